#!/usr/bin/env python3
"""Prints the time from a fault's appearance in the kernel log to the agent's taint being visible through
the API (p50, p99 over >= 200 faults), and the API requests a healthy node makes per hour.

The whole agent runs in this process: the kmsg source tails a pipe standing in for /dev/kmsg, NVML is the
fake library (8 GPUs), and the Kubernetes actuators talk over HTTP to the fake API server, or with `--real`
over HTTPS to the real control plane of tests/realcluster (kube-apiserver 1.37.2, etcd, kwok; built by
scripts/build-controlplane), with the agent's own ServiceAccount token under the shipped RBAC and policy.
"Visible" is when a watch on the node delivers it tainted (the real server), as a scheduler would see it.
Targets: p99 <= 50 ms; 0 writes per healthy node per hour.

With `--real --npd`, node-problem-detector's row follows on the same control plane, once the agent has
stopped (they never share the CPU): NPD, built from the Go module proxy by bench_storm's build_npd, runs its
system-log monitor (filelog plugin, stock kernel rules) on a syslog-format kernel log this script appends to,
with the k8s exporter on (admin kubeconfig, --hostname-override the benchmark node). Its Xid 79 rules are
permanent and set the node condition XidError. A permanent condition only changes (and NPD only patches the
node) when its status or reason changes, and never clears by itself, so the Xid 79 lines alternate between
two rules: fault n ends in "fault n", an even n matches reason Xid79Even, an odd n Xid79Odd. The first fault
turns XidError False -> True, later ones turn its reason over; all go one way through NPD (the log watcher's
500 ms poll, the rule match, the condition manager's 1 s sync tick, PATCH nodes/status).
Measured: from the write of the line to the watch on the node delivering XidError True with that fault's
reason, for at most NPD_FAULTS faults, once NPD's initial XidError False has reached the node. Before each
write the script sleeps a random 0-1 s, so the write does not fall at a fixed phase of NPD's sync tick (which
it would right after the previous patch). NPD starts that tick a few ms before its log watcher's first poll,
so each poll follows a tick by those few ms, and a line read at the poll just after a tick waits nearly a
whole second: a fault written U s after a tick shows 1 - U s later if U < 0.5, 2 - U if not (seen per fault
here; mean 1 s). That is a freshly started NPD, at its slowest phase; the two loops drift apart only by the
poll's timer overshoot, so a long-running NPD sits at a mean between this 1 s and 0.5 s (0.75 s over all
phases); restarting it here would only set the same phase again. The filelog poll is NPD's way of
following a syslog file; its kmsg plugin reads /dev/kmsg itself (a fixed path: it cannot be pointed at this
script's pipe) and has no such poll. NPD uses the admin kubeconfig, the agent its own ServiceAccount token.
With `--npd-source DIR` (a checkout of NPD carrying `vendor/`, e.g. its main branch), that tree is built too
(bench_storm's build_npd_source) and measured after the release, on the same control plane, one at a time.
Usage: scripts/bench_latency.py [--real [--npd [--npd-source DIR]]] [FAULTS] [HEALTHY_SECONDS]
"""

from __future__ import annotations

import ctypes
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from prometheus_client import CollectorRegistry  # noqa: E402

from agent.cluster_side import build_cluster_side  # noqa: E402
from agent.config import Config, load_config  # noqa: E402
from agent.daemon import Daemon  # noqa: E402
from agent.engine import builtin_rules_dir, load_rules  # noqa: E402
from agent.fleetapi.brake_claims import claim_name  # noqa: E402
from agent.k8s.client import client_for  # noqa: E402
from agent.logs import configure_logging  # noqa: E402
from agent.model import NodeInventory, Observation, PodRef, Signal  # noqa: E402
from agent.simulation.fake_apiserver import FakeApiServer, FakeCluster, populate  # noqa: E402
from agent.simulation.fake_apiserver.resources import RESOURCES  # noqa: E402
from tests.conftest import eight_gpus  # noqa: E402

sys.path.insert(0, str(REPO / "scripts"))
from bench_storm import BuiltNpd, build_npds, free_port, npd_kernel_monitor, syslog_line  # noqa: E402

