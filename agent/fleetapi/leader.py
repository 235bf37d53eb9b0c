"""Leader election on a coordination.k8s.io/v1 Lease, as client-go's leaderelection does: a candidate takes
the Lease only when its holder has not renewed it for a whole leaseDurationSeconds, judged by when this
candidate saw the record change on its own monotonic clock (never by comparing the renewTime written by
another machine's clock with this one's); the leader renews it every retry period and steps down when it
could not renew within the renew deadline; every write carries the resourceVersion it read."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agent.k8s.bodies import Lease
from agent.k8s.errors import Conflict, K8sError, NotFound
from agent.k8s.events import micro_time
from agent.k8s.raw import JsonDocument, RawApi, api_path


@dataclass(frozen=True, slots=True)
class LeaseConfig:
    """client-go's defaults: a 15 s lease, renewed every 2 s, given up when not renewed within 10 s."""

    namespace: str
    name: str
    identity: str
    lease_seconds: int = 15
    renew_deadline_seconds: float = 10.0
    retry_seconds: float = 2.0

    def __post_init__(self) -> None:
        if not self.identity:
            raise ValueError("leader election needs a holder identity")
        if not 0 < self.retry_seconds < self.renew_deadline_seconds < self.lease_seconds:
            raise ValueError("leader election needs retry < renew deadline < lease duration")


class LeaderElector:
    """One candidate for one Lease; `try_acquire_or_renew` is one round, `run` keeps at it."""

    def __init__(self, raw: RawApi, config: LeaseConfig, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.raw = raw
        self.config = config
        self.clock = clock
        self.path = api_path("coordination.k8s.io", "v1", "leases", namespace=config.namespace, name=config.name)
        self._observed: tuple[Any, ...] | None = None
        self._observed_at = 0.0
        self._renewed_at: float | None = None
        self.holder = ""
        self.transitions = 0

    @property
    def leading(self) -> bool:
        """Whether this candidate holds the Lease now: it renewed it within the renew deadline."""
        return self._renewed_at is not None and self.clock() - self._renewed_at < self.config.renew_deadline_seconds

    def try_acquire_or_renew(self) -> bool:
        """One round: take a free or lapsed Lease, or renew ours; False while another holds it (or a write
        raced another candidate's)."""
        now = self.clock()
        try:
            lease = self.raw.get(self.path)
        except NotFound:
            return self._create(now)
        spec = lease.get("spec") or {}
        record = (spec.get("holderIdentity"), spec.get("leaseDurationSeconds"), spec.get("acquireTime"),
                  spec.get("renewTime"), spec.get("leaseTransitions"))
        if record != self._observed:
            self._observed, self._observed_at = record, now
        self.holder = str(spec.get("holderIdentity") or "")
        self.transitions = int(spec.get("leaseTransitions") or 0)
        duration = float(spec.get("leaseDurationSeconds") or self.config.lease_seconds)
        ours = self.holder == self.config.identity
        if self.holder and not ours and now < self._observed_at + duration:
            self._renewed_at = None
            return False
        stamp = micro_time()
        body = {**lease, "spec": {
            **spec, "holderIdentity": self.config.identity, "leaseDurationSeconds": self.config.lease_seconds,
            "renewTime": stamp, "acquireTime": spec.get("acquireTime") if ours else stamp,
            "leaseTransitions": self.transitions if ours else self.transitions + 1}}
        try:
            written = self.raw.request("PUT", self.path, body=body)
        except Conflict:
            return self.leading
        return self._won(written, now)

    def _create(self, now: float) -> bool:
        stamp = micro_time()
        body: Lease = {
            "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": self.config.name, "namespace": self.config.namespace},
            "spec": {"holderIdentity": self.config.identity, "leaseDurationSeconds": self.config.lease_seconds,
                     "acquireTime": stamp, "renewTime": stamp, "leaseTransitions": 0}}
        try:
            written = self.raw.create(api_path("coordination.k8s.io", "v1", "leases",
                                               namespace=self.config.namespace), body)
        except Conflict:
            return False  # another candidate created it first
        return self._won(written, now)

    def _won(self, written: JsonDocument, now: float) -> bool:
        spec = written.get("spec") or {}
        self._observed = (spec.get("holderIdentity"), spec.get("leaseDurationSeconds"), spec.get("acquireTime"),
                          spec.get("renewTime"), spec.get("leaseTransitions"))
        self._observed_at = self._renewed_at = now
        self.holder = self.config.identity
        self.transitions = int(spec.get("leaseTransitions") or 0)
        return True

    def release(self) -> bool:
        """Step down: the Lease is left with no holder and a one-second duration, so a standby takes it at
        its next round instead of waiting out the lease (client-go's ReleaseOnCancel)."""
        if self._renewed_at is None:
            return False
        self._renewed_at = None
        try:
            lease = self.raw.get(self.path)
            spec = lease.get("spec") or {}
            if spec.get("holderIdentity") != self.config.identity:
                return False
            body = {**lease, "spec": {**spec, "holderIdentity": "", "leaseDurationSeconds": 1,
                                      "renewTime": micro_time()}}
            self.raw.request("PUT", self.path, body=body)
        except K8sError:
            return False
        return True

    def run(self, stop: threading.Event, *, on_change: Callable[[bool], None] = lambda leading: None,
            on_error: Callable[[K8sError], None] = lambda exc: None) -> None:
        """Rounds every retry period until `stop`; `on_change(True/False)` when leadership is won or lost;
        the Lease is released on the way out."""
        was = False
        try:
            while not stop.is_set():
                try:
                    self.try_acquire_or_renew()
                except K8sError as exc:
                    on_error(exc)
                now = self.leading
                if now != was:
                    was = now
                    on_change(now)
                stop.wait(self.config.retry_seconds)
        finally:
            self.release()
            if was:
                on_change(False)
