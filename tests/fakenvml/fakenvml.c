/*
 * A fake libnvidia-ml.so.1 for tests: the real pynvml loads it and gets GPUs whose state comes from a
 * JSON file named by $FAKE_NVML_STATE, re-read whenever it changes, so a test can change a GPU under
 * a running agent. Prototypes are declared here from NVML's public documentation; nothing of NVIDIA's
 * header is copied. Only what the agent calls is implemented; everything else is absent, which pynvml
 * reports as NVML_ERROR_FUNCTION_NOT_FOUND.
 *
 * State (all keys optional):
 * {"driver_loaded": true, "driver_version": "550.90.07",
 *  "gpus": [{"uuid": "GPU-...", "pci": "00000000:18:00.0", "name": "NVIDIA H100 80GB HBM3", "mig_mode": 0,
 *            "temp": 40, "mem_temp": 45,
 *            "thresholds": {"shutdown": 92, "slowdown": 90, "mem_max": 95, "gpu_max": 87},
 *            "power_mw": 100000, "power_limit_mw": 700000, "clocks_event_reasons": 0,
 *            "ecc": {"sbe_volatile": 0, "dbe_volatile": 0, "sbe_aggregate": 0, "dbe_aggregate": 0},
 *            "retired_pages": {"sbe": 0, "dbe": 0, "pending": 0},
 *            "remapped_rows": {"corr": 0, "unc": 0, "pending": 0, "failure": 0},
 *            "recovery_action": 0,
 *            "nvlink": {"links": 18, "down": [3], "crc_flit": 0, "crc_data": 0, "replay": 0, "recovery": 0,
 *                       "ecc_data": 0},
 *            "pcie": {"replay": 0, "gen": 5, "max_gen": 5, "width": 16, "max_width": 16},
 *            "utilization": {"gpu": 0, "memory": 0},
 *            "lost": false,
 *            "errors": {"nvmlDeviceGetPowerUsage": 3},
 *            "fail_all": 16,
 *            "sram": {"threshold_exceeded": 0, "volatile_unc_parity": 0, "volatile_unc_secded": 0},
 *            "hang": ["nvmlDeviceGetTemperatureV"], "hang_all": false}],
 *  "events": [{"id": 1, "gpu": 3, "type": 8, "data": 79, "gi": 4294967295, "ci": 4294967295}]}
 * A value of null for "retired_pages", "remapped_rows", "ecc" or "nvlink" makes those calls NotSupported;
 * so does a missing "sram" for nvmlDeviceGetSramEccErrorStatus.
 * "fail_all": every device call on that GPU returns this NVML error (16: a GPU that requires a reset).
 * nvmlDeviceGetFieldValues, as NVML documents it, answers NVML_SUCCESS and carries each field's own status:
 * an error that "fail_all" or "errors" gives it lands in every field's nvmlReturn, not in the call's.
 * "ecc_mode": {"current": 1, "pending": 1} (default both on); with current 0 the ECC counters, remapped
 * rows and retired pages read NotSupported, as on a real GPU with ECC off. "memory_bus_width": bits
 * (default 5120, HBM3; null: NotSupported).
 * "fabric": {"state": 3, "status": 0, "health_mask": 0, "health_summary": 1, "clique_id": 1, "version": 3,
 *            "cluster_uuid": "c0c1c2c3c4c5c6c7c8c9cacbcccdcecf"}
 * answers nvmlDeviceGetGpuFabricInfoV (state 3 Completed; status an NVML return code); absent or null
 * is NotSupported (a PCIe-only GPU); "version": 2 is a driver that takes only the v2 struct. The cluster
 * UUID (32 hex digits, default c0..cf) is reported only once the registration completed (state 3): before
 * it the GPU belongs to no fabric cluster and NVML's clusterUuid is all zero.
 * A call named in "hang" blocks until the state no longer names it; with "hang_all": true every device call
 * of that GPU blocks until it is false again (a GPU whose GSP firmware stopped answering: no call returns).
 */
#define _GNU_SOURCE
#include <ctype.h>
#include <stddef.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* ---- NVML types and values, declared from the public API documentation ---- */
typedef int nvmlReturn_t;
enum {
    NVML_SUCCESS = 0, NVML_ERROR_UNINITIALIZED = 1, NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3, NVML_ERROR_INSUFFICIENT_SIZE = 7, NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_TIMEOUT = 10, NVML_ERROR_GPU_IS_LOST = 15, NVML_ERROR_UNKNOWN = 999
};
typedef struct fake_device *nvmlDevice_t;
typedef struct fake_event_set *nvmlEventSet_t;

