"""The agent's side of the fleet view, pure: which faults a hold covers, when the brake keeps a new taint
waiting, what the guard makes of both, and the summary an agent publishes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agent.fleet import BrakePolicy, Dimension, Hold
from agent.fleet.node_side import FleetReading, fleet_view
from agent.fleet.summariser import Summariser
from agent.model import Action, FaultClass, NodeInventory, PodRef, Severity, Signal, Step, StepKind, StepResult
from agent.pipeline import LocalActuator, Pipeline
from agent.remediation import ActiveFault, AttemptHistory, ClusterView, GuardPolicy, Mode, decide
from agent.remediation.guard import BRAKED, held_back
from agent.remediation.state import NodeState
from tests.conftest import gpu, obs

BRAKE = BrakePolicy(max_share=0.15, min_nodes=2, max_nodes=200, window_seconds=600.0)


@dataclass
class Source:
    """A FleetSource that counts its reads."""

    holds: tuple[Hold, ...] = ()
    quarantined: dict[str, float] = field(default_factory=dict)
    gpu_nodes: int = 10
    brake: BrakePolicy | None = BRAKE
    holds_error: str = ""
    count_error: str = ""
    reads: int = 0
    settle_seconds: float = 0.0
    settle_max_seconds: float = 0.0
    published: bool = True
    heard: dict[str, frozenset[str]] = field(default_factory=dict)
    controller_alive: bool = True
    controller_gone: bool = False
    now: float = 100.0
    fresh_after: list[float | None] = field(default_factory=list)

    def clock(self) -> float:
        return self.now

    def wall(self) -> float:
        return self.now

    #: The count a fresh list finds (None: the same as the cached one), and whether the count read is cached.
    fresh_quarantined: dict[str, float] | None = None
    count_cached: bool = False
    fresh_counts: int = 0

    #: What a claim on the brake answers ("": its place is granted), and the nodes that claimed.
    claim_refusal: str = ""
    claimed: list[str] = field(default_factory=list)

    def claim(self, node: str) -> str:
        self.claimed.append(node)
        return self.claim_refusal

    tidied: int = 0

    def tidy(self) -> None:
        self.tidied += 1

    def read(self, *, count: bool, fresh_after: float | None = None, fresh_count: bool = False) -> FleetReading:
        self.reads += 1
        self.fresh_after.append(fresh_after)
        self.fresh_counts += fresh_count
        fresh = fresh_count and self.fresh_quarantined is not None
        quarantined = self.fresh_quarantined if fresh and self.fresh_quarantined is not None else self.quarantined
        counted = count and not self.count_error
        return FleetReading(self.holds, self.now, self.gpu_nodes if counted else None,
                            quarantined if counted else {}, holds_error=self.holds_error,
                            count_error=self.count_error if count else "", published=self.published,
                            heard=self.heard, controller_alive=self.controller_alive,
                            controller_gone=self.controller_gone, count_cached=count and self.count_cached
                            and not fresh_count)


def hold(rule: str = "xid-119", nodes: tuple[str, ...] = ("n1",)) -> Hold:
    return Hold(f"{rule}/driver-version/570", rule, FaultClass.DRIVER, Dimension.DRIVER_VERSION, "570",
                "driver 570", frozenset(nodes), 0.0, 1000.0)


def fault(rule: str = "xid-119", cls: FaultClass = FaultClass.DRIVER, action: Action = Action.RESET_GPU,
          gpu: str = "GPU-0") -> ActiveFault:
    return ActiveFault(rule, gpu, Severity.FATAL, action, f"{rule} on {gpu}", 1.0, fault_class=cls)


def test_no_acting_fault_reads_nothing():
    """A healthy node, or one whose faults only notify, costs the API server nothing for the fleet view."""
    source = Source()
    view = fleet_view(source, node="n1", faults=[fault(action=Action.NOTIFY)], quarantined=False)
    assert (view.held, view.brake, view.settle_until) == ({}, "", None)
    assert source.reads == 0


def test_a_hold_covers_its_rule_on_its_nodes():
    """The hold's rule on a node it names is held; the hold's id and cause say why."""
    view = fleet_view(Source(holds=(hold(),)), node="n1", faults=[fault()], quarantined=False)
    assert view.held == {("GPU-0", "xid-119"): "held by fleet hold xid-119/driver-version/570: driver 570"}


def test_a_hold_never_covers_another_rule_another_node_or_a_hardware_fault():
    """A DBE (hardware), another rule, or the same rule on a node the hold does not name: acted on."""
    faults = [fault("xid-48", FaultClass.HARDWARE), fault("xid-120", gpu="GPU-1")]
    assert fleet_view(Source(holds=(hold(),)), node="n1", faults=faults, quarantined=False).held == {}
    assert fleet_view(Source(holds=(hold(),)), node="n2", faults=[fault()], quarantined=False).held == {}


def test_holds_that_cannot_be_read_again_still_hold():
    """A 503 on the holds read: the holds last read (each to its own expiry) still hold the node's fault."""
    source = Source(holds=(hold(),), holds_error="Unavailable: 503")
    view = fleet_view(source, node="n1", faults=[fault()], quarantined=False)
    assert view.held == {("GPU-0", "xid-119"): "held by fleet hold xid-119/driver-version/570: driver 570"}


