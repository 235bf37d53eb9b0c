"""An upgrade from the previous release and its rollback on the real node, as a platform team does them with
helm from the registry: the previous release (its own commit's image and chart, scripts/publish-previous-release)
holds a live fault when `helm upgrade` replaces it with the release under test, and `helm rollback` brings it
back; each new agent resumes from the journal on the state hostPath and repeats nothing."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from agent.fleet.published import SUMMARY_ANNOTATION
from agent.fleet.summary import NodeSummary
from agent.k8s.node import AGENT_CONDITIONS, STATE_ANNOTATION
from tests.conftest import FakeNvml
from tests.realnode import agent
from tests.realnode.installs import Install, Installs
from tests.realnode.marks import agent_taints, eviction_events, holder_evicted_by_xid, journaled_record
from tests.realnode.node import RealNode
from tests.realnode.registry import Published
from tests.realnode.runtime import wait_until

MODE = "remediate"  # the mode that evicts: a repeated eviction would show
WATCHED_PASSES = 5  # the agent reconciles every second (tick_seconds): a repeated step shows within these
# The previous release's own parser, run in its own pod (kubectl exec): the summary on stdin, its faults out.
READ_SUMMARY = ("import json, sys; from agent.fleet.summary import NodeSummary; "
                "s = NodeSummary.from_json(sys.stdin.read(), source='stdin'); "
                "print(json.dumps(sorted([f.rule_id, str(f.fault_class)] for f in s.faults)))")


@dataclass(frozen=True, slots=True)
class Marks:
    """What an upgrade must leave as it was: the agent's taints (with when they were added), its conditions
    (with their last transition), the node's record in the journal and as the running agent mirrors it."""

    taints: list[tuple[str, str, Any]]
    conditions: list[tuple[str, str, str, Any]]
    record: dict[str, Any]
    mirror: str  # the record as the running agent mirrors it to the Node (its state annotation)


def marks(node: RealNode) -> Marks:
    current = node.node()
    conditions = sorted((c.type, c.status, c.reason, c.last_transition_time) for c in current.status.conditions
                        if c.type in AGENT_CONDITIONS)
    mirror = str((current.metadata.annotations or {}).get(STATE_ANNOTATION, ""))
    return Marks(agent_taints(node), conditions, journaled_record(node) or {}, mirror)


def settled_marks(node: RealNode) -> Marks:
    """The marks once the agent's pass has ended: the journal is written as each step is taken, the mirror with
    the pass's one Node write at its end, so a reading between the two finds the mirror generations behind the
    journal. Settled: the mirror at the journal's generation, and the same marks read a second later."""
    def settled() -> Marks | None:
        first = marks(node)
        mirrored = json.loads(first.mirror) if first.mirror else {}
        if not first.record or mirrored.get("generation") != first.record.get("generation"):
            return None
        time.sleep(1)
        return first if marks(node) == first else None
    return wait_until(settled, "the agent's pass ended (its mirror at the journal's generation)", timeout=60)


def summary_faults(text: str) -> list[list[str]]:
    """The faults of a published fleet summary as this release's fleet code reads them: rule and class."""
    summary = NodeSummary.from_json(text, source=SUMMARY_ANNOTATION)
    return sorted([f.rule_id, str(f.fault_class)] for f in summary.faults)


def published_summary(node: RealNode) -> str:
    return str((node.node().metadata.annotations or {}).get(SUMMARY_ANNOTATION, ""))


def running(node: RealNode, release: Published) -> Any:
    """The one agent pod, Ready, its container running `release`'s image by digest (the other version's
    pod gone)."""
    def only_ready() -> Any:
        node.check_alive()
        pods = agent.agent_pods(node.plane)
        if len(pods) != 1 or pods[0].metadata.deletion_timestamp is not None:
            return None
        statuses = pods[0].status.container_statuses or []
        ours = next((c for c in statuses if c.name == "agent"), None)
        if ours is None or not ours.ready or not (ours.image_id or "").endswith(release.digest):
            return None
        return pods[0]
    return wait_until(only_ready, f"the agent of {release.image}@{release.digest} the only one, Ready", timeout=180)


