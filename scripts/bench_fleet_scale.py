#!/usr/bin/env python3
"""Prints how the fleet behaves at scale on the real control plane: NODES kwok GPU nodes, AGENTS real
`gpu-health-agent run` processes (each its node's agent: its own ServiceAccount token bound to its pod, a
fake NVML state file and a kernel-log FIFO the driver writes Xid records into), and the fleet controller as
`gpu-health-agent fleet run` with its own token. Then the scenarios of issue 24, a row each:

  (c) GSP timeouts (Xid 119) on GPU 0 of every agent node of one driver version, 0.1 s apart;
  (g) the fleet controller killed (SIGKILL) in the middle of (c) and started again;
  (e) one node inside (c)'s hold: its GPU 4 falls off the bus (Xid 79, hardware) - quarantined despite the hold;
  (f) independent Xid 79s on other nodes, RATE a second, for a few seconds - each quarantined on its own.

A row gives the nodes tainted (at any time, from a Node watch), evicted pods, reboot requests, the time from
the first fault to the FleetCorrelation Event, and the Events raised; the fleet rows add the API requests/s
of the agents (audit log), the agents' RSS, the controller's CPU and RSS. Nothing is asserted.

Usage: scripts/bench_fleet_scale.py [--nodes 1000] [--agents 100] [--rate 25] [--more-nodes 4000]
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.conftest import eight_gpus  # noqa: E402
from tests.realcluster.controlplane import (  # noqa: E402
    AGENT_NAMESPACE,
    GPU_LABEL,
    KWOK_LABEL,
    ControlPlane,
    _kubeconfig,
    audit_events,
)

FAKE_DIR = REPO / "tests" / "fakenvml" / "build"
DRIVERS = ("575.51.03", "570.86.15")
TAINT = "gpu-health-agent.io/unhealthy"
FLEET_USER = "system:serviceaccount:gpu-health:gpu-health-fleet"


@dataclass
class AgentProcess:
    node: str
    driver: str
    process: subprocess.Popen[bytes]
    kmsg: int  # the FIFO, held open for writing
    log: Path
    seq: int = 0

    def xid(self, code: int, bus: str, message: str) -> float:
        """One NVRM Xid record into the agent's kernel log; returns when it was written (time.time())."""
        self.seq += 1
        stamp = int(time.monotonic() * 1e6)
        record = f"4,{self.seq},{stamp},-;NVRM: Xid (PCI:0000:{bus}:00): {code}, pid=4242, name=python3, {message}\n"
        written = time.time()
        os.write(self.kmsg, record.encode())
        return written

    def rss_mib(self) -> float:
        return _status(self.process.pid, "VmRSS")


@dataclass
class Watcher:
    """Every taint change of the agents' taint, from one admin watch of the Nodes: node -> first tainted at."""

    plane: ControlPlane
    tainted: dict[str, float] = field(default_factory=dict)
    #: node -> when it last went from untainted to tainted
    became: dict[str, float] = field(default_factory=dict)
    now_tainted: set[str] = field(default_factory=set)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        from kubernetes import watch  # noqa: PLC0415

        while not self.stop.is_set():
            stream = watch.Watch()
            try:
                for event in stream.stream(self.plane.core.list_node, timeout_seconds=30):
                    node = event["object"]
                    ours = any(t.key == TAINT for t in node.spec.taints or [])
                    name = node.metadata.name
                    if ours:
                        self.tainted.setdefault(name, time.time())
                        if name not in self.now_tainted:
                            self.became[name] = time.time()
                        self.now_tainted.add(name)
                    else:
                        self.now_tainted.discard(name)
                    if self.stop.is_set():
                        break
            except Exception:  # noqa: BLE001 - a benchmark's watch: re-open it
                time.sleep(0.5)


