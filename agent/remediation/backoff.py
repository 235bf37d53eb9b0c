"""How soon a pass whose API requests failed is tried again: 2 s at first, doubling per failing pass in a row."""

from __future__ import annotations

#: The wait after the first failing pass; each further failing pass in a row doubles it, up to the cap.
FIRST_SECONDS = 2.0
#: The cap while a disruptive step (a fatal fault's eviction, reset, reboot request) is owed and only failed
#: requests keep it back: the node is already quarantined and every pass goes on from what the last one got.
OWED_CAP_SECONDS = 4.0


def failed_pass_delay(failing_passes: int, *, cap_seconds: float, first_seconds: float = FIRST_SECONDS) -> float:
    """The wait before the next pass after `failing_passes` failing passes in a row (0: none, no wait owed).

    A failed request (the API answered an error past its retries, or could not be read) is a transient fault of
    the API, not a refusal: the pass is tried again soon, backing off only while the failures go on."""
    if failing_passes <= 0:
        return 0.0
    return min(cap_seconds, first_seconds * 2.0 ** min(failing_passes - 1, 32))
