"""The probe's judgement (`helm test`): every node the DaemonSet should cover has its agent Ready and answering."""

from __future__ import annotations

from agent.install_probe import AgentPod, Answer, asked, judge

HEALTHY = {"mode": "remediate", "dry_run": False, "sources": ["kmsg"], "loop_age_seconds": 0.2}


def answering(name: str, node: str) -> AgentPod:
    return AgentPod(name, node, "10.0.0.1", True, "Running",
                    {"/healthz": Answer(200, dict(HEALTHY)), "/readyz": Answer(200, dict(HEALTHY))})


def test_every_agent_answering_on_every_scheduled_node_passes():
    """Two nodes, two agents answering: ok, one line a node saying what the agent reports about itself."""
    verdict = judge(2, [answering("a-1", "n2"), answering("a-0", "n1")])
    assert verdict.ok
    assert verdict.lines == ["node n1: pod a-0 answers: mode remediate, sources kmsg, loop 0.2s ago",
                             "node n2: pod a-1 answers: mode remediate, sources kmsg, loop 0.2s ago",
                             "2 of 2 agent(s) answer"]


def test_a_node_without_its_agent_pod_fails():
    """The DaemonSet should run on two nodes, one pod exists: not ok, the missing one counted."""
    verdict = judge(2, [answering("a-0", "n1")])
    assert not verdict.ok
    assert verdict.lines[-1] == "1 of 2 agent(s) answer, 1 missing: not every node is covered"


def test_a_daemonset_scheduled_on_no_node_fails_saying_why():
    """No node matches the DaemonSet: not ok (an install that covers nothing), with the label it looks for."""
    verdict = judge(0, [])
    assert not verdict.ok
    assert "no node matches its nodeSelector" in verdict.lines[-1]


def test_an_agent_not_ready_and_without_an_ip_is_named_with_both():
    """A pod still Pending with no IP: not asked, its line says both."""
    pod = AgentPod("a-0", "n1", "", False, "Pending")
    verdict = judge(1, asked([pod], 9402, 1.0, get=lambda *args: Answer(200)))
    assert not verdict.ok
    assert verdict.lines[0] == "node n1: pod a-0 not Ready (phase Pending); no pod IP yet"


def test_an_unreachable_agent_is_named_with_the_reason():
    """Nothing answered the probe: the endpoint named unreachable, with what the connection said."""
    pod = AgentPod("a-0", "n1", "10.0.0.1", True, "Running")
    verdict = judge(1, asked([pod], 9402, 1.0, get=lambda ip, port, path, t: Answer(0, error="timed out")))
    assert verdict.lines[0] == "node n1: pod a-0 /healthz unreachable: timed out; /readyz unreachable: timed out"
