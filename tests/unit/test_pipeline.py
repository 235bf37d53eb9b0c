from collections.abc import Callable
from pathlib import Path

from prometheus_client import CollectorRegistry

from agent.journal import Journal
from agent.metrics import Metrics
from agent.model import GpuRef, NodeInventory, Observation, PodRef, Signal, StepKind, StepResult, frozen_attrs
from agent.pipeline import LocalActuator, Pipeline
from agent.remediation import GuardPolicy, Mode
from tests.conftest import gpu, obs

NODE = NodeInventory("node-1", (gpu(0), gpu(1)), (PodRef("ml", "p0", "u0", (gpu(0).uuid,)),))


def pipeline(rules, journal=None, metrics=None):
    return Pipeline(rules=rules, inventory=NODE, policy=GuardPolicy(mode=Mode.REMEDIATE), journal=journal,
                    metrics=metrics, clock=lambda: 100.0)


def test_a_restart_does_not_raise_or_act_on_a_known_fault_again(shipped_rules, tmp_path: Path):
    journal = Journal(tmp_path / "j.db")
    first = pipeline(shipped_rules, journal)
    assert first.handle(obs(Signal.XID, 79, 1.0), 1.0).verdicts
    second = pipeline(shipped_rules, Journal(tmp_path / "j.db"))
    again = second.handle(obs(Signal.XID, 79, 2.0), 2.0)
    assert again.verdicts == []
    assert second.gpu_statuses()[gpu(0).key] == "fatal"


def test_a_pci_only_observation_is_resolved_to_the_full_gpu(shipped_rules):
    from agent.model import GpuRef
    p = pipeline(shipped_rules)
    [verdict] = p.handle(obs(Signal.XID, 79, 1.0, gpu_ref=GpuRef(pci_bus_id="0000:19:00")), 1.0).verdicts
    assert verdict.gpu == gpu(1)


def test_metrics_count_observations_verdicts_and_steps(shipped_rules):
    registry = CollectorRegistry()
    p = pipeline(shipped_rules, metrics=Metrics(registry))
    p.handle(obs(Signal.XID, 79, 99.5, source="kmsg"), 100.0)
    value = registry.get_sample_value
    assert value("gpu_health_observations_total", {"source": "kmsg", "signal": "xid"}) == 1
    assert value("gpu_health_verdicts_total", {"kind": "fault", "severity": "fatal", "fault_class": "hardware",
                                               "rule_id": "xid-79", "drill": "false"}) == 1
    assert value("gpu_health_remediation_steps_total", {"kind": "taint", "result": "planned"}) == 1
    assert value("gpu_health_gpu_status", {"gpu": "0", "UUID": gpu(0).uuid, "pci_bus_id": "00000000:18:00.0",
                                           "modelName": "NVIDIA H100 80GB HBM3", "Hostname": "node-1",
                                           "status": "fatal"}) == 1
    assert value("gpu_health_detection_latency_seconds_count") == 1
    assert value("gpu_health_detection_latency_seconds_sum") == 0.5
    assert value("gpu_health_faults_total", {"fault_class": "hardware", "severity": "fatal",
                                             "modelName": "NVIDIA H100 80GB HBM3"}) == 1
    assert value("gpu_health_detection_to_quarantine_seconds_count") == 0  # local mode only plans


def test_a_fault_on_a_gpu_the_inventory_lacks_is_labelled_by_what_the_fault_knows(shipped_rules):
    """A kernel-log Xid for a PCI address NVML never listed: its series names that address, not a made-up UUID."""
    registry = CollectorRegistry()
    p = pipeline(shipped_rules, metrics=Metrics(registry))
    p.handle(obs(Signal.XID, 79, 99.5, gpu_ref=GpuRef(pci_bus_id="0000:c1:00")), 100.0)
    assert registry.get_sample_value("gpu_health_gpu_status", {
        "gpu": "", "UUID": "", "pci_bus_id": "00000000:C1:00.0", "modelName": "", "Hostname": "node-1",
        "status": "fatal"}) == 1


