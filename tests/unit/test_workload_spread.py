"""NVIDIA's Xid 31 workflow: a repeat on one GPU is the GPU's only while the same workload does not fault elsewhere."""

from agent.model import NodeInventory, Signal
from agent.pipeline import Pipeline
from agent.remediation import GuardPolicy, Mode
from agent.remediation.spread import WorkloadSpread
from tests.conftest import gpu, obs

RULE = "xid-app-faults-across-workloads"


def pipeline(rules):
    return Pipeline(rules=rules, inventory=NodeInventory("node-1", (gpu(0), gpu(1)), ()),
                    policy=GuardPolicy(mode=Mode.QUARANTINE), clock=lambda: 100.0, diagnostic_available=True)


def fault(p, index, workload, at, xid=31):
    return p.handle(obs(Signal.XID, xid, at, gpu_ref=gpu(index), workload=workload), at).verdicts


def test_three_owners_faulting_only_on_one_gpu_call_for_a_diagnostic(shipped_rules):
    p = pipeline(shipped_rules)
    for n, owner in enumerate(("a/Job/x", "b/Job/y", "c/Job/z")):
        fault(p, 0, owner, 10.0 * (n + 1))
    assert RULE in {f.rule_id for f in p.record.faults.values()}


def test_a_workload_that_also_faults_on_another_gpu_does_not_count_against_the_first(shipped_rules):
    """Owner a faults on GPU 0 and then GPU 1: it is a's bug, so b and c alone do not make GPU 0 suspect."""
    p = pipeline(shipped_rules)
    fault(p, 0, "a/Job/x", 10.0)
    fault(p, 1, "a/Job/x", 20.0)
    fault(p, 0, "b/Job/y", 30.0)
    fault(p, 0, "c/Job/z", 40.0)
    assert RULE not in {f.rule_id for f in p.record.faults.values()}
    assert not p.node.tainted


def test_a_fault_elsewhere_more_than_an_hour_apart_does_not_excuse_the_workload():
    spread = WorkloadSpread(window_seconds=3600.0)
    assert spread.note("a/Job/x", "gpu0", 0.0) == set()
    assert spread.note("a/Job/x", "gpu1", 4000.0) == set()
    assert spread.note("a/Job/x", "gpu0", 4100.0) == {"gpu1"}


def test_the_memory_of_workloads_is_bounded():
    spread = WorkloadSpread(max_workloads=3)
    for n in range(10):
        spread.note(f"w{n}", "gpu0", float(n))
    assert spread.note("w0", "gpu1", 11.0) == set()  # w0 was forgotten


def test_a_fault_of_a_workload_seen_elsewhere_keeps_its_folded_count(shipped_rules):
    """Marked as the workload's (workload_elsewhere), a storm's observation still counts all its repeats."""
    p = pipeline(shipped_rules)
    fault(p, 0, "a/Job/x", 10.0)
    p.handle(obs(Signal.XID, 31, 20.0, gpu_ref=gpu(1), count=4, workload="a/Job/x"), 20.0)
    assert p.occurrences(gpu(1).key, "xid-31") == 4
