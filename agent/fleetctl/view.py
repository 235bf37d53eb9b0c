"""The controller's view of the fleet: each node's summary (topology, driver version and GPU product from its
labels where it has them), when this controller first saw each (node, rule) and where each node's boot lies,
all on the controller's own monotonic clock; and for the brake's census, which nodes are GPU nodes and which
quarantined ones carry no label."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from agent.errors import InputError
from agent.fleet import NodeSummary, Sighting
from agent.fleet.node_selector import labels_match_selector
from agent.fleet.published import QUARANTINE_LABEL, SUMMARY_ANNOTATION
from agent.fleet.summary import RACK_LABEL, ZONE_LABEL

GPU_NODE_SELECTOR = "nvidia.com/gpu.present=true"
#: GPU Feature Discovery's labels (the NVIDIA device plugin's GFD, or the GPU Operator's): the driver version
#: (whole, or as its three parts) and the GPU product. An agent's token may not write them (its admission
#: policy: only gpu-health-agent.io/ labels on its own Node), so the controller groups by them where a node
#: has them, not by what the agent's summary says.
GFD_DRIVER_LABEL = "nvidia.com/cuda.driver-version.full"
GFD_DRIVER_PARTS = ("nvidia.com/cuda.driver.major", "nvidia.com/cuda.driver.minor", "nvidia.com/cuda.driver.rev")
GFD_PRODUCT_LABEL = "nvidia.com/gpu.product"


def gfd_driver(labels: Mapping[str, object]) -> str:
    """The driver version GFD labelled the node with ("" where it did not)."""
    whole = str(labels.get(GFD_DRIVER_LABEL) or "")
    if whole:
        return whole
    parts = [str(labels.get(key) or "") for key in GFD_DRIVER_PARTS]
    return ".".join(parts) if all(parts) else ""


@dataclass(frozen=True, slots=True)
class Labels:
    """Which node labels name the topology the fleet groups by."""

    rack: str = RACK_LABEL
    zone: str = ZONE_LABEL
    #: The agents' GPU node selector (remediation.gpu_node_selector): the nodes the brake's share counts.
    gpu_nodes: str = GPU_NODE_SELECTOR


class SummaryView:
    """Nodes' summaries as the watch delivers them; `observe` says whether anything the correlation reads
    changed, so the controller runs a pass only then (and at its tick)."""

    def __init__(self, labels: Labels = Labels()) -> None:
        self.labels = labels
        self.summaries: dict[str, NodeSummary] = {}
        #: Nodes whose annotation could not be read, with the one-line reason (they are left out).
        self.invalid: dict[str, str] = {}
        self.nodes: set[str] = set()
        self.first_seen: dict[tuple[str, str], float] = {}
        self.boots: dict[str, tuple[str, float]] = {}
        #: The nodes the GPU node selector matches (the census's count).
        self.gpu_nodes: set[str] = set()
        #: Quarantined nodes (by their summary) without the quarantine label: an older agent's (the census).
        self.unlabelled: dict[str, float] = {}

    def resync(self, objects: Iterable[Mapping[str, Any]], now: float) -> bool:
        """A fresh list: nodes gone from it are forgotten, the others observed."""
        names = set()
        changed = False
        for obj in objects:
            names.add(_name(obj))
            changed |= self.observe(obj, now)
        for gone in self.nodes - names:
            changed |= self.forget(gone)
        return changed

    def observe(self, obj: Mapping[str, Any], now: float) -> bool:
        """One Node (or its PartialObjectMetadata) as added or modified."""
        name = _name(obj)
        if not name:
            return False
        self.nodes.add(name)
        metadata = obj.get("metadata") or {}
        labels = metadata.get("labels") or {}
        if labels_match_selector(labels, self.labels.gpu_nodes):
            self.gpu_nodes.add(name)
        else:
            self.gpu_nodes.discard(name)
        self.unlabelled.pop(name, None)
        text = (metadata.get("annotations") or {}).get(SUMMARY_ANNOTATION)
        if not text:
            self.invalid.pop(name, None)
            return self._drop_summary(name)
        try:
            summary = NodeSummary.from_json(str(text), source=f"node {name} annotation {SUMMARY_ANNOTATION}")
        except InputError as exc:
            self.invalid[name] = exc.line()
            return self._drop_summary(name)
        self.invalid.pop(name, None)
        if summary.quarantined_since > 0 and QUARANTINE_LABEL not in labels:
            self.unlabelled[name] = summary.quarantined_since
        # What agents cannot write wins over what their summaries say: topology, driver and product labels.
        summary = replace(summary, node=name, rack=str(labels.get(self.labels.rack) or summary.rack),
                          zone=str(labels.get(self.labels.zone) or summary.zone),
                          driver_version=gfd_driver(labels) or summary.driver_version,
                          gpu_model=str(labels.get(GFD_PRODUCT_LABEL) or summary.gpu_model))
        previous = self.summaries.get(name)
        if previous == summary:
            return False
        self.summaries[name] = summary
        boot = self.boots.get(name)
        if boot is None or boot[0] != summary.boot_id:
            self.boots[name] = (summary.boot_id, now - summary.uptime_seconds)
        rules = {f.rule_id for f in summary.faults}
        for rule in _rules(previous) - rules:  # the fault ended: a later one is a new sighting
            self.first_seen.pop((name, rule), None)
        for rule in rules:
            self.first_seen.setdefault((name, rule), now)
        return True

    def adopt_first_seen(self, seen: Mapping[tuple[str, str], float]) -> None:
        """First sightings another controller published (this clock): each standing fault keeps the earlier
        of its own and that one, so a new leader never takes an old fault for a new one."""
        for key, at in seen.items():
            own = self.first_seen.get(key)
            if own is not None and at < own:
                self.first_seen[key] = at

    def forget(self, name: str) -> bool:
        """The Node was deleted."""
        self.nodes.discard(name)
        self.gpu_nodes.discard(name)
        self.unlabelled.pop(name, None)
        self.invalid.pop(name, None)
        self.boots.pop(name, None)
        return self._drop_summary(name)

    def _drop_summary(self, name: str) -> bool:
        """Forget the node's summary and its first sightings (only its summary's rules have any: a lookup
        each, never a scan of the fleet's sightings per node)."""
        dropped = self.summaries.pop(name, None)
        for rule in _rules(dropped):
            self.first_seen.pop((name, rule), None)
        return dropped is not None

    def sightings(self) -> list[Sighting]:
        """Every active fault, with when it was first seen and when its node booted (this clock)."""
        found = []
        for name, summary in self.summaries.items():
            booted = self.boots.get(name, ("", None))[1]
            for fault in summary.faults:
                seen = self.first_seen.get((name, fault.rule_id))
                if seen is not None:
                    found.append(Sighting(name, fault.rule_id, fault.fault_class, seen, booted))
        return found


def _rules(summary: NodeSummary | None) -> set[str]:
    return {f.rule_id for f in summary.faults} if summary is not None else set()


def _name(obj: Mapping[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("name") or "")
