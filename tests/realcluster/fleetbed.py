"""The fleet test bed on the real control plane: kwok GPU nodes, real agents with fake kubelets, the controller."""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from agent.k8s.podresources import PodDevices, encode_list_response
from tests.conftest import eight_gpus
from tests.realcluster.controlplane import (
    AGENT_NAMESPACE,
    FLEET_USER,
    GPU_LABEL,
    KWOK_LABEL,
    REPO,
    UNSERVED_KINDS,
    ControlPlane,
    _kubeconfig,
)

FAKE_DIR = REPO / "tests" / "fakenvml" / "build"
TAINT = "gpu-health-agent.io/unhealthy"
#: Set on the nodes that run an agent: the bench's Job is placed on them (node affinity).
AGENT_NODE_LABEL = "gpu-health-agent.io/bench-agent"
DOMAIN_SIZE = 18  # nodes per NVLink fabric domain (an NVL72 rack: 18 trays of 4 GPUs; here 18 nodes of 8)


def fleet_kubeconfig(plane: ControlPlane, *, manager: str = "gpu-health-tests", seconds: int = 3600) -> Path:
    """A kubeconfig on the fleet ServiceAccount's own token (daemonset/fleet applied, its Deployment left out),
    as the controller's pod would have it."""
    plane.apply_shipped_manifests()
    rendered = plane.kubectl("kustomize", str(REPO / "daemonset" / "fleet"))
    documents = [d for d in yaml.safe_load_all(rendered)
                 if d and d["kind"] != "Deployment" and d["kind"] not in UNSERVED_KINDS]
    plane.kubectl("apply", "--server-side", "--force-conflicts", f"--field-manager={manager}", "-f", "-",
                  input_text=yaml.safe_dump_all(documents))
    token = plane.core.create_namespaced_service_account_token(
        "gpu-health-fleet", AGENT_NAMESPACE, {"spec": {"expirationSeconds": seconds}}).status.token
    path = plane.workdir / f"fleet-{plane.unique('token')}.kubeconfig"
    path.write_text(yaml.safe_dump(_kubeconfig(plane.url, plane.ca_file, FLEET_USER, {"token": token})))
    return path


def node_name(number: int) -> str:
    return f"fleet-{number:05d}"


def node_number(name: str) -> int:
    return int(name.rsplit("-", 1)[1])


def fabric_cluster(number: int) -> str:
    """The NVLink fabric cluster UUID (32 hex digits) of the node's domain: DOMAIN_SIZE nodes each."""
    return f"{number // DOMAIN_SIZE + 1:032x}"


def add_nodes(plane: ControlPlane, numbers: Iterable[int], driver: Callable[[int], str], *,
              agent_nodes: frozenset[int] = frozenset(), threads: int = 8) -> list[str]:
    """kwok GPU nodes labelled as the GPU Operator labels them, created `threads` at a time; not waited for."""
    def create(n: int) -> str:
        name = node_name(n)
        resources = {"nvidia.com/gpu": "8", "cpu": "192", "memory": "2Ti", "pods": "110"}
        labels = {GPU_LABEL: "true", KWOK_LABEL: "kwok", "kubernetes.io/hostname": name,
                  "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3", "nvidia.com/gpu.count": "8",
                  "nvidia.com/cuda.driver-version.full": driver(n),
                  "topology.kubernetes.io/rack": f"rack-{n // DOMAIN_SIZE}",
                  "topology.kubernetes.io/zone": f"zone-{n % 3}"}
        if n in agent_nodes:
            labels[AGENT_NODE_LABEL] = "true"
        plane.core.create_node({"metadata": {"name": name, "labels": labels,
                                             "annotations": {"node.alpha.kubernetes.io/ttl": "0"}},
                                "status": {"capacity": resources, "allocatable": resources}})
        return name

    with futures.ThreadPoolExecutor(threads) as pool:
        return list(pool.map(create, numbers))


