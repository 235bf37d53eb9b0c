"""The NVML source's readings of one GPU's links: NVLink state, the PCIe link (width; generation while busy)
and the GPU fabric (NVSwitch / NVL72 registration and health). Each appends its observations to `out`."""

from __future__ import annotations

import ctypes
import uuid
from fnmatch import fnmatchcase
from typing import Any

from agent.model import AttrValue, Observation, Signal
from agent.sources.node_memory import NodeMemory
from agent.sources.nvml_calls import (
    ERROR_ARGUMENT_VERSION_MISMATCH,
    ERROR_GPU_IS_LOST,
    ERROR_INVALID_ARGUMENT,
    NOT_SUPPORTED_CODES,
    GpuLost,
    GpuState,
    NvmlCalls,
    observation,
    text,
)

MAX_NVLINKS = 18
#: The NVLinks a GPU of these models has up on its baseboard (HGX / DGX, GB200 NVL): every link of an SXM
#: GPU is wired to the NVSwitches (or, on GB200, the NVLink switch trays). A PCIe card (H100 PCIe, H100 NVL,
#: H200 NVL: bridges optional) and an unlisted model are judged against their peers only.
EXPECTED_NVLINKS: tuple[tuple[str, int], ...] = (
    ("*H100 PCIe*", 0), ("*H100 NVL*", 0), ("*H200 NVL*", 0), ("*H100*", 18), ("*H200*", 18), ("*H20*", 18),
    ("*H800 PCIe*", 0), ("*H800*", 8), ("*GB200*", 18), ("*B200*", 18), ("*A100-SXM*", 12), ("*A800-SXM*", 8))
NVLINK_KEY = "nvml.nvlinks_seen_up"
#: GPU utilisation (percent) from which the PCIe link generation is meaningful: an idle GPU lowers it to
#: save power, a busy one runs at the highest generation the link trained to.
BUSY_PERCENT = 50
FABRIC_STATES = {0: "NotSupported", 1: "NotStarted", 2: "InProgress", 3: "Completed"}
FABRIC_STATE_NOT_SUPPORTED = 0
#: nvmlGpuFabricInfo_v3 / _v2: (struct version << 24) | struct size.
FABRIC_INFO_VERSIONS = {3: "c_nvmlGpuFabricInfo_v3_t", 2: "c_nvmlGpuFabricInfo_v2_t"}
#: The health mask's two-bit flags (1 true, 2 false, 0 not supported), by the shift NVML documents.
FABRIC_HEALTH_FLAGS = {"degraded_bandwidth": 0, "route_recovery": 2, "route_unhealthy": 4,
                       "access_timeout_recovery": 6}
FABRIC_CONFIG_SHIFT, FABRIC_CONFIG_WIDTH = 8, 0xF
FABRIC_CONFIGS = {1: "none", 2: "incorrect system GUID", 3: "incorrect chassis serial number",
                  4: "no partition", 5: "insufficient NVLinks", 6: "incompatible GPU firmware",
                  7: "invalid location", 8: "GPU state invalid"}
FABRIC_SUMMARIES = {1: "healthy", 2: "unhealthy", 3: "limited capacity"}


def expected_nvlinks(gpu: GpuState, gpus: list[GpuState]) -> tuple[int, str]:
    """How many NVLinks this GPU should have up, and by what: its model's count on NVLink baseboards
    (EXPECTED_NVLINKS), or the most its peers (the node's other GPUs of the same model) were seen with, where
    this GPU has any link up at all; (0, "") when nothing says (a PCIe-only GPU with no link up stays unjudged)."""
    model = gpu.ref.model
    by_model = next((count for pattern, count in EXPECTED_NVLINKS if fnmatchcase(model, pattern)), 0)
    peers = max((len(g.links_seen_up) for g in gpus if g is not gpu and g.ref.model == model), default=0) \
        if gpu.links_seen_up else 0
    if by_model >= peers and by_model:
        return by_model, "model"
    return (peers, "peers") if peers else (0, "")


