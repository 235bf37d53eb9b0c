"""What the agent left on the real node, read as a test compares it: its taints, its eviction Events, the pods it
evicted, and the node's record in its journal on the state hostPath; and the fault that makes them."""

from __future__ import annotations

import contextlib
import json
import sqlite3
from typing import Any

from kubernetes.client.exceptions import ApiException

from tests.conftest import FakeNvml, eight_gpus
from tests.realnode import agent
from tests.realnode.node import AGENT_STATE, NODE_NAME, RealNode
from tests.realnode.runtime import wait_until
from tests.realnode.test_node import GPU_UUIDS, given_devices, gpu_pod, stopped_by


def evicted(node: RealNode, name: str) -> bool:
    """The pod deleted through the API and its container stopped by SIGTERM."""
    try:
        pod = node.plane.core.read_namespaced_pod(name, "trainers")
    except ApiException as exc:
        gone = exc.status == 404
    else:
        gone = pod.metadata.deletion_timestamp is not None
    return gone and stopped_by(node, name) == "SIGTERM"


def agent_taints(node: RealNode) -> list[tuple[str, str, Any]]:
    return sorted((t.key, t.effect, t.time_added) for t in node.node().spec.taints or []
                  if t.key.startswith("gpu-health-agent.io/"))


def eviction_events(node: RealNode, pod_uid: str) -> list[Any]:
    """The EvictedForGpuFault Events regarding this pod (by uid: earlier tests evicted pods of the same name,
    and their Events live on for an hour)."""
    events = node.plane.core.list_event_for_all_namespaces(field_selector="reason=EvictedForGpuFault").items
    return [e for e in events if e.involved_object is not None and e.involved_object.uid == pod_uid]


def journaled_record(node: RealNode) -> dict[str, Any] | None:
    """The node's record as the agent's journal on the state hostPath holds it (what a new process resumes
    from); read-only, beside the running agent (SQLite in WAL mode)."""
    try:
        with contextlib.closing(sqlite3.connect(f"file:{AGENT_STATE / 'journal.db'}?mode=ro", uri=True)) as db:
            row = db.execute("SELECT value FROM cursors WHERE name = ?", (f"record:{NODE_NAME}",)).fetchone()
    except sqlite3.Error:  # busy for a moment, or not there yet: asked again
        return None
    return dict(json.loads(row[0])) if row else None


def owed_eviction_events(node: RealNode) -> list[Any]:
    """EvictedForGpuFault Events the journaled record still owes (not yet acknowledged as delivered)."""
    record = journaled_record(node) or {}
    return [e for e in record.get("owed") or [] if e.get("reason") == "EvictedForGpuFault"]


def holder_evicted_by_xid(node: RealNode, nvml: FakeNvml) -> str:
    """A trainer pod holds one GPU and NVML delivers Xid 79 on it: the installed agent evicts it (SIGTERM),
    sends its EvictedForGpuFault Event and acknowledges the delivery in the journal (an agent killed between
    the two sends the Event again: Events are delivered at least once); NVML then reads healthy, as it does to
    a new process, which is delivered no event again. The pod's uid."""
    held_uid = str(gpu_pod(node, "held", gpus=1)["metadata"]["uid"])
    agent.xid(nvml, GPU_UUIDS.index(given_devices(node, "held")[0]))
    wait_until(lambda: evicted(node, "held"), "the holder evicted (SIGTERM)", timeout=60)
    wait_until(lambda: eviction_events(node, held_uid), "the agent's EvictedForGpuFault Event", timeout=30)
    wait_until(lambda: journaled_record(node) is not None and not owed_eviction_events(node),
               "the Event's delivery acknowledged in the journal", timeout=30)
    nvml.write(eight_gpus())
    return held_uid
