"""The holds' published form: times recovered as differences on the reader's own clock."""

from __future__ import annotations

import pytest

from agent.errors import InputError
from agent.fleet import Dimension, Hold
from agent.fleet.published import (
    ALIVE_KEY,
    CENSUS_KEY,
    HEARD_KEY,
    HOLDS_KEY,
    WRITTEN_KEY,
    decode,
    decode_census,
    decode_heard,
    encode,
    encode_census,
    encode_heard,
    quarantine_label,
    quarantined_since,
    same_holds,
)
from agent.model import FaultClass


def hold(started: float = 100.0, expires: float = 1000.0, **kw: object) -> Hold:
    fields = {"id": "xid-13/workload/ml/Job/train", "rule_id": "xid-13", "fault_class": FaultClass.APPLICATION,
              "dimension": Dimension.WORKLOAD, "key": "ml/Job/train", "cause": "c", "nodes": frozenset({"a", "b"}),
              "started_at": started, "expires_at": expires, **kw}
    return Hold(**fields)  # type: ignore[arg-type]


def test_a_reader_places_holds_on_its_own_clock_from_when_it_saw_them():
    """Written on one machine's clocks, read on another's: only the time left carries over."""
    data = encode([hold(started=100.0, expires=1000.0)], now=400.0, wall=1.7e9, writer="c")
    [read] = decode(data, observed_at=50.0)
    assert read.expires_at == pytest.approx(50.0 + 600.0)
    assert read.started_at == pytest.approx(50.0 - 300.0)


def test_a_reader_that_sees_an_old_version_cuts_it_short_by_its_wall_clock_never_longer():
    """Written 300 s ago by the reader's wall clock: 300 s less; a reader whose wall clock is behind the
    writer's places it as if just written (skew never lengthens a hold)."""
    data = encode([hold(expires=1000.0)], now=400.0, wall=5000.0, writer="c")
    [late] = decode(data, observed_at=50.0, wall=5300.0)
    [behind] = decode(data, observed_at=50.0, wall=4000.0)
    assert late.expires_at == pytest.approx(50.0 + 300.0)
    assert behind.expires_at == pytest.approx(50.0 + 600.0)


def test_an_empty_or_absent_object_holds_nothing():
    """No ConfigMap yet, or one with no holds key: no holds."""
    assert decode(None, observed_at=1.0) == [] and decode({WRITTEN_KEY: "1.0"}, observed_at=1.0) == []


def test_a_malformed_written_stamp_is_one_input_error():
    """A broken `written` names the object instead of raising a traceback."""
    data = encode([hold()], now=1.0, wall=2.0, writer="c")
    with pytest.raises(InputError, match="written"):
        decode({**data, WRITTEN_KEY: "soon"}, observed_at=1.0, source="configmap x")
    with pytest.raises(InputError, match="JSON"):
        decode({**data, HOLDS_KEY: "{"}, observed_at=1.0, source="configmap x")


def test_same_holds_ignores_placement_jitter_but_not_a_change():
    """Re-placed times within the slack are the same holds; another node, or an expiry moved, is not."""
    assert same_holds([hold()], [hold(started=100.4, expires=1000.3)])
    assert not same_holds([hold()], [hold(expires=1100.0)])
    assert not same_holds([hold()], [hold(nodes=frozenset({"a"}))])
    assert not same_holds([hold()], [])


def test_the_controllers_word_reads_back_as_written():
    """What it heard, per rule, and its promise of the next write come back as they went out."""
    word = encode_heard({"xid-13": {"b", "a"}, "xid-119": set()}, alive_until=1.7e9 + 30)
    assert decode_heard(word) == ({"xid-13": frozenset({"a", "b"})}, pytest.approx(1.7e9 + 30))


def test_no_word_from_an_older_controller_is_no_word():
    """A holds object without the word (a controller before it, or an operator's first write): nothing heard,
    no promise, so a node waits the settle only."""
    assert decode_heard({HOLDS_KEY: "[]", WRITTEN_KEY: "1"}) == ({}, 0.0)


@pytest.mark.parametrize("data", [{HEARD_KEY: "{", ALIVE_KEY: "1"}, {HEARD_KEY: "{}", ALIVE_KEY: "soon"},
                                  {HEARD_KEY: '{"xid-13": "a"}', ALIVE_KEY: "1"}], ids=["json", "alive", "shape"])
def test_a_malformed_word_is_one_input_error(data):
    """One line naming the object, never a traceback."""
    with pytest.raises(InputError, match="configmap x"):
        decode_heard(data, source="configmap x")


def test_the_census_reads_back_as_written():
    """The selector, the count of GPU nodes and the unlabelled quarantines survive their published form."""
    census = decode_census(encode_census("nvidia.com/gpu.present=true", 1000, {"b": 1.7e9, "a": 1.7e9 - 5}))
    assert census is not None
    assert (census.selector, census.gpu_nodes, dict(census.unlabelled)) == (
        "nvidia.com/gpu.present=true", 1000, {"a": 1.7e9 - 5, "b": 1.7e9})


def test_no_census_is_none_so_the_brake_lists_the_gpu_nodes():
    """An older controller or an operator's first write: no census (the agent counts for itself)."""
    assert decode_census({HOLDS_KEY: "[]", WRITTEN_KEY: "1"}) is None


@pytest.mark.parametrize("text", ["{", "[]", '{"selector":"x","gpu_nodes":-1,"unlabelled":{}}',
                                  '{"selector":"x","gpu_nodes":true,"unlabelled":{}}',
                                  '{"selector":"x","gpu_nodes":3,"unlabelled":{"a":"soon"}}'])
def test_a_malformed_census_is_one_clear_line_naming_its_source(text):
    """A census someone broke is an InputError that names the object, never a count taken on trust."""
    with pytest.raises(InputError, match="configmap x"):
        decode_census({CENSUS_KEY: text}, source="configmap x")


def test_the_quarantine_label_is_the_whole_second_and_reads_back():
    """The label's value is a whole second (a label value), at least 1; nothing else reads as a time."""
    assert quarantine_label(1.7e9 + 0.9) == "1700000000"
    assert quarantine_label(0.4) == "1"
    assert quarantine_label(0.0) is None
    assert quarantined_since("1700000000") == 1.7e9
    assert [quarantined_since(v) for v in ("", "0", "-5", "1.5e9", None)] == [0.0] * 5