def read_nvlink_state(calls: NvmlCalls, memory: NodeMemory, gpus: list[GpuState], gpu: GpuState, now: float,
                      out: list[Observation]) -> None:
    """Which NVLinks are down of those seen up before, and which of those the GPU should have (expected_nvlinks)
    never came up; no reading where a link's state could not be read."""
    if "nvlink.state" in gpu.unsupported:
        return
    inactive: list[int] = []
    learned = False
    links = gpu.nvlinks if gpu.nvlinks is not None else MAX_NVLINKS
    for link in range(links):
        try:
            active = calls.call("nvmlDeviceGetNvLinkState", calls.nvml.nvmlDeviceGetNvLinkState, gpu.handle, link)
        except calls.nvml.NVMLError as exc:
            code = getattr(exc, "value", None)
            if code == ERROR_GPU_IS_LOST:
                raise GpuLost("nvmlDeviceGetNvLinkState") from None
            if code not in NOT_SUPPORTED_CODES and code != ERROR_INVALID_ARGUMENT:
                calls.failed(gpu, "nvmlDeviceGetNvLinkState", exc)
                return  # a link whose state cannot be read is not "up": no reading at all
            if gpu.nvlinks is None:
                gpu.nvlinks = link
                if link == 0:
                    gpu.unsupported.add("nvlink.state")
            break
        if active:
            if link not in gpu.links_seen_up:
                gpu.links_seen_up.add(link)
                learned = True
        else:
            inactive.append(link)
    else:
        gpu.nvlinks = links
    if learned:  # a link seen up is remembered across restarts and reboots
        memory.save(NVLINK_KEY, {g.ref.uuid: sorted(g.links_seen_up) for g in gpus if g.ref.uuid and g.links_seen_up})
    # A link counts as down against a baseline (seen up before, remembered across restarts), or as untrained
    # where the GPU should have it (its model's count, its peers'); a link neither judges gives no reading, so
    # "none down" is said only when every link is judged (never healthy by default).
    expected, expected_from = expected_nvlinks(gpu, gpus)
    # Links train once the GPU has registered with the fabric (Fabric Manager configures them): while its last
    # fabric reading says it has not, an untrained link is that registration's (fabric-not-registered), not a fault
    # of its own; a GPU without a fabric reading (no NVSwitch, or before the first) is judged as it reads.
    if gpu.readings.get("fabric_state") not in (None, "Completed"):
        expected = 0
    expected = min(expected, gpu.nvlinks or 0)
    down = [n for n in inactive if n in gpu.links_seen_up]
    # The links it lacks of those it should have: inactive ones without a baseline, as many as it lacks.
    untrained = sorted(n for n in inactive if n not in gpu.links_seen_up)[:max(0, expected - len(gpu.links_seen_up))]
    judged = len(gpu.links_seen_up) + len(untrained)
    without_baseline = (gpu.nvlinks or 0) - judged if expected < (gpu.nvlinks or 0) else 0
    if gpu.links_seen_up or untrained:
        gpu.readings.update(nvlinks_up=len(gpu.links_seen_up) - len(down), nvlinks_down=[*down, *untrained],
                            nvlinks_without_baseline=max(0, without_baseline))
    if down or untrained or (gpu.links_seen_up and without_baseline <= 0):
        extra: dict[str, AttrValue | None] = {"links": ",".join(str(n) for n in down) or "none", "was_up": len(down),
                                             "untrained": len(untrained) or None}
        if expected:
            extra.update(expected=expected, expected_from=expected_from, active=len(gpu.links_seen_up) - len(down),
                         untrained_links=",".join(str(n) for n in untrained) or "none")
        out.append(observation(gpu, Signal.NVLINK_DOWN, len(down) + len(untrained), now, extra=extra))


def read_pcie_link(calls: NvmlCalls, gpu: GpuState, now: float, out: list[Observation]) -> None:
    """The link width against its maximum; the generation against its maximum only while the GPU is busy."""
    nvml, h = calls.nvml, gpu.handle
    width = calls.optional(gpu, "nvmlDeviceGetCurrPcieLinkWidth", nvml.nvmlDeviceGetCurrPcieLinkWidth, h)
    if "pcie_max_width" not in gpu.readings:
        gpu.readings["pcie_max_width"] = calls.optional(gpu, "nvmlDeviceGetMaxPcieLinkWidth",
                                                        nvml.nvmlDeviceGetMaxPcieLinkWidth, h, aux=True)
        gpu.readings["pcie_max_gen"] = calls.optional(gpu, "nvmlDeviceGetMaxPcieLinkGeneration",
                                                      nvml.nvmlDeviceGetMaxPcieLinkGeneration, h, aux=True)
    gen = calls.optional(gpu, "nvmlDeviceGetCurrPcieLinkGeneration", nvml.nvmlDeviceGetCurrPcieLinkGeneration, h)
    gpu.readings.update(pcie_width=width, pcie_gen=gen)
    max_width, max_gen = gpu.readings.get("pcie_max_width"), gpu.readings.get("pcie_max_gen")
    if width is not None and max_width:
        out.append(observation(gpu, Signal.PCIE_LINK, int(width), now, max_width=int(max_width),
                               gen=int(gen or 0), max_gen=int(max_gen or 0)))
    busy = gpu.readings.get("utilization_gpu")
    if gen is not None and max_gen and isinstance(busy, int) and busy >= BUSY_PERCENT:
        out.append(observation(gpu, Signal.PCIE_LINK_GEN, int(gen), now, max_gen=int(max_gen),
                               utilization_gpu=busy, width=int(width) if width is not None else None))


