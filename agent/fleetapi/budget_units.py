"""The disruption budget's units: the live slots of one published fleet unit count as one disruption.

A node taken out with a fleet unit (agent.fleet.unit: a fabric fault confined to one fabric domain) takes
its own slot as ever, annotated with the unit's id when it is disrupted for the unit's rule alone. A reader
counts a slot as its unit's when it names the unit and the unit, as this reader read it published in the
holds ConfigMap, names the slot's node; any other slot counts as its own node, whatever unit it claims: an
agent that lies, a unit that ended, or a node of the unit disrupted for another rule as well (a GSP timeout
beside the fabric fault) gains no shared place. The first slot of a unit takes a place; later slots of that
unit join it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

from agent.fleet.unit import unit_of_node

Units = Mapping[str, frozenset[str]]


class SlotLike(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def holder(self) -> str: ...

    @property
    def unit(self) -> str: ...


def counted_as(slot: SlotLike, units: Units) -> str:
    """What the budget counts this slot as: the published unit it names, where that unit names its node, else
    the slot itself (a slot taken for another rule on a unit's node is its own disruption)."""
    nodes = units.get(slot.unit) if slot.unit else None
    return "unit/" + slot.unit if nodes is not None and slot.holder in nodes else slot.name


def distinct(slots: Iterable[SlotLike], units: Units, *, besides: str = "") -> int:
    """How many disruptions these slots are (a unit's slots one), not counting `besides` (a counted_as key)."""
    return len({key for s in slots if (key := counted_as(s, units)) != besides})


def taken_for(units: Units, *, node: str, rules: frozenset[str]) -> str:
    """The published unit `node`'s slot is taken for: one naming the node, whose rule is every rule the node is
    disrupted for (`rules`); "" when none, or the node is disrupted for another rule."""
    unit = unit_of_node(units, node)
    rule = unit.split("/", 1)[0]
    return unit if unit and rules and rules <= {rule} else ""


def own_key(units: Units, *, node: str, slot: str, rules: frozenset[str]) -> str:
    """What the budget counts `node`'s slot (named `slot`) as, unlisted: its unit's, or the slot itself."""
    unit = taken_for(units, node=node, rules=rules)
    return "unit/" + unit if unit else slot


class UnitView:
    """The published units as this node last read them (`read`, the fleet view's reader: never raises, {}
    when it cannot read), and every unit seen within the rate bound's window (a unit that ended still
    counts once for the takes of its hour; a restarted reader forgets it and counts per node: stricter)."""

    def __init__(self, read: Callable[[], Units] | None, *, window_seconds: float,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.read = read
        self.window = window_seconds
        self.monotonic = monotonic
        self._seen: dict[str, tuple[frozenset[str], float]] = {}
        self.live: dict[str, frozenset[str]] = {}

    def refresh(self) -> Units:
        """Read the published units now (the reader caches): the live ones."""
        if self.read is None:
            return {}
        now = self.monotonic()
        self.live = dict(self.read())
        for uid, nodes in self.live.items():
            earlier = self._seen.get(uid)
            self._seen[uid] = ((earlier[0] if earlier else frozenset()) | nodes, now)
        self._seen = {uid: seen for uid, seen in self._seen.items() if now - seen[1] < self.window}
        return self.live

    def recent(self) -> Units:
        """Every unit seen live within the window, with every node it named then."""
        return {uid: nodes for uid, (nodes, _) in self._seen.items()}