def test_detection_to_quarantine_is_measured_when_the_taint_is_applied(shipped_rules):
    from agent.pipeline import LocalActuator

    class Applies(LocalActuator):
        def apply(self, step):
            return StepResult.APPLIED, "ok"

    registry = CollectorRegistry()
    p = Pipeline(rules=shipped_rules, inventory=NODE, policy=GuardPolicy(mode=Mode.REMEDIATE), actuator=Applies(),
                 metrics=Metrics(registry), clock=lambda: 100.0)
    p.handle(obs(Signal.XID, 79, 99.75), 100.0)
    assert registry.get_sample_value("gpu_health_detection_to_quarantine_seconds_sum") == 0.25


def test_a_blocked_step_is_retried_later(shipped_rules):
    from agent.pipeline import LocalGate
    from agent.remediation import GateReading

    class EmptyBudget(LocalGate):
        def __init__(self):
            self.available = False

        def acquire(self, rules=frozenset()):
            return GateReading(held=self.available)

        def read(self):
            return GateReading(limit=1 if self.available else 0)

    gate = EmptyBudget()
    p = Pipeline(rules=shipped_rules, inventory=NODE, policy=GuardPolicy(mode=Mode.REMEDIATE), gate=gate,
                 retry_seconds=30)
    first = p.handle(obs(Signal.XID, 79, 0.0), 0.0)
    assert {a.step.kind: str(a.result) for a in first.actions}[StepKind.EVICT] == "blocked"
    assert p.tick(10.0).actions == []
    gate.available = True
    retried = p.tick(40.0)  # the retry is jittered between 30 and 37.5 s
    assert [(a.step.kind, str(a.result)) for a in retried.actions if a.step.kind is StepKind.EVICT] == [
        (StepKind.EVICT, "planned")]


def test_a_broken_journal_does_not_stop_detection(shipped_rules, tmp_path: Path):
    journal = Journal(tmp_path / "j.db")
    p = pipeline(shipped_rules, journal)
    journal.close()
    assert p.handle(obs(Signal.XID, 79, 1.0), 1.0).verdicts


def test_time_to_recovery_is_measured_from_quarantine_to_clearing(shipped_rules):
    registry = CollectorRegistry()
    p = pipeline(shipped_rules, metrics=Metrics(registry))
    hot = {"shutdown_c": 92, "slowdown_c": 90}
    p.handle(obs(Signal.TEMPERATURE, 95, 10.0, **hot), 10.0)
    p.handle(obs(Signal.TEMPERATURE, 60, 20.0, **hot), 20.0)
    p.tick(700.0)
    assert registry.get_sample_value("gpu_health_time_to_recovery_seconds_sum") == 690.0


def test_local_mode_remembers_what_it_planned_across_a_restart(shipped_rules, tmp_path: Path):
    first = pipeline(shipped_rules, Journal(tmp_path / "j.db"))
    first.handle(obs(Signal.XID, 79, 1.0), 1.0)
    second = pipeline(shipped_rules, Journal(tmp_path / "j.db"))
    assert second.node.tainted
    assert second.tick(100.0).actions == []


def test_a_drill_fault_ends_by_itself_but_one_that_came_again_is_kept(shipped_rules, tmp_path: Path):
    """The drill's fault is released after DRILL_SECONDS; if the same Xid came again meanwhile it is real."""
    from agent.drill import DRILL_SECONDS, DrillBox, marked, new_request

    box = DrillBox(tmp_path / "drills")
    for again in (False, True):
        p = pipeline(shipped_rules)
        request = box.file(new_request(node="node-1", pci=gpu(1).pci_bus_id, xid=79, full=False,
                                       requested_by="oncall", now=0.0))
        p.handle(marked(obs(Signal.XID, 79, 1.0, gpu_ref=gpu(1)), request), 1.0)
        if again:
            p.handle(obs(Signal.XID, 79, 5.0, gpu_ref=gpu(1)), 5.0)
        p.tick(1.0 + DRILL_SECONDS)
        assert p.gpu_statuses()[gpu(1).key] == ("fatal" if again else "healthy")



def _converged(rules, monkeypatch) -> tuple[Pipeline, list[int]]:
    """A pipeline that reconciles on every observation, converged on an Xid 79, and its count of plans
    (through the seam agent.control.reconciler.plan)."""
    import agent.control.reconciler
    calls: list[int] = []
    real = agent.control.reconciler.plan

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(agent.control.reconciler, "plan", counted)
    p = Pipeline(rules=rules, inventory=NODE, policy=GuardPolicy(mode=Mode.REMEDIATE), sync_seconds=0.0,
                 clock=lambda: 100.0)
    p.handle(obs(Signal.XID, 79, 1.0), 1.0)
    p.handle(obs(Signal.XID, 79, 2.0), 2.0)
    assert calls
    return p, calls