def gpu_state(number: int, driver: str, *, links_down: bool = False, fabric_status: int = 0,
              fabric_state: int = 3) -> dict[str, Any]:
    """The fake NVML state of a node: eight H100s in the node's fabric domain, NVLinks up unless told."""
    fabric = {"state": fabric_state, "status": fabric_status, "clique_id": 1, "cluster_uuid": fabric_cluster(number),
              "health_mask": 0, "health_summary": 1}
    nvlink = {"links": 18, "down": list(range(18)) if links_down else []}
    overrides = {str(i): {"fabric": fabric, "nvlink": nvlink} for i in range(8)}
    return {**eight_gpus(**overrides), "driver_version": driver}


class PodsByNode:
    """The pods of one namespace by node, listed every `seconds` (what a node's kubelet would know)."""

    def __init__(self, plane: ControlPlane, namespace: str, seconds: float = 2.0) -> None:
        self.plane, self.namespace, self.seconds = plane, namespace, seconds
        self.pods: dict[str, list[str]] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(self.seconds):
            with contextlib.suppress(Exception):
                listed: dict[str, list[str]] = {}
                for pod in self.plane.core.list_namespaced_pod(self.namespace).items:
                    if pod.spec.node_name and pod.status.phase not in {"Succeeded", "Failed"}:
                        listed.setdefault(pod.spec.node_name, []).append(pod.metadata.name)
                self.pods = listed


class FakeKubelet:
    """A node's kubelet PodResources socket (gRPC List): every pod of `namespace` on the node holds its eight
    GPUs. kwok has no kubelet, so this stands in for it."""

    def __init__(self, socket: Path, node: str, gpus: list[str], pods: PodsByNode) -> None:
        import grpc

        self.socket = socket
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
        handler = grpc.method_handlers_generic_handler("v1.PodResourcesLister", {
            "List": grpc.unary_unary_rpc_method_handler(
                lambda request, context: [PodDevices(pods.namespace, name, {"nvidia.com/gpu": gpus})
                                          for name in pods.pods.get(node, [])],
                request_deserializer=lambda data: data, response_serializer=encode_list_response)})
        self.server.add_generic_rpc_handlers((handler,))
        self.server.add_insecure_port(f"unix://{socket}")
        self.server.start()


@dataclass
class AgentProcess:
    """One real `gpu-health-agent run` as the agent of a kwok node."""

    node: str
    driver: str
    home: Path
    process: subprocess.Popen[bytes]
    kmsg: int  # the FIFO, held open for writing
    kubelet: FakeKubelet
    seq: int = 0

    @property
    def number(self) -> int:
        return node_number(self.node)

    def xid(self, code: int, bus: str, message: str, pid: int = 4_190_000) -> float:
        """One NVRM Xid record into the agent's kernel log; returns when it was written (time.time())."""
        self.seq += 1
        stamp = int(time.monotonic() * 1e6)
        record = f"4,{self.seq},{stamp},-;NVRM: Xid (PCI:0000:{bus}:00): {code}, pid={pid}, name=python3, {message}\n"
        written = time.time()
        os.write(self.kmsg, record.encode())
        return written

    def nvml(self, **state: Any) -> None:
        """Replace the fake NVML state atomically (the library re-reads it at the next call)."""
        temporary = self.home / "nvml.tmp"
        temporary.write_text(json.dumps(gpu_state(self.number, self.driver, **state)))
        os.replace(temporary, self.home / "nvml.json")

    def steps(self, since: float, rule: str = "") -> dict[str, int]:
        """The remediation steps its journal records as applied since `since` (wall clock), by kind; only
        those of `rule` if given."""
        try:
            with contextlib.closing(sqlite3.connect(f"file:{self.home / 'journal.db'}?mode=ro", uri=True,
                                                    timeout=5)) as db:
                rows = db.execute("SELECT kind, COUNT(*) FROM actions WHERE at >= ? AND result = 'applied'"
                                  " AND (? = '' OR rule_id = ?) GROUP BY kind", (since, rule, rule)).fetchall()
        except sqlite3.Error:
            return {}
        return {str(kind): int(count) for kind, count in rows}

    def rss_mib(self) -> float:
        return proc_status(self.process.pid, "VmRSS")

    def log_tail(self) -> str:
        return (self.home / "agent.log").read_text(errors="replace")[-1500:]


