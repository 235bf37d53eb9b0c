"""A faithful fake Kubernetes API server (real HTTP) and a GPU node to put in it, for tests and `simulate`.

It serves what the agent and `kubectl` use: discovery; nodes (get, list with label selectors, the three
patch types, resourceVersion preconditions answered with 409, the status subresource, taint validation);
pods (list with field selectors, graceful deletion: a deleted or evicted pod keeps a deletionTimestamp
until its grace period has passed on the cluster's clock, or `finish_termination`); pods/eviction with
PodDisruptionBudget semantics (429 when no disruption is allowed, the bare 500 for a pod under two
budgets); events.k8s.io/v1 events (validated as on creation); coordination.k8s.io/v1 leases; apps/v1
daemonsets; ConfigMaps; watches with bookmarks and 410 (watch.py); resource.k8s.io/v1 DeviceClasses,
ResourceSlices, ResourceClaims and DeviceTaintRules (stored and listed, rules validated, deletion
preconditions honoured; no scheduler allocates claims); and injected faults (5xx, latency, downtime,
conflicts). Objects live in memory. What still differs from a real server is listed in docs/testing.md.

Its modules, one job each: `server` (HTTP routing, injected faults, lists and watches), `store` (FakeCluster:
the objects and their writes), `resources` (what is served where, discovery), `errors` (Status answers),
`selectors`, `evictions` (graceful deletion, PodDisruptionBudgets), `patch`, `validation`, `watch`, `gpu_node`.
"""

from agent.simulation.fake_apiserver.errors import ApiError
from agent.simulation.fake_apiserver.gpu_node import populate
from agent.simulation.fake_apiserver.server import FakeApiServer
from agent.simulation.fake_apiserver.store import FakeCluster

__all__ = ["ApiError", "FakeApiServer", "FakeCluster", "populate"]
