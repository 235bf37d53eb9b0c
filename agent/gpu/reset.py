"""The GPU reset procedure, as a GPU Operator node allows it.

`nvidia-smi --gpu-reset` needs root (CAP_SYS_ADMIN) and refuses while any process holds the GPU, monitoring
included. On a node with the GPU Operator the agent's own NVML session, the device plugin, DCGM, dcgm-exporter
and GPU feature discovery all hold every GPU open. So a reset is a procedure, not a command:

1. pause the operands that hold the GPUs (OperandControl: the GPU Operator's per-node
   `nvidia.com/gpu.deploy.<operand>` labels, recorded on the Node in the same write) and await their pods gone;
2. let go of the agent's own NVML handles (NvmlHandles: nvmlShutdown, nvmlInit again afterwards);
3. the privileged part (DeviceReset, in its own narrowly privileged container): wait, bounded, for the GPU's
   device file to be held by nobody, naming who still holds it, and only then run the reset command;
4. whatever happened: NVML back, operands restored (only labels still at the agent's value).

The clean poll that verifies the reset is the pipeline's, as for any reset.
"""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from agent.gpu.holders import Holder, device_minor, holders_of

#: What the actuator calls: the GPU UUID in, (reset done, one line saying what happened) out.
ResetRunner = Callable[[str], tuple[bool, str]]
#: GPU and MIG UUIDs as NVML prints them: all a reset request may name (it becomes a command argument).
UUID_PATTERN = re.compile(r"^(GPU|MIG)-[0-9A-Fa-f-]{8,64}$")


@dataclass(frozen=True, slots=True)
class ResetOutcome:
    """What the privileged part did: reset or not, why, and who held the GPU when it gave up."""

    ok: bool
    message: str
    holders: tuple[Holder, ...] = ()


class ResetExecutor(Protocol):
    """The privileged part of a reset: in-process (DeviceReset) or in the reset container (HelperClient)."""

    def __call__(self, uuid: str) -> ResetOutcome: ...


class OperandControl(Protocol):
    """Pauses the node's GPU operands for a reset and puts them back (the Kubernetes edge implements it)."""

    def pause(self) -> str:
        """Pause what holds the GPUs and wait (bounded) for its pods to go; says what it did."""
        ...

    def restore(self) -> str:
        """Put back what a pause changed, this one's or one a crash left; says what it did."""
        ...


class NvmlHandles(Protocol):
    """The agent's own NVML session, which holds every GPU's device file open while it is initialised."""

    def release_for_reset(self) -> None: ...

    def reacquire_after_reset(self) -> None: ...


@dataclass(slots=True)
class DeviceReset:
    """Waits until nobody holds the GPU's /dev/nvidiaN, then runs the reset command (`{uuid}` substituted)."""

    command: Sequence[str]
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
    _last: tuple[Holder, ...] = field(default=(), init=False)

    def __call__(self, uuid: str) -> ResetOutcome:
        if not UUID_PATTERN.match(uuid):
            return ResetOutcome(False, f"not a GPU UUID: {uuid[:80]!r}")
        minor = device_minor(uuid, driver_root=self.driver_root)
        if minor is None:
            return ResetOutcome(False, f"{uuid} is not in the driver's GPU table ({self.driver_root})")
        device = self.dev_root / f"nvidia{minor}"
        held = self._wait_free(device)
        if held:
            names = ", ".join(str(h) for h in held)
            return ResetOutcome(False, f"not reset: {device} still held after {self.holder_wait_seconds:g}s by "
                                       f"{names}", held)
        argv = [part.replace("{uuid}", uuid) for part in self.command]
        try:
            done = subprocess.run(  # noqa: S603 - the operator's configured command, no shell
                argv, capture_output=True, text=True, timeout=self.timeout_seconds, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return ResetOutcome(False, f"{argv[0]}: {exc}")
        lines = (done.stdout + done.stderr).strip().splitlines()
        last = lines[-1].strip() if lines else ""
        return ResetOutcome(done.returncode == 0, f"{argv[0]} exit {done.returncode}: {last}")

    def _wait_free(self, device: Path) -> tuple[Holder, ...]:
        deadline = self.clock() + self.holder_wait_seconds
        while True:
            held = tuple(h for h in holders_of(device, proc_root=self.proc_root) if h.name not in self.ignored_holders)
            if not held or self.clock() >= deadline:
                return held
            self.sleep(self.poll_seconds)


@dataclass(slots=True)
class ResetProcedure:
    """The whole reset, callable as the actuator's ResetRunner. Each step's failure is reported, and what
    was paused or released is put back whatever happened."""

    execute: ResetExecutor
    operands: OperandControl | None = None
    nvml: NvmlHandles | None = None

    def __call__(self, uuid: str) -> tuple[bool, str]:
        notes: list[str] = []
        released = False
        outcome = ResetOutcome(False, "not attempted")
        try:
            if self.operands is not None:
                notes.append(self.operands.pause())
            if self.nvml is not None:
                self.nvml.release_for_reset()
                released = True
            outcome = self.execute(uuid)
        except Exception as exc:  # noqa: BLE001 - a failed step fails the reset; the finally puts things back
            outcome = ResetOutcome(False, f"{type(exc).__name__}: {exc}")
        finally:
            if released and self.nvml is not None:
                try:
                    self.nvml.reacquire_after_reset()
                except Exception as exc:  # noqa: BLE001 - reported; the NVML source reports the GPUs unreadable
                    notes.append(f"NVML not reinitialised: {type(exc).__name__}: {exc}")
            if self.operands is not None:
                try:
                    notes.append(self.operands.restore())
                except Exception as exc:  # noqa: BLE001 - the record on the Node lets the next start restore
                    notes.append(f"operands not restored yet (the next reset or agent start restores them): "
                                 f"{type(exc).__name__}: {exc}")
        return outcome.ok, "; ".join(part for part in (outcome.message, *notes) if part)
