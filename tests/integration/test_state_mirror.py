"""The Node's state annotation (the record's mirror) stays within the API server's annotation limit, on the
fake and on the real control plane, and a restart that lost its journal adopts what the bounded mirror kept."""

from __future__ import annotations

import json

from agent.k8s.node import STATE_ANNOTATION
from agent.model import Observation, Signal
from agent.remediation import Mode
from tests.k8s_helpers import TAINT, gpu_node, make_agent, restart

#: Xids that raise a fault on their first occurrence (tests/unit/test_xid_catalog.py has their policy):
#: 80 on each of 8 GPUs is 640 active faults: the whole record (about 320 KB) no longer fits.
CODES = range(1, 81)
#: apimachinery's TotalAnnotationSizeLimitB.
LIMIT = 256 * 1024


def _many_faults(agent) -> None:
    agent.pipeline.inline = False  # as the daemon runs it: classification first, one reconciliation pass after
    for gpu in agent.inventory.gpus:
        for code in CODES:
            agent.pipeline.handle(Observation(Signal.XID, code, 1.0, "kmsg", gpu), 1.0)
    agent.pipeline.reconcile(2.0)


def test_the_state_annotation_stays_current_and_within_the_limit_past_400_faults(fake):
    """640 active faults: the mirror is written (no 422), is the record's generation, and says it is cut."""
    cluster, server = fake
    agent = make_agent(cluster, server, gpu_node("n1"), mode=Mode.QUARANTINE)
    _many_faults(agent)
    assert len(agent.pipeline.record.faults) == 640
    annotations = cluster.node("n1")["metadata"]["annotations"]
    state = json.loads(annotations[STATE_ANNOTATION])
    assert state["generation"] == agent.pipeline.record.generation
    assert state["truncated"]["faults"] == 640 and 0 < state["truncated"]["kept_faults"] < 640
    assert sum(len(k.encode()) + len(v.encode()) for k, v in annotations.items()) <= LIMIT


def test_a_restart_without_its_journal_adopts_what_the_bounded_mirror_kept(fake):
    """Journal lost: the new process takes the kept faults (each GPU's worst among them, so the node stays
    quarantined) and no kernel-log cursor, so the kernel log is read again and the rest are raised again."""
    cluster, server = fake
    agent = make_agent(cluster, server, gpu_node("n1"), mode=Mode.QUARANTINE)
    agent.pipeline.record.cursors["kmsg"] = "boot-1:4242"  # as the kernel-log source acknowledges its records
    _many_faults(agent)
    state = json.loads(cluster.node("n1")["metadata"]["annotations"][STATE_ANNOTATION])
    worst = {gpu.key: "xid-79" for gpu in agent.inventory.gpus}  # reboot_node: the highest action raised
    again = restart(agent)  # no journal file: a fresh record
    faults = again.pipeline.record.faults
    assert len(faults) == state["truncated"]["kept_faults"]
    assert {(key, rule) for key, rule in worst.items()} <= set(faults)
    assert "kmsg" not in again.pipeline.record.cursors
    again.pipeline.reconcile(3.0)
    assert any(t["key"] == TAINT for t in cluster.node("n1")["spec"].get("taints") or [])