def test_an_observation_that_changes_nothing_is_not_planned(shipped_rules, monkeypatch):
    """Once the node is converged, repeats of an active fault reconcile (every pass is due) but never plan."""
    p, calls = _converged(shipped_rules, monkeypatch)
    planned = len(calls)
    for at in range(3, 50):
        assert p.handle(obs(Signal.XID, 79, float(at)), float(at)).actions == []
    assert len(calls) == planned


def test_a_changed_node_state_is_planned_again(shipped_rules, monkeypatch):
    """A taint gone from the node (the node's state changed) is planned, and put back, on the next pass."""
    p, calls = _converged(shipped_rules, monkeypatch)
    planned = len(calls)
    p.record.node.tainted = False
    outcome = p.handle(obs(Signal.XID, 79, 3.0), 3.0)
    assert len(calls) > planned
    assert [a.step.kind for a in outcome.actions] == [StepKind.TAINT]


class _FaultDuring(LocalActuator):
    """Applies every step; while applying one of a given kind, a new fault arrives (from the source thread)."""

    def __init__(self):
        super().__init__()
        self.applied: list[StepKind] = []
        self.targets: list[tuple[StepKind, str]] = []
        self.during: tuple[StepKind, Callable[[], object]] | None = None

    def apply(self, step):
        self.applied.append(step.kind)
        self.targets.append((step.kind, step.target))
        if self.during is not None and step.kind is self.during[0]:
            arrive, self.during = self.during[1], None
            arrive()
        return StepResult.APPLIED, "ok"


def _released_while_a_fault_arrives(rules, during: StepKind) -> tuple[Pipeline, _FaultDuring]:
    actuator = _FaultDuring()
    p = Pipeline(rules=rules, inventory=NODE, policy=GuardPolicy(mode=Mode.QUARANTINE), actuator=actuator,
                 clock=lambda: 100.0, inline=False)
    p.handle(obs(Signal.XID, 79, 1.0), 1.0)
    p.reconcile(1.0)
    actuator.applied.clear()
    p.handle(obs(Signal.OPERATOR_RELEASE, 1, 2.0), 2.0)
    actuator.during = (during, lambda: p.handle(obs(Signal.XID, 79, 2.0, gpu_ref=gpu(1)), 2.0))
    p.reconcile(2.0)
    return p, actuator


def test_a_fault_arriving_during_a_release_drops_the_rest_of_the_stale_plan(shipped_rules):
    """The release's plan was made before the new fault: its untaint must not run, the node stays tainted."""
    p, actuator = _released_while_a_fault_arrives(shipped_rules, during=StepKind.CLEAR_CONDITION)
    assert StepKind.UNTAINT not in actuator.applied
    assert p.record.node.tainted


def test_a_fault_arriving_after_the_untaint_is_tainted_before_the_passs_events(shipped_rules):
    """The new fault's taint is the next write, not one after the release's Events."""
    p, actuator = _released_while_a_fault_arrives(shipped_rules, during=StepKind.UNTAINT)
    assert actuator.applied[:3] == [StepKind.CLEAR_CONDITION, StepKind.UNTAINT, StepKind.TAINT]
    assert p.record.node.tainted


TWO_PODS = NodeInventory("node-1", (gpu(0), gpu(1)), (PodRef("ml", "p0", "u0", (gpu(0).uuid,)),
                                                       PodRef("ml", "p1", "u1", (gpu(1).uuid,))))


def test_a_release_during_a_pass_stops_the_evictions_planned_for_the_released_gpu(shipped_rules):
    """The plan made before the operator released GPU 1 would still evict its pod; that rest is dropped."""
    actuator = _FaultDuring()
    p = Pipeline(rules=shipped_rules, inventory=TWO_PODS, policy=GuardPolicy(mode=Mode.REMEDIATE),
                 actuator=actuator, clock=lambda: 100.0, inline=False)
    p.handle(obs(Signal.XID, 48, 1.0, gpu_ref=gpu(0)), 1.0)
    p.handle(obs(Signal.XID, 48, 1.0, gpu_ref=gpu(1)), 1.0)
    actuator.during = (StepKind.EVICT, lambda: p.handle(obs(Signal.OPERATOR_RELEASE, 1, 2.0, gpu_ref=gpu(1)), 2.0))
    p.reconcile(2.0)
    assert [target for kind, target in actuator.targets if kind is StepKind.EVICT] == ["ml/p0"]


