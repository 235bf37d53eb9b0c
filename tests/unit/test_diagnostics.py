"""A GPU diagnostic's output decides pass, fail or nothing; a pass releases, a failure is a hardware fault."""

import sys

from agent.diagnostics import DiagnosticOutcome, command_runner, outcome_of, parse
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
    outcome, summary = runner("GPU-x")
    assert outcome is DiagnosticOutcome.INCONCLUSIVE and "did not finish within 0.2s" in summary


def test_the_command_gets_the_gpu_uuid():
    runner = command_runner([sys.executable, "-c", "import sys; print('| GPU', sys.argv[1], '| Pass |')", "{uuid}"],
                            timeout_seconds=10)
    assert runner("GPU-abc") == (DiagnosticOutcome.PASS, "passed 1 test(s)")


def test_a_step_message_carries_its_outcome():
    assert outcome_of("pass: passed 3 test(s)") is DiagnosticOutcome.PASS
    assert outcome_of("fail: failed: PCIe") is DiagnosticOutcome.FAIL
    assert outcome_of("ValueError: boom") is DiagnosticOutcome.INCONCLUSIVE


class Diagnoses(LocalActuator):
    """Every step takes effect; the diagnostic gives the outcome it is told to."""

    def __init__(self, outcome: str) -> None:
        self.outcome = outcome
        self.ran: list[str] = []

    def apply(self, step):
        if step.kind is StepKind.RUN_DIAGNOSTIC:
            self.ran.append(step.target)
            if self.outcome == "inconclusive":
                return StepResult.FAILED, "inconclusive: exit 127"
            return StepResult.APPLIED, f"{self.outcome}: dcgmi diag -r 2"
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
    assert runner("GPU-x")[0] is DiagnosticOutcome.PASS
