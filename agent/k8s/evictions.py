"""Evictions through the Eviction API (policy/v1): PodDisruptionBudgets decide, nothing is ever forced."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from agent.k8s.bodies import Eviction
from agent.k8s.errors import Conflict, EvictionRefused, NotFound, TooManyRequests
from agent.k8s.raw import RawApi, api_path
from agent.k8s.retry import with_retries


class EvictionOutcome(StrEnum):
    EVICTED = "evicted"
    GONE = "gone"
    WAITING = "waiting"
    STUCK = "stuck"


@dataclass(frozen=True, slots=True)
class EvictionResult:
    outcome: EvictionOutcome
    message: str


class Evictor:
    """One eviction attempt per call; a 429 is retried by the caller until the pod's deadline, then STUCK.
    A refusal that retrying cannot lift (a pod under more than one PodDisruptionBudget) is STUCK at once."""

    def __init__(self, raw: RawApi, *, deadline_seconds: float = 600.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.raw = raw
        self.deadline = deadline_seconds
        self.clock = clock
        self._first_refused: dict[str, float] = {}
        self.stuck: set[str] = set()

    def evict(self, namespace: str, name: str, uid: str = "") -> EvictionResult:
        """Evict the pod `namespace/name`; with `uid`, only that incarnation of it (a uid precondition): a pod
        recreated under the same name (a StatefulSet's, maybe on another node) is not the one on the GPU."""
        key = f"{namespace}/{name}"
        body: Eviction = {"apiVersion": "policy/v1", "kind": "Eviction",
                          "metadata": {"name": name, "namespace": namespace}}
        if uid:
            body["deleteOptions"] = {"preconditions": {"uid": uid}}
        try:
            path = api_path("", "v1", "pods", namespace=namespace, name=name, subresource="eviction")
            with_retries(lambda: self.raw.create(path, body))
        except NotFound:
            self._first_refused.pop(key, None)
            return EvictionResult(EvictionOutcome.GONE, "the pod is already gone")
        except Conflict:
            self._first_refused.pop(key, None)
            return EvictionResult(EvictionOutcome.GONE, f"the pod is already gone: {key} is now another pod "
                                                        f"(not uid {uid}), left running")
        except EvictionRefused as exc:
            self._first_refused.pop(key, None)
            self.stuck.add(key)
            return EvictionResult(EvictionOutcome.STUCK, f"the API refuses this eviction for good ({exc}); "
                                                         "not forced: a human decides")
        except TooManyRequests as exc:
            first = self._first_refused.setdefault(key, self.clock())
            waited = self.clock() - first
            if waited >= self.deadline:
                self.stuck.add(key)
                return EvictionResult(EvictionOutcome.STUCK, f"refused for {waited:.0f}s by its disruption budget "
                                                             f"({exc}); not forced: a human decides")
            return EvictionResult(EvictionOutcome.WAITING, f"disruption budget allows no eviction yet ({exc}); "
                                                           f"retrying until {self.deadline:.0f}s have passed")
        self._first_refused.pop(key, None)
        return EvictionResult(EvictionOutcome.EVICTED, "evicted through the Eviction API")