def test_a_reset_verdict_that_ends_another_gpus_wait_does_not_break_the_tick(shipped_rules):
    """Failing one GPU's unverified reset may forget another GPU's wait while the tick is looking at it."""

    class ReleasesGpu1DuringItsReset(LocalActuator):
        def apply(self, step):
            if step.kind is StepKind.RESET_GPU and step.target == gpu(1).uuid:
                p.handle(obs(Signal.OPERATOR_RELEASE, 1, 2.0, gpu_ref=gpu(1)), 2.0)
            return StepResult.APPLIED, "ok"

    p = Pipeline(rules=shipped_rules, inventory=NodeInventory("node-1", (gpu(0), gpu(1)), ()),
                 policy=GuardPolicy(mode=Mode.REMEDIATE), actuator=ReleasesGpu1DuringItsReset(),
                 clock=lambda: 100.0, inline=False, reset_settle_seconds=0.0, reset_verify_seconds=60.0)
    p.handle(obs(Signal.XID, 48, 1.0, gpu_ref=gpu(0)), 1.0)
    p.handle(obs(Signal.XID, 48, 1.0, gpu_ref=gpu(1)), 1.0)
    p.reconcile(2.0)
    failed = p.tick(200.0).verdicts
    assert [v.rule_id for v in failed if v.gpu_key == gpu(0).key] == ["gpu-reset-failed"]


def test_with_a_fixed_pod_list_a_pod_on_two_faulty_gpus_is_evicted_once_even_after_one_recovers(shipped_rules):
    """Local mode lists pods once: the pod evicted for GPU 0 is not evicted for GPU 1, then or after GPU 0's
    release."""
    actuator = _FaultDuring()
    shared = NodeInventory("node-1", (gpu(0), gpu(1)), (PodRef("ml", "pair", "u0", (gpu(0).uuid, gpu(1).uuid)),))
    p = Pipeline(rules=shipped_rules, inventory=shared, policy=GuardPolicy(mode=Mode.REMEDIATE), actuator=actuator,
                 clock=lambda: 100.0, inline=False)
    p.handle(obs(Signal.XID, 48, 1.0, gpu_ref=gpu(0)), 1.0)
    p.reconcile(1.0)
    p.handle(obs(Signal.XID, 48, 2.0, gpu_ref=gpu(1)), 2.0)
    p.reconcile(2.0)
    p.handle(obs(Signal.OPERATOR_RELEASE, 1, 3.0, gpu_ref=gpu(0)), 3.0)
    p.reconcile(3.0)
    assert [target for kind, target in actuator.targets if kind is StepKind.EVICT] == ["ml/pair"]


def _kmsg_xid(code: int, seq: int, at: float) -> Observation:
    """A kernel-log Xid on GPU 0 as the kmsg source gives it: source "kmsg", its record's sequence number."""
    return obs(Signal.XID, code, at, source="kmsg", kmsg_seq=seq, message=f"m{seq}")


def _booted(rules, journal: Journal) -> Pipeline:
    booted = pipeline(rules, journal)
    booted.handle(Observation(Signal.BOOT, 0, 0.5, "kmsg", attrs=frozen_attrs({"boot_id": "boot-a"})), 0.5)
    return booted


def test_a_kernel_log_record_that_changes_nothing_writes_its_cursor_alone_not_the_record(shipped_rules,
                                                                                         tmp_path: Path):
    """In a storm of repeats the durable record is not rewritten once a line: each record's cursor is
    written alone, at once; the write that raised the fault carried its own."""
    journal = Journal(tmp_path / "j.db")
    first = _booted(shipped_rules, journal)
    assert first.handle(_kmsg_xid(31, 1, 1.0), 1.0).verdicts
    generation = journal.record("node-1")["generation"]
    for seq in range(2, 50):
        assert first.handle(_kmsg_xid(31, seq, 1.0 + seq / 1000), 1.0 + seq / 1000).verdicts == []
        assert journal.cursor("kmsg") == f"boot-a:{seq}"
    assert journal.record("node-1")["generation"] == generation


