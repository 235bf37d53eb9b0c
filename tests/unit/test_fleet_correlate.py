"""Correlation: faults on many nodes at once are named as one suspected cause, by what those nodes share."""

from __future__ import annotations

import math

from agent.fleet import CorrelationPolicy, Dimension, FaultSummary, NodeSummary, Sighting, correlate
from agent.fleet.correlate import poisson_tail
from agent.model import Action, FaultClass, Severity

POLICY = CorrelationPolicy()


def fleet(size: int = 40, *, domain_size: int = 10) -> dict[str, NodeSummary]:
    """`size` healthy nodes: half on each of two driver versions, fabric domains (= racks) of `domain_size`."""
    return {f"n{i}": NodeSummary(node=f"n{i}", gpu_model="NVIDIA H100 80GB HBM3",
                                 driver_version="570.86.15" if i % 2 == 0 else "575.51.03",
                                 fabric_domain=f"fabric-{i // domain_size}", rack=f"rack-{i // domain_size}",
                                 zone="zone-a", workloads=(f"ml/job-{i}",))
            for i in range(size)}


def with_fault(summaries: dict[str, NodeSummary], nodes: list[str], rule_id: str, fault_class: FaultClass,
               *, owner: str | None = None) -> list[Sighting]:
    """Put the rule's fault on each node (on GPUs the owner's pods hold, if an owner is given)."""
    sightings = []
    for at, node in enumerate(nodes):
        summary = summaries[node]
        owners = (owner,) if owner else ()
        fault = FaultSummary(rule_id, fault_class, Severity.FATAL, Action.QUARANTINE, owners=owners)
        summaries[node] = NodeSummary(**{**{f: getattr(summary, f) for f in summary.__slots__},  # type: ignore[arg-type]
                                         "faults": (*summary.faults, fault),
                                         "workloads": (*summary.workloads, *owners)})
        sightings.append(Sighting(node, rule_id, fault_class, seen_at=float(at)))
    return sightings


def test_one_jobs_crash_loop_on_many_nodes_is_named_as_the_job():
    """Xid 13 on the 12 nodes one job spans, same driver as 20 others: the job is the cause, not the driver."""
    summaries = fleet()
    nodes = [f"n{i}" for i in range(0, 24, 2)]
    sightings = with_fault(summaries, nodes, "xid-13", FaultClass.APPLICATION, owner="ml/Job/train")
    [found] = correlate(summaries, sightings, now=30.0, policy=POLICY)
    assert (found.dimension, found.key) == (Dimension.WORKLOAD, "ml/Job/train")
    assert found.nodes == set(nodes)
    assert "the workload ml/Job/train" in found.cause


def test_a_fault_on_every_node_of_one_driver_version_is_named_as_the_driver():
    """GSP timeouts on all 20 nodes of driver 570 (different jobs each): the driver version is the cause."""
    summaries = fleet()
    nodes = [f"n{i}" for i in range(0, 40, 2)]
    sightings = with_fault(summaries, nodes, "xid-119", FaultClass.DRIVER)
    [found] = correlate(summaries, sightings, now=30.0, policy=POLICY)
    assert (found.dimension, found.key) == (Dimension.DRIVER_VERSION, "570.86.15")
    assert found.group == set(nodes)


def test_links_down_in_one_fabric_domain_are_named_as_the_fabric_domain():
    """NVLink down on the 10 nodes of one fabric domain (both driver versions): the domain is the cause."""
    summaries = fleet()
    nodes = [f"n{i}" for i in range(10, 20)]
    sightings = with_fault(summaries, nodes, "nvlink-down", FaultClass.INTERCONNECT)
    [found] = correlate(summaries, sightings, now=30.0, policy=POLICY)
    assert (found.dimension, found.key) == (Dimension.FABRIC_DOMAIN, "fabric-1")


def test_links_down_right_after_each_boot_are_named_as_a_boot_time_flap():
    """Links down within minutes of each node's boot, across domains: a boot-time flap, one cause."""
    summaries = fleet()
    nodes = ["n1", "n12", "n25", "n38"]
    sightings = [Sighting(s.node, s.rule_id, s.fault_class, seen_at=1000.0 + i * 3600, booted_at=900.0 + i * 3600)
                 for i, s in enumerate(with_fault(summaries, nodes, "nvlink-down", FaultClass.INTERCONNECT))]
    policy = CorrelationPolicy(window_seconds=4 * 3600)
    [found] = correlate(summaries, sightings, now=1000.0 + 3 * 3600, policy=policy)
    assert found.dimension is Dimension.BOOT_WINDOW
    assert found.nodes == set(nodes)


