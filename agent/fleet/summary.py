"""The compact summary an agent publishes of its node for the fleet view, and its bounded JSON form."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from agent.errors import InputError
from agent.model import Action, FaultClass, Severity

#: The format's version; a reader refuses another.
SUMMARY_VERSION = 1
#: Bounds that keep one summary small whatever the node's state (an annotation or a small object).
MAX_FAULTS = 32
MAX_OWNERS = 8
MAX_WORKLOADS = 32
MAX_TEXT = 253


#: The Node labels naming a node's zone and rack (Kubernetes' well-known topology labels): the controller groups
#: by them (agent.fleetctl.view, `fleet run --rack-label/--zone-label`) and an agent reads its own from its Node
#: (remediation.rack_label, zone_label), so a hold scoped to a rack or a zone covers the nodes that are in it.
ZONE_LABEL = "topology.kubernetes.io/zone"
RACK_LABEL = "topology.kubernetes.io/rack"

@dataclass(frozen=True, slots=True)
class FaultSummary:
    """One active fault of the node: its rule, who is at fault, how bad, and the workloads on its GPUs."""

    rule_id: str
    fault_class: FaultClass
    severity: Severity
    action: Action
    gpus: int = 1
    owners: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class NodeSummary:
    """What the fleet needs of one node. `uptime_seconds` is read on the node's monotonic clock, so the reader
    places the boot on its own clock (observed_at - uptime) without comparing wall clocks across machines."""

    node: str
    gpu_model: str = ""
    driver_version: str = ""
    fabric_domain: str = ""
    rack: str = ""
    zone: str = ""
    boot_id: str = ""
    uptime_seconds: float = 0.0
    workloads: tuple[str, ...] = ()
    faults: tuple[FaultSummary, ...] = ()
    #: When the agent quarantined the node (node or device taint), on the node's wall clock; 0: it is not.
    #: What the quarantine brake counts (agent.fleet.node_side).
    quarantined_since: float = 0.0

    def to_json(self) -> str:
        """The bounded, compact JSON form: the most severe faults first, at most MAX_FAULTS of them."""
        faults = sorted(self.faults, key=lambda f: (-f.severity.rank, -f.action.rank, f.rule_id))[:MAX_FAULTS]
        document: dict[str, object] = {
            "v": SUMMARY_VERSION,
            "node": self.node,
            "model": self.gpu_model,
            "driver": self.driver_version,
            "fabric": self.fabric_domain,
            "rack": self.rack,
            "zone": self.zone,
            "boot": self.boot_id,
            "uptime": round(self.uptime_seconds, 1),
            "workloads": sorted(self.workloads)[:MAX_WORKLOADS],
            "faults": [{"rule": f.rule_id, "class": str(f.fault_class), "severity": str(f.severity),
                        "action": str(f.action), "gpus": f.gpus, "owners": sorted(f.owners)[:MAX_OWNERS]}
                       for f in faults],
            "more": max(0, len(self.faults) - MAX_FAULTS),
            "quarantined": round(self.quarantined_since, 3),
        }
        return json.dumps(document, separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, text: str, *, source: str = "") -> NodeSummary:
        """Parse a published summary; anything malformed is one InputError naming the node's object."""
        try:
            document = json.loads(text)
        except ValueError as exc:
            raise InputError(f"summary is not JSON: {exc}", file=source) from None
        if not isinstance(document, dict):
            raise InputError("summary is not a JSON object", file=source)
        if document.get("v") != SUMMARY_VERSION:
            raise InputError(f"summary version {document.get('v')!r} is not {SUMMARY_VERSION}", file=source)
        try:
            faults = tuple(_fault(f) for f in _list(document, "faults"))
            return cls(node=_text(document, "node"), gpu_model=_text(document, "model"),
                       driver_version=_text(document, "driver"), fabric_domain=_text(document, "fabric"),
                       rack=_text(document, "rack"), zone=_text(document, "zone"), boot_id=_text(document, "boot"),
                       uptime_seconds=_number(document, "uptime"),
                       workloads=tuple(_texts(document, "workloads"))[:MAX_WORKLOADS], faults=faults,
                       quarantined_since=_number(document, "quarantined"))
        except (KeyError, ValueError, TypeError) as exc:
            raise InputError(f"summary field is malformed: {exc}", file=source) from None


def _fault(value: object) -> FaultSummary:
    if not isinstance(value, Mapping):
        raise TypeError("a fault is not an object")
    gpus = value.get("gpus", 1)
    if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 0:
        raise ValueError(f"gpus {gpus!r}")
    return FaultSummary(rule_id=_text(value, "rule"), fault_class=FaultClass(_text(value, "class")),
                        severity=Severity(_text(value, "severity")), action=Action(_text(value, "action")),
                        gpus=gpus, owners=tuple(_texts(value, "owners"))[:MAX_OWNERS])


def _text(document: Mapping[str, object], key: str) -> str:
    value = document.get(key, "")
    if not isinstance(value, str):
        raise TypeError(f"{key} is not a string")
    return value[:MAX_TEXT]


def _number(document: Mapping[str, object], key: str) -> float:
    value = document.get(key, 0.0)
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise ValueError(f"{key} {value!r}")
    return float(value)


def _list(document: Mapping[str, object], key: str) -> list[object]:
    value = document.get(key, [])
    if not isinstance(value, list):
        raise TypeError(f"{key} is not a list")
    return value


def _texts(document: Mapping[str, object], key: str) -> list[str]:
    values = _list(document, key)
    if not all(isinstance(v, str) for v in values):
        raise TypeError(f"{key} holds a non-string")
    return [str(v)[:MAX_TEXT] for v in values]
