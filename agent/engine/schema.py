"""The rule schema: what a rule in `rules/*.yaml` may say, checked strictly so mistakes fail at load."""

from __future__ import annotations

import copy
from fnmatch import fnmatchcase
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from agent.model import Action, FaultClass, Severity, Signal
from agent.strict import RecordInvalid, Strict, convert

ScalarValue = bool | int | float | str
ConditionOp = Literal["eq", "ne", "gt", "ge", "lt", "le", "in", "not_in", "bits_any", "bits_none", "present", "absent"]
_NEEDS_NOTHING = {"present", "absent"}
_NEEDS_LIST = {"in", "not_in"}
_NEEDS_INT = {"bits_any", "bits_none"}


NonEmpty = Annotated[str, Meta(min_length=1)]
NonNegative = Annotated[float, Meta(ge=0)]


class Condition(Strict, frozen=True, kw_only=True, omit_defaults=True):
    """One test on an observation: `field` is `value` or one of its attributes.

    Compare against a literal `value`, or against another attribute named by `ref` plus `offset`
    (so a temperature is judged against the GPU's own threshold, not a fleet-wide constant).
    """

    field: NonEmpty
    op: ConditionOp
    value: ScalarValue | list[ScalarValue] | None = None
    ref: str | None = None
    offset: float = 0.0

    def __post_init__(self) -> None:
        if self.op in _NEEDS_NOTHING:
            if self.value is not None or self.ref is not None:
                raise ValueError(f"op {self.op} takes neither value nor ref")
        elif self.op in _NEEDS_LIST:
            if not isinstance(self.value, list) or self.ref is not None:
                raise ValueError(f"op {self.op} needs a list in value")
        elif self.op in _NEEDS_INT:
            if isinstance(self.value, bool) or not isinstance(self.value, int) or self.ref is not None:
                raise ValueError(f"op {self.op} needs an integer bit mask in value")
        elif (self.value is None) == (self.ref is None):
            raise ValueError(f"op {self.op} needs exactly one of value or ref")
        elif isinstance(self.value, list):
            raise ValueError(f"op {self.op} needs a single value, not a list")


class Window(Strict, frozen=True, kw_only=True):
    """Fire after `count` occurrences within `seconds` (0: no time limit); with `distinct`, count
    distinct values of that attribute instead (e.g. different pods hitting the same GPU); with `per`, count
    the occurrences of each value of that attribute apart and fire when one value has `count` of them (e.g. the
    same NVLink link: an observation without the attribute counts for nothing)."""

    count: Annotated[int, Meta(ge=1)] = 1
    seconds: NonNegative = 0.0
    distinct: str | None = None
    per: NonEmpty | None = None

    def __post_init__(self) -> None:
        if self.count > 1 and self.seconds == 0:
            raise ValueError("a count above 1 needs seconds > 0 (N occurrences within T)")
        if self.per is not None and self.distinct is not None:
            raise ValueError("a window counts either distinct values or occurrences per value, not both")


RecoveryKind = Literal["quiet", "reset", "boot", "operator", "diagnostic", "recovered"]


class Recovery(Strict, frozen=True, kw_only=True):
    """How an active fault clears.

    quiet: no match for `quiet_seconds` (and, for polled levels, a healthy reading since);
    reset: a verified GPU reset or a new boot; boot: a new boot id; operator: only an operator release;
    diagnostic: a passing diagnostic of the GPU at NVIDIA's EUD depth (agent/diagnostics.py; a shallower pass
    lifts only a quarantine) or an operator release, never a timer;
    recovered: the driver reports the recovery done (its Xid 154 line: the action changed to none) and a clean
    poll verifies it, or a verified reset, or a new boot (for a recovery the driver asks of someone else, such
    as recovering the IMEX domain).
    """

    kind: RecoveryKind
    quiet_seconds: NonNegative = 0.0

    def __post_init__(self) -> None:
        if self.kind == "quiet" and self.quiet_seconds <= 0:
            raise ValueError("recovery kind quiet needs quiet_seconds > 0")
        if self.kind != "quiet" and self.quiet_seconds:
            raise ValueError(f"quiet_seconds applies only to recovery kind quiet, not {self.kind}")


#: The signals and Xids whose faults the driver itself reports recovered (the recovery action back to none).
_DRIVER_REPORTED_XIDS = frozenset({154})


