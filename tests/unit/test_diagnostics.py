"""A GPU diagnostic's output decides pass, fail or nothing; a pass at NVIDIA's EUD depth releases, a shallower one
only downgrades, a failure is a hardware fault."""

import dataclasses
import sys

from agent.diagnostics import (
    DiagnosticOutcome,
    DiagnosticResult,
    command_runner,
    eud_status,
    level_of,
    outcome_of,
    parse,
    shortfall,
)
from agent.model import NodeInventory, PodRef, Signal, StepKind, StepResult
from agent.pipeline import LocalActuator, Pipeline
from agent.remediation import GuardPolicy, Mode
from tests.conftest import gpu, obs

TABLE = """Successfully ran diagnostic for group.
+---------------------------+------------------------------------------------+
| Diagnostic                | Result                                         |
+===========================+================================================+
|-----  Deployment  --------+------------------------------------------------|
| Denylist                  | Pass                                           |
| NVML Library              | Pass                                           |
| Environment Variables     | Pass                                           |
+-----  Integration  -------+------------------------------------------------+
| PCIe                      | {pcie}                                         |
+-----  Hardware  ----------+------------------------------------------------+
| GPU Memory                | Pass - All                                     |
+---------------------------+------------------------------------------------+
"""
WORKLOADS = [obs(Signal.XID, 31, t, workload=f"ns/Deployment/app-{t:g}") for t in (1.0, 60.0, 120.0)]


def test_a_table_of_passes_with_a_zero_exit_passes():
    assert parse(0, TABLE.format(pcie="Pass - All"))[0] is DiagnosticOutcome.PASS


def test_one_failed_test_fails_the_gpu_whatever_the_exit_code():
    outcome, summary = parse(0, TABLE.format(pcie="Fail - GPU: 0"))
    assert (outcome, summary) == (DiagnosticOutcome.FAIL, "failed: PCIe")


def test_the_json_output_is_read_too():
    """dcgmi diag -j: the statuses of its results decide."""
    doc = ('{"DCGM GPU Diagnostic": {"test_categories": [{"tests": [{"name": "Memory", '
           '"results": [{"status": "Fail"}]}]}]}}')
    assert parse(226, doc) == (DiagnosticOutcome.FAIL, "failed: Memory")


def test_a_command_that_could_not_test_decides_nothing():
    """dcgmi missing, no permission, a busy GPU: a non-zero exit with no test result is inconclusive."""
    assert parse(127, "dcgmi: command not found")[0] is DiagnosticOutcome.INCONCLUSIVE
    assert parse(0, "")[0] is DiagnosticOutcome.INCONCLUSIVE


def test_a_diagnostic_that_runs_too_long_is_killed_and_inconclusive():
    runner = command_runner([sys.executable, "-c", "import time; time.sleep(5)"], timeout_seconds=0.2)
    result = runner("GPU-x")
    assert result.outcome is DiagnosticOutcome.INCONCLUSIVE and "did not finish within 0.2s" in result.summary


def test_the_command_gets_the_gpu_uuid():
    runner = command_runner([sys.executable, "-c", "import sys; print('| GPU', sys.argv[1], '| Pass |')", "{uuid}"],
                            timeout_seconds=10)
    assert runner("GPU-abc") == DiagnosticResult(DiagnosticOutcome.PASS, "passed 1 test(s)")


def test_the_result_says_the_level_the_command_asked_for_and_how_the_eud_test_went():
    """dcgmi diag -r 3 whose table has an EUD row that passed: level 3, eud pass, in the step's message too."""
    script = "print('| Memory | Pass |'); print('| EUD | Pass - All |')"
    result = command_runner([sys.executable, "-c", script, "-r", "long"], timeout_seconds=10)("GPU-x")
    assert (result.outcome, result.level, result.eud) == (DiagnosticOutcome.PASS, "3", "pass")
    assert DiagnosticResult.of_message(result.message()) == result
    assert result.message() == "pass: passed 2 test(s) [level 3, eud pass]"


def test_the_level_is_read_from_dcgmi_diags_run_option():
    assert [level_of(c) for c in (["dcgmi", "diag", "-r", "2"], ["dcgmi", "diag", "--run=xlong"],
                                  ["dcgmi", "diag", "--run", "eud", "-i", "{uuid}"], ["/opt/site/diag.sh"])] == \
        ["2", "4", "eud", ""]


