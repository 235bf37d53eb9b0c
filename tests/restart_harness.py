"""Fault injection for restart safety: agents killed at any I/O point of a remediation and started again.

A trial runs a scenario (a fault, its remediation, a release or a reset...) against one backend. Each
agent counts its I/O (every API request once the server answered, every journal write of the record,
every GPU reset) and is killed at the Nth: `Killed` is a BaseException, so nothing in the agent catches
it, and nothing after that point runs, as with SIGKILL. The next agent starts like the daemon does: a
fresh memory, the same journal file, the Node read first, the GPUs learnt again from NVML, the kernel
log replayed from the acknowledged cursor. At the end the trial checks the cluster: pods evicted that
were not on a faulty GPU, double evictions, faults lost, a released node quarantined again, owed Events.

`start_backend()` is the one place that knows the API server; it returns the fake today, and can return
the real control plane (same methods) once the suite has one.
"""

from __future__ import annotations

import random
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from agent.cluster_side import request_release
from agent.engine import RuleSet
from agent.fleetapi.budget import LeaseBudget
from agent.k8s.client import client_for
from agent.k8s.raw import RawApi
from agent.model import GpuRef, NodeInventory, Observation, Signal, frozen_attrs
from agent.simulation.fake_apiserver import FakeApiServer, FakeCluster
from tests.k8s_helpers import RULES, TAINT, Agent, gpu_node, make_agent


class Killed(BaseException):
    """The agent process dies here (SIGKILL): nothing after this point runs."""


