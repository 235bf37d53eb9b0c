"""Where the fleet view lives on the API server and the holds' published form.

Each agent writes its NodeSummary's JSON to its own Node as the annotation SUMMARY_ANNOTATION. The fleet
controller (and an operator's `fleet hold|release`) writes the holds to one ConfigMap, HOLDS_CONFIGMAP in the
agent's namespace, under the data keys below. Times in it are the writer's wall clock, and what they say is
their differences: a reader places each hold on its own monotonic clock as `observed_at + (t - written)`,
where `observed_at` is when it first saw that resourceVersion. A reader that first sees an old version (a
restarted controller or agent) may also cut the placement short by how long ago its own wall clock says the
version was written: wall clocks can only shorten a hold (toward acting as without one), never lengthen
it. Pure: the I/O is agent.fleetapi.holds_store's.

The controller also publishes what it has heard: for each holdable rule, the nodes whose summary showing it
the pass that wrote this version correlated (HEARD_KEY), and until when, by its wall clock, it promises to
write again (ALIVE_KEY). A node past its settle that its controller has not heard of yet keeps waiting for
that word, bounded (agent.fleet.node_side); an operator's write carries both over unchanged.

For the quarantine brake, a quarantined agent labels its own Node QUARANTINE_LABEL (its wall clock's second
of the first quarantine), so counting the fleet's quarantines is a list of the few labelled nodes, not of
every GPU node's summary. The controller adds the census (CENSUS_KEY): how many nodes its agents' GPU node
selector matches, and the nodes whose summary says quarantined but that carry no label (agents of an older
version, during a rolling upgrade), so a node asking the brake reads no list of every GPU node.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Set
from dataclasses import dataclass, replace

from agent.errors import InputError
from agent.fleet.correlate import Correlation, Sighting
from agent.fleet.hold import Hold, Unread, holdable, holds_to_json, parse_holds
from agent.fleet.scope import SCOPABLE

SUMMARY_ANNOTATION = "gpu-health-agent.io/fleet-summary"
HOLDS_CONFIGMAP = "gpu-health-fleet-holds"
LEASE_NAME = "gpu-health-fleet-controller"
#: The ConfigMap's data keys: the holds (agent.fleet.holds_to_json), the writer's clock when it wrote them,
#: and who wrote them (the controller's identity, or `operator`).
HOLDS_KEY = "holds.json"
WRITTEN_KEY = "written"
WRITER_KEY = "writer"
#: What the controller has heard ({rule: [node, ...]}, holdable rules only) and its wall clock's promise of
#: the next write (a reader past it counts the controller gone and waits for no word).
HEARD_KEY = "heard.json"
ALIVE_KEY = "controller-alive-until"
#: When the controller first saw each fault it heard of ({rule: {node: t}}, t on the writer's wall clock,
#: placed by a reader like the holds' times): a new leader (a restart, a failover) takes them, so faults first
#: seen minutes apart are never correlated as if they came at once.
SEEN_KEY = "seen.json"
#: The census: {"selector": the GPU node selector, "gpu_nodes": how many nodes match it, "unlabelled":
#: {node: quarantined since, its wall clock} for quarantined summaries without QUARANTINE_LABEL}.
CENSUS_KEY = "census.json"
#: On a quarantined node (node or device taint): the second, on the node's wall clock, it was first seen so.
QUARANTINE_LABEL = "gpu-health-agent.io/quarantined-since"
#: How many node names the scoped holds list in all (published_form); the heard nodes and the first
#: sightings listed, each (the controller keeps the most recent; agent.fleetctl.controller).
LISTED_NODES = 500
HEARD_NODES = 1000
SEEN_NODES = 1000


def published_form(holds: Iterable[Hold]) -> list[Hold]:
    """The holds as published (agent.fleet.scope): a hold of a key readers judge themselves is scoped by it,
    and names its nodes too while at most LISTED_NODES names are listed so in all (in id order: for a reader
    of an earlier version, and a node whose own key reads otherwise than the controller's); every other
    hold, an operator's and a unit name theirs. The object's size then grows with its causes, not the fleet."""
    published: list[Hold] = []
    listed = 0
    for hold in sorted(holds, key=lambda h: h.id):
        if hold.unit or hold.by_operator or hold.dimension not in SCOPABLE:
            published.append(hold)
            continue
        keep = listed + len(hold.nodes) <= LISTED_NODES
        listed += len(hold.nodes) if keep else 0
        published.append(replace(hold, scope=True, nodes=hold.nodes if keep else frozenset()))
    return published


def encode(holds: Iterable[Hold], *, now: float, wall: float, writer: str,
           unread: Iterable[Unread] = ()) -> dict[str, str]:
    """The ConfigMap's data for holds kept on the writer's monotonic clock (`now`), stamped on its wall
    clock (`wall`): every time shifts by the same offset, so a reader recovers the differences. Entries the
    writer could not read (`unread`: a newer writer's) go with them unchanged. Holds go in their published
    form (published_form)."""
    offset = wall - now
    shifted = [replace(h, started_at=round(h.started_at + offset, 3), expires_at=round(h.expires_at + offset, 3))
               for h in published_form(holds)]
    return {HOLDS_KEY: holds_to_json(shifted, unread=[u.entry for u in unread]), WRITTEN_KEY: f"{wall:.3f}",
            WRITER_KEY: writer}


def decode(data: Mapping[str, str] | None, *, observed_at: float, wall: float | None = None,
           source: str = "") -> list[Hold]:
    """The holds of a ConfigMap's data this reader can read (decode_all without what it set aside)."""
    return decode_all(data, observed_at=observed_at, wall=wall, source=source)[0]


def decode_all(data: Mapping[str, str] | None, *, observed_at: float, wall: float | None = None,
               source: str = "") -> tuple[list[Hold], list[Unread]]:
    """The holds of a ConfigMap's data on the reader's monotonic clock, placed from `observed_at` (when
    the reader first saw this version of the object), less the time since `written` by the reader's wall
    clock `wall` when given and positive; and the entries it could not read, each with why (a newer
    writer's kind, dimension or class: skipped, never a reason to drop the rest). An empty or absent object
    holds nothing; one whose holds are not a list, or whose `written` is not a number (nothing in it can be
    placed), is an InputError naming `source`."""
    if not data or not data.get(HOLDS_KEY):
        return [], []
    try:
        written = float(data.get(WRITTEN_KEY, ""))
    except ValueError:
        raise InputError(f"{WRITTEN_KEY} {data.get(WRITTEN_KEY)!r} is not a number", file=source) from None
    offset = observed_at - written - (max(0.0, wall - written) if wall is not None else 0.0)
    holds, unread = parse_holds(data[HOLDS_KEY], source=source)
    return [replace(h, started_at=h.started_at + offset, expires_at=h.expires_at + offset) for h in holds], unread


def still_written(unread: Iterable[Unread], *, wall: float) -> list[Unread]:
    """The entries set aside that a writer carries over: those whose own `expires` (the writer's wall clock)
    is still ahead of `wall`. One with no readable expiry is dropped: nothing says how long it may stand."""
    kept = []
    for entry in unread:
        expires = entry.entry.get("expires")
        if isinstance(expires, int | float) and not isinstance(expires, bool) and expires > wall:
            kept.append(entry)
    return kept


def same_holds(left: Iterable[Hold], right: Iterable[Hold], *, slack: float = 1.0) -> bool:
    """Whether two sets of holds say the same thing in their published form, times within `slack` seconds (a
    placement's jitter): the controller writes only when something changed."""
    a, b = {h.id: h for h in published_form(left)}, {h.id: h for h in published_form(right)}
    if a.keys() != b.keys():
        return False
    for key, x in a.items():
        y = b[key]
        if replace(x, started_at=0.0, expires_at=0.0) != replace(y, started_at=0.0, expires_at=0.0):
            return False
        if abs(x.started_at - y.started_at) > slack or abs(x.expires_at - y.expires_at) > slack:
            return False
    return True


def word_of_pass(correlations: Iterable[Correlation], sightings: Iterable[Sighting], *, units: Set[str],
                 withheld: Set[tuple[str, str]], spent: Set[str], now: float, window_seconds: float
                 ) -> tuple[dict[str, set[str]], dict[tuple[str, str], float]]:
    """What a controller's pass publishes beside its holds: the nodes it heard of by rule (the word a settling
    node waits for: this pass correlated its fault; never one of `withheld`, (rule, node) of a cause still
    settling) and the first sightings ((node, rule) -> seen at, within the window) a new leader takes. Neither
    names a node a scoped hold covers by its own key (it waits for no word, and its cause is the hold: a
    standing cause of a SCOPABLE key, neither a unit nor `spent`), and each keeps the most recent
    HEARD_NODES / SEEN_NODES (a node heard of earlier is past its settle), so the object stays bounded."""
    standing = list(correlations)
    scoped = {(c.rule_id, node) for c in standing if c.id not in units and c.id not in spent
              and holdable(c.fault_class) and c.dimension in SCOPABLE for node in c.nodes}
    recent = sorted((x for x in sightings if holdable(x.fault_class) and (x.rule_id, x.node) not in scoped),
                    key=lambda x: (-x.seen_at, x.node, x.rule_id))
    heard: dict[str, set[str]] = {}
    for sighting in [x for x in recent if (x.rule_id, x.node) not in withheld][:HEARD_NODES]:
        heard.setdefault(sighting.rule_id, set()).add(sighting.node)
    first = {(x.node, x.rule_id): x.seen_at
             for x in [x for x in recent if now - x.seen_at <= window_seconds][:SEEN_NODES]}
    return heard, first


def encode_heard(heard: Mapping[str, Iterable[str]], *, alive_until: float) -> dict[str, str]:
    """The controller's word: the nodes it heard of per rule (sorted, so an unchanged view is the same text),
    and its wall clock's promise of the next write."""
    text = json.dumps({rule: sorted(set(nodes)) for rule, nodes in sorted(heard.items()) if nodes},
                      separators=(",", ":"))
    return {HEARD_KEY: text, ALIVE_KEY: f"{alive_until:.3f}"}


def decode_heard(data: Mapping[str, str] | None, *, source: str = "") -> tuple[dict[str, frozenset[str]], float]:
    """({rule: nodes heard}, alive_until by the writer's wall clock); ({}, 0.0) when the controller wrote none
    (an older controller, or none yet); a malformed word is an InputError naming `source`."""
    if not data or not data.get(HEARD_KEY):
        return {}, 0.0
    try:
        parsed = json.loads(data[HEARD_KEY])
        alive_until = float(data.get(ALIVE_KEY, ""))
    except ValueError as exc:
        raise InputError(f"{HEARD_KEY} or {ALIVE_KEY} is unreadable: {exc}", file=source) from None
    if not isinstance(parsed, dict) or not all(
            isinstance(nodes, list) and all(isinstance(n, str) for n in nodes) for nodes in parsed.values()):
        raise InputError(f"{HEARD_KEY} is not a map of rule to node names", file=source)
    return {str(rule): frozenset(nodes) for rule, nodes in parsed.items()}, alive_until


def encode_seen(first_seen: Mapping[tuple[str, str], float], *, now: float, wall: float) -> dict[str, str]:
    """The first sightings ((node, rule) -> the writer's monotonic time) on the writer's wall clock, by rule."""
    by_rule: dict[str, dict[str, float]] = {}
    for (node, rule), at in sorted(first_seen.items()):
        by_rule.setdefault(rule, {})[node] = round(at + wall - now, 1)
    return {SEEN_KEY: json.dumps(by_rule, separators=(",", ":"), sort_keys=True)}


def decode_seen(data: Mapping[str, str] | None, *, observed_at: float, wall: float | None = None
                ) -> dict[tuple[str, str], float]:
    """The first sightings a controller published, on the reader's clock as the holds are placed (decode_all);
    {} where there are none or they cannot be read (the reader then has only its own)."""
    if not data or not data.get(SEEN_KEY):
        return {}
    try:
        written = float(data.get(WRITTEN_KEY, ""))
        parsed = json.loads(data[SEEN_KEY])
    except ValueError:
        return {}
    offset = observed_at - written - (max(0.0, wall - written) if wall is not None else 0.0)
    seen: dict[tuple[str, str], float] = {}
    for rule, nodes in parsed.items() if isinstance(parsed, dict) else ():
        for node, at in nodes.items() if isinstance(nodes, dict) else ():
            if isinstance(at, int | float) and not isinstance(at, bool):
                seen[(str(node), str(rule))] = float(at) + offset
    return seen


def quarantine_label(since: float) -> str | None:
    """QUARANTINE_LABEL's value for a node quarantined since `since` (its wall clock); None: not quarantined."""
    return str(max(1, int(since))) if since > 0 else None


def quarantined_since(value: object) -> float:
    """The wall-clock second a QUARANTINE_LABEL value says; 0.0 for one that is not a positive number."""
    text = str(value or "")
    return float(text) if text.isdigit() and int(text) > 0 else 0.0


@dataclass(frozen=True, slots=True)
class Census:
    """What the controller counted for the brake (CENSUS_KEY)."""

    selector: str
    gpu_nodes: int
    unlabelled: Mapping[str, float]


def encode_census(selector: str, gpu_nodes: int, unlabelled: Mapping[str, float]) -> dict[str, str]:
    """The census's data key (sorted, so an unchanged count is the same text)."""
    document = {"selector": selector, "gpu_nodes": gpu_nodes,
                "unlabelled": {node: round(since, 3) for node, since in sorted(unlabelled.items())}}
    return {CENSUS_KEY: json.dumps(document, separators=(",", ":"))}


def decode_census(data: Mapping[str, str] | None, *, source: str = "") -> Census | None:
    """The census, or None where the controller wrote none (an older controller, an operator's first
    write); a malformed one is an InputError naming `source`."""
    if not data or not data.get(CENSUS_KEY):
        return None
    try:
        parsed = json.loads(data[CENSUS_KEY])
    except ValueError as exc:
        raise InputError(f"{CENSUS_KEY} is unreadable: {exc}", file=source) from None
    if not isinstance(parsed, dict):
        raise InputError(f"{CENSUS_KEY} is not an object", file=source)
    selector, count, unlabelled = parsed.get("selector"), parsed.get("gpu_nodes"), parsed.get("unlabelled")
    if not isinstance(selector, str) or not isinstance(count, int) or isinstance(count, bool) or count < 0 \
            or not isinstance(unlabelled, dict) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in unlabelled.values()):
        raise InputError(f"{CENSUS_KEY} needs a selector, a count of GPU nodes and a map of node to time",
                         file=source)
    return Census(selector, count, {str(node): float(since) for node, since in unlabelled.items()})
