"""The built-in scenarios through the real pipeline: what `simulate` promises."""

import pytest

from agent.errors import ScenarioError
from agent.model import StepKind, StepResult, VerdictKind
from agent.remediation import GuardPolicy, Mode
from agent.simulate import simulate
from agent.sources.scenario import builtin_names, load_scenario, parse_scenario

REMEDIATE = GuardPolicy(mode=Mode.REMEDIATE)
DISRUPTIVE = {"taint", "evict", "reset_gpu", "reboot_request"}


def run(name, policy=REMEDIATE, rules=None, **kwargs):
    from agent.engine import builtin_rules_dir, load_rules
    return simulate(load_scenario(name), rules=rules or load_rules(builtin_rules_dir()), policy=policy,
                    **kwargs).to_json()


@pytest.mark.parametrize("name", builtin_names())
def test_every_builtin_scenario_runs(name):
    report = run(name)
    assert report["verdicts"], f"{name} produced no verdict"


def test_the_required_scenarios_are_built_in():
    assert {"xid79", "xid13", "ecc-dbe", "row-remap-pending", "thermal-slowdown", "xid-storm",
            "recovery"} <= set(builtin_names())


def test_xid79_quarantines_and_evicts_exactly_the_pod_on_that_gpu():
    report = run("xid79")
    [verdict] = report["verdicts"]
    assert (verdict["severity"], verdict["rule_id"], verdict["gpu"]["index"]) == ("fatal", "xid-79", 3)
    kinds = {(a["kind"], a["target"]) for a in report["actions"]}
    assert ("taint", "gpu-node-1") in kinds
    assert ("set_condition", "GpuFatalFault") in kinds
    assert [a["target"] for a in report["actions"] if a["kind"] == "evict"] == ["ml/trainer-3"]
    assert all(a["result"] == "planned" for a in report["actions"])


def test_xid13_disrupts_nothing():
    report = run("xid13")
    assert report["verdicts"][0]["severity"] == "warning"
    assert not {a["kind"] for a in report["actions"]} & DISRUPTIVE


def test_an_xid_storm_gives_one_verdict_and_keeps_the_count():
    report = run("xid-storm")
    assert len([v for v in report["verdicts"] if v["kind"] == "fault"]) == 1
    assert report["active_faults"][0]["occurrences"] == 20000


def test_recovery_clears_what_the_fault_set():
    report = run("recovery")
    assert [v["kind"] for v in report["verdicts"]] == ["fault", "cleared"]
    kinds = [a["kind"] for a in report["actions"]]
    assert kinds.index("untaint") > kinds.index("taint")
    assert "clear_condition" in kinds
    assert report["gpu_status"] and set(report["gpu_status"].values()) == {"healthy"}


def test_row_remap_pending_is_no_quarantine():
    report = run("row-remap-pending")
    assert "taint" not in {a["kind"] for a in report["actions"]}
    assert [a["target"] for a in report["actions"] if a["kind"] == "reset_gpu"] == [
        report["node"]["gpus"][6]["uuid"]]


def test_an_unreadable_gpu_is_unknown_never_a_fault():
    report = run("gpu-unreadable")
    assert report["verdicts"][0]["severity"] == "unknown"
    assert not {a["kind"] for a in report["actions"]} & DISRUPTIVE


def test_dry_run_changes_every_result_to_dry_run():
    report = run("xid79", GuardPolicy(mode=Mode.REMEDIATE, dry_run=True))
    assert {a["result"] for a in report["actions"]} == {str(StepResult.DRY_RUN)}


def test_quarantine_mode_skips_evictions():
    report = run("xid79", GuardPolicy(mode=Mode.QUARANTINE))
    results = {a["kind"]: a["result"] for a in report["actions"]}
    assert results["taint"] == "planned"
    assert results["evict"] == "skipped"


def test_a_failing_actuator_fails_its_step_and_the_others_still_run():
    from agent.pipeline import LocalActuator

    class Flaky(LocalActuator):
        def apply(self, step):
            if step.kind is StepKind.TAINT:
                raise RuntimeError("api server down")
            return StepResult.APPLIED, "ok"

    from agent.engine import builtin_rules_dir, load_rules
    from agent.pipeline import Pipeline
    from agent.simulate import ScenarioClock
    from agent.sources.scenario import inventory

    scenario, clock = load_scenario("xid79"), ScenarioClock()
    pipeline = Pipeline(rules=load_rules(builtin_rules_dir()), inventory=inventory(scenario), policy=REMEDIATE,
                        actuator=Flaky(), clock=clock)
    report = simulate(scenario, pipeline=pipeline, clock=clock).to_json()
    results = {a["kind"]: a["result"] for a in report["actions"]}
    assert results["taint"] == "failed"
    assert results["evict"] == "applied"


