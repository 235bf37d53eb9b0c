"""The disruption budget's units, pure: the live slots of one published unit count as one disruption."""

from __future__ import annotations

from agent.fleetapi.budget_slots import Slot, ahead_of
from agent.fleetapi.budget_units import UnitView, distinct

UNIT = "nvlink-link-down/fabric-domain/fabric-1"
DOMAIN = frozenset(f"d{i}" for i in range(18))


def slot(node: str, created: float, unit: str = "") -> Slot:
    return Slot(f"gpu-health-slot-{node}", node, f"uid-{node}", "1", created, unit=unit)


def test_eighteen_slots_of_one_published_unit_count_as_one():
    """The 18 nodes of one unit, each with its slot: one disruption, and a later node ranks behind one."""
    live = [slot(n, 1.0 + i, UNIT) for i, n in enumerate(sorted(DOMAIN))]
    assert distinct(live, {UNIT: DOMAIN}) == 1
    assert ahead_of(slot("x", 100.0), live, units={UNIT: DOMAIN}) == 1


def test_a_later_slot_of_a_unit_joins_its_place():
    """Limit 2, a unit and another node ahead: the unit's 18th slot has only the other node ahead of it."""
    live = [slot("x", 0.5)] + [slot(n, 1.0 + i, UNIT) for i, n in enumerate(sorted(DOMAIN))]
    assert ahead_of(live[-1], live, units={UNIT: DOMAIN}) == 1


def test_slots_claiming_an_unpublished_unit_count_each_as_its_own_node():
    """The same 18 slots when the reader has no such unit published: 18 disruptions."""
    live = [slot(n, 1.0 + i, UNIT) for i, n in enumerate(sorted(DOMAIN))]
    assert distinct(live, {}) == 18
    assert ahead_of(slot("x", 100.0), live, units={}) == 18


def test_a_slot_of_a_node_the_unit_does_not_name_counts_as_its_own_node():
    """A node outside the domain claiming the unit's id gains nothing."""
    live = [slot("d0", 1.0, UNIT), slot("intruder", 2.0, UNIT)]
    assert distinct(live, {UNIT: DOMAIN}) == 2


def test_a_unit_seen_live_counts_as_one_for_the_rate_window_after_it_ended():
    """Read published once, then gone: the rate bound still counts its takes as one within the window."""
    now = [0.0]
    published: list[dict[str, frozenset[str]]] = [{UNIT: DOMAIN}]
    view = UnitView(lambda: published[0], window_seconds=3600.0, monotonic=lambda: now[0])
    view.refresh()
    published[0] = {}
    now[0] = 1800.0
    assert view.refresh() == {} and view.recent() == {UNIT: DOMAIN}
    now[0] = 3700.0
    view.refresh()
    assert view.recent() == {}


def test_a_slot_of_a_unit_node_that_does_not_name_the_unit_counts_as_its_own_node():
    """A node of the unit whose slot was taken for another rule as well (no unit annotation) is a disruption
    of its own: a GSP timeout on a node of the domain does not ride on the fabric's shared place."""
    live = [slot("d0", 1.0), slot("d1", 2.0, UNIT)]
    assert distinct(live, {UNIT: DOMAIN}) == 2
