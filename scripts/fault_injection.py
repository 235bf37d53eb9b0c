#!/usr/bin/env python3
"""Fault injection for restart safety: hundreds of trials per scenario, each killing the agent at a random
I/O point (an API request once the server answered it, a write of the durable record, a GPU reset) and
starting a new one, then a fleet of agents under a budget of 2; prints the table of issue 11. Then the
disruption budget's rows (issue 28): 503s at 10, 50 and 90 % and a 409 on every first write, a failure after
each request of the budget path (answer lost, agent killed), a fleet whose clocks are each off by up to
6 h, the same fleet under the rate bound (3 nodes an hour; issue 24), and one agent's own token turned on
another's slot and the pause Lease (real control plane).

The agents run in this process against the fake API server over HTTP (tests/restart_harness.py,
tests/budget_harness.py); a kill is a BaseException that nothing in the agent catches, so nothing after it
runs, as with SIGKILL. Retries do not sleep here (retry.WAIT off, 0.3 s deadline): "fatal step within 10 s"
counts the agent's passes (one a second) and back-offs, not the retries' jittered sleeps.
Usage: scripts/fault_injection.py [TRIALS_PER_SCENARIO] [FLEET_NODES] [FLEET_HOURS] [ROWS]
ROWS: all (default), restart (issue 11's rows) or budget (issue 28's rows).
"""

from __future__ import annotations

import logging
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from agent.k8s import retry  # noqa: E402
from agent.logs import configure_logging  # noqa: E402
from tests.budget_harness import BudgetTrial, after_each_trial, budget_requests, flaky_trial  # noqa: E402
from tests.restart_harness import SCENARIOS, FleetResult, TrialResult, fleet, kill_points, run_trial  # noqa: E402

#: The kill points of issue 11 (fault, eviction, reset, reboot request, release, clear) and the record's own
#: writes: each gets the trials, spread over the scenarios that pass it.
KILL_POINTS = ("fault", "evict", "reset_gpu", "reboot_request", "release", "untaint", "clear_reboot_request",
               "journal", "mirror", "event")

#: The rate bound of the rate row (the shipped default).
RATE = 3
COLUMNS = ("trials", "wrong evictions", "double evictions", "faults lost", "re-quarantined", "Events missing",
           "Events twice")
BUDGET_COLUMNS = ("trials", "fatal step > 10 s", "fatal step never", "wrong evictions", "double evictions",
                  "faults lost", "leaked slots", "over budget")


def main() -> None:
    trials = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    fleet_nodes = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    fleet_hours = float(sys.argv[3]) if len(sys.argv) > 3 else 10.0
    rows_wanted = sys.argv[4] if len(sys.argv) > 4 else "all"
    configure_logging("critical")
    logging.getLogger().setLevel(logging.CRITICAL)
    retry.WAIT = False
    retry.DEFAULT_DEADLINE_SECONDS = 0.3
    if rows_wanted in {"all", "restart"}:
        restart_rows(trials, fleet_nodes, fleet_hours)
    if rows_wanted in {"all", "budget"}:
        budget_rows(trials, fleet_nodes, fleet_hours)