def test_after_a_crash_no_record_handled_is_read_again(shipped_rules, tmp_path: Path):
    """The new agent resumes after the last record handled, though the record was last written before it:
    records classified with what the dead agent knew in memory (here, that workload w faulted on GPU 1, so
    it does not count against GPU 0) are never classified again without it."""
    journal = Journal(tmp_path / "j.db")
    first = _booted(shipped_rules, journal)
    first.handle(obs(Signal.XID, 13, 1.0, source="kmsg", kmsg_seq=1), 1.0)
    first.handle(obs(Signal.XID, 13, 2.0, gpu_ref=gpu(1), source="kmsg", kmsg_seq=2, workload="w"), 2.0)
    for seq, workload in ((3, "a"), (4, "b"), (5, "w")):
        assert first.handle(obs(Signal.XID, 13, seq, source="kmsg", kmsg_seq=seq, workload=workload), seq) \
            .verdicts == []
    second = pipeline(shipped_rules, Journal(tmp_path / "j.db"))  # the first was killed here
    assert second.record.cursors["kmsg"] == "boot-a:5"


def test_a_folded_observation_keeps_its_count_when_its_gpu_is_resolved(shipped_rules):
    """A kernel-log storm's observation names the GPU by PCI address and carries the repeats folded into it:
    resolved to the inventory's GPU, it still counts every one of them."""
    p = pipeline(shipped_rules)
    p.handle(obs(Signal.XID, 31, 1.0, gpu_ref=GpuRef(pci_bus_id=gpu(0).pci_bus_id), count=5), 1.0)
    assert p.occurrences(gpu(0).key, "xid-31") == 5


def _skipped_evictions(history: list[dict[str, object]]) -> list[dict[str, object]]:
    return [e for e in history if e["type"] == "action" and e["result"] == "skipped" and e["kind"] == "evict"]


def test_a_skipped_eviction_is_logged_and_journaled_once_over_many_passes(shipped_rules, tmp_path: Path, capsys):
    """Quarantine mode: Xid 119 repeating over many passes gives one `evict skipped` line and one journal row."""
    import json

    from agent import logs
    logs.configure_logging("info", "json")
    journal = Journal(tmp_path / "j.db")
    p = Pipeline(rules=shipped_rules, inventory=NODE, policy=GuardPolicy(mode=Mode.QUARANTINE), journal=journal,
                 clock=lambda: 100.0, inline=False)
    capsys.readouterr()
    for at in range(1, 40):
        p.handle(obs(Signal.XID, 119, float(at)), float(at))
        p.reconcile(float(at) * 31)
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line.startswith("{")]
    skipped = [r for r in lines if r["event"] == "step" and r.get("kind") == "evict" and r.get("result") == "skipped"]
    assert len(skipped) == 1
    assert len(_skipped_evictions(journal.history(limit=10_000))) == 1


def test_a_skipped_eviction_is_journaled_again_once_it_changes(shipped_rules, tmp_path: Path):
    """Once per change: an eviction skipped while the node is opted out is journaled once, then again as it runs."""
    from agent.remediation.record import NodeObservation

    class OptOut(LocalActuator):
        opted_out = True

        def observe(self, devices=True):
            return NodeObservation(conditions={}, tainted=False, reboot_requested=False, replacement=frozenset(),
                                   opted_out=self.opted_out)

    actuator = OptOut()
    journal = Journal(tmp_path / "j.db")
    p = Pipeline(rules=shipped_rules, inventory=NODE, policy=GuardPolicy(mode=Mode.REMEDIATE), journal=journal,
                 actuator=actuator, clock=lambda: 100.0, inline=False)
    p.handle(obs(Signal.XID, 119, 1.0), 1.0)
    for at in (1.0, 40.0, 80.0):
        p.reconcile(at)
    actuator.opted_out = False
    p.reconcile(120.0)
    history = journal.history(limit=10_000)
    evictions = [e for e in history if e["type"] == "action" and e["kind"] == "evict"]
    assert [e["result"] for e in history if e["type"] == "action" and e["kind"] == "taint"][:2] == \
        ["skipped", "planned"]  # the node-wide taint (no GPU named) too
    assert [(e["result"], e["message"]) for e in evictions] == [
        ("skipped", "node opted out of remediation by label"),
        ("planned", "started: the result is journaled when it returns"),
        ("planned", "local mode: no cluster to act on")]


