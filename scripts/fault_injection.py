#!/usr/bin/env python3
"""Fault injection for restart safety: hundreds of trials per scenario, each killing the agent at a random
I/O point (an API request once the server answered it, a write of the durable record, a GPU reset) and
starting a new one, then a fleet of agents under a budget of 2; prints the table of issue 11.

The agents run in this process against the fake API server over HTTP (tests/restart_harness.py); a kill
is a BaseException that nothing in the agent catches, so nothing after it runs, as with SIGKILL.
Usage: scripts/fault_injection.py [TRIALS_PER_SCENARIO] [FLEET_NODES] [FLEET_HOURS]
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
from tests.restart_harness import SCENARIOS, TrialResult, fleet, kill_points, run_trial  # noqa: E402

#: The kill points of issue 11 (fault, eviction, reset, reboot request, release, clear) and the record's own
#: writes: each gets the trials, spread over the scenarios that pass it.
KILL_POINTS = ("fault", "evict", "reset_gpu", "reboot_request", "release", "untaint", "clear_reboot_request",
               "journal", "mirror", "event")

COLUMNS = ("trials", "wrong evictions", "double evictions", "faults lost", "re-quarantined", "Events missing",
           "Events twice")


def main() -> None:
    trials = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    fleet_nodes = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    fleet_hours = float(sys.argv[3]) if len(sys.argv) > 3 else 10.0
    configure_logging("critical")
    logging.getLogger().setLevel(logging.CRITICAL)
    retry.WAIT = False
    retry.DEFAULT_DEADLINE_SECONDS = 0.3
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
