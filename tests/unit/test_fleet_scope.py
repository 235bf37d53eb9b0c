"""Holds scoped by their group key: the published object stays bounded at any fleet size, and each reader
judges from its own summary whether a scoped hold covers it."""

from __future__ import annotations

from dataclasses import replace

from agent.fleet import Dimension, Hold, NodeSummary
from agent.fleet.correlate import FABRIC_WIDE_KEY, Correlation, Sighting
from agent.fleet.hold import covering_hold, holds_from_json
from agent.fleet.published import (
    HEARD_NODES,
    HOLDS_KEY,
    LISTED_NODES,
    SEEN_NODES,
    encode,
    encode_heard,
    encode_seen,
    published_form,
    word_of_pass,
)
from agent.fleet.summary import FaultSummary
from agent.model import Action, FaultClass, Severity

NODES = 10_000
#: A cloud-length node name (EKS's), about 45 characters.
NAME = "ip-10-{}-{}-{}.us-west-2.compute.internal"


def names(count: int = NODES) -> list[str]:
    return [NAME.format(i // 65536, (i // 256) % 256, i % 256) for i in range(count)]


def hold(dimension: Dimension, key: str, nodes: list[str], rule: str = "xid-119", **fields: object) -> Hold:
    return Hold(f"{rule}/{dimension}/{key}", rule, FaultClass.DRIVER, dimension, key, "cause", frozenset(nodes),
                0.0, 900.0, **fields)  # type: ignore[arg-type]


def own(**fields: object) -> NodeSummary:
    return NodeSummary(node="somewhere-else", **fields)  # type: ignore[arg-type]


def round_trip(holds: list[Hold]) -> list[Hold]:
    return holds_from_json(encode(holds, now=0.0, wall=0.0, writer="fleet-a")[HOLDS_KEY])


def covers(holds: list[Hold], summary: NodeSummary, rule: str = "xid-119") -> bool:
    return covering_hold(holds, node=summary.node, rule_id=rule, fault_class=FaultClass.DRIVER, now=1.0,
                         own=summary) is not None


def test_a_driver_hold_over_the_fleet_is_published_by_its_key_and_covers_every_node_of_that_driver():
    """10,000 names are past LISTED_NODES: the hold names none, and covers a node whose own NVML reads its
    driver version, never one of another."""
    published = round_trip([hold(Dimension.DRIVER_VERSION, "570.86.15", names())])
    assert published[0].scope and published[0].nodes == frozenset()
    assert covers(published, own(driver_version="570.86.15"))
    assert not covers(published, own(driver_version="575.51.03"))
    assert not covers(published, own())


def test_a_small_scoped_hold_still_names_its_nodes():
    """Under LISTED_NODES in all, a scoped hold names its nodes too (a reader of an earlier version, or a node
    whose own key reads otherwise than the controller's, is still covered)."""
    published = round_trip([hold(Dimension.DRIVER_VERSION, "570.86.15", names(3))])
    assert published[0].scope and published[0].nodes == frozenset(names(3))
    assert covers(published, NodeSummary(node=names(3)[0], driver_version="575.51.03"))


def test_a_fabric_wide_hold_covers_the_nodes_of_the_domains_it_touched():
    """A fabric-wide cause is scoped by the fabric domains it touched: a node of another domain is not in it."""
    wide = hold(Dimension.FABRIC_DOMAIN, FABRIC_WIDE_KEY, names(), domains=frozenset({"d1", "d2"}))
    published = round_trip([wide])
    assert published[0].domains == {"d1", "d2"} and published[0].nodes == frozenset()
    assert covers(published, own(fabric_domain="d2"))
    assert not covers(published, own(fabric_domain="d3"))


def test_a_model_hold_keyed_by_gpu_feature_discoverys_product_label_covers_the_nodes_of_that_model():
    """GFD writes the model with dashes (and -SHARED under time-slicing); NVML reads it with spaces."""
    for key in ("NVIDIA-H100-80GB-HBM3", "NVIDIA-H100-80GB-HBM3-SHARED", "NVIDIA H100 80GB HBM3"):
        published = round_trip([hold(Dimension.GPU_MODEL, key, names())])
        assert covers(published, own(gpu_model="NVIDIA H100 80GB HBM3"))
        assert not covers(published, own(gpu_model="NVIDIA H200"))


def test_a_workload_hold_covers_a_node_running_that_workload():
    """The job's key among the node's own workloads (or its faults' owners): covered; another job's node: not."""
    published = round_trip([hold(Dimension.WORKLOAD, "Job/ml/llm", names())])
    assert covers(published, own(workloads=("Job/ml/llm",)))
    faulty = FaultSummary("xid-119", FaultClass.DRIVER, Severity.FATAL, Action.RESET_GPU, owners=("Job/ml/llm",))
    assert covers(published, own(faults=(faulty,)))
    assert not covers(published, own(workloads=("Job/ml/other",)))


def test_a_rack_or_zone_hold_over_the_fleet_covers_the_nodes_whose_own_node_labels_place_them_there():
    """Issue 38: a rack or zone hold is scoped by its key like the others; each reader judges it by the rack
    and zone its own Node's topology labels give (its summary's), so a rack of 10,000 names costs no names."""
    for dimension, field in ((Dimension.RACK, "rack"), (Dimension.ZONE, "zone")):
        published = round_trip([hold(dimension, "r1", names())])
        assert published[0].scope and published[0].nodes == frozenset()
        assert covers(published, own(**{field: "r1"}))
        assert not covers(published, own(**{field: "r2"})) and not covers(published, own())


def test_operator_holds_and_units_are_never_scoped():
    """What a reader does not judge of itself (an operator's list) and a unit keep their names."""
    held = [hold(Dimension.OPERATOR, "ticket", names(4), by_operator=True),
            hold(Dimension.FABRIC_DOMAIN, "d1", names(4), unit=True)]
    assert [(h.scope, len(h.nodes)) for h in published_form(held)] == [(False, 4)] * 2


def test_the_listed_names_stop_at_their_bound_in_id_order():
    """Scoped holds name their nodes while at most LISTED_NODES names are listed in all: later ones name none."""
    jobs = [hold(Dimension.WORKLOAD, f"Job/ml/{i:03}", names(NODES)[i * 25:(i + 1) * 25]) for i in range(400)]
    listed = [len(h.nodes) for h in published_form(jobs)]
    assert sum(listed) <= LISTED_NODES and listed[0] == 25 and listed[-1] == 0


def test_nodes_a_scoped_hold_covers_are_neither_heard_nor_seen_and_the_rest_is_bounded():
    """A driver storm on every node, and independent faults on 3,000 more: the word names none of the storm's
    nodes and the most recent HEARD_NODES / SEEN_NODES of the rest."""
    everyone = names(NODES + 3000)
    storm, alone = everyone[:NODES], everyone[NODES:]
    cause = Correlation("xid-119", FaultClass.DRIVER, Dimension.DRIVER_VERSION, "570", frozenset(storm),
                        frozenset(storm), 0.0, 10.0)
    sightings = [Sighting(n, "xid-119", FaultClass.DRIVER, 3500.0) for n in storm] + \
        [Sighting(n, "xid-119", FaultClass.DRIVER, 100.0 + i) for i, n in enumerate(alone)]
    heard, first = word_of_pass([cause], sightings, units=set(), withheld=set(), spent=set(), now=3600.0,
                                window_seconds=3600.0)
    assert heard["xid-119"] == set(alone[-HEARD_NODES:])
    assert set(first) == {(n, "xid-119") for n in alone[-SEEN_NODES:]}


def test_the_holds_object_at_ten_thousand_nodes_stays_under_256_kib():
    """The worst case of issue 38 at 10,000 cloud-length names: a three-rule fabric event over every node's
    556 fabric domains, a driver storm, 100 jobs' holds and a full word (HEARD_NODES heard, SEEN_NODES seen):
    under 256 KiB in all."""
    everyone = names()
    domains = frozenset(f"{i:032x}.{i % 18}" for i in range(556))
    holds = [hold(Dimension.FABRIC_DOMAIN, FABRIC_WIDE_KEY, everyone, rule=f"nvlink-{r}", domains=domains)
             for r in range(3)]
    holds += [hold(Dimension.DRIVER_VERSION, "570.86.15", everyone)]
    cause = "xid-119 on 25 of 25 nodes share one suspected cause: the workload PyTorchJob/ml/train-000"
    holds += [hold(Dimension.WORKLOAD, f"PyTorchJob/ml/train-{i:03}", everyone[i * 25:(i + 1) * 25])
              for i in range(100)]
    holds = [replace(h, cause=cause) for h in holds]
    heard = {"xid-31": set(everyone[:HEARD_NODES])}
    first = {(n, "xid-31"): 1.7e9 + i for i, n in enumerate(everyone[:SEEN_NODES])}
    data = encode(holds, now=0.0, wall=1.7e9, writer="fleet-a") | encode_heard(heard, alive_until=1.7e9) | \
        encode_seen(first, now=0.0, wall=1.7e9)
    size = sum(len(k) + len(v.encode()) for k, v in data.items())
    assert size < 256 * 1024, f"{size} bytes"
