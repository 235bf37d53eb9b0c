"""AcceleratedHardwareReady on the real node (remediation.accelerated_hardware_condition on): False after a
fault that needs a reboot, its lastTransitionTime unmoved by the same fault again and by a new agent pod."""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import FakeNvml
from tests.realnode import agent
from tests.realnode.node import RealNode
from tests.realnode.runtime import wait_until

CONDITION = "AcceleratedHardwareReady"


def _condition(node: RealNode) -> Any:
    return next((c for c in node.node().status.conditions or [] if c.type == CONDITION), None)


def _handled_faults(port: int) -> float:
    """Xid observations the agent (the process serving `port`) has taken in."""
    return agent.metric(agent.metrics(port), "gpu_health_observations_total", signal="xid")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("installed", ["quarantine:repair-condition"], indirect=True)
def test_the_repair_condition_keeps_its_transition_time_across_a_repeated_fault_and_an_agent_restart(
        installed: tuple[str, Any, int], real_node: RealNode, healthy_gpus: FakeNvml):
    """Absent on the healthy node; Xid 79 (reboot_node) makes it False; the same Xid again, then the agent's
    pod deleted and made again by the DaemonSet (the new agent taking in the Xid once more), leave its
    status False and its lastTransitionTime where the first fault put it."""
    _, pod, port = installed
    assert _condition(real_node) is None  # no fault has needed repair: nothing for a repair tool to read
    agent.xid(healthy_gpus, 2)
    failed = wait_until(lambda: (c := _condition(real_node)) is not None and c.status == "False" and c,
                        "AcceleratedHardwareReady False after Xid 79", timeout=60)
    first = failed.last_transition_time
    before = _handled_faults(port)
    agent.xid(healthy_gpus, 2)
    wait_until(lambda: _handled_faults(port) > before, "the agent to take in the repeated Xid", timeout=30)
    real_node.plane.core.delete_namespaced_pod(pod.metadata.name, agent.AGENT_NAMESPACE)

    def new_agent_ready() -> Any:
        return next((p for p in agent.agent_pods(real_node.plane) if p.metadata.uid != pod.metadata.uid
                     and p.status.container_statuses and all(c.ready for c in p.status.container_statuses)), None)

    wait_until(new_agent_ready, "the DaemonSet's new agent pod Ready", timeout=90)
    agent.xid(healthy_gpus, 2)
    wait_until(lambda: _handled_faults(port) >= 1, "the new agent to take in the Xid", timeout=30)
    condition = _condition(real_node)
    assert condition.status == "False" and condition.last_transition_time == first, condition
