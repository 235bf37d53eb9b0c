"""An operator's confirm of a taint the quarantine brake keeps waiting: the value `fleet confirm` writes and
how long the agent honours it. Pure.

The value is when the operator wrote it (RFC 3339, the operator's wall clock). The agent places it on its own
monotonic clock when it first sees it, as it places a hold: honoured until `first seen + CONFIRM_SECONDS -
its age then` (the age read on the agent's wall clock, never below 0), so a skewed wall clock can only
shorten a confirm, never lengthen it past CONFIRM_SECONDS from when the agent first saw it.
"""

from __future__ import annotations

import math

from agent.timefmt import parse_rfc3339, rfc3339

#: A confirm not used within this long of being written expires: it lets through the taint waiting when the
#: operator looked, not one that comes to wait later.
CONFIRM_SECONDS = 900.0


def confirm_value(wall: float) -> str:
    """What `gpu-health-agent fleet confirm` writes: when it was written."""
    return rfc3339(wall)


def confirm_deadline(value: str, *, seen_at: float, wall: float, seconds: float = CONFIRM_SECONDS) -> float:
    """Until when (the reader's monotonic clock; it first saw `value` at `seen_at`, its wall clock reading
    `wall`) the confirm is honoured; -inf for a value that is not a time (never honoured)."""
    try:
        written = parse_rfc3339(value)
    except ValueError:
        return -math.inf
    return seen_at + seconds - max(0.0, wall - written)
