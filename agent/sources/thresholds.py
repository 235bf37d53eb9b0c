"""Sanity bounds for temperature thresholds a GPU reports: an absurd one (a shutdown threshold of 0 C) is
ignored with a warning, never trusted into a drain at room temperature."""

from __future__ import annotations

import math

#: No NVIDIA GPU slows down, shuts down or caps its memory outside this range (datacenter parts: 85-105 C).
PLAUSIBLE_THRESHOLD_C = (60.0, 130.0)


def plausible_threshold(value: float | None) -> bool:
    """True when a reported threshold (degrees C) can be a real one."""
    if value is None or isinstance(value, bool) or not math.isfinite(value):
        return False
    low, high = PLAUSIBLE_THRESHOLD_C
    return low <= value <= high
