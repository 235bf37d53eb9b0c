"""A watch of the quarantine brake's claims (agent.fleetapi.brake_claims), so that ranking a new claim needs no list:
the claims as the watch holds them once it has delivered the new claim's own create are every claim committed
before it, as a list made after that create would show them.

A watch delivers one resource's changes in the order etcd committed them (resourceVersion order), so when the
create of this node's claim (resourceVersion v) arrives, every claim created before it (a smaller version)
has arrived too, and any deleted since as far as the stream has gone: the set is a consistent list at a
version >= v. Where the watch is not synced (starting, after a failure or a 410), where a version is not a
plain integer, or where the create does not arrive within the wait, the caller lists instead, as before.
"""

from __future__ import annotations

import threading
from typing import Any

from agent.fleetapi.brake_claims import CLAIM_LABEL, CLAIM_PREFIX, Claim, plain_version
from agent.k8s.errors import K8sError
from agent.k8s.raw import JsonDocument, api_path
from agent.k8s.watch import ListWatch, WatchOptions
from agent.logs import get_logger

log = get_logger("agent.fleetapi.claims_watch")
#: How long a ranking waits for its own claim's create to be delivered before it lists instead (the watch
#: delivers within milliseconds of the create's answer; a longer wait means a stalled connection).
DELIVERY_WAIT_SECONDS = 0.25
#: The claims watch asks to be ended this many times later than the Node's watch (`node_watch_seconds`): a
#: third as many re-opens, so a healthy node stays within 2 requests an hour. A stalled one costs a ranking
#: the wait above and a list, nothing more.
REOPEN_FACTOR = 3.0


class ClaimsWatch:
    """Lists the claims (at start and after a 410), then watches them; `through` answers a ranking."""

    def __init__(self, api_client: Any, namespace: str, *, watch_seconds: float,
                 max_backoff_seconds: float = 30.0) -> None:
        self.lister = ListWatch(api_client, api_path("coordination.k8s.io", "v1", "leases", namespace=namespace),
                                WatchOptions(label_selector=f"{CLAIM_LABEL}=true", watch_seconds=watch_seconds,
                                             max_backoff_seconds=max_backoff_seconds))
        self._changed = threading.Condition()
        self._claims: dict[str, Claim] = {}
        #: The newest resourceVersion the claims held are known to be current to (0: not synced).
        self._through = 0
        #: Rankings answered from the watch, and those that listed instead.
        self.answered = 0
        self.missed = 0

    def run(self, stop: threading.Event) -> None:
        """Until `stop`: keeps the claims current; not synced while the watch fails or relists."""
        self.lister.run(stop, on_sync=self._synced, on_event=self._event, on_error=self._failed,
                        on_expired=self._lost)
        self._lost()

    def close(self) -> None:
        """Ends the open watch now (a stop), from another thread."""
        self.lister.close()

    def through(self, version: int | None, *, wait_seconds: float = DELIVERY_WAIT_SECONDS) -> list[Claim] | None:
        """Every claim as the watch holds them once it is current to `version` (this node's claim's create),
        waiting at most `wait_seconds` for that while it is synced; None at once where it is not or `version`
        cannot be compared, and None where it did not get there in time: the caller lists."""
        wanted = version or 0
        with self._changed:
            if wanted:
                self._changed.wait_for(lambda: not self._through or self._through >= wanted, timeout=wait_seconds)
            claims = list(self._claims.values()) if wanted and self._through >= wanted else None
        if claims is None:
            self.missed += 1
            return None
        self.answered += 1
        return claims

    def _synced(self, items: list[JsonDocument]) -> None:
        claims = {c.name: c for c in map(Claim.of, items) if c.name.startswith(CLAIM_PREFIX)}
        with self._changed:
            self._claims = claims
            self._through = plain_version(self.lister.resource_version) or 0
            self._changed.notify_all()

    def _event(self, kind: str, obj: JsonDocument) -> None:
        claim = Claim.of(obj)
        with self._changed:
            if kind == "DELETED":
                self._claims.pop(claim.name, None)
            elif claim.name.startswith(CLAIM_PREFIX):
                self._claims[claim.name] = claim
            if self._through and claim.version is not None:
                self._through = max(self._through, claim.version)
            self._changed.notify_all()

    def _lost(self) -> None:
        with self._changed:
            self._through = 0

    def _failed(self, exc: K8sError) -> None:
        self._lost()
        log.warning("claims_watch_failed", error=str(exc), fallback="each ranking lists the claims until it is back")