def assert_nothing_repeated(node: RealNode, before: Marks, held_uid: str, port: int) -> None:
    """Once the new agent has loaded the record (its active-fault gauge), the marks stay as they were over its
    next WATCHED_PASSES reconcile passes (one a second), and it evicted nobody and sent no eviction Event."""
    wait_until(lambda: agent.metric(agent.metrics(port), "gpu_health_active_faults") > 0,
               "the new agent's record loaded (gpu_health_active_faults)", timeout=60)
    for _ in range(WATCHED_PASSES):
        after = marks(node)
        assert after.taints == before.taints
        assert after.conditions == before.conditions
        assert after.record == before.record
        assert after.mirror == before.mirror
        time.sleep(1)
    text = agent.metrics(port)
    assert agent.metric(text, "gpu_health_remediation_steps_total", kind="evict") == 0, text
    events = eviction_events(node, held_uid)
    assert len(events) == 1 and (events[0].count or 1) == 1, events


@pytest.mark.timeout(1500)  # the previous release's build, when its commit's image is not cached yet, included
def test_an_upgrade_from_the_previous_release_and_its_rollback_keep_the_record_and_repeat_nothing(
        installs: Installs, real_node: RealNode, healthy_gpus: FakeNvml, published: Published,
        previous_published: Published, tmp_path: Path):
    """The previous release installed by helm from the registry evicts the holder of a GPU with Xid 79 and
    taints the node; `helm upgrade` to the release under test, then `helm rollback` to the first revision,
    each replace the agent's pod with the other version's image, and after each: the record (journaled and
    mirrored to the Node), the taint and the condition as they were, no second eviction or eviction Event;
    the release under test reads the fleet summary the previous one published, and the previous one reads
    the summary as the release under test writes it."""
    assert previous_published.digest != published.digest, "the previous release is the release under test"
    plane = real_node.plane
    installs.release()
    directory, port = agent.overlay(tmp_path, plane, healthy_gpus.path, MODE, helm=True)
    agent.helm_install(plane, directory, MODE, previous_published)
    installs.track(Install(f"{MODE}:helm", None, port))
    try:
        running(real_node, previous_published)
        held_uid = holder_evicted_by_xid(real_node, healthy_gpus)  # by the previous release
        before = settled_marks(real_node)
        assert before.taints and before.conditions and before.record and before.mirror
        by_previous = published_summary(real_node)
        faults = summary_faults(by_previous)  # the release under test reads the previous one's summary
        assert faults, by_previous

        agent.helm_upgrade(plane, directory, MODE, published)
        running(real_node, published)
        assert_nothing_repeated(real_node, before, held_uid, port)
        assert summary_faults(published_summary(real_node)) == faults
        # The agent publishes its summary with its record, which the upgrade left as it was (checked above): the
        # summary on the Node may still be the previous agent's, so the release under test's own writer makes
        # its form of it, for the previous release to read after the rollback.
        by_current = NodeSummary.from_json(published_summary(real_node)).to_json()

        agent.helm_rollback(plane, 1)
        rolled_back = running(real_node, previous_published)
        assert_nothing_repeated(real_node, before, held_uid, port)
        read = plane.kubectl("exec", "-i", "-n", agent.AGENT_NAMESPACE, rolled_back.metadata.name, "-c", "agent",
                             "--", "/opt/gpu-health-agent/bin/python", "-c", READ_SUMMARY, input_text=by_current)
        assert json.loads(read) == faults  # the previous release reads the summary as the release under test writes it
        history = json.loads(agent.helm("history", "gpu-health-agent", "-o", "json", plane=plane))
        assert [(h["revision"], h["status"]) for h in history] == [(1, "superseded"), (2, "superseded"),
                                                                   (3, "deployed")]
    finally:
        installs.release()
