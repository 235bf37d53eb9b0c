"""Correlation: the same fault on many nodes at once, grouped by what the nodes share, is one suspected cause.

Pure. The caller (the fleet controller) passes the nodes' summaries and its sightings: when it first saw each
fault on each node, and where each node's current boot lies, both on its own monotonic clock, so no
comparison of wall clocks across machines decides anything.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Set
from dataclasses import dataclass, replace
from enum import StrEnum

from agent.fleet.summary import NodeSummary
from agent.model import FaultClass


class Dimension(StrEnum):
    """What the nodes showing one fault may share: the suspected cause's kind."""

    WORKLOAD = "workload"
    FABRIC_DOMAIN = "fabric-domain"
    BOOT_WINDOW = "boot-window"
    DRIVER_VERSION = "driver-version"
    GPU_MODEL = "gpu-model"
    RACK = "rack"
    ZONE = "zone"
    #: Not found by correlation: an operator's `gpu-health-agent fleet hold` names the nodes.
    OPERATOR = "operator"


#: For each fault class, the causes to prefer when two explain the nodes equally well (most likely first):
#: an application fault is first the job's, a link fault the fabric's, a driver fault the driver version's.
PREFERENCE: Mapping[FaultClass, tuple[Dimension, ...]] = {
    FaultClass.APPLICATION: (Dimension.WORKLOAD, Dimension.BOOT_WINDOW, Dimension.FABRIC_DOMAIN,
                             Dimension.DRIVER_VERSION, Dimension.GPU_MODEL, Dimension.RACK, Dimension.ZONE),
    FaultClass.INTERCONNECT: (Dimension.FABRIC_DOMAIN, Dimension.BOOT_WINDOW, Dimension.WORKLOAD, Dimension.RACK,
                              Dimension.ZONE, Dimension.DRIVER_VERSION, Dimension.GPU_MODEL),
    FaultClass.DRIVER: (Dimension.DRIVER_VERSION, Dimension.WORKLOAD, Dimension.BOOT_WINDOW,
                        Dimension.FABRIC_DOMAIN, Dimension.GPU_MODEL, Dimension.RACK, Dimension.ZONE),
}
#: The class whose cause is not a place (a job's bug): the first dimension of the class's
#: preference with a key that correlates names the cause (then the share, then the nodes). A place-bound
#: cause (a switch, a link, a rack) is ranked by the share of its group first: the most specific place that
#: shows it whole. (At 1,000 nodes, ranked by share, one job's crash loop on 100 nodes was first explained as
#: the 18-node fabric domains its first nodes filled whole, before the job's own 100 had all faulted: ten
#: holds and Events instead of one.)
BY_PREFERENCE = frozenset({FaultClass.APPLICATION})
#: The classes whose cause is a version or a place alike (a driver bug, or a rack's power): a place that shows
#: the fault whole names it first (one rack whole beats 10 of a driver version's 25 nodes, and holds 10, not
#: 25); where none does, the class's preference (the driver version first), then the share. (At 1,000 nodes,
#: ranked by share alone, GSP timeouts whose first three nodes shared a rack were named as that rack and two
#: more before the driver version: four verdicts for one cause.)
WHOLE_FIRST = frozenset({FaultClass.DRIVER})
#: The classes whose fault on several fabric domains at once is one fabric-wide event (a Fabric Manager or
#: driver rollout, a power event), named once over the domains it touched: the fabric-domain dimension with
#: the key FABRIC_WIDE_KEY (a dimension readers before it know, so a rolling upgrade reads it). Ranked by share,
#: the same event was named piecewise as it reached the controller: at 1,000 nodes, every NVLink down on 100
#: nodes gave 11 holds and Events (each fabric domain, both driver versions, two zones, the job).
FABRIC_WIDE = frozenset({FaultClass.INTERCONNECT})
#: The key of a fabric-wide cause: one per rule, whatever domains it touches (no domain is named so: a
#: domain's key is `<cluster UUID>/<clique id>`).
FABRIC_WIDE_KEY = "several-domains"
#: The sightings a domain needs to count as touched by a fabric-wide event whenever they came (a lone node's
#: fault is its own, unless it came with the event's first: FABRIC_WIDE_AT_ONCE_SECONDS).
FABRIC_WIDE_MIN_PER_DOMAIN = 2
#: Lone nodes first seen within this of the rule's first sighting are part of the event. (At 1,000 nodes,
#: every NVLink down on 100 nodes, the nodes of domains the controller had heard from only once were left
#: over and named as the job: a second hold and Event.)
FABRIC_WIDE_AT_ONCE_SECONDS = 20.0
_DEFAULT_PREFERENCE = (Dimension.DRIVER_VERSION, Dimension.BOOT_WINDOW, Dimension.WORKLOAD, Dimension.FABRIC_DOMAIN,
                       Dimension.GPU_MODEL, Dimension.RACK, Dimension.ZONE)