def test_a_newer_cut_node_copy_never_takes_faults_the_journal_holds(shipped_rules, tmp_path: Path):
    """The Node's copy is newer but cut (bounded): a process with its journal keeps the faults the copy dropped."""
    from agent.remediation.record import NodeObservation, mirror_of

    first = pipeline(shipped_rules)
    first.inline = False
    for code in range(1, 161):
        for g in (gpu(0), gpu(1)):
            first.handle(obs(Signal.XID, code, 1.0, gpu_ref=g), 1.0)
        if code == 100:
            older = first.record.to_json()  # what a journal restored from a backup would hold
    cut = mirror_of(first.record.to_json())
    assert cut["truncated"]["kept_faults"] < len(older["faults"])

    class CutCopy(LocalActuator):
        def observe(self, devices=True):
            return NodeObservation(conditions={}, tainted=False, reboot_requested=False, replacement=frozenset(),
                                   record=cut)

    journal = Journal(tmp_path / "j.db")
    journal.save_record(NODE.name, older)
    second = Pipeline(rules=shipped_rules, inventory=NODE, policy=GuardPolicy(mode=Mode.QUARANTINE),
                      journal=journal, actuator=CutCopy(), clock=lambda: 100.0, inline=False)
    second.start()
    held = {(f["gpu_key"], f["rule_id"]) for f in older["faults"]}
    assert held <= set(second.record.faults)
    assert second.record.generation > cut["generation"]  # adopted, then saved


def test_a_node_wide_eviction_skipped_in_quarantine_is_journaled_once_per_pod(shipped_rules, tmp_path: Path):
    """Xid 119 arriving on 6 GPUs (past max_faulty_gpus the node as a whole is taken out): over many passes each
    skipped eviction, the node-wide ones too (no fault of their own), is one row."""
    gpus = tuple(gpu(i) for i in range(6))
    node = NodeInventory("node-1", gpus, tuple(PodRef("ml", f"p{i}", f"u{i}", (g.uuid,)) for i, g in enumerate(gpus)))
    journal = Journal(tmp_path / "j.db")
    p = Pipeline(rules=shipped_rules, inventory=node, policy=GuardPolicy(mode=Mode.QUARANTINE), journal=journal,
                 clock=lambda: 100.0)
    for at in range(1, 20):
        for g in gpus:  # inline: a pass after each new fault, then one each time a pass is due
            p.handle(obs(Signal.XID, 119, float(at), gpu_ref=g), float(at) * 31)
    rows = [(e["target"], e["gpu_key"], e["rule_id"]) for e in _skipped_evictions(journal.history(limit=10_000))]
    assert any(rule == "node-too-many-faulty-gpus" for _, _, rule in rows)
    assert len(rows) == len(set(rows))


def test_a_noexecute_device_taint_is_journaled_before_the_next_step(shipped_rules, tmp_path: Path):
    """A NoExecute device taint deletes pods like an eviction: the record holds it before anything else runs."""
    from agent.model import DeviceRef
    from agent.remediation.record import NodeObservation, NodeRecord
    from agent.remediation.state import DeviceIsolation

    journal = Journal(tmp_path / "j.db")
    device = DeviceRef("gpu.nvidia.com", "node-1", "gpu-0")
    seen: list[dict[str, object]] = []

    class DraNode(LocalActuator):
        def observe(self, devices=True):
            return NodeObservation({}, False, False, frozenset(), device_taints={},
                                   devices=DeviceIsolation({gpu(0).uuid: (device,)}, effect="NoExecute"))

        def apply(self, step):
            if seen == [{}]:  # the step right after the NoExecute taint
                seen[0] = NodeRecord.from_json(journal.record("node-1") or {}).node.to_json()
            if step.details.get("effect") == "NoExecute":
                seen.append({})
            return StepResult.APPLIED, "ok"

    idle = NodeInventory("node-1", NODE.gpus, ())
    p = Pipeline(rules=shipped_rules, inventory=idle, policy=GuardPolicy(mode=Mode.REMEDIATE), journal=journal,
                 actuator=DraNode(), clock=lambda: 100.0)
    p.handle(obs(Signal.XID, 79, 1.0), 1.0)
    assert seen and seen[0]["device_taints"] == [{"driver": "gpu.nvidia.com", "pool": "node-1",
                                                    "device": "gpu-0", "gpu": gpu(0).uuid, "effect": "NoExecute"}]