def _status(pid: int, key: str) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def add_nodes(plane: ControlPlane, first: int, count: int) -> list[str]:
    """kwok GPU nodes labelled as the GPU Operator labels them; not waited for one by one."""
    names = []
    for n in range(first, first + count):
        name = f"fleet-{n:05d}"
        driver = DRIVERS[n % 2]
        resources = {"nvidia.com/gpu": "8", "cpu": "192", "memory": "2Ti", "pods": "110"}
        plane.core.create_node({
            "metadata": {"name": name, "labels": {
                GPU_LABEL: "true", KWOK_LABEL: "kwok", "kubernetes.io/hostname": name,
                "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3", "nvidia.com/gpu.count": "8",
                "nvidia.com/cuda.driver-version.full": driver,
                "topology.kubernetes.io/rack": f"rack-{n // 18}", "topology.kubernetes.io/zone": f"zone-{n % 3}"},
                "annotations": {"node.alpha.kubernetes.io/ttl": "0"}},
            "status": {"capacity": resources, "allocatable": resources},
        })
        names.append(name)
    return names


def add_job(plane: ControlPlane, node: str) -> None:
    plane.ensure_namespace("ml")
    client = __import__("kubernetes").client
    client.BatchV1Api(plane.admin).create_namespaced_job("ml", {
        "metadata": {"name": f"train-{node}"},
        "spec": {"backoffLimit": 0, "template": {"spec": {
            "nodeName": node, "restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
            "tolerations": [{"operator": "Exists"}],
            "containers": [{"name": "main", "image": "example.invalid/trainer:1",
                            "resources": {"limits": {"nvidia.com/gpu": "8"}}}]}}}})


def start_agent(plane: ControlPlane, folder: Path, node: str, driver: str) -> AgentProcess:
    home = folder / node
    home.mkdir()
    state = home / "nvml.json"
    state.write_text(json.dumps({**eight_gpus(), "driver_version": driver}))
    kmsg = home / "kmsg"
    os.mkfifo(kmsg)
    keep = os.open(kmsg, os.O_RDWR | os.O_NONBLOCK)
    env = dict(os.environ, LD_LIBRARY_PATH=str(FAKE_DIR), FAKE_NVML_STATE=str(state), NODE_NAME=node,
               POD_NAME=f"gpu-health-agent-{node}", POD_NAMESPACE=AGENT_NAMESPACE,
               GPU_HEALTH_SOURCES__KMSG__ENABLED="on", GPU_HEALTH_SOURCES__KMSG__PATH=str(kmsg),
               GPU_HEALTH_SOURCES__NVML__ENABLED="on", GPU_HEALTH_SOURCES__DCGM__ENABLED="off",
               GPU_HEALTH_JOURNAL_PATH=str(home / "journal.db"), GPU_HEALTH_HTTP__HOST="127.0.0.1",
               GPU_HEALTH_LOG__LEVEL="warning", GPU_HEALTH_LOG__FORMAT="json", GPU_HEALTH_MODE="remediate",
               KUBECONFIG=str(plane.agent_kubeconfig(node)))
    env.pop("KUBERNETES_SERVICE_HOST", None)
    log = home / "agent.log"
    with log.open("wb") as stderr:
        process = subprocess.Popen([sys.executable, "-m", "agent", "run", "--port", "0"], env=env,
                                   stdout=subprocess.DEVNULL, stderr=stderr, cwd=REPO)
    return AgentProcess(node, driver, process, keep, log)


def fleet_kubeconfig(plane: ControlPlane) -> Path:
    rendered = plane.kubectl("kustomize", str(REPO / "daemonset" / "fleet"))
    documents = [d for d in yaml.safe_load_all(rendered) if d and d["kind"] != "Deployment"]
    plane.kubectl("apply", "--server-side", "--force-conflicts", "--field-manager=bench", "-f", "-",
                  input_text=yaml.safe_dump_all(documents))
    token = plane.core.create_namespaced_service_account_token(
        "gpu-health-fleet", AGENT_NAMESPACE, {"spec": {"expirationSeconds": 7200}}).status.token
    path = plane.workdir / "fleet.kubeconfig"
    path.write_text(yaml.safe_dump(_kubeconfig(plane.url, plane.ca_file, FLEET_USER, {"token": token})))
    return path


def start_controller(kubeconfig: Path, folder: Path, identity: str) -> subprocess.Popen[bytes]:
    env = dict(os.environ, POD_NAME=identity)
    env.pop("KUBERNETES_SERVICE_HOST", None)
    with (folder / f"{identity}.log").open("wb") as stderr:
        return subprocess.Popen([sys.executable, "-m", "agent", "fleet", "run", f"--kubeconfig={kubeconfig}",
                                 "--port", "0", f"--identity={identity}", "--log-level", "warning"], env=env, stdout=subprocess.DEVNULL,
                                stderr=stderr, cwd=REPO)


