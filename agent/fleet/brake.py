"""The quarantine brake: new quarantines beyond a share of the GPU nodes within a window wait.

Pure. It never blocks clearing, untainting or a release (the caller asks it only for a new quarantine), a
node already counted in the window passes again (a restart replays nothing new), and it closes by itself as
the window moves on.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BrakePolicy:
    """At most `max_share` of the GPU nodes (never fewer than `min_nodes`, never more than `max_nodes`) newly
    quarantined within `window_seconds`."""

    max_share: float = 0.15
    min_nodes: int = 2
    max_nodes: int = 200
    window_seconds: float = 600.0


def brake_bound(gpu_nodes: int, policy: BrakePolicy) -> int:
    """How many nodes may be newly quarantined within one window."""
    by_share = math.floor(policy.max_share * max(gpu_nodes, 0))
    return max(policy.min_nodes, min(policy.max_nodes, by_share))


def brake_allows(*, node: str, quarantined_at: Mapping[str, float], gpu_nodes: int, now: float,
                 policy: BrakePolicy, units: Mapping[str, str] | None = None) -> bool:
    """Whether `node` may be newly quarantined now, given when each node was newly quarantined (the reader's
    clock): yes when it is already counted in the window, or the window has room. The nodes of one published
    unit (`units`: node to unit id, agent.fleet.unit.by_unit) count as one: the first takes a place, the
    others join it."""
    window = _window(quarantined_at, now=now, policy=policy, units=units or {})
    return (units or {}).get(node, node) in window or len(window) < brake_bound(gpu_nodes, policy)


def newly_quarantined(quarantined_at: Mapping[str, float], *, now: float, policy: BrakePolicy,
                      units: Mapping[str, str] | None = None) -> int:
    """How many nodes the brake counts as newly quarantined within its window (a unit as one)."""
    return len(_window(quarantined_at, now=now, policy=policy, units=units or {}))


def quarantined_within(quarantined_at: Mapping[str, float], *, now: float, policy: BrakePolicy) -> list[str]:
    """The nodes newly quarantined within the window (each by name)."""
    return [name for name, at in quarantined_at.items() if 0.0 <= now - at < policy.window_seconds]


def _window(quarantined_at: Mapping[str, float], *, now: float, policy: BrakePolicy,
            units: Mapping[str, str]) -> set[str]:
    """The nodes (a unit by its id) newly quarantined within the window."""
    return {units.get(name, name) for name in quarantined_within(quarantined_at, now=now, policy=policy)}
