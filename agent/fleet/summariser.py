"""The summary an agent publishes of its node, built from the record it mirrors and the pods on its GPUs."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from agent.fleet.summary import FaultSummary, NodeSummary
from agent.model import NODE_KEY, Action, FaultClass, PodRef, Severity


@dataclass(frozen=True, slots=True)
class NodeFacts:
    """What the record does not say: the driver version and the NVLink fabric domain, both from NVML, and the
    rack and zone, the Node's topology labels (the fleet controller reads its own from its metadata watch and
    trusts those; the agent's are what it judges a hold scoped to a rack or a zone by: agent.fleet.scope)."""

    driver_version: str = ""
    fabric_domain: str = ""
    rack: str = ""
    zone: str = ""


class Summariser:
    """Turns the mirrored record into the summary's JSON. The quarantine's start (node or device taint) is the
    record's (agent.remediation.state.NodeState.quarantined_since, durable across restarts), so a re-publish
    or a restarted agent keeps the brake's count stable; a record without one is stamped here once."""

    def __init__(self, node: str, *, wall: Callable[[], float], uptime: Callable[[], float],
                 pods: Callable[[], Iterable[PodRef]] = tuple, facts: Callable[[], NodeFacts] = NodeFacts) -> None:
        self.node = node
        self.wall = wall
        self.uptime = uptime
        self.pods = pods
        self.facts = facts
        self._quarantined_since = 0.0
        #: The summary last made (what a scoped hold is judged against: agent.fleet.scope); None before one.
        self.last: NodeSummary | None = None

    def __call__(self, document: Mapping[str, object]) -> NodeSummary:
        return self.summary(document)

    def summary(self, document: Mapping[str, object]) -> NodeSummary:
        pods = [p for p in self.pods() if p.gpu_uuids and not p.daemonset]
        faults = tuple(self._fault(entry, pods) for entry in _dicts(document.get("faults")))
        remediation = document.get("remediation")
        state = remediation if isinstance(remediation, Mapping) else {}
        taints = [t for t in _dicts(state.get("device_taints")) if t.get("effect") in {"NoSchedule", "NoExecute"}]
        recorded = state.get("quarantined_since")
        if not (state.get("tainted") or taints):
            self._quarantined_since = 0.0
        elif isinstance(recorded, int | float) and not isinstance(recorded, bool) and recorded > 0:
            self._quarantined_since = float(recorded)  # the record's: durable, never stamped anew
        else:  # a record without it (an earlier version's): stamped once by this process
            self._quarantined_since = self._quarantined_since or self.wall()
        cursors = document.get("cursors")
        models = sorted({str(g.get("model")) for g in _dicts(document.get("gpus")) if g.get("model")})
        facts = self.facts()
        self.last = NodeSummary(node=self.node, gpu_model=",".join(models), driver_version=facts.driver_version,
                                fabric_domain=facts.fabric_domain, rack=facts.rack, zone=facts.zone,
                                boot_id=str(cursors.get("boot_id", "")) if isinstance(cursors, Mapping) else "",
                                uptime_seconds=max(0.0, self.uptime()),
                                workloads=tuple(sorted({p.owner for p in pods if p.owner})), faults=faults,
                                quarantined_since=self._quarantined_since)
        return self.last

    @staticmethod
    def _fault(entry: Mapping[str, object], pods: list[PodRef]) -> FaultSummary:
        key = str(entry.get("gpu_key", ""))
        gpu = entry.get("gpu")
        uuid = (str(gpu.get("uuid") or "") if isinstance(gpu, Mapping) else "") or key  # the key: a UUID
        on_it = pods if key == NODE_KEY else [p for p in pods if uuid and uuid in p.gpu_uuids]
        return FaultSummary(rule_id=str(entry.get("rule_id", "")),
                            fault_class=_enum(FaultClass, entry.get("fault_class"), FaultClass.HARDWARE),
                            severity=_enum(Severity, entry.get("severity"), Severity.WARNING),
                            action=_enum(Action, entry.get("action"), Action.NOTIFY),
                            owners=tuple(sorted({p.owner for p in on_it if p.owner})))


E = TypeVar("E", FaultClass, Severity, Action)


def _enum(kind: type[E], value: object, default: E) -> E:
    try:
        return kind(str(value))
    except ValueError:
        return default


def _dicts(value: object) -> list[Mapping[str, object]]:
    return [v for v in value if isinstance(v, Mapping)] if isinstance(value, list) else []