def test_a_boot_time_flap_holds_only_the_nodes_at_boot():
    """Links down within minutes of each node's boot on four of six nodes booting now: a boot-time flap, whose
    hold covers those six, not the 34 nodes long past their boot."""
    summaries = fleet()
    booting = ["n1", "n12", "n25", "n38", "n2", "n3"]
    now = 1000.0
    sightings = [Sighting(s.node, s.rule_id, s.fault_class, seen_at=now - i, booted_at=now - 120.0)
                 for i, s in enumerate(with_fault(summaries, booting[:4], "nvlink-down", FaultClass.INTERCONNECT))]
    booted = {name: (now - 120.0 if name in booting else now - 86_400.0) for name in summaries}
    [found] = correlate(summaries, sightings, now=now, policy=POLICY, booted=booted)
    assert found.dimension is Dimension.BOOT_WINDOW and found.group == set(booting)


def test_one_node_alone_is_never_a_fleet_cause():
    """A single node's fault is that node's, whatever its group."""
    summaries = fleet()
    sightings = with_fault(summaries, ["n3"], "xid-119", FaultClass.DRIVER)
    assert correlate(summaries, sightings, now=1.0, policy=POLICY) == []


def test_two_of_forty_nodes_on_different_groups_are_not_correlated():
    """Two nodes in different domains, on different drivers and jobs: below k and below the share of any group."""
    summaries = fleet()
    sightings = with_fault(summaries, ["n3", "n14"], "xid-119", FaultClass.DRIVER)
    assert correlate(summaries, sightings, now=1.0, policy=POLICY) == []


def test_sightings_older_than_the_window_do_not_count():
    """Faults spread over hours are not one event: only those within the window are counted together."""
    summaries = fleet()
    nodes = [f"n{i}" for i in range(0, 24, 2)]
    sightings = [Sighting(s.node, s.rule_id, s.fault_class, seen_at=i * 1000.0)
                 for i, s in enumerate(with_fault(summaries, nodes, "xid-13", FaultClass.APPLICATION,
                                                  owner="ml/Job/train"))]
    assert correlate(summaries, sightings, now=11 * 1000.0, policy=POLICY) == []


def test_two_jobs_crash_looping_at_once_are_two_causes():
    """Each job's nodes are named for their own job: the first cause does not swallow the second's nodes."""
    summaries = fleet()
    first = with_fault(summaries, ["n0", "n2", "n4", "n6"], "xid-13", FaultClass.APPLICATION, owner="ml/Job/a")
    second = with_fault(summaries, ["n21", "n23", "n25", "n27"], "xid-13", FaultClass.APPLICATION, owner="ml/Job/b")
    found = correlate(summaries, first + second, now=10.0, policy=POLICY)
    assert {(c.dimension, c.key) for c in found} == {(Dimension.WORKLOAD, "ml/Job/a"), (Dimension.WORKLOAD, "ml/Job/b")}


def test_a_correlations_group_holds_nodes_not_yet_showing_the_fault():
    """The job's other nodes are in the group (the hold's scope) before they fault too."""
    summaries = fleet()
    for node in ("n30", "n31"):
        s = summaries[node]
        summaries[node] = NodeSummary(node=node, driver_version=s.driver_version, workloads=("ml/Job/train",))
    sightings = with_fault(summaries, ["n0", "n2", "n4"], "xid-13", FaultClass.APPLICATION, owner="ml/Job/train")
    [found] = correlate(summaries, sightings, now=5.0, policy=POLICY)
    assert found.group == {"n0", "n2", "n4", "n30", "n31"}


def test_one_node_is_never_a_cause_whatever_the_policy_says():
    """Even a policy of one node in a group of one names no cause of fewer than two nodes."""
    summaries = fleet()
    sightings = with_fault(summaries, ["n3", "n14"], "xid-119", FaultClass.DRIVER)
    policy = CorrelationPolicy(min_nodes=1, min_group=1, min_share=0.0)
    assert all(len(c.nodes) >= 2 for c in correlate(summaries, sightings, now=1.0, policy=policy))


