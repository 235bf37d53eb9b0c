"""What an observation needs beyond what its source saw before the engine judges it: spread, repeats, containment."""

from __future__ import annotations

from agent.control.shared import Shared
from agent.model import Action, Observation, Signal, frozen_attrs, new_observation
from agent.remediation.spread import APPLICATION_XIDS, LocationRepeats, WorkloadSpread


class Enricher:
    """Adds the facts the rules need that no single observation carries (kept in memory, per workload)."""

    def __init__(self, shared: Shared, *, diagnostic_available: bool) -> None:
        self.shared = shared
        self.spread = WorkloadSpread()
        self.locations = LocationRepeats()
        #: A diagnostic can decide the repeat patterns (one is configured; a scenario may stand in for it).
        self.diagnostic_available = diagnostic_available

    def enrich(self, observation: Observation) -> Observation:
        return self._contained_if_so(self._repeat_facts(self._not_the_gpus_if_elsewhere(observation)))

    def _not_the_gpus_if_elsewhere(self, observation: Observation) -> Observation:
        """NVIDIA's Xid 31 workflow: a repeat on one GPU points at the GPU only while the same workload does not
        fault elsewhere. A workload whose application Xids hit another GPU within the hour is the application's:
        it counts toward no GPU's distinct-workload window, and what it counted already is taken back."""
        workload = observation.attrs.get("workload")
        if observation.signal is not Signal.XID or int(observation.value) not in APPLICATION_XIDS or \
                not isinstance(workload, str) or not workload:
            return observation
        elsewhere = self.spread.note(workload, observation.gpu_key, observation.at)
        if not elsewhere:
            return observation
        counting = self.shared.rules.counting_distinct("workload")
        for gpu_key in elsewhere:  # only these rules on these GPUs: not every rule's state on every observation
            for rule_id in counting:
                state = self.shared.engine.rules.get((gpu_key, rule_id))
                if state is not None and not state.active:
                    state.distinct.pop(workload, None)
        self.locations.forget(workload)
        attrs = {k: v for k, v in observation.attrs.items() if k != "workload"}
        attrs["workload_elsewhere"] = workload
        return new_observation(observation.signal, observation.value, observation.at, observation.source,
                               observation.gpu, frozen_attrs(attrs), observation.count)

    def _repeat_facts(self, observation: Observation) -> Observation:
        """What the repeat patterns of application Xids (NVIDIA's WORKFLOW_XID_13/31) need beyond the line: how
        many workloads (owners) hit this GPC/TPC within the window (`sm_location_workloads`, Xid 13), and
        `no_diagnostic` where no diagnostic is configured, so that a pattern only a diagnostic can decide is
        reported instead of quarantining for ever."""
        if observation.signal is not Signal.XID or int(observation.value) not in APPLICATION_XIDS:
            return observation
        attrs = dict(observation.attrs)
        workload, location = attrs.get("workload"), attrs.get("sm_location")
        if isinstance(workload, str) and workload and isinstance(location, str) and location:
            attrs["sm_location_workloads"] = self.locations.note(observation.gpu_key, location, workload,
                                                                 observation.at)
        if not self.diagnostic_available:
            attrs["no_diagnostic"] = True
        if len(attrs) == len(observation.attrs):
            return observation
        return new_observation(observation.signal, observation.value, observation.at, observation.source,
                               observation.gpu, frozen_attrs(attrs), observation.count)

    def _contained_if_so(self, observation: Observation) -> Observation:
        """A volatile DBE on a GPU whose contained incident is active (Xid 94, or the driver's drain-and-reset)
        is that incident's error, counted by NVML: it names the incident (`contained_by`), so the ECC rule defers
        to it (nobody evicted, the reset once idle) instead of resetting the GPU under its co-tenants."""
        if observation.signal is not Signal.ECC_DBE:
            return observation
        key = observation.gpu_key
        contained = sorted(rule_id for (gpu_key, rule_id), f in self.shared.record.faults.items()
                           if gpu_key == key and f.action is Action.QUARANTINE_RESET_WHEN_IDLE)
        if not contained:
            return observation
        attrs = {**observation.attrs, "contained_by": contained[0]}
        return new_observation(observation.signal, observation.value, observation.at, observation.source,
                               observation.gpu, frozen_attrs(attrs), observation.count)
