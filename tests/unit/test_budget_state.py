"""The budget slot's state machine, pure: each transition's next state, and what each state says."""

from __future__ import annotations

import pytest

from agent.fleetapi.budget_slots import Slot
from agent.fleetapi.budget_state import BudgetStateError, Phase, SlotState, Take, Written

HOUR = 3600.0
TRUST = 6480.0  # 0.9 of a two-hour lifetime


def lease(*, uid: str = "uid-1", takes: int = 3, released: bool = False) -> Slot:
    return Slot("gpu-health-slot-n1", "n1", uid, "7", 1.0e9, takes, released)


def unsure(*, take: Take | None = None, counted: bool = False) -> SlotState:
    return SlotState(Phase.UNSURE, take, counted)


def taking(*, sent_at: float = 10.0, carry: bool = False) -> SlotState:
    return SlotState(Phase.TAKING, Take("uid-1", 3, sent_at + 1), True, Written(lease(), True, sent_at, carry))


def held(*, confirmed_at: float = 10.0) -> SlotState:
    return SlotState(Phase.HELD, Take("uid-1", 3, 11.0), True, confirmed_at=confirmed_at)


def kept(*, kept_from: float = 11.0) -> SlotState:
    return SlotState(Phase.KEPT, Take("uid-1", 3, kept_from), True, kept_from=kept_from)


@pytest.mark.parametrize(("state", "maybe"), [(SlotState(), False), (unsure(), True), (taking(), True),
                                              (held(), True), (kept(), False)],
                         ids=["free", "unsure", "taking", "held", "kept"])
def test_a_slot_may_be_held_from_its_first_write_until_it_is_released_or_deleted(state, maybe):
    """maybe_held in UNSURE, TAKING and HELD; not in FREE or KEPT."""
    assert state.maybe_held is maybe


def test_only_a_kept_slot_lingers():
    """lingering is KEPT alone: the pipeline calls release until the kept slot is deleted."""
    assert [s.lingering for s in (SlotState(), unsure(), taking(), held(), kept())] == [False] * 4 + [True]


def test_a_new_process_knows_no_slot():
    """A new process starts FREE, with no take and nothing counted."""
    assert SlotState() == SlotState(Phase.FREE, None, False)


def test_a_write_sent_leaves_the_process_unsure_of_its_slot():
    """sent: FREE → UNSURE (the create may land whatever its answer)."""
    assert SlotState().sent().phase is Phase.UNSURE


def test_a_held_slot_sent_a_release_is_no_longer_held():
    """sent: HELD → UNSURE, the take and its count kept (a lost answer leaves nothing trusted as held)."""
    state = held().sent()
    assert (state.phase, state.take, state.counted, state.confirmed(11.0, TRUST)) == \
        (Phase.UNSURE, Take("uid-1", 3, 11.0), True, False)


def test_a_write_sent_over_a_kept_slot_ends_its_keep():
    """sent: KEPT → UNSURE: the slot written again is no longer a release kept for its window."""
    state = kept().sent()
    assert (state.phase, state.lingering, state.kept_due(11.0 + HOUR, HOUR)) == (Phase.UNSURE, False, False)


def test_a_slot_found_on_the_server_counts_when_given_back():
    """found: FREE → FREE, counted (an earlier process's slot is released and kept, never deleted)."""
    state = SlotState().found()
    assert (state.phase, state.counted) == (Phase.FREE, True)


def test_a_created_slot_is_a_new_take_dated_when_its_answer_came():
    """created: UNSURE → TAKING, the take dated at the answer, the write at when it was sent."""
    state = unsure().created(lease(), sent_at=10.0, at=12.0)
    assert (state.phase, state.take, state.write().created, state.write().sent_at) == \
        (Phase.TAKING, Take("uid-1", 3, 12.0), True, 10.0)


def test_a_created_slot_does_not_count_by_itself():
    """created keeps counted False: a refused new slot is deleted, not kept."""
    assert not unsure().created(lease(), sent_at=10.0, at=12.0).counted


def test_a_re_take_is_a_new_take_one_lease_transition_on():
    """retaken, not reused: leaseTransitions + 1, dated at the answer."""
    state = unsure().retaken(lease(), reused=False, unit="", sent_at=10.0, at=12.0)
    assert (state.phase, state.take, state.write().slot.takes) == (Phase.TAKING, Take("uid-1", 4, 12.0), 4)


def test_a_reused_re_take_keeps_its_take_and_carries_it_once_granted():
    """retaken, reused: the take unchanged, the write marked to carry it forward."""
    mine = Take("uid-1", 3, 5.0)
    state = unsure(take=mine).retaken(lease(released=True), reused=True, unit="", sent_at=10.0, at=12.0)
    assert (state.take, state.write().slot.takes, state.write().carry) == (mine, 3, True)


def test_a_re_taken_slot_is_no_longer_released_and_names_its_unit():
    """retaken writes the released mark off and the unit on."""
    slot = unsure().retaken(lease(released=True), reused=False, unit="u/1", sent_at=10.0, at=12.0).write().slot
    assert (slot.released, slot.unit) == (False, "u/1")


@pytest.mark.parametrize(("released", "live"), [(False, True), (True, False)])
def test_a_re_take_remembers_whether_the_slot_was_live(released, live):
    """retaken: was_live when the slot re-taken was not released (a rate refusal keeps it TAKING)."""
    state = unsure().retaken(lease(released=released), reused=False, unit="", sent_at=10.0, at=12.0)
    assert state.write().was_live is live