def test_an_unreadable_count_leaves_the_claim_to_decide():
    """The brake cannot count the quarantined nodes: the taint is not let through on the count's say, it
    must claim its place (ranked against the brake's floor), and it is not refused for nothing counted."""
    source = Source(quarantined={"a": 50.0, "b": 60.0}, count_error="Unavailable: 503")
    view = fleet_view(source, node="n1", faults=[fault("xid-48", FaultClass.HARDWARE)], quarantined=False)
    assert (view.brake, view.claim) == ("", True)


def test_the_brake_keeps_a_new_quarantine_waiting_beyond_its_bound():
    """Two of ten GPU nodes newly quarantined within the window: a third waits."""
    view = fleet_view(Source(quarantined={"a": 50.0, "b": 60.0}), node="n1", faults=[fault("xid-48",
                      FaultClass.HARDWARE)], quarantined=False)
    assert view.brake.startswith("quarantine brake: 2 of 10 GPU nodes")


def test_the_brake_lets_a_node_already_counted_pass():
    """A node counted in the window (a restart, a retaint) is not new: it passes."""
    view = fleet_view(Source(quarantined={"a": 50.0, "n1": 60.0}), node="n1",
                      faults=[fault("xid-48", FaultClass.HARDWARE)], quarantined=False)
    assert view.brake == ""


def test_the_brake_is_not_asked_for_a_node_already_quarantined():
    """Already tainted: nothing new to count, nothing read."""
    source = Source(quarantined={"a": 50.0, "b": 60.0})
    assert fleet_view(source, node="n1", faults=[fault("xid-48", FaultClass.HARDWARE)], quarantined=True).brake == ""
    assert source.reads == 0


def test_the_guard_blocks_a_braked_taint_and_never_an_untaint():
    """The brake's reason blocks a new taint; untainting and clearing pass whatever it says."""
    cluster = ClusterView(brake="quarantine brake: full")
    policy = GuardPolicy(mode=Mode.QUARANTINE)
    taint = decide(Step(StepKind.TAINT, "n1", "x"), policy=policy, cluster=cluster, history=AttemptHistory(), now=1)
    untaint = decide(Step(StepKind.UNTAINT, "n1", "x"), policy=policy, cluster=cluster, history=AttemptHistory(),
                     now=1)
    assert (taint.result, taint.reason) == (StepResult.BLOCKED, "quarantine brake: full")
    assert untaint.proceed