def restart_rows(trials: int, fleet_nodes: int, fleet_hours: float) -> None:
    started = time.monotonic()
    rows: dict[str, list[TrialResult]] = defaultdict(list)
    by_point: dict[str, list[TrialResult]] = defaultdict(list)
    with tempfile.TemporaryDirectory() as scratch:
        where = Path(scratch)
        for point in KILL_POINTS:
            passing = [name for name in SCENARIOS if kill_points(name, where)[point]]
            for seed in range(trials):
                name = passing[seed % len(passing)]
                by_point[point].append(run_trial(name, seed, kill_on=point, directory=where / f"{point}-{seed}"))
            print(f"  killed at {point}: {trials} trials over {len(passing)} scenarios, "
                  f"{time.monotonic() - started:.0f}s", file=sys.stderr)
        for name in SCENARIOS:
            for seed in range(trials):
                rows[name].append(run_trial(name, seed, directory=where / f"{len(rows)}-{seed}"))
            print(f"  {name}: {trials} trials, {time.monotonic() - started:.0f}s", file=sys.stderr)
        fleet_result = fleet(1, nodes=fleet_nodes, budget=2, hours=fleet_hours, directory=where / "fleet")
    print("\nKilled at one kill point (a random occurrence of it)")
    _table(by_point)
    print("\nKilled at a random I/O point, by scenario")
    _table(rows)
    kills = Counter(r.kill_label for results in rows.values() for r in results)
    print(f"\nwhere the random kills fell: {dict(sorted(kills.items()))}")
    print(f"\nFleet: {fleet_result.nodes} agents, budget {fleet_result.budget}, {fleet_hours:g} h, "
          f"{fleet_result.kills} kills")
    print(f"  samples {fleet_result.samples}; over budget: Lease holders {fleet_result.over_budget_holders}, "
          f"nodes disrupted {fleet_result.over_budget_disrupted}")
    print(f"  evictions not on a faulty GPU {fleet_result.wrong_evictions}, double {fleet_result.double_evictions}; "
          f"nodes not yet remediated at the end {fleet_result.not_remediated}")
    print(f"  API requests per minute of a blocked node: max {fleet_result.blocked_requests_per_minute_max:.1f}, "
          f"mean {fleet_result.blocked_requests_per_minute_mean:.1f}")
    print(f"\n{time.monotonic() - started:.0f}s")


def budget_rows(trials: int, fleet_nodes: int, fleet_hours: float) -> None:
    started = time.monotonic()
    rows: dict[str, list[BudgetTrial]] = defaultdict(list)
    with tempfile.TemporaryDirectory() as scratch:
        where = Path(scratch)
        for label, options in (("503 on 10 % of requests", {"rate": 0.1}), ("503 on 50 % of requests", {"rate": 0.5}),
                               ("503 on 90 % of requests", {"rate": 0.9}), ("409 on every first write",
                                                                            {"conflicts": True})):
            for seed in range(trials):
                rows[label].append(flaky_trial(seed, directory=where / f"flaky-{len(rows)}-{seed}", **options))  # type: ignore[arg-type]
            print(f"  {label}: {trials} trials, {time.monotonic() - started:.0f}s", file=sys.stderr)
        for per_hour in (0, RATE):
            requests = budget_requests(where / f"probe-{per_hour}", per_hour)
            for killed in (False, True):
                label = f"each budget request, then {'killed' if killed else 'answer lost'}"
                label += f" (rate bound {per_hour} an hour)" if per_hour else ""
                for seed in range(trials):
                    rows[label].append(after_each_trial(seed, index=seed % requests + 1, killed=killed,
                                                        directory=where / f"after-{killed}-{per_hour}-{seed}",
                                                        per_hour=per_hour))
                print(f"  {label}: {trials} trials over {requests} requests, {time.monotonic() - started:.0f}s",
                      file=sys.stderr)
        skewed = fleet(2, nodes=fleet_nodes, budget=2, hours=fleet_hours, skew_hours=6.0, directory=where / "skew")
        rated = fleet(2, nodes=fleet_nodes, budget=2, hours=fleet_hours, skew_hours=6.0, per_hour=RATE,
                      directory=where / "rate")
    print("\nThe disruption budget (issue 28)")
    width = max(len(name) for name in rows) + 2
    print("".join([f"{'':{width}}", *(f"{c:>18}" for c in BUDGET_COLUMNS)]))
    for name, results in rows.items():
        timed = "%" in name or "409" in name
        late = sum(1 for r in results if r.fatal_step_seconds is None or r.fatal_step_seconds > 10)
        figures: list[int | str] = [
                   len(results), late if timed and "90 %" not in name else "-",
                   sum(1 for r in results if r.fatal_step_seconds is None) if timed else "-",
                   sum(r.wrong_evictions for r in results), sum(r.double_evictions for r in results),
                   sum(r.faults_lost for r in results), sum(r.leaked_slots for r in results),
                   sum(r.over_budget for r in results)]
        print("".join([f"{name:{width}}", *(f"{f:>18}" for f in figures)]))
    for name, results in rows.items():
        times = sorted(r.fatal_step_seconds for r in results if r.fatal_step_seconds is not None)
        if times:
            print(f"  {name}: fatal step after {times[len(times) // 2]:.0f} s (median), {times[-1]:.0f} s (max)")
    print(f"\nFleet, clocks each off by up to 6 h: {skewed.nodes} agents, budget {skewed.budget}, {fleet_hours:g} h, "
          f"{skewed.kills} kills")
    print(f"  samples {skewed.samples}; over budget: slots {skewed.over_budget_holders}, "
          f"nodes disrupted {skewed.over_budget_disrupted}; evictions not on a faulty GPU {skewed.wrong_evictions}, "
          f"double {skewed.double_evictions}; not remediated at the end {skewed.not_remediated}")
    rate_row(skewed, rated, fleet_hours)
    token_row(trials)
    print(f"\n{time.monotonic() - started:.0f}s")