def test_a_job_whose_first_nodes_fill_a_fabric_domain_is_named_as_the_job():
    """One job spans 40 nodes; its first 10 faulty nodes are the whole of one fabric domain (and rack): the job,
    an application fault's first cause, is named, not the domain it happens to fill first."""
    summaries = fleet()
    for name, s in list(summaries.items()):
        summaries[name] = NodeSummary(node=name, driver_version=s.driver_version, fabric_domain=s.fabric_domain,
                                      rack=s.rack, workloads=("ml/Job/train",))
    sightings = with_fault(summaries, [f"n{i}" for i in range(10)], "xid-13", FaultClass.APPLICATION,
                           owner="ml/Job/train")
    found = correlate(summaries, sightings, now=10.0, policy=POLICY)
    assert [(c.dimension, c.key) for c in found] == [(Dimension.WORKLOAD, "ml/Job/train")]


def test_a_driver_fault_on_one_whole_rack_is_named_as_the_rack_not_its_driver_version():
    """GSP timeouts on all ten nodes of rack-0, which run the driver half the fleet runs: the rack (10 of 10) is
    the cause, and the hold's scope is its ten nodes, not the driver version's 25."""
    summaries = fleet()
    for i in range(10):
        s = summaries[f"n{i}"]
        summaries[f"n{i}"] = NodeSummary(node=s.node, driver_version="575.51.03", fabric_domain=s.fabric_domain,
                                         rack=s.rack)
    sightings = with_fault(summaries, [f"n{i}" for i in range(10)], "xid-119", FaultClass.DRIVER)
    [found] = correlate(summaries, sightings, now=10.0, policy=POLICY)
    assert found.dimension in {Dimension.RACK, Dimension.FABRIC_DOMAIN} and len(found.group) == 10


def test_a_driver_faults_first_nodes_in_one_rack_are_named_as_the_driver_not_the_part_rack():
    """GSP timeouts first reach four of rack-0's nodes, all on driver 570 (which 20 of 40 run): no place
    shows it whole, so the driver version, the class's first cause, names it, not the rack of which the
    four are a larger share (a hold per rack first, then the driver's, was four verdicts for one cause)."""
    summaries = fleet()
    sightings = with_fault(summaries, ["n0", "n2", "n4", "n6"], "xid-119", FaultClass.DRIVER)
    [found] = correlate(summaries, sightings, now=10.0, policy=POLICY)
    assert (found.dimension, found.key) == (Dimension.DRIVER_VERSION, "570.86.15")


def test_links_down_on_several_fabric_domains_at_once_are_one_fabric_wide_cause():
    """NVLink down on all of fabric-0 and half of fabric-1: one cause, the fabric across the two domains it
    touched (their 20 nodes the group), not one per domain, driver version or zone."""
    summaries = fleet()
    nodes = [f"n{i}" for i in range(15)]
    sightings = with_fault(summaries, nodes, "nvlink-link-down", FaultClass.INTERCONNECT)
    [found] = correlate(summaries, sightings, now=30.0, policy=POLICY)
    assert (found.dimension, found.key, found.touched) == \
        (Dimension.FABRIC_DOMAIN, "several-domains", {"fabric-0", "fabric-1"})
    assert found.nodes == set(nodes) and found.group == {f"n{i}" for i in range(20)}
    assert "a fabric-wide event across 2 NVLink fabric domains" in found.cause


def test_a_lone_link_fault_in_another_domain_later_is_left_to_its_own_cause():
    """fabric-1's outage on four nodes, and a minute later one node of fabric-2 alone: fabric-1 is the cause
    of its four, and the lone node is no part of any cause (it acts on its own evidence)."""
    summaries = fleet()
    sightings = with_fault(summaries, ["n10", "n11", "n12", "n13", "n25"], "nvlink-link-down",
                           FaultClass.INTERCONNECT)
    sightings[-1] = Sighting("n25", "nvlink-link-down", FaultClass.INTERCONNECT, seen_at=60.0)
    [found] = correlate(summaries, sightings, now=70.0, policy=POLICY)
    assert (found.dimension, found.key, found.nodes) == \
        (Dimension.FABRIC_DOMAIN, "fabric-1", {"n10", "n11", "n12", "n13"})