@dataclass
class Tripwire:
    """Counts an agent's I/O by kill point and kills it at the `kill_at`-th I/O (of kind `kill_on`, if set).

    The kill point is the remediation step in progress (evict, reset_gpu, reboot_request, untaint...),
    "fault" while an observation is classified and recorded, "release" while a release is consumed, else
    the kind of I/O (read, lease, event, journal)."""

    kill_at: int | None = None
    kill_on: str = ""
    count: int = 0
    requests: int = 0
    context: str = ""
    points: Counter[str] = field(default_factory=Counter)

    def hit(self, label: str) -> None:
        point = self.context or label
        self.points[point] += 1
        self.count += 1
        counted = self.points[point] if self.kill_on else self.count
        if self.kill_at is not None and (not self.kill_on or point == self.kill_on) and counted == self.kill_at:
            raise Killed(point)

    def within(self, context: str, func: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            outer, self.context = self.context, context
            try:
                return func(*args, **kwargs)
            finally:
                self.context = outer
        return run


class _Labelled:
    """The agent's actuator, naming the kill point after the step in progress."""

    def __init__(self, actuator: Any, tripwire: Tripwire) -> None:
        self.actuator = actuator
        self.tripwire = tripwire

    def apply(self, step: Any) -> Any:
        return self.tripwire.within(str(step.kind), self.actuator.apply)(step)

    def observe(self, devices: bool = True) -> Any:
        return self.actuator.observe()

    def mirror(self, document: Any) -> None:
        self.tripwire.within("mirror", self.actuator.mirror)(document)

    def consume_release(self, value: str) -> None:
        self.tripwire.within("release", self.actuator.consume_release)(value)

    def consume_confirm(self, value: str) -> None:
        self.tripwire.within("confirm", self.actuator.consume_confirm)(value)

    def begin_batch(self) -> None:
        self.actuator.begin_batch()

    def write_node(self) -> str:
        return str(self.tripwire.within("node", self.actuator.write_node)())


def _label(method: str, path: str) -> str:
    if path.endswith("/eviction"):
        return "eviction"
    if "/events" in path:
        return "event"
    if "/leases/" in path or path.endswith("/leases"):
        return "lease"
    if method != "GET" and "/nodes/" in path:
        return "node write"
    return "read"


class Backend:
    """The API server a trial runs against, with what the checks need to read of it."""

    def __init__(self) -> None:
        # The cluster's clock follows the trial's virtual time, so an evicted pod stops Terminating (and
        # frees its GPU for a reset) once its grace period has passed there, as a kubelet would end it.
        self._base = time.time()
        self.elapsed = 0.0
        self.cluster = FakeCluster(clock=lambda: self._base + self.elapsed)
        self.server = FakeApiServer(self.cluster).start()

    def advance_to(self, elapsed: float) -> None:
        """The trial's time reached `elapsed` seconds: the kubelet ends pods whose grace period passed."""
        if elapsed > self.elapsed:
            self.elapsed = elapsed
            self.cluster.finish_terminations()

    def client(self, tripwire: Tripwire) -> Any:
        """An API client whose every request counts on the tripwire once the server answered it."""
        api = client_for(self.server.url)
        original = api.request

        def request(method: str, path: str, **kwargs: Any) -> bytes:
            tripwire.requests += 1
            try:
                return original(method, path, **kwargs)
            finally:
                tripwire.hit(_label(method, path))

        api.request = request  # type: ignore[method-assign]
        return api

    def evictions(self) -> list[tuple[str, int]]:
        """(pod name, HTTP status) of every eviction request the server answered."""
        return [(path.split("/")[-2], code) for method, path, code in self.cluster.log
                if method == "POST" and path.endswith("/eviction")]

    def node(self, name: str) -> dict[str, Any]:
        return self.cluster.node(name)

    def events(self) -> list[dict[str, Any]]:
        return self.cluster.events()

    def release(self, node: str) -> None:
        request_release(client_for(self.server.url), node, "all")

    def stop(self) -> None:
        self.server.stop()


def start_backend() -> Backend:
    """The one helper that picks the API server for the suite (the fake, until the real one is wired)."""
    return Backend()


@dataclass
class World:
    """One node, its agent (killed and restarted as the trial goes), its kernel log and its GPUs."""

    backend: Backend
    inventory: NodeInventory
    journal: Path
    rng: random.Random
    kill_at: int | None = None
    rules: RuleSet = RULES
    agent: Agent | None = None
    tripwire: Tripwire = field(default_factory=Tripwire)
    ring: list[tuple[int, Observation]] = field(default_factory=list)
    boot_id: str = "boot-1"
    lost: set[int] = field(default_factory=set)
    faulty: set[int] = field(default_factory=set)
    expect_clean: bool = False
    restarts: int = 0
    first_points: Counter[str] = field(default_factory=Counter)
    kills: list[str] = field(default_factory=list)
    now: float = 0.0
    resets: Counter[str] = field(default_factory=Counter)
    options: dict[str, Any] = field(default_factory=dict)
    #: How far this machine's clocks are off (the budget's stamps and its monotonic base).
    skew: float = 0.0

    @property
    def name(self) -> str:
        return self.inventory.name

    def start_agent(self, *, first: bool = False, kill_at: int | None = None, kill_on: str = "") -> None:
        """Start an agent as the daemon does: the Node first, then NVML's GPUs, then the kernel log."""
        self.tripwire = Tripwire(kill_at, kill_on)
        known = self.inventory if first else NodeInventory(self.name, (), self.inventory.pods)

        def reset(uuid: str) -> tuple[bool, str]:
            self.resets[uuid] += 1
            self.tripwire.hit("reset")
            return True, "fake reset"

        self.agent = make_agent(self.backend.cluster, self.backend.server, known, populate_node=first,
                                restore=not first, journal=self.journal, reset=reset, clock=lambda: self.now,
                                budget_clock=lambda: self.now + self.skew,
                                api_client=self.backend.client(self.tripwire),
                                **self.options)
        original = self.agent.pipeline.journal.save_record if self.agent.pipeline.journal else None
        if original is not None and self.agent.pipeline.journal is not None:
            def save_record(*args: Any, **kwargs: Any) -> None:
                original(*args, **kwargs)
                self.tripwire.hit("journal")

            self.agent.pipeline.journal.save_record = save_record  # type: ignore[method-assign]
        self.agent.pipeline.actuator = _Labelled(self.agent.actuator, self.tripwire)
        self.deliver(Observation(Signal.BOOT, 0, self.now, "kmsg", None, frozen_attrs({"boot_id": self.boot_id})))
        for gpu in self.inventory.gpus:
            assert gpu.index is not None
            if gpu.index in self.lost:
                self.deliver(Observation(Signal.GPU_LOST, 1, self.now, "nvml", GpuRef(index=gpu.index)))
            else:
                self.deliver(Observation(Signal.TEMPERATURE, 40, self.now, "nvml", gpu))
        acked = self.agent.pipeline.record.cursors.get("kmsg", "")
        boot, _, seq = acked.rpartition(":")
        after = int(seq) if boot == self.boot_id and seq.isdigit() else 0
        for number, observation in self.ring:
            if number > after:
                self.deliver(observation)

    def deliver(self, observation: Observation) -> None:
        assert self.agent is not None
        self.tripwire.within("fault" if observation.signal is Signal.XID else "",
                             self.agent.pipeline.handle)(observation, self.now)

    def step(self, action: Callable[[World], None]) -> None:
        """Run one scenario step; a kill restarts the agent (the step's input is replayed by its source)."""
        try:
            action(self)
        except Killed as killed:
            self.kills.append(str(killed))
            self.restart(killed=True)

    def restart(self, *, killed: bool = False) -> None:
        """A new agent process; a killed one wrote nothing more (its committed journal writes stay)."""
        if self.agent is not None:
            self.agent.close()
        if self.restarts == 0:
            self.first_points = Counter(self.tripwire.points)
        self.restarts += 1
        while True:
            try:
                self.start_agent()
                return
            except Killed:  # only the first agent carries a kill point
                continue

    # ---- scenario steps ----
    def kmsg_xid(self, gpu: int, xid: int) -> Callable[[World], None]:
        def run(world: World) -> None:
            number = len(world.ring) + 1
            observation = Observation(Signal.XID, xid, world.now, "kmsg", world.inventory.gpus[gpu],
                                      frozen_attrs({"kmsg_seq": number}))
            world.ring.append((number, observation))
            world.faulty.add(gpu)
            if xid == 79:
                world.lost.add(gpu)
            world.deliver(observation)
        return run

    def settle(self, seconds: float) -> Callable[[World], None]:
        def run(world: World) -> None:
            world.now += seconds
            world.backend.advance_to(world.now)
            assert world.agent is not None
            world.agent.pipeline.tick(world.now)
        return run

    def operator_release(self) -> Callable[[World], None]:
        def run(world: World) -> None:
            world.backend.release(world.name)
            world.lost.clear()
            world.expect_clean = True
        return run


@dataclass
class TrialResult:
    scenario: str
    kill_label: str
    restarts: int
    wrong_evictions: int
    double_evictions: int
    faults_lost: int
    requarantined: int
    events_missing: int
    events_duplicated: int


def check(world: World, *, expect_active: set[int]) -> TrialResult:
    """Settle, restart once more (a clean node must stay clean), and read the verdict off the cluster."""
    for _ in range(4):
        world.step(world.settle(40.0))
    world.kill_at = None
    world.restart()
    for _ in range(3):
        world.step(world.settle(40.0))
    backend, name = world.backend, world.name
    pod_gpu = {p.name: world.inventory.gpus.index(next(g for g in world.inventory.gpus if g.uuid in p.gpu_uuids))
               for p in world.inventory.pods if p.gpu_uuids}
    accepted = [pod for pod, code in backend.evictions() if code in {200, 201}]
    attempts = Counter(pod for pod, code in backend.evictions() if code != 429)
    wrong = sum(1 for pod in accepted if pod_gpu.get(pod) not in world.faulty)
    double = sum(n - 1 for n in attempts.values() if n > 1)
    node = backend.node(name)
    tainted = TAINT in {t["key"] for t in node["spec"].get("taints") or []}
    fatal = any(c["type"] == "GpuFatalFault" and c["status"] == "True" for c in node["status"]["conditions"])
    assert world.agent is not None
    statuses = world.agent.pipeline.gpu_statuses()
    lost = sum(1 for g in expect_active if statuses.get(world.inventory.gpus[g].key) != "fatal")
    lost += 1 if expect_active and not tainted else 0
    requarantined = int(world.expect_clean and not expect_active and (tainted or fatal))
    events = backend.events()
    reasons = Counter(e["reason"] for e in events)
    evicted_events = Counter(e["regarding"]["name"] for e in events if e["reason"] == "EvictedForGpuFault")
    missing = len(world.agent.pipeline.record.owed)
    missing += sum(1 for pod in set(accepted) if evicted_events[pod] == 0)
    missing += 0 if reasons["GpuFatalFault"] else 1
    duplicated = sum(n - 1 for n in evicted_events.values() if n > 1)
    return TrialResult("", world.kills[0] if world.kills else "none", world.restarts, wrong, double, lost,
                       requarantined, missing, duplicated)


def new_world(seed: int, *, kill_at: int | None, directory: Path, kill_on: str = "", **options: Any) -> World:
    rng = random.Random(seed)
    backend = start_backend()
    directory.mkdir(parents=True, exist_ok=True)
    world = World(backend, gpu_node(f"n{seed % 1000}"), directory / f"journal-{seed}.db", rng, kill_at,
                  options=options)
    try:
        world.start_agent(first=True, kill_at=kill_at, kill_on=kill_on)
    except Killed as killed:
        world.kills.append(str(killed))
        world.restart(killed=True)
    return world


# ---- scenarios: each returns the world and which GPUs must still be faulty at the end ----
def xid79_then_release(world: World) -> set[int]:
    """Fatal fault: condition, taint, evict the GPU's pod, reboot request; an operator releases; clear."""
    gpu = world.rng.randrange(8)
    world.step(world.kmsg_xid(gpu, 79))
    world.step(world.settle(40.0))
    world.step(world.operator_release())
    world.step(world.settle(40.0))
    return set()


def xid48_reset(world: World) -> set[int]:
    """Reset ladder: evict the GPU's pod, wait until it is gone, reset, the verified reset clears it."""
    gpu = world.rng.randrange(8)
    world.step(world.kmsg_xid(gpu, 48))
    world.step(world.settle(15.0))
    world.step(world.settle(40.0))
    return set()


def second_fault_during_first(world: World) -> set[int]:
    """Xid 79 on one GPU, Xid 48 on another while the first is remediated: both pods move, only them."""
    first, second = world.rng.sample(range(8), 2)
    world.step(world.kmsg_xid(first, 79))
    world.step(world.settle(1.0))
    world.step(world.kmsg_xid(second, 48))
    world.step(world.settle(40.0))
    return {first}


def graceful_restart_mid_ladder(world: World) -> set[int]:
    """A rolling upgrade mid-remediation: the agent stops cleanly between two steps."""
    gpu = world.rng.randrange(8)
    world.step(world.kmsg_xid(gpu, 79))
    world.restart()
    world.step(world.settle(40.0))
    world.restart()
    world.step(world.operator_release())
    world.step(world.settle(40.0))
    return set()


def damaged_journal(world: World) -> set[int]:
    """The journal is damaged (garbage, truncated, emptied, missing) while a fault is active."""
    gpu = world.rng.randrange(8)
    world.step(world.kmsg_xid(gpu, 79))
    world.step(world.settle(40.0))
    _damage_journal(world)
    world.step(world.settle(40.0))
    return {gpu}


def journal_lost_after_release(world: World) -> set[int]:
    """Released, then the journal is lost: the next agent rebuilds from the Node and stays released."""
    xid79_then_release(world)
    _damage_journal(world)
    world.step(world.settle(40.0))
    return set()


def _damage_journal(world: World) -> None:
    if world.agent is not None:
        world.agent.close()
    kind = world.rng.choice(["garbage", "truncated", "empty", "missing"])
    data = world.journal.read_bytes() if world.journal.exists() else b""
    for leftover in world.journal.parent.glob(world.journal.name + "-*"):
        leftover.unlink()
    if kind == "missing":
        world.journal.unlink(missing_ok=True)
    else:
        world.journal.write_bytes({"garbage": b"\x00garbage" * 64, "truncated": data[:len(data) // 3],
                                   "empty": b""}[kind])
    world.agent = None
    world.restart(killed=True)


def rules_reload_renames(world: World) -> set[int]:
    """A rules reload renames the active fault's rule; the operator's release still clears it."""
    gpu = world.rng.randrange(8)
    world.step(world.kmsg_xid(gpu, 79))
    world.step(world.settle(40.0))
    renamed = RuleSet(rules=tuple(msgspec.structs.replace(r, id="xid-79-v2") if r.id == "xid-79" else r
                                  for r in RULES.rules))
    world.rules = renamed

    def reload(w: World) -> None:
        assert w.agent is not None
        w.agent.pipeline.replace_rules(renamed)

    world.step(reload)
    world.step(world.operator_release())
    world.step(reload)  # an agent restarted meanwhile reads the renamed rules too
    world.step(world.settle(40.0))
    return set()


def api_trouble(world: World) -> set[int]:
    """5xx, 409 on every first write, latency and an outage around a fatal fault and its release."""
    cluster = world.backend.cluster
    gpu = world.rng.randrange(8)
    cluster.faults.fail_next_writes = [500, 503] * world.rng.randrange(1, 4)
    cluster.faults.conflict_first_write = world.rng.random() < 0.5
    world.step(world.kmsg_xid(gpu, 79))
    cluster.faults.down = True
    world.step(world.settle(40.0))
    cluster.faults.down = False
    cluster.faults.latency_seconds = 0.01
    world.step(world.settle(40.0))
    cluster.faults.latency_seconds = 0.0
    world.step(world.operator_release())
    world.step(world.settle(40.0))
    cluster.faults.conflict_first_write = False
    return set()


SCENARIOS: dict[str, Callable[[World], set[int]]] = {
    "fault, evict, reboot request, release, clear": xid79_then_release,
    "fault, evict, reset, clear": xid48_reset,
    "second fault during the first": second_fault_during_first,
    "graceful restarts mid-ladder": graceful_restart_mid_ladder,
    "damaged or missing journal": damaged_journal,
    "journal lost after a release": journal_lost_after_release,
    "rules reload renaming the rule": rules_reload_renames,
    "API 5xx, 409, latency, outage": api_trouble,
}


def io_points(scenario: Callable[[World], set[int]], seed: int, directory: Path) -> Counter[str]:
    """The I/O points the scenario's first agent passes when nothing kills it, by kill point."""
    world = new_world(seed, kill_at=None, directory=directory)
    try:
        scenario(world)
        return world.first_points if world.restarts else Counter(world.tripwire.points)
    finally:
        if world.agent is not None:
            world.agent.close()
        world.backend.stop()


_POINTS: dict[str, Counter[str]] = {}


def kill_points(name: str, directory: Path) -> Counter[str]:
    """The kill points a scenario passes, with how often (probed once, without a kill)."""
    if name not in _POINTS:
        _POINTS[name] = io_points(SCENARIOS[name], 0, directory / f"probe-{len(_POINTS)}")
    return _POINTS[name]


def run_trial(name: str, seed: int, *, kill_on: str = "", directory: Path | None = None) -> TrialResult:
    """One trial: the scenario with the first agent killed at a random I/O point (seeded), or at a random
    occurrence of one kill point."""
    scenario = SCENARIOS[name]
    with tempfile.TemporaryDirectory() as scratch:
        where = directory or Path(scratch)
        points = kill_points(name, where)
        total = points[kill_on] if kill_on else sum(points.values())
        kill_at = random.Random(seed).randrange(1, max(1, total) + 1)
        world = new_world(seed, kill_at=kill_at, kill_on=kill_on, directory=where)
        try:
            expect = scenario(world)
            result = check(world, expect_active=expect)
        finally:
            if world.agent is not None:
                world.agent.close()
            world.backend.stop()
    result.scenario = name
    return result


@dataclass
class FleetResult:
    nodes: int
    budget: int
    samples: int
    over_budget_holders: int
    over_budget_disrupted: int
    wrong_evictions: int
    double_evictions: int
    kills: int
    not_remediated: int
    blocked_requests_per_minute_max: float
    blocked_requests_per_minute_mean: float
    #: The most nodes first disrupted (reboot requested) within any one hour of the run, and the rate bound.
    most_newly_disrupted_in_an_hour: int = 0
    per_hour: int = 0


def fleet(seed: int, *, nodes: int = 20, budget: int = 2, hours: float = 4.0, step: float = 15.0,
          kill_rate: float = 0.01, skew_hours: float = 0.0, per_hour: int = 0, directory: Path) -> FleetResult:
    """Every node of a fleet gets a fatal fault at once; a budget of 2 lets two at a time evict and ask for a
    reboot; reboots come 30 to 180 minutes later (slots outlive their 2 h lifetime unless renewed); agents
    are killed at random I/O points and started again; each agent's clocks are off by up to `skew_hours`
    either way (its own, drawn at random); `per_hour` is the budget's rate bound (0: none). Samples the slots
    and the Nodes at every step."""
    rng = random.Random(seed)
    backend = start_backend()
    directory.mkdir(parents=True, exist_ok=True)
    worlds = []
    try:
        for index in range(nodes):
            world = World(backend, gpu_node(f"f{seed}-{index}"), directory / f"fleet-{seed}-{index}.db",
                          random.Random(seed * 1000 + index), options={"max_nodes": budget, "max_percent": 0,
                                                                       "max_per_hour": per_hour},
                          skew=random.Random(seed * 7919 + index).uniform(-skew_hours, skew_hours) * 3600.0)
            world.start_agent(first=True)
            worlds.append(world)
        observer = LeaseBudget(RawApi(client_for(backend.server.url)), node_name="observer", namespace="gpu-health",
                               max_nodes=budget, max_percent=0, clock=lambda: now,
                               monotonic=lambda: now)
        reboot_at: dict[str, float] = {}
        faulty_at = {w.name: rng.uniform(0, 300) for w in worlds}
        samples = over_holders = over_disrupted = kills = 0
        per_minute: list[float] = []
        window: dict[str, list[int]] = {w.name: [] for w in worlds}
        first_disrupted: dict[str, float] = {}
        now = 0.0
        while now < hours * 3600:
            now += step
            backend.advance_to(now)
            for world in worlds:
                world.now = now
                if world.name in faulty_at and faulty_at[world.name] <= now:
                    del faulty_at[world.name]
                    world.step(world.kmsg_xid(rng.randrange(8), 79))
                if world.name in reboot_at and reboot_at[world.name] <= now:
                    del reboot_at[world.name]
                    _reboot(world)
                if rng.random() < kill_rate:
                    world.tripwire.kill_at = world.tripwire.count + rng.randrange(1, 8)
                blocked = _blocked(world)
                before = world.tripwire.requests
                world.step(world.settle(0.0))
                spent = window[world.name]
                if blocked and _blocked(world):
                    spent.append(max(0, world.tripwire.requests - before))
                    if len(spent) * step >= 60.0:
                        per_minute.append(sum(spent) * 60.0 / (len(spent) * step))
                        spent.clear()
                else:
                    spent.clear()
                requested = "gpu-health-agent.io/reboot-requested" in (backend.node(world.name)["metadata"]
                                                                        .get("annotations") or {})
                if requested and world.name not in reboot_at and not world.expect_clean:
                    # Most nodes reboot within minutes; some only after the slot's 2 h lifetime.
                    long = rng.random() < 0.2
                    reboot_at[world.name] = now + (rng.uniform(7800, 10800) if long else rng.uniform(300, 1200))
            kills = sum(len(w.kills) for w in worlds)
            samples += 1
            holders = len(observer.holders())
            requested = {w.name for w in worlds if "gpu-health-agent.io/reboot-requested" in
                         (backend.node(w.name)["metadata"].get("annotations") or {})}
            disrupted = len(requested)
            for name in requested:
                first_disrupted.setdefault(name, now)
            over_holders += holders > budget
            over_disrupted += disrupted > budget
        accepted = [pod for pod, code in backend.evictions() if code in {200, 201}]
        attempts = Counter(pod for pod, code in backend.evictions() if code != 429)
        on_faulty = set()
        for world in worlds:
            for gpu in world.faulty:
                on_faulty |= {p.name for p in world.inventory.pods if world.inventory.gpus[gpu].uuid in p.gpu_uuids}
        not_remediated = sum(1 for w in worlds if w.faulty and not w.expect_clean)
        return FleetResult(nodes, budget, samples, over_holders, over_disrupted,
                           sum(1 for pod in accepted if pod not in on_faulty),
                           sum(n - 1 for n in attempts.values() if n > 1), kills, not_remediated,
                           max(per_minute, default=0.0), sum(per_minute) / len(per_minute) if per_minute else 0.0,
                           most_within(sorted(first_disrupted.values()), 3600.0), per_hour)
    finally:
        for world in worlds:
            if world.agent is not None:
                world.agent.close()
        backend.stop()


def most_within(times: list[float], window: float) -> int:
    """The most of the sorted `times` that fall within any one `window` (a sliding window)."""
    most = start = 0
    for end, at in enumerate(times):
        while at - times[start] >= window:
            start += 1
        most = max(most, end - start + 1)
    return most


def _blocked(world: World) -> bool:
    """A faulty node that could not yet evict or ask for its reboot (the budget is spent)."""
    if world.agent is None or not world.agent.pipeline.record.faults:
        return False
    return not world.agent.pipeline.record.node.reboot_requested


def _reboot(world: World) -> None:
    """The node reboots: a new boot id, an empty ring buffer, the GPUs back, a new agent process."""
    world.boot_id = f"boot-{world.rng.randrange(10**9)}"
    world.ring.clear()
    world.lost.clear()
    world.expect_clean = True
    world.restart()
