"""The fleet controller's settings: what it correlates and how long a hold lasts (docs/fleet.md)."""

from __future__ import annotations

from dataclasses import dataclass, field

from agent.fleet import CorrelationPolicy
from agent.fleetctl.view import Labels


@dataclass(frozen=True, slots=True)
class FleetSettings:
    """What the controller correlates and how long a hold lasts (docs/fleet.md argues the defaults)."""

    namespace: str = "gpu-health"
    labels: Labels = field(default_factory=Labels)
    policy: CorrelationPolicy = field(default_factory=CorrelationPolicy)
    hold_seconds: float = 900.0
    max_hold_seconds: float = 6 * 3600.0
    tick_seconds: float = 10.0
    settle_seconds: float = 0.5
    #: How long a fabric fault must stay confined to one domain before it is named a unit (agent.fleet.unit).
    unit_settle_seconds: float = 20.0
