"""The fleet view: what each node publishes of its faults, how faults on many nodes are correlated into
one suspected cause, the holds that keep a correlated fault class from being acted on node by node, and
the quarantine brake. Pure: the fleet controller and the nodes' guards do the I/O."""

from agent.fleet.brake import BrakePolicy, brake_allows, brake_bound
from agent.fleet.correlate import Correlation, CorrelationPolicy, Dimension, Sighting, correlate
from agent.fleet.hold import Hold, covering_hold, holdable, holds_from_json, holds_to_json, next_holds
from agent.fleet.summary import FaultSummary, NodeSummary

__all__ = [
    "BrakePolicy",
    "Correlation",
    "CorrelationPolicy",
    "Dimension",
    "FaultSummary",
    "Hold",
    "NodeSummary",
    "Sighting",
    "brake_allows",
    "brake_bound",
    "correlate",
    "covering_hold",
    "holdable",
    "holds_from_json",
    "holds_to_json",
    "next_holds",
]
