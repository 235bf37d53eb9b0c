"""Remediation on a cluster: the real client and actuators against the fake API server over HTTP."""

import pytest

from agent.fleet import BrakePolicy, brake_bound
from agent.k8s.node import AGENT_CONDITIONS
from agent.model import Observation, Signal, StepKind, StepResult
from agent.remediation import Mode
from agent.simulation.fake_apiserver.resources import RESOURCES
from tests.k8s_helpers import TAINT, gpu_node, grace_period_passes, make_agent, operator_client, running_pods

pytestmark = pytest.mark.usefixtures("no_retry_sleep")


def resource(plural):
    return next(r for r in RESOURCES if r.plural == plural)


def results(outcome):
    return {(a.step.kind, a.step.target): a.result for a in outcome.actions}


def our_conditions(node):
    return {c["type"]: c for c in node["status"]["conditions"] if c["type"] in AGENT_CONDITIONS}


def test_a_fatal_fault_taints_conditions_and_evicts_exactly_the_pod_on_that_gpu(fake):
    cluster, server = fake
    agent = make_agent(cluster, server, gpu_node("n1"))
    outcome = agent.fault(3)
    assert set(results(outcome).values()) == {StepResult.APPLIED}
    node = cluster.node("n1")
    assert [t["key"] for t in node["spec"]["taints"]] == [TAINT]
    assert node["spec"]["taints"][0]["effect"] == "NoSchedule"
    condition = our_conditions(node)["GpuFatalFault"]
    assert condition["status"] == "True"
    assert "GPU-n1-0003" in condition["message"] and "0000:1b:00.0" in condition["message"]
    assert "xid-79" in condition["message"]
    pods = {p["metadata"]["name"]: p for p in cluster.pods_on("n1")}
    # The real server's kubelet (kwok) may have finished the deletion already: terminating or gone.
    untouched = {name for name, pod in pods.items() if not pod["metadata"].get("deletionTimestamp")}
    assert untouched == {f"n1-trainer-{i}" for i in (0, 1, 2, 4, 5, 6, 7)} | {"gpu-health-agent-n1"}
    grace_period_passes(cluster)
    remaining = {p["metadata"]["name"] for p in cluster.pods_on("n1")}
    assert "n1-trainer-3" not in remaining
    assert {f"n1-trainer-{i}" for i in (0, 1, 2, 4, 5, 6, 7)} | {"gpu-health-agent-n1"} == remaining


def test_events_regard_the_node_and_the_evicted_pod(fake):
    cluster, server = fake
    make_agent(cluster, server, gpu_node("n1")).fault(3)
    events = cluster.events()
    kinds = {(e["regarding"]["kind"], e["reason"]) for e in events}
    assert ("Node", "GpuFatalFault") in kinds
    assert ("Pod", "EvictedForGpuFault") in kinds
    for event in events:
        assert event["reportingController"] == "gpu-health-agent.io/agent"
        assert event["reportingInstance"]
        assert event["reason"][0].isupper() and "_" not in event["reason"]
        assert len(event["note"]) <= 1024


def test_the_eviction_event_names_the_evicted_pods_uid(fake):
    """`kubectl describe pod` selects a pod's Events by its uid: the EvictedForGpuFault Event carries it."""
    cluster, server = fake
    agent = make_agent(cluster, server, gpu_node("n1"))
    uid = next(p["metadata"]["uid"] for p in cluster.pods_on("n1") if p["metadata"]["name"] == "n1-trainer-3")
    agent.fault(3)
    [event] = [e for e in cluster.events() if e["reason"] == "EvictedForGpuFault"
               and e["regarding"]["name"] == "n1-trainer-3"]
    assert event["regarding"]["uid"] == uid