typedef struct {
    char busIdLegacy[16];
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

typedef struct { unsigned int version; int sensorType; int temperature; } nvmlTemperature_t;
typedef struct { unsigned int gpu, memory; } nvmlUtilization_t;

typedef union {
    double dVal; unsigned int uiVal; unsigned long ulVal; unsigned long long ullVal;
    long long sllVal; int siVal; unsigned short usVal;
} nvmlValue_t;

typedef struct {
    unsigned int fieldId, scopeId;
    long long timestamp, latencyUsec;
    int valueType;
    nvmlReturn_t nvmlReturn;
    nvmlValue_t value;
} nvmlFieldValue_t;

typedef struct {
    nvmlDevice_t device;
    unsigned long long eventType, eventData;
    unsigned int gpuInstanceId, computeInstanceId;
} nvmlEventData_t;

/* ---- a small JSON reader ---- */
typedef enum { J_NULL, J_BOOL, J_NUM, J_STR, J_ARR, J_OBJ } jtype;
typedef struct jnode {
    jtype type;
    double num;
    char *str;
    struct jnode **items;
    char **keys;
    int count;
} jnode;

static const char *jp;

static void skip_ws(void) { while (*jp && isspace((unsigned char)*jp)) jp++; }
static jnode *jparse(void);

static jnode *jnew(jtype t) { jnode *n = calloc(1, sizeof(jnode)); n->type = t; return n; }

static char *jstring(void) {
    size_t cap = 32, len = 0;
    char *out = malloc(cap);
    jp++;
    while (*jp && *jp != '"') {
        char c = *jp++;
        if (c == '\\' && *jp) {
            c = *jp++;
            if (c == 'n') c = '\n'; else if (c == 't') c = '\t';
            else if (c == 'u') { for (int i = 0; i < 4 && *jp; i++) jp++; c = '?'; }
        }
        if (len + 2 > cap) { cap *= 2; out = realloc(out, cap); }
        out[len++] = c;
    }
    if (*jp == '"') jp++;
    out[len] = 0;
    return out;
}

static jnode *jparse(void) {
    skip_ws();
    if (*jp == '{' || *jp == '[') {
        int object = *jp == '{';
        jnode *n = jnew(object ? J_OBJ : J_ARR);
        jp++;
        for (;;) {
            skip_ws();
            if (*jp == '}' || *jp == ']') { jp++; break; }
            if (!*jp) break;
            char *key = NULL;
            if (object) {
                if (*jp != '"') break;
                key = jstring();
                skip_ws();
                if (*jp == ':') jp++;
            }
            jnode *child = jparse();
            n->items = realloc(n->items, sizeof(jnode *) * (n->count + 1));
            n->keys = realloc(n->keys, sizeof(char *) * (n->count + 1));
            n->items[n->count] = child;
            n->keys[n->count] = key;
            n->count++;
            skip_ws();
            if (*jp == ',') jp++;
        }
        return n;
    }
    if (*jp == '"') { jnode *n = jnew(J_STR); n->str = jstring(); return n; }
    if (!strncmp(jp, "true", 4)) { jp += 4; jnode *n = jnew(J_BOOL); n->num = 1; return n; }
    if (!strncmp(jp, "false", 5)) { jp += 5; return jnew(J_BOOL); }
    if (!strncmp(jp, "null", 4)) { jp += 4; return jnew(J_NULL); }
    char *end;
    double v = strtod(jp, &end);
    if (end == jp) { if (*jp) jp++; return jnew(J_NULL); }
    jp = end;
    jnode *n = jnew(J_NUM);
    n->num = v;
    return n;
}

static void jfree(jnode *n) {
    if (!n) return;
    for (int i = 0; i < n->count; i++) { jfree(n->items[i]); free(n->keys ? n->keys[i] : NULL); }
    free(n->items); free(n->keys); free(n->str); free(n);
}

static jnode *jget(jnode *n, const char *key) {
    if (!n || n->type != J_OBJ) return NULL;
    for (int i = 0; i < n->count; i++) if (n->keys[i] && !strcmp(n->keys[i], key)) return n->items[i];
    return NULL;
}

static double jnum(jnode *n, const char *key, double fallback) {
    jnode *v = jget(n, key);
    return v && (v->type == J_NUM || v->type == J_BOOL) ? v->num : fallback;
}

static const char *jstr(jnode *n, const char *key, const char *fallback) {
    jnode *v = jget(n, key);
    return v && v->type == J_STR ? v->str : fallback;
}

/* ---- state ---- */
#define MAX_GPUS 64
struct fake_device { int index; };
struct fake_event_set { unsigned long long masks[MAX_GPUS]; unsigned long long delivered; };

static struct fake_device devices[MAX_GPUS];
#define MIG_BASE 1000
#define MAX_MIG 8
static struct fake_device mig_devices[MAX_GPUS * MAX_MIG];
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static jnode *state;
static struct timespec state_mtime;
static off_t state_size;
static int initialised;

static void reload_locked(void) {
    const char *path = getenv("FAKE_NVML_STATE");
    struct stat st;
    if (!path || stat(path, &st) != 0) return;
    if (state && st.st_mtim.tv_sec == state_mtime.tv_sec && st.st_mtim.tv_nsec == state_mtime.tv_nsec &&
        st.st_size == state_size) return;
    FILE *f = fopen(path, "r");
    if (!f) return;
    char *text = calloc(1, st.st_size + 1);
    size_t got = fread(text, 1, st.st_size, f);
    fclose(f);
    text[got] = 0;
    if (got == 0) { free(text); return; }  /* a writer is mid-way: keep the last state */
    jp = text;
    jnode *fresh = jparse();
    free(text);
    jfree(state);
    state = fresh;
    state_mtime = st.st_mtim;
    state_size = st.st_size;
}

static jnode *gpus_locked(void) { jnode *g = jget(state, "gpus"); return g && g->type == J_ARR ? g : NULL; }

static jnode *gpu_locked(nvmlDevice_t device) {
    jnode *gpus = gpus_locked();
    if (!device || !gpus) return NULL;
    int i = device->index;
    return i >= 0 && i < gpus->count ? gpus->items[i] : NULL;
}

static int names(jnode *list, const char *call) {
    if (!list || list->type != J_ARR) return 0;
    for (int i = 0; i < list->count; i++)
        if (list->items[i]->type == J_STR && !strcmp(list->items[i]->str, call)) return 1;
    return 0;
}

/* Every device call starts here: reload, hang if asked, then lost / injected error / ok. */
static nvmlReturn_t enter(nvmlDevice_t device, const char *call, jnode **gpu_out) {
    for (;;) {
        pthread_mutex_lock(&lock);
        reload_locked();
        if (!initialised) { pthread_mutex_unlock(&lock); return NVML_ERROR_UNINITIALIZED; }
        jnode *gpu = gpu_locked(device);
        if (!gpu) { pthread_mutex_unlock(&lock); return NVML_ERROR_INVALID_ARGUMENT; }
        if (jnum(gpu, "hang_all", 0) || names(jget(gpu, "hang"), call)) {
            pthread_mutex_unlock(&lock); usleep(20000); continue;
        }
        if (jnum(gpu, "lost", 0)) { pthread_mutex_unlock(&lock); return NVML_ERROR_GPU_IS_LOST; }
        double failing = jnum(gpu, "fail_all", 0);
        if (failing) { pthread_mutex_unlock(&lock); return (nvmlReturn_t)failing; }
        jnode *errors = jget(gpu, "errors");
        double injected = jnum(errors, call, 0);
        if (injected) { pthread_mutex_unlock(&lock); return (nvmlReturn_t)injected; }
        *gpu_out = gpu;
        return NVML_SUCCESS; /* the caller unlocks */
    }
}

#define ENTER(call)                                                   \
    jnode *gpu = NULL;                                                \
    nvmlReturn_t status = enter(device, call, &gpu);                  \
    if (status != NVML_SUCCESS) return status;
#define LEAVE(value) do { pthread_mutex_unlock(&lock); return (value); } while (0)

static void copy_out(char *out, unsigned int size, const char *text) {
    if (!out || size == 0) return;
    size_t n = strlen(text);
    if (n >= size) n = size - 1;
    memcpy(out, text, n);
    out[n] = 0;
}

/* ---- the API ---- */
nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    pthread_mutex_lock(&lock);
    reload_locked();
    if (!state || !jnum(state, "driver_loaded", 1)) { pthread_mutex_unlock(&lock); return NVML_ERROR_DRIVER_NOT_LOADED; }
    for (int i = 0; i < MAX_GPUS; i++) devices[i].index = i;
    for (int i = 0; i < MAX_GPUS * MAX_MIG; i++) mig_devices[i].index = MIG_BASE + i;
    initialised++;
    pthread_mutex_unlock(&lock);
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
nvmlReturn_t nvmlInit(void) { return nvmlInitWithFlags(0); }

nvmlReturn_t nvmlShutdown(void) {
    pthread_mutex_lock(&lock);
    if (initialised) initialised--;
    pthread_mutex_unlock(&lock);
    return NVML_SUCCESS;
}

const char *nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    default: return "Unknown Error";
    }
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    pthread_mutex_lock(&lock);
    reload_locked();
    copy_out(version, length, jstr(state, "driver_version", "550.90.07"));
    pthread_mutex_unlock(&lock);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    pthread_mutex_lock(&lock);
    reload_locked();
    if (!initialised) { pthread_mutex_unlock(&lock); return NVML_ERROR_UNINITIALIZED; }
    jnode *gpus = gpus_locked();
    *count = gpus ? (unsigned int)(gpus->count < MAX_GPUS ? gpus->count : MAX_GPUS) : 0;
    pthread_mutex_unlock(&lock);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    unsigned int count = 0;
    nvmlReturn_t status = nvmlDeviceGetCount_v2(&count);
    if (status != NVML_SUCCESS) return status;
    if (index >= count) return NVML_ERROR_INVALID_ARGUMENT;
    *device = &devices[index];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index) {
    ENTER("nvmlDeviceGetIndex");
    *index = (unsigned int)device->index;
    LEAVE(NVML_SUCCESS);
}

