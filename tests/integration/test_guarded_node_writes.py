"""Dry-run writes nothing and an opted-out node gets Events only: requests counted on the fake and real server."""

from __future__ import annotations

from typing import Any

import pytest

from agent.cluster_side import request_release
from agent.remediation import Mode
from tests.k8s_helpers import gpu_node, make_agent, operator_client

pytestmark = pytest.mark.usefixtures("no_retry_sleep")

#: A write as the fake logs it (HTTP method) and as the real server's audit log does (verb).
WRITES = {"POST", "PUT", "PATCH", "DELETE", "create", "update", "patch", "delete"}
OPT_OUT = "gpu-health-agent.io/opt-out"


def writes_since(cluster: Any, start: int) -> list[tuple[str, str]]:
    """(verb, path) of every write the agents made from the request log's entry `start` on."""
    return [(str(verb), path) for verb, path, _ in cluster.log[start:] if str(verb) in WRITES]


def test_a_dry_run_agent_given_xid_79_writes_nothing(fake):
    """Dry-run in remediate mode: the fault is recorded, and no request writes anything, the Node included."""
    cluster, server = fake
    agent = make_agent(cluster, server, gpu_node("dry1"), mode=Mode.REMEDIATE, dry_run=True)
    before = cluster.node("dry1")
    start = len(cluster.log)
    agent.fault(3)
    agent.pipeline.reconcile(100.0)
    assert agent.pipeline.gpu_statuses()["GPU-dry1-0003"] == "fatal"
    assert writes_since(cluster, start) == []
    assert cluster.node("dry1")["metadata"].get("annotations", {}) == before["metadata"].get("annotations", {})


def test_an_opted_out_node_given_xid_79_gets_events_and_no_node_write(fake):
    """Opt-out: Events are written; the Node is not (no taint, no condition, no mirrored record)."""
    cluster, server = fake
    agent = make_agent(cluster, server, gpu_node("opt1"))
    agent.side.writer.set_metadata(labels={OPT_OUT: "true"})
    start = len(cluster.log)
    agent.fault(3)
    agent.pipeline.reconcile(100.0)
    writes = writes_since(cluster, start)
    assert writes, "the Events are written"
    assert [path for _, path in writes if "/events" not in path] == []


def test_a_release_on_an_opted_out_node_is_handled_once_and_writes_no_node(fake):
    """The release request is handled (the fault is released) but not consumed, since that would write the
    Node; left there, it does not release a fault that comes after it."""
    cluster, server = fake
    agent = make_agent(cluster, server, gpu_node("opt2"))
    agent.side.writer.set_metadata(labels={OPT_OUT: "true"})
    agent.fault(3)
    agent.pipeline.reconcile(50.0)
    request_release(operator_client(server), "opt2")
    start = len(cluster.log)
    released = agent.pipeline.reconcile(100.0)
    again = agent.pipeline.reconcile(200.0)
    assert agent.pipeline.gpu_statuses()["GPU-opt2-0003"] == "healthy"
    assert released.verdicts and not again.verdicts
    agent.fault(5, at=250.0)
    agent.pipeline.reconcile(300.0)
    assert agent.pipeline.gpu_statuses()["GPU-opt2-0005"] == "fatal"
    assert [path for _, path in writes_since(cluster, start) if "/events" not in path] == []
