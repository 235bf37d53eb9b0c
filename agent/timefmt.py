"""RFC 3339 times as Kubernetes writes them, always UTC: Time (whole seconds) and MicroTime (microseconds)."""

from __future__ import annotations

import time
from datetime import UTC, datetime


def rfc3339(at: float | None = None) -> str:
    """A Kubernetes Time (taint timeAdded, condition times, annotations): `2026-12-02T01:20:03Z`."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() if at is None else at))


def rfc3339_micro(at: float | None = None) -> str:
    """A Kubernetes MicroTime (an Event's eventTime, a Lease's renewTime) and a log line's timestamp:
    `2026-12-02T01:20:03.123456Z`."""
    moment = datetime.now(UTC) if at is None else datetime.fromtimestamp(at, UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_rfc3339(text: str) -> float:
    """Seconds since the epoch of an RFC 3339 time (`Z` or an offset, with or without a fraction); raises
    ValueError on anything else."""
    value = text.strip()
    if value.endswith(("Z", "z")):
        value = value[:-1] + "+00:00"
    moment = datetime.fromisoformat(value)
    if moment.tzinfo is None:
        raise ValueError(f"not an RFC 3339 time (no offset): {text!r}")
    return moment.timestamp()
