"""Fault scenarios: a node and a timeline of observations on a virtual clock, for demos, tests and replay."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import yaml
from msgspec import Meta

from agent.errors import ScenarioError
from agent.model import AttrValue, GpuRef, NodeInventory, Observation, PodRef, Signal, frozen_attrs
from agent.sources.base import Emit
from agent.strict import RecordInvalid, Strict, convert
from agent.yamlload import safe_load

DEFAULT_MODEL = "NVIDIA H100 80GB HBM3"
HGX_PCI_BUSES = ("18", "2a", "3a", "5d", "9a", "ab", "ba", "db")


NonEmpty = Annotated[str, Meta(min_length=1)]
Index = Annotated[int, Meta(ge=0)]
NonNegative = Annotated[float, Meta(ge=0)]


class ScenarioGpu(Strict, frozen=True, kw_only=True):
    index: Index
    uuid: NonEmpty
    pci_bus_id: NonEmpty
    model: str = DEFAULT_MODEL


class ScenarioPod(Strict, frozen=True, kw_only=True):
    namespace: str = "default"
    name: NonEmpty
    uid: str = ""
    gpus: list[int] = msgspec.field(default_factory=list)
    daemonset: bool = False


class ScenarioHostHolder(Strict, frozen=True, kw_only=True):
    """A host process holding one GPU open that the reset procedure cannot stop (nv-hostengine, a host
    dcgm-exporter), until a virtual time (absent: for ever). Only on a `gpu_operator` node."""

    gpu: Index
    name: NonEmpty
    until: NonNegative | None = None


class ScenarioNode(Strict, frozen=True, kw_only=True):
    name: str = "gpu-node-1"
    gpus: int | list[ScenarioGpu] = 8
    model: str = DEFAULT_MODEL
    pods: Literal["one-per-gpu"] | list[ScenarioPod] = "one-per-gpu"
    #: The GPUs are published in ResourceSlices (NVIDIA's DRA driver) and pods hold them through claims:
    #: `simulate` isolates a faulty GPU by DeviceTaintRule instead of tainting the node.
    dra: bool = False
    #: The node runs the GPU Operator's operands (device plugin, GFD, DCGM, dcgm-exporter; with `dra`, the
    #: Operator's DRA mode: the DRA driver's kubelet plugin in the device plugin's place), which hold every GPU
    #: open until a reset pauses them (simulate in a fake cluster: agent/simulation/gpu_operator.py).
    gpu_operator: bool = False
    #: On a `gpu_operator` node: persistence mode is on for every GPU (nvidia-persistenced in the driver pod),
    #: which nvidia-smi refuses a reset for until the procedure turns it off.
    persistence_mode: bool = False
    #: On a `gpu_operator` node: host processes holding a GPU that no operand label stops.
    host_holders: list[ScenarioHostHolder] = msgspec.field(default_factory=list)
    #: A diagnostic is configured on the node (remediation.diagnostic_command): the repeat patterns of
    #: application Xids quarantine and wait for it; a `diagnostic` timeline step gives its result.
    diagnostic: bool = False


class ScenarioFleet(Strict, frozen=True, kw_only=True):
    """Several nodes like `node`, each with its own agent, and the fleet controller (docs/scenarios.md)."""

    nodes: Annotated[int, Meta(ge=2, le=500)]
    #: Node names: the prefix and the node's number from 0.
    prefix: NonEmpty = "gpu-"
    #: The owner of every node's `one-per-gpu` pods (`namespace/Kind/name`): one job spanning the fleet.
    workload: str = ""
    #: Consecutive nodes per rack (the controller's rack label), per NVLink fabric domain; 0: none.
    rack_size: Index = 0
    fabric_domain_size: Index = 0
    #: The NVIDIA driver of each node, in turn.
    driver_versions: Annotated[list[str], Meta(min_length=1)] = msgspec.field(default_factory=lambda: ["570.86.15"])
    #: The fleet controller runs (correlates and holds); false: the agents alone, with the quarantine brake.
    controller: bool = True


class ScenarioEvent(Strict, frozen=True, kw_only=True):
    """One timeline entry: an observation (maybe repeated), at a virtual time in seconds."""

    at: NonNegative
    signal: Signal
    value: float = 1
    gpu: int | None = None
    #: A GPU known only by its PCI address, not one of the node's (`gpu` names those): the kernel log's address
    #: of a GPU, or one on the PCI bus that NVML does not enumerate.
    pci_bus_id: str = ""
    source: str = "scenario"
    attrs: dict[str, AttrValue] = msgspec.field(default_factory=dict)
    repeat: Annotated[int, Meta(ge=1, le=1_000_000)] = 1
    every: NonNegative = 0.0
    note: str = ""
    #: In a fleet: the nodes it happens on (numbers, or ranges "FIRST-LAST"); absent: every node.
    nodes: list[int | str] | None = None
    #: In a fleet: seconds between one node's observation and the next node's.
    stagger: NonNegative = 0.0


class Scenario(Strict, frozen=True, kw_only=True):
    name: NonEmpty
    description: str = ""
    node: ScenarioNode = msgspec.field(default_factory=ScenarioNode)
    timeline: Annotated[list[ScenarioEvent], Meta(min_length=1)]
    until: NonNegative | None = None
    tick_seconds: Annotated[float, Meta(gt=0)] = 1.0
    boot_id: str = "boot-1"
    fleet: ScenarioFleet | None = None
    #: The agent's mode the scenario is meant to show (simulate --mode overrides); absent: the agent's default.
    mode: Literal["observe", "quarantine", "remediate"] | None = None

    def __post_init__(self) -> None:
        count = self.node.gpus if isinstance(self.node.gpus, int) else len(self.node.gpus)
        if (self.node.host_holders or self.node.persistence_mode) and not self.node.gpu_operator:
            raise ValueError("node.host_holders and node.persistence_mode need node.gpu_operator")
        for holder in self.node.host_holders:
            if holder.gpu >= count:
                raise ValueError(f"node.host_holders: gpu {holder.gpu} but the node has {count} GPUs")
        for position, event in enumerate(self.timeline):
            if event.gpu is not None and event.gpu >= count:
                raise ValueError(f"timeline entry {position + 1}: gpu {event.gpu} but the node has {count} GPUs")
            if event.gpu is not None and event.pci_bus_id:
                raise ValueError(f"timeline entry {position + 1}: gpu or pci_bus_id, not both")
            if (event.nodes is not None or event.stagger) and self.fleet is None:
                raise ValueError(f"timeline entry {position + 1}: nodes and stagger need a fleet")
            if event.nodes is not None and self.fleet is not None:
                node_numbers(event.nodes, self.fleet.nodes, entry=position + 1)

    @property
    def end(self) -> float:
        last = max(e.at + e.every * (e.repeat - 1) + e.stagger * (self._node_count(e) - 1) for e in self.timeline)
        return max(self.until or 0.0, last)

    def _node_count(self, event: ScenarioEvent) -> int:
        if self.fleet is None:
            return 1
        return len(node_numbers(event.nodes, self.fleet.nodes)) if event.nodes is not None else self.fleet.nodes


def node_numbers(selected: list[int | str] | None, count: int, *, entry: int = 0) -> list[int]:
    """The fleet's node numbers a timeline entry names (`[3, "10-19"]`), in order, each once; every node when
    it names none. A number outside the fleet, or a range that is not FIRST-LAST, is a ValueError."""
    if selected is None:
        return list(range(count))
    numbers: list[int] = []
    for item in selected:
        first, last = _node_range(item, entry)
        if not 0 <= first <= last < count:
            raise ValueError(f"timeline entry {entry}: nodes {item} but the fleet has nodes 0-{count - 1}")
        numbers += [n for n in range(first, last + 1) if n not in numbers]
    return numbers


def _node_range(item: int | str, entry: int) -> tuple[int, int]:
    if isinstance(item, int):
        return item, item
    first, dash, last = item.partition("-")
    if not (dash and first.strip().isdigit() and last.strip().isdigit()):
        raise ValueError(f"timeline entry {entry}: nodes {item!r} is neither a number nor a range FIRST-LAST")
    return int(first), int(last)


def inventory(scenario: Scenario, number: int | None = None) -> NodeInventory:
    """The node a scenario describes (in a fleet, its node `number`), with generated identities where it gives
    only a count."""
    node = scenario.node
    owner, prefix, agent = "", "", "gpu-health-agent-x7k2p"
    if scenario.fleet is not None and number is not None:
        # One namespace across the fleet: each node's pods are named after it.
        node = msgspec.structs.replace(node, name=f"{scenario.fleet.prefix}{number}")
        owner, prefix, agent = scenario.fleet.workload, f"{node.name}-", f"gpu-health-agent-{node.name}"
    gpus = _gpus(node)
    if node.pods == "one-per-gpu":
        pods = [PodRef("ml", f"{prefix}trainer-{g.index}", _uid(node.name, f"pod{g.index}"), (g.uuid,), owner=owner)
                for g in gpus]
        pods.append(PodRef("gpu-health", agent, _uid(node.name, "agent"), (), daemonset=True))
    else:
        pods = [
            PodRef(p.namespace, p.name, p.uid or _uid(node.name, p.name),
                   tuple(gpus[i].uuid for i in p.gpus if i < len(gpus)), p.daemonset)
            for p in node.pods
        ]
    return NodeInventory(name=node.name, gpus=tuple(gpus), pods=tuple(pods))


def _gpus(node: ScenarioNode) -> list[GpuRef]:
    if isinstance(node.gpus, list):
        return [GpuRef(g.index, g.uuid, g.pci_bus_id, g.model) for g in node.gpus]
    return [
        GpuRef(i, f"GPU-{_uid(node.name, f'gpu{i}')}", f"0000:{HGX_PCI_BUSES[i % 8]}:00.0" if i < 8
               else f"0000:{0x20 + i:02x}:00.0", node.model)
        for i in range(node.gpus)
    ]


def _uid(*parts: str) -> str:
    digest = hashlib.sha256("/".join(parts).encode()).hexdigest()
    return f"{digest[:8]}-{digest[8:12]}-{digest[12:16]}-{digest[16:20]}-{digest[20:32]}"


@dataclass(frozen=True, slots=True)
class TimedObservation:
    """An observation of the expanded timeline, with the entry it came from."""

    entry: int
    observation: Observation


def expand(scenario: Scenario, node: NodeInventory) -> list[TimedObservation]:
    """Every observation of the timeline in time order, repeats expanded, the boot record first."""
    boot = Observation(Signal.BOOT, 0, 0.0, "scenario", attrs=frozen_attrs({"boot_id": scenario.boot_id}))
    timed = [TimedObservation(-1, boot)]
    for position, event in enumerate(scenario.timeline):
        gpu = _gpu_of(event, node)
        attrs = frozen_attrs(event.attrs)
        for n in range(event.repeat):
            at = event.at + n * event.every
            timed.append(TimedObservation(position, Observation(event.signal, event.value, at, event.source,
                                                                gpu, attrs)))
    return sorted(timed, key=lambda t: (t.observation.at, t.entry))


def _gpu_of(event: ScenarioEvent, node: NodeInventory) -> GpuRef | None:
    if event.gpu is not None:
        return node.gpus[event.gpu]
    return GpuRef(pci_bus_id=event.pci_bus_id) if event.pci_bus_id else None


def fleet_timeline(scenario: Scenario) -> list[tuple[int, TimedObservation]]:
    """A fleet's observations in time order, each with its node's number: every node's boot record first,
    each entry on the nodes it names, the k-th of them `stagger` * k seconds after the first (no fleet: the
    one node, number 0)."""
    count = scenario.fleet.nodes if scenario.fleet is not None else 1
    nodes = [inventory(scenario, n) for n in range(count)]
    boot = Observation(Signal.BOOT, 0, 0.0, "scenario", attrs=frozen_attrs({"boot_id": scenario.boot_id}))
    timed = [(n, TimedObservation(-1, boot)) for n in range(count)]
    for position, event in enumerate(scenario.timeline):
        attrs = frozen_attrs(event.attrs)
        for k, number in enumerate(node_numbers(event.nodes, count)):
            gpu = _gpu_of(event, nodes[number])
            for n in range(event.repeat):
                at = event.at + k * event.stagger + n * event.every
                timed.append((number, TimedObservation(position, Observation(event.signal, event.value, at,
                                                                             event.source, gpu, attrs))))
    return sorted(timed, key=lambda t: (t[1].observation.at, t[0], t[1].entry))


def parse_scenario(text: str, *, origin: str) -> Scenario:
    try:
        data = safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ScenarioError(f"not valid YAML{where}", file=origin) from None
    if not isinstance(data, dict):
        raise ScenarioError("expected a mapping with name and timeline", file=origin)
    try:
        return convert(data, Scenario)
    except RecordInvalid as exc:
        raise ScenarioError(exc.reason, file=origin, field=exc.field or "(scenario)") from None


def builtin_names() -> list[str]:
    folder = resources.files("agent") / "scenarios"
    return sorted(p.name[: -len(".yaml")] for p in folder.iterdir() if p.name.endswith(".yaml"))


def load_scenario(name_or_path: str) -> Scenario:
    """A built-in scenario by name, or a scenario file by path."""
    if name_or_path in builtin_names():
        text = (resources.files("agent") / "scenarios" / f"{name_or_path}.yaml").read_text(encoding="utf-8")
        return parse_scenario(text, origin=f"built-in scenario {name_or_path}")
    path = Path(name_or_path)
    if not path.is_file():
        known = ", ".join(builtin_names())
        raise ScenarioError(f"no such scenario file or built-in scenario (built-in: {known})", file=name_or_path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ScenarioError(f"cannot read: {exc}", file=name_or_path) from None
    return parse_scenario(text, origin=name_or_path)


class ScaledClock:
    """Wall-clock time that runs `speed` times faster from the moment it is made (for `run --speed`)."""

    def __init__(self, speed: float, clock: Callable[[], float] = time.time) -> None:
        self.speed = speed
        self._clock = clock
        self._origin = clock()

    def __call__(self) -> float:
        return self._origin + (self._clock() - self._origin) * self.speed


class ScenarioSource:
    """Replays a scenario in real time (optionally sped up), for injection tests of a running agent."""

    name = "scenario"

    def __init__(self, scenario: Scenario, node: NodeInventory, *, speed: float = 1.0,
                 clock: Any = time.time, stamp: Any = None) -> None:
        self.scenario = scenario
        self.node = node
        self.speed = speed
        self.clock = clock
        #: The time each observation carries: the agent's clock (a ScaledClock when sped up).
        self.stamp = stamp or clock

    def run(self, emit: Emit, stop: threading.Event) -> None:
        start = self.clock()
        for timed in expand(self.scenario, self.node):
            if timed.observation.signal is Signal.BOOT:
                continue
            due = start + timed.observation.at / self.speed
            if stop.wait(max(0.0, due - self.clock())):
                return
            obs = timed.observation
            emit(Observation(obs.signal, obs.value, self.stamp(), obs.source, obs.gpu, obs.attrs, obs.count))