def published(plane: ControlPlane, nodes: list[str]) -> int:
    listed = plane.core.list_node(label_selector="nvidia.com/gpu.present=true").items
    wanted = set(nodes)
    return sum(1 for n in listed if n.metadata.name in wanted
               and "gpu-health-agent.io/fleet-summary" in (n.metadata.annotations or {}))


def agent_requests(plane: ControlPlane, since: float) -> int:
    users = ("system:serviceaccount:gpu-health:gpu-health-agent",)
    count = 0
    for event in audit_events(plane.audit_log, user=users[0]):
        stamp = event.get("requestReceivedTimestamp", "")
        if stamp and _epoch(stamp) >= since:
            count += 1
    return count


def _epoch(stamp: str) -> float:
    from datetime import datetime  # noqa: PLC0415

    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def events(plane: ControlPlane, reason: str, since: float) -> list[Any]:
    items = plane.core.list_event_for_all_namespaces(field_selector=f"reason={reason}").items
    return [e for e in items if (e.event_time or e.last_timestamp or e.first_timestamp)
            and (e.event_time or e.last_timestamp or e.first_timestamp).timestamp() >= since - 1]


def reboot_requests(plane: ControlPlane, nodes: list[str]) -> int:
    wanted = set(nodes)
    return sum(1 for n in plane.core.list_node().items if n.metadata.name in wanted and any(
        c.type == "GpuRebootRequired" and c.status == "True" for c in n.status.conditions or []))


def evicted_pods(plane: ControlPlane, since: float) -> int:
    return len(events(plane, "EvictedForGpuFault", since))


