"""The quarantine brake's claims: a Lease per newly quarantining node, created before its taint and ranked by
its creation resourceVersion, so that agents deciding at once never quarantine more nodes than the bound.

Counting alone has a race: agents that list within one round trip each see room and each taint. A claim
closes it. A node whose new taint the brake's count allows first creates its claim, the Lease
`gpu-health-brake-<node>` labelled `gpu-health-agent.io/brake-claim=true`; then it lists every claim (or
reads them from its watch once that delivered its own create: agent.fleetapi.claims_watch) and counts those
created before its own. A claim is never written again, so its resourceVersion is the one its
create got: etcd's commit order, which Kubernetes makes comparable between objects of one resource (1.35,
KEP-5504). The claim created last among any set lists after every other one of them was committed, so it
sees them all ahead of it. Hence no more than `bound` claims within a window are ever let through together.
A version that is not a plain integer cannot be compared: it counts as ahead, on both sides.

A claim counts as new while it is younger than the window by the API server's clock alone: its
creationTimestamp against the newest creationTimestamp in the same list (at least the reader's own claim,
created just before), so no agent's clock, however far off, makes a claim look older than it is, and a claim
whose holder died stops counting a window after it was made. A refused claim is deleted at once; its holder
deletes an admitted one once it has held it for a window, and replaces one an earlier process left. Only the
holder writes its claim (daemonset/admission-policy.yaml: create and delete, never update), so a claim this
process made is ranked again within its window without being fetched.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from agent.fleetapi.budget_slots import epoch
from agent.k8s.bodies import Lease, ObjectMeta
from agent.k8s.errors import Conflict, K8sError, NotFound
from agent.k8s.raw import JsonDocument, RawApi, api_path
from agent.k8s.retry import with_retries

CLAIM_LABEL = "gpu-health-agent.io/brake-claim"
CLAIM_PREFIX = "gpu-health-brake-"
#: The NVLink fabric domain the claiming node reports itself (NVML), on its claim: a published unit counts a
#: claim as one of its own only where the claim states the unit's domain (a unit naming nodes of another
#: domain gains them nothing).
DOMAIN_ANNOTATION = "gpu-health-agent.io/fabric-domain"


def claim_name(node: str) -> str:
    return CLAIM_PREFIX + node


@dataclass(frozen=True, slots=True)
class Claim:
    """One claim as the API server lists it."""

    name: str
    holder: str
    uid: str
    #: The resourceVersion its create got (None: not a plain integer, so not comparable).
    version: int | None
    #: The API server's creationTimestamp, seconds since the epoch (None: unreadable, counted as new).
    created: float | None = None
    #: The fabric domain its holder stated (DOMAIN_ANNOTATION; "" none).
    domain: str = ""

    @classmethod
    def of(cls, lease: JsonDocument) -> Claim:
        meta = lease.get("metadata") or {}
        spec = lease.get("spec") or {}
        return cls(str(meta.get("name", "")), str(spec.get("holderIdentity") or ""), str(meta.get("uid", "")),
                   plain_version(meta.get("resourceVersion")), epoch(meta.get("creationTimestamp")),
                   str((meta.get("annotations") or {}).get(DOMAIN_ANNOTATION) or ""))


def plain_version(value: object) -> int | None:
    """A resourceVersion as an integer where it is a plain one (comparable, KEP-5504); else None."""
    text = str(value or "")
    return int(text) if text.isdigit() and not text.startswith("0") else None


def places_ahead(own: Claim, claims: Iterable[Claim], *, units: Mapping[str, str],
                 unclaimed: Iterable[str] = (), domains: Mapping[str, str] | None = None) -> int:
    """The places taken ahead of `own`: the holders of the claims created before it, and the `unclaimed` nodes
    (newly quarantined within the window by the count, with no claim listed: an older agent's, an operator's
    confirm, a claim already given back), a published unit's nodes (`units`: node to unit id) as one place,
    and `own`'s unit being its own place. With `domains` (unit id to its fabric domain), a claim joins its
    unit only where it states that domain itself, and an unclaimed node (which states none) never does."""
    listed = list(claims)
    holders = {c.holder for c in listed}

    def place(holder: str, domain: str | None) -> str:
        unit = units.get(holder)
        if unit is None or (domains is not None and (domain is None or domains.get(unit) != domain)):
            return holder
        return unit

    mine = place(own.holder, own.domain)
    ahead = {place(c.holder, c.domain) for c in listed if c.name != own.name and _before(c, own)}
    ahead |= {place(node, None) for node in unclaimed if node not in holders and node != own.holder}
    ahead.discard(mine)
    return len(ahead)


def within_window(claims: Iterable[Claim], *, window_seconds: float) -> list[Claim]:
    """The claims younger than the window by the API server's clock: each creationTimestamp against the newest
    listed (a time the server has passed, so a claim never looks older than it is; one second more for the
    stamps' whole seconds). An unreadable stamp counts as new."""
    listed = list(claims)
    newest = max((c.created for c in listed if c.created is not None), default=None)
    return [c for c in listed if c.created is None or newest is None or newest - c.created < window_seconds + 1]


def _before(other: Claim, own: Claim) -> bool:
    """Created before `own`; where either version cannot be compared, counted as if it were."""
    return other.version is None or own.version is None or other.version < own.version


class BrakeClaims:
    """This node's claim: made before a new quarantine, ranked against the others' in one list, deleted when
    refused or a window after it was made."""

    def __init__(self, raw: RawApi, *, node_name: str, namespace: str, window_seconds: float,
                 monotonic: Callable[[], float] = time.monotonic, deadline_seconds: float | None = None,
                 rng: random.Random | None = None, fabric_domain: Callable[[], str] = str,
                 delivered: Callable[[int | None], list[Claim] | None] | None = None) -> None:
        self.raw = raw
        #: The claims as a watch holds them once current to a version (agent.fleetapi.claims_watch), or None where
        #: it cannot say: a ranking then lists them.
        self.delivered = delivered
        #: This node's NVLink fabric domain as it reports it (NVML), stated on its claim.
        self.fabric_domain = fabric_domain
        self.node = node_name
        self.name = claim_name(node_name)
        self.namespace = namespace
        self.window = window_seconds
        self.monotonic = monotonic
        self.deadline = deadline_seconds
        self.rng = rng or random.Random()  # noqa: S311 - jitter, not cryptography
        self.leases = api_path("coordination.k8s.io", "v1", "leases", namespace=namespace)
        #: When this process created or first found its own claim (None: it knows of none), and the claim as
        #: the server answered (a claim is never written again: a ranking within its window needs no request).
        self._held_from: float | None = None
        self._held: JsonDocument | None = None
        #: Whether this process gave back what an earlier one left (expire's first call).
        self._started = False

    def rank(self, *, bound: int, units: Mapping[str, str], unclaimed: Iterable[str] = (),
             domains: Mapping[str, str] | None = None) -> tuple[bool, int]:
        """Create this node's claim, list every claim, and rank it (with the `unclaimed` quarantines the count
        saw, places_ahead): whether fewer than `bound` places are taken ahead of it within the window, and how
        many are. A refused claim is deleted; where that delete fails it stays refused (its holder deletes it
        later), never let through. Raises only where the claim could not be made or the claims listed."""
        own, claims = self._claim_and_list()
        listed = [c for c in claims if c.name != own.name]
        ahead = places_ahead(own, within_window([own, *listed], window_seconds=self.window), units=units,
                             unclaimed=unclaimed, domains=domains)
        if ahead < bound:
            return True, ahead
        # A delete that fails leaves it this node's to delete (the next claim or tidy does): meanwhile it only
        # counts against the others.
        with contextlib.suppress(K8sError):
            self.withdraw()
        return False, ahead

    def _claim_and_list(self) -> tuple[Claim, list[Claim]]:
        """This node's claim (made, or the one it holds) and every claim listed after it was made: from the
        watch once it delivered the claim's create, else a list. A held claim missing there was deleted by
        someone else: made anew, once."""
        reused = self._reusable()
        own = Claim.of(self._retried(self._create))
        claims = self._listed_after(own)
        if reused and not any(c.name == own.name and c.uid == own.uid for c in claims):
            self._held_from, self._held = None, None
            own = Claim.of(self._retried(self._create))
            claims = self._listed_after(own)
        return own, claims

    def _listed_after(self, own: Claim) -> list[Claim]:
        """Every claim once `own` was made: the watch's, where it can say, else a list."""
        delivered = self.delivered(own.version) if self.delivered is not None else None
        return self._list() if delivered is None else delivered

    def withdraw(self) -> None:
        """Delete this node's claim (already gone is fine)."""

        def delete() -> JsonDocument:
            try:
                return self.raw.delete(f"{self.leases}/{self.name}")
            except NotFound:
                return {}

        self._retried(delete)
        self._held_from, self._held = None, None

    def expire(self) -> bool:
        """Delete this node's claim once this process has held it for a window, and once at its start the one
        an earlier process may have left (a reboot or a rollout within the window: nobody else may delete it);
        whether it sent a delete."""
        if not self._started and self._held_from is None:
            self.withdraw()
            self._started = True
            return True
        self._started = True
        if self._held_from is None or self._holds():
            return False
        self.withdraw()
        return True

    def _reusable(self) -> bool:
        """This process holds the claim it made, as the server answered it: ranked again without a request."""
        return self._held is not None and self._holds()

    def _holds(self) -> bool:
        """This process made the claim there less than a window ago."""
        return self._held_from is not None and self.monotonic() - self._held_from < self.window

    def _create(self) -> JsonDocument:
        """This node's claim: created; the one this process holds (within its window: ranked as it was made);
        one an earlier process left is deleted and made anew (its stamp and rank are of another time)."""
        domain = self.fabric_domain()
        metadata: ObjectMeta = {"name": self.name, "namespace": self.namespace, "labels": {CLAIM_LABEL: "true"}}
        if domain:
            metadata["annotations"] = {DOMAIN_ANNOTATION: domain}
        body: Lease = {"metadata": metadata,
                       "spec": {"holderIdentity": self.node, "leaseDurationSeconds": int(self.window)}}
        path = f"{self.leases}/{self.name}"
        if self._held is not None and self._reusable():
            return self._held
        for _ in range(3):
            try:
                self._held = self.raw.create(self.leases, body)
                self._held_from = self.monotonic()
                return self._held
            except Conflict:
                pass
            try:
                if self._holds():
                    self._held = self.raw.get(path)
                    return self._held
                self.raw.delete(path)
            except NotFound:
                self._held_from, self._held = None, None
        raise Conflict(f"lease {self.namespace}/{self.name} was there again after being deleted three times",
                       status=409)

    def _list(self) -> list[Claim]:
        """The claims: labelled, and named as one (a slot someone labelled as a claim is no claim)."""
        listed = self._retried(lambda: self.raw.get(self.leases, query={"labelSelector": f"{CLAIM_LABEL}=true"}))
        claims = [Claim.of(item) for item in listed.get("items") or []]
        return [c for c in claims if c.name.startswith(CLAIM_PREFIX)]

    def _retried(self, func: Callable[[], JsonDocument]) -> JsonDocument:
        return with_retries(func, deadline_seconds=self.deadline, rng=self.rng)
