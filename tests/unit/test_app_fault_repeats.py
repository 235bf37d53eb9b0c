"""Issue 26 items 8 and 9: the repeat patterns of application Xids count workloads (owners) within a window, and
quarantine only where a diagnostic can decide; without one they notify and clear by themselves."""

from agent.model import NodeInventory, Signal
from agent.pipeline import Pipeline
from agent.remediation import GuardPolicy, Mode
from agent.remediation.spread import LocationRepeats
from tests.conftest import gpu, obs

DAY = 86400.0
LOCATION = "GPC 0, TPC 0"


def pipeline(rules, *, diagnose: bool):
    return Pipeline(rules=rules, inventory=NodeInventory("node-1", (gpu(0), gpu(1)), ()),
                    policy=GuardPolicy(mode=Mode.QUARANTINE), clock=lambda: 100.0, diagnose=diagnose)


def xid13(p, workload, at, pid, location=LOCATION):
    attrs = {"pid": pid, "sm_location": location}
    if workload:
        attrs["workload"] = workload
    return p.handle(obs(Signal.XID, 13, at, gpu_ref=gpu(0), **attrs), at).verdicts


def rules_raised(p):
    return {f.rule_id for f in p.record.faults.values()}


def test_one_jobs_restarts_at_one_gpc_tpc_are_one_workload_and_never_quarantine(shipped_rules):
    """Three restarts of one job (a new process each) within hours, each faulting at GPC 0, TPC 0: one owner, no
    repeat pattern."""
    p = pipeline(shipped_rules, diagnose=True)
    for restart in range(3):
        xid13(p, "team-a/Job/train", restart * 3600.0 + 10, pid=1000 + restart)
    assert not {r for r in rules_raised(p) if r.startswith("xid-app-13-repeat")}
    assert not p.node.tainted


def test_processes_without_a_workload_never_count_as_different_tenants(shipped_rules):
    """Unattributed pids (another pid namespace, a crash-looping process) say nothing about owners."""
    p = pipeline(shipped_rules, diagnose=True)
    for n in range(5):
        xid13(p, "", 10.0 * n, pid=2000 + n)
    assert not {r for r in rules_raised(p) if r.startswith("xid-app-13-repeat")}


def test_three_owners_at_one_gpc_tpc_within_the_window_quarantine_where_a_diagnostic_decides(shipped_rules):
    """Three different owners fault at the same GPC/TPC within the window: a diagnostic will decide."""
    p = pipeline(shipped_rules, diagnose=True)
    for n, owner in enumerate(("a/Job/x", "b/Job/y", "c/Job/z")):
        xid13(p, owner, 3600.0 * n + 10, pid=100 + n)
    assert "xid-app-13-repeat-gpc-tpc" in rules_raised(p)
    assert p.node.tainted


def test_three_owners_at_one_gpc_tpc_days_apart_are_no_repeat(shipped_rules):
    """The window is bounded: owners two days apart at one location are not one pattern."""
    p = pipeline(shipped_rules, diagnose=True)
    for n, owner in enumerate(("a/Job/x", "b/Job/y", "c/Job/z")):
        xid13(p, owner, 2 * DAY * n + 10, pid=100 + n)
    assert not {r for r in rules_raised(p) if r.startswith("xid-app-13-repeat")}


def test_without_a_diagnostic_the_gpc_tpc_repeat_notifies_and_does_not_quarantine(shipped_rules):
    """No diagnostic can decide: the pattern is reported (degraded, notify), the node is not tainted."""
    p = pipeline(shipped_rules, diagnose=False)
    for n, owner in enumerate(("a/Job/x", "b/Job/y", "c/Job/z")):
        xid13(p, owner, 600.0 * n + 10, pid=100 + n)
    assert "xid-app-13-repeat-gpc-tpc-undiagnosed" in rules_raised(p)
    assert "xid-app-13-repeat-gpc-tpc" not in rules_raised(p)
    assert not p.node.tainted


def test_without_a_diagnostic_three_tenants_xid_31s_do_not_keep_the_node_tainted(shipped_rules):
    """Three tenants' Xid 31 on one GPU under the shipped config (no diagnostic): notified, never tainted, and the
    report clears by itself once the GPU is quiet."""
    p = pipeline(shipped_rules, diagnose=False)
    for n, owner in enumerate(("a/Job/x", "b/Job/y", "c/Job/z")):
        p.handle(obs(Signal.XID, 31, 10.0 * (n + 1), gpu_ref=gpu(0), workload=owner), 10.0 * (n + 1))
    assert "xid-app-faults-across-workloads-undiagnosed" in rules_raised(p)
    assert not p.node.tainted
    p.tick(7 * DAY)
    assert rules_raised(p) == set()


def test_the_location_memory_is_bounded():
    """At most max_workloads owners per location and max_locations locations are remembered."""
    repeats = LocationRepeats(max_locations=2, max_workloads=3)
    counts = [repeats.note("g0", LOCATION, f"owner-{n}", float(n)) for n in range(6)]
    assert counts == [1, 2, 3, 3, 3, 3]
    for n in range(5):
        repeats.note("g0", f"GPC {n}, TPC 0", "owner", 10.0 + n)
    assert repeats.locations() == 2


def test_another_tpc_or_another_gpu_is_another_location():
    """Owners count per GPU and GPC/TPC: a fault elsewhere starts its own count."""
    repeats = LocationRepeats()
    repeats.note("g0", LOCATION, "a", 1.0)
    assert repeats.note("g0", "GPC 0, TPC 1", "b", 2.0) == 1
    assert repeats.note("g1", LOCATION, "c", 3.0) == 1
    assert repeats.note("g0", LOCATION, "d", 4.0) == 2