def test_a_malformed_scenario_names_the_field():
    with pytest.raises(ScenarioError) as caught:
        parse_scenario("name: x\ntimeline:\n  - {at: 1, signal: nonsense}\n", origin="bad.yaml")
    assert caught.value.line().startswith("bad.yaml: field timeline.0.signal:")


def test_a_scenario_naming_a_missing_gpu_is_rejected():
    with pytest.raises(ScenarioError, match="gpu 9 but the node has 8"):
        parse_scenario("name: x\ntimeline:\n  - {at: 1, signal: xid, value: 79, gpu: 9}\n", origin="bad.yaml")


def test_an_unknown_scenario_lists_the_builtin_ones():
    with pytest.raises(ScenarioError, match="xid79"):
        load_scenario("no-such-scenario")


def test_verdict_kinds_are_fault_or_cleared():
    assert {v["kind"] for v in run("recovery")["verdicts"]} <= {str(k) for k in VerdictKind}


def test_a_crash_looping_job_never_quarantines_the_node():
    """One owner's pods crash-looping on a GPU are one workload: the application's, not the node's."""
    report = run("crash-looping-job")
    assert report["verdicts"] and not any(v["quarantine"] for v in report["verdicts"])
    assert not {a["kind"] for a in report["actions"]} & (DISRUPTIVE | {"taint"})


def test_faults_across_owners_hold_until_a_diagnostic_releases_them():
    """Three owners on one GPU: NoSchedule, no eviction, held past every quiet timer, released by the passing
    diagnostic (t=5400) and by nothing before it."""
    report = run("app-faults-across-workloads")
    ours = [(v["kind"], v["at"]) for v in report["verdicts"] if v["rule_id"] == "xid-app-faults-across-workloads"]
    assert ours == [("fault", 1800.0), ("cleared", 5400.0)]
    assert report["active_faults"] == []
    kinds = [a["kind"] for a in report["actions"]]
    assert "evict" not in kinds and {"taint", "untaint"} <= set(kinds)


def test_a_prolonged_power_brake_stops_new_work_evicts_nothing_and_clears():
    report = run("power-brake-prolonged")
    prolonged = [(v["kind"], v["at"]) for v in report["verdicts"] if v["rule_id"] == "clocks-power-brake-prolonged"]
    assert prolonged == [("fault", 900.0), ("cleared", 3000.0)]
    kinds = {a["kind"] for a in report["actions"]}
    assert {"taint", "untaint"} <= kinds and "evict" not in kinds


def test_a_gpu_missing_after_the_reboot_stays_a_fatal_fault():
    """The reboot clears Xid 79; the GPU that did not come back is marked for replacement and stays so."""
    report = run("gpu-missing-after-boot")
    assert [f["rule_id"] for f in report["active_faults"]] == ["gpu-missing"]
    assert "mark_replacement" in {a["kind"] for a in report["actions"]}


def test_the_dra_scenario_taints_one_device_and_evicts_only_its_pod():
    """`simulate dra-device-isolation` on the fake cluster: one DeviceTaintRule for gpu-3, no node taint,
    only ml/trainer-3 evicted."""
    from agent.engine import builtin_rules_dir, load_rules
    from agent.simulate import simulate_in_cluster

    report = simulate_in_cluster(load_scenario("dra-device-isolation"), rules=load_rules(builtin_rules_dir()),
                                 policy=REMEDIATE).to_json()
    cluster = report["cluster"]
    assert [r["device"]["device"] for r in cluster["device_taint_rules"]] == ["gpu-3"]
    assert cluster["device_taint_rules"][0]["taint"]["effect"] == "NoSchedule"
    assert cluster["node"]["taints"] == []
    assert [a["target"] for a in report["actions"] if a["kind"] == "evict"] == ["ml/trainer-3"]
    assert "ml/trainer-3" not in cluster["pods"] and len(cluster["pods"]) == 8