NODE = "bench-node"
NPD_CONDITION = "XidError"
NPD_REASONS = ("Xid79Even", "Xid79Odd")
NPD_FAULTS = 100
LEASES = next(r for r in RESOURCES if r.plural == "leases")


class FakeBackend:
    """The fake API server in this process: the node as the agent's writes leave it, its request log."""

    name = "fake API server"

    def __init__(self, inventory: NodeInventory) -> None:
        self.cluster = FakeCluster()
        populate(self.cluster, inventory)
        self.server = FakeApiServer(self.cluster).start()
        self.agent_client = client_for(self.server.url)

    def node(self) -> dict[str, Any]:
        return self.cluster.node(NODE)

    def wait_tainted(self, wanted: bool, started: float, timeout: float) -> float | None:
        """Seconds from `started` until the node's taint is as wanted (read in this process's memory)."""
        while bool(self.node()["spec"].get("taints")) is not wanted:
            if time.perf_counter() - started > timeout:
                return None
            time.sleep(0.0005)
        return time.perf_counter() - started

    def counts(self) -> tuple[int, int]:
        return self.cluster.faults.requests, self.cluster.faults.writes

    def claim_exists(self) -> bool:
        """The node's claim on the quarantine brake is there."""
        return any(lease["metadata"]["name"] == claim_name(NODE)
                   for lease in self.cluster.list_objects(LEASES, "gpu-health"))

    def calls_since(self, start: int) -> list[str]:
        return [f"{method} {path}" for method, path, _ in self.cluster.log[start:]]

    def mark(self) -> int:
        return len(self.cluster.log)

    def stop(self) -> None:
        self.server.stop()


class RealBackend:
    """The real control plane, started in a temporary directory; the agent uses its own token."""

    name = "real kube-apiserver 1.37.2"

    def __init__(self, inventory: NodeInventory, folder: Path) -> None:
        from tests.realcluster.backend import RealCluster, RealServer  # noqa: PLC0415 - only with --real
        from tests.realcluster.controlplane import ControlPlane  # noqa: PLC0415
        self.plane = ControlPlane(folder / "controlplane").start()
        self.plane.apply_shipped_manifests()
        self.cluster = RealCluster(self.plane)
        self.cluster.populate(inventory)
        self.agent_client = RealServer(self.plane).agent_client(NODE)
        # A watch on the node, as a scheduler or controller sees the taint arrive: polling the server every
        # half millisecond would itself take a core of this 2-core machine from the agent and the server.
        self.changed = threading.Condition()
        self.tainted = bool(self.node()["spec"].get("taints"))
        self.changed_at = 0.0
        self.condition = ("", "")  # (status, reason) of the node's NPD_CONDITION, as the watch last saw it
        self.condition_at = 0.0
        self.stopped = False
        threading.Thread(target=self._watch, daemon=True).start()

    def node(self) -> dict[str, Any]:
        return self.cluster.node(NODE)

    def _watch(self) -> None:
        while not self.stopped:
            try:
                self._follow()
            except Exception:  # noqa: BLE001 - the server went away (the benchmark ends) or cut the watch
                time.sleep(0.1)

    def _follow(self) -> None:
        response = self.plane.core.list_node(field_selector=f"metadata.name={NODE}", watch=True,
                                             timeout_seconds=300, _preload_content=False)
        buffer = b""
        for chunk in response.stream(4096, decode_content=True):
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                event = json.loads(line)
                node = event.get("object", {})
                tainted = bool(node.get("spec", {}).get("taints"))
                conditions = node.get("status", {}).get("conditions") or []
                condition = next(((str(c.get("status")), str(c.get("reason"))) for c in conditions
                                  if c.get("type") == NPD_CONDITION), ("", ""))
                with self.changed:
                    now = time.perf_counter()
                    if tainted is not self.tainted:
                        self.tainted, self.changed_at = tainted, now
                        self.changed.notify_all()
                    if condition != self.condition:
                        self.condition, self.condition_at = condition, now
                        self.changed.notify_all()

    def wait_tainted(self, wanted: bool, started: float, timeout: float) -> float | None:
        """Seconds from `started` until the watch delivered the node with its taint as wanted."""
        with self.changed:
            if not self.changed.wait_for(lambda: self.tainted is wanted, timeout=timeout):
                return None
            return self.changed_at - started

    def wait_condition(self, wanted: tuple[str, str], started: float, timeout: float) -> float | None:
        """Seconds from `started` until the watch delivered the node with NPD_CONDITION's (status, reason)."""
        with self.changed:
            if not self.changed.wait_for(lambda: self.condition == wanted, timeout=timeout):
                return None
            return self.condition_at - started

    def counts(self) -> tuple[int, int]:
        return len(self.cluster.log), self.cluster.faults.writes

    def claim_exists(self) -> bool:
        """The node's claim on the quarantine brake is there (read as the admin)."""
        from kubernetes import client  # noqa: PLC0415 - only with --real
        leases = client.CoordinationV1Api(self.plane.admin).list_namespaced_lease("gpu-health").items
        return any(lease.metadata.name == claim_name(NODE) for lease in leases)

    def calls_since(self, start: int) -> list[str]:
        return [f"{verb} {path}" for verb, path, _ in self.cluster.log[start:]]

    def mark(self) -> int:
        return len(self.cluster.log)

    def stop(self) -> None:
        self.stopped = True
        self.plane.stop()


