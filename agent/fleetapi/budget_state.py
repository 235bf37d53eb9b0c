"""This node's budget slot as this process knows it: one state value and its transitions, pure (no I/O).

FREE (none known) → UNSURE (a write sent) → TAKING (written, to be ranked) → HELD (granted, renewed) →
KEPT (released for the rate bound's window) → FREE (deleted). `LeaseBudget` (agent/fleetapi/budget.py) sends each
request and moves the state by one transition after it; docs/control-map.md ("The budget slot's states")
draws the machine with what each transition writes to the API. A transition asked of a state it does not
leave raises `BudgetStateError`: a bug, never an API answer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import StrEnum

from agent.errors import AgentError
from agent.fleetapi.budget_slots import Slot

#: The live and the recently taken slots, as one list of the Leases made after this process's write.
Lists = tuple[list[Slot], list[Slot]]


class BudgetStateError(AgentError):
    """A transition asked of a state it does not leave (a bug in LeaseBudget)."""


class Phase(StrEnum):
    #: No slot of this node known to this process (none written yet, or deleted).
    FREE = "free"
    #: The slot may be on the server, vouched for by nothing this process confirmed: a write in flight or
    #: unanswered, a slot lapsed for other readers, or gone or replaced under this process.
    UNSURE = "unsure"
    #: Written (created, or re-taken in place) and not yet ranked against the other slots.
    TAKING = "taking"
    #: Granted, and written recently enough that no reader can have let it lapse: renewals only renew.
    HELD = "held"
    #: Given back with the rate bound: released on the server and kept until its window has passed.
    KEPT = "kept"


@dataclass(frozen=True, slots=True)
class Take:
    """A take of the slot this process wrote (the Lease's uid and leaseTransitions) and when its answer came
    (this process's monotonic clock): every reader counts it from then on or later."""

    uid: str
    takes: int
    at: float


@dataclass(frozen=True, slots=True)
class Written:
    """This node's slot as this process's write left it, waiting for its rank (TAKING only)."""

    slot: Slot
    #: The write created the slot (False: it was there, and was re-taken in place: ranked as taken now).
    created: bool
    #: When the write was sent: a grant is trusted from then (other readers saw it no sooner).
    sent_at: float
    #: The re-take reused this process's take (its own released slot within the window): once granted, the
    #: take is carried forward (a new leaseTransitions) so that readers count it a window from then.
    carry: bool = False
    #: The re-taken slot was live (not released): one the rate bound alone refuses stays TAKING.
    was_live: bool = False
    #: A list of the Leases made after the write (the gate's reading): the acquire that follows ranks by it.
    lists: Lists | None = None


@dataclass(frozen=True, slots=True)
class SlotState:
    """What this process knows of its node's slot: the phase, and the facts that phase carries."""

    phase: Phase = Phase.FREE
    #: The take this process last wrote (None in FREE, or for a slot only an earlier process wrote).
    take: Take | None = None
    #: Given back, the slot is released and kept rather than deleted: its take stands for a disruption the
    #: rate bound counts (it was granted, or was on the server before this process wrote it).
    counted: bool = False
    #: TAKING: the write to rank.
    written: Written | None = None
    #: HELD: when the last write that confirmed the slot was sent (the grant's, then each renewal's).
    confirmed_at: float = 0.0
    #: KEPT: the monotonic time the release is kept from (the take's answer, else the release): it is deleted
    #: a window after.
    kept_from: float = 0.0

    # ---- what the state says ----
    @property
    def maybe_held(self) -> bool:
        """A slot this process wrote may be on the server, not given back: the pipeline gives it back."""
        return self.phase in {Phase.UNSURE, Phase.TAKING, Phase.HELD}

    @property
    def lingering(self) -> bool:
        """A released slot kept for the rate bound's window (release deletes it once due)."""
        return self.phase is Phase.KEPT

    def confirmed(self, now: float, trust_seconds: float) -> bool:
        """HELD and confirmed by a write sent less than `trust_seconds` ago (no reader can have let it lapse)."""
        return self.phase is Phase.HELD and now - self.confirmed_at < trust_seconds

    def fresh(self, now: float, trust_seconds: float) -> bool:
        """TAKING by a write sent less than `trust_seconds` ago (older, other readers may have let it lapse)."""
        return self.written is not None and now - self.written.sent_at < trust_seconds

    def kept_due(self, now: float, window_seconds: float) -> bool:
        """KEPT for a whole window: the slot is deleted."""
        return self.phase is Phase.KEPT and now - self.kept_from >= window_seconds

    def reuses(self, slot: Slot, now: float, window_seconds: float) -> bool:
        """A re-take of `slot` (as read) is this process's own take again: the slot released, still at the take
        this process wrote, within the window (it counts once)."""
        take = self.take
        return (slot.released and take is not None and (take.uid, take.takes) == (slot.uid, slot.takes)
                and now - take.at < window_seconds)

    # ---- transitions: each returns the next state ----
    def sent(self) -> SlotState:
        """Every state → UNSURE: a write is in flight whose answer decides what readers count (a create, a re-take, a
        carried take, a release), or what this process knew no longer vouches for the slot (lapsed, gone)."""
        return SlotState(Phase.UNSURE, self.take, self.counted)

    def found(self) -> SlotState:
        """FREE or UNSURE, the slot found on the server already (an earlier process's, or this one's): given
        back it is released and kept, never deleted."""
        self._leaves(Phase.FREE, Phase.UNSURE)
        return dataclasses.replace(self, counted=True)

    def created(self, slot: Slot, *, sent_at: float, at: float) -> SlotState:
        """UNSURE → TAKING: this process's create made the slot (a new take, dated when the answer came)."""
        self._leaves(Phase.UNSURE)
        return SlotState(Phase.TAKING, Take(slot.uid, slot.takes, at), self.counted,
                         Written(slot, created=True, sent_at=sent_at))

    def retaken(self, slot: Slot, *, reused: bool, unit: str, sent_at: float, at: float) -> SlotState:
        """UNSURE → TAKING: the slot that was there (`slot`, as read) written again in place, a new take
        (leaseTransitions + 1) or, `reused`, this process's take again."""
        self._leaves(Phase.UNSURE)
        if reused:
            own, take = dataclasses.replace(slot, released=False, unit=unit), self.take
        else:
            own = dataclasses.replace(slot, takes=slot.takes + 1, released=False, unit=unit)
            take = Take(slot.uid, slot.takes + 1, at)
        return SlotState(Phase.TAKING, take, True,
                         Written(own, created=False, sent_at=sent_at, carry=reused, was_live=not slot.released))

    def listed(self, lists: Lists | None) -> SlotState:
        """TAKING → TAKING: a list made after the write kept for the ranking (None: used, or to be made)."""
        self._leaves(Phase.TAKING)
        return dataclasses.replace(self, written=dataclasses.replace(self.write(), lists=lists))

    def granted(self, *, confirmed_at: float, take: Take | None = None) -> SlotState:
        """TAKING (or UNSURE while a carried take was written) → HELD: the ranking granted the slot, trusted
        from when its write was sent; `take`: the take carried forward."""
        self._leaves(Phase.TAKING, Phase.UNSURE)
        return SlotState(Phase.HELD, take or self.take, True, confirmed_at=confirmed_at)

    def renewed(self, *, confirmed_at: float) -> SlotState:
        """HELD → HELD: a renewal sent at `confirmed_at` landed."""
        self._leaves(Phase.HELD)
        return dataclasses.replace(self, confirmed_at=confirmed_at)

    def released(self, now: float) -> SlotState:
        """UNSURE (a release sent) or FREE (an earlier process's released slot found) → KEPT: kept from when
        this process's take was answered, else from now (as every reader first seeing it counts it)."""
        self._leaves(Phase.UNSURE, Phase.FREE)
        return SlotState(Phase.KEPT, self.take, self.counted,
                         kept_from=self.take.at if self.take is not None else now)

    def deleted(self) -> SlotState:
        """Every state → FREE: the slot deleted (or found gone): nothing of it is remembered."""
        return SlotState()

    def write(self) -> Written:
        """TAKING: the write to rank."""
        if self.written is None:
            raise BudgetStateError(f"budget slot state {self.phase} has no write to rank")
        return self.written

    def _leaves(self, *phases: Phase) -> None:
        if self.phase not in phases:
            raise BudgetStateError(f"budget slot state {self.phase} has no such transition")