_AT_BOOT = "at-boot"


@dataclass(frozen=True, slots=True)
class Sighting:
    """One active fault on one node, with when the reader first saw it and (if known) when the node booted."""

    node: str
    rule_id: str
    fault_class: FaultClass
    seen_at: float
    booted_at: float | None = None


@dataclass(frozen=True, slots=True)
class CorrelationPolicy:
    """When faults on several nodes count as one cause: at least `min_nodes` nodes sharing a key, or at least
    `min_share` of a group of at least `min_group` nodes, within `window_seconds`; never fewer than two."""

    min_nodes: int = 3
    min_share: float = 0.5
    min_group: int = 4
    window_seconds: float = 600.0
    boot_window_seconds: float = 900.0
    #: The base-rate test: a group's faulty nodes must also be more than independent faults would give it by
    #: chance (at most `chance`), at the rule's rate outside the group within the window, never taken below
    #: `base_rate` per node and window (5e-4: one rule's independent faults on 0.07 of the nodes a day, well
    #: above what a healthy fleet shows). So the minimum grows with the group: 4 nodes up to a group of about
    #: 1,000, 8 of a driver version's 5,000 at 10,000 nodes; six independent GSP timeouts on one version there
    #: are no cause, where three nodes were.
    base_rate: float = 5e-4
    chance: float = 0.01


@dataclass(frozen=True, slots=True)
class Correlation:
    """One suspected cause: a rule's fault on `nodes`, all sharing `key` of `dimension` with the `group`."""

    rule_id: str
    fault_class: FaultClass
    dimension: Dimension
    key: str
    nodes: frozenset[str]
    group: frozenset[str]
    first_at: float
    last_at: float
    #: The fabric domains a fabric-wide cause (FABRIC_WIDE) touched; empty for any other.
    touched: frozenset[str] = frozenset()

    @property
    def id(self) -> str:
        """Stable while the cause stands: the hold it leads to keeps this name."""
        return f"{self.rule_id}/{self.dimension}/{self.key}"

    @property
    def share(self) -> float:
        return len(self.nodes) / len(self.group) if self.group else 0.0

    @property
    def fabric_wide(self) -> bool:
        """Whether this is a fabric fault on several fabric domains at once (FABRIC_WIDE)."""
        return self.dimension is Dimension.FABRIC_DOMAIN and self.key == FABRIC_WIDE_KEY

    @property
    def domains(self) -> int:
        """How many fabric domains a fabric-wide cause touched (0 for any other dimension)."""
        return len(self.touched)

    @property
    def cause(self) -> str:
        """The suspected cause in an operator's words."""
        shown = f"{self.rule_id} on {len(self.nodes)} of {len(self.group)} nodes"
        what = {
            Dimension.WORKLOAD: f"the workload {self.key}",
            Dimension.FABRIC_DOMAIN: (f"a fabric-wide event across {self.domains} NVLink fabric domains at once "
                                      "(Fabric Manager, a driver or firmware rollout, power), not each node's "
                                      "own links") if self.fabric_wide else f"the NVLink fabric domain {self.key}",
            Dimension.BOOT_WINDOW: "a boot-time flap (each node shows it within minutes of its boot)",
            Dimension.DRIVER_VERSION: f"the driver version {self.key}",
            Dimension.GPU_MODEL: f"the GPU model {self.key}",
            Dimension.RACK: f"the rack {self.key}",
            Dimension.ZONE: f"the zone {self.key}",
            Dimension.OPERATOR: f"an operator's hold ({self.key})",
        }[self.dimension]
        return f"{shown} share one suspected cause: {what}"


