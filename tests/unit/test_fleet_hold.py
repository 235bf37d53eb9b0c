"""Holds: a correlated cause keeps its rule from being acted on node by node, never a node's own hardware fault."""

from __future__ import annotations

import json

import pytest

from agent.errors import InputError
from agent.fleet import Correlation, Dimension, covering_hold, holds_from_json, holds_to_json, next_holds
from agent.fleet.hold import parse_holds
from agent.model import FaultClass


def correlation(rule_id: str = "xid-13", fault_class: FaultClass = FaultClass.APPLICATION,
                group: frozenset[str] = frozenset({"n1", "n2", "n3", "n4"})) -> Correlation:
    return Correlation(rule_id, fault_class, Dimension.WORKLOAD, "ml/Job/train", frozenset({"n1", "n2", "n3"}),
                       group, 0.0, 2.0)


def test_a_correlation_starts_a_hold_over_its_whole_group():
    """Every node sharing the cause is held, also the one that has not faulted yet."""
    holds = next_holds({}, [correlation()], now=10.0, hold_seconds=600, max_hold_seconds=6 * 3600)
    assert covering_hold(holds.values(), node="n4", rule_id="xid-13", fault_class=FaultClass.APPLICATION, now=11.0)


def test_a_hold_never_covers_a_hardware_fault():
    """A node's own double-bit ECC is acted on as ever, inside a hold."""
    holds = next_holds({}, [correlation()], now=10.0, hold_seconds=600, max_hold_seconds=6 * 3600)
    assert covering_hold(holds.values(), node="n1", rule_id="xid-13", fault_class=FaultClass.HARDWARE,
                         now=11.0) is None


def test_a_hold_never_covers_another_rule():
    """Independent evidence (another rule) on a held node is not held."""
    holds = next_holds({}, [correlation()], now=10.0, hold_seconds=600, max_hold_seconds=6 * 3600)
    assert covering_hold(holds.values(), node="n1", rule_id="xid-79", fault_class=FaultClass.APPLICATION,
                         now=11.0) is None


def test_no_hold_is_started_for_a_hardware_correlation():
    """Many nodes with hardware faults at once are each acted on: hardware is never a fleet cause to hold."""
    holds = next_holds({}, [correlation("ecc-dbe", FaultClass.HARDWARE)], now=10.0, hold_seconds=600,
                       max_hold_seconds=6 * 3600)
    assert holds == {}


def test_a_hold_ends_by_itself_after_its_correlation_ends():
    """Renewed while the cause stands; gone one hold period after the last pass that saw it."""
    holds = next_holds({}, [correlation()], now=10.0, hold_seconds=600, max_hold_seconds=6 * 3600)
    holds = next_holds(holds, [correlation()], now=300.0, hold_seconds=600, max_hold_seconds=6 * 3600)
    holds = next_holds(holds, [], now=899.0, hold_seconds=600, max_hold_seconds=6 * 3600)
    assert list(holds) == ["xid-13/workload/ml/Job/train"]
    assert next_holds(holds, [], now=900.0, hold_seconds=600, max_hold_seconds=6 * 3600) == {}


def test_a_hold_is_renewed_no_longer_than_its_bound():
    """A cause that never ends still lets its hold lapse after the bound: nothing is held for ever."""
    holds = next_holds({}, [correlation()], now=0.0, hold_seconds=600, max_hold_seconds=3600)
    covered_until = 0
    for now in range(60, 8000, 60):
        holds = next_holds(holds, [correlation()], now=float(now), hold_seconds=600, max_hold_seconds=3600)
        if covering_hold(holds.values(), node="n1", rule_id="xid-13", fault_class=FaultClass.APPLICATION,
                         now=float(now)):
            covered_until = now
    assert covered_until == 3540


def test_a_spent_hold_starts_afresh_once_its_cause_has_ended():
    """After the cause ended, a new correlation of the same rule and key is a new event with a new hold."""
    holds = next_holds({}, [correlation()], now=0.0, hold_seconds=600, max_hold_seconds=600)
    holds = next_holds(holds, [correlation()], now=600.0, hold_seconds=600, max_hold_seconds=600)
    assert next(iter(holds.values())).spent
    holds = next_holds(holds, [], now=660.0, hold_seconds=600, max_hold_seconds=600)
    holds = next_holds(holds, [correlation()], now=720.0, hold_seconds=600, max_hold_seconds=600)
    assert covering_hold(holds.values(), node="n1", rule_id="xid-13", fault_class=FaultClass.APPLICATION, now=721.0)


def test_holds_survive_their_json_form():
    """What the fleet controller publishes is what the nodes read back (a restart loses no hold)."""
    holds = next_holds({}, [correlation()], now=10.0, hold_seconds=600, max_hold_seconds=6 * 3600)
    assert holds_from_json(holds_to_json(holds.values())) == list(holds.values())


def test_holds_that_are_not_a_list_are_one_input_error():
    """A holds object that is not a list of entries is one line naming it, never a traceback."""
    with pytest.raises(InputError, match="gpu-health/holds: holds are not a list"):
        parse_holds('{"id": "x"}', source="gpu-health/holds")


def test_an_entry_of_a_newer_format_is_set_aside_and_the_rest_read():
    """One entry with a dimension, kind or class this reader does not know (a newer writer's), or damaged,
    is set aside with why; every other entry is read as ever."""
    known = next_holds({}, [correlation()], now=10.0, hold_seconds=600, max_hold_seconds=6 * 3600)
    newer = [dict(h.to_json(), id=f"x/{field}", **{field: value}) for h in known.values()
             for field, value in (("dimension", "pcie-switch"), ("kind", "quarantine"), ("class", "thermal"))]
    text = json.dumps([*json.loads(holds_to_json(known.values())), *newer, {"id": "damaged"}, 7])
    holds, unread = parse_holds(text, source="gpu-health/holds")
    assert holds == list(known.values())
    assert [u.entry.get("id") for u in unread] == ["x/dimension", "x/kind", "x/class", "damaged", None]
    assert "pcie-switch" in unread[0].reason and "quarantine" in unread[1].reason


def test_an_entry_set_aside_is_written_back_unchanged():
    """A writer that could not read an entry carries it over as it was (a newer controller's hold is not an
    older one's to delete)."""
    entry = {"id": "x", "kind": "quarantine", "expires": 99.0}
    holds, unread = parse_holds(holds_to_json([], unread=[entry]))
    assert holds == [] and [u.entry for u in unread] == [entry]
