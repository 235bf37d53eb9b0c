"""One node's waits on the quarantine brake: the QuarantineBraked Event owed once per wait, the gauge, and an
operator's confirm (`gpu-health-agent fleet confirm`) taken in, honoured for the taint waiting, and consumed."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable

from agent.control.seams import Actuator
from agent.control.shared import Shared
from agent.fleet.confirm import confirm_deadline
from agent.fleet.node_side import FleetView, fleet_view
from agent.remediation import ActiveFault
from agent.remediation.record import OwedEvent

#: The reason of the Event a node gets when the brake first keeps its new taint waiting.
REASON = "QuarantineBraked"


class BrakeWaits:
    """The brake's word on this node for the reconciler's pass, with what an operator confirmed.

    A wait starts when the brake first refuses the node's new taint and ends when nothing waits (the taint went,
    the fault ended, the brake opened). Its Event is owed in the record under an id made from the faults that
    wait (each one's rule, GPU and since), so a restart during the wait owes the same Event and the API server
    keeps the one it has (409)."""

    def __init__(self, shared: Shared, actuator: Actuator) -> None:
        self.shared = shared
        self.actuator = actuator
        self._wait = ""
        #: The confirm this pass's read of the Node found, and until when it is honoured (the fleet clock).
        self._confirm: tuple[str, float] | None = None
        #: Whether the confirm lifted the brake's refusal in this process.
        self._used = False
        #: A confirm consumed (or spent where the Node may not be written): never honoured again here.
        self._spent = ""
        #: When this process first saw each active fault (gpu_key, rule_id), on the fleet clock: its settle.
        self._first_seen: dict[tuple[str, str], float] = {}
        #: When the settle of a holdable fault ends (the fleet clock), for the reconciler's next pass.
        self.settle_until: float | None = None

    def observed(self, value: str) -> None:
        """The confirm annotation as the pass's read of the Node found it ("": none, or the Node unread)."""
        source = self.shared.fleet
        if not value or value == self._spent or source is None:
            self._confirm, self._used = None, False
            return
        if self._confirm is None or self._confirm[0] != value:
            self._confirm = (value, confirm_deadline(value, seen_at=source.clock(), wall=source.wall()))
            self._used = False

    def view(self, faults: list[ActiveFault], *, quarantined: bool) -> FleetView:
        """The fleet's word on the faults as they are now. A live confirm lifts the brake's refusal of the
        waiting taint (the node's and its devices' quarantine), and nothing else: holds, the budget, the mode
        and every other gate decide as ever."""
        shared = self.shared
        quarantined_at = None
        if shared.fleet is not None:
            now = shared.fleet.clock()
            self._first_seen = {(f.gpu_key, f.rule_id): self._first_seen.get((f.gpu_key, f.rule_id), now)
                                for f in faults}
            with shared.lock:
                since = shared.record.node.quarantined_since
            if since > 0:  # the record's start (this node's wall clock) on the fleet clock, one machine's clocks
                quarantined_at = now - max(0.0, shared.fleet.wall() - since)
        view = fleet_view(shared.fleet, node=shared.inventory.name, faults=faults, quarantined=quarantined,
                          first_seen=self._first_seen, quarantined_at=quarantined_at)
        self.settle_until = view.settle_until
        if (view.brake or view.claim) and self._live():  # the count's refusal, or the claim's to come
            if not self._used:
                shared.log.warning("brake_confirmed", brake=view.brake or "a claim on the brake's places",
                                   confirm=self._confirm_value)
            self._used = True
            self._waiting("", faults, view)
            return dataclasses.replace(view, brake="", claim=False)
        if view.brake or not view.claim:  # with a claim to come, a wait goes on until the claim answers
            self._waiting(view.brake, faults, view)
        return view

    def claim_refused(self) -> None:
        """The claim of a new quarantine the count allowed was refused this pass: the wait begins (its Event)."""
        shared = self.shared
        with shared.lock:
            faults = list(shared.record.faults.values())
        self._waiting(shared.fleet_view.brake, faults, shared.fleet_view)

    def end_pass(self, *, writes_refused: bool) -> None:
        """A confirm is consumed once its work is done or there is none: the node is quarantined now, nothing
        waits, or it expired. One that lifted the brake for a taint that did not take effect (a failed write,
        the budget) stays for the next pass, until it expires. Where the Node may not be written (dry-run,
        opt-out) it is spent here and left on the Node."""
        source = self.shared.fleet
        if self._confirm is None or source is None:
            return
        value, until = self._confirm
        shared = self.shared
        with shared.lock:
            quarantined = shared.record.node.quarantined
        expired = source.clock() >= until
        if not quarantined and not expired and self._used:
            return
        result = "used" if self._used else "expired" if expired else "unused"
        shared.log.info("brake_confirm_consumed", result=result, confirm=value)
        if shared.metrics:
            shared.metrics.brake_confirms.labels(result).inc()
        self._spent, self._confirm, self._used = value, None, False
        if not writes_refused:
            shared.store.safely("confirm_not_consumed", self.actuator.consume_confirm, value)

    @property
    def _confirm_value(self) -> str:
        return self._confirm[0] if self._confirm is not None else ""

    def _live(self) -> bool:
        source = self.shared.fleet
        return self._confirm is not None and source is not None and source.clock() < self._confirm[1]

    def _waiting(self, brake: str, faults: Iterable[ActiveFault], view: FleetView) -> None:
        """The wait begins (its Event owed) or ends; the gauge says which."""
        shared = self.shared
        if shared.metrics:
            shared.metrics.quarantine_braked.set(1 if brake else 0)
        if not brake:
            self._wait = ""
            return
        waiting = sorted((f.gpu_key, f.rule_id, f.since) for f in faults
                         if f.action.quarantines and (f.gpu_key, f.rule_id) not in view.held)
        wait = hashlib.sha256(f"{shared.inventory.name}|{REASON}|{waiting}".encode()).hexdigest()[:20]
        if wait == self._wait:
            return
        self._wait = wait
        rules = ", ".join(sorted({rule for _, rule, _ in waiting})) or "a fault"
        note = (f"The taint for {rules} waits: {brake}. It goes as the window moves past the other nodes' "
                f"quarantines; `gpu-health-agent fleet confirm {shared.inventory.name}` lets it through now "
                "(docs/fleet.md).")
        event = OwedEvent(wait, shared.inventory.name, REASON, "Warning", note)
        shared.log.warning("quarantine_braked", brake=brake, rules=rules)
        with shared.lock:
            shared.record.owe(event)
            shared.save()
