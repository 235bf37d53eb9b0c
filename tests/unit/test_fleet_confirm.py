"""How long an operator's confirm of a braked taint is honoured, on the agent's own clocks."""

import math

from agent.fleet.confirm import CONFIRM_SECONDS, confirm_deadline, confirm_value

WALL = 1_790_000_000.0


def test_a_confirm_seen_as_it_is_written_lives_fifteen_minutes_from_then():
    """Written and first seen at once: honoured until CONFIRM_SECONDS after first sight (monotonic clock)."""
    assert confirm_deadline(confirm_value(WALL), seen_at=50.0, wall=WALL) == 50.0 + CONFIRM_SECONDS


def test_a_confirm_seen_late_lives_only_what_is_left_of_its_lifetime():
    """First seen ten minutes after it was written (the agent was down): five minutes are left."""
    assert confirm_deadline(confirm_value(WALL), seen_at=50.0, wall=WALL + 600.0) == 50.0 + CONFIRM_SECONDS - 600.0


def test_an_operator_clock_ahead_cannot_lengthen_a_confirm():
    """Written an hour in the agent's future: still at most CONFIRM_SECONDS from first sight."""
    assert confirm_deadline(confirm_value(WALL + 3600.0), seen_at=50.0, wall=WALL) == 50.0 + CONFIRM_SECONDS


def test_a_value_that_is_not_a_time_is_never_honoured():
    """Anything but an RFC 3339 time (a hand-written `yes`) has expired before it was seen."""
    assert confirm_deadline("yes", seen_at=50.0, wall=WALL) == -math.inf