/* "mig_devices": ["MIG-...", ...]: the GPU's MIG devices (their handles answer GetUUID only) */
nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t device, unsigned int *count) {
    ENTER("nvmlDeviceGetMaxMigDeviceCount");
    *count = jnum(gpu, "mig_mode", 0) ? 7 : 0;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t device, unsigned int index, nvmlDevice_t *mig) {
    ENTER("nvmlDeviceGetMigDeviceHandleByIndex");
    jnode *list = jget(gpu, "mig_devices");
    if (!list || list->type != J_ARR || index >= (unsigned int)list->count || index >= MAX_MIG) LEAVE(6);
    *mig = &mig_devices[device->index * MAX_MIG + (int)index];
    LEAVE(NVML_SUCCESS);
}

static nvmlReturn_t mig_uuid(nvmlDevice_t device, char *uuid, unsigned int length) {
    pthread_mutex_lock(&lock);
    reload_locked();
    int slot = device->index - MIG_BASE;
    jnode *gpus = gpus_locked();
    jnode *gpu = gpus && slot / MAX_MIG < gpus->count ? gpus->items[slot / MAX_MIG] : NULL;
    jnode *list = jget(gpu, "mig_devices");
    if (!list || list->type != J_ARR || slot % MAX_MIG >= list->count) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    copy_out(uuid, length, list->items[slot % MAX_MIG]->type == J_STR ? list->items[slot % MAX_MIG]->str : "");
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    if (device && device->index >= MIG_BASE) return mig_uuid(device, uuid, length);
    ENTER("nvmlDeviceGetUUID");
    char fallback[64];
    snprintf(fallback, sizeof fallback, "GPU-00000000-0000-0000-0000-%012d", device->index);
    copy_out(uuid, length, jstr(gpu, "uuid", fallback));
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    ENTER("nvmlDeviceGetName");
    copy_out(name, length, jstr(gpu, "name", "NVIDIA H100 80GB HBM3"));
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci) {
    ENTER("nvmlDeviceGetPciInfo_v3");
    memset(pci, 0, sizeof *pci);
    char fallback[32];
    snprintf(fallback, sizeof fallback, "00000000:%02X:00.0", 0x18 + device->index);
    const char *bus_id = jstr(gpu, "pci", fallback);
    copy_out(pci->busId, sizeof pci->busId, bus_id);
    copy_out(pci->busIdLegacy, sizeof pci->busIdLegacy, bus_id);
    unsigned int domain = 0, bus = 0, dev = 0;
    sscanf(bus_id, "%x:%x:%x", &domain, &bus, &dev);
    pci->domain = domain; pci->bus = bus; pci->device = dev; pci->pciDeviceId = 0x233010de;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *current, unsigned int *pending) {
    ENTER("nvmlDeviceGetMigMode");
    *current = *pending = (unsigned int)jnum(gpu, "mig_mode", 0);
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetTemperatureV(nvmlDevice_t device, nvmlTemperature_t *temperature) {
    ENTER("nvmlDeviceGetTemperatureV");
    temperature->temperature = (int)jnum(gpu, "temp", 40);
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device, int sensor, unsigned int *temp) {
    (void)sensor;
    ENTER("nvmlDeviceGetTemperature");
    *temp = (unsigned int)jnum(gpu, "temp", 40);
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetTemperatureThreshold(nvmlDevice_t device, int type, unsigned int *temp) {
    ENTER("nvmlDeviceGetTemperatureThreshold");
    static const char *keys[] = {"shutdown", "slowdown", "mem_max", "gpu_max"};
    static const double defaults[] = {92, 90, 95, 87};
    if (type < 0 || type > 3) LEAVE(NVML_ERROR_NOT_SUPPORTED);
    jnode *thresholds = jget(gpu, "thresholds");
    *temp = (unsigned int)jnum(thresholds, keys[type], defaults[type]);
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t device, unsigned int *power) {
    ENTER("nvmlDeviceGetPowerUsage");
    *power = (unsigned int)jnum(gpu, "power_mw", 100000);
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetEnforcedPowerLimit(nvmlDevice_t device, unsigned int *limit) {
    ENTER("nvmlDeviceGetEnforcedPowerLimit");
    *limit = (unsigned int)jnum(gpu, "power_limit_mw", 700000);
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t device, unsigned long long *reasons) {
    ENTER("nvmlDeviceGetCurrentClocksEventReasons");
    *reasons = (unsigned long long)jnum(gpu, "clocks_event_reasons", 0);
    LEAVE(NVML_SUCCESS);
}

static int ecc_off(jnode *gpu) {
    jnode *mode = jget(gpu, "ecc_mode");
    return mode && mode->type == J_OBJ && !jnum(mode, "current", 1);
}

nvmlReturn_t nvmlDeviceGetEccMode(nvmlDevice_t device, int *current, int *pending) {
    ENTER("nvmlDeviceGetEccMode");
    jnode *ecc = jget(gpu, "ecc");
    if (ecc && ecc->type == J_NULL) LEAVE(NVML_ERROR_NOT_SUPPORTED);
    jnode *mode = jget(gpu, "ecc_mode");
    *current = (int)jnum(mode, "current", 1);
    *pending = (int)jnum(mode, "pending", *current);
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetMemoryBusWidth(nvmlDevice_t device, unsigned int *bits) {
    ENTER("nvmlDeviceGetMemoryBusWidth");
    jnode *width = jget(gpu, "memory_bus_width");
    if (width && width->type == J_NULL) LEAVE(NVML_ERROR_NOT_SUPPORTED);
    *bits = (unsigned int)jnum(gpu, "memory_bus_width", 5120);
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t device, int error_type, int counter_type,
                                         unsigned long long *count) {
    ENTER("nvmlDeviceGetTotalEccErrors");
    jnode *ecc = jget(gpu, "ecc");
    if ((ecc && ecc->type == J_NULL) || ecc_off(gpu)) LEAVE(NVML_ERROR_NOT_SUPPORTED);
    const char *key = error_type == 0 ? (counter_type == 0 ? "sbe_volatile" : "sbe_aggregate")
                                      : (counter_type == 0 ? "dbe_volatile" : "dbe_aggregate");
    *count = (unsigned long long)jnum(ecc, key, 0);
    LEAVE(NVML_SUCCESS);
}

/* "ecc": {"locations": {"2": 1, ...}}: uncorrected volatile counts per memory location */
nvmlReturn_t nvmlDeviceGetMemoryErrorCounter(nvmlDevice_t device, int error_type, int counter_type, int location,
                                             unsigned long long *count) {
    ENTER("nvmlDeviceGetMemoryErrorCounter");
    jnode *ecc = jget(gpu, "ecc");
    if ((ecc && ecc->type == J_NULL) || ecc_off(gpu)) LEAVE(NVML_ERROR_NOT_SUPPORTED);
    char key[8];
    snprintf(key, sizeof key, "%d", location);
    *count = error_type == 1 && counter_type == 0 ? (unsigned long long)jnum(jget(ecc, "locations"), key, 0) : 0;
    LEAVE(NVML_SUCCESS);
}

/* timestamps (v2 only): "sbe_timestamps" / "dbe_timestamps" lists (seconds since the epoch), else "now" */
static nvmlReturn_t retired_pages(nvmlDevice_t device, const char *call, int cause, unsigned int *count,
                                  unsigned long long *addresses, unsigned long long *timestamps) {
    ENTER(call);
    jnode *pages = jget(gpu, "retired_pages");
    if (!pages || pages->type == J_NULL || ecc_off(gpu)) LEAVE(NVML_ERROR_NOT_SUPPORTED);
    unsigned int have = (unsigned int)jnum(pages, cause == 0 ? "sbe" : "dbe", 0);
    if (!addresses || *count < have) { *count = have; LEAVE(have ? NVML_ERROR_INSUFFICIENT_SIZE : NVML_SUCCESS); }
    jnode *times = jget(pages, cause == 0 ? "sbe_timestamps" : "dbe_timestamps");
    for (unsigned int i = 0; i < have; i++) {
        addresses[i] = 0x1000ULL * (i + 1) + (unsigned long long)cause;
        if (timestamps) {
            int listed = times && times->type == J_ARR && (int)i < times->count;
            timestamps[i] = listed ? (unsigned long long)times->items[i]->num : (unsigned long long)time(NULL);
        }
    }
    *count = have;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetRetiredPages(nvmlDevice_t device, int cause, unsigned int *count,
                                       unsigned long long *addresses) {
    return retired_pages(device, "nvmlDeviceGetRetiredPages", cause, count, addresses, NULL);
}

nvmlReturn_t nvmlDeviceGetRetiredPages_v2(nvmlDevice_t device, int cause, unsigned int *count,
                                          unsigned long long *addresses, unsigned long long *timestamps) {
    return retired_pages(device, "nvmlDeviceGetRetiredPages_v2", cause, count, addresses, timestamps);
}

typedef struct { unsigned int pid; unsigned long long usedGpuMemory; unsigned int gpuInstanceId, computeInstanceId; }
    nvmlProcessInfo_t;

static nvmlReturn_t running_processes(nvmlDevice_t device, const char *call, const char *key, unsigned int *count,
                                      nvmlProcessInfo_t *infos);

/* "processes": [pid, ...] with a compute context on the GPU */
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *count,
                                                     nvmlProcessInfo_t *infos) {
    return running_processes(device, "nvmlDeviceGetComputeRunningProcesses_v3", "processes", count, infos);
}

/* "graphics_processes": [pid, ...] with a graphics context on the GPU */
nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t device, unsigned int *count,
                                                      nvmlProcessInfo_t *infos) {
    return running_processes(device, "nvmlDeviceGetGraphicsRunningProcesses_v3", "graphics_processes", count, infos);
}

static nvmlReturn_t running_processes(nvmlDevice_t device, const char *call, const char *key, unsigned int *count,
                                      nvmlProcessInfo_t *infos) {
    ENTER(call);
    jnode *procs = jget(gpu, key);
    unsigned int have = procs && procs->type == J_ARR ? (unsigned int)procs->count : 0;
    if (!infos || *count < have) { *count = have; LEAVE(have ? NVML_ERROR_INSUFFICIENT_SIZE : NVML_SUCCESS); }
    for (unsigned int i = 0; i < have; i++) {
        infos[i].pid = (unsigned int)procs->items[i]->num;
        infos[i].usedGpuMemory = 1ULL << 30;
        infos[i].gpuInstanceId = infos[i].computeInstanceId = 0xFFFFFFFFu;
    }
    *count = have;
    LEAVE(NVML_SUCCESS);
}

/* nvmlEccSramErrorStatus_v1_t as nvml.h lays it out; the version must be nvmlEccSramErrorStatus_v1. */
typedef struct {
    unsigned int version;
    unsigned long long aggregateUncParity, aggregateUncSecDed, aggregateCor, volatileUncParity, volatileUncSecDed,
        volatileCor, aggregateUncBucketL2, aggregateUncBucketSm, aggregateUncBucketPcie, aggregateUncBucketMcu,
        aggregateUncBucketOther;
    unsigned int bThresholdExceeded;
} fake_sram_status_t;
#define FAKE_SRAM_STATUS_V1 0x1000068u
#define NVML_ERROR_ARGUMENT_VERSION_MISMATCH 25

nvmlReturn_t nvmlDeviceGetSramEccErrorStatus(nvmlDevice_t device, fake_sram_status_t *out) {
    ENTER("nvmlDeviceGetSramEccErrorStatus");
    jnode *sram = jget(gpu, "sram");
    if (!sram || sram->type != J_OBJ) LEAVE(NVML_ERROR_NOT_SUPPORTED);
    if (!out) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    if (out->version != FAKE_SRAM_STATUS_V1) LEAVE(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    unsigned int version = out->version;
    memset(out, 0, sizeof(*out));
    out->version = version;
    out->volatileUncParity = (unsigned long long)jnum(sram, "volatile_unc_parity", 0);
    out->volatileUncSecDed = (unsigned long long)jnum(sram, "volatile_unc_secded", 0);
    out->aggregateUncParity = (unsigned long long)jnum(sram, "aggregate_unc_parity", 0);
    out->aggregateUncSecDed = (unsigned long long)jnum(sram, "aggregate_unc_secded", 0);
    out->bThresholdExceeded = (unsigned int)jnum(sram, "threshold_exceeded", 0);
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetRetiredPagesPendingStatus(nvmlDevice_t device, int *pending) {
    ENTER("nvmlDeviceGetRetiredPagesPendingStatus");
    jnode *pages = jget(gpu, "retired_pages");
    if (!pages || pages->type == J_NULL || ecc_off(gpu)) LEAVE(NVML_ERROR_NOT_SUPPORTED);
    *pending = (int)jnum(pages, "pending", 0);
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t device, unsigned int *corr, unsigned int *unc,
                                       unsigned int *pending, unsigned int *failure) {
    ENTER("nvmlDeviceGetRemappedRows");
    jnode *rows = jget(gpu, "remapped_rows");
    if ((rows && rows->type == J_NULL) || ecc_off(gpu)) LEAVE(NVML_ERROR_NOT_SUPPORTED);
    *corr = (unsigned int)jnum(rows, "corr", 0);
    *unc = (unsigned int)jnum(rows, "unc", 0);
    *pending = (unsigned int)jnum(rows, "pending", 0);
    *failure = (unsigned int)jnum(rows, "failure", 0);
    LEAVE(NVML_SUCCESS);
}

static double field_value(jnode *gpu, unsigned int field, int *supported) {
    jnode *nvlink = jget(gpu, "nvlink");
    jnode *pcie = jget(gpu, "pcie");
    *supported = 1;
    switch (field) {
    case 230: return jnum(gpu, "recovery_action", 0);
    case 82: return jnum(gpu, "mem_temp", 45);
    case 94: return jnum(pcie, "replay", 0);
    case 38: case 45: case 52: case 59: case 160:
        if (nvlink && nvlink->type == J_NULL) { *supported = 0; return 0; }
        return jnum(nvlink, field == 38 ? "crc_flit" : field == 45 ? "crc_data" : field == 52 ? "replay"
                          : field == 59 ? "recovery" : "ecc_data", 0);
    default: *supported = 0; return 0;
    }
}

nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t device, int count, nvmlFieldValue_t *values) {
    jnode *gpu = NULL;
    nvmlReturn_t status = enter(device, "nvmlDeviceGetFieldValues", &gpu);
    if (status == NVML_ERROR_UNINITIALIZED || status == NVML_ERROR_INVALID_ARGUMENT ||
        status == NVML_ERROR_GPU_IS_LOST)
        return status;
    if (status != NVML_SUCCESS) { /* the call answers; each field says it failed (the lock is not held) */
        for (int i = 0; i < count; i++) {
            values[i].timestamp = (long long)time(NULL) * 1000000LL;
            values[i].latencyUsec = 0;
            values[i].valueType = 3;
            values[i].nvmlReturn = status;
            values[i].value.ullVal = 0;
        }
        return NVML_SUCCESS;
    }
    for (int i = 0; i < count; i++) {
        int supported = 0;
        double v = field_value(gpu, values[i].fieldId, &supported);
        values[i].timestamp = (long long)time(NULL) * 1000000LL;
        values[i].latencyUsec = 0;
        values[i].valueType = 3; /* unsigned long long */
        values[i].nvmlReturn = supported ? NVML_SUCCESS : NVML_ERROR_NOT_SUPPORTED;
        values[i].value.ullVal = (unsigned long long)v;
    }
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t device, unsigned int link, int *active) {
    ENTER("nvmlDeviceGetNvLinkState");
    jnode *nvlink = jget(gpu, "nvlink");
    if (nvlink && nvlink->type == J_NULL) LEAVE(NVML_ERROR_NOT_SUPPORTED);
    if (link >= (unsigned int)jnum(nvlink, "links", 18)) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    jnode *down = jget(nvlink, "down");
    *active = 1;
    for (int i = 0; down && down->type == J_ARR && i < down->count; i++)
        if ((unsigned int)down->items[i]->num == link) *active = 0;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetPcieReplayCounter(nvmlDevice_t device, unsigned int *value) {
    ENTER("nvmlDeviceGetPcieReplayCounter");
    *value = (unsigned int)jnum(jget(gpu, "pcie"), "replay", 0);
    LEAVE(NVML_SUCCESS);
}

static nvmlReturn_t pcie_value(nvmlDevice_t device, const char *call, const char *key, double fallback,
                               unsigned int *out) {
    ENTER(call);
    *out = (unsigned int)jnum(jget(gpu, "pcie"), key, fallback);
    LEAVE(NVML_SUCCESS);
}
nvmlReturn_t nvmlDeviceGetCurrPcieLinkWidth(nvmlDevice_t d, unsigned int *v) {
    return pcie_value(d, "nvmlDeviceGetCurrPcieLinkWidth", "width", 16, v);
}
nvmlReturn_t nvmlDeviceGetMaxPcieLinkWidth(nvmlDevice_t d, unsigned int *v) {
    return pcie_value(d, "nvmlDeviceGetMaxPcieLinkWidth", "max_width", 16, v);
}
nvmlReturn_t nvmlDeviceGetCurrPcieLinkGeneration(nvmlDevice_t d, unsigned int *v) {
    return pcie_value(d, "nvmlDeviceGetCurrPcieLinkGeneration", "gen", 5, v);
}
nvmlReturn_t nvmlDeviceGetMaxPcieLinkGeneration(nvmlDevice_t d, unsigned int *v) {
    return pcie_value(d, "nvmlDeviceGetMaxPcieLinkGeneration", "max_gen", 5, v);
}

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *utilization) {
    ENTER("nvmlDeviceGetUtilizationRates");
    jnode *u = jget(gpu, "utilization");
    utilization->gpu = (unsigned int)jnum(u, "gpu", 0);
    utilization->memory = (unsigned int)jnum(u, "memory", 0);
    LEAVE(NVML_SUCCESS);
}

/* nvmlGpuFabricInfo_v2_t / _v3_t as the public NVML documentation lays them out; version = (v << 24) | size. */
typedef struct {
    unsigned int version;
    unsigned char clusterUuid[16];
    nvmlReturn_t status;
    unsigned int cliqueId;
    unsigned int state;
    unsigned int healthMask;
    unsigned char healthSummary; /* v3 only */
} fake_fabric_info_t;
#define FAKE_FABRIC_V2 0x02000024u
#define FAKE_FABRIC_V3 0x03000028u

nvmlReturn_t nvmlDeviceGetGpuFabricInfoV(nvmlDevice_t device, fake_fabric_info_t *info) {
    ENTER("nvmlDeviceGetGpuFabricInfoV");
    jnode *fabric = jget(gpu, "fabric");
    if (!fabric || fabric->type != J_OBJ) LEAVE(NVML_ERROR_NOT_SUPPORTED);
    if (!info) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    int newest = (int)jnum(fabric, "version", 3);
    unsigned int version = info->version;
    if (version != FAKE_FABRIC_V2 && !(version == FAKE_FABRIC_V3 && newest >= 3))
        LEAVE(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    memset(info, 0, version == FAKE_FABRIC_V3 ? sizeof(*info) : offsetof(fake_fabric_info_t, healthSummary));
    info->version = version;
    info->status = (nvmlReturn_t)jnum(fabric, "status", 0);
    info->cliqueId = (unsigned int)jnum(fabric, "clique_id", 1);
    info->state = (unsigned int)jnum(fabric, "state", 3);
    if (info->state == 3) {
        const char *hex = jstr(fabric, "cluster_uuid", "c0c1c2c3c4c5c6c7c8c9cacbcccdcecf");
        for (int i = 0; i < 16; i++) {
            unsigned int byte = 0;
            if (strlen(hex) >= 32 && sscanf(hex + 2 * i, "%2x", &byte) == 1) info->clusterUuid[i] = (unsigned char)byte;
            else info->clusterUuid[i] = (unsigned char)(0xc0 + i);
        }
    }
    info->healthMask = (unsigned int)jnum(fabric, "health_mask", 0);
    if (version == FAKE_FABRIC_V3) info->healthSummary = (unsigned char)jnum(fabric, "health_summary", 0);
    LEAVE(NVML_SUCCESS);
}

/* ---- events ---- */
#ifndef FAKE_EVENT_POLL_MS
#define FAKE_EVENT_POLL_MS 20
#endif
nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    *set = calloc(1, sizeof(struct fake_event_set));
    return *set ? NVML_SUCCESS : NVML_ERROR_UNKNOWN;
}

nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set) { free(set); return NVML_SUCCESS; }

nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t device, unsigned long long *types) {
    ENTER("nvmlDeviceGetSupportedEventTypes");
    *types = 0x1ULL | 0x2ULL | 0x8ULL | 0x4000ULL | 0x8000ULL;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long types, nvmlEventSet_t set) {
    ENTER("nvmlDeviceRegisterEvents");
    set->masks[device->index] |= types;
    LEAVE(NVML_SUCCESS);
}

/* Delivers queued events in id order, each once per set; waits up to the timeout for a new one. */
nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeout_ms) {
    long waited = 0;
    for (;;) {
        pthread_mutex_lock(&lock);
        reload_locked();
        jnode *events = jget(state, "events");
        jnode *gpus = gpus_locked();
        jnode *best = NULL;
        unsigned long long best_id = 0;
        for (int i = 0; events && events->type == J_ARR && i < events->count; i++) {
            jnode *e = events->items[i];
            unsigned long long id = (unsigned long long)jnum(e, "id", 0);
            int index = (int)jnum(e, "gpu", 0);
            if (id <= set->delivered || index < 0 || index >= MAX_GPUS || !gpus || index >= gpus->count) continue;
            if (!(set->masks[index] & (unsigned long long)jnum(e, "type", 0))) continue;
            if (!best || id < best_id) { best = e; best_id = id; }
        }
        if (best) {
            set->delivered = best_id;
            data->device = &devices[(int)jnum(best, "gpu", 0)];
            data->eventType = (unsigned long long)jnum(best, "type", 0);
            data->eventData = (unsigned long long)jnum(best, "data", 0);
            data->gpuInstanceId = (unsigned int)jnum(best, "gi", 4294967295.0);
            data->computeInstanceId = (unsigned int)jnum(best, "ci", 4294967295.0);
            pthread_mutex_unlock(&lock);
            return NVML_SUCCESS;
        }
        pthread_mutex_unlock(&lock);
        if (waited >= (long)timeout_ms) return NVML_ERROR_TIMEOUT;
        /* A real driver sleeps in the kernel until an event comes; the fake looks at its file now and then. */
        usleep(FAKE_EVENT_POLL_MS * 1000);
        waited += FAKE_EVENT_POLL_MS;
    }
}
