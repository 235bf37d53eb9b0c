"""The GPU reset procedure, as a GPU Operator node allows it.

`nvidia-smi --gpu-reset` needs root (CAP_SYS_ADMIN) and refuses while any process holds the GPU, monitoring
included. On a node with the GPU Operator the agent's own NVML session, the device plugin, DCGM, dcgm-exporter
and GPU feature discovery all hold every GPU open. So a reset is a procedure, not a command:

1. pause the operands that hold the GPUs (OperandControl: the GPU Operator's per-node
   `nvidia.com/gpu.deploy.<operand>` labels, recorded on the Node in the same write) and await their pods gone;
2. let go of the agent's own NVML handles (NvmlHandles: nvmlShutdown, nvmlInit again afterwards);
3. the privileged part (DeviceReset, in its own narrowly privileged container): persistence mode off for that
   GPU where it is on (`nvidia-smi -pm 0 -i <uuid>`: nvidia-persistenced's attachment is a holder the driver
   refuses a reset for), `nvidia-smi --gpu-reset -i <uuid>`, a fixed command for a checked UUID, retried
   (bounded) while the driver refuses it as in use, then persistence mode back on (`-pm 1`) whatever happened;
4. whatever happened: NVML back, operands restored (only labels still at the agent's value); a restore that
   failed, or a pause a crashed agent left, is put back by restore_if_needed at the next reconcile pass.

A GPU still held when the wait ends (a host holder the procedure cannot stop: nv-hostengine, a host
dcgm-exporter) is not idle yet, not a failed reset: the outcome says `held`, the actuator reports the step
blocked (not charged), and the reset is asked again once the guard's reset cooldown has passed, as often in a
row as its attempt cap allows within the hour, then it failed (control/steps.py).

The clean poll that verifies the reset is the pipeline's, as for any reset.
"""

from __future__ import annotations

import re
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from agent.config import RESET_COMMANDS
from agent.gpu.holders import Holder, device_minor, holders_of

#: What the actuator calls: the GPU UUID in, (reset done; None: not idle yet, still held; one line) out.
ResetRunner = Callable[[str], tuple[bool | None, str]]
#: GPU and MIG UUIDs as NVML prints them: all a reset request may name (it becomes a command argument).
UUID_PATTERN = re.compile(r"^(GPU|MIG)-[0-9A-Fa-f-]{8,64}$")
#: nvidia-smi's refusals while a process holds the GPU, in each driver's words: "Unable to reset this GPU because
#: it's being used by some other process", "GPU 00000000:1A:00.0: In use by another client" (NVML_ERROR_IN_USE,
#: persistence mode on: NVSentinel #1690), "GPU 00000000:C1:00.0 is currently in use by another process." and
#: "1 device is currently being used by one or more other processes" (gpu-operator #118, mig-parted #181).
IN_USE = re.compile(r"being used by some other process|in use by another client|currently in use by another "
                    r"process|currently being used by one or more other processes", re.IGNORECASE)
#: Persistence mode: read, off and back on for one GPU (argv[0] is the reset command's nvidia-smi).
PERSISTENCE_QUERY = ("--query-gpu=persistence_mode", "--format=csv,noheader", "-i", "{uuid}")
PERSISTENCE_OFF = ("-pm", "0", "-i", "{uuid}")
PERSISTENCE_ON = ("-pm", "1", "-i", "{uuid}")


@dataclass(frozen=True, slots=True)
class ResetOutcome:
    """What the privileged part did: reset or not, why, and who held the GPU when it gave up."""

    ok: bool
    message: str
    holders: tuple[Holder, ...] = ()
    #: Not reset because the GPU is still held (not idle yet): asked again later, never a failed reset.
    held: bool = False


class ResetExecutor(Protocol):
    """The privileged part of a reset: in-process (DeviceReset) or in the reset container (HelperClient)."""

    def __call__(self, uuid: str) -> ResetOutcome: ...


class OperandControl(Protocol):
    """Pauses the node's GPU operands for a reset and puts them back (the Kubernetes edge implements it)."""

    def pause(self) -> str:
        """Pause what holds the GPUs and wait (bounded) for its pods to go; says what it did."""
        ...

    def restore(self) -> str:
        """Put back what a pause changed, this one's or one a crash left; says what it did ("" for nothing).
        Cheap when nothing is paused, so that it can be asked every reconcile pass."""
        ...


