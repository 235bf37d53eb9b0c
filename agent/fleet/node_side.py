"""What the fleet's holds and the quarantine brake mean for one node's faults: the agent's side, pure."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from agent.fleet.brake import BrakePolicy, brake_allows, brake_bound, newly_quarantined
from agent.fleet.hold import Hold, covering_hold, holdable
from agent.fleet.summary import NodeSummary
from agent.fleet.unit import by_unit, live_units
from agent.model import Action, FaultClass


class FaultLike(Protocol):
    """What the node side needs of an active fault (agent.remediation's ActiveFault has it)."""

    @property
    def rule_id(self) -> str: ...

    @property
    def gpu_key(self) -> str: ...

    @property
    def fault_class(self) -> FaultClass: ...

    @property
    def action(self) -> Action: ...


@dataclass(frozen=True, slots=True)
class FleetReading:
    """One read of the fleet view: the holds on the reader's monotonic clock `now`, and for the brake the GPU
    nodes counted and when each was newly quarantined (same clock); `error` when it could not be read."""

    holds: tuple[Hold, ...] = ()
    now: float = 0.0
    gpu_nodes: int | None = None
    quarantined_at: Mapping[str, float] = field(default_factory=dict)
    #: Why the holds could not be read this time: `holds` are then the last ones read (each standing until
    #: its own expiry on this clock), never none for a failed read.
    holds_error: str = ""
    #: Why the brake's count could not be read (gpu_nodes is then None): the node's new quarantine may take
    #: only the brake's floor of places, by its claim (FleetSource.claim).
    count_error: str = ""
    #: Whether a fleet controller publishes holds here (the holds object exists): only then does a new
    #: quarantine of a holdable fault wait the settle for its word.
    published: bool = False
    #: What the controller heard of ({rule: nodes}), in the pass that wrote the holds read, and whether its
    #: promise to write again still stands by the reader's wall clock (False: gone, or an older controller).
    heard: Mapping[str, frozenset[str]] = field(default_factory=dict)
    controller_alive: bool = False
    #: The controller gave its word and its promise lapsed (uninstalled, or down longer than three ticks):
    #: nobody is there to hear of a fault, so a node does not wait the settle for it.
    controller_gone: bool = False
    #: This node's own summary as it last published it: what a scoped hold is judged against
    #: (agent.fleet.scope); None before its first, and where no hold read is scoped (not looked up then).
    own: NodeSummary | None = None
    #: Whether the brake's count came from the reader's cache (listed up to its count_seconds before) rather
    #: than listed for this read.
    count_cached: bool = False
    #: Why this node's last claim was refused, while that refusal stands (FleetSource.claim): the taint waits
    #: on it without claiming again every pass.
    refused: str = ""


class FleetSource(Protocol):
    """Reads the fleet view (agent.fleetapi.fleet_gate); `brake` None: no quarantine brake configured. `clock` is
    the monotonic clock its readings are on, `wall` the node's wall clock."""

    @property
    def brake(self) -> BrakePolicy | None: ...

    @property
    def settle_seconds(self) -> float: ...

    @property
    def settle_max_seconds(self) -> float: ...

    clock: Callable[[], float]
    wall: Callable[[], float]

    def read(self, *, count: bool, fresh_after: float | None = None, fresh_count: bool = False) -> FleetReading:
        """The holds (read again when the last read was before `fresh_after`), and with `count` the quarantine
        count (listed anew with `fresh_count`); never raises (an error is in the reading)."""
        ...

    def claim(self, node: str) -> str:
        """A write, made only for a taint the guard let past: `node`'s place among the new quarantines within
        the brake's window, ranked against every other node's claim; "" when it may be taken, else why the
        taint waits. Never raises."""
        ...

    def tidy(self) -> None:
        """Give back what this node claimed once its window has passed. Never raises."""
        ...


@dataclass(frozen=True, slots=True)
class FleetView:
    """What the guard is told: the faults (gpu_key, rule_id) a hold covers and why, and why a new quarantine
    of this node waits ("" when it may go ahead)."""

    held: Mapping[tuple[str, str], str] = field(default_factory=dict)
    brake: str = ""
    #: When the first settle of a holdable fault ends (the source's clock): the pass to run then.
    settle_until: float | None = None
    #: The faults (gpu_key, rule_id) this view was read for; None: every fault (no fleet view is configured).
    #: A fault recorded after the read (a verdict arriving mid-pass) is not judged: the guard holds its steps
    #: back until the next read, so it neither slips past a hold, the settle or the brake, nor waits long.
    judged: frozenset[tuple[str, str]] | None = None
    #: The count has room for this node's new quarantine: the step that takes it claims its place first
    #: (FleetSource.claim), which is exact where the count is not (agents counting at once each see room).
    claim: bool = False


#: How often a node past its settle, waiting to be heard, reads the holds again (at most 10 reads a minute).
HEARD_REREAD_SECONDS = 6.0


def acts(action: Action) -> bool:
    """Whether a fault with this action takes a taint, an eviction, a reset or a reboot request."""
    return action.quarantines or action.resets


#: A quarantine this much older than a hold's start (the reader's clock) was not the hold's to lift: the slack
#: covers the placement's rounding and a pass between the write and the read.
BEFORE_HOLD_SLACK_SECONDS = 1.0


def fleet_view(source: FleetSource | None, *, node: str, faults: Iterable[FaultLike], quarantined: bool,
               first_seen: Mapping[tuple[str, str], float] | None = None,
               quarantined_at: float | None = None) -> FleetView:
    """The fleet's word on this node's faults, read only when it can change what the node does: a holdable
    fault that acts, or a new quarantine the brake counts. A read error switches neither off: the last holds
    read stand until their own expiry, and the brake, left without a count, lets the node's claim rank it
    against the brake's floor.

    The settle: where a controller publishes holds, a node not yet quarantined takes no step for a holdable
    fault until `settle_seconds` after it first saw the fault (`first_seen`, on the source's clock), and then
    only on holds read after that: its summary reaches the controller first, so a fleet-wide cause is held
    before any node acts on it, not undone after. Past the settle, while the controller is alive and has not
    yet heard of the fault (a loaded API server delivers summaries late), the node keeps waiting for that
    word, reading again every HEARD_REREAD_SECONDS, until `settle_max_seconds` after it first saw it; a
    controller whose promise to write again lapsed is gone, and no node waits for it at all.

    A hold lifts only what it explains: a node quarantined (`quarantined_at`, the source's clock) before a
    controller's hold started acted on its own evidence before any correlation formed, so that hold does not
    take its taint away (an operator's hold does: it is a person's decision)."""
    if source is None:
        return FleetView()
    faults = list(faults)
    judged = frozenset((f.gpu_key, f.rule_id) for f in faults)
    holdable_acting = [f for f in faults if acts(f.action) and holdable(f.fault_class)]
    wants_quarantine = not quarantined and source.brake is not None and any(f.action.quarantines for f in faults)
    if not holdable_acting and not wants_quarantine:
        return FleetView(judged=judged)
    now = source.clock()
    settle = source.settle_seconds if not quarantined and first_seen is not None else 0.0
    seen = {(f.gpu_key, f.rule_id): first_seen.get((f.gpu_key, f.rule_id), now)
            for f in holdable_acting} if first_seen is not None and settle > 0 else {}
    ends = {key: at + settle for key, at in seen.items()}
    limits = {key: at + max(settle, source.settle_max_seconds) for key, at in seen.items()}
    fresh = [end if now >= limits[key] else max(end, now - HEARD_REREAD_SECONDS)
             for key, end in ends.items() if end <= now]
    # An unreadable holds object leaves the last holds read standing (their own expiry), and an unreadable
    # count leaves the brake its floor (the claim decides): a read error never switches either off.
    reading = source.read(count=wants_quarantine, fresh_after=max(fresh, default=None))
    rules = {(f.gpu_key, f.rule_id): f.rule_id for f in holdable_acting}
    held: dict[tuple[str, str], str] = {}
    for fault in holdable_acting:
        hold = covering_hold(reading.holds, node=node, rule_id=fault.rule_id, fault_class=fault.fault_class,
                             now=reading.now, own=reading.own)
        if hold is not None and quarantined and quarantined_at is not None and not hold.by_operator and \
                quarantined_at < hold.started_at - BEFORE_HOLD_SLACK_SECONDS:
            continue  # acted on before the correlation formed: not the hold's to undo
        if hold is not None:
            held[(fault.gpu_key, fault.rule_id)] = f"held by fleet hold {hold.id}: {hold.cause}"
    waiting: dict[tuple[str, str], float] = {}
    for key, end in ends.items():
        if not reading.published or reading.controller_gone or key in held:
            continue
        if reading.now < end:
            waiting[key] = end
            held[key] = (f"fleet settle: waits {settle:.0f} s for the fleet controller's word before acting "
                         f"({end - reading.now:.0f} s left)")
        elif reading.controller_alive and reading.now < limits[key] and \
                node not in reading.heard.get(rules[key], frozenset()):
            waiting[key] = min(limits[key], reading.now + HEARD_REREAD_SECONDS)
            held[key] = (f"fleet settle: the fleet controller has not heard of this fault yet; waits for its "
                         f"word up to {limits[key] - reading.now:.0f} s more")
    settle_until = min(waiting.values(), default=None)
    still_quarantines = any(f.action.quarantines and (f.gpu_key, f.rule_id) not in held for f in faults)
    brake, claim = "", False
    if wants_quarantine and still_quarantines and source.brake is not None:
        brake = brake_refusal(reading, node=node, policy=source.brake)
        # Room by the count (or no count: the floor's room): the taint claims its place once the guard lets
        # it past, and the claim decides.
        claim = not brake
    return FleetView(held, brake, settle_until, judged, claim)


def brake_refusal(reading: FleetReading, *, node: str, policy: BrakePolicy) -> str:
    """Why the brake keeps this node's new quarantine waiting, or "" when it may go ahead. The nodes of a
    published unit count as one (the controller judged them one fabric fault)."""
    if reading.refused:
        return reading.refused
    if reading.count_error:
        return ""  # nothing counted: the claim ranks this node against the floor (FleetSource.claim)
    units = by_unit(live_units(reading.holds, now=reading.now))
    if reading.gpu_nodes is None or brake_allows(node=node, quarantined_at=reading.quarantined_at,
                                                 gpu_nodes=reading.gpu_nodes, now=reading.now, policy=policy,
                                                 units=units):
        return ""
    window = newly_quarantined(reading.quarantined_at, now=reading.now, policy=policy, units=units)
    return (f"quarantine brake: {window} of {reading.gpu_nodes} GPU nodes newly quarantined within "
            f"{policy.window_seconds:.0f} s (bound {brake_bound(reading.gpu_nodes, policy)}); the taint waits")