def figures(delays: list[float]) -> str:
    """p50, p99 and max of the sorted `delays`, in ms."""
    p99 = delays[min(len(delays) - 1, int(len(delays) * 0.99))]
    return (f"p50 {statistics.median(delays) * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms, "
            f"max {delays[-1] * 1e3:.1f} ms")


def npd_body(n: int) -> str:
    """Fault n's Xid 79 line, as the NVIDIA driver writes it, ending in its number."""
    return f"NVRM: Xid (PCI:0000:18:00): 79, pid=1, name=x, GPU has fallen off the bus, fault {n}"


def npd_rules() -> list[dict[str, str]]:
    """Two permanent Xid 79 rules for NPD_CONDITION: even-numbered faults, odd-numbered faults."""
    return [{"type": "permanent", "condition": NPD_CONDITION, "reason": reason,
             "pattern": rf"NVRM: Xid \(PCI:[0-9a-fA-F:.]+\): 79,.* fault \d*[{digits}]"}
            for reason, digits in zip(NPD_REASONS, ("02468", "13579"), strict=True)]


def start_npd(built: BuiltNpd, backend: RealBackend, log: Path) -> subprocess.Popen[bytes]:
    """NPD following `log`, once its initial condition has reached the node."""
    log.touch()
    config = log.with_suffix(".npd.json")
    conditions = [{"type": NPD_CONDITION, "reason": "NoXidError", "message": "no Xid error seen"}]
    config.write_text(json.dumps(npd_kernel_monitor(log, built.stock_rules, conditions, npd_rules()), indent=1))
    apiserver = f"{backend.plane.url}?inClusterConfig=false&auth={backend.plane.admin_kubeconfig}"
    env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
    with log.with_suffix(".npd.stderr").open("ab") as stderr:
        npd = subprocess.Popen([str(built.binary), f"--config.system-log-monitor={config}",
                                f"--apiserver-override={apiserver}", f"--hostname-override={NODE}",
                                "--address=127.0.0.1", f"--port={free_port()}", "--prometheus-address=127.0.0.1",
                                f"--prometheus-port={free_port()}", "--logtostderr"],
                               stdout=subprocess.DEVNULL, stderr=stderr, env=env)
    if backend.wait_condition(("False", "NoXidError"), time.perf_counter(), 60.0) is None:
        stop_npd(npd)
        raise RuntimeError(f"NPD's condition never reached the node; see {log.with_suffix('.npd.stderr')}")
    return npd


def stop_npd(npd: subprocess.Popen[bytes]) -> None:
    """Terminate NPD and wait for it."""
    npd.terminate()
    try:
        npd.wait(10)
    except subprocess.TimeoutExpired:
        npd.kill()
        npd.wait()


