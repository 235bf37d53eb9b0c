"""Holds: while a correlated cause stands, its fault class on the affected nodes is not acted on node by node.

Pure. A hold covers one rule on a set of nodes; it never covers a hardware-class fault (a node's own
double-bit ECC, fell-off-the-bus or row-remap failure is acted on as ever) nor another rule. It lasts while
its correlation stands and ends by itself a bounded time after it no longer does.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Set
from dataclasses import dataclass, replace

from agent.errors import InputError
from agent.fleet.correlate import Correlation, Dimension
from agent.fleet.scope import own_key_matches
from agent.fleet.summary import NodeSummary
from agent.model import FaultClass

#: The classes a fleet cause can explain; a hardware fault is a node's own evidence and is never held.
HOLDABLE = frozenset({FaultClass.APPLICATION, FaultClass.DRIVER, FaultClass.INTERCONNECT, FaultClass.TELEMETRY})


def holdable(fault_class: FaultClass) -> bool:
    return fault_class in HOLDABLE


@dataclass(frozen=True, slots=True)
class Hold:
    """One rule held on `nodes` for `cause`, from `started_at` until `expires_at` (the reader's clock)."""

    id: str
    rule_id: str
    fault_class: FaultClass
    dimension: Dimension
    key: str
    cause: str
    nodes: frozenset[str]
    started_at: float
    expires_at: float
    by_operator: bool = False
    #: Renewed for its whole bound while the cause still stands: kept (covering nothing) so it does not restart.
    spent: bool = False
    #: A unit (agent.fleet.unit), not a hold: its nodes are taken out together, counted as one disruption.
    unit: bool = False
    #: Scoped by its group key (agent.fleet.scope): it also covers a node whose own key is `key` (for a
    #: fabric-wide cause: whose own fabric domain is one of `domains`), listed in `nodes` or not.
    scope: bool = False
    domains: frozenset[str] = frozenset()

    @property
    def kind(self) -> str:
        return "unit" if self.unit else "hold"

    def to_json(self) -> dict[str, object]:
        """The entry as published and reported; a scoped hold adds its scope (and a fabric-wide one the
        domains it touched)."""
        entry: dict[str, object] = {
            "id": self.id, "kind": self.kind, "rule": self.rule_id, "class": str(self.fault_class),
            "dimension": str(self.dimension), "key": self.key, "cause": self.cause, "nodes": sorted(self.nodes),
            "started": self.started_at, "expires": self.expires_at, "operator": self.by_operator,
            "spent": self.spent}
        if self.scope:
            entry |= {"scope": True} | ({"domains": sorted(self.domains)} if self.domains else {})
        return entry

    @classmethod
    def from_json(cls, value: Mapping[str, object], *, source: str = "") -> Hold:
        try:
            nodes = value["nodes"]
            if not isinstance(nodes, list) or not all(isinstance(n, str) for n in nodes):
                raise TypeError("nodes is not a list of names")
            domains = value.get("domains", [])
            if not isinstance(domains, list) or not all(isinstance(d, str) for d in domains):
                raise TypeError("domains is not a list of names")
            kind = value.get("kind", "hold")  # absent: written before units existed, a hold
            if kind not in ("hold", "unit"):
                raise ValueError(f"kind {kind!r} is neither hold nor unit")
            return cls(id=str(value["id"]), rule_id=str(value["rule"]), fault_class=FaultClass(str(value["class"])),
                       dimension=Dimension(str(value["dimension"])), key=str(value["key"]), cause=str(value["cause"]),
                       nodes=frozenset(nodes), started_at=_seconds(value["started"]),
                       expires_at=_seconds(value["expires"]), by_operator=value.get("operator") is True,
                       spent=value.get("spent") is True, unit=kind == "unit",
                       scope=value.get("scope") is True and kind == "hold", domains=frozenset(domains))
        except (KeyError, ValueError, TypeError) as exc:
            raise InputError(f"hold is malformed: {exc}", file=source) from None


def _seconds(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{value!r} is not a number")
    return float(value)


def holds_to_json(holds: Iterable[Hold], *, unread: Iterable[Mapping[str, object]] = ()) -> str:
    """The holds' published form, with `unread` (entries a reader of this version could not read: a newer
    format) carried over unchanged after them."""
    entries = [h.to_json() for h in sorted(holds, key=lambda h: h.id)] + [dict(e) for e in unread]
    return json.dumps(entries, separators=(",", ":"))


@dataclass(frozen=True, slots=True)
class Unread:
    """One entry of the holds this reader cannot read (a newer writer's kind, dimension or class, or damaged),
    with why, kept as written."""

    reason: str
    entry: Mapping[str, object]


def parse_holds(text: str, *, source: str = "") -> tuple[list[Hold], list[Unread]]:
    """The holds, parsed entry by entry: an entry this reader cannot read is set aside (with why), never a
    reason to drop the others. Text that is not a JSON list of objects is one InputError naming `source`."""
    try:
        document = json.loads(text)
    except ValueError as exc:
        raise InputError(f"holds are not JSON: {exc}", file=source) from None
    if not isinstance(document, list):
        raise InputError("holds are not a list", file=source)
    holds: list[Hold] = []
    unread: list[Unread] = []
    for entry in document:
        if not isinstance(entry, dict):
            unread.append(Unread("an entry is not an object", {"value": entry}))
            continue
        try:
            holds.append(Hold.from_json(entry, source=source))
        except InputError as exc:
            unread.append(Unread(f"entry {str(entry.get('id', '?'))[:120]!r}: {exc.message}", entry))
    return holds, unread


def holds_from_json(text: str, *, source: str = "") -> list[Hold]:
    """The holds this reader can read (parse_holds without what it set aside)."""
    return parse_holds(text, source=source)[0]


def next_holds(previous: Mapping[str, Hold], correlations: Iterable[Correlation], *, now: float,
               hold_seconds: float, max_hold_seconds: float, units: Set[str] = frozenset()) -> dict[str, Hold]:
    """The holds after a pass: each holdable correlation starts or renews its hold (its scope grows with the
    group, never shrinks while it stands), renewal stops at `max_hold_seconds` after the start, and a hold
    whose correlation ended lives out its last renewal. A hold that reached its bound while the cause still
    stands is kept as spent (covering nothing) until the cause ends, so it cannot start over. A correlation
    whose id is in `units` (agent.fleet.unit.unit_ids) starts a unit instead, unless a live hold of its rule
    covers one of its nodes; a unit stays one while its id is in `units` and becomes a hold once it is not
    (the fault showed beyond its domain), also when another cause of its rule overtook its own (the
    fabric-wide event it turned out to be); a hold never becomes a unit."""
    standing = {c.id: c for c in correlations if holdable(c.fault_class)}
    # Rules a standing cause now holds (a unit of the rule whose own cause ended was overtaken by it: the
    # fault showed beyond the domain and is fabric-wide), so the unit becomes a hold.
    holding = {c.rule_id for key, c in standing.items() if key not in units}
    holds: dict[str, Hold] = {}
    for key, hold in previous.items():
        if now < hold.expires_at:
            overtaken = hold.unit and key not in standing and hold.rule_id in holding
            holds[key] = replace(hold, unit=False) if overtaken else hold
        elif key in standing and (hold.spent or now >= hold.started_at + max_hold_seconds):
            holds[key] = replace(hold, spent=True)
    for key, correlation in standing.items():
        held = holds.get(key)
        if held is None:
            # A live hold of the rule on any of its nodes keeps a new unit a hold: never back toward acting.
            unit = key in units and not any(
                h.rule_id == correlation.rule_id and not (h.unit or h.spent) and h.nodes & correlation.group
                for h in holds.values())
            holds[key] = Hold(key, correlation.rule_id, correlation.fault_class, correlation.dimension,
                              correlation.key, correlation.cause, correlation.group, now, now + hold_seconds,
                              unit=unit, domains=correlation.touched)
        elif not (held.by_operator or held.spent):
            expires = min(held.started_at + max_hold_seconds, now + hold_seconds)
            holds[key] = replace(held, cause=correlation.cause, nodes=held.nodes | correlation.group,
                                 expires_at=max(held.expires_at, expires), unit=held.unit and key in units,
                                 domains=held.domains | correlation.touched)
    return holds


def covering_hold(holds: Iterable[Hold], *, node: str, rule_id: str, fault_class: FaultClass,
                  now: float, own: NodeSummary | None = None) -> Hold | None:
    """The live hold that covers this node's fault, if any: never a hardware fault, never another rule, never
    a unit (its nodes act). A hold names the node, or is scoped by a group key the node's own summary `own`
    has (agent.fleet.scope: the reader's own knowledge, never the writer's list)."""
    if not holdable(fault_class):
        return None
    for hold in holds:
        if hold.unit or hold.rule_id != rule_id or now >= hold.expires_at:
            continue
        if node in hold.nodes or (hold.scope and own is not None and
                                   own_key_matches(hold.dimension, hold.key, hold.domains, own)):
            return hold
    return None