def rate_row(unbounded: FleetResult, rated: FleetResult, fleet_hours: float) -> None:
    """The same fleet (every node faulty within 5 minutes, clocks off by up to 6 h, agents killed) without
    and with the rate bound: the most nodes first disrupted within any one hour."""
    print(f"\nRate bound (issue 24), the same fleet, {rated.nodes} agents, budget {rated.budget}, {fleet_hours:g} h:")
    for label, result in (("no rate bound", unbounded), (f"at most {rated.per_hour} an hour", rated)):
        print(f"  {label}: most nodes newly disrupted within any hour {result.most_newly_disrupted_in_an_hour}; "
              f"over the concurrency budget: slots {result.over_budget_holders}, nodes {result.over_budget_disrupted} "
              f"of {result.samples} samples; {result.kills} kills; not remediated at the end {result.not_remediated}")


def token_row(trials: int) -> None:
    """One agent's own token against another's live slot and the pause Lease, on the real control plane."""
    from tests.realcluster.controlplane import ControlPlane, ControlPlaneError  # noqa: PLC0415

    with tempfile.TemporaryDirectory() as scratch:
        plane = ControlPlane(Path(scratch))
        try:
            plane.start()
        except ControlPlaneError as exc:
            print(f"\nTokens: not run ({exc})")
            plane.stop()
            return
        try:
            tried, carried_out = _token_trials(plane, trials)
        finally:
            plane.stop()
    print(f"\nTokens (real kube-apiserver, each agent its own bound token, both directions): {trials} trials, "
          f"{tried} requests, carried out {len(carried_out)}{': ' + '; '.join(sorted(set(carried_out))) if carried_out else ''}")


def _token_trials(plane: object, trials: int) -> tuple[int, list[str]]:
    from tests.realcluster.budget_tokens import (  # noqa: PLC0415
        accepted,
        agent_budget,
        agent_raw,
        attempts,
        operator_pause_attempts,
        pause,
    )

    a, b = plane.unique("token-a"), plane.unique("token-b")  # type: ignore[attr-defined]
    plane.add_gpu_node(a)  # type: ignore[attr-defined]
    plane.add_gpu_node(b)  # type: ignore[attr-defined]
    raws = {a: agent_raw(plane, a), b: agent_raw(plane, b)}  # type: ignore[arg-type]
    gates = {n: agent_budget(plane, n, raw=raws[n]) for n in (a, b)}  # type: ignore[arg-type]
    tried, carried_out = 0, []
    for trial in range(trials):
        own, other = (a, b) if trial % 2 == 0 else (b, a)
        gates[other].acquire()
        tries = attempts(raws[own], own, other)
        tried += len(tries)
        carried_out += accepted(tries)
        gates[other].release()
    pause(plane)  # type: ignore[arg-type]
    for trial in range(trials):
        tries = operator_pause_attempts(raws[a if trial % 2 == 0 else b])
        tried += len(tries)
        carried_out += accepted(tries)
    return tried, carried_out


def _table(rows: dict[str, list[TrialResult]]) -> None:
    width = max(len(name) for name in rows) + 2
    print("".join([f"{'':{width}}", *(f"{c:>18}" for c in COLUMNS)]))
    for name, results in rows.items():
        figures = [len(results), sum(r.wrong_evictions for r in results), sum(r.double_evictions for r in results),
                   sum(r.faults_lost for r in results), sum(r.requarantined for r in results),
                   sum(r.events_missing for r in results), sum(r.events_duplicated for r in results)]
        print("".join([f"{name:{width}}", *(f"{f:>18}" for f in figures)]))


if __name__ == "__main__":
    main()
