"""The NVML source: polls every GPU's health counters and waits on NVML events, each call under a deadline.

Counters become deltas between polls; NotSupported is remembered per GPU and call, and probed again when
the GPU's MIG mode changes and every `reprobe_seconds`; a hung call makes that GPU Unknown (its own
observation, naming the call `hung`), never a hardware fault, and that GPU is not called again until the hung
call returns, while the others keep being read (one that stays hung keeps new work off the GPU:
gpu-calls-hung); a GPU none of whose readings succeed is Unknown too. GPU lost and "reset required" are their
own observations. The node's GPUs and the NVLinks seen up are remembered in a NodeMemory, so a GPU missing
after a reboot, or a link down since it, is seen. The readings themselves are in nvml_reads (core and memory)
and nvml_links (NVLink, PCIe, fabric); events in nvml_events; discovery in nvml_discovery.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from agent.logs import get_logger
from agent.model import AttrValue, GpuRef, Observation, Signal, frozen_attrs, normalise_pci
from agent.sources import nvml_links, nvml_probe, nvml_reads
from agent.sources.base import Emit
from agent.sources.bounded import BoundedCaller, CallTimeout, TooManyHungCalls
from agent.sources.expected_gpus import labelled_count, nvswitches, pci_gpus, shortfall
from agent.sources.fabric_manager import UNSEEN, FabricManagerWatch, FmInstance, status
from agent.sources.node_memory import InMemory, NodeMemory
from agent.sources.nvml_calls import GpuLost, GpuState, NvmlCalls, Reading, handle_key, text
from agent.sources.nvml_calls import observation as _observation
from agent.sources.nvml_discovery import discover, mig_devices
from agent.sources.nvml_events import event_observation, watch_events
from agent.sources.nvml_links import NVLINK_KEY

__all__ = ["GpuState", "NvmlSource", "load_pynvml", "probe_calls"]

log = get_logger("agent.sources.nvml")

REPROBE_SECONDS = 600.0
INVENTORY_KEY = "nvml.inventory"
#: The Fabric Manager instance each GPU registered with, this boot: {"boot": boot id, "gpus": {uuid: instance}}.
FABRIC_MANAGER_KEY = "nvml.fabric_manager"


class NvmlSource:
    """Polls GPUs every `poll_seconds`; a second thread turns NVML events into observations at once."""

    name = "nvml"

    def __init__(self, nvml: Any, *, poll_seconds: float = 10.0, call_timeout_seconds: float = 2.0,
                 clock: Callable[[], float] = time.time, event_wait_ms: int = 500,
                 memory: NodeMemory | None = None, reprobe_seconds: float = REPROBE_SECONDS,
                 max_hung_calls: int = 8, pci_devices: Path | None = None,
                 node_labels: Callable[[], Mapping[str, str]] = dict,
                 fabric_manager: FabricManagerWatch | None = None) -> None:
        """`pci_devices` (sysfs, None: not read) and `node_labels` (the Node's, as last seen) say how many GPUs
        the node should have where no inventory is remembered (a first boot): see expected_gpus.
        `fabric_manager` (None: not watched) finds the host's nv-fabricmanager: see fabric_manager."""
        self.nvml = nvml
        self.fabric_manager = fabric_manager
        #: The instance running at this poll, whether one must run (NVSwitches on the bus, or one seen), and the
        #: instance each GPU registered with (FABRIC_MANAGER_KEY).
        self.fm_now: FmInstance | None = None
        self.fm_expected = False
        self.fm_registered: dict[str, str] = {}
        self._fm_boot = ""
        self.pci_devices = pci_devices
        self.node_labels = node_labels
        #: The most GPUs GFD's label has said since the start: GFD relabels with what it finds on this boot, and
        #: a relabel to fewer must not hide the GPUs that went missing.
        self.labelled_gpus: int | None = None
        #: The NVIDIA GPUs on the PCI bus at the start (normalised addresses), read once: the bus does not change
        #: while the driver runs, and a GPU that falls off it later is Xid 79's.
        self.on_bus: list[str] = []
        self.memory: NodeMemory = memory if memory is not None else InMemory()
        self.reprobe_seconds = reprobe_seconds
        self.missing: list[GpuRef] = []
        self.poll_seconds = poll_seconds
        self.caller = BoundedCaller(timeout_seconds=call_timeout_seconds, max_hung=max_hung_calls)
        self.calls = NvmlCalls(nvml, self.caller)
        self.clock = clock
        self.event_wait_ms = event_wait_ms
        self.gpus: list[GpuState] = []
        self.driver_version = ""
        self.ready = threading.Event()
        # The GPU reset's seam (release_for_reset below): while released, NVML is shut down and nothing reads it.
        self._session = threading.RLock()
        self._released = False
        self._session_generation = 0

    # ---- lifecycle ----
    def start(self) -> None:
        """nvmlInit and discover the GPUs (raises the NVML error when the driver or library is missing)."""
        self.calls.call("nvmlInit", self.nvml.nvmlInit)
        self.driver_version = text(self.calls.call("nvmlSystemGetDriverVersion", self.nvml.nvmlSystemGetDriverVersion))
        count = int(self.calls.call("nvmlDeviceGetCount", self.nvml.nvmlDeviceGetCount))
        self.gpus = [discover(self.calls, self.nvml, index) for index in range(count)]
        self.on_bus = pci_gpus(self.pci_devices) if self.pci_devices is not None else []
        self._remember_inventory()
        self._restore_nvlink_baselines()
        self._restore_fabric_manager()

    def stop(self) -> None:
        with contextlib.suppress(Exception):  # shutting down a wedged driver is best effort
            self.calls.call("nvmlShutdown", self.nvml.nvmlShutdown)
        self.caller.close()

    def run(self, emit: Emit, stop: threading.Event) -> None:
        self.start()
        events = threading.Thread(target=self._events, args=(emit, stop), name="nvml-events", daemon=True)
        events.start()
        self.ready.set()
        try:
            while not stop.is_set():
                started = self.clock()
                for observation in self.poll():
                    emit(observation)
                stop.wait(max(0.0, self.poll_seconds - (self.clock() - started)))
        finally:
            events.join(timeout=2 * self.event_wait_ms / 1000 + 1)
            self.stop()

    # ---- what the node had before ----
    def _remember_inventory(self) -> None:
        """Compare the GPUs found with those the node had before; remember every GPU ever seen here.

        A GPU that cannot even name itself is present but unreadable (reported lost), so while one is,
        nothing is called missing: it may be that very GPU.
        """
        known = [g for g in self.memory.load(INVENTORY_KEY) or [] if isinstance(g, dict) and g.get("uuid")]
        present = {gpu.ref.uuid for gpu in self.gpus if gpu.ref.uuid}
        unnamed = any(not gpu.ref.uuid for gpu in self.gpus)
        self.missing = [] if unnamed else [
            GpuRef(uuid=str(g["uuid"]), pci_bus_id=str(g.get("pci", "")), model=str(g.get("model", "")))
            for g in known if g["uuid"] not in present]
        for ref in self.missing:
            log.warning("gpu_missing", gpu=ref.uuid, pci=ref.pci_bus_id)
        inventory = {str(g["uuid"]): g for g in known}
        for gpu in self.gpus:
            if gpu.ref.uuid:
                inventory[gpu.ref.uuid] = {"uuid": gpu.ref.uuid, "pci": gpu.ref.pci_bus_id, "model": gpu.ref.model,
                                           "index": gpu.ref.index}
        self.memory.save(INVENTORY_KEY, sorted(inventory.values(), key=lambda g: str(g["uuid"])))

    def forget_gpu(self, uuid: str, *, pci_bus_id: str = "") -> None:
        """An operator released a missing GPU (removed or replaced on purpose; one on the bus NVML does not
        enumerate, known only by its address, until the next start): stop reporting it."""
        if uuid:
            known = self.memory.load(INVENTORY_KEY) or []
            self.memory.save(INVENTORY_KEY, [g for g in known if isinstance(g, dict) and g.get("uuid") != uuid])
            self.missing = [ref for ref in self.missing if ref.uuid != uuid]
        elif pci_bus_id:
            self.on_bus = [pci for pci in self.on_bus if pci != normalise_pci(pci_bus_id)]

    def _restore_nvlink_baselines(self) -> None:
        saved = self.memory.load(NVLINK_KEY) or {}
        for gpu in self.gpus:
            links = saved.get(gpu.ref.uuid) if isinstance(saved, dict) else None
            if isinstance(links, list):
                gpu.links_seen_up.update(int(n) for n in links if isinstance(n, int))

    def _restore_fabric_manager(self) -> None:
        """The instance each GPU registered with, as remembered this boot (another boot registers anew)."""
        if self.fabric_manager is not None and not self.fabric_manager.sees_host():
            self.fabric_manager = None  # a container's own /proc: Fabric Manager cannot be seen, so is not judged
        if self.fabric_manager is None:
            return
        self._fm_boot = self.fabric_manager.boot_id()
        self.fm_expected = bool(self.pci_devices is not None and nvswitches(self.pci_devices))
        saved = self.memory.load(FABRIC_MANAGER_KEY)
        if isinstance(saved, dict) and saved.get("boot") == self._fm_boot and isinstance(saved.get("gpus"), dict):
            self.fm_registered = {str(k): str(v) for k, v in saved["gpus"].items()}

    def _fabric_manager_attrs(self, gpu: GpuState) -> dict[str, AttrValue | None]:
        """What the GPU's fabric reading says of Fabric Manager (nothing where nothing says one runs here)."""
        if self.fabric_manager is None:
            return {}
        now = self.fm_now
        state = status(now, self.fm_registered.get(gpu.ref.uuid), expected=self.fm_expected)
        if state is None:
            return {}
        return {"fabric_manager": state, "fabric_manager_pid": now.pid if now is not None else None}

    def _note_registration(self, gpu: GpuState) -> None:
        """A GPU read registered (Completed) with no instance remembered registered with the one running now
        (or with one that could not be seen, where one must run: any instance later is another); one read
        registering again (a reset by anyone, a driver reload) is forgotten, to be noted when it completes."""
        uuid = gpu.ref.uuid
        state = gpu.readings.get("fabric_state")
        if self.fabric_manager is None or not uuid or state is None:
            return
        if state != "Completed":
            self._registered_again(uuid)
            return
        if uuid in self.fm_registered or not (self.fm_now or self.fm_expected):
            return
        self.fm_registered[uuid] = self.fm_now.key if self.fm_now is not None else UNSEEN
        self.memory.save(FABRIC_MANAGER_KEY, {"boot": self._fm_boot, "gpus": dict(sorted(self.fm_registered.items()))})

    def _registered_again(self, uuid: str) -> None:
        """A reset GPU registers again, with whichever instance runs when it is next read Completed."""
        if self.fm_registered.pop(uuid, None) is not None:
            self.memory.save(FABRIC_MANAGER_KEY, {"boot": self._fm_boot,
                                                  "gpus": dict(sorted(self.fm_registered.items()))})

    @property
    def fabric_domain(self) -> str:
        """The NVLink fabric domain(s) of this node's GPUs as the last poll read them ("" on a PCIe-only node or
        before the fabric was read; several, comma-separated, only on a node whose GPUs disagree)."""
        return ",".join(sorted({str(d) for g in self.gpus if (d := g.readings.get("fabric_domain"))}))

    def mig_parents(self) -> dict[str, str]:
        """MIG device UUID -> the UUID of the GPU it is a slice of."""
        return {mig: gpu.ref.uuid for gpu in self.gpus for mig in gpu.mig_uuids}

    # ---- polling ----
    def poll(self) -> list[Observation]:
        """One reading of every GPU (also what `check` uses); none while NVML is released for a GPU reset."""
        with self._session:
            return [] if self._released else self._poll_all()

    def _poll_all(self) -> list[Observation]:
        observations: list[Observation] = []
        if self.fabric_manager is not None:
            self.fm_now = self.fabric_manager.instance()
            self.fm_expected = self.fm_expected or self.fm_now is not None
        for gpu in self.gpus:
            observations.extend(self.poll_gpu(gpu))
        now = self.clock()
        for ref in self.missing:
            observations.append(Observation(Signal.GPU_MISSING, 1.0, now, self.name, ref, frozen_attrs(
                {"last_seen": f"PCI {ref.pci_bus_id or '?'} before the last restart",
                 "message": "no longer enumerated by NVML"})))
        observations.extend(self._expected_missing(now))
        return observations

    def _expected_missing(self, now: float) -> list[Observation]:
        """The GPUs a first boot lacks beside the remembered inventory's: each NVIDIA GPU on the PCI bus that
        NVML does not enumerate (known by its address), and, as one reading of the node, how many fewer GPUs
        than GFD's `nvidia.com/gpu.count` says all of them account for (0 once they do)."""
        labelled = labelled_count(self._labels())
        if labelled is not None:
            self.labelled_gpus = max(labelled, self.labelled_gpus or 0)
        lacking = shortfall(enumerated=[g.ref.pci_bus_id for g in self.gpus], enumerated_count=len(self.gpus),
                            on_bus=self.on_bus if all(g.ref.pci_bus_id for g in self.gpus) else [],
                            remembered_missing=[r.pci_bus_id for r in self.missing],
                            expected=self.labelled_gpus)
        out = [Observation(Signal.GPU_MISSING, 1.0, now, self.name, GpuRef(pci_bus_id=pci), frozen_attrs(
                   {"expected_from": "pci", "last_seen": f"PCI {pci} on the bus (sysfs)",
                    "message": "an NVIDIA GPU on the PCI bus that NVML does not enumerate"}))
               for pci in lacking.on_bus]
        if lacking.expected is not None:
            out.append(Observation(Signal.GPU_MISSING, float(lacking.unnamed), now, self.name, None, frozen_attrs(
                {"expected_from": "label", "expected": lacking.expected, "enumerated": len(self.gpus),
                 "message": f"GPU Feature Discovery's nvidia.com/gpu.count says {lacking.expected}"})))
        return out

    def _labels(self) -> Mapping[str, str]:
        try:
            return self.node_labels()
        except Exception as exc:  # noqa: BLE001 - the Node's labels are a hint; reading them never stops a poll
            log.warning("node_labels_unreadable", error=str(exc))
            return {}

    def poll_gpu(self, gpu: GpuState) -> list[Observation]:
        """Every reading of one GPU, all under one deadline: a hung call makes the GPU Unknown."""
        now = self.clock()
        out: list[Observation] = []
        gpu.readings.pop("errors", None)
        reading = Reading()
        try:
            if gpu.lost:
                raise GpuLost("nvmlDeviceGetUUID")
            self.caller.call("poll", self.calls.run_reading, reading, lambda: self._read_all(gpu, now, out),
                             key=gpu.caller_key)
        except CallTimeout:
            reading.abandoned.set()
            gpu.hung_call = reading.current or "an NVML call"
            message = f"{gpu.hung_call} timed out after {self.caller.timeout:g}s"
            # what was read before the hung call stands; the worker adds nothing once abandoned
            return self._unreadable(gpu, [*out], now, message, hung=gpu.hung_call)
        except GpuLost as lost:
            out.append(_observation(gpu, Signal.GPU_LOST, 1, now, message=f"{lost} returned GPU_IS_LOST"))
            gpu.readings["status_note"] = "GPU lost"
            return out
        except TooManyHungCalls as exc:
            still = self.caller.hung_for(gpu.caller_key)
            hung = gpu.hung_call if still else ""
            message = (f"{hung} is still hung in the driver; this GPU is not called again until it "
                       f"returns" if hung else str(exc))
            return self._unreadable(gpu, out, now, message, hung=hung)
        gpu.hung_call = ""
        return self._judged(gpu, reading, now, out)

    def _judged(self, gpu: GpuState, reading: Reading, now: float, out: list[Observation]) -> list[Observation]:
        """A finished poll: reset required, unreadable (no reading succeeded), or the readings and a
        gpu_polled that can verify a reset."""
        if gpu.ref.uuid:
            out.append(_observation(gpu, Signal.GPU_MISSING, 0, now))
        out.append(_observation(gpu, Signal.RESET_REQUIRED, 1 if reading.reset_required else 0, now,
                                message=f"{reading.reset_required} returned NVML_ERROR_RESET_REQUIRED"
                                if reading.reset_required else None))
        if reading.reset_required:
            gpu.readings["status_note"] = "reset required"
            return out
        if reading.failed and not reading.succeeded:
            errors = gpu.readings.get("errors", {})
            first = next(iter(errors.items()), ("an NVML call", "failed"))
            return self._unreadable(gpu, out, now, f"no NVML reading succeeded ({reading.failed} failed), "
                                                   f"e.g. {first[0]}: {first[1]}")
        out.append(_observation(gpu, Signal.SOURCE_UNREADABLE, 0, now))
        out.append(self._polled(gpu, now))
        gpu.readings.pop("status_note", None)
        return out

    def _unreadable(self, gpu: GpuState, out: list[Observation], now: float, message: str, *,
                    hung: str = "") -> list[Observation]:
        """The GPU unreadable this poll; `hung`: the call of this GPU still stuck in the driver (a GPU that does
        not answer, which the rule gpu-calls-hung judges once it lasts), "" for errors and for calls not made
        because other GPUs' calls are hung."""
        out.append(_observation(gpu, Signal.SOURCE_UNREADABLE, 1, now, message=message, hung=hung or None))
        gpu.readings["status_note"] = message
        return out

    def _polled(self, gpu: GpuState, now: float) -> Observation:
        """The whole poll in one reading, what verifies a reset: None where the GPU cannot say."""
        r = gpu.readings
        down = r.get("nvlinks_down")
        return _observation(gpu, Signal.GPU_POLLED, 1, now, extra={
            "recovery_action": r.get("recovery_action"), "remap_pending": r.get("remap_pending"),
            "retirement_pending": r.get("retired_pages_pending"), "volatile_dbe": r.get("ecc_dbe_volatile"),
            "links_down": len(down) if isinstance(down, list) else None,
            "mig_devices": len(gpu.mig_uuids) if gpu.mig_mode else None})

    def _reprobe(self, gpu: GpuState, now: float) -> None:
        """Forget what was NotSupported when the MIG mode changed (remapped rows come back when MIG goes
        off) and every `reprobe_seconds` (a driver update, a GPU reset); the MIG devices, read again."""
        mig = self.calls.optional(gpu, "nvmlDeviceGetMigMode", self.nvml.nvmlDeviceGetMigMode, gpu.handle, aux=True)
        mode = int(mig[0]) if mig else gpu.mig_mode
        changed = mode != gpu.mig_mode
        if changed or now - gpu.probed_at >= self.reprobe_seconds:
            if changed:
                log.info("nvml_mig_mode_changed", gpu=gpu.ref.uuid, mig_mode=mode)
            gpu.unsupported.clear()
            gpu.nvlinks = None
            gpu.probed_at = now
            gpu.mig_mode = mode
        # Every poll: a reset destroys a MIG GPU's instances (its MIG mode stays), mig-manager re-creates them
        # under new UUIDs; the poll's count is what verifies a reset restored the geometry.
        gpu.mig_uuids = mig_devices(self.calls, self.nvml, gpu) if gpu.mig_mode else []

    def _read_all(self, gpu: GpuState, now: float, out: list[Observation]) -> None:
        calls, nvml, h = self.calls, self.nvml, gpu.handle
        self._reprobe(gpu, now)
        nvml_reads.read_temperature(calls, gpu, now, out)
        nvml_reads.read_fields(calls, gpu, now, out)
        nvml_reads.read_power_and_clocks(calls, gpu, now, out)
        nvml_reads.read_ecc_mode(calls, gpu, now, out)
        nvml_reads.read_ecc(calls, gpu, now, out)
        nvml_reads.read_sram(calls, gpu, now, out)
        nvml_reads.read_retired_pages(calls, gpu, now, out)
        nvml_reads.read_remapped_rows(calls, gpu, now, out)
        nvml_links.read_nvlink_state(calls, self.memory, self.gpus, gpu, now, out)
        nvml_links.read_fabric(calls, gpu, now, out, extra=self._fabric_manager_attrs(gpu))
        self._note_registration(gpu)
        utilization = calls.optional(gpu, "nvmlDeviceGetUtilizationRates", nvml.nvmlDeviceGetUtilizationRates, h,
                                     aux=True)
        if utilization is not None:
            gpu.readings.update(utilization_gpu=int(utilization.gpu), utilization_memory=int(utilization.memory))
        else:
            gpu.readings.pop("utilization_gpu", None)
        nvml_links.read_pcie_link(calls, gpu, now, out)
        processes = calls.optional(gpu, "nvmlDeviceGetComputeRunningProcesses",
                                   nvml.nvmlDeviceGetComputeRunningProcesses, h, aux=True)
        if processes is not None:
            gpu.readings["pids"] = sorted(int(p.pid) for p in processes)

    # ---- the pods on each GPU ----
    def pids_by_gpu(self) -> dict[str, list[int]]:
        """The compute processes each GPU ran at the last poll (for finding the pods on a faulty GPU)."""
        return {gpu.ref.uuid: list(gpu.readings.get("pids", [])) for gpu in self.gpus if gpu.ref.uuid}

    # ---- the GPU reset's seam (agent/gpu/reset.py NvmlHandles) ----
    def processes_on(self, uuid: str) -> list[int]:
        """The compute and graphics processes NVML lists on this GPU now, by host PID (the driver knows no PID
        namespace); [] for a GPU not known, NVML released, or lists it cannot read."""
        with self._session:
            gpu = next((g for g in self.gpus if g.ref.uuid == uuid), None)
            if self._released or gpu is None:
                return []
            pids: set[int] = set()
            for name in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
                func = getattr(self.nvml, name, None)
                listed = None
                if func is not None:
                    try:
                        listed = self.calls.optional(gpu, name, func, gpu.handle, aux=True)
                    except Exception:  # noqa: BLE001 - only a note for a reset's message: a list not read is none
                        listed = None
                pids.update(int(p.pid) for p in listed or [])
            return sorted(pids)

    def release_for_reset(self) -> None:
        """nvmlShutdown, after the poll or event wait under way: NVML holds every /dev/nvidiaN open while it is
        initialised, and the driver resets no GPU that any process holds. Nothing is read until reacquired."""
        with self._session:
            if not self._released:
                self._released = True
                self.calls.call("nvmlShutdown", self.nvml.nvmlShutdown)

    def reacquire_after_reset(self, reset_uuid: str = "") -> None:
        """nvmlInit and each GPU's handle again; readings and event waits resume. Should nvmlInit fail, polls resume
        anyway, so the GPUs read as unreadable (Unknown) rather than silently not at all. The GPU reset
        (`reset_uuid`, "" when the reset failed) registers with the fabric again."""
        if reset_uuid:
            self._registered_again(reset_uuid)
        with self._session:
            if not self._released:
                return
            try:
                self.calls.call("nvmlInit", self.nvml.nvmlInit)
                for gpu in self.gpus:  # by index, as discovered; a reset renumbers nothing
                    if gpu.ref.index is not None:
                        gpu.handle = self.calls.call("nvmlDeviceGetHandleByIndex",
                                                     self.nvml.nvmlDeviceGetHandleByIndex, gpu.ref.index)
                        gpu.handle_key = handle_key(gpu.handle)
            finally:
                self._released = False
                self._session_generation += 1

    def _events(self, emit: Emit, stop: threading.Event) -> None:
        """Event sessions, one per NVML session: a GPU reset's release ends one, the reacquire starts the next."""
        while not stop.is_set():
            if self._released:
                stop.wait(self.event_wait_ms / 1000)
                continue
            generation = self._session_generation

            def current(generation: int = generation) -> bool:
                return not self._released and generation == self._session_generation

            if not watch_events(self.calls, self.gpus, emit, stop, wait_ms=self.event_wait_ms, clock=self.clock,
                                session=self._session, current=current):
                return

    def event_observation(self, gpu: GpuState, data: Any) -> Observation | None:
        """An NVML event as an observation (see nvml_events)."""
        return event_observation(gpu, data, self.clock())


def load_pynvml() -> Any:
    """The real pynvml module (nvidia-ml-py)."""
    import pynvml  # noqa: PLC0415 - only the NVML source touches the driver bindings

    return pynvml


def probe_calls(source: NvmlSource) -> list[tuple[int, str, str]]:
    """(GPU index, NVML call, supported | NotSupported | error: ...) for every read the agent makes."""
    return nvml_probe.probe_calls(source.nvml, source.caller, source.gpus)