def row(name: str, **figures: Any) -> None:
    print(f"{name:<44} " + "  ".join(f"{k}={v}" for k, v in figures.items()), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--agents", type=int, default=100)
    parser.add_argument("--rate", type=float, default=25.0, help="(f): independent faults a second")
    parser.add_argument("--more-nodes", type=int, default=4000, help="added at the end for the controller's cost")
    args = parser.parse_args()
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as name:
        folder = Path(name)
        plane = ControlPlane(folder / "controlplane").start()
        watcher = Watcher(plane)
        agents: list[AgentProcess] = []
        controller: subprocess.Popen[bytes] | None = None
        try:
            plane.apply_shipped_manifests()
            began = time.monotonic()
            nodes = add_nodes(plane, 0, args.nodes)
            row("kwok GPU nodes created", nodes=len(nodes), seconds=round(time.monotonic() - began, 1))
            threading.Thread(target=watcher.run, daemon=True).start()
            began = time.monotonic()
            for node in nodes[: args.agents]:
                agents.append(start_agent(plane, folder, node, DRIVERS[int(node.rsplit("-", 1)[1]) % 2]))
            ours = [a.node for a in agents]
            for node in ours:  # a Job's pod on each agent node, holding its eight GPUs (kwok runs it)
                add_job(plane, node)
            deadline = time.monotonic() + 60 + 3 * len(agents)
            while published(plane, ours) < len(agents) and time.monotonic() < deadline:
                dead = [a for a in agents if a.process.poll() is not None]
                if dead:
                    raise SystemExit(f"agent {dead[0].node} exited: {dead[0].log.read_text()[-1500:]}")
                time.sleep(2)
            rss = [a.rss_mib() for a in agents]
            row("agents started, each published its summary", agents=len(agents),
                published=published(plane, ours), seconds=round(time.monotonic() - began, 1),
                rss_mib_mean=round(sum(rss) / len(rss), 1), rss_mib_max=round(max(rss), 1),
                rss_gib_total=round(sum(rss) / 1024, 2))
            kubeconfig = fleet_kubeconfig(plane)
            controller = start_controller(kubeconfig, folder, "fleet-a")
            time.sleep(20)
            quiet_from = time.time()
            time.sleep(60)
            healthy = agent_requests(plane, quiet_from)
            row("healthy fleet, 60 s", agent_requests=healthy,
                per_node_per_hour=round(healthy / len(agents) * 60, 1),
                controller_rss_mib=round(_status(controller.pid, "VmRSS"), 1),
                controller_cpu_s=round(_cpu_seconds(controller.pid), 1))

            # (c) + (g): GSP timeouts on every agent node of one driver; the controller killed mid-storm.
            storm = [a for a in agents if a.driver == DRIVERS[0]]
            first = time.time()
            tainted_before = set(watcher.tainted)
            killed = False
            for k, agent in enumerate(storm):
                agent.xid(119, "18", "Timeout after 6s of waiting for RPC response from GPU0 GSP!")
                if k == len(storm) // 2 and controller is not None:
                    controller.send_signal(signal.SIGKILL)
                    controller.wait(10)
                    controller = start_controller(kubeconfig, folder, "fleet-b")
                    killed = True
                time.sleep(0.1)
            time.sleep(45)
            correlations = events(plane, "FleetCorrelation", first)
            first_event = min(((e.event_time or e.first_timestamp).timestamp() for e in correlations),
                              default=float("nan"))
            tainted = set(watcher.tainted) - tainted_before
            holds = plane.core.read_namespaced_config_map("gpu-health-fleet-holds", AGENT_NAMESPACE).data or {}
            held = json.loads(holds.get("holds.json", "[]"))
            row("(c) Xid 119 on one driver, (g) controller killed" if killed else "(c) Xid 119 on one driver",
                faulted=len(storm), tainted_ever=len(tainted & {a.node for a in storm}),
                tainted_at_end=len(watcher.now_tainted & {a.node for a in storm}),
                evicted=evicted_pods(plane, first), reboot_requests=reboot_requests(plane, [a.node for a in storm]),
                correlation_events=len(correlations),
                seconds_to_correlation=round(first_event - first, 2),
                holds=",".join(sorted(h["id"] for h in held)) or "none",
                held_nodes=max((len(h["nodes"]) for h in held), default=0),
                agent_requests_per_s=round(agent_requests(plane, first) / (time.time() - first), 1))

            # (e): a broken GPU of its own on a node inside the hold.
            inside = next((a for a in storm if a.node not in watcher.now_tainted), storm[-1])
            written = inside.xid(79, "58", "GPU has fallen off the bus.")
            while watcher.became.get(inside.node, 0.0) < written and time.time() - written < 30:
                time.sleep(0.01)
            became = watcher.became.get(inside.node, 0.0)
            row("(e) Xid 79 on a node inside the hold", node=inside.node, untainted_before=True,
                quarantined_after_s=round(became - written, 3) if became >= written else "not within 30 s")

            # (f): independent hardware faults on the other driver's nodes, RATE a second.
            others = [a for a in agents if a.driver == DRIVERS[1]]
            sent: dict[str, float] = {}
            started = time.time()
            for agent in others:
                sent[agent.node] = agent.xid(79, "38", "GPU has fallen off the bus.")
                time.sleep(max(0.0, started + len(sent) / args.rate - time.time()))
            while len(set(sent) & set(watcher.tainted)) < len(sent) and time.time() - started < 120:
                time.sleep(0.05)
            delays = sorted(watcher.tainted[n] - t for n, t in sent.items() if n in watcher.tainted)
            done = max((watcher.tainted[n] for n in sent if n in watcher.tainted), default=started)
            row("(f) independent Xid 79s", faults=len(sent), arrived_per_s=args.rate,
                quarantined=len(delays), p50_s=round(delays[len(delays) // 2], 3) if delays else "n/a",
                max_s=round(delays[-1], 3) if delays else "n/a",
                throughput_nodes_per_s=round(len(delays) / max(done - started, 1e-9), 1),
                evicted=evicted_pods(plane, started))
            if controller is not None and args.more_nodes:
                add_nodes(plane, args.nodes, args.more_nodes)
                time.sleep(30)
                row(f"controller at {args.nodes + args.more_nodes} nodes",
                    controller_rss_mib=round(_status(controller.pid, "VmRSS"), 1),
                    controller_cpu_s=round(_cpu_seconds(controller.pid), 1))
        finally:
            watcher.stop.set()
            for agent in agents:
                agent.process.terminate()
            for agent in agents:
                try:
                    agent.process.wait(15)
                except subprocess.TimeoutExpired:
                    agent.process.kill()
                os.close(agent.kmsg)
            if controller is not None:
                controller.terminate()
                controller.wait(15)
            plane.stop()


if __name__ == "__main__":
    main()