def test_an_eviction_meant_for_an_earlier_incarnation_leaves_the_pod_of_that_name_running(fake):
    """The eviction names the uid of the pod found on the GPU: a pod of the same name that is not that one
    (recreated meanwhile) is refused by the API server (409) and left running; the eviction counts as done."""
    cluster, server = fake
    agent = make_agent(cluster, server, gpu_node("n1"))
    result = agent.evictor.evict("ml", "n1-trainer-3", uid="an-earlier-incarnation")
    assert result.outcome.value == "gone"
    assert "n1-trainer-3" in running_pods(cluster, "n1")


def test_repeated_events_are_folded_into_a_series(fake):
    cluster, server = fake
    agent = make_agent(cluster, server, gpu_node("n1"))
    for _ in range(3):
        agent.actuator.events.record(regarding={"kind": "Node", "apiVersion": "v1", "name": "n1"},
                                     reason="GpuWarning", action="Record", note="same")
    [event] = [e for e in cluster.events() if e["reason"] == "GpuWarning"]
    assert event["series"]["count"] == 3


def test_an_application_fault_changes_nothing_on_the_node(fake):
    cluster, server = fake
    agent = make_agent(cluster, server, gpu_node("n1"))
    before = cluster.node("n1")
    agent.fault(1, xid=13)
    after = cluster.node("n1")
    assert after["spec"] == before["spec"]
    assert our_conditions(after) == {}
    assert len(running_pods(cluster, "n1")) == 9


def test_last_transition_time_is_kept_while_the_status_holds(fake):
    cluster, server = fake
    agent = make_agent(cluster, server, gpu_node("n1"))
    writer = agent.side.writer
    writer.set_condition("GpuDegraded", status=True, reason="GpuDegraded", message="first")
    first = our_conditions(cluster.node("n1"))["GpuDegraded"]["lastTransitionTime"]
    cluster.node("n1")["status"]["conditions"][-1]["lastTransitionTime"] = "2020-01-01T00:00:00Z"
    writer.set_condition("GpuDegraded", status=True, reason="GpuDegraded", message="second")
    assert our_conditions(cluster.node("n1"))["GpuDegraded"]["lastTransitionTime"] == first


def test_recovery_clears_the_agents_marks_and_nothing_else(fake):
    cluster, server = fake
    inventory = gpu_node("n1")
    agent = make_agent(cluster, server, inventory)
    node = cluster.node("n1")
    node["spec"]["taints"] = [{"key": "someone/else", "effect": "NoSchedule"}]
    cluster.replace(resource("nodes"), "", "n1", node)
    agent.pipeline.handle(Observation(Signal.TEMPERATURE, 95, 1.0, "nvml", inventory.gpus[2],
                                      {"shutdown_c": 92, "slowdown_c": 90}), 1.0)
    assert {t["key"] for t in cluster.node("n1")["spec"]["taints"]} == {"someone/else", TAINT}
    agent.pipeline.handle(Observation(Signal.TEMPERATURE, 70, 2.0, "nvml", inventory.gpus[2],
                                      {"shutdown_c": 92, "slowdown_c": 90}), 2.0)
    outcome = agent.pipeline.tick(700.0)
    assert outcome.verdicts and outcome.verdicts[0].kind == "cleared"
    node = cluster.node("n1")
    assert [t["key"] for t in node["spec"]["taints"]] == ["someone/else"]
    assert our_conditions(node)["GpuFatalFault"]["status"] == "False"


@pytest.mark.fake_only
def test_every_first_write_answered_409_still_lands(fake):
    cluster, server = fake
    agent = make_agent(cluster, server, gpu_node("n1"))
    cluster.faults.conflict_first_write = True
    outcome = agent.fault(3)
    assert results(outcome)[(StepKind.TAINT, "n1")] is StepResult.APPLIED
    assert results(outcome)[(StepKind.SET_CONDITION, "GpuFatalFault")] is StepResult.APPLIED
    assert [t["key"] for t in cluster.node("n1")["spec"]["taints"]] == [TAINT]
    assert any(code == 409 for _, _, code in cluster.log)