def read_fabric(calls: NvmlCalls, gpu: GpuState, now: float, out: list[Observation], *,
                extra: dict[str, AttrValue | None] | None = None) -> None:
    """The GPU's fabric registration (NVSwitch systems, GB200 NVL72): state, status and health mask, and `extra`
    (what the source knows of Fabric Manager). NotSupported (a PCIe-only GPU) gives no reading; so does state
    NotSupported."""
    info = _fabric_info(calls, gpu)
    if info is None or int(info.state) == FABRIC_STATE_NOT_SUPPORTED:
        return
    state, status = int(info.state), int(info.status)
    attrs: dict[str, AttrValue | None] = {
        "state_name": FABRIC_STATES.get(state, f"state {state}"), "status": status,
        "status_text": _error_text(calls.nvml, status), "clique_id": int(info.cliqueId),
        "cluster_uuid": bytes(info.clusterUuid).hex()}
    mask = int(getattr(info, "healthMask", 0))
    attrs["health_mask"] = mask
    for name, shift in FABRIC_HEALTH_FLAGS.items():
        flag = (mask >> shift) & 0x3
        if flag:
            attrs[name] = 1 if flag == 1 else 0
    config = (mask >> FABRIC_CONFIG_SHIFT) & FABRIC_CONFIG_WIDTH
    if config:
        attrs["incorrect_configuration"] = FABRIC_CONFIGS.get(config, f"code {config}")
        attrs["configuration_ok"] = 1 if config == 1 else 0
    summary = int(getattr(info, "healthSummary", 0))
    if summary:
        attrs["health_summary"] = FABRIC_SUMMARIES.get(summary, f"code {summary}")
    gpu.readings.update(fabric_state=attrs["state_name"], fabric_status=attrs["status_text"], fabric_health_mask=mask,
                        fabric_domain=fabric_domain(bytes(info.clusterUuid), int(info.cliqueId)))
    out.append(observation(gpu, Signal.GPU_FABRIC, state, now, extra={**attrs, **(extra or {})}))


def fabric_domain(cluster_uuid: bytes, clique_id: int) -> str:
    """The NVLink fabric domain a GPU is registered in, `<cluster UUID>/<clique id>` (what the fleet view
    correlates on); "" while the GPU is not registered (NVML reports an all-zero cluster UUID)."""
    if len(cluster_uuid) != 16 or not any(cluster_uuid):
        return ""
    return f"{uuid.UUID(bytes=cluster_uuid)}/{clique_id}"


def _fabric_info(calls: NvmlCalls, gpu: GpuState) -> Any:
    """The newest fabric-info struct the driver takes (v3, else v2), or None."""
    nvml = calls.nvml
    func = getattr(nvml, "nvmlDeviceGetGpuFabricInfoV", None)
    if func is None or "nvmlDeviceGetGpuFabricInfoV" in gpu.unsupported:
        return None
    while True:
        factory = getattr(nvml, FABRIC_INFO_VERSIONS.get(gpu.fabric_version, ""), None)
        if factory is None:
            if gpu.fabric_version <= min(FABRIC_INFO_VERSIONS):
                return None
            gpu.fabric_version -= 1  # an older pynvml without this struct: the older one
            continue
        info = factory()
        try:
            calls.call("nvmlDeviceGetGpuFabricInfoV", func, gpu.handle, ctypes.byref(info))
        except nvml.NVMLError as exc:
            code = getattr(exc, "value", None)
            if code == ERROR_GPU_IS_LOST:
                raise GpuLost("nvmlDeviceGetGpuFabricInfoV") from None
            if code == ERROR_ARGUMENT_VERSION_MISMATCH and gpu.fabric_version > 2:
                gpu.fabric_version -= 1  # an older driver: ask again with the older struct
                continue
            if code in NOT_SUPPORTED_CODES:
                gpu.unsupported.add("nvmlDeviceGetGpuFabricInfoV")
            else:
                calls.failed(gpu, "nvmlDeviceGetGpuFabricInfoV", exc)
            return None
        return info


def _error_text(nvml: Any, code: int) -> str:
    if code == 0:
        return "Success"
    try:
        return text(nvml.nvmlErrorString(code))
    except Exception:  # noqa: BLE001 - a code the library cannot name is still shown
        return f"NVML error {code}"