def correlate(summaries: Mapping[str, NodeSummary], sightings: Iterable[Sighting], *, now: float,
              policy: CorrelationPolicy, booted: Mapping[str, float] | None = None) -> list[Correlation]:
    """The causes that explain the recent sightings of each rule, best first: each pass takes the key that
    explains its nodes best (the largest share of its group, then the most nodes, then the fault class's
    preference; for an application fault the preference first: BY_PREFERENCE; for a driver fault a group
    shown whole first, then the preference: WHOLE_FIRST) and goes on with
    the nodes it did not explain; nodes no cause explains stay on their own. A fabric fault on several
    fabric domains at once is first named as one fabric-wide cause (FABRIC_WIDE). A boot-time flap is judged
    against the whole fleet, and its group (the hold's scope) is the nodes at boot now: those whose boot
    (`booted`, each node's on the reader's clock; without it, the faulty nodes) lies within the boot window."""
    recent: dict[tuple[str, FaultClass], dict[str, Sighting]] = {}
    for sighting in sightings:
        if now - sighting.seen_at <= policy.window_seconds and sighting.node in summaries:
            recent.setdefault((sighting.rule_id, sighting.fault_class), {})[sighting.node] = sighting
    found: list[Correlation] = []
    groups = _Groups(summaries)
    for (rule_id, fault_class), by_node in sorted(recent.items()):
        left = dict(by_node)
        faulty = frozenset(by_node)
        wide = _fabric_wide(rule_id, fault_class, left, summaries, policy, faulty, groups) \
            if fault_class in FABRIC_WIDE else None
        if wide is not None:
            found.append(wide)
            for node in wide.nodes:
                del left[node]
        while len(left) >= 2:
            best = _best(rule_id, fault_class, left, summaries, policy, faulty, groups)
            if best is not None and best.dimension is Dimension.BOOT_WINDOW:
                at_boot_now = {n for n, at in (booted or {}).items() if 0.0 <= now - at <= policy.boot_window_seconds}
                best = replace(best, group=frozenset(best.nodes | (at_boot_now & set(summaries))))
            if best is None:
                break
            found.append(best)
            for node in best.nodes:
                del left[node]
    return found


def _best(rule_id: str, fault_class: FaultClass, sightings: Mapping[str, Sighting],
          summaries: Mapping[str, NodeSummary], policy: CorrelationPolicy,
          faulty: frozenset[str], groups: _Groups) -> Correlation | None:
    preference = PREFERENCE.get(fault_class, _DEFAULT_PREFERENCE)
    best: tuple[tuple[float, ...], Correlation] | None = None
    for rank, dimension in enumerate(preference):
        members: dict[str, set[str]] = {}
        for node, sighting in sightings.items():
            for key in _keys(dimension, summaries[node], sighting, rule_id, policy):
                members.setdefault(key, set()).add(node)
        for key, nodes in members.items():
            group = groups.of(dimension, key) | nodes
            if not _enough(len(nodes), len(group), policy) or \
                    not beyond_chance(len(nodes), group, faulty=faulty, fleet=len(summaries), policy=policy):
                continue
            times = [sightings[n].seen_at for n in nodes]
            candidate = Correlation(rule_id, fault_class, dimension, key, frozenset(nodes), frozenset(group),
                                    min(times), max(times))
            score: tuple[float, ...]
            if fault_class in BY_PREFERENCE:
                score = (-rank, candidate.share, len(nodes))
            elif fault_class in WHOLE_FIRST:
                score = (float(candidate.share >= 1.0), -rank, candidate.share, len(nodes))
            else:
                score = (candidate.share, len(nodes), -rank)
            if best is None or score > best[0]:
                best = (score, candidate)
    return best[1] if best is not None else None