@pytest.mark.fake_only
def test_an_api_server_that_is_down_fails_the_steps_and_they_land_when_it_is_back(fake):
    cluster, server = fake
    agent = make_agent(cluster, server, gpu_node("n1"), retry_seconds=5)
    cluster.faults.down = True
    outcome = agent.fault(3)
    assert {a.result for a in outcome.actions if a.step.kind is not StepKind.EVENT} <= {StepResult.FAILED,
                                                                                          StepResult.BLOCKED}
    cluster.faults.down = False
    retried = agent.pipeline.tick(10.0)
    assert results(retried)[(StepKind.TAINT, "n1")] is StepResult.APPLIED
    assert any(e["reason"] == "GpuFatalFault" for e in cluster.events())  # the refused Event was sent again
    grace_period_passes(cluster)
    assert "n1-trainer-3" not in {p["metadata"]["name"] for p in cluster.pods_on("n1")}


def test_a_pdb_that_blocks_past_the_deadline_is_never_forced(fake):
    cluster, server = fake
    now = [0.0]
    agent = make_agent(cluster, server, gpu_node("n1"), deadline=60, clock=lambda: now[0], retry_seconds=5)
    selector = {"matchLabels": {"app": "n1-trainer"}}
    cluster.add("poddisruptionbudgets", {"metadata": {"name": "trainers"},
                                         "spec": {"maxUnavailable": 0, "selector": selector}},
                group="policy", namespace="ml")
    first = agent.fault(3)
    assert results(first)[(StepKind.EVICT, "ml/n1-trainer-3")] is StepResult.BLOCKED
    now[0] = 30.0
    assert results(agent.pipeline.tick(10.0))[(StepKind.EVICT, "ml/n1-trainer-3")] is StepResult.BLOCKED
    now[0] = 61.0
    stuck = agent.pipeline.tick(20.0)
    assert results(stuck)[(StepKind.EVICT, "ml/n1-trainer-3")] is StepResult.FAILED
    assert agent.stuck == ["ml/n1-trainer-3"]
    assert "n1-trainer-3" in running_pods(cluster, "n1")
    assert any(e["reason"] == "EvictionStuck" for e in cluster.events())
    assert results(agent.pipeline.tick(40.0)).get((StepKind.EVICT, "ml/n1-trainer-3")) is StepResult.SKIPPED


def test_a_restart_mid_remediation_repeats_no_eviction(fake):
    cluster, server = fake
    inventory = gpu_node("n1")
    make_agent(cluster, server, inventory).fault(3)
    evictions = [entry for entry in cluster.log if entry[1].endswith("/eviction")]
    restarted = make_agent(cluster, server, inventory, populate_node=False, restore=True)
    assert restarted.pipeline.gpu_statuses()["GPU-n1-0003"] == "fatal"
    again = restarted.fault(3, at=50.0)
    assert again.verdicts == []
    assert [entry for entry in cluster.log if entry[1].endswith("/eviction")] == evictions
    assert not any(a.step.kind is StepKind.EVICT for a in restarted.pipeline.tick(100.0).actions)


def test_a_healthy_node_writes_nothing(fake):
    cluster, server = fake
    inventory = gpu_node("n1")
    agent = make_agent(cluster, server, inventory)
    writes = cluster.faults.writes
    for t in range(200):
        agent.pipeline.handle(Observation(Signal.TEMPERATURE, 40, float(t), "nvml", inventory.gpus[t % 8],
                                          {"shutdown_c": 92, "slowdown_c": 90}), float(t))
        agent.pipeline.tick(float(t))
    assert cluster.faults.writes == writes