def test_a_re_taken_slot_counts_when_given_back():
    """retaken: counted (the slot was there before this write)."""
    assert unsure().retaken(lease(), reused=False, unit="", sent_at=10.0, at=12.0).counted


def test_its_own_released_take_within_the_window_is_reused():
    """reuses: released, at this process's take, less than a window after its answer."""
    assert unsure(take=Take("uid-1", 3, 5.0)).reuses(lease(released=True), 5.0 + HOUR - 1, HOUR)


@pytest.mark.parametrize(("slot", "now"), [(lease(), 10.0), (lease(released=True), 5.0 + HOUR),
                                           (lease(released=True, takes=4), 10.0),
                                           (lease(released=True, uid="other"), 10.0)],
                         ids=["not-released", "window-passed", "another-take", "another-lease"])
def test_a_take_not_its_own_released_one_within_the_window_is_not_reused(slot, now):
    """reuses is False for a live slot, a window passed, or another take or Lease than this process wrote."""
    assert not unsure(take=Take("uid-1", 3, 5.0)).reuses(slot, now, HOUR)


def test_a_slot_only_an_earlier_process_wrote_is_never_reused():
    """reuses is False without a take of this process's."""
    assert not unsure().reuses(lease(released=True), 10.0, HOUR)


def test_a_list_made_after_the_write_is_kept_for_its_ranking():
    """listed: TAKING → TAKING with the lists; listed(None) drops them."""
    lists = ([lease()], [])
    state = taking().listed(lists)
    assert (state.phase, state.write().lists, state.listed(None).write().lists) == (Phase.TAKING, lists, None)


def test_a_write_is_fresh_until_other_readers_may_have_let_it_lapse():
    """fresh: TAKING, its write sent less than the trust ago."""
    state = taking(sent_at=10.0)
    assert (state.fresh(10.0 + TRUST - 1, TRUST), state.fresh(10.0 + TRUST, TRUST)) == (True, False)


def test_a_granted_slot_is_trusted_from_when_its_write_was_sent():
    """granted: TAKING → HELD, confirmed until the trust has passed since the write was sent."""
    state = taking(sent_at=10.0).granted(confirmed_at=10.0)
    assert (state.phase, state.confirmed(10.0 + TRUST - 1, TRUST), state.confirmed(10.0 + TRUST, TRUST)) == \
        (Phase.HELD, True, False)


def test_a_granted_slot_counts_when_given_back():
    """granted: counted, whatever the write was."""
    assert SlotState(Phase.TAKING, written=Written(lease(), True, 10.0)).granted(confirmed_at=10.0).counted


def test_a_carried_take_replaces_the_reused_one_when_granted():
    """granted(take=...): the carried take is the one readers count from now (from UNSURE: the carry's write)."""
    carried = Take("uid-1", 4, 20.0)
    assert taking(carry=True).sent().granted(confirmed_at=10.0, take=carried).take == carried


def test_a_renewal_moves_the_trust_forward():
    """renewed: HELD → HELD, confirmed from the renewal's send."""
    state = held(confirmed_at=10.0).renewed(confirmed_at=5000.0)
    assert (state.phase, state.confirmed(10.0 + TRUST, TRUST)) == (Phase.HELD, True)


def test_a_release_is_kept_from_when_its_take_was_answered():
    """released: UNSURE → KEPT from the take's answer (its hour ends no later than every reader's)."""
    state = held().sent().released(500.0)
    assert (state.phase, state.kept_from) == (Phase.KEPT, 11.0)


def test_an_earlier_processs_released_slot_is_kept_from_now():
    """released: FREE (found) → KEPT from now, as every reader first seeing it counts it."""
    state = SlotState().found().released(500.0)
    assert (state.phase, state.kept_from, state.counted) == (Phase.KEPT, 500.0, True)


def test_a_kept_slot_is_due_a_window_after_it_is_kept_from():
    """kept_due: KEPT for a whole window."""
    state = kept(kept_from=11.0)
    assert (state.kept_due(11.0 + HOUR - 1, HOUR), state.kept_due(11.0 + HOUR, HOUR)) == (False, True)


def test_a_deleted_slot_is_forgotten():
    """deleted: any → FREE, with no take and nothing counted."""
    assert [s.deleted() for s in (unsure(take=Take("u", 1, 1.0), counted=True), taking(), held(), kept())] == \
        [SlotState()] * 4


@pytest.mark.parametrize("transition", [
    lambda: SlotState().granted(confirmed_at=1.0),
    lambda: held().created(lease(), sent_at=1.0, at=1.0),
    lambda: kept().retaken(lease(), reused=False, unit="", sent_at=1.0, at=1.0),
    lambda: unsure().renewed(confirmed_at=1.0),
    lambda: held().released(1.0),
    lambda: held().listed(None),
    lambda: taking().found(),
], ids=["free-granted", "held-created", "kept-retaken", "unsure-renewed", "held-released", "held-listed",
        "taking-found"])
def test_a_transition_a_state_does_not_leave_raises(transition):
    """A transition asked of a state it does not leave is a bug, raised as BudgetStateError."""
    with pytest.raises(BudgetStateError):
        transition()