def test_the_eud_test_is_found_in_dcgmis_json_and_a_failure_on_one_gpu_wins():
    doc = ('{"tests": [{"name": "eud", "results": [{"entity_id": 0, "status": "Pass"}, '
           '{"entity_id": 1, "status": "Fail"}]}, {"name": "memory", "results": [{"status": "Pass"}]}]}')
    assert (eud_status(doc), eud_status(TABLE.format(pcie="Pass"))) == ("fail", "")


def test_only_a_long_run_whose_eud_test_passed_is_nvidias_run_dcgmeud():
    """WORKFLOW_XID_13/31: RUN_DCGMEUD. Level 2 is an epilogue's check; a long run without EUD did not run it."""
    assert shortfall("3", "pass") == "" and shortfall("eud", "pass") == ""
    assert shortfall("2", "") == "level 2, below 3; no eud test"
    assert shortfall("4", "skip") == "eud skip"
    assert shortfall("", "pass") == "its level unknown (not a dcgmi diag -r command)"


def test_a_step_message_carries_its_outcome():
    assert outcome_of("pass: passed 3 test(s)") is DiagnosticOutcome.PASS
    assert outcome_of("fail: failed: PCIe") is DiagnosticOutcome.FAIL
    assert outcome_of("ValueError: boom") is DiagnosticOutcome.INCONCLUSIVE


class Diagnoses(LocalActuator):
    """Every step takes effect; the diagnostic gives the outcome it is told to, at the depth it is told to (by
    default NVIDIA's RUN_DCGMEUD: level 3 with the eud test passed), as the K8sActuator words it."""

    def __init__(self, outcome: str, level: str = "3", eud: str = "pass") -> None:
        self.outcome = outcome
        self.level, self.eud = level, eud
        self.ran: list[str] = []

    def apply(self, step):
        if step.kind is StepKind.RUN_DIAGNOSTIC:
            self.ran.append(step.target)
            if self.outcome == "inconclusive":
                return StepResult.FAILED, "inconclusive: exit 127"
            return StepResult.APPLIED, DiagnosticResult(DiagnosticOutcome(self.outcome), "dcgmi diag",
                                                        self.level, self.eud).message()
        return StepResult.APPLIED, "ok"


def pipeline(rules, actuator, pods=()):
    held = list(pods)
    return Pipeline(rules=rules, inventory=NodeInventory("node-1", (gpu(0), gpu(1)), tuple(held)),
                    policy=GuardPolicy(mode=Mode.REMEDIATE), actuator=actuator, clock=lambda: 100.0,
                    pods=lambda: tuple(held), diagnose=True), held


def quarantined(rules, actuator, pods=()):
    p, held = pipeline(rules, actuator, pods)
    for fault in WORKLOADS:
        p.handle(fault, fault.at)
    return p, held


def test_a_passing_diagnostic_on_the_idle_gpu_releases_it(shipped_rules):
    """Three owners faulted: the diagnostic runs at once on the idle GPU, passes, and the node is back."""
    actuator = Diagnoses("pass")
    p, _ = quarantined(shipped_rules, actuator)
    assert actuator.ran == [gpu(0).uuid]
    assert p.gpu_statuses()[gpu(0).key] == "healthy" and not p.node.tainted


def test_a_level_2_pass_lifts_the_quarantine_but_never_releases_the_suspected_gpu(shipped_rules):
    """Issue 41 row 9: dcgmi diag -r 2 passing is an epilogue's check, not NVIDIA's RUN_DCGMEUD: new work may use
    the GPU again, and it stays degraded (gpu-diagnostic-shallow-pass) until EUD passes or an operator acts."""
    actuator = Diagnoses("pass", level="2", eud="")
    p, _ = quarantined(shipped_rules, actuator)
    assert actuator.ran == [gpu(0).uuid] and not p.node.tainted
    active = {f.rule_id for f in p.record.faults.values()}
    assert "gpu-diagnostic-shallow-pass" in active and "xid-app-faults-across-workloads" not in active
    assert p.gpu_statuses()[gpu(0).key] == "degraded"
    p.tick(30 * 86400.0)
    assert p.gpu_statuses()[gpu(0).key] == "degraded" and actuator.ran == [gpu(0).uuid]