@pytest.mark.fake_only  # the brake counts every GPU node: the shared real control plane holds other tests' too
def test_a_fleet_wide_false_positive_storm_stays_within_the_budget_and_the_brake(fake):
    """The same fault on ten nodes: one is disrupted (the budget), two are quarantined (the brake), not ten."""
    cluster, server = fake
    brake = BrakePolicy()  # the shipped defaults: 15 % of the GPU nodes, at least 2, within 10 minutes
    agents = [make_agent(cluster, server, gpu_node(f"n{i}"), max_nodes=2, max_percent=10, brake=brake)
              for i in range(10)]
    for agent in agents:
        agent.fault(0)
    grace_period_passes(cluster)

    def still_there(agent):
        return {p["metadata"]["name"] for p in cluster.pods_on(agent.inventory.name)}

    disrupted = [a.inventory.name for a in agents if f"{a.inventory.name}-trainer-0" not in still_there(a)]
    assert len(disrupted) == 1  # the tighter of 2 nodes and 10 % of 10 GPU nodes
    tainted = [a for a in agents if cluster.node(a.inventory.name)["spec"].get("taints")]
    assert len(tainted) == brake_bound(10, brake) == 2  # the other eight wait: condition, no taint
    assert len(agents[0].side.gate.holders()) == 1


def test_the_budget_slot_is_given_back_on_recovery(fake):
    cluster, server = fake
    inventory = gpu_node("n1")
    first = make_agent(cluster, server, inventory, max_nodes=1, max_percent=0)
    second = make_agent(cluster, server, gpu_node("n2"), max_nodes=1, max_percent=0)
    first.pipeline.handle(Observation(Signal.TEMPERATURE, 95, 1.0, "nvml", inventory.gpus[0],
                                      {"shutdown_c": 92}), 1.0)
    blocked = second.fault(0, at=2.0)
    assert results(blocked)[(StepKind.EVICT, "ml/n2-trainer-0")] is StepResult.BLOCKED
    first.pipeline.handle(Observation(Signal.TEMPERATURE, 60, 3.0, "nvml", inventory.gpus[0],
                                      {"shutdown_c": 92}), 3.0)
    first.pipeline.tick(700.0)
    retried = second.pipeline.tick(40.0)
    assert results(retried)[(StepKind.EVICT, "ml/n2-trainer-0")] is StepResult.APPLIED


def test_an_opted_out_node_only_gets_events(fake):
    cluster, server = fake
    inventory = gpu_node("n1")
    agent = make_agent(cluster, server, inventory)
    agent.side.writer.set_metadata(labels={"gpu-health-agent.io/opt-out": "true"})
    outcome = agent.fault(3)
    assert results(outcome)[(StepKind.EVICT, "ml/n1-trainer-3")] is StepResult.SKIPPED
    assert len(running_pods(cluster, "n1")) == 9


def test_a_cluster_wide_pause_blocks_disruption(fake):
    cluster, server = fake
    agent = make_agent(cluster, server, gpu_node("n1"))
    cluster.add("leases", {"metadata": {"name": "gpu-health-pause"}, "spec": {}}, group="coordination.k8s.io",
                namespace="gpu-health")
    assert results(agent.fault(3))[(StepKind.EVICT, "ml/n1-trainer-3")] is StepResult.BLOCKED
    assert agent.side.gate.holders() == {}  # a paused node takes no slot from the others


def test_quarantine_mode_taints_without_evicting(fake):
    cluster, server = fake
    agent = make_agent(cluster, server, gpu_node("n1"), mode=Mode.QUARANTINE)
    outcome = agent.fault(3)
    assert results(outcome)[(StepKind.EVICT, "ml/n1-trainer-3")] is StepResult.SKIPPED
    assert cluster.node("n1")["spec"]["taints"]


def test_a_replacement_is_released_only_by_an_operator(fake):
    from agent.cluster_side import request_release
    cluster, server = fake
    inventory = gpu_node("n1")
    agent = make_agent(cluster, server, inventory)
    agent.pipeline.handle(Observation(Signal.ROW_REMAP_FAILURE, 1, 1.0, "nvml", inventory.gpus[5]), 1.0)
    node = cluster.node("n1")
    assert node["metadata"]["labels"]["gpu-health-agent.io/needs-replacement"] == "true"
    assert agent.pipeline.tick(10**6).verdicts == []
    request_release(operator_client(server), "n1", "GPU-n1-0005")
    agent.pipeline.reconcile(20.0)
    node = cluster.node("n1")
    assert "gpu-health-agent.io/needs-replacement" not in node["metadata"]["labels"]
    assert "gpu-health-agent.io/release" not in node["metadata"].get("annotations", {})


