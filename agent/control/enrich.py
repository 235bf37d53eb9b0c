"""What an observation needs beyond what its source saw before the engine judges it: spread, repeats, containment."""

from __future__ import annotations

from collections import OrderedDict, deque

from agent.control.shared import Shared
from agent.diagnostics import shortfall
from agent.engine import CONTAINED_BY
from agent.model import Observation, Signal, frozen_attrs, new_observation
from agent.remediation.spread import APPLICATION_XIDS, LocationRepeats, WorkloadSpread

#: What is remembered of the observations judged without a contained incident, for one that follows within the
#: settle window: per GPU, and GPUs in all (an incident's own errors are a handful; more is a storm of repeats).
RECENT_PER_GPU = 16
RECENT_GPUS = 64


class Enricher:
    """Adds the facts the rules need that no single observation carries (kept in memory, per workload)."""

    def __init__(self, shared: Shared, *, diagnostic_available: bool) -> None:
        self.shared = shared
        self.spread = WorkloadSpread()
        self.locations = LocationRepeats()
        #: A diagnostic can decide the repeat patterns (one is configured; a scenario may stand in for it).
        self.diagnostic_available = diagnostic_available
        #: Per GPU, the observations a contained incident would govern that were judged without one, newest last,
        #: none older than the settle window before the newest.
        self._uncontained: OrderedDict[str, deque[Observation]] = OrderedDict()

    def enrich(self, observation: Observation) -> Observation:
        if observation.signal is Signal.DIAGNOSTIC:
            return _depth_judged(observation)
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
        """An error a contained incident governs (a rule reads `contained_by` for it: the DBE that NVML counts,
        Xid 48, Xid 64) on a GPU whose contained incident is active (a `contains` rule: Xid 94, the driver's
        drain-and-reset) is that incident's error: it names the incident, so its rule defers to it (nobody
        evicted, the reset once idle) instead of resetting the GPU under its co-tenants. One judged with no
        incident active is remembered for the settle window: an incident that follows governs it too."""
        if not self.shared.rules.containable(observation.signal, observation.value):
            return observation
        incident = self.incident_on(observation.gpu_key)
        if not incident:
            self._remember(observation)
            return observation
        return contained_by(observation, incident)

    def incident_on(self, gpu_key: str) -> str:
        """The contained incident active on this GPU: the first of its `contains` faults' rule ids ("" if none)."""
        rules = self.shared.rules
        return min((rule_id for key, rule_id in self.shared.record.faults
                    if key == gpu_key and (rule := rules.get(rule_id)) is not None and rule.contains), default="")

    def _remember(self, observation: Observation) -> None:
        settle = self.shared.options.incident_settle_seconds
        key = observation.gpu_key
        recent = self._uncontained.pop(key, None) or deque(maxlen=RECENT_PER_GPU)
        recent.append(observation)
        while recent and recent[0].at < observation.at - settle:
            recent.popleft()
        self._uncontained[key] = recent  # most recently noted last
        while len(self._uncontained) > RECENT_GPUS:
            self._uncontained.popitem(last=False)

    def governed(self, gpu_key: str, at: float, incident: str) -> list[Observation]:
        """The observations of this GPU judged without a contained incident within the settle window of `at`
        (when `incident` was seen), each naming it now; forgotten here, so each is judged again once."""
        settle = self.shared.options.incident_settle_seconds
        recent = self._uncontained.pop(gpu_key, None) or ()
        return [contained_by(o, incident) for o in recent if abs(o.at - at) <= settle]


def contained_by(observation: Observation, incident: str) -> Observation:
    """The observation naming the contained incident (a rule id) that governs it."""
    return new_observation(observation.signal, observation.value, observation.at, observation.source,
                           observation.gpu, frozen_attrs({**observation.attrs, CONTAINED_BY: incident}),
                           observation.count)


def _depth_judged(observation: Observation) -> Observation:
    """A passing diagnostic short of NVIDIA's RUN_DCGMEUD (below level 3, or no eud test passed: its `level` and
    `eud`, as the runner or a scenario gives them; unknown counts as short) says why in `shallow`: it only
    downgrades the repeat pattern it ran for (gpu-diagnostic-shallow-pass), never releases it."""
    if observation.value != 1:
        return observation
    why = shortfall(str(observation.attrs.get("level", "")), str(observation.attrs.get("eud", "")).lower())
    if not why:
        return observation
    return new_observation(observation.signal, observation.value, observation.at, observation.source,
                           observation.gpu, frozen_attrs({**observation.attrs, "shallow": why}), observation.count)
