"""Fault injection on the disruption budget's path: a flaky API server, a failure after each budget request,
clocks hours off, and one agent's token turned on another's slot or the pause Lease.

Built on tests/restart_harness.py's World (one node, its agent killed and started again as the trial goes);
the faults are injected in the agent's API client, so the fake server and a real one are treated alike.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.fleetapi.budget_slots import RELEASED_ANNOTATION, SLOT_LABEL, slot_name
from agent.k8s import retry
from agent.k8s.errors import status_error
from agent.simulation.fake_apiserver.resources import RESOURCES
from tests.k8s_helpers import gpu_node
from tests.restart_harness import Backend, Killed, World, check, start_backend

LEASES = next(r for r in RESOURCES if r.plural == "leases")


class RetryTime:
    """Tenacity's clock and sleep made virtual: the retries wait as in production (jittered, exponential,
    under the 5-s deadline) without the trial sleeping; `slept` is the time they would have taken."""

    def __init__(self) -> None:
        self.slept = 0.0

    def monotonic(self) -> float:
        return time.monotonic() + self.slept

    def time(self) -> float:
        return time.time() + self.slept

    def sleep(self, seconds: float) -> None:
        self.slept += seconds


@contextlib.contextmanager
def production_retries() -> Iterator[RetryTime]:
    """The agent's retry settings as deployed (waits on, 5-s deadline), on a virtual clock."""
    import tenacity
    import tenacity.nap

    clock = RetryTime()
    saved = (retry.WAIT, retry.DEFAULT_DEADLINE_SECONDS, tenacity.time, tenacity.nap.time)  # type: ignore[attr-defined]
    retry.WAIT, retry.DEFAULT_DEADLINE_SECONDS = True, 5.0
    tenacity.time = clock  # type: ignore[attr-defined]
    tenacity.nap.time = clock  # type: ignore[attr-defined]
    try:
        yield clock
    finally:
        retry.WAIT, retry.DEFAULT_DEADLINE_SECONDS, tenacity.time, tenacity.nap.time = saved  # type: ignore[attr-defined]


@dataclass
class BudgetTrial:
    """What one trial found: when the fatal step came, and whatever went wrong."""

    fatal_step_seconds: float | None
    wrong_evictions: int
    double_evictions: int
    faults_lost: int
    leaked_slots: int
    over_budget: int


def slots(backend: Backend) -> set[str]:
    """The slots held: labelled as slots and not released (a released one, kept for the rate bound's hour,
    disrupts nothing)."""
    return {lease["metadata"]["name"] for lease in backend.cluster.list_objects(LEASES, "gpu-health")
            if (lease["metadata"].get("labels") or {}).get(SLOT_LABEL) == "true"
            and RELEASED_ANNOTATION not in (lease["metadata"].get("annotations") or {})}


def _disrupted(world: World) -> bool:
    if world.agent is None:
        return False
    node = world.agent.pipeline.record.node
    active = {k for k, _ in world.agent.pipeline.record.faults}
    return bool(node.reboot_requested or any(node.evicted.get(k) for k in active))


def _leaked(world: World) -> int:
    """1 when the node's slot exists although the record does not call for it (checked between passes)."""
    return int(slot_name(world.name) in slots(world.backend) and not _disrupted(world))


def budget_request(method: str, path: str, body: bytes | None) -> bool:
    """A request of the budget path: a Lease, the count of GPU nodes, the disruption label."""
    return "/leases" in path or (method == "GET" and path.endswith("/nodes")) or \
        (method == "PATCH" and b'"gpu-health-agent.io/disruption"' in (body or b""))


def _injecting(backend: Backend, fault: Callable[[int, str, str], BaseException | None],
               after: Callable[[int, str, str, bytes | None], BaseException | None]) -> None:
    """Every agent's client: `fault` may refuse a request (or a streamed list) before it is sent, `after` fail
    it once the server carried it out (the answer lost, or the agent killed); both see the agent's number (1 =
    the first)."""
    original = backend.client
    agents = [0]

    def client(tripwire: Any) -> Any:
        agents[0] += 1
        number = agents[0]
        api = original(tripwire)
        inner = api.request

        def request(method: str, path: str, **kwargs: Any) -> bytes:
            refused = fault(number, method, path)
            if refused is not None:
                raise refused
            try:
                answer: bytes = inner(method, path, **kwargs)
            except Exception:  # the server answered with an error (a 404 the agent expects): it counts too
                failed = after(number, method, path, kwargs.get("body"))
                if failed is not None:
                    raise failed from None
                raise
            failed = after(number, method, path, kwargs.get("body"))
            if failed is not None:
                raise failed
            return answer

        def stream(path: str, **kwargs: Any) -> Any:  # a list read as it comes (the GPU-node count)
            refused = fault(number, "GET", path)
            if refused is not None:
                raise refused
            answer = inner_stream(path, **kwargs)
            failed = after(number, "GET", path, None)
            if failed is not None:
                answer.release_conn()
                raise failed
            return answer

        inner_stream = api.stream
        api.request = request
        api.stream = stream
        return api

    backend.client = client  # type: ignore[method-assign]