def test_a_fault_back_after_verified_recoveries_needs_replacement(fake):
    cluster, server = fake
    inventory = gpu_node("n1")
    agent = make_agent(cluster, server, inventory)
    for round_ in range(2):
        agent.fault(2, xid=48, at=1000.0 * round_ + 1)  # reset_gpu: drained, then reset once it settled
        assert agent.pipeline.gpu_statuses()["GPU-n1-0002"] == "fatal"
        grace_period_passes(cluster)  # the evicted pod holds the GPU until it is gone
        agent.pipeline.tick(1000.0 * round_ + 11)  # the fake reset command runs
        agent.poll(2, at=1000.0 * round_ + 12)  # a clean poll verifies it
        assert agent.pipeline.gpu_statuses()["GPU-n1-0002"] == "healthy"
    third = agent.fault(2, xid=48, at=3000.0)
    assert third.verdicts[0].action == "replace_gpu"
    assert cluster.node("n1")["metadata"]["labels"]["gpu-health-agent.io/needs-replacement"] == "true"


def test_too_many_faulty_gpus_move_every_gpu_pod(fake):
    cluster, server = fake
    agent = make_agent(cluster, server, gpu_node("n1"), max_nodes=1, max_faulty_gpus=1,
                       reset=lambda uuid: (False, "reset refused"))
    agent.fault(1, xid=48)
    agent.fault(2, xid=48, at=2.0)
    grace_period_passes(cluster)
    assert {p["metadata"]["name"] for p in cluster.pods_on("n1")} == {"gpu-health-agent-n1"}


def test_a_reset_waits_for_the_incident_to_settle(fake):
    cluster, server = fake
    resets = []
    inventory = gpu_node("n1")
    agent = make_agent(cluster, server, inventory, reset=lambda uuid: (resets.append(uuid) or True, "reset"))
    agent.pipeline.handle(Observation(Signal.ECC_DBE, 1, 1.0, "nvml", inventory.gpus[2]), 1.0)
    agent.fault(2, xid=48, at=1.5)
    assert resets == []
    grace_period_passes(cluster)  # the evicted pod holds the GPU until it is gone
    agent.pipeline.tick(11.0)
    assert resets == ["GPU-n1-0002"]
    verified = agent.poll(2, at=12.0)
    assert sorted(v.rule_id for v in verified.verdicts) == ["ecc-dbe", "xid-48"]  # one reset clears both


def test_a_gpu_is_never_reset_while_its_pod_still_runs(fake):
    cluster, server = fake
    resets = []
    agent = make_agent(cluster, server, gpu_node("n1"), reset=lambda uuid: (resets.append(uuid) or True, "reset"))
    selector = {"matchLabels": {"app": "n1-trainer"}}
    cluster.add("poddisruptionbudgets", {"metadata": {"name": "trainers"},
                                         "spec": {"maxUnavailable": 0, "selector": selector}},
                group="policy", namespace="ml")
    outcome = agent.fault(2, xid=48)
    assert results(outcome)[(StepKind.EVICT, "ml/n1-trainer-2")] is StepResult.BLOCKED
    assert resets == []
    cluster.delete(resource("poddisruptionbudgets"), "ml", "trainers")
    retried = agent.pipeline.tick(40.0)
    assert results(retried)[(StepKind.EVICT, "ml/n1-trainer-2")] is StepResult.APPLIED
    assert resets == []  # evicted, but still terminating: it holds the GPU
    grace_period_passes(cluster)
    agent.pipeline.tick(80.0)
    assert resets == ["GPU-n1-0002"]


