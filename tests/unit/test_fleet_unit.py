"""Units: a fabric fault confined to one fabric domain takes the domain out as one; one on many domains is held."""

from __future__ import annotations

from agent.fleet import (
    BrakePolicy,
    CorrelationPolicy,
    Hold,
    brake_allows,
    correlate,
    covering_hold,
    holds_from_json,
    holds_to_json,
    next_holds,
)
from agent.fleet.unit import by_unit, live_units, settling, unit_ids, unit_of_node
from agent.model import FaultClass
from tests.unit.test_fleet_correlate import fleet, with_fault

POLICY = CorrelationPolicy()
LINKS = "nvlink-link-down"


def units_after(nodes: list[str], *, rule_id: str = LINKS, fault_class: FaultClass = FaultClass.INTERCONNECT,
                booted_at: float | None = None) -> dict[str, Hold]:
    """The holds and units a pass publishes for the rule's fault on `nodes` of a fleet of 40 (domains of 10)."""
    summaries = fleet()
    sightings = with_fault(summaries, nodes, rule_id, fault_class)
    if booted_at is not None:
        sightings = [s.__class__(s.node, s.rule_id, s.fault_class, s.seen_at, booted_at) for s in sightings]
    correlations = correlate(summaries, sightings, now=30.0, policy=POLICY)
    units = unit_ids(correlations, sightings, now=30.0, policy=POLICY)
    return next_holds({}, correlations, now=30.0, hold_seconds=900, max_hold_seconds=6 * 3600, units=units)


def test_a_fabric_fault_confined_to_one_domain_is_a_unit_of_the_whole_domain():
    """NVLink down on 6 of fabric-1's 10 nodes and nowhere else: one unit naming all 10, covering no node."""
    [unit] = units_after([f"n{i}" for i in range(10, 16)]).values()
    assert unit.unit and unit.key == "fabric-1"
    assert unit.nodes == {f"n{i}" for i in range(10, 20)}
    assert covering_hold([unit], node="n11", rule_id=LINKS, fault_class=FaultClass.INTERCONNECT, now=31.0) is None


def test_a_fabric_fault_on_many_domains_at_once_is_held_not_taken_out():
    """NVLink down on every node of all four domains (a fleet-wide event): holds, no unit."""
    holds = units_after([f"n{i}" for i in range(40)])
    assert holds and not any(h.unit for h in holds.values())


def test_a_fabric_fault_that_also_shows_outside_its_domain_is_held():
    """fabric-1's 10 nodes and two nodes of fabric-2: the rule is not confined to one domain, so it is held."""
    holds = units_after([f"n{i}" for i in range(10, 20)] + ["n20", "n25"])
    assert holds and not any(h.unit for h in holds.values())


def test_a_fabric_fault_at_boot_is_held_as_a_boot_time_flap():
    """Every sighting within minutes of its node's boot: held, never taken out."""
    holds = units_after([f"n{i}" for i in range(10, 20)], booted_at=0.0)
    assert holds and not any(h.unit for h in holds.values())


def test_a_driver_fault_of_one_domain_is_held_not_a_unit():
    """Only the fabric's own fault class makes a unit."""
    holds = units_after([f"n{i}" for i in range(10, 20)], rule_id="xid-119", fault_class=FaultClass.DRIVER)
    assert not any(h.unit for h in holds.values())


def test_a_unit_that_shows_beyond_its_domain_becomes_a_hold_and_never_back():
    """Renewed without its id among the units, a unit is a hold from then; a hold stays one."""
    [unit] = units_after([f"n{i}" for i in range(10, 16)]).values()
    summaries = fleet()
    sightings = with_fault(summaries, [f"n{i}" for i in range(10, 16)], LINKS, FaultClass.INTERCONNECT)
    correlations = correlate(summaries, sightings, now=40.0, policy=POLICY)
    [hold] = next_holds({unit.id: unit}, correlations, now=40.0, hold_seconds=900, max_hold_seconds=3600).values()
    assert not hold.unit
    [again] = next_holds({hold.id: hold}, correlations, now=50.0, hold_seconds=900, max_hold_seconds=3600,
                         units={hold.id}).values()
    assert not again.unit


def test_a_unit_is_published_with_its_kind_and_an_entry_without_one_reads_as_a_hold():
    """The ConfigMap's entries say `kind`; one written before units existed is a hold."""
    [unit] = units_after([f"n{i}" for i in range(10, 16)]).values()
    [read] = holds_from_json(holds_to_json([unit]))
    assert read.unit and '"kind":"unit"' in holds_to_json([unit])
    old = holds_to_json([unit]).replace('"kind":"unit",', "")
    assert not holds_from_json(old)[0].unit