def measure_npds(backend: RealBackend, folder: Path, faults: int, agent_p50: float, source: Path | None) -> None:
    """NPD's rows on the same control plane: the release, then the checkout `source` if given, one at a time."""
    workdir = folder / "npd"  # its module source, binaries, configs, logs and stderr; removed once measured
    workdir.mkdir()
    for built in build_npds(workdir, source=source):
        measure_npd(backend, built, workdir, faults, agent_p50)
    shutil.rmtree(workdir)


def measure_npd(backend: RealBackend, built: BuiltNpd, workdir: Path, faults: int, agent_p50: float) -> None:
    """One NPD build's row, as the module docstring says; prints it and the p50 ratio."""
    count = min(faults, NPD_FAULTS)
    log = workdir / f"kern-{built.label}.log"
    try:
        npd = start_npd(built, backend, log)
    except RuntimeError as error:
        print(f"# NPD not measured: {error}")
        return
    delays = []
    jitter = random.Random(14)  # noqa: S311 - a phase for each write, not a secret
    try:
        with log.open("a", encoding="utf-8") as writer:
            for n in range(count):
                time.sleep(jitter.uniform(0.0, 1.0))
                started = time.perf_counter()
                writer.write(syslog_line(npd_body(n), time.time()))
                writer.flush()
                delay = backend.wait_condition(("True", NPD_REASONS[n % 2]), started, 10.0)
                if delay is not None and delay >= 0:  # a negative one: the previous fault never showed
                    delays.append(delay)
    finally:
        stop_npd(npd)
    if not delays:
        print(f"# NPD not measured: no fault's condition reached the node; see {log.with_suffix('.npd.stderr')}")
        return
    delays.sort()
    print("# NPD freshly started: its 500 ms log poll follows its 1 s condition sync by a few ms, its slowest "
          "phase (see the docstring)")
    print(f"node-problem-detector {built.version}: kernel-log Xid 79 -> condition visible through the API: "
          f"{figures(delays)} over {len(delays)} of {count} faults")
    print(f"agent / NPD {built.version} p50: {agent_p50 / statistics.median(delays):.3f}")


def start_agent(config: Config, backend: FakeBackend | RealBackend) -> tuple[Daemon, threading.Event,
                                                                            threading.Thread]:
    """The whole agent on a thread of this process, two seconds after its start (its watches listed)."""
    daemon = Daemon(config, rules=load_rules(builtin_rules_dir()), registry=CollectorRegistry(),
                    cluster_of=partial(build_cluster_side, backend.agent_client, config, on_stuck=lambda pod: None))
    stop = threading.Event()
    thread = threading.Thread(target=daemon.run, args=(stop,), daemon=True)
    thread.start()
    time.sleep(2.0)
    return daemon, stop, thread