def test_verified_recoveries_are_remembered_across_a_restart(fake):
    cluster, server = fake
    inventory = gpu_node("n1")
    agent = make_agent(cluster, server, inventory)
    for round_ in range(2):
        agent.fault(2, xid=48, at=1000.0 * round_ + 1)
        grace_period_passes(cluster)
        agent.pipeline.tick(1000.0 * round_ + 11)
        agent.poll(2, at=1000.0 * round_ + 12)
    restarted = make_agent(cluster, server, inventory, populate_node=False, restore=True)
    assert restarted.pipeline.node.recoveries.to_json() == {"GPU-n1-0002": {"hardware": [12.0, 1012.0]}}
    assert restarted.fault(2, xid=48, at=3000.0).verdicts[0].action == "replace_gpu"


@pytest.mark.fake_only
def test_an_agent_started_while_the_api_is_down_reads_its_node_once_it_is_back(fake, tmp_path):
    from prometheus_client import CollectorRegistry

    from agent.cluster_side import build_cluster_side
    from agent.config import load_config
    from agent.daemon import Daemon
    from agent.k8s.client import client_for
    from tests.k8s_helpers import RULES

    cluster, server = fake
    inventory = gpu_node("n1")
    make_agent(cluster, server, inventory).fault(3)
    config = load_config(None, env={"NODE_NAME": "n1", "GPU_HEALTH_JOURNAL_PATH": str(tmp_path / "j.db")})
    side = build_cluster_side(client_for(server.url), config, on_stuck=lambda pod: None)
    cluster.faults.down = True
    daemon = Daemon(config, rules=RULES, sources=[object()], registry=CollectorRegistry(), cluster=side)  # type: ignore[list-item]
    assert not daemon.pipeline.node.tainted
    cluster.faults.down = False
    daemon.pipeline.reconcile()
    assert daemon.pipeline.node.tainted
    assert daemon.pipeline.gpu_statuses()["GPU-n1-0003"] == "fatal"


def test_a_step_blocked_before_a_restart_is_taken_after_it(fake):
    cluster, server = fake
    inventory = gpu_node("n1")
    first = make_agent(cluster, server, inventory)
    selector = {"matchLabels": {"app": "n1-trainer"}}
    cluster.add("poddisruptionbudgets", {"metadata": {"name": "trainers"},
                                         "spec": {"maxUnavailable": 0, "selector": selector}},
                group="policy", namespace="ml")
    assert results(first.fault(3))[(StepKind.EVICT, "ml/n1-trainer-3")] is StepResult.BLOCKED
    cluster.delete(resource("poddisruptionbudgets"), "ml", "trainers")
    restarted = make_agent(cluster, server, inventory, populate_node=False, restore=True)
    taken = restarted.pipeline.tick(1.0)
    assert results(taken)[(StepKind.EVICT, "ml/n1-trainer-3")] is StepResult.APPLIED
    assert (StepKind.TAINT, "n1") not in results(taken)  # already there: not repeated


def test_the_taint_stays_until_a_clean_poll_verifies_the_reset(fake):
    """A reset command that succeeded leaves the node quarantined until a clean poll of the GPU."""
    cluster, server = fake
    agent = make_agent(cluster, server, gpu_node("n1"))
    agent.fault(2, xid=48)
    grace_period_passes(cluster)
    agent.pipeline.tick(11.0)  # the reset command runs and succeeds

    def tainted():
        return TAINT in [t["key"] for t in cluster.node("n1")["spec"].get("taints") or []]
    assert tainted()
    agent.poll(2, at=12.0, remap_pending=1)  # not clean yet
    assert tainted()
    agent.poll(2, at=13.0)
    assert not tainted()


def test_a_failed_reset_asks_the_node_for_a_reboot(fake):
    """The reset command failed: the Node carries the reboot request."""
    from agent.k8s.node import REBOOT_ANNOTATION
    cluster, server = fake
    agent = make_agent(cluster, server, gpu_node("n1"), reset=lambda uuid: (False, "reset refused"))
    agent.fault(2, xid=48)
    grace_period_passes(cluster)
    agent.pipeline.tick(11.0)
    assert REBOOT_ANNOTATION in cluster.node("n1")["metadata"].get("annotations", {})
    assert "gpu-reset-failed" in our_conditions(cluster.node("n1"))["GpuFatalFault"]["message"]


