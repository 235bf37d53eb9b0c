"""Graceful deletion and the Eviction API's PodDisruptionBudget rules, as the API server applies them."""

from __future__ import annotations

from typing import Any

from agent.simulation.fake_apiserver.errors import ApiError
from agent.simulation.fake_apiserver.selectors import selector_matches

#: A pod's terminationGracePeriodSeconds when its spec gives none (the API server's default).
DEFAULT_GRACE_SECONDS = 30


MULTIPLE_PDBS = "This pod has more than one PodDisruptionBudget, which the eviction subresource does not support."


def grace_period(pod: dict[str, Any], asked: int | None) -> int:
    """The grace period a delete gives a pod: none for an unbound or finished one (nothing runs it)."""
    if not pod.get("spec", {}).get("nodeName") or pod.get("status", {}).get("phase") in {"Succeeded", "Failed"}:
        return 0
    if asked is not None:
        return max(int(asked), 0)
    return int(pod.get("spec", {}).get("terminationGracePeriodSeconds", DEFAULT_GRACE_SECONDS))


def budget_ignored(pod: dict[str, Any]) -> bool:
    """Pods an eviction deletes without asking a budget: terminating, finished or not yet running."""
    phase = pod.get("status", {}).get("phase")
    return bool(pod["metadata"].get("deletionTimestamp")) or phase in {"Succeeded", "Failed", "Pending"}


def pod_ready(pod: dict[str, Any]) -> bool:
    status = pod.get("status", {})
    if status.get("phase") != "Running" or pod.get("metadata", {}).get("deletionTimestamp"):
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions", []))


def disruptions_allowed(pdb: dict[str, Any], expected: int, healthy: int) -> int:
    spec = pdb.get("spec", {})
    if "minAvailable" in spec:
        return healthy - _scaled(spec["minAvailable"], expected, round_up=True)
    if "maxUnavailable" in spec:
        return _scaled(spec["maxUnavailable"], expected, round_up=True) - (expected - healthy)
    return 1


def _scaled(value: Any, total: int, *, round_up: bool) -> int:
    if isinstance(value, str) and value.endswith("%"):
        share = int(value[:-1]) * total
        return -(-share // 100) if round_up else share // 100
    return int(value)


def check_budgets(pod: dict[str, Any], covering: list[dict[str, Any]], namespace_pods: list[dict[str, Any]]) -> None:
    """Refuse the eviction as the Eviction API does: a bare 500 for a pod under two or more budgets, 429 when
    its one budget allows no disruption of a ready pod."""
    if len(covering) > 1:
        raise ApiError(500, "", MULTIPLE_PDBS)
    for pdb in covering:
        selector = pdb.get("spec", {}).get("selector", {})
        matching = [p for p in namespace_pods if selector_matches(selector, p)]
        healthy = [p for p in matching if pod_ready(p)]
        allowed = disruptions_allowed(pdb, len(matching), len(healthy))
        if allowed <= 0 and pod_ready(pod):
            raise ApiError(429, "TooManyRequests",
                           "Cannot evict pod as it would violate the pod's disruption budget.",
                           {"causes": [{"reason": "DisruptionBudget", "message":
                                        f"The disruption budget {pdb['metadata']['name']} needs "
                                        f"{len(healthy) - allowed} healthy pods and has {len(healthy)} "
                                        f"currently"}]})


def disruption_target(pod: dict[str, Any], stamp: str) -> list[dict[str, Any]]:
    """The pod's conditions with DisruptionTarget set, as the Eviction API marks a pod before deleting it."""
    conditions = [c for c in pod.get("status", {}).get("conditions", []) if c.get("type") != "DisruptionTarget"]
    conditions.append({"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI",
                       "message": "Eviction API: evicting", "lastTransitionTime": stamp})
    return conditions
