"""The real API server's limit on a Node's annotations, which the agent's state annotation is bounded by."""

from __future__ import annotations

import json

import pytest
from kubernetes.client.rest import ApiException

from agent.k8s.node import STATE_ANNOTATION, NodeWriter
from agent.k8s.raw import RawApi
from agent.remediation.record import MIRROR_MAX_BYTES, mirror_of
from tests.integration.test_state_mirror import LIMIT
from tests.realcluster.backend import RealServer


def _record(faults: int) -> dict[str, object]:
    """A record with this many active faults, as NodeRecord.to_json writes them (about 500 bytes each)."""
    return {"generation": 1, "remediation": {}, "owed": [], "gpus": [], "cursors": {"kmsg": "b:1"},
            "faults": [{"rule_id": f"xid-{i % 200}", "gpu_key": f"GPU-{i // 200}", "severity": "warning",
                        "action": "notify", "summary": "x" * 380, "since": float(i), "gpu": None, "recovery": "quiet",
                        "quiet_seconds": 3600.0, "fault_class": "driver", "occurrences": 1, "observed_at": 1.0}
                       for i in range(faults)]}


def test_the_real_server_refuses_node_annotations_past_256_kib(control_plane):
    """A state annotation just over the limit is a 422 naming metadata.annotations: the fake mirrors this."""
    control_plane.add_gpu_node("big", 1)
    text = json.dumps(_record(600), sort_keys=True, separators=(",", ":"))
    assert len(text) > LIMIT
    with pytest.raises(ApiException) as refused:
        control_plane.core.patch_node("big", {"metadata": {"annotations": {STATE_ANNOTATION: text}}})
    assert refused.value.status == 422 and "metadata.annotations: Too long" in str(refused.value.body)


def test_the_bounded_mirror_of_600_faults_is_written_by_the_agents_own_identity(control_plane):
    """The same record bounded: the agent's Node writer (its own token) gets it accepted."""
    control_plane.add_gpu_node("big2", 1)
    server = RealServer(control_plane)
    writer = NodeWriter(RawApi(server.agent_client("big2")), "big2", taint_key="gpu-health-agent.io/unhealthy")
    document = mirror_of(_record(600))
    assert writer.save_record(document)
    written = control_plane.rest("GET", "/api/v1/nodes/big2")["metadata"]["annotations"][STATE_ANNOTATION]
    assert len(written) <= MIRROR_MAX_BYTES and json.loads(written)["truncated"]["faults"] == 600