def test_a_release_on_the_node_starts_the_recovery_count_again(fake):
    """After two verified recoveries, an operator's release annotation clears the GPU's history."""
    from agent.cluster_side import request_release
    cluster, server = fake
    agent = make_agent(cluster, server, gpu_node("n1"))
    for round_ in range(2):
        agent.fault(2, xid=48, at=1000.0 * round_ + 1)
        grace_period_passes(cluster)
        agent.pipeline.tick(1000.0 * round_ + 11)
        agent.poll(2, at=1000.0 * round_ + 12)
    request_release(operator_client(server), "n1", "GPU-n1-0002")
    agent.pipeline.reconcile(2500.0)
    assert agent.pipeline.node.recoveries.to_json() == {}
    assert agent.fault(2, xid=48, at=3000.0).verdicts[0].action == "reset_gpu"


def test_a_contained_ecc_error_taints_noschedule_and_evicts_nobody(fake):
    """Xid 94: the Node gets the NoSchedule taint; every pod, the GPU's own tenant included, keeps running."""
    cluster, server = fake
    agent = make_agent(cluster, server, gpu_node("n1"))
    outcome = agent.fault(2, xid=94)
    assert StepKind.EVICT not in {a.step.kind for a in outcome.actions}
    node = cluster.node("n1")
    assert [(t["key"], t["effect"]) for t in node["spec"]["taints"]] == [(TAINT, "NoSchedule")]
    assert our_conditions(node)["GpuDegraded"]["status"] == "True"
    assert not [p for p in cluster.pods_on("n1") if p["metadata"].get("deletionTimestamp")]
    assert len(running_pods(cluster, "n1")) == 9


def _diagnosed_agent(fake, script: str, level: str):
    """An agent whose configured diagnostic prints `script`'s table for `dcgmi diag -r <level>`, and the GPUs it
    ran on."""
    import sys

    from agent.diagnostics import command_runner
    cluster, server = fake
    inventory = gpu_node("n1")
    ran = []
    passing = command_runner([sys.executable, "-c", script, "-r", level], timeout_seconds=30)
    agent = make_agent(cluster, server, inventory, diagnose=lambda uuid: (ran.append(uuid), passing(uuid))[1])
    return agent, inventory, ran


def _three_owners_then_idle(fake, agent, inventory, ran):
    """Three owners' Xid 31 on GPU 2 (NoSchedule, nobody evicted, no diagnostic while its tenant runs), then the
    tenant's job ends and the next pass finds the GPU idle."""
    from agent.model import frozen_attrs
    cluster, _ = fake
    for n, at in enumerate((1.0, 60.0, 120.0)):
        agent.pipeline.handle(Observation(Signal.XID, 31, at, "kmsg", inventory.gpus[2],
                                          frozen_attrs({"workload": f"ns/Deployment/app-{n}"})), at)
    assert TAINT in [t["key"] for t in cluster.node("n1")["spec"]["taints"]]
    assert ran == [] and len(running_pods(cluster, "n1")) == 9  # the tenant still runs: nobody evicted
    cluster.delete(resource("pods"), "ml", "n1-trainer-2")  # its job finished
    grace_period_passes(cluster)
    agent.pipeline.tick(500.0)