def test_a_held_fault_keeps_its_severity_and_asks_for_nothing():
    """Held back: notify only (no taint, eviction, reset, reboot), same severity, the hold named."""
    faults = held_back({("GPU-0", "xid-119"): fault()}, {("GPU-0", "xid-119"): "held by fleet hold h"})
    held = faults[("GPU-0", "xid-119")]
    assert (held.action, held.severity) == (Action.NOTIFY, Severity.FATAL)
    assert held.summary.endswith("(held by fleet hold h)")


def test_a_hardware_fault_is_never_held_back():
    """Whatever the map says, a hardware fault keeps its action."""
    dbe = fault("xid-48", FaultClass.HARDWARE)
    assert held_back({("GPU-0", "xid-48"): dbe}, {("GPU-0", "xid-48"): "held"})[("GPU-0", "xid-48")] == dbe


def test_a_fault_the_fleet_view_was_not_read_for_asks_for_nothing_yet_whatever_its_class():
    """Recorded after the view's read: notify only, its summary unchanged (no condition text flaps); the
    faults the view judged, and every fault where no fleet view is configured, keep their action."""
    faults = {("GPU-0", "xid-119"): fault(), ("GPU-1", "xid-48"): fault("xid-48", FaultClass.HARDWARE, gpu="GPU-1"),
              ("GPU-2", "xid-79"): fault("xid-79", FaultClass.HARDWARE, Action.QUARANTINE, gpu="GPU-2")}
    planned = held_back(faults, {}, judged=frozenset({("GPU-0", "xid-119")}))
    assert planned[("GPU-0", "xid-119")] == faults[("GPU-0", "xid-119")]
    assert [planned[k].action for k in [("GPU-1", "xid-48"), ("GPU-2", "xid-79")]] == [Action.NOTIFY] * 2
    assert planned[("GPU-2", "xid-79")].summary == faults[("GPU-2", "xid-79")].summary
    assert held_back(faults, {}, judged=None) == faults


def test_the_view_says_which_faults_it_was_read_for():
    """Whatever it found, a view names the faults it judged, so a later verdict's fault is known unjudged."""
    source = Source()
    view = fleet_view(source, node="n1", faults=[fault(), fault("xid-13", FaultClass.APPLICATION, gpu="GPU-3")],
                      quarantined=False)
    assert view.judged == {("GPU-0", "xid-119"), ("GPU-3", "xid-13")}
    assert fleet_view(None, node="n1", faults=[fault()], quarantined=False).judged is None


def test_the_summary_names_each_faults_workloads_and_when_the_node_was_quarantined():
    """Owners of the pods on the faulty GPU; the quarantine's start kept across re-publishes, 0 once lifted."""
    wall = iter([500.0, 900.0])
    pods = (PodRef("ml", "a", gpu_uuids=("GPU-0",), owner="ml/Job/train"),
            PodRef("ml", "b", gpu_uuids=("GPU-1",), owner="ml/Job/other"))
    summarise = Summariser("n1", wall=lambda: next(wall), uptime=lambda: 10.0, pods=lambda: pods)
    document = {"faults": [fault().to_dict()], "remediation": {"tainted": True}}
    first, again = summarise.summary(document), summarise.summary(document)
    assert first.faults[0].owners == ("ml/Job/train",)
    assert (first.quarantined_since, again.quarantined_since) == (500.0, 500.0)
    assert summarise.summary({"faults": [], "remediation": {"tainted": False}}).quarantined_since == 0.0


def test_the_summary_takes_the_quarantine_start_the_record_keeps():
    """A restarted agent's summariser (no memory, its wall clock an hour on) publishes the start the durable
    record says, never a new one."""
    summarise = Summariser("n1", wall=lambda: 4100.0, uptime=lambda: 10.0)
    document = {"faults": [fault().to_dict()], "remediation": {"tainted": True, "quarantined_since": 500.0}}
    assert summarise.summary(document).quarantined_since == 500.0