def test_links_down_on_one_node_of_each_of_three_domains_at_once_are_one_fabric_wide_cause():
    """Four nodes of four domains within seconds, none with a neighbour: one fabric-wide event (it stands with
    any one of them taken away), not the job or the driver version they also share."""
    summaries = fleet()
    sightings = with_fault(summaries, ["n0", "n12", "n24", "n36"], "nvlink-link-down", FaultClass.INTERCONNECT,
                           owner="ml/Job/train")
    [found] = correlate(summaries, sightings, now=30.0, policy=POLICY)
    assert (found.key, found.nodes, found.touched) == \
        ("several-domains", {"n0", "n12", "n24", "n36"}, {"fabric-0", "fabric-1", "fabric-2", "fabric-3"})


def test_no_single_nodes_word_makes_a_cause():
    """Two real GSP timeouts on one driver version and one agent that writes the same fault into its own
    summary: no cause stands with that one summary taken away, so there is no hold and the two act."""
    summaries = fleet()
    sightings = with_fault(summaries, ["n0", "n2", "n4"], "xid-119", FaultClass.DRIVER)
    assert correlate(summaries, sightings, now=10.0, policy=POLICY) == []


def test_three_lone_link_faults_in_three_domains_are_no_fabric_wide_cause():
    """One node of each of three domains at once: with any one taken away, two nodes of two domains remain,
    fewer than the three a cause needs: each node acts on its own evidence."""
    summaries = fleet()
    sightings = with_fault(summaries, ["n0", "n12", "n24"], "nvlink-link-down", FaultClass.INTERCONNECT)
    assert correlate(summaries, sightings, now=30.0, policy=POLICY) == []


def test_independent_faults_at_fleet_scale_are_no_cause():
    """10,000 nodes, half on each driver version: six GSP timeouts on one version within the window are what
    independent faults give 5,000 nodes by chance, so no cause (the old three-node threshold held 5,000)."""
    summaries = fleet(10_000, domain_size=18)
    nodes = [f"n{i}" for i in range(0, 10_000, 1_666)][:6]  # even: one version, each its own rack and domain
    sightings = with_fault(summaries, nodes, "xid-119", FaultClass.DRIVER)
    assert correlate(summaries, sightings, now=10.0, policy=POLICY) == []


def test_a_driver_fault_on_many_nodes_of_a_version_at_fleet_scale_is_its_cause():
    """The same fleet, thirty GSP timeouts on one version within the window: far beyond chance, the version."""
    summaries = fleet(10_000, domain_size=18)
    nodes = [f"n{i}" for i in range(0, 10_000, 332)][:30]
    sightings = with_fault(summaries, nodes, "xid-119", FaultClass.DRIVER)
    [found] = correlate(summaries, sightings, now=10.0, policy=POLICY)
    assert (found.dimension, found.key, len(found.nodes)) == (Dimension.DRIVER_VERSION, "570.86.15", 30)


def test_the_chance_of_so_many_faults_is_a_poisson_tail():
    """The base-rate test's tail: exact against the sum of the first terms, and no underflow at fleet scale."""
    assert poisson_tail(0, 3.0) == 1.0 and poisson_tail(4, 0.0) == 0.0
    assert abs(poisson_tail(2, 1.0) - (1 - 2 / math.e)) < 1e-12
    assert 0.0 < poisson_tail(2000, 1000.0) < 1e-100


def test_a_group_is_judged_against_the_rules_rate_outside_it():
    """A fifth of a 1,000-node fleet shows the rule; one rack (and fabric domain) of 10 shows it on 4 nodes,
    what that rate gives ten nodes by chance: neither is named, only the fleet-wide cause."""
    summaries = fleet(1_000)
    elsewhere = [f"n{i}" for i in range(10, 1_000, 5)]
    rack = ["n0", "n1", "n2", "n3"]
    sightings = with_fault(summaries, rack + elsewhere, "thermal-slowdown", FaultClass.TELEMETRY)
    found = correlate(summaries, sightings, now=10.0, policy=POLICY)
    assert [(c.dimension, len(c.group)) for c in found] == [(Dimension.GPU_MODEL, 1_000)]
