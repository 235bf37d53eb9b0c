"""The reconcile pass converges the Node to the record: a taint someone removed comes back (fake and real server)."""

from __future__ import annotations

import pytest

from agent.remediation import Mode
from tests.integration.test_node_writer import operator_sets_taints
from tests.k8s_helpers import TAINT, gpu_node, make_agent

pytestmark = pytest.mark.usefixtures("no_retry_sleep")


def test_a_taint_someone_removed_is_put_back_by_the_next_pass(fake):
    """The pass reads the Node, not its memory of it: a fault's taint removed by hand is written again."""
    cluster, server = fake
    agent = make_agent(cluster, server, gpu_node("tc1"), mode=Mode.QUARANTINE)
    agent.fault(3)
    assert [t["key"] for t in cluster.node("tc1")["spec"].get("taints") or []] == [TAINT]
    operator_sets_taints(cluster, "tc1", [])
    agent.pipeline.reconcile(100.0)
    assert [t["key"] for t in cluster.node("tc1")["spec"].get("taints") or []] == [TAINT]