def start_agent(plane: ControlPlane, folder: Path, node: str, driver: str, pods: PodsByNode,
                kubeconfig: Path, *, mode: str = "remediate") -> AgentProcess:
    home = folder / node
    home.mkdir()
    state = gpu_state(node_number(node), driver)
    (home / "nvml.json").write_text(json.dumps(state))
    kubelet = FakeKubelet(home / "kubelet.sock", node, [str(g["uuid"]) for g in state["gpus"]], pods)
    kmsg = home / "kmsg"
    os.mkfifo(kmsg)
    keep = os.open(kmsg, os.O_RDWR | os.O_NONBLOCK)
    env = dict(os.environ, LD_LIBRARY_PATH=str(FAKE_DIR), FAKE_NVML_STATE=str(home / "nvml.json"), NODE_NAME=node,
               POD_NAME=f"gpu-health-agent-{node}", POD_NAMESPACE=AGENT_NAMESPACE,
               GPU_HEALTH_SOURCES__KMSG__ENABLED="on", GPU_HEALTH_SOURCES__KMSG__PATH=str(kmsg),
               GPU_HEALTH_SOURCES__NVML__ENABLED="on", GPU_HEALTH_SOURCES__DCGM__ENABLED="off",
               GPU_HEALTH_REMEDIATION__POD_RESOURCES_SOCKET=str(kubelet.socket),
               GPU_HEALTH_JOURNAL_PATH=str(home / "journal.db"), GPU_HEALTH_HTTP__HOST="127.0.0.1",
               GPU_HEALTH_LOG__LEVEL="warning", GPU_HEALTH_LOG__FORMAT="json", GPU_HEALTH_MODE=mode,
               KUBECONFIG=str(kubeconfig))
    env.pop("KUBERNETES_SERVICE_HOST", None)
    with (home / "agent.log").open("wb") as stderr:
        process = subprocess.Popen([sys.executable, "-m", "agent", "run", "--port", "0"], env=env,
                                   stdout=subprocess.DEVNULL, stderr=stderr, cwd=REPO)
    return AgentProcess(node, driver, home, process, keep, kubelet)


def stop_agents(agents: list[AgentProcess]) -> None:
    for agent in agents:
        agent.process.terminate()
    for agent in agents:
        try:
            agent.process.wait(15)
        except subprocess.TimeoutExpired:
            agent.process.kill()
        os.close(agent.kmsg)
        agent.kubelet.server.stop(0)


def start_controller(kubeconfig: Path, folder: Path, identity: str) -> subprocess.Popen[bytes]:
    env = dict(os.environ, POD_NAME=identity)
    env.pop("KUBERNETES_SERVICE_HOST", None)
    with (folder / f"{identity}.log").open("wb") as stderr:
        return subprocess.Popen([sys.executable, "-m", "agent", "fleet", "run", f"--kubeconfig={kubeconfig}",
                                 "--port", "0", "--health-port", "0", f"--identity={identity}", "--log-level",
                                 "warning"],
                                env=env, stdout=subprocess.DEVNULL, stderr=stderr, cwd=REPO)


@dataclass
class TaintWatch:
    """Every change of the agents' node taint, from one admin watch of the Nodes."""

    plane: ControlPlane
    #: node -> when it last went from untainted to tainted (time.time())
    became: dict[str, float] = field(default_factory=dict)
    now_tainted: set[str] = field(default_factory=set)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        from kubernetes import watch

        while not self.stop.is_set():
            stream = watch.Watch()
            try:
                for event in stream.stream(self.plane.core.list_node, label_selector=AGENT_NODE_LABEL,
                                           timeout_seconds=30):
                    node = event["object"]
                    name = node.metadata.name
                    if any(t.key == TAINT for t in node.spec.taints or []):
                        if name not in self.now_tainted:
                            self.became[name] = time.time()
                        self.now_tainted.add(name)
                    else:
                        self.now_tainted.discard(name)
                    if self.stop.is_set():
                        break
            except Exception:  # a benchmark's watch: re-open it
                time.sleep(0.5)

    def tainted_since(self, since: float, nodes: Iterable[str]) -> set[str]:
        return {n for n in nodes if self.became.get(n, 0.0) >= since}


def proc_status(pid: int, key: str) -> float:
    """A /proc/PID/status field in kB, as MiB (0 when the process is gone)."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) / 1024
    return 0.0


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def mem_available_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return 0.0