def test_the_record_stamps_a_quarantine_once_keeps_it_and_clears_it_when_lifted():
    """The node state stamps the quarantine's start when a taint (node or device) takes effect, keeps it
    through its JSON form, and clears it once nothing keeps work off."""
    state = NodeState()
    state.apply(Step(StepKind.TAINT, "n1", "x"))
    assert state.mark_quarantine(500.0) and not state.mark_quarantine(900.0)
    restored = NodeState.from_json(state.to_json())
    assert restored.quarantined_since == 500.0
    restored.apply(Step(StepKind.UNTAINT, "n1", "x"))
    assert restored.mark_quarantine(1000.0) and restored.quarantined_since == 0.0


class _FaultDuringAnEvent(LocalActuator):
    """Applies every step; while the first Event is sent, a new fault arrives (from the source thread)."""

    def __init__(self) -> None:
        super().__init__()
        self.applied: list[StepKind] = []
        self.arrive: Callable[[], object] | None = None

    def apply(self, step: Step) -> tuple[StepResult, str]:
        self.applied.append(step.kind)
        if step.kind is StepKind.EVENT and self.arrive is not None:
            arrive, self.arrive = self.arrive, None
            arrive()
        return StepResult.APPLIED, "ok"


def test_a_fault_arriving_during_a_pass_still_waits_on_the_brake(shipped_rules):
    """The brake is asked again after each new verdict: a fault raised mid-pass is not tainted past it."""
    actuator = _FaultDuringAnEvent()
    p = Pipeline(rules=shipped_rules, inventory=NodeInventory("n1", (gpu(0), gpu(1)), ()),
                 policy=GuardPolicy(mode=Mode.QUARANTINE), actuator=actuator, clock=lambda: 100.0, inline=False,
                 fleet=Source(quarantined={"a": 50.0, "b": 60.0}))
    p.handle(obs(Signal.XID, 13, 1.0, gpu_ref=gpu(0)), 1.0)  # notify-only: an Event to send, nothing to taint
    actuator.arrive = lambda: p.handle(obs(Signal.XID, 79, 2.0, gpu_ref=gpu(1)), 2.0)
    p.reconcile(2.0)
    assert StepKind.TAINT not in actuator.applied and not p.record.node.tainted


def test_a_braked_fault_says_so_in_its_condition():
    """While the brake keeps the taint waiting, the quarantining fault's summary (its condition) says so."""
    faults = held_back({("GPU-0", "xid-48"): fault("xid-48", FaultClass.HARDWARE)}, {}, braked=True)
    assert faults[("GPU-0", "xid-48")].summary.endswith(f"({BRAKED})")


SETTLE = 10.0


def settling(**fields: object) -> Source:
    return Source(settle_seconds=SETTLE, **fields)  # type: ignore[arg-type]


def test_a_holdable_fault_waits_the_settle_before_it_acts():
    """Where a controller publishes holds, a new driver fault is held back for the settle after it was first
    seen, and the view says when the settle ends."""
    view = fleet_view(settling(), node="n1", faults=[fault()], quarantined=False,
                      first_seen={("GPU-0", "xid-119"): 95.0})
    assert view.held[("GPU-0", "xid-119")].startswith("fleet settle: waits 10 s")
    assert view.settle_until == 105.0


def test_after_the_settle_a_fault_acts_on_holds_read_since_it_ended():
    """Once the settle is over the fault is no longer held back, and the holds are read afresh after its end."""
    source = settling(now=106.0)
    view = fleet_view(source, node="n1", faults=[fault()], quarantined=False,
                      first_seen={("GPU-0", "xid-119"): 95.0})
    assert view.held == {} and view.settle_until is None
    assert source.fresh_after == [105.0]


def test_a_hold_read_after_the_settle_covers_the_fault():
    """The controller's hold, published during the settle, is what the node then finds: held, not acted on."""
    view = fleet_view(settling(now=106.0, holds=(hold(),)), node="n1", faults=[fault()], quarantined=False,
                      first_seen={("GPU-0", "xid-119"): 95.0})
    assert view.held[("GPU-0", "xid-119")].startswith("held by fleet hold")