def test_a_long_run_in_which_the_eud_test_did_not_run_only_downgrades(shipped_rules):
    """dcgmi diag -r 3 on a node without the EUD plugin passes without the test NVIDIA's workflow names."""
    p, _ = quarantined(shipped_rules, Diagnoses("pass", level="3", eud=""))
    faults = {f.rule_id: f for f in p.record.faults.values()}
    assert "xid-app-faults-across-workloads" not in faults and not p.node.tainted
    assert "(no eud test)" in faults["gpu-diagnostic-shallow-pass"].summary


def test_a_pattern_that_comes_back_after_a_shallow_pass_waits_for_an_operator(shipped_rules):
    """The same shallow diagnostic is not run again: the returning pattern quarantines, nothing releases it."""
    actuator = Diagnoses("pass", level="2", eud="")
    p, _ = quarantined(shipped_rules, actuator)
    for fault in WORKLOADS:
        p.handle(dataclasses.replace(fault, at=fault.at + 7200), fault.at + 7200)
    p.tick(7 * 86400.0)
    assert p.node.tainted and actuator.ran == [gpu(0).uuid]
    assert {"xid-app-faults-across-workloads", "gpu-diagnostic-shallow-pass"} <= \
        {f.rule_id for f in p.record.faults.values()}


def test_the_diagnostic_waits_until_no_pod_holds_the_gpu(shipped_rules):
    """Nobody is evicted for it: the diagnostic runs only once the GPU's tenant has gone."""
    actuator = Diagnoses("pass")
    p, held = quarantined(shipped_rules, actuator, [PodRef("ml", "tenant", "u0", (gpu(0).uuid,))])
    assert actuator.ran == [] and p.node.tainted
    held.clear()
    p.tick(500.0)
    assert actuator.ran == [gpu(0).uuid] and not p.node.tainted


def test_a_failed_diagnostic_marks_the_gpu_for_replacement_and_is_not_rerun(shipped_rules):
    actuator = Diagnoses("fail")
    p, _ = quarantined(shipped_rules, actuator)
    assert {"xid-app-faults-across-workloads", "gpu-diagnostic-failed"} <= {f.rule_id for f in p.record.faults.values()}
    assert gpu(0).key in p.node.replacement
    p.tick(10_000.0)
    assert actuator.ran == [gpu(0).uuid]


def test_an_inconclusive_diagnostic_releases_nothing(shipped_rules):
    """A diagnostic that could not run keeps the quarantine; no timer lets the GPU back."""
    actuator = Diagnoses("inconclusive")
    p, _ = quarantined(shipped_rules, actuator)
    p.tick(7 * 86400.0)
    assert p.node.tainted and "xid-app-faults-across-workloads" in {f.rule_id for f in p.record.faults.values()}


def test_without_a_diagnostic_command_nothing_runs_and_nothing_is_quarantined(shipped_rules):
    """No diagnostic could decide: the repeat is reported (undiagnosed rule), the node never tainted."""
    actuator = Diagnoses("pass")
    p = Pipeline(rules=shipped_rules, inventory=NodeInventory("node-1", (gpu(0),), ()),
                 policy=GuardPolicy(mode=Mode.REMEDIATE), actuator=actuator, clock=lambda: 100.0)
    for fault in WORKLOADS:
        p.handle(fault, fault.at)
    assert "xid-app-faults-across-workloads-undiagnosed" in {f.rule_id for f in p.record.faults.values()}
    p.tick(7 * 86400.0)
    assert actuator.ran == [] and not p.node.tainted


def test_the_command_gets_the_dcgm_hostengine_it_is_configured_with():
    """{hostengine} is sources.dcgm.hostengine: dcgmi asks the GPU Operator's nv-hostengine for the diagnostic."""
    script = "import sys; print('| Memory |', 'Pass' if sys.argv[1] == '10.0.0.5:5555' else 'Fail', '|')"
    runner = command_runner([sys.executable, "-c", script, "{hostengine}"], timeout_seconds=10,
                            hostengine="10.0.0.5:5555")
    assert runner("GPU-x").outcome is DiagnosticOutcome.PASS
