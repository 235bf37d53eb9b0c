"""Units: a fabric fault confined to one NVLink fabric domain takes that domain out as one disruption.

Pure. A correlation becomes a unit when its best explanation is one fabric domain, its fault class is the
fabric's (interconnect: NVLink down, fabric registration, NVSwitch SXids), and no node outside that domain
shows the rule within the window: a fault on every domain at once (a fleet-wide or boot-time event) is held
instead. Its nodes are not held: each quarantines and drains for the rule, and the disruption budget and the
quarantine brake count the whole unit as one node.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from agent.fleet.correlate import Correlation, CorrelationPolicy, Dimension, Sighting, at_boot
from agent.fleet.hold import Hold
from agent.model import FaultClass

#: The classes whose correlation by fabric domain is the fabric's own fault (rules/fabric.yaml, links.yaml,
#: node.yaml's sxid-*).
UNIT_CLASSES = frozenset({FaultClass.INTERCONNECT})
#: The slot Lease annotation naming the unit a node is disrupted with (agent.fleetapi.budget).
UNIT_ANNOTATION = "gpu-health-agent.io/fleet-unit"


def confined(correlation: Correlation, sightings: Iterable[Sighting], *, now: float,
             policy: CorrelationPolicy) -> bool:
    """Whether the correlation is a fabric fault of its one domain: explained by the domain, of a unit class,
    every recent sighting of the rule inside the domain, and not every one of them within its node's boot
    window (a boot-time flap is held, never taken out)."""
    if correlation.dimension is not Dimension.FABRIC_DOMAIN or correlation.fault_class not in UNIT_CLASSES or \
            correlation.fabric_wide:
        return False
    recent = [s for s in sightings if s.rule_id == correlation.rule_id and now - s.seen_at <= policy.window_seconds]
    if any(s.node not in correlation.group for s in recent):
        return False
    return not all(at_boot(s, policy) for s in recent)


def unit_ids(correlations: Iterable[Correlation], sightings: Iterable[Sighting], *, now: float,
             policy: CorrelationPolicy) -> frozenset[str]:
    """The ids of the correlations that are units (agent.fleet.hold.next_holds takes them)."""
    seen = list(sightings)
    return frozenset(c.id for c in correlations if confined(c, seen, now=now, policy=policy))


def settling(correlations: Iterable[Correlation], *, now: float, settle_seconds: float) -> dict[str, float]:
    """The correlations of one fabric domain too young to name, each with when it may be: a fabric fault seen
    in one domain for less than `settle_seconds` may yet show on others (every NVLink down on 100 nodes
    reaches the controller node by node). Named early, it took its domain out as a unit before the fault was
    seen to be fleet-wide, or held the domain as one cause and the fabric-wide event as another."""
    return {c.id: c.first_at + settle_seconds for c in correlations
            if c.dimension is Dimension.FABRIC_DOMAIN and c.fault_class in UNIT_CLASSES and not c.fabric_wide
            and now < c.first_at + settle_seconds}


def live_units(holds: Iterable[Hold], *, now: float) -> dict[str, frozenset[str]]:
    """The published units that stand (neither spent nor expired): each one's id and nodes."""
    return {h.id: h.nodes for h in holds if h.unit and not h.spent and now < h.expires_at}


def unit_of_node(units: Mapping[str, frozenset[str]], node: str) -> str:
    """The unit this node is taken out with ("" when none; the first by id when several)."""
    return by_unit(units).get(node, "")


def by_unit(units: Mapping[str, frozenset[str]]) -> dict[str, str]:
    """Each node of a unit, with its unit's id: what the brake and the budget count as one."""
    return {node: uid for uid, nodes in sorted(units.items(), reverse=True) for node in nodes}
