"""Issue 24, the quarantine brake's own Event and an operator's confirm: a node whose new taint the brake keeps
waiting says so once, and `gpu-health-agent fleet confirm` lets that taint (and nothing else) through."""

from __future__ import annotations

import time
from typing import Any

import pytest
from click.testing import CliRunner
from prometheus_client import CollectorRegistry

from agent.cli import main
from agent.fleet import BrakePolicy
from agent.fleet.confirm import CONFIRM_SECONDS, confirm_value
from agent.k8s.node import CONFIRM_ANNOTATION, NodeWriter
from agent.k8s.raw import RawApi
from agent.logs import capture_logs
from agent.metrics import Metrics
from agent.model import StepKind
from agent.remediation import Mode
from tests.k8s_helpers import (
    Agent,
    gpu_node,
    make_agent,
    operator_client,
    operator_kubeconfig,
    restart,
    running_pods,
)

pytestmark = pytest.mark.usefixtures("no_retry_sleep")
#: One new quarantine per window, whatever else the cluster holds: the second node to fault always waits, on
#: the fake and on the real control plane the session's tests share.
BRAKE = BrakePolicy(max_share=0.0, min_nodes=1, max_nodes=1, window_seconds=600.0)
REASON = "QuarantineBraked"


class Clock:
    """The fleet view's monotonic and wall clock at once, from a real wall time, moved by the test."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def braked(fake: Any, clock: Clock, metrics: Metrics | None = None) -> tuple[Agent, Agent]:
    """Two GPU nodes fall off the bus (Xid 79) one after the other: the first is tainted, the second (its
    agent's metrics `metrics`) waits."""
    cluster, server = fake
    first, second = (make_agent(cluster, server, gpu_node(name, gpus=2), mode=Mode.QUARANTINE, brake=BRAKE,
                                fleet_clock=clock, metrics=of)
                     for name, of in (("brake-a", None), ("brake-b", metrics)))
    first.fault(0, xid=79, at=1.0)
    second.fault(0, xid=79, at=1.0)
    return first, second


def tainted(fake: Any, name: str) -> bool:
    return bool(fake[0].node(name)["spec"].get("taints"))


def annotations(fake: Any, name: str) -> dict[str, str]:
    return fake[0].node(name)["metadata"].get("annotations") or {}


def braked_events(fake: Any, name: str) -> list[dict[str, Any]]:
    return [e for e in fake[0].events() if e.get("reason") == REASON and e["regarding"]["name"] == name]


def fleet_confirm(fake: Any, tmp_path: Any, *args: str) -> Any:
    """`gpu-health-agent fleet confirm ARGS` with the operator's credentials."""
    return CliRunner().invoke(main, ["fleet", "confirm", *args, "--kubeconfig", operator_kubeconfig(fake[1], tmp_path)],
                              catch_exceptions=False)


def annotate(fake: Any, name: str, value: str) -> None:
    """What an operator's `kubectl annotate` does, bypassing the CLI's checks."""
    NodeWriter(RawApi(operator_client(fake[1])), name, taint_key="").set_metadata(
        annotations={CONFIRM_ANNOTATION: value})


def test_a_braked_node_is_sent_one_quarantine_braked_event_however_many_passes_it_waits(fake):
    """Three more passes of waiting deliver no second QuarantineBraked Event; the one there names the way out."""
    _, second = braked(fake, Clock())
    sent = [a for at in (100.0, 200.0, 300.0) for a in second.settle(at).actions
            if a.step.kind is StepKind.EVENT and a.step.details.get("reason") == REASON]
    assert not tainted(fake, "brake-b") and sent == []
    [event] = braked_events(fake, "brake-b")
    assert "gpu-health-agent fleet confirm brake-b" in event["note"] and event["type"] == "Warning"


def test_a_restart_during_the_wait_sends_no_second_braked_event(fake):
    """The agent restarts while its taint waits: the Node still has one QuarantineBraked Event."""
    _, second = braked(fake, Clock())
    again = restart(second)
    again.settle(100.0)
    assert not tainted(fake, "brake-b") and len(braked_events(fake, "brake-b")) == 1


def test_fleet_confirm_lets_the_waiting_taint_through_at_the_next_pass(fake, tmp_path):
    """The operator confirms the waiting node: its agent's next pass taints it and removes the confirm."""
    _, second = braked(fake, Clock())
    result = fleet_confirm(fake, tmp_path, "brake-b")
    assert result.exit_code == 0, result.output
    assert CONFIRM_ANNOTATION in annotations(fake, "brake-b") and not tainted(fake, "brake-b")
    second.settle(100.0)
    assert tainted(fake, "brake-b") and CONFIRM_ANNOTATION not in annotations(fake, "brake-b")


def test_a_used_confirm_is_logged_once_naming_the_brake_it_lifted(fake, tmp_path):
    """The operator's confirm that lets a waiting taint through is one warning line, `brake_confirmed`, with
    the node, the brake's refusal it lifted and the confirm's value."""
    _, second = braked(fake, Clock())
    assert fleet_confirm(fake, tmp_path, "brake-b").exit_code == 0
    value = annotations(fake, "brake-b")[CONFIRM_ANNOTATION]
    with capture_logs() as captured:
        for at in (100.0, 200.0, 300.0):
            second.settle(at)
    [line] = [e for e in captured if e["event"] == "brake_confirmed"]
    assert line["log_level"] == "warning" and line["confirm"] == value
    assert str(line["brake"]).startswith("quarantine brake: 1 of 2 GPU nodes") and line["node"] == "brake-b"
    assert tainted(fake, "brake-b")


def test_the_braked_gauge_says_whether_the_taint_waits_and_the_used_confirm_is_counted(fake, tmp_path):
    """gpu_health_quarantine_braked is 1 while the taint waits, 0 once the confirm let it through; the confirm
    is counted as used."""
    registry = CollectorRegistry()
    _, second = braked(fake, Clock(), Metrics(registry))
    waiting = registry.get_sample_value("gpu_health_quarantine_braked")
    fleet_confirm(fake, tmp_path, "brake-b")
    second.settle(100.0)
    assert (waiting, registry.get_sample_value("gpu_health_quarantine_braked")) == (1.0, 0.0)
    assert registry.get_sample_value("gpu_health_brake_confirms_total", {"result": "used"}) == 1.0


def test_a_confirm_lets_the_taint_through_but_no_eviction_past_a_spent_budget(fake, tmp_path):
    """In remediate mode the first node holds the one budget slot: the confirmed node is tainted, and its
    pods stay where they are, the evictions blocked by the budget as without a confirm."""
    cluster, server = fake
    clock = Clock()
    first, second = (make_agent(cluster, server, gpu_node(name, gpus=2), mode=Mode.REMEDIATE, brake=BRAKE,
                                fleet_clock=clock, max_nodes=1, max_percent=100) for name in ("brake-a", "brake-b"))
    first.fault(0, xid=79, at=1.0)
    second.fault(0, xid=79, at=1.0)
    assert fleet_confirm(fake, tmp_path, "brake-b").exit_code == 0
    steps = second.settle(100.0).actions
    assert tainted(fake, "brake-b") and running_pods(cluster, "brake-b") >= {"brake-b-trainer-0"}
    assert {(str(a.step.kind), a.message) for a in steps if a.step.kind is StepKind.EVICT} == {
        ("evict", "cluster-wide disruption budget exhausted")}


def test_a_confirm_found_with_nothing_waiting_is_removed_and_lets_no_later_taint_through(fake, tmp_path):
    """A confirm the agent finds while no taint waits (written by hand) is consumed unused: a fault that comes
    to wait afterwards waits."""
    cluster, server = fake
    clock = Clock()
    first = make_agent(cluster, server, gpu_node("brake-a", gpus=2), mode=Mode.QUARANTINE, brake=BRAKE,
                       fleet_clock=clock)
    first.fault(0, xid=79, at=1.0)
    second = make_agent(cluster, server, gpu_node("brake-b", gpus=2), mode=Mode.QUARANTINE, brake=BRAKE,
                        fleet_clock=clock)
    annotate(fake, "brake-b", confirm_value(clock()))
    second.settle(100.0)
    assert CONFIRM_ANNOTATION not in annotations(fake, "brake-b")
    second.fault(0, xid=79, at=150.0)
    second.settle(300.0)
    assert not tainted(fake, "brake-b")


def test_a_confirm_older_than_its_lifetime_lets_nothing_through(fake):
    """A confirm written more than 15 minutes before its agent first sees it (the agent was down) has
    expired: the taint keeps waiting and the confirm is removed."""
    clock = Clock()
    _, second = braked(fake, clock)
    annotate(fake, "brake-b", confirm_value(clock() - CONFIRM_SECONDS - 60.0))
    second.settle(100.0)
    assert not tainted(fake, "brake-b") and CONFIRM_ANNOTATION not in annotations(fake, "brake-b")


def test_a_confirm_the_agent_has_seen_expires_if_its_taint_cannot_go(fake):
    """An agent in observe mode never taints: a confirm annotated on its node lives 15 minutes, then is
    removed."""
    clock = Clock()
    cluster, server = fake
    first, second = (make_agent(cluster, server, gpu_node(name, gpus=2), mode=mode, brake=BRAKE, fleet_clock=clock)
                     for name, mode in (("brake-a", Mode.QUARANTINE), ("brake-b", Mode.OBSERVE)))
    first.fault(0, xid=79, at=1.0)
    second.fault(0, xid=79, at=1.0)
    annotate(fake, "brake-b", confirm_value(clock()))
    second.settle(100.0)
    assert CONFIRM_ANNOTATION in annotations(fake, "brake-b")
    clock.now += CONFIRM_SECONDS
    second.settle(200.0)
    assert CONFIRM_ANNOTATION not in annotations(fake, "brake-b")


def test_confirm_with_dry_run_prints_the_annotation_and_writes_nothing(fake, tmp_path):
    """--dry-run says what it would write on the waiting node; the Node is left as it was."""
    braked(fake, Clock())
    result = fleet_confirm(fake, tmp_path, "brake-b", "--dry-run")
    assert result.exit_code == 0 and f"would annotate node brake-b {CONFIRM_ANNOTATION}=" in result.output
    assert CONFIRM_ANNOTATION not in annotations(fake, "brake-b")


def test_confirm_of_a_node_with_nothing_waiting_is_one_line_and_no_write(fake, tmp_path):
    """The tainted node has no taint waiting: refused in one line (exit 2), nothing written."""
    braked(fake, Clock())
    result = fleet_confirm(fake, tmp_path, "brake-a")
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert result.output.strip().splitlines() == [
        "gpu-health-agent fleet confirm: node brake-a: no taint waits on the quarantine brake (its conditions "
        "do not say 'quarantine brake: the taint waits'), nothing to confirm"]
    assert CONFIRM_ANNOTATION not in annotations(fake, "brake-a")


def test_confirm_of_a_node_that_does_not_exist_is_one_line(fake, tmp_path):
    """An unknown node: `no such node`, exit 2."""
    result = fleet_confirm(fake, tmp_path, "brake-nowhere")
    assert result.exit_code == 2 and result.output.strip() == \
        "gpu-health-agent fleet confirm: no such node: brake-nowhere"


def test_confirm_by_selector_confirms_only_the_nodes_whose_taint_waits(fake, tmp_path):
    """--selector over both nodes: the waiting one is confirmed, the tainted one left alone."""
    braked(fake, Clock())
    result = fleet_confirm(fake, tmp_path, "--selector", "nvidia.com/gpu.present=true")
    assert result.exit_code == 0, result.output
    assert CONFIRM_ANNOTATION in annotations(fake, "brake-b") and CONFIRM_ANNOTATION not in annotations(fake,
                                                                                                        "brake-a")


def test_a_confirm_lets_through_a_taint_whose_claim_was_refused(fake, tmp_path):
    """Another node claimed the one place but is not quarantined yet: the count has room, the claim is refused
    and the taint waits; the operator's confirm lets it through without claiming again."""
    cluster, server = fake
    clock = Clock()
    ahead = make_agent(cluster, server, gpu_node("brake-c", gpus=2), mode=Mode.QUARANTINE, brake=BRAKE,
                       fleet_clock=clock)
    ahead.side.fleet.read(count=True)
    assert ahead.side.fleet.claim("brake-c") == ""
    waiting = make_agent(cluster, server, gpu_node("brake-d", gpus=2), mode=Mode.QUARANTINE, brake=BRAKE,
                         fleet_clock=clock)
    waiting.fault(0, xid=79, at=1.0)
    assert not tainted(fake, "brake-d") and len(braked_events(fake, "brake-d")) == 1
    assert fleet_confirm(fake, tmp_path, "brake-d").exit_code == 0
    clock.now += 61.0  # past the refusal's standing: the count has room and a claim would be refused again
    waiting.settle(100.0)
    assert tainted(fake, "brake-d")
