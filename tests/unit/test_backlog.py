"""The backlog between sources and engine: FIFO while it keeps up, repeats folded in a storm, no new kind lost."""

import threading

from agent.model import GpuRef, Signal
from agent.sources.backlog import Backlog
from tests.conftest import obs


def drain(backlog: Backlog):
    out = []
    while (item := backlog.get(timeout=0)) is not None:
        out.append(item)
    return out


def on(n: int) -> GpuRef:
    return GpuRef(index=n, uuid=f"GPU-{n}")


def test_below_the_high_water_mark_every_observation_passes_unchanged_in_order():
    backlog = Backlog(capacity=10)
    sent = [obs(Signal.XID, 31, float(n), pid=n) for n in range(5)]
    for o in sent:
        backlog.put(o)
    assert drain(backlog) == sent
    assert backlog.coalesced_total == 0


def test_in_a_storm_repeats_of_a_waiting_kind_are_folded_into_its_count():
    backlog = Backlog(capacity=4)
    for n in range(1000):
        backlog.put(obs(Signal.XID, 31, float(n), count=2))
    received = drain(backlog)
    assert len(received) == 2
    assert sum(o.count for o in received) == 2000
    assert received[0].at == 0.0
    assert backlog.coalesced_total == 998


def test_a_new_kind_is_admitted_past_the_capacity():
    backlog = Backlog(capacity=4)
    for n in range(100):
        backlog.put(obs(Signal.XID, 31, float(n)))
    kinds = [obs(Signal.XID, code, 200.0, gpu_ref=on(n)) for n, code in enumerate((79, 48, 94, 95, 63, 64))]
    assert all(backlog.put(o) for o in kinds)
    received = drain(backlog)
    assert [o.value for o in received if o.value != 31] == [79, 48, 94, 95, 63, 64]
    assert backlog.dropped_total == 0


def test_only_beyond_twice_the_capacity_of_distinct_kinds_is_one_refused():
    backlog = Backlog(capacity=4)
    accepted = [backlog.put(obs(Signal.XID, code, 0.0)) for code in range(9)]
    assert accepted == [True] * 8 + [False]
    assert (backlog.depth, backlog.dropped_total) == (8, 1)


def test_the_same_code_on_another_gpu_is_another_kind():
    backlog = Backlog(capacity=2, high_water=0)
    backlog.put(obs(Signal.XID, 79, 0.0, gpu_ref=on(0)))
    backlog.put(obs(Signal.XID, 79, 0.0, gpu_ref=on(1)))
    assert backlog.depth == 2


def test_lifecycle_facts_are_never_folded():
    backlog = Backlog(capacity=2, high_water=0)
    for n in range(3):
        backlog.put(obs(Signal.BOOT, 0, float(n), boot_id=f"b{n}"))
    assert [o.attrs["boot_id"] for o in drain(backlog)] == ["b0", "b1", "b2"]


def test_a_waiting_level_reading_is_replaced_by_the_newer_one():
    backlog = Backlog(capacity=4, high_water=0)
    backlog.put(obs(Signal.TEMPERATURE, 80, 0.0))
    backlog.put(obs(Signal.TEMPERATURE, 95, 1.0))
    [reading] = drain(backlog)
    assert (reading.value, reading.at, reading.count) == (95, 1.0, 1)


def test_a_taken_kind_starts_a_new_entry():
    backlog = Backlog(capacity=4, high_water=0)
    backlog.put(obs(Signal.XID, 31, 0.0))
    backlog.get(timeout=0)
    backlog.put(obs(Signal.XID, 31, 1.0))
    assert [o.at for o in drain(backlog)] == [1.0]


def test_get_returns_none_when_nothing_comes_in_time():
    assert Backlog(capacity=4).get(timeout=0.01) is None


def test_get_waits_for_a_put_from_another_thread():
    backlog = Backlog(capacity=4)
    thread = threading.Thread(target=backlog.put, args=(obs(Signal.XID, 79, 0.0),))
    thread.start()
    assert backlog.get(timeout=30).value == 79
    thread.join()


def test_concurrent_producers_lose_no_occurrence():
    backlog = Backlog(capacity=8)
    threads = [threading.Thread(target=lambda: [backlog.put(obs(Signal.XID, 31, 0.0)) for _ in range(5000)])
               for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sum(o.count for o in drain(backlog)) == 20_000


def test_the_backlog_is_exported_as_metrics_read_at_scrape_time():
    from prometheus_client import CollectorRegistry

    from agent.metrics import Metrics

    backlog = Backlog(capacity=4, high_water=0)
    metrics = Metrics(CollectorRegistry())
    metrics.watch_backlog(backlog)
    for n in range(3):
        backlog.put(obs(Signal.XID, 31, float(n)))
    text = metrics.exposition().decode()
    assert "gpu_health_backlog_depth 1.0" in text
    assert "gpu_health_backlog_coalesced_total 2.0" in text
    assert "gpu_health_backlog_dropped_total 0.0" in text


def test_get_many_takes_the_oldest_in_order_at_most_the_limit_each_with_its_folded_count():
    """One lock for a run of observations: the same ones, in the same order and counts, as one get at a time."""
    backlog = Backlog(capacity=4)
    for n in range(1000):  # two waiting before the high-water mark, then repeats folded into the second
        backlog.put(obs(Signal.XID, 31, float(n)))
    backlog.put(obs(Signal.XID, 79, 2000.0, gpu_ref=on(5)))
    first = backlog.get_many(2, timeout=0)
    assert [(o.value, o.at, o.count) for o in first] == [(31, 0.0, 1), (31, 1.0, 999)]
    assert [(o.value, o.count) for o in backlog.get_many(10, timeout=0)] == [(79, 1)]
    assert backlog.depth == 0


def test_get_many_gives_nothing_when_nothing_came_in_time():
    """An empty backlog waits at most the timeout, then gives an empty run."""
    assert Backlog(capacity=4).get_many(10, timeout=0.01) == []


def test_a_repeat_of_a_kind_taken_by_get_many_is_queued_anew_not_lost():
    """A kind taken out can no longer fold: its next repeat, past the high-water mark, waits as a new entry
    instead of vanishing into the one already handed to the engine."""
    backlog = Backlog(capacity=2)  # high-water mark 1
    backlog.put(obs(Signal.XID, 31, 0.0))
    backlog.put(obs(Signal.XID, 79, 1.0, gpu_ref=on(5)))
    assert len(backlog.get_many(10, timeout=0)) == 2
    backlog.put(obs(Signal.XID, 48, 2.0, gpu_ref=on(6)))  # the backlog at its high-water mark again
    backlog.put(obs(Signal.XID, 79, 3.0, gpu_ref=on(5), count=3))
    assert [(o.value, o.count) for o in drain(backlog)] == [(48, 1), (79, 3)]
