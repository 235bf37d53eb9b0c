"""The quarantine brake: new quarantines beyond a share of the GPU nodes within a window wait."""

from __future__ import annotations

from agent.fleet import BrakePolicy, brake_allows, brake_bound

POLICY = BrakePolicy(max_share=0.15, min_nodes=2, max_nodes=200, window_seconds=600)


def test_the_bound_is_a_share_of_the_gpu_nodes_within_its_floor_and_ceiling():
    """15 % of 1,000 nodes is 150; of 4 nodes the floor of 2; of 10,000 the ceiling of 200."""
    assert (brake_bound(1000, POLICY), brake_bound(4, POLICY), brake_bound(10_000, POLICY)) == (150, 2, 200)


def test_a_new_quarantine_past_the_bound_waits():
    """With 150 of 1,000 nodes newly quarantined in the window, the 151st waits."""
    recent = {f"n{i}": 100.0 for i in range(150)}
    assert not brake_allows(node="n999", quarantined_at=recent, gpu_nodes=1000, now=200.0, policy=POLICY)


def test_a_node_already_counted_passes_again():
    """A node quarantined in the window is not held back by its own count (a restart replays nothing new)."""
    recent = {f"n{i}": 100.0 for i in range(150)}
    assert brake_allows(node="n7", quarantined_at=recent, gpu_nodes=1000, now=200.0, policy=POLICY)


def test_the_brake_closes_by_itself_as_the_window_moves_on():
    """Once the window has passed, the same count no longer holds anyone back."""
    recent = {f"n{i}": 100.0 for i in range(150)}
    assert brake_allows(node="n999", quarantined_at=recent, gpu_nodes=1000, now=700.0, policy=POLICY)