def unreachable_recovery(action: Action, kind: str, signal: Signal, codes: frozenset[int]) -> str:
    """Why a fault with this action could never clear by this recovery ("" when it can). A quiet window and an
    operator's release are always reachable and a diagnostic runs where one is configured; a reset needs an action
    that resets the GPU (or reboots the node); a boot, an action that reboots it; `recovered`, a signal whose
    recovery the driver reports. Only what keeps work off a GPU is judged: a notification that never clears
    leaves a condition, not a quarantine."""
    if not action.quarantines or kind in {"quiet", "operator", "diagnostic"}:
        return ""
    if kind == "reset" and not (action.resets or action is Action.REBOOT_NODE):
        return (f"recovery reset cannot follow action {action}: the agent never resets the GPU for it, so the "
                "fault would never clear (use an action that resets, e.g. quarantine_reset_when_idle, or another "
                "recovery)")
    if kind == "boot" and action is not Action.REBOOT_NODE:
        return (f"recovery boot cannot follow action {action}: the agent never asks for a reboot for it, so the "
                "fault would stay until someone reboots (use reboot_node, or another recovery)")
    if kind == "recovered" and not (signal is Signal.RECOVERY_ACTION or codes & _DRIVER_REPORTED_XIDS):
        return ("recovery recovered needs a fault whose recovery the driver reports (signal recovery_action or "
                "Xid 154)")
    return ""


class Override(Strict, frozen=True, kw_only=True):
    """Per-GPU-model changes for heterogeneous fleets; `models` are shell patterns on the model name."""

    models: Annotated[list[str], Meta(min_length=1)]
    enabled: bool | None = None
    severity: Severity | None = None
    action: Action | None = None
    window: Window | None = None
    sustain_seconds: NonNegative | None = None

    def changes(self) -> dict[str, Any]:
        """What the override sets (its fields other than `models` that are not None)."""
        return {name: value for name in self.__struct_fields__ if name != "models"
                for value in [getattr(self, name)] if value is not None}

    def applies_to(self, model: str) -> bool:
        return any(fnmatchcase(model, pattern) for pattern in self.models)


class Rule(Strict, frozen=True, kw_only=True):
    """One classification rule: which observations it matches and what it decides about them."""

    id: Annotated[str, Meta(pattern=r"^[a-z0-9][a-z0-9.\-]*$")]
    signal: Signal
    code: int | list[int] | None = None
    when: list[Condition] = msgspec.field(default_factory=list)
    fallback: bool = False
    enabled: bool = True
    severity: Severity
    action: Action
    fault_class: FaultClass
    summary: NonEmpty
    source: NonEmpty
    nvidia_action: str | None = None
    reason: str | None = None
    window: Window = msgspec.field(default_factory=Window)
    sustain_seconds: NonNegative = 0.0
    recovery: Recovery
    overrides: list[Override] = msgspec.field(default_factory=list)
    #: Its fault is a contained incident (Xid 94, the driver's drain-and-reset): while it is active on a GPU, or
    #: when it follows within the incident settle window, the GPU's observations that rules read `contained_by`
    #: for (the DBE, Xid 48, Xid 64) name it there and are judged as contained (docs/rules.md).
    contains: bool = False

    def __post_init__(self) -> None:
        if self.code is not None and self.signal not in {Signal.XID, Signal.SXID}:
            raise ValueError("code applies only to the xid and sxid signals")
        if self.severity is Severity.OK:
            raise ValueError("severity ok is for cleared verdicts; a rule raises at least info")
        if self.action.quarantines and self.severity.rank < Severity.DEGRADED.rank:
            raise ValueError(f"action {self.action} needs severity degraded or fatal, not {self.severity}")
        if self.contains and self.action.evicts:
            raise ValueError(f"a contained incident (contains: true) evicts nobody, not action {self.action}")
        if self.fault_class is FaultClass.TELEMETRY and self.action.quarantines:
            raise ValueError("a telemetry (cannot read the GPU) rule must never quarantine")
        problem = unreachable_recovery(self.action, self.recovery.kind, self.signal, self.codes)
        if problem:
            raise ValueError(problem)
        self._overrides_valid()

    def _overrides_valid(self) -> None:
        """Each per-model override must leave a rule that would pass on its own: same checks, no loophole."""
        if not self.overrides:
            return
        base = msgspec.to_builtins(self)
        del base["overrides"]
        for position, override in enumerate(self.overrides):
            try:
                convert({**base, **msgspec.to_builtins(override.changes())}, Rule)
            except RecordInvalid as exc:
                models = ", ".join(override.models)
                raise ValueError(f"override {position + 1} (models {models}): {exc.reason}") from None

    @property
    def codes(self) -> frozenset[int]:
        if self.code is None:
            return frozenset()
        return frozenset([self.code] if isinstance(self.code, int) else self.code)

    def for_model(self, model: str) -> Rule:
        """This rule with every override for `model` applied, in file order."""
        update: dict[str, Any] = {}
        for override in self.overrides:
            if override.applies_to(model):
                update.update(override.changes())
        if not update:
            return self
        # Not validated again (as replace() would, against the other overrides too): each override was checked
        # at load against the rule it changes, and two overrides for one model may legitimately combine.
        variant = copy.copy(self)
        for name, value in update.items():
            msgspec.structs.force_setattr(variant, name, value)
        return variant


