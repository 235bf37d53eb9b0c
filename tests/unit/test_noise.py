"""Issue 26 item 13: what an operator should not be alarmed by, and what a single reading cannot say."""

from agent.check import check_node
from agent.engine import EngineState, evaluate
from agent.model import Severity, Signal
from agent.remediation.planner import verdict_events
from tests.conftest import gpu, obs


def test_a_solo_xid_45_is_a_normal_event_not_a_warning(shipped_rules):
    """Xid 45 with no cause follows every GPU pod killed mid-kernel (OOM, eviction): a Normal Event, no condition."""
    [verdict] = evaluate(obs(Signal.XID, 45), EngineState(), 0.0, rules=shipped_rules)
    assert verdict.severity is Severity.INFO
    [event] = [s for s in verdict_events([verdict], _inventory(), "node-1")]
    assert event.details["type"] == "Normal"


def test_an_xid_45_right_after_another_xid_follows_it_without_saying_so(shipped_rules):
    """Within seconds of another Xid on the GPU, an Xid 45 is that Xid's cleanup even when its text names no cause."""
    state = EngineState()
    evaluate(obs(Signal.XID, 13, 1.0), state, 1.0, rules=shipped_rules)
    verdicts = evaluate(obs(Signal.XID, 45, 2.0), state, 2.0, rules=shipped_rules)
    assert [v.rule_id for v in verdicts] == ["xid-45-after-xid"]


def test_fabric_manager_advice_is_given_for_nvswitch_systems_only(shipped_rules):
    """"Restart the Fabric Manager" is NVIDIA's advice where there is one (NVSwitch systems), not everywhere."""
    reason = shipped_rules.get("xid-45-solo").reason or ""
    assert "NVSwitch" in reason and "restart the fabric manager" not in reason.lower().split("nvswitch")[0]


def test_check_does_not_judge_fifteen_minutes_from_one_reading(shipped_rules):
    """A hardware slowdown in the one reading `check` takes is reported as seen, not as held for 15 minutes."""
    report = check_node(shipped_rules, gpus=[(gpu(0), {})], observations=[obs(Signal.CLOCK_EVENTS, 0x48)], now=0.0,
                        sources={})
    [gpu_report] = report.gpus
    assert gpu_report.status == "healthy"
    assert "cannot be judged from one reading" in gpu_report.why
    assert "held in hardware slowdown for 15 minutes" not in gpu_report.why


def test_nvlink_down_reason_does_not_speak_of_the_agents_start(shipped_rules):
    """Links are judged against what was seen up before (kept across restarts), not since the agent started."""
    rule = shipped_rules.get("nvlink-link-down")
    assert "since the agent started" not in (rule.reason or "") + rule.summary


def _inventory():
    from agent.model import NodeInventory
    return NodeInventory("node-1", (gpu(0),), ())
