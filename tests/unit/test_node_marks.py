"""The pure diff from the agent's wanted marks to the Node patches: what goes where, and what is never touched."""

from __future__ import annotations

from typing import Any

from agent.k8s.node_marks import ConditionWant, NodeMarks, TaintOptions, node_patches

TAINT = TaintOptions("gpu-health-agent.io/unhealthy")
NOW = "2026-12-07T01:00:00Z"


def node(**parts: Any) -> Any:
    return {"metadata": {"name": "n1", "resourceVersion": "7", "labels": {}, "annotations": {}},
            "spec": {}, "status": {"conditions": []}, **parts}


def fatal(status: bool = True) -> dict[str, ConditionWant]:
    return {"GpuFatalFault": ConditionWant(status, "GpuFatalFault", "xid 79", create=True)}


def test_the_taint_is_added_beside_foreign_taints_which_survive():
    """Taints are one list: the patch carries the others unchanged, and the agent's added at its end."""
    foreign = {"key": "someone/else", "effect": "NoSchedule"}
    patches = node_patches(NodeMarks(taint=True), node(spec={"taints": [foreign]}), taint=TAINT, now=NOW)
    assert patches.main is not None and patches.status is None
    assert patches.main["spec"]["taints"] == [foreign, {"key": TAINT.key, "value": "gpu-fault",
                                                        "effect": "NoSchedule", "timeAdded": NOW}]


def test_removing_the_taint_keeps_every_foreign_taint():
    """The untaint leaves the others as they were."""
    foreign = {"key": "someone/else", "effect": "NoExecute"}
    observed = node(spec={"taints": [foreign, {"key": TAINT.key, "effect": "NoSchedule"}]})
    patches = node_patches(NodeMarks(taint=False), observed, taint=TAINT, now=NOW)
    assert patches.main is not None and patches.main["spec"]["taints"] == [foreign]


def test_labels_and_annotations_ride_with_the_status_patch_where_there_is_one():
    """Conditions and metadata in one status patch; the Node itself is not written."""
    marks = NodeMarks(conditions=fatal(), labels={"gpu-health-agent.io/disruption": "active"},
                      annotations={"gpu-health-agent.io/state": "{}"})
    patches = node_patches(marks, node(), taint=TAINT, now=NOW)
    assert patches.main is None and patches.status is not None
    assert patches.status["metadata"] == {"labels": {"gpu-health-agent.io/disruption": "active"},
                                          "annotations": {"gpu-health-agent.io/state": "{}"}}
    assert [c["type"] for c in patches.status["status"]["conditions"]] == ["GpuFatalFault"]


def test_metadata_alone_goes_to_the_node_itself():
    """No condition changes: labels and annotations are one patch of the Node."""
    patches = node_patches(NodeMarks(annotations={"gpu-health-agent.io/state": "{}"}), node(), taint=TAINT, now=NOW)
    assert patches.status is None and patches.main == {"metadata": {"annotations": {"gpu-health-agent.io/state": "{}"}}}


def test_a_node_that_already_shows_the_marks_needs_no_patch():
    """Nothing is written where nothing differs (a label already there, a condition as wanted)."""
    observed = node(metadata={"name": "n1", "resourceVersion": "7", "labels": {"a/b": "c"}, "annotations": {}},
                    status={"conditions": [{"type": "GpuFatalFault", "status": "True", "reason": "GpuFatalFault",
                                            "message": "xid 79"}]})
    assert node_patches(NodeMarks(conditions=fatal(), labels={"a/b": "c"}, annotations={"x/y": None}), observed,
                        taint=TAINT, now=NOW).empty()


def test_a_condition_keeps_its_transition_time_while_its_status_holds():
    """A new message on a condition still True keeps lastTransitionTime (repair timers read it)."""
    observed = node(status={"conditions": [{"type": "GpuFatalFault", "status": "True", "reason": "GpuFatalFault",
                                            "message": "old", "lastTransitionTime": "2026-01-01T00:00:00Z"}]})
    patches = node_patches(NodeMarks(conditions=fatal()), observed, taint=TAINT, now=NOW)
    assert patches.status is not None
    [condition] = patches.status["status"]["conditions"]
    assert condition["lastTransitionTime"] == "2026-01-01T00:00:00Z" and condition["lastHeartbeatTime"] == NOW


def test_an_absent_condition_is_not_created_to_clear_it():
    """Clearing a condition the Node never had writes nothing."""
    want = {"GpuFatalFault": ConditionWant(False, "GpuHealthy", "ok", create=False)}
    assert node_patches(NodeMarks(conditions=want), node(), taint=TAINT, now=NOW).empty()


def test_an_uncordon_is_only_of_a_cordon_the_agent_made():
    """Untainting removes unschedulable only where the agent's cordon annotation says it set it."""
    cordon = TaintOptions(TAINT.key, cordon=True)
    theirs = node(spec={"unschedulable": True})
    assert node_patches(NodeMarks(taint=False), theirs, taint=cordon, now=NOW).empty()
    ours = node(spec={"unschedulable": True},
                metadata={"name": "n1", "resourceVersion": "7", "annotations": {"gpu-health-agent.io/cordoned": NOW}})
    patches = node_patches(NodeMarks(taint=False), ours, taint=cordon, now=NOW)
    assert patches.main is not None and patches.main["spec"] == {"unschedulable": None}
    assert patches.main["metadata"]["annotations"] == {"gpu-health-agent.io/cordoned": None}
