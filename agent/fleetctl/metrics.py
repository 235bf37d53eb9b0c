"""The fleet controller's Prometheus metrics (docs/metrics.md, "Fleet controller")."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from agent.fleet import Correlation, Hold


class FleetMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.correlation = Gauge("gpu_health_fleet_correlation", "1 for each standing correlation: one rule's "
                                 "fault on many nodes explained by one suspected cause",
                                 ["rule", "dimension", "key"], registry=self.registry)
        self.correlation_nodes = Gauge("gpu_health_fleet_correlation_nodes", "Nodes showing the fault of each "
                                       "standing correlation", ["rule", "dimension", "key"], registry=self.registry)
        self.correlations = Counter("gpu_health_fleet_correlations", "New correlations found",
                                    ["rule", "dimension"], registry=self.registry)
        self.holds = Gauge("gpu_health_fleet_holds", "Published holds by state (live: covering nodes; spent: "
                           "reached their bound while the cause stands)", ["state", "origin"], registry=self.registry)
        self.held_nodes = Gauge("gpu_health_fleet_held_nodes", "Nodes covered by at least one live hold",
                                registry=self.registry)
        self.unit_nodes = Gauge("gpu_health_fleet_unit_nodes", "Nodes of live units (a fabric domain taken out "
                                "as one disruption)", registry=self.registry)
        self.nodes = Gauge("gpu_health_fleet_nodes", "Nodes the controller sees, by summary state",
                           ["summary"], registry=self.registry)
        self.leader = Gauge("gpu_health_fleet_leader", "1 while this controller holds the leader Lease",
                            registry=self.registry)
        self.passes = Counter("gpu_health_fleet_passes", "Correlation passes run", registry=self.registry)
        self.errors = Counter("gpu_health_fleet_errors", "Failed API calls of the controller, by what failed",
                              ["what"], registry=self.registry)
        self._shown: set[tuple[str, str, str]] = set()

    def show(self, correlations: list[Correlation], holds: list[Hold], *, now: float) -> None:
        shown = set()
        for c in correlations:
            labels = (c.rule_id, str(c.dimension), c.key)
            shown.add(labels)
            self.correlation.labels(*labels).set(1)
            self.correlation_nodes.labels(*labels).set(len(c.nodes))
        for labels in self._shown - shown:
            self.correlation.remove(*labels)
            self.correlation_nodes.remove(*labels)
        self._shown = shown
        for state in ("live", "spent"):
            for origin in ("correlated", "operator"):
                self.holds.labels(state, origin).set(sum(
                    1 for h in holds if (h.spent or now >= h.expires_at) == (state == "spent") and not h.unit
                    and h.by_operator == (origin == "operator")))
            self.holds.labels(state, "unit").set(sum(
                1 for h in holds if h.unit and (h.spent or now >= h.expires_at) == (state == "spent")))
        live = [h for h in holds if not h.spent and now < h.expires_at]
        self.held_nodes.set(len({n for h in live if not h.unit for n in h.nodes}))
        self.unit_nodes.set(len({n for h in live if h.unit for n in h.nodes}))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
