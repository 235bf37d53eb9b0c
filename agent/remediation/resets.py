"""When a GPU reset counts as done: a clean poll of that GPU after it; a reset by someone else from the driver's log."""

from __future__ import annotations

from agent.model import Observation, Signal

#: The recovery actions whose end, reported by the driver, means the GPU was recovered (NVML: 1 GPU_RESET,
#: 4 DRAIN_AND_RESET, 6 BUS_RESET by a reset; 5 RECOVER_IMEX_DOMAIN by whoever recovered the IMEX domain).
RESET_ACTIONS = frozenset({1, 4, 5, 6})
#: Of those, the one whose end is no reset of the GPU: the IMEX domain was recovered, the GPU was not touched.
IMEX_RECOVERY = 5


def unclean(poll: Observation, *, mig_expected: int = 0) -> list[str]:
    """Why one complete poll of a GPU (signal gpu_polled) does not show it recovered; empty when it does.

    Clean: recovery action none, no row remap or page retirement pending, volatile DBE 0, no NVLink down that
    was up before, and as many MIG devices as it had before the reset (`mig_expected`, 0: none recorded; a reset
    destroys the instances). A reading the GPU does not support (None) does not count against it."""
    attrs = poll.attrs
    reasons = []
    if mig_expected:
        mig = attrs.get("mig_devices")
        found = int(mig) if isinstance(mig, int | float) else 0
        if found < mig_expected:
            reasons.append(f"MIG devices {found} of the {mig_expected} it had before the reset (not re-created yet)")
    action = attrs.get("recovery_action")
    if isinstance(action, int) and action != 0:
        reasons.append(f"recovery action {action}")
    for name, text in (("remap_pending", "row remap pending"), ("retirement_pending", "page retirement pending"),
                       ("volatile_dbe", "volatile DBE count"), ("links_down", "NVLinks down")):
        value = attrs.get(name)
        if isinstance(value, int | float) and value:
            reasons.append(f"{text} {value:g}")
    return reasons


def reset_by_driver_log(observation: Observation) -> bool:
    """The driver's Xid 154 line says the GPU left a reset-requiring recovery action (or IMEX domain recovery)
    for none: it was reset or recovered (by someone else, or by the agent). NVIDIA prints the change as
    "GPU recovery action changed from 0x1 (GPU Reset Required) to 0x0 (None)" (Xid catalog, row 154)."""
    if observation.signal is not Signal.XID or int(observation.value) != 154:
        return False
    return driver_log_recovery(observation) != ""


def driver_log_recovery(observation: Observation) -> str:
    """What the driver's Xid 154 line says was done: "reset" (it left GPU reset, drain-and-reset or bus reset for
    none), "recovered" (it left IMEX domain recovery for none: the GPU itself was not reset), else ""."""
    if observation.signal is not Signal.XID or int(observation.value) != 154:
        return ""
    before, after = observation.attrs.get("recovery_action_from"), observation.attrs.get("recovery_action")
    if before not in RESET_ACTIONS or after != 0:
        return ""
    return "recovered" if before == IMEX_RECOVERY else "reset"
