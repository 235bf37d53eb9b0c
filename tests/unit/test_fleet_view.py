"""The fleet controller's view: summaries from Node annotations, first sightings and boots on its clock."""

from __future__ import annotations

from typing import Any

from agent.fleet import FaultSummary, NodeSummary
from agent.fleet.published import SUMMARY_ANNOTATION
from agent.fleetctl.view import Labels, SummaryView
from agent.model import Action, FaultClass, Severity


def node(name: str, *rules: str, uptime: float = 3600.0, boot: str = "b1", labels: dict[str, str] | None = None,
         text: str | None = None) -> dict[str, Any]:
    faults = tuple(FaultSummary(r, FaultClass.APPLICATION, Severity.FATAL, Action.QUARANTINE) for r in rules)
    summary = NodeSummary(node=name, boot_id=boot, uptime_seconds=uptime, rack="from-summary", faults=faults)
    return {"metadata": {"name": name, "labels": labels or {},
                         "annotations": {SUMMARY_ANNOTATION: summary.to_json() if text is None else text}}}


def test_a_fault_keeps_its_first_sighting_while_it_stands():
    """Later updates of the same fault do not move when it was first seen."""
    view = SummaryView()
    view.observe(node("n1", "xid-13"), 10.0)
    view.observe(node("n1", "xid-13", "xid-31", uptime=3700.0), 20.0)
    seen = {s.rule_id: s.seen_at for s in view.sightings()}
    assert seen == {"xid-13": 10.0, "xid-31": 20.0}


def test_a_fault_that_ended_and_came_back_is_a_new_sighting():
    """Gone from the summary, the fault's first sighting is forgotten; its return is seen anew."""
    view = SummaryView()
    view.observe(node("n1", "xid-13"), 10.0)
    view.observe(node("n1"), 20.0)
    view.observe(node("n1", "xid-13"), 30.0)
    assert [s.seen_at for s in view.sightings()] == [30.0]


def test_the_boot_is_placed_once_per_boot_on_the_readers_clock():
    """booted_at = observed_at - uptime, kept for the boot; a new boot id places it again."""
    view = SummaryView()
    view.observe(node("n1", "xid-13", uptime=100.0), 1000.0)
    view.observe(node("n1", "xid-13", uptime=190.0), 1100.0)
    assert view.boots["n1"] == ("b1", 900.0)
    view.observe(node("n1", "xid-13", uptime=5.0, boot="b2"), 2000.0)
    assert view.boots["n1"] == ("b2", 1995.0)
    assert [s.booted_at for s in view.sightings()] == [1995.0]


def test_topology_labels_name_rack_and_zone():
    """The node's rack label (configurable) and zone label win over what the summary says."""
    view = SummaryView(Labels(rack="example.com/rack"))
    view.observe(node("n1", labels={"example.com/rack": "r7", "topology.kubernetes.io/zone": "z1"}), 1.0)
    assert (view.summaries["n1"].rack, view.summaries["n1"].zone) == ("r7", "z1")


def test_a_malformed_summary_leaves_the_node_out_with_one_line():
    """An annotation that is not a summary is recorded as one line and the node is not correlated."""
    view = SummaryView()
    view.observe(node("n1", "xid-13"), 1.0)
    view.observe(node("n1", text="{nope"), 2.0)
    assert "n1" not in view.summaries and view.sightings() == []
    assert "n1" in view.invalid and "\n" not in view.invalid["n1"]


def test_an_unchanged_summary_is_no_change_and_a_deleted_node_is_forgotten():
    """observe says False for a repeat (no pass needed); forget drops the node's sightings."""
    view = SummaryView()
    assert view.observe(node("n1", "xid-13"), 1.0)
    assert not view.observe(node("n1", "xid-13"), 2.0)
    assert view.forget("n1") and view.sightings() == [] and "n1" not in view.nodes


def test_a_relist_forgets_nodes_no_longer_listed():
    """resync with a fresh list drops nodes deleted while the watch was down."""
    view = SummaryView()
    view.resync([node("n1", "xid-13"), node("n2", "xid-13")], 1.0)
    view.resync([node("n2", "xid-13")], 2.0)
    assert set(view.summaries) == {"n2"} and view.nodes == {"n2"}
