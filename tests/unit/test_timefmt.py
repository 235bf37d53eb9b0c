"""One time-format module: Kubernetes Time and MicroTime, written and read back the same everywhere."""

from __future__ import annotations

import re

import pytest

from agent.k8s.events import micro_time
from agent.logs import _now
from agent.timefmt import parse_rfc3339, rfc3339, rfc3339_micro

AT = 1_795_000_000.25  # 2026-11-18T11:06:40.25Z
TIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$")
MICRO = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z$")


def test_a_time_is_whole_seconds_in_utc():
    """Time: seconds, `Z`; the fraction is dropped, not rounded."""
    assert rfc3339(AT) == "2026-11-18T11:06:40Z"


def test_a_micro_time_has_six_fraction_digits_in_utc():
    """MicroTime: exactly six fraction digits, `Z`."""
    assert rfc3339_micro(AT) == "2026-11-18T11:06:40.250000Z"


@pytest.mark.parametrize("text", ["2026-11-18T11:06:40.250000Z", "2026-11-18T12:06:40.25+01:00",
                                  "2026-11-18T11:06:40.25z"])
def test_an_rfc3339_time_reads_back_to_the_same_instant(text: str):
    """`Z`, an offset, a short fraction: all read as the same instant."""
    assert parse_rfc3339(text) == AT


@pytest.mark.parametrize("text", ["2026-11-18T11:06:40", "yesterday", ""])
def test_a_time_without_an_offset_or_unreadable_is_refused(text: str):
    """A time with no offset is ambiguous: ValueError, never a guess at the local zone."""
    with pytest.raises(ValueError):
        parse_rfc3339(text)


def test_the_writers_use_the_two_formats():
    """Events and log lines write MicroTime; a taint's timeAdded and the annotations write Time."""
    assert MICRO.match(micro_time()) and MICRO.match(_now())
    assert TIME.match(rfc3339())