def test_fabric_manager_down_quarantines_the_node_until_the_fabric_completes():
    """Fabric NotStarted on every GPU: tainted at 120 s, nothing evicted, untainted once Completed and quiet."""
    report = run("fabric-manager-down")
    faults = {v["gpu"]["index"] for v in report["verdicts"] if v["rule_id"] == "fabric-not-registered"
              and v["kind"] == "fault"}
    assert faults == set(range(8))
    kinds = [a["kind"] for a in report["actions"]]
    assert "taint" in kinds and "untaint" in kinds and "evict" not in kinds
    degraded = [v for v in report["verdicts"] if v["rule_id"] == "fabric-degraded-bandwidth"]
    assert [(v["kind"], v["gpu"]["index"]) for v in degraded][:1] == [("fault", 3)]
    assert set(report["gpu_status"].values()) == {"healthy"}


def test_a_reset_on_a_gpu_operator_node_succeeds_and_leaves_the_7_gpu_job_alone():
    """Issue 26 item 4: operands paused and restored, NVML released, GPU 6 reset, the job untouched, no reboot."""
    from agent.engine import builtin_rules_dir, load_rules
    from agent.k8s.operands import PAUSED_ANNOTATION
    from agent.simulate import simulate_in_cluster
    from agent.simulation.gpu_operator import OPERANDS

    report = simulate_in_cluster(load_scenario("reset-on-a-gpu-operator-node"),
                                 rules=load_rules(builtin_rules_dir()), policy=REMEDIATE).to_json()
    [reset] = [a for a in report["actions"] if a["kind"] == "reset_gpu"]
    assert reset["result"] == "applied" and reset["target"] == report["node"]["gpus"][6]["uuid"]
    assert "successfully reset" in reset["message"] and "paused device-plugin" in reset["message"]
    assert not {a["kind"] for a in report["actions"]} & {"evict", "taint", "reboot_request"}
    cluster = report["cluster"]
    assert {k: cluster["node"]["labels"][k] for k in OPERANDS} == dict.fromkeys(OPERANDS, "true")
    assert PAUSED_ANNOTATION not in cluster["node"]["annotations"]
    assert "ml/trainer-0" in cluster["pods"] and len([p for p in cluster["pods"] if p.startswith("gpu-operator/")]) == 4
    assert set(report["gpu_status"].values()) == {"healthy"}


def test_a_reset_on_a_dra_mode_gpu_operator_node_pauses_the_dra_drivers_kubelet_plugin():
    """Issue 39: in the GPU Operator's DRA mode the DRA driver's kubelet plugin holds the GPUs in the device
    plugin's place; the reset pauses it (its label, nvidia.com/gpu.deploy.dra-driver) with the other operands,
    so nvidia-smi finds GPU 6 free, and restores it."""
    from agent.engine import builtin_rules_dir, load_rules
    from agent.simulate import simulate_in_cluster
    from agent.simulation.gpu_operator import DRA_OPERANDS

    report = simulate_in_cluster(load_scenario("reset-on-a-dra-gpu-operator-node"),
                                 rules=load_rules(builtin_rules_dir()), policy=REMEDIATE).to_json()
    [reset] = [a for a in report["actions"] if a["kind"] == "reset_gpu"]
    assert reset["result"] == "applied" and "dra-driver" in reset["message"]
    assert not {a["kind"] for a in report["actions"]} & {"evict", "reboot_request"}
    labels = report["cluster"]["node"]["labels"]
    assert {k: labels[k] for k in DRA_OPERANDS} == dict.fromkeys(DRA_OPERANDS, "true")


def test_a_replacement_mark_survives_the_reboot_that_follows_it():
    """Scenario replacement-survives-reboot: the third Xid 79 is a replacement, and the day-12 reboot keeps it."""
    report = run("replacement-survives-reboot")
    [active] = report["active_faults"]
    assert (active["rule_id"], active["action"]) == ("xid-79", "replace_gpu")
    cleared_after_mark = [v for v in report["verdicts"] if v["kind"] == "cleared" and v["at"] > 867600]
    assert cleared_after_mark == []
    assert "unmark_replacement" not in {a["kind"] for a in report["actions"]}