def test_the_live_units_name_each_node_with_its_unit():
    """A unit standing maps each of its nodes to its id; a spent one maps nothing."""
    [unit] = units_after([f"n{i}" for i in range(10, 16)]).values()
    units = live_units([unit], now=31.0)
    assert unit_of_node(units, "n19") == unit.id and unit_of_node(units, "n9") == ""
    assert live_units([unit.__class__(**{**{f: getattr(unit, f) for f in unit.__slots__}, "spent": True})],
                      now=31.0) == {}


def test_the_brake_counts_the_nodes_of_one_unit_as_one():
    """Bound 2: two nodes of one unit already quarantined leave room; a third unit node joins them."""
    policy = BrakePolicy(max_share=0.0, min_nodes=2, max_nodes=200, window_seconds=600.0)
    quarantined = {"n10": 1.0, "n11": 2.0}
    units = by_unit({"u": frozenset({"n10", "n11", "n12"})})
    assert brake_allows(node="n5", quarantined_at=quarantined, gpu_nodes=40, now=10.0, policy=policy, units=units)
    assert brake_allows(node="n12", quarantined_at={**quarantined, "n5": 3.0}, gpu_nodes=40, now=10.0,
                        policy=policy, units=units)
    assert not brake_allows(node="n5", quarantined_at=quarantined, gpu_nodes=40, now=10.0, policy=policy)


def test_a_domains_cause_is_not_named_until_its_fault_stayed_there_for_the_settle():
    """Seen in one domain for 5 s of a 20 s settle: settling (not named), until first sighting + 20 s."""
    summaries = fleet()
    sightings = with_fault(summaries, [f"n{i}" for i in range(10, 14)], LINKS, FaultClass.INTERCONNECT)
    correlations = correlate(summaries, sightings, now=5.0, policy=POLICY)
    assert settling(correlations, now=5.0, settle_seconds=20.0) == {f"{LINKS}/fabric-domain/fabric-1": 20.0}
    assert settling(correlations, now=20.0, settle_seconds=20.0) == {}


def test_a_fabric_wide_cause_is_named_at_once():
    """Links down on two domains: the fabric-wide cause is no domain's to wait for; it is never a unit."""
    summaries = fleet()
    sightings = with_fault(summaries, ["n10", "n11", "n20", "n21"], LINKS, FaultClass.INTERCONNECT)
    correlations = correlate(summaries, sightings, now=5.0, policy=POLICY)
    assert [c.key for c in correlations] == ["several-domains"]
    assert settling(correlations, now=5.0, settle_seconds=20.0) == {}
    assert unit_ids(correlations, sightings, now=5.0, policy=POLICY) == frozenset()


def passes(*steps: tuple[float, list[str]]) -> dict[str, Hold]:
    """The holds after a pass at each (time, faulty nodes) of a fleet of 40 (domains of 10), as the
    controller publishes them (a settling domain's cause withheld)."""
    holds: dict[str, Hold] = {}
    for now, nodes in steps:
        summaries = fleet()
        sightings = with_fault(summaries, nodes, LINKS, FaultClass.INTERCONNECT)
        correlations = correlate(summaries, sightings, now=now, policy=POLICY)
        units = unit_ids(correlations, sightings, now=now, policy=POLICY)
        young = settling(correlations, now=now, settle_seconds=20.0)
        holds = next_holds(holds, [c for c in correlations if c.id not in young], now=now, hold_seconds=900,
                           max_hold_seconds=6 * 3600, units=units)
    return holds


def test_a_unit_overtaken_by_a_fabric_wide_cause_becomes_a_hold():
    """fabric-1 taken out as a unit, then the fault shows on fabric-2 too: the unit is renewed as a hold,
    beside the fabric-wide hold (its nodes no longer act, nor count as a unit)."""
    holds = passes((30.0, ["n10", "n11", "n12", "n13"]), (60.0, ["n10", "n11", "n12", "n13", "n20", "n21"]))
    assert {h.id: h.unit for h in holds.values()} == {f"{LINKS}/fabric-domain/fabric-1": False,
                                                      f"{LINKS}/fabric-domain/several-domains": False}


def test_a_domain_left_alone_by_a_fabric_wide_hold_is_not_taken_out():
    """The fabric-wide hold stands on fabric-1 and fabric-2; fabric-2's faults clear: fabric-1's own cause is
    a hold, not a unit (the judgment never moves back toward acting)."""
    holds = passes((30.0, ["n10", "n11", "n12", "n13", "n20", "n21"]), (60.0, ["n10", "n11", "n12", "n13"]))
    assert holds[f"{LINKS}/fabric-domain/fabric-1"].unit is False