class NvmlHandles(Protocol):
    """The agent's own NVML session, which holds every GPU's device file open while it is initialised."""

    def processes_on(self, uuid: str) -> list[int]:
        """The processes NVML lists on the GPU (compute and graphics contexts), by host PID."""
        ...

    def release_for_reset(self) -> None: ...

    def reacquire_after_reset(self, reset_uuid: str = "") -> None:
        """NVML again; `reset_uuid` is the GPU reset ("" when the reset failed): it registers with the fabric anew."""
        ...


@dataclass(slots=True)
class DeviceReset:
    """Runs `nvidia-smi --gpu-reset -i <uuid>` once nobody holds the GPU, the driver's refusal the final word.

    The command is one of config.RESET_COMMANDS, nothing else (it runs as root with CAP_SYS_ADMIN), and the UUID
    must match UUID_PATTERN and be in the driver's GPU table. Where `proc_root` shows other processes, they are
    scanned first (agent/gpu/holders.py, failing closed). nvidia-smi refusing because the GPU is in use is
    retried until `holder_wait_seconds` have passed (operand pods still terminating), then reported as is."""

    command: Sequence[str] = RESET_COMMANDS[0]
    timeout_seconds: float = 120.0
    #: How long processes that are going away (operand pods terminating) get to let go of the device.
    holder_wait_seconds: float = 30.0
    proc_root: Path = Path("/proc")
    driver_root: Path = Path("/proc/driver/nvidia/gpus")
    dev_root: Path = Path("/dev")
    #: Process names (comm) not waited for: they do not keep the driver from resetting the GPU.
    ignored_holders: frozenset[str] = frozenset()
    poll_seconds: float = 1.0
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep

    def __post_init__(self) -> None:
        if tuple(self.command) not in RESET_COMMANDS:
            raise ValueError(f"not a reset command: {list(self.command)!r} (only nvidia-smi --gpu-reset -i {{uuid}})")

    def __call__(self, uuid: str) -> ResetOutcome:
        if not UUID_PATTERN.match(uuid):
            return ResetOutcome(False, f"not a GPU UUID: {uuid[:80]!r}")
        minor = device_minor(uuid, driver_root=self.driver_root)
        if minor is None:
            return ResetOutcome(False, f"{uuid} is not in the driver's GPU table ({self.driver_root})")
        device = self.dev_root / f"nvidia{minor}"
        return without_persistence(lambda args: self._nvidia_smi(uuid, args), lambda: self._reset(uuid, device))

    def _nvidia_smi(self, uuid: str, args: Sequence[str]) -> tuple[int, str]:
        """One persistence-mode command for this GPU (the reset command's nvidia-smi, fixed arguments)."""
        argv = [self.command[0], *(part.replace("{uuid}", uuid) for part in args)]
        try:
            done = subprocess.run(  # noqa: S603 - fixed arguments, a checked UUID, no shell
                argv, capture_output=True, text=True, timeout=self.timeout_seconds, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return -1, str(exc)
        return done.returncode, (done.stdout + done.stderr).strip()

    def _reset(self, uuid: str, device: Path) -> ResetOutcome:
        argv = [part.replace("{uuid}", uuid) for part in self.command]
        deadline = self.clock() + self.holder_wait_seconds
        while True:
            scan = holders_of(device, proc_root=self.proc_root).without(self.ignored_holders)
            if scan.clear:
                outcome = self._run(argv)
                if outcome.ok or not IN_USE.search(outcome.message):
                    return outcome
            if self.clock() >= deadline:
                break
            self.sleep(self.poll_seconds)
        if not scan.clear:
            return ResetOutcome(False, f"not reset: {device} still held after {self.holder_wait_seconds:g}s by "
                                       f"{scan.describe()}", scan.holders + scan.unreadable, held=True)
        return ResetOutcome(False, f"not reset: the driver still refuses after {self.holder_wait_seconds:g}s, the "
                                   f"GPU in use by a process ({outcome.message})", held=True)

    def _run(self, argv: list[str]) -> ResetOutcome:
        try:
            done = subprocess.run(  # noqa: S603 - one of RESET_COMMANDS, a checked UUID, no shell
                argv, capture_output=True, text=True, timeout=self.timeout_seconds, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return ResetOutcome(False, f"{argv[0]}: {exc}")
        lines = (done.stdout + done.stderr).strip().splitlines()
        last = next((line.strip() for line in lines if IN_USE.search(line)), lines[-1].strip() if lines else "")
        return ResetOutcome(done.returncode == 0, f"{argv[0]} exit {done.returncode}: {last}")


#: Runs one of the PERSISTENCE_* argument lists for the GPU being reset: (exit status, what it printed).
PersistenceRunner = Callable[[Sequence[str]], tuple[int, str]]


def without_persistence(run: PersistenceRunner, reset: Callable[[], ResetOutcome]) -> ResetOutcome:
    """`reset()` with the GPU's persistence mode off, where it was on, and back on afterwards whatever happened
    (NVSentinel #1690/#1692: nvidia-persistenced's attachment is refused as "In use by another client"; a GPU
    whose mode cannot be read is reset as it is). The outcome's message says what was done."""
    code, text = run(PERSISTENCE_QUERY)
    if code != 0 or text.strip().lower() != "enabled":
        return reset()
    code, text = run(PERSISTENCE_OFF)
    off = "persistence mode turned off for the reset" if code == 0 else \
        f"persistence mode on: could not turn it off ({_last(text, code)})"
    try:
        outcome = reset()
    finally:
        code, text = run(PERSISTENCE_ON)
        back = "persistence mode back on" if code == 0 else \
            f"persistence mode NOT back on ({_last(text, code)}): nvidia-smi -pm 1 -i <uuid>"
    return ResetOutcome(outcome.ok, f"{outcome.message}; {off}; {back}", outcome.holders, outcome.held)


def _last(text: str, code: int) -> str:
    lines = text.strip().splitlines()
    return lines[-1].strip() if lines else f"exit {code}"


@dataclass(slots=True)
class ResetProcedure:
    """The whole reset, callable as the actuator's ResetRunner. Each step's failure is reported, and what
    was paused or released is put back whatever happened. One lock covers a reset and every restore, so a
    restore never runs while a reset has the operands paused, and a pause left behind (a crash, a restore
    that failed) is put back by restore_if_needed, called every reconcile pass."""

    execute: ResetExecutor
    operands: OperandControl | None = None
    nvml: NvmlHandles | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def __call__(self, uuid: str) -> tuple[bool | None, str]:
        """(True: reset, False: failed, None: not idle yet, the GPU still held; what happened)."""
        with self._lock:
            return self._reset(uuid)

    def restore_if_needed(self) -> str:
        """Put back a pause no reset is using (the Node's record says what); "" when there is nothing to do.
        Never waits for a running reset (it restores when it ends) and never raises: a failed restore says
        so and is tried again at the next call."""
        if self.operands is None:
            return ""
        if not self._lock.acquire(blocking=False):
            return ""
        try:
            return self.operands.restore()
        except Exception as exc:  # noqa: BLE001 - the record stays on the Node; the next call tries again
            return f"operands not restored (tried again next pass): {type(exc).__name__}: {exc}"
        finally:
            self._lock.release()

    def _reset(self, uuid: str) -> tuple[bool | None, str]:
        notes: list[str] = []
        listed: list[int] = []
        released = False
        outcome = ResetOutcome(False, "not attempted")
        try:
            if self.operands is not None:
                notes.append(self.operands.pause())
            if self.nvml is not None:
                listed = self.nvml.processes_on(uuid)  # before letting go: the last view of who runs on it
                self.nvml.release_for_reset()
                released = True
            outcome = self.execute(uuid)
            if not outcome.ok and listed:
                notes.append(f"NVML listed on the GPU before the reset: {', '.join(f'pid {p}' for p in listed)} "
                             f"(host PIDs)")
        except Exception as exc:  # noqa: BLE001 - a failed step fails the reset; the finally puts things back
            outcome = ResetOutcome(False, f"{type(exc).__name__}: {exc}")
        finally:
            if released and self.nvml is not None:
                try:
                    self.nvml.reacquire_after_reset(uuid if outcome.ok else "")
                except Exception as exc:  # noqa: BLE001 - reported; the NVML source reports the GPUs unreadable
                    notes.append(f"NVML not reinitialised: {type(exc).__name__}: {exc}")
            if self.operands is not None:
                try:
                    notes.append(self.operands.restore())
                except Exception as exc:  # noqa: BLE001 - the record on the Node: restore_if_needed retries
                    notes.append(f"operands not restored yet (the next reconcile pass restores them): "
                                 f"{type(exc).__name__}: {exc}")
        done: bool | None = None if outcome.held and not outcome.ok else outcome.ok
        return done, "; ".join(part for part in (outcome.message, *notes) if part)