def _fabric_wide(rule_id: str, fault_class: FaultClass, sightings: Mapping[str, Sighting],
                 summaries: Mapping[str, NodeSummary], policy: CorrelationPolicy,
                 faulty: frozenset[str], groups: _Groups) -> Correlation | None:
    """A fabric fault on two or more fabric domains at once, at least `min_nodes` nodes in all (both also with any
    one node's summary taken away): one cause, the
    fabric, over the domains it touched (their every node is its group: the hold's scope). A node counts when
    its domain shows the fault on FABRIC_WIDE_MIN_PER_DOMAIN nodes or more, or when it was first seen within
    FABRIC_WIDE_AT_ONCE_SECONDS of the rule's first sighting; a lone node's fault in another domain later on
    is left to its own cause, and so is a fault every node showed within its boot window (the ranking names
    it, a boot-time flap or what the nodes share)."""
    by_domain: dict[str, list[str]] = {}
    for node in sightings:
        if summaries[node].fabric_domain:
            by_domain.setdefault(summaries[node].fabric_domain, []).append(node)
    if not by_domain:
        return None
    start = min(sightings[node].seen_at for members in by_domain.values() for node in members)
    touched = {domain: nodes if len(nodes) >= FABRIC_WIDE_MIN_PER_DOMAIN else
               [n for n in nodes if sightings[n].seen_at <= start + FABRIC_WIDE_AT_ONCE_SECONDS]
               for domain, nodes in by_domain.items()}
    touched = {domain: nodes for domain, nodes in touched.items() if nodes}
    nodes = [node for members in touched.values() for node in members]
    # It must stand without any one node's summary: the lone node of a domain taken away leaves one domain less.
    lone = any(len(members) == 1 for members in touched.values())
    if len(touched) - lone < 2 or len(nodes) - 1 < policy.min_nodes:
        return None
    if all(at_boot(sightings[node], policy) for node in nodes):
        return None
    group = {name for domain in touched for name in groups.of(Dimension.FABRIC_DOMAIN, domain)}
    if not beyond_chance(len(nodes), group, faulty=faulty, fleet=len(summaries), policy=policy):
        return None
    times = [sightings[node].seen_at for node in nodes]
    return Correlation(rule_id, fault_class, Dimension.FABRIC_DOMAIN, FABRIC_WIDE_KEY, frozenset(nodes),
                       frozenset(group), min(times), max(times), frozenset(touched))


def at_boot(sighting: Sighting, policy: CorrelationPolicy) -> bool:
    """Whether the node showed the fault within `boot_window_seconds` of its own boot."""
    booted = sighting.booted_at
    return booted is not None and 0.0 <= sighting.seen_at - booted <= policy.boot_window_seconds


def beyond_chance(nodes: int, group: Set[str], *, faulty: Set[str], fleet: int, policy: CorrelationPolicy) -> bool:
    """Whether `nodes` faulty nodes in `group` are more than independent faults would put there: the chance of
    at least that many, at the rule's rate outside the group (`faulty` nodes among the `fleet`'s others; never
    below the policy's base rate), is at most `policy.chance` (a Poisson tail)."""
    outside = fleet - len(group)
    faulty_outside = len(faulty) - len(faulty & group)  # an intersection walks the smaller set
    rate = max(policy.base_rate, faulty_outside / outside if outside > 0 else 0.0)
    return poisson_tail(nodes, rate * len(group)) <= policy.chance