def waiting_for_word(**fields: object) -> Source:
    return Source(**{"settle_seconds": SETTLE, "settle_max_seconds": 60.0, "now": 106.0, **fields})  # type: ignore[arg-type]


def test_past_the_settle_a_fault_the_controller_has_not_heard_of_waits_for_its_word():
    """The controller is alive but its last pass did not have this node's fault: held back, a pass due when
    the holds are read again, and the message says why."""
    view = fleet_view(waiting_for_word(), node="n1", faults=[fault()], quarantined=False,
                      first_seen={("GPU-0", "xid-119"): 95.0})
    assert view.held[("GPU-0", "xid-119")].startswith("fleet settle: the fleet controller has not heard")
    assert view.settle_until == 106.0 + 6.0


def test_while_waiting_for_the_word_the_holds_are_read_again_every_six_seconds():
    """Each pass past the settle asks for a read no older than six seconds, so the word is seen soon after
    the controller writes it and the node reads at most ten times a minute."""
    source = waiting_for_word(now=130.0)
    fleet_view(source, node="n1", faults=[fault()], quarantined=False, first_seen={("GPU-0", "xid-119"): 95.0})
    assert source.fresh_after == [124.0]


def test_a_fault_the_controller_heard_of_acts_when_no_hold_covers_it():
    """Heard, with no hold in the same write: the controller found no cause, so the node acts."""
    view = fleet_view(waiting_for_word(heard={"xid-119": frozenset({"n1"})}), node="n1", faults=[fault()],
                      quarantined=False, first_seen={("GPU-0", "xid-119"): 95.0})
    assert view.held == {} and view.settle_until is None


def test_the_wait_for_the_word_ends_at_its_bound():
    """Never heard of, 60 s after it was first seen: the node acts on its own evidence."""
    view = fleet_view(waiting_for_word(now=155.0), node="n1", faults=[fault()], quarantined=False,
                      first_seen={("GPU-0", "xid-119"): 95.0})
    assert view.held == {}


def test_no_wait_for_the_word_of_a_controller_that_stopped_writing():
    """Its promise to write again has lapsed: past the settle the node acts, heard or not."""
    view = fleet_view(waiting_for_word(controller_alive=False), node="n1", faults=[fault()], quarantined=False,
                      first_seen={("GPU-0", "xid-119"): 95.0})
    assert view.held == {}


def test_no_settle_once_the_controller_is_gone():
    """Its promise lapsed long ago (uninstalled, its holds object left behind): a new fault acts at once."""
    view = fleet_view(settling(controller_alive=False, controller_gone=True), node="n1", faults=[fault()],
                      quarantined=False, first_seen={("GPU-0", "xid-119"): 99.0})
    assert view.held == {}


def test_a_hold_ends_the_wait_for_the_word():
    """Not heard of by name, but a hold covers it: held by the hold, no further settle pass."""
    view = fleet_view(waiting_for_word(holds=(hold(),)), node="n1", faults=[fault()], quarantined=False,
                      first_seen={("GPU-0", "xid-119"): 95.0})
    assert view.held[("GPU-0", "xid-119")].startswith("held by fleet hold") and view.settle_until is None


def test_no_settle_where_no_controller_publishes_holds():
    """Without a holds object (no fleet controller deployed) a fault acts at once."""
    view = fleet_view(settling(published=False), node="n1", faults=[fault()], quarantined=False,
                      first_seen={("GPU-0", "xid-119"): 95.0})
    assert view.held == {}


def test_no_settle_for_a_hardware_fault():
    """A node's own hardware evidence (fell off the bus) is never held back, settle or not."""
    view = fleet_view(settling(), node="n1", faults=[fault("xid-79", FaultClass.HARDWARE, Action.REBOOT_NODE)],
                      quarantined=False, first_seen={("GPU-0", "xid-79"): 99.0})
    assert view.held == {}


def test_no_settle_on_a_node_already_quarantined():
    """A node already tainted (before a restart, for another fault) is not untainted by a settle."""
    view = fleet_view(settling(), node="n1", faults=[fault()], quarantined=True,
                      first_seen={("GPU-0", "xid-119"): 99.0})
    assert view.held == {}