def _world(seed: int, backend: Backend, directory: Path, per_hour: int = 0) -> World:
    """The trial's node and first agent; every random draw of the trial (the agents' jitter included) is
    seeded from `seed`, so a trial comes out the same whatever ran before it."""
    directory.mkdir(parents=True, exist_ok=True)
    retry.JITTER.seed(seed)
    world = World(backend, gpu_node(f"b{seed % 1000}"), directory / f"journal-{seed}.db", random.Random(seed),
                  options={"seed": seed, "max_per_hour": per_hour})
    while True:
        try:
            world.start_agent(first=world.agent is None)
            return world
        except Killed as killed:
            world.kills.append(str(killed))


def _finish(world: World, fatal_at: float | None, leaks: int) -> BudgetTrial:
    result = check(world, expect_active=set())
    leaks += _leaked(world)
    try:
        return BudgetTrial(fatal_at, result.wrong_evictions, result.double_evictions, result.faults_lost, leaks,
                           int(len(slots(world.backend)) > 1))
    finally:
        if world.agent is not None:
            world.agent.close()
        world.backend.stop()


def flaky_trial(seed: int, *, rate: float = 0.0, conflicts: bool = False, directory: Path) -> BudgetTrial:
    """Xid 79 with `rate` of the agent's requests answered 503 (and/or a 409 on every first write); passes
    every second; the time from the fault to the eviction the server accepted; then a release and a clear."""
    rng = random.Random(seed)
    backend = start_backend()
    _injecting(backend, lambda n, m, p: status_error(503, "Service Unavailable", "") if rng.random() < rate else None,
               lambda n, m, p, b: None)
    backend.cluster.faults.conflict_first_write = conflicts
    world = _world(seed, backend, directory)
    gpu = world.rng.randrange(8)
    fatal_at: float | None = None
    leaks = 0
    with production_retries() as retries:
        world.step(world.kmsg_xid(gpu, 79))
        for _ in range(60):
            if any(code in {200, 201} for _, code in backend.evictions()):
                fatal_at = world.now + retries.slept  # the passes' seconds and the retries' waits
                break
            world.step(world.settle(1.0))
    rate, conflicts = 0.0, False  # the API answers again: from the next pass on no slot may be left over
    backend.cluster.faults.conflict_first_write = False
    world.step(world.settle(40.0))
    leaks += _leaked(world)
    world.step(world.operator_release())
    world.step(world.settle(40.0))
    leaks += _leaked(world)
    return _finish(world, fatal_at, leaks)


def budget_requests(directory: Path, per_hour: int = 0) -> int:
    """How many Lease requests the first agent makes in `after_each_trial`'s scenario with nothing failing."""
    backend = start_backend()
    seen = [0]

    def count(number: int, method: str, path: str, body: bytes | None) -> None:
        if number == 1 and budget_request(method, path, body):
            seen[0] += 1

    _injecting(backend, lambda n, m, p: None, count)
    world = _world(0, backend, directory, per_hour)
    _release_scenario(world)
    _finish(world, None, 0)
    return seen[0]


def _release_scenario(world: World) -> int:
    leaks = 0
    world.step(world.kmsg_xid(world.rng.randrange(8), 79))
    for _ in range(3):
        world.step(world.settle(15.0))
        leaks += _leaked(world)
    world.step(world.operator_release())
    for _ in range(3):
        world.step(world.settle(15.0))
        leaks += _leaked(world)
    return leaks


def after_each_trial(seed: int, *, index: int, killed: bool, directory: Path, per_hour: int = 0) -> BudgetTrial:
    """Xid 79, eviction, reboot request, release, clear; the `index`-th Lease request of the first agent is
    carried out by the server and then fails: its answer lost (a 503 after the fact), or the agent killed."""
    backend = start_backend()
    seen = [0]

    def fail(number: int, method: str, path: str, body: bytes | None) -> BaseException | None:
        if number != 1 or not budget_request(method, path, body):
            return None
        seen[0] += 1
        if seen[0] != index:
            return None
        return Killed(f"lease {method}") if killed else status_error(503, "Service Unavailable", "")

    _injecting(backend, lambda n, m, p: None, fail)
    world = _world(seed, backend, directory, per_hour)
    leaks = _release_scenario(world)
    return _finish(world, None, leaks)
