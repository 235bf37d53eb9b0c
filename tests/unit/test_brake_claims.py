"""The quarantine brake's claims, ranked: by the resourceVersion each create got, a unit as one place, and only
claims younger than the window by the API server's own stamps."""

from __future__ import annotations

from agent.fleetapi.brake_claims import Claim, claim_name, places_ahead, within_window

WINDOW = 600.0


def claim(node: str, version: int | None, created: float | None = 1000.0) -> Claim:
    return Claim(claim_name(node), node, f"uid-{node}", version, created)


def test_the_claims_created_before_are_ahead_and_those_after_are_not():
    """Versions 5 and 7 are ahead of 9; 11 (created after) is not."""
    own = claim("n9", 9)
    assert places_ahead(own, [claim("n5", 5), claim("n7", 7), own, claim("n11", 11)], units={}) == 2


def test_a_version_that_cannot_be_compared_counts_as_ahead_on_both_sides():
    """An opaque version is ahead of a comparable claim, and every claim is ahead of an opaque one."""
    assert places_ahead(claim("n9", 9), [claim("x", None), claim("n11", 11)], units={}) == 1
    assert places_ahead(claim("x", None), [claim("n5", 5), claim("n11", 11)], units={}) == 2


def test_a_units_nodes_take_one_place_and_a_node_of_its_own_unit_is_not_ahead_of_it():
    """Three claims of one unit ahead count once; a node of that unit counts none of them."""
    units = {"d1": "u", "d2": "u", "d3": "u", "d4": "u"}
    ahead = [claim("d1", 1), claim("d2", 2), claim("d3", 3), claim("x", 4)]
    assert places_ahead(claim("y", 9), ahead, units=units) == 2
    assert places_ahead(claim("d4", 9), ahead, units=units) == 1


def test_a_claim_as_old_as_the_window_by_the_servers_stamps_no_longer_counts():
    """Against the newest stamp listed: 600.5 s older is still counted (whole-second stamps), 602 s is not,
    and an unreadable stamp is counted."""
    listed = [claim("new", 9, 2000.0), claim("edge", 5, 2000.0 - WINDOW - 0.5),
              claim("old", 3, 2000.0 - WINDOW - 2.0), claim("unread", 4, None)]
    assert [c.holder for c in within_window(listed, window_seconds=WINDOW)] == ["new", "edge", "unread"]


def test_a_claim_reads_its_version_and_stamp_from_the_lease():
    """A Lease as listed: the plain-integer resourceVersion, the server's creationTimestamp; a version with a
    leading zero or letters is not comparable."""
    lease = {"metadata": {"name": claim_name("n1"), "uid": "u1", "resourceVersion": "1234",
                          "creationTimestamp": "2026-12-06T04:00:00Z"}, "spec": {"holderIdentity": "n1"}}
    read = Claim.of(lease)
    assert (read.holder, read.version, read.created) == ("n1", 1234, 1796529600.0)
    assert Claim.of({"metadata": {"resourceVersion": "0123"}}).version is None
    assert Claim.of({"metadata": {"resourceVersion": "12a"}}).version is None


def test_a_quarantine_the_count_saw_without_a_claim_takes_a_place_too():
    """An older agent's quarantine (no claim) is ahead of every claim; a counted node with a claim is ranked by
    that claim; the node itself is never ahead of itself."""
    own = claim("n9", 9)
    listed = [claim("n5", 5), own, claim("n11", 11)]
    assert places_ahead(own, listed, units={}, unclaimed=["old", "n11", "n9"]) == 2