def test_a_quarantine_the_count_allows_claims_its_place_before_the_taint():
    """The count has room: the view asks the taint to claim its place; a count without room asks no claim."""
    xid79 = fault("xid-79", FaultClass.HARDWARE, Action.QUARANTINE)
    assert fleet_view(Source(quarantined={}), node="n1", faults=[xid79], quarantined=False).claim
    full = Source(quarantined={f"m{i}": 95.0 for i in range(2)})  # the bound for 10 GPU nodes is 2
    view = fleet_view(full, node="n1", faults=[xid79], quarantined=False)
    assert view.brake.startswith("quarantine brake: 2 of 10") and not view.claim


class _Applying(LocalActuator):
    """Applies every step, and keeps each one."""

    def __init__(self) -> None:
        super().__init__()
        self.applied: list[Step] = []

    def apply(self, step: Step) -> tuple[StepResult, str]:
        self.applied.append(step)
        return StepResult.APPLIED, "ok"


REFUSAL = "quarantine brake: 2 of 10 GPU nodes newly quarantined or claimed first within 600 s (bound 2)"


def xid79_on_a_braked_node(rules: Any, source: Source, *, dry_run: bool = False) -> tuple[Pipeline, _Applying]:
    """Node n1's GPU 0 falls off the bus (Xid 79, quarantine mode) with `source` as its fleet view."""
    actuator = _Applying()
    p = Pipeline(rules=rules, inventory=NodeInventory("n1", (gpu(0),), ()),
                 policy=GuardPolicy(mode=Mode.QUARANTINE, dry_run=dry_run), actuator=actuator,
                 clock=lambda: 100.0, fleet=source)
    p.handle(obs(Signal.XID, 79, 1.0, gpu_ref=gpu(0)), 1.0)
    return p, actuator


def braked_events(actuator: _Applying) -> list[Step]:
    return [s for s in actuator.applied if s.kind is StepKind.EVENT and s.details.get("reason") == "QuarantineBraked"]


def test_a_refused_claim_keeps_the_taint_waiting_and_says_why(shipped_rules):
    """The count had room but other nodes claimed the places first: no taint, a QuarantineBraked Event owed,
    and the condition says the taint waits."""
    source = Source(quarantined={}, claim_refusal=REFUSAL)
    p, actuator = xid79_on_a_braked_node(shipped_rules, source)
    assert source.claimed == ["n1"] and not p.record.node.tainted
    assert StepKind.TAINT not in [s.kind for s in actuator.applied]
    assert len(braked_events(actuator)) == 1
    assert any(BRAKED in str(s.details.get("message")) for s in actuator.applied
               if s.kind is StepKind.SET_CONDITION)


def test_a_granted_claim_lets_the_taint_go(shipped_rules):
    """The claim is granted: the node is tainted, after one claim."""
    source = Source(quarantined={})
    p, _ = xid79_on_a_braked_node(shipped_rules, source)
    assert source.claimed == ["n1"] and p.record.node.tainted


def test_a_wait_on_a_refused_claim_owes_one_event_however_many_passes_ask_again(shipped_rules):
    """The count keeps having room and each pass's claim is refused: the wait goes on through the passes
    (the claim to come does not end it), so its Event is sent once."""
    source = Source(quarantined={}, claim_refusal=REFUSAL)
    p, actuator = xid79_on_a_braked_node(shipped_rules, source)
    p.reconcile(40.0)
    assert len(source.claimed) == 2 and len(braked_events(actuator)) == 1


def test_a_dry_run_gives_back_no_claim(shipped_rules):
    """Dry-run writes nothing, so neither does the claims' tidying (a leftover claim stays)."""
    source = Source(quarantined={})
    p, _ = xid79_on_a_braked_node(shipped_rules, source, dry_run=True)
    p.reconcile(40.0)
    assert source.tidied == 0 and source.claimed == []
