"""The disruption budget's units against the fake API server: every node of a published unit takes its own
slot, and all of them count as one disruption; a unit the reader has not read published counts per node."""

from __future__ import annotations

from typing import Any

import pytest

from agent.fleet.unit import UNIT_ANNOTATION
from agent.fleetapi.budget import LeaseBudget
from agent.k8s.client import client_for
from agent.k8s.raw import RawApi
from tests.integration.test_budget import LEASE_RESOURCE, Clock, slots, three_gpu_nodes

pytestmark = pytest.mark.usefixtures("no_retry_sleep")
UNIT = "sxid-fatal/fabric-domain/fabric-1"
FABRIC = frozenset({"sxid-fatal"})
DOMAIN = frozenset(f"d{i}" for i in range(18))


@pytest.fixture
def cluster_and_server():
    cluster, server = three_gpu_nodes()
    yield cluster, server
    server.stop()


def budget(server: Any, node: str, units: dict[str, frozenset[str]], *, limit: int = 2) -> LeaseBudget:
    return LeaseBudget(RawApi(client_for(server.url)), node_name=node, namespace="gpu-health", max_nodes=limit,
                       max_percent=0, clock=Clock().wall, monotonic=Clock().monotonic, units=lambda: units)


def test_the_eighteen_nodes_of_a_published_unit_take_one_place_of_the_budget(cluster_and_server):
    """Limit 2: all 18 nodes of the unit are granted their slots, one other node the second place, and a
    third node waits."""
    cluster, server = cluster_and_server
    published = {UNIT: DOMAIN}
    assert all(budget(server, node, published).acquire(FABRIC).held for node in sorted(DOMAIN))
    assert budget(server, "x", published).acquire().held
    assert not budget(server, "y", published).acquire().held
    assert len(slots(cluster)) == 19
    annotated = {lease["metadata"]["name"] for lease in cluster.list_objects(LEASE_RESOURCE, "gpu-health")
                 if (lease["metadata"].get("annotations") or {}).get(UNIT_ANNOTATION) == UNIT}
    assert len(annotated) == 18


def test_the_nodes_of_a_unit_the_readers_have_not_read_published_go_two_at_a_time(cluster_and_server):
    """The same 18 nodes without the unit published: two slots granted, as node by node."""
    cluster, server = cluster_and_server
    granted = [budget(server, node, {}).acquire(FABRIC).held for node in sorted(DOMAIN)]
    assert len(slots(cluster)) == 2
    assert granted.count(True) == 2


def test_a_slot_claiming_a_unit_another_reader_has_not_published_counts_as_its_node(cluster_and_server):
    """Two nodes that say they are of the unit: a reader without it published counts them as two."""
    cluster, server = cluster_and_server
    published = {UNIT: DOMAIN}
    assert budget(server, "d0", published).acquire(FABRIC).held and \
        budget(server, "d1", published).acquire(FABRIC).held
    assert not budget(server, "x", {}).acquire().held
    assert len(slots(cluster)) == 2


def test_nodes_of_a_unit_disrupted_for_another_rule_too_take_places_of_their_own(cluster_and_server):
    """Limit 2: nodes of the domain that are drained for a GSP timeout as well as the fabric fault are each
    their own disruption, so only two of them are granted, not the whole domain on the unit's one place."""
    cluster, server = cluster_and_server
    published = {UNIT: DOMAIN}
    granted = [budget(server, node, published).acquire(FABRIC | {"xid-119"}).held for node in sorted(DOMAIN)[:5]]
    assert granted.count(True) == 2
    assert not any((lease["metadata"].get("annotations") or {}).get(UNIT_ANNOTATION)
                   for lease in cluster.list_objects(LEASE_RESOURCE, "gpu-health"))


def test_the_limit_is_a_share_of_the_gpu_nodes_the_census_counted(cluster_and_server):
    """10 % of the 20 GPU nodes a live controller counted is 2 at once, though the reader's own list would
    find 3 nodes (1 at once); a census of none counts for nothing, and the list decides."""
    _, server = cluster_and_server
    raw = RawApi(client_for(server.url))

    def limited(node: str, census: int | None) -> LeaseBudget:
        return LeaseBudget(raw, node_name=node, namespace="gpu-health", max_nodes=0, max_percent=10,
                           clock=Clock().wall, monotonic=Clock().monotonic, census=lambda selector: census)

    assert limited("n1", 20).acquire().limit == 2
    assert limited("n2", 0).acquire().limit == 1