def main() -> None:
    argv = sys.argv[1:]
    source = None
    if "--npd-source" in argv:
        at = argv.index("--npd-source")
        if at + 1 >= len(argv):
            sys.exit("--npd-source needs a directory")
        source = Path(argv[at + 1])
        del argv[at:at + 2]
    args = [a for a in argv if a not in ("--real", "--npd")]
    real = "--real" in argv
    npd = "--npd" in argv
    if npd and not real:
        sys.exit("--npd needs --real")
    if source is not None and not npd:
        sys.exit("--npd-source needs --real --npd")
    faults = int(args[0]) if args else 200
    healthy_seconds = float(args[1]) if len(args) > 1 else 60.0
    configure_logging("error")
    folder = Path(tempfile.mkdtemp())
    state = folder / "nvml.json"
    state.write_text(json.dumps(eight_gpus()))
    os.environ["FAKE_NVML_STATE"] = str(state)
    ctypes.CDLL(str(REPO / "tests/fakenvml/build/libnvidia-ml.so.1"), mode=os.RTLD_NOW | ctypes.RTLD_GLOBAL)
    kmsg = folder / "kmsg"
    os.mkfifo(kmsg)
    writer = os.open(kmsg, os.O_RDWR | os.O_NONBLOCK)

    gpus = [g for g in eight_gpus()["gpus"]]  # type: ignore[union-attr]
    pods = tuple(PodRef("ml", f"trainer-{i}", f"u{i}", (str(g["uuid"]),)) for i, g in enumerate(gpus))
    inventory = NodeInventory(NODE, (), pods)
    backend = RealBackend(inventory, folder) if real else FakeBackend(inventory)
    env = {"NODE_NAME": NODE, "GPU_HEALTH_JOURNAL_PATH": str(folder / "j.db"), "GPU_HEALTH_MODE": "quarantine",
           "GPU_HEALTH_SOURCES__KMSG__PATH": str(kmsg), "GPU_HEALTH_SOURCES__KMSG__ADMIT_USER_RECORDS": "true",
           "GPU_HEALTH_SOURCES__DCGM__ENABLED": "off", "GPU_HEALTH_TICK_SECONDS": "0.2"}
    faulted = [0]  # kernel records written so far (each needs the next sequence number)

    def fault_and_release(daemon: Daemon) -> float | None:
        """One Xid 79 line; the seconds until its taint was visible (None: not within 5 s); then released."""
        n = faulted[0]
        faulted[0] += 1
        gpu = gpus[n % 8]
        bus = str(gpu["pci"]).split(":", 1)[1][:5].lower()
        started = time.perf_counter()
        os.write(writer, f"4,{n + 1},{n},-;NVRM: Xid (PCI:0000:{bus}): 79, pid=1, name=x, fault {n}\n".encode())
        delay = backend.wait_tainted(True, started, 5.0)
        daemon.emit(Observation(Signal.OPERATOR_RELEASE, 1, time.time(), "bench"))
        backend.wait_tainted(False, time.perf_counter(), 5.0)
        return delay if delay is not None and delay >= 0 else None  # negative: the last release not shown yet

    config = load_config(None, env=env)
    daemon, stop, thread = start_agent(config, backend)
    delays = sorted(d for d in (fault_and_release(daemon) for _ in range(faults)) if d is not None)
    print(f"{backend.name}: kernel-log fault -> taint visible through the API: {figures(delays)} "
          f"over {len(delays)} of {faults} faults (one after another: the brake's claim made at the first "
          f"is held for its window and ranked again with no request)")

    time.sleep(5.0)  # let the last recovery finish (untaint, conditions, state annotation, budget slot)
    log_start = backend.mark()
    requests0, writes0 = backend.counts()
    time.sleep(healthy_seconds)
    per_hour = 3600 / healthy_seconds
    requests1, writes1 = backend.counts()
    print(f"healthy node: {(requests1 - requests0) * per_hour:.0f} API requests per hour, "
          f"{(writes1 - writes0) * per_hour:.0f} writes per hour "
          f"(measured over {healthy_seconds:.0f} s; reads are the node sync every "
          f"{config.remediation.node_sync_seconds:g} s)")
    calls: dict[str, int] = {}
    for call in backend.calls_since(log_start):
        calls[call] = calls.get(call, 0) + 1
    for call, count in sorted(calls.items()):
        print(f"  {count:4d} x {call}")
    stop.set()
    thread.join(10)

    # A lone fault, as on a node that had none within the brake's window: a new claim is created and ranked
    # (from the claims watch) before the taint. The agent restarted with a 2-s window, so that each claim is
    # given back between faults (its first pass deletes the one the earlier process left).
    lone = max(20, faults // 5)
    config = load_config(None, env={**env, "GPU_HEALTH_REMEDIATION__BRAKE_WINDOW_SECONDS": "2"})
    daemon, stop, thread = start_agent(config, backend)
    lone_delays = []
    for _ in range(lone):
        deadline = time.monotonic() + 10.0
        while backend.claim_exists() and time.monotonic() < deadline:
            time.sleep(0.5)
            daemon.pipeline.wake.set()  # a pass now, not at the next node sync: its tidy gives the claim back
        if backend.claim_exists():
            continue
        delay = fault_and_release(daemon)
        if delay is not None:
            lone_delays.append(delay)
    lone_delays.sort()
    print(f"{backend.name}: a lone fault (no claim held: created and ranked first) -> taint visible: "
          f"{figures(lone_delays)} over {len(lone_delays)} of {lone} faults")
    stop.set()
    thread.join(10)
    if npd and isinstance(backend, RealBackend):
        measure_npds(backend, folder, faults, statistics.median(delays), source)
    backend.stop()


if __name__ == "__main__":
    main()