def poisson_tail(k: int, mean: float) -> float:
    """P(X >= k) for X ~ Poisson(mean), summed in log space (no underflow at fleet-sized means)."""
    if k <= 0:
        return 1.0
    if mean <= 0.0:
        return 0.0
    if k <= mean:
        return 1.0  # at or below the mean: never beyond chance
    total, i = 0.0, k
    while True:
        term = math.exp(-mean + i * math.log(mean) - math.lgamma(i + 1))
        total += term
        if term < 1e-18 * total or i > k + 1000:
            return min(1.0, total)
        i += 1


def _enough(nodes: int, group: int, policy: CorrelationPolicy) -> bool:
    """Whether `nodes` faulty nodes of a `group` are one cause, also with any one node's summary taken away
    (the worst case is a faulty one, gone from both counts): no single agent's word makes a cause."""
    return _stands(nodes - 1, group - 1, policy)


def _stands(nodes: int, group: int, policy: CorrelationPolicy) -> bool:
    if nodes < 2:
        return False
    return nodes >= policy.min_nodes or (group >= policy.min_group and nodes / group >= policy.min_share)


def _keys(dimension: Dimension, summary: NodeSummary, sighting: Sighting, rule_id: str,
          policy: CorrelationPolicy) -> tuple[str, ...]:
    """The keys a node showing the fault has in this dimension (a fault may touch several workloads)."""
    if dimension is Dimension.WORKLOAD:
        return tuple({owner for fault in summary.faults if fault.rule_id == rule_id for owner in fault.owners})
    if dimension is Dimension.BOOT_WINDOW:
        return (_AT_BOOT,) if at_boot(sighting, policy) else ()
    value = _static_key(dimension, summary)
    return (value,) if value else ()


#: The summary's field of each dimension one value of which a node has.
_STATIC_FIELDS = {Dimension.FABRIC_DOMAIN: "fabric_domain", Dimension.DRIVER_VERSION: "driver_version",
                  Dimension.GPU_MODEL: "gpu_model", Dimension.RACK: "rack", Dimension.ZONE: "zone"}


def _static_key(dimension: Dimension, summary: NodeSummary) -> str:
    field = _STATIC_FIELDS.get(dimension)
    return str(getattr(summary, field)) if field else ""


def group_keys(dimension: Dimension, summary: NodeSummary) -> frozenset[str]:
    """The keys a node has in a static dimension or its workloads (those its pods run and its faults' owners):
    the group it belongs to, faulty or not (empty keys none). Both the controller's groups and a reader's
    own check of a scoped hold (agent.fleet.scope) take them from here."""
    if dimension is Dimension.WORKLOAD:
        keys = {*summary.workloads, *(owner for fault in summary.faults for owner in fault.owners)}
    else:
        keys = {_static_key(dimension, summary)}
    return frozenset(key for key in keys if key)


class _Groups:
    """Every node by its key, per dimension, indexed once per pass on first use: a group is a lookup, not a
    scan of the fleet for each candidate key (at 10,000 nodes that scan was 4 s of a 5-s pass)."""

    def __init__(self, summaries: Mapping[str, NodeSummary]) -> None:
        self.summaries = summaries
        self._index: dict[Dimension, dict[str, frozenset[str]]] = {}

    def of(self, dimension: Dimension, key: str) -> frozenset[str]:
        """Every node that shares the key, faulty or not: the share's denominator and the hold's scope."""
        if dimension is Dimension.BOOT_WINDOW:
            return frozenset(self.summaries)  # a boot-time flap is judged against the whole fleet
        index = self._index.get(dimension)
        if index is None:
            members: dict[str, set[str]] = {}
            for name, summary in self.summaries.items():
                for value in group_keys(dimension, summary):
                    members.setdefault(value, set()).add(name)
            index = self._index[dimension] = {value: frozenset(names) for value, names in members.items()}
        return index.get(key, frozenset())
