#!/usr/bin/env python3
"""Prints how the fleet behaves at scale on the real control plane (issue 24): NODES kwok GPU nodes, AGENTS real
`gpu-health-agent run` processes (each its node's agent: its own ServiceAccount token bound to its pod there, a
fake NVML state file and a kernel-log FIFO the driver writes Xid records into) and the fleet controller as
`gpu-health-agent fleet run` on its own token, then a row per scenario.

The fleet: nodes fleet-00000.. labelled as the GPU Operator labels them (8 H100s, two driver versions alternating,
racks and NVLink fabric domains of 18 nodes, three zones); the agents run on the first AGENTS of them, in
`remediate` mode with the shipped budget and brake. One real batch/v1 Job (parallelism AGENTS, the controller
manager's Job controller) puts one pod holding eight GPUs on each agent node (node affinity; kwok runs it).
kwok has no kubelet, so each agent's PodResources socket is a fake kubelet in this script answering with the
pods the API server has on that node; that is how an agent knows which workload holds its GPUs.

Rows, in the order run:
  brake-only (no controller yet; the GPU nodes are the AGENTS agent nodes, so the shipped brake's bound is
  15 % of AGENTS): (a) Xid 13 on every agent node, (b) every GPU's fabric registration lost (fabric-not-registered,
  120 s sustain; not the NVLink rule, so (b) below starts afresh), (c) Xid 120 on one driver's nodes;
  then the other kwok nodes join and the controller starts (it takes over what the brake kept waiting);
  (a) one Job on every agent node crash-loops: Xid 13, three pids per GPU, one SM location (GPC 0, TPC 1);
  (b) every NVLink of every GPU drops at once on every agent node (fake NVML), 60 s sustain;
  (d) fabric registration of every GPU fails (an NVSwitch fault) on the 18 nodes of one fabric domain;
  (c)+(g) Xid 119 on every node of the other driver version, 0.2 s apart; the controller SIGKILLed half-way
  (once its hold is published) and started again;
  (e) one node inside (c)'s hold: its GPU falls off the bus (Xid 79, hardware);
  (f) independent Xid 79s on the first driver's nodes: SLOW_FAULTS of them one a second (the issue's (f)), then
  the rest RATE a second (its throughput);
  the controller's CPU and RSS after MORE kwok nodes join.

A row gives the nodes newly tainted (from a Node watch), evicted pods, GPU resets and reboot requests (the agents'
journals), the time from the first fault to the hold (and from the k-th node's verdict), the holds and Events, and
the API requests/s of the agents and the controller (audit log). Nothing is asserted.

Usage: scripts/bench_fleet_scale.py [--nodes 1000] [--agents 100] [--rate 25] [--slow-faults 15] [--more-nodes 4000]
       [--wave 10] [--throughput-only]
With --throughput-only, only (f)'s throughput, on every agent's node (a longer burst than the full run leaves).
Needs scripts/build-controlplane and the fake NVML (tests/fakenvml/build.sh); root is not needed.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from agent.fleet import BrakePolicy, brake_bound  # noqa: E402
from tests.realcluster.controlplane import AGENT_NAMESPACE, AGENT_USER, FLEET_USER, ControlPlane  # noqa: E402
from tests.realcluster.fleetbed import (  # noqa: E402
    AGENT_NODE_LABEL,
    DOMAIN_SIZE,
    AgentProcess,
    PodsByNode,
    TaintWatch,
    add_nodes,
    cpu_seconds,
    fleet_kubeconfig,
    mem_available_gib,
    node_name,
    proc_status,
    start_agent,
    start_controller,
    stop_agents,
)

DRIVERS = ("575.51.03", "570.86.15")
JOB_NAMESPACE = "ml"
BUS = [f"{0x18 + i * 0x10:02x}" for i in range(8)]


def driver_of(number: int) -> str:
    return DRIVERS[number % 2]


class Audit:
    """The audit log read on: each request's (time received, user), for requests/s over a span."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset = path, 0
        self.requests: list[tuple[float, str]] = []

    def read(self) -> None:
        from datetime import datetime  # noqa: PLC0415

        with self.path.open("rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1
        self.offset += end
        for line in data[:end].splitlines():
            event = json.loads(line)
            watch = event.get("verb") == "watch"  # a watch counts once, when it starts
            if event.get("stage") == ("ResponseStarted" if watch else "ResponseComplete"):
                stamp = datetime.fromisoformat(event["requestReceivedTimestamp"].replace("Z", "+00:00"))
                self.requests.append((stamp.timestamp(), event.get("user", {}).get("username", "")))

    def count(self, user: str, since: float, until: float | None = None) -> int:
        self.read()
        end = until if until is not None else time.time()
        return sum(1 for at, who in self.requests if who == user and since <= at < end)

    def per_s(self, user: str, since: float) -> float:
        return round(self.count(user, since) / max(time.time() - since, 1e-9), 1)


class Bench:
    def __init__(self, plane: ControlPlane, folder: Path, args: argparse.Namespace) -> None:
        self.plane, self.folder, self.args = plane, folder, args
        self.audit = Audit(plane.audit_log)
        self.taints = TaintWatch(plane)
        self.pods = PodsByNode(plane, JOB_NAMESPACE)
        self.agents: list[AgentProcess] = []
        self.controller: subprocess.Popen[bytes] | None = None
        self.fleet_config = Path()

    # ---- what the cluster shows ----
    def holds(self) -> list[dict[str, Any]]:
        try:
            data = self.plane.core.read_namespaced_config_map("gpu-health-fleet-holds", AGENT_NAMESPACE).data or {}
        except Exception:  # noqa: BLE001 - none yet
            return []
        return list(json.loads(data.get("holds.json", "[]")))

    def wait_hold(self, rule: str, timeout: float) -> float | None:
        """When a hold of `rule` was first seen (polled every 0.2 s), or None within `timeout`."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if any(h["rule"] == rule for h in self.holds()):
                return time.time()
            time.sleep(0.2)
        return None

    def events(self, reason: str, since: float, text: str = "") -> list[Any]:
        items = self.plane.core.list_event_for_all_namespaces(field_selector=f"reason={reason}").items
        found = []
        for e in items:
            at = e.event_time or e.last_timestamp or e.first_timestamp
            if at and at.timestamp() >= since - 1 and text in (e.message or e.note or ""):
                found.append(e)
        return found

    def slots(self) -> int:
        """The budget slot Leases held now (a slot given back is kept, annotated, for the rate bound's hour)."""
        leases = self.plane.rest("GET", f"/apis/coordination.k8s.io/v1/namespaces/{AGENT_NAMESPACE}/leases")
        return sum(1 for lease in leases["items"] if lease["metadata"]["name"].startswith("gpu-health-slot-")
                   and lease.get("spec", {}).get("holderIdentity")
                   and "gpu-health-agent.io/released" not in (lease["metadata"].get("annotations") or {}))

    def steps(self, agents: Iterable[AgentProcess], since: float) -> dict[str, int]:
        total: dict[str, int] = {}
        for agent in agents:
            for kind, count in agent.steps(since).items():
                total[kind] = total.get(kind, 0) + count
        return total

    def verdict_times(self, agents: Iterable[AgentProcess], rule: str, since: float) -> list[float]:
        import sqlite3  # noqa: PLC0415

        times = []
        for agent in agents:
            try:
                db = sqlite3.connect(f"file:{agent.home / 'journal.db'}?mode=ro", uri=True, timeout=5)
                row = db.execute("SELECT MIN(at) FROM verdicts WHERE rule_id = ? AND at >= ? AND kind = 'fault'",
                                 (rule, since)).fetchone()
                db.close()
            except sqlite3.Error:
                continue
            if row and row[0] is not None:
                times.append(float(row[0]))
        return sorted(times)

    # ---- one scenario's row ----
    def scenario(self, name: str, nodes: list[AgentProcess], inject: Callable[[], None], *, rule: str,
                 settle: float, hold_timeout: float = 0.0, k: int = 3, **extra: Any) -> dict[str, Any]:
        before = set(self.taints.now_tainted)
        started = time.time()
        inject()
        names = {a.node for a in nodes}
        hold_at = self.wait_hold(rule, hold_timeout) if hold_timeout else None
        most = 0
        while time.time() < started + settle:
            most = max(most, len(self.taints.now_tainted & names))
            time.sleep(0.5)
        steps = self.steps(nodes, started)
        holds = [h for h in self.holds() if h["rule"] == rule]
        correlations = self.events("FleetCorrelation", started, rule)
        verdicts = self.verdict_times(nodes, rule, started)
        figures = {
            "faulted": len(nodes),
            "tainted_new": len(self.taints.tainted_since(started, names) - before),
            "tainted_most_at_once": most, "tainted_at_end": len(self.taints.now_tainted & names),
            "evicted": steps.get("evict", 0), "resets": steps.get("reset_gpu", 0),
            "reboot_requests": steps.get("reboot_request", 0), "taint_waited": self.blocked(nodes, started),
            "braked_events": len(self.events("QuarantineBraked", started)),
            "correlation_events": len(correlations),
            "s_to_hold": round(hold_at - started, 2) if hold_at else "none",
            f"s_from_verdict_{k}_to_hold": round(hold_at - verdicts[k - 1], 2) if hold_at and len(verdicts) >= k
            else "n/a",
            "holds": ",".join(sorted(h["id"] for h in holds)) or "none",
            "held_nodes": ",".join(str(len(h["nodes"])) for h in holds) or "0",
            "agent_req_per_s": self.audit.per_s(AGENT_USER, started),
            "controller_req_per_s": self.audit.per_s(FLEET_USER, started),
            "load1": round(os.getloadavg()[0], 1), **extra}
        row(name, **figures)
        return figures

    def blocked(self, nodes: Iterable[AgentProcess], since: float) -> int:
        """Taints the brake kept waiting since `since`: nodes whose journal has a blocked taint step."""
        import sqlite3  # noqa: PLC0415

        count = 0
        for agent in nodes:
            try:
                db = sqlite3.connect(f"file:{agent.home / 'journal.db'}?mode=ro", uri=True, timeout=5)
                row_ = db.execute("SELECT COUNT(*) FROM actions WHERE kind = 'taint' AND result = 'blocked'"
                                  " AND at >= ? AND message LIKE 'quarantine brake%'", (since,)).fetchone()
                db.close()
            except sqlite3.Error:
                continue
            count += 1 if row_ and row_[0] else 0
        return count

    # ---- the fleet ----
    def start_agents(self, numbers: list[int]) -> None:
        self.plane.apply_shipped_manifests()
        kubeconfigs: dict[str, Path] = {}
        from concurrent import futures  # noqa: PLC0415

        with futures.ThreadPoolExecutor(4) as pool:  # each: the agent's pod, Running, and a token bound to it
            for node, path in zip([node_name(n) for n in numbers],
                                  pool.map(self.plane.agent_kubeconfig, [node_name(n) for n in numbers]),
                                  strict=True):
                kubeconfigs[node] = path
        began, free_before = time.monotonic(), mem_available_gib()
        for first in range(0, len(numbers), self.args.wave):
            if mem_available_gib() < self.args.min_free_gib:
                row("agents: stopped starting, memory", free_gib=round(mem_available_gib(), 2))
                break
            wave = [start_agent(self.plane, self.folder, node_name(n), driver_of(n), self.pods,
                                kubeconfigs[node_name(n)]) for n in numbers[first:first + self.args.wave]]
            self.agents.extend(wave)
            deadline = time.monotonic() + 30 + 3 * len(wave)
            while self.published({a.node for a in wave}) < len(wave) and time.monotonic() < deadline:
                dead = [a for a in wave if a.process.poll() is not None]
                if dead:
                    raise SystemExit(f"agent {dead[0].node} exited: {dead[0].log_tail()}")
                time.sleep(1)
        rss = [a.rss_mib() for a in self.agents]
        row("agents started (waves), each published its summary", agents=len(self.agents),
            published=self.published({a.node for a in self.agents}), seconds=round(time.monotonic() - began, 1),
            rss_mib_mean=round(sum(rss) / len(rss), 1), rss_mib_max=round(max(rss), 1),
            rss_gib_total=round(sum(rss) / 1024, 2), free_gib_before=round(free_before, 2),
            free_gib_after=round(mem_available_gib(), 2),
            more_agents_would_fit=int(max(0.0, mem_available_gib() - self.args.min_free_gib) * 1024
                                      / (sum(rss) / len(rss))))

    def published(self, nodes: set[str]) -> int:
        listed = self.plane.core.list_node(label_selector=AGENT_NODE_LABEL).items
        return sum(1 for n in listed if n.metadata.name in nodes
                   and "gpu-health-agent.io/fleet-summary" in (n.metadata.annotations or {}))

    def add_job(self, count: int) -> None:
        from kubernetes import client  # noqa: PLC0415

        self.plane.ensure_namespace(JOB_NAMESPACE)
        affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": AGENT_NODE_LABEL, "operator": "In", "values": ["true"]}]}]}}}
        client.BatchV1Api(self.plane.admin).create_namespaced_job(JOB_NAMESPACE, {
            "metadata": {"name": "train"},
            "spec": {"parallelism": count, "completions": count, "backoffLimit": 10_000, "template": {
                "metadata": {"labels": {"app": "train"}},
                "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1, "affinity": affinity,
                         "containers": [{"name": "main", "image": "example.invalid/trainer:1",
                                         "resources": {"limits": {"nvidia.com/gpu": "8"}}}]}}}})
        began = time.monotonic()
        while time.monotonic() - began < 180:
            running = [p for p in self.plane.core.list_namespaced_pod(JOB_NAMESPACE).items
                       if p.status.phase == "Running"]
            if len(running) >= count:
                break
            time.sleep(2)
        row("Job ml/train, one pod of 8 GPUs per agent node", pods_running=len(running),
            seconds=round(time.monotonic() - began, 1))

    def kill_controller(self, identity: str) -> None:
        if self.controller is None:
            return
        self.controller.send_signal(signal.SIGKILL)
        self.controller.wait(10)
        self.controller = start_controller(self.fleet_config, self.folder, identity)


def row(name: str, **figures: Any) -> None:
    print(f"{name:<46} " + "  ".join(f"{k}={v}" for k, v in figures.items()), flush=True)


XID13 = "Graphics SM Warp Exception on (GPC 0, TPC 1, SM 0): Out Of Range Address"
XID31 = ("MMU Fault: ENGINE GRAPHICS GPC0 GPCCLIENT_T1_0 faulted @ 0x7f12_34560000. Fault is of type FAULT_PDE"
         " ACCESS_TYPE_VIRT_READ")


def crash_loop(agents: list[AgentProcess], code: int, message: str) -> Callable[[], None]:
    """One job's ranks restart and fault again: three new processes per GPU, each at the same place."""
    def inject() -> None:
        for rank, agent in enumerate(agents):
            for gpu, bus in enumerate(BUS):
                for restart in range(3):
                    agent.xid(code, bus, message, pid=4_000_000 + rank * 100 + gpu * 10 + restart)
    return inject


def run(bench: Bench) -> None:
    args, plane = bench.args, bench.plane
    agent_numbers = list(range(args.agents))
    began = time.monotonic()
    add_nodes(plane, agent_numbers, driver_of, agent_nodes=frozenset(agent_numbers))
    row("kwok GPU nodes created (the agents' nodes)", nodes=args.agents, seconds=round(time.monotonic() - began, 1))
    threading.Thread(target=bench.taints.run, daemon=True).start()
    threading.Thread(target=bench.pods.run, daemon=True).start()
    bench.add_job(args.agents)
    bench.start_agents(agent_numbers)
    agents = bench.agents
    by_driver = [[a for a in agents if a.driver == d] for d in DRIVERS]
    time.sleep(40)  # past every agent's first pass (it publishes its record)
    if args.throughput_only:
        throughput(bench, agents)
        return
    quiet = time.time()
    time.sleep(args.quiet)
    healthy = bench.audit.count(AGENT_USER, quiet)
    row(f"healthy fleet, {args.quiet:.0f} s", agent_requests=healthy,
        per_node_per_hour=round(healthy / len(agents) * 3600 / args.quiet, 2))

    # ---- brake only: no controller runs; the GPU nodes are the agents' nodes ----
    bound = brake_bound(len(agents), BrakePolicy())
    brake_began = time.time()
    bench.scenario(f"brake-only (a) one Job: Xid 31 x3 pids, {len(agents)}", agents,
                   crash_loop(agents, 31, XID31), rule="xid-31", settle=20, bound=bound)
    bench.scenario(f"brake-only (b) fabric registration lost, {len(agents)}", agents,
                   lambda: [a.nvml(fabric_state=1) for a in agents], rule="fabric-not-registered", settle=150,
                   bound=bound)
    for agent in agents:
        agent.nvml()
    storm = by_driver[1]
    bench.scenario(f"brake-only (c) Xid 120 on driver {DRIVERS[1]}", storm,
                   lambda: [(a.xid(120, BUS[1], "Timeout after 6s of waiting for RPC response from GPU1 GSP!"),
                             time.sleep(0.1)) for a in storm], rule="xid-120", settle=25, bound=bound)
    row("brake-only (a)-(c) within one brake window", newly_quarantined=len(
        bench.taints.tainted_since(brake_began, {a.node for a in agents})), bound=bound,
        gpu_nodes=len(agents), taint_waited=bench.blocked(agents, brake_began))

    # ---- the whole fleet, and the controller ----
    began = time.monotonic()
    add_nodes(plane, range(args.agents, args.nodes), driver_of)
    row("kwok GPU nodes created (the rest)", nodes=args.nodes - args.agents, seconds=round(time.monotonic() - began, 1))
    bench.fleet_config = fleet_kubeconfig(plane, manager="bench", seconds=7200)
    tainted = set(bench.taints.now_tainted)
    bench.controller = start_controller(bench.fleet_config, bench.folder, "fleet-a")
    cpu0, at0 = cpu_seconds(bench.controller.pid), time.time()
    time.sleep(45)
    row(f"controller started at {args.nodes} nodes", holds=len(bench.holds()),
        held_rules=",".join(sorted({h["rule"] for h in bench.holds()})),
        tainted_before=len(tainted), tainted_after_45s=len(bench.taints.now_tainted),
        controller_rss_mib=round(proc_status(bench.controller.pid, "VmRSS"), 1),
        controller_cpu_pct=round(100 * (cpu_seconds(bench.controller.pid) - cpu0) / (time.time() - at0), 1),
        controller_req_per_s=bench.audit.per_s(FLEET_USER, at0))

    bench.scenario("(a) one Job crash-loops: Xid 13 x3 pids", agents, crash_loop(agents, 13, XID13), rule="xid-13",
                   settle=90, hold_timeout=80)
    bench.scenario("(b) every NVLink down", agents, lambda: [a.nvml(links_down=True) for a in agents],
                   rule="nvlink-link-down", settle=130, hold_timeout=120)
    for agent in agents:
        agent.nvml()
    domain = [a for a in agents if a.number < DOMAIN_SIZE]
    slots_before = bench.slots()
    bench.scenario(f"(d) fabric fault in one domain of {len(domain)}", domain,
                   lambda: [a.nvml(fabric_status=999) for a in domain], rule="fabric-registration-failed",
                   settle=60, hold_timeout=50, budget_slots_before=slots_before)
    row("  (d) budget slots held after (d)", slots=bench.slots())
    for agent in domain:
        agent.nvml()

    storm = by_driver[0]
    before_kill: list[str] = []

    def gsp_storm() -> None:
        """0.2 s apart; the controller is killed half-way, once its xid-119 hold is published (or at the end)."""
        def kill() -> None:
            before_kill.extend(h["id"] for h in bench.holds())
            bench.kill_controller("fleet-b")

        for k, agent in enumerate(storm):
            agent.xid(119, BUS[0], "Timeout after 6s of waiting for RPC response from GPU0 GSP!")
            if k >= len(storm) // 2 and not before_kill and any(h["rule"] == "xid-119" for h in bench.holds()):
                kill()
            time.sleep(0.2)
        if not before_kill:
            bench.wait_hold("xid-119", 30)
            kill()

    figures = bench.scenario(f"(c)+(g) Xid 119 on {DRIVERS[0]}, controller killed", storm, gsp_storm,
                             rule="xid-119", settle=60, hold_timeout=55)
    ids = [h["id"] for h in bench.holds()]
    acted = [a.steps(0.0, "xid-119").get("taint", 0) for a in storm]
    row("  (g) holds across the kill", before_kill=len(before_kill), after=len(ids),
        lost=len(set(before_kill) - set(ids)), duplicated=len(ids) - len(set(ids)),
        xid119_correlation_events=figures["correlation_events"], xid119_taints_max_per_node=max(acted, default=0))

    inside = next((a for a in storm if a.node not in bench.taints.now_tainted), storm[-1])
    written = inside.xid(79, BUS[4], "GPU has fallen off the bus.")
    while bench.taints.became.get(inside.node, 0.0) < written and time.time() - written < 30:
        time.sleep(0.01)
    became = bench.taints.became.get(inside.node, 0.0)
    row("(e) Xid 79 on a node inside (c)'s hold", node=inside.node,
        quarantined_after_s=round(became - written, 3) if became >= written else "not within 30 s",
        held_by=",".join(h["id"] for h in bench.holds() if inside.node in h["nodes"] and h["rule"] == "xid-119"))

    others = [a for a in by_driver[1] if a.node not in bench.taints.now_tainted]
    slow = min(args.slow_faults, len(others) // 2)
    independent_faults(bench, others[:slow], rate=1.0, label="(f) independent Xid 79s, one a second")
    independent_faults(bench, others[slow:], rate=args.rate, label=f"(f) independent Xid 79s, {args.rate:g} a second")

    if args.more_nodes and bench.controller is not None:
        cpu0, at0 = cpu_seconds(bench.controller.pid), time.time()
        add_nodes(plane, range(args.nodes, args.nodes + args.more_nodes), driver_of)
        added = time.time()
        time.sleep(30)
        cpu1, at1 = cpu_seconds(bench.controller.pid), time.time()
        time.sleep(30)
        row(f"controller at {args.nodes + args.more_nodes} nodes",
            add_s=round(added - at0, 1), controller_rss_mib=round(proc_status(bench.controller.pid, "VmRSS"), 1),
            cpu_pct_while_added=round(100 * (cpu1 - cpu0) / (at1 - at0), 1),
            cpu_pct_after=round(100 * (cpu_seconds(bench.controller.pid) - cpu1) / (time.time() - at1), 1))


def throughput(bench: Bench, agents: list[AgentProcess]) -> None:
    """(f)'s throughput alone, over a longer burst: the fleet's other nodes join and the controller starts (the
    brake's bound is then a share of every GPU node, as in the full run), then Xid 79 on every agent's node at
    --rate a second."""
    args, plane = bench.args, bench.plane
    add_nodes(plane, range(args.agents, args.nodes), driver_of)
    bench.fleet_config = fleet_kubeconfig(plane, manager="bench", seconds=7200)
    bench.controller = start_controller(bench.fleet_config, bench.folder, "fleet-a")
    time.sleep(30)
    independent_faults(bench, agents, rate=args.rate, label=f"(f) independent Xid 79s, {args.rate:g} a second, "
                       f"{len(agents)} nodes")


def independent_faults(bench: Bench, agents: list[AgentProcess], *, rate: float, label: str) -> None:
    """(f): Xid 79 (fell off the bus) on each agent's node in turn, `rate` a second; a row of how soon each node
    was tainted, the throughput, and the budget slots sampled meanwhile. The throughput is the rate the taints
    came at, from the first to the last (a fleet that keeps up with the faults taints as fast as they arrive);
    first_fault_to_last_taint_s is the whole burst, the last node's delay included."""
    sent_at: dict[str, float] = {}
    samples: list[int] = []
    cpu0, busy0 = sum(cpu_seconds(a.process.pid) for a in agents), machine_busy()
    started = time.time()
    for agent in agents:
        sent_at[agent.node] = agent.xid(79, BUS[2], "GPU has fallen off the bus.")
        time.sleep(max(0.0, started + len(sent_at) / rate - time.time()))
    while len([n for n in sent_at if bench.taints.became.get(n, 0) >= sent_at[n]]) < len(sent_at) \
            and time.time() - started < 60:
        samples.append(bench.slots())
        time.sleep(0.5)
    delays = sorted(bench.taints.became[n] - t for n, t in sent_at.items() if bench.taints.became.get(n, 0) >= t)
    taints = sorted(bench.taints.became[n] for n in sent_at if bench.taints.became.get(n, 0) >= sent_at[n])
    done = taints[-1] if taints else started
    agents_cpu, (busy, total) = sum(cpu_seconds(a.process.pid) for a in agents) - cpu0, machine_busy()
    for _ in range(10):
        samples.append(bench.slots())
        time.sleep(1)
    steps = bench.steps(agents, started)
    row(label, faults=len(sent_at), arrived_per_s=rate, quarantined=len(delays),
        p50_s=round(delays[len(delays) // 2], 3) if delays else "n/a",
        max_s=round(delays[-1], 3) if delays else "n/a",
        throughput_nodes_per_s=round((len(taints) - 1) / max(taints[-1] - taints[0], 1e-9), 1) if len(taints) > 1
        else "n/a", first_fault_to_last_taint_s=round(done - started, 2),
        evicted=steps.get("evict", 0), reboot_requests=steps.get("reboot_request", 0),
        budget_slots_max_sampled=max(samples, default=0), agent_req_per_s=bench.audit.per_s(AGENT_USER, started),
        agents_cpu_ms_per_fault=round(1000 * agents_cpu / max(len(sent_at), 1), 1),
        machine_busy_pct=round(100 * (busy - busy0[0]) / max(total - busy0[1], 1e-9), 1))


def machine_busy() -> tuple[float, float]:
    """The machine's busy and total CPU time so far (/proc/stat's first line, in clock ticks)."""
    ticks = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
    return float(sum(ticks) - idle), float(sum(ticks))


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--agents", type=int, default=100)
    parser.add_argument("--rate", type=float, default=25.0, help="(f): independent faults a second")
    parser.add_argument("--throughput-only", action="store_true",
                        help="run (f)'s throughput alone, on every agent's node, after the controller starts")
    parser.add_argument("--slow-faults", type=int, default=15,
                        help="(f) first at one fault a second on this many nodes (at most half of those left)")
    parser.add_argument("--more-nodes", type=int, default=4000, help="added at the end for the controller's cost")
    parser.add_argument("--wave", type=int, default=10, help="agents started together")
    parser.add_argument("--quiet", type=float, default=90.0, help="seconds the healthy fleet's requests are counted")
    parser.add_argument("--min-free-gib", type=float, default=3.0, help="start no more agents below this free memory")
    args = parser.parse_args()
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as name:
        folder = Path(name)
        plane = ControlPlane(folder / "controlplane", extra_controllers=("job",)).start()
        bench = Bench(plane, folder, args)
        try:
            run(bench)
        finally:
            bench.taints.stop.set()
            bench.pods.stop.set()
            stop_agents(bench.agents)
            if bench.controller is not None:
                bench.controller.terminate()
                bench.controller.wait(15)
            plane.stop()


if __name__ == "__main__":
    main()