def test_a_level_2_pass_lifts_the_taint_and_leaves_the_gpu_degraded_on_the_node(fake):
    """Issue 41 row 9, through the real runner and the fake API server: `dcgmi diag -r 2` passing is short of
    NVIDIA's EUD: the taint goes, and the GpuDegraded condition names gpu-diagnostic-shallow-pass."""
    cluster, _ = fake
    agent, inventory, ran = _diagnosed_agent(fake, "print('| Memory | Pass |')", "2")
    _three_owners_then_idle(fake, agent, inventory, ran)
    assert ran == ["GPU-n1-0002"]
    assert TAINT not in [t["key"] for t in cluster.node("n1")["spec"].get("taints") or []]
    [degraded] = [c for c in cluster.node("n1")["status"]["conditions"] if c["type"] == "GpuDegraded"]
    assert degraded["status"] == "True" and "short of NVIDIA's EUD (level 2, below 3; no eud test)" in \
        degraded["message"]


def test_a_passing_diagnostic_releases_the_node_once_the_gpu_is_idle(fake):
    """Three owners fault on GPU 2: NoSchedule, nobody evicted; its tenant finishes, the configured diagnostic
    (level 3, its eud test passing: NVIDIA's RUN_DCGMEUD) runs on the idle GPU, passes, and the taint goes."""
    cluster, _ = fake
    agent, inventory, ran = _diagnosed_agent(fake, "print('| Memory | Pass |'); print('| EUD | Pass |')", "3")
    _three_owners_then_idle(fake, agent, inventory, ran)
    assert ran == ["GPU-n1-0002"]
    assert TAINT not in [t["key"] for t in cluster.node("n1")["spec"].get("taints") or []]
    assert [c["status"] for c in cluster.node("n1")["status"]["conditions"] if c["type"] == "GpuDegraded"] \
        in ([], ["False"])


def held_then(answers):
    """A reset procedure that finds the GPU still held (None) for each False in `answers`, then resets it."""
    calls = []

    def reset(uuid):
        calls.append(uuid)
        return (True, "reset") if answers[min(len(calls), len(answers)) - 1] else (None, "not reset: still held")
    return reset, calls


def test_a_reset_the_gpus_holders_refuse_is_asked_again_not_charged_as_failed(fake):
    """Issue 41 row 3: a host holder keeps the GPU (nvidia-smi: in use): the reset step is blocked, no failed
    reset, no reboot request; after the back-off it is asked again and, the holder gone, resets."""
    from agent.k8s.node import REBOOT_ANNOTATION
    cluster, server = fake
    reset, calls = held_then([False, True])
    agent = make_agent(cluster, server, gpu_node("n1"), reset=reset)
    agent.fault(2, xid=48)
    grace_period_passes(cluster)
    first = agent.pipeline.tick(11.0)
    assert results(first)[(StepKind.RESET_GPU, "GPU-n1-0002")] is StepResult.BLOCKED
    assert "gpu-reset-failed" not in {v.rule_id for v in first.verdicts}
    assert REBOOT_ANNOTATION not in cluster.node("n1")["metadata"].get("annotations", {})
    agent.pipeline.tick(60.0)
    assert len(calls) == 1  # the reset cooldown (300 s)
    retried = agent.pipeline.tick(320.0)
    assert results(retried)[(StepKind.RESET_GPU, "GPU-n1-0002")] is StepResult.APPLIED
    assert [v.rule_id for v in agent.poll(2, at=321.0).verdicts] == ["xid-48"]


def test_a_gpu_that_stays_held_through_the_hours_resets_is_a_failed_reset(fake):
    """Bounded: the third reset in a row (the attempt cap in an hour) that finds the GPU held fails, saying so;
    the reboot request follows."""
    from agent.k8s.node import REBOOT_ANNOTATION
    cluster, server = fake
    reset, calls = held_then([False])
    agent = make_agent(cluster, server, gpu_node("n1"), reset=reset)
    agent.fault(2, xid=48)
    grace_period_passes(cluster)
    outcomes = [agent.pipeline.tick(at) for at in (11.0, 320.0, 630.0)]
    assert len(calls) == 3
    assert [results(o).get((StepKind.RESET_GPU, "GPU-n1-0002")) for o in outcomes] == [StepResult.BLOCKED] * 2 + [
        StepResult.FAILED]
    assert REBOOT_ANNOTATION in cluster.node("n1")["metadata"].get("annotations", {})