def test_an_imex_domain_recovery_clears_when_the_driver_reports_it_done():
    """Scenario imex-domain-recovery: Xid 154 0 -> 5 quarantines; 5 -> 0 and a clean poll clear it."""
    report = run("imex-domain-recovery")
    assert [(v["rule_id"], v["kind"]) for v in report["verdicts"] if v["rule_id"] == "xid-154-action-5"] == [
        ("xid-154-action-5", "fault"), ("xid-154-action-5", "cleared")]
    assert report["active_faults"] == []
    assert "untaint" in {a["kind"] for a in report["actions"]}


def test_a_contained_ecc_error_on_a_shared_gpu_evicts_nobody_and_resets_nothing_while_in_use():
    """Scenario contained-ecc-time-sliced: ecc-dbe defers to the contained incident; its three tenants run on."""
    report = run("contained-ecc-time-sliced")
    assert "ecc-dbe" not in {v["rule_id"] for v in report["verdicts"]}
    assert "ecc-dbe-contained" in {v["rule_id"] for v in report["verdicts"]}
    assert not {a["kind"] for a in report["actions"]} & {"evict", "reset_gpu", "reboot_request"}


def test_one_jobs_restarts_at_one_gpc_tpc_never_quarantine_but_three_owners_wait_for_the_diagnostic():
    """Scenario gpc-tpc-repeats: one job's three restarts are the application's; three owners within a day
    quarantine until the diagnostic passes."""
    report = run("gpc-tpc-repeats")
    raised = [(v["at"], v["kind"]) for v in report["verdicts"] if v["rule_id"] == "xid-app-13-repeat-gpc-tpc"]
    assert raised == [(353400.0, "fault"), (380000.0, "cleared")]
    assert "xid-app-faults-across-workloads" not in {v["rule_id"] for v in report["verdicts"]}


def test_simulate_in_a_cluster_wires_the_cluster_side_from_the_agents_config():
    """The replay's cluster side is the one `run` builds from its config: a configured taint key is the one
    the node gets (issue 40's one wiring: simulate had its own, with a fixed key)."""
    from agent.config import parse_config
    from agent.engine import builtin_rules_dir, load_rules
    from agent.simulate import simulate_in_cluster

    config = parse_config({"remediation": {"taint_key": "example.com/gpu-broken"}})
    report = simulate_in_cluster(load_scenario("xid79"), rules=load_rules(builtin_rules_dir()), policy=REMEDIATE,
                                 config=config).to_json()
    assert [t["key"] for t in report["cluster"]["node"]["taints"]] == ["example.com/gpu-broken"]


def test_simulate_in_a_cluster_publishes_the_fleet_summary_the_agent_publishes():
    """With the shipped config the replay's agent, like `run`'s, publishes its fleet summary and marks the
    quarantine's start for the brake: the fleet view is part of its cluster side."""
    import json

    from agent.engine import builtin_rules_dir, load_rules
    from agent.fleet.published import QUARANTINE_LABEL, SUMMARY_ANNOTATION
    from agent.simulate import simulate_in_cluster

    report = simulate_in_cluster(load_scenario("xid79"), rules=load_rules(builtin_rules_dir()),
                                 policy=REMEDIATE).to_json()
    node = report["cluster"]["node"]
    summary = json.loads(node["annotations"][SUMMARY_ANNOTATION])
    assert [f["rule"] for f in summary["faults"]] == ["xid-79"]
    assert QUARANTINE_LABEL in node["labels"]


def test_the_shipped_mode_leaves_the_node_schedulable_once_the_device_plugin_withholds_the_gpu():
    """Issue 41 row 2 in a replay: the contained ECC incident in quarantine mode (it runs no reset) ends with the
    node untainted, GPU 2 withheld by the device plugin (no longer among the kubelet's allocatable devices after
    the Xid 48) and the reset
    asked for by GpuResetRequired; nobody evicted."""
    from agent.engine import builtin_rules_dir, load_rules
    from agent.simulate import simulate_in_cluster

    report = simulate_in_cluster(load_scenario("contained-ecc-real-order"), rules=load_rules(builtin_rules_dir()),
                                 policy=GuardPolicy(mode=Mode.QUARANTINE)).to_json()
    node = report["cluster"]["node"]
    assert node["taints"] == [] and not node["unschedulable"]
    assert sorted(c["type"] for c in node["conditions"] if c["status"] == "True") == ["GpuDegraded", "GpuResetRequired"]
    assert "evict" not in {a["kind"] for a in report["actions"]}
