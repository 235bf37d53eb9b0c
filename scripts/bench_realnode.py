#!/usr/bin/env python3
"""The eviction on the real node, measured: from an Xid 79 written into the fake NVML's state to the trainer's
container receiving the kubelet's SIGTERM, over RUNS faults (default 20), p50/p99; then the agent's RSS in its
pod beside scripts/bench_memory.py's cluster-mode figure (with --bench-memory).

The node is tests/realnode's (containerd, the kubelet, the fake device plugin, the image built from the
Dockerfile by scripts/build-image) and the agent is installed from the kustomize base with the tests' overlay
in `remediate` mode. Between faults the agent's fault is released as an operator would (`gpu-health-agent
release`, with the node sync at 1 s) and the next fault goes to the next GPU; the trainers tolerate the
agent's taint so that a new one can start while the node is still quarantined. Needs root and what
scripts/build-node builds. Usage: scripts/bench_realnode.py [RUNS] [--bench-memory]
"""

from __future__ import annotations

import contextlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kubernetes.client.exceptions import ApiException  # noqa: E402

from tests.conftest import FakeNvml, eight_gpus  # noqa: E402
from tests.realcluster.controlplane import ControlPlane  # noqa: E402
from tests.realnode import agent  # noqa: E402
from tests.realnode.agent import IMAGE_NAME  # noqa: E402
from tests.realnode.conftest import PAUSE_IMAGE  # noqa: E402
from tests.realnode.node import AGENT_STATE, NODE_NAME, RealNode  # noqa: E402
from tests.realnode.runtime import Containerd, wait_until  # noqa: E402

GPU_UUIDS = [str(gpu["uuid"]) for gpu in eight_gpus()["gpus"]]  # type: ignore[index, union-attr]
# The agent's limits on repeated disruption would stop a benchmark after three faults in an hour.
BENCH_ENV = {"GPU_HEALTH_REMEDIATION__NODE_SYNC_SECONDS": "1", "GPU_HEALTH_REMEDIATION__MAX_ATTEMPTS_PER_HOUR": "1000",
             "GPU_HEALTH_REMEDIATION__COOLDOWN_SECONDS": "0"}


def trainer(node: RealNode, image: str, name: str, signals: Path) -> str:
    """A pod holding one GPU that writes the wall-clock time of the SIGTERM stopping it, then exits."""
    node.plane.core.create_namespaced_pod("trainers", {
        "metadata": {"name": name},
        "spec": {"hostNetwork": True, "nodeSelector": {"kubernetes.io/hostname": NODE_NAME},
                 "terminationGracePeriodSeconds": 5, "restartPolicy": "Never",
                 "tolerations": [{"key": "gpu-health-agent.io/unhealthy", "operator": "Exists"}],
                 "containers": [{"name": "main", "image": image, "imagePullPolicy": "Never",
                                 "command": ["/usr/bin/python3", "-c",
                                             "import os, signal, time\n"
                                             "print('devices', os.environ.get('NVIDIA_VISIBLE_DEVICES'), flush=True)\n"
                                             "def stop(*_):\n"
                                             f"    open('/signals/{name}', 'w').write(repr(time.time()))\n"
                                             "    os._exit(143)\n"
                                             "signal.signal(signal.SIGTERM, stop)\n"
                                             "time.sleep(3600)\n"],
                                 "volumeMounts": [{"name": "signals", "mountPath": "/signals"}],
                                 "resources": {"limits": {"nvidia.com/gpu": "1"}}}],
                 "volumes": [{"name": "signals", "hostPath": {"path": str(signals), "type": "DirectoryOrCreate"}}]}})

    def given() -> str:
        log = str(node.plane.core.read_namespaced_pod_log(name, "trainers")) \
            if node.plane.core.read_namespaced_pod(name, "trainers").status.phase == "Running" else ""
        return log.split()[1] if log.startswith("devices") else ""

    return str(wait_until(given, f"trainer {name} running", timeout=60))


def one_fault(node: RealNode, nvml: FakeNvml, image: str, run: int, signals: Path) -> float:
    name = f"t{run}"
    uuid = str(trainer(node, image, name, signals))
    state = eight_gpus()
    state["events"] = [{"id": 1000 + run, "gpu": GPU_UUIDS.index(uuid), "type": 8, "data": 79,
                        "gi": 4294967295, "ci": 4294967295}]
    start = time.time()
    nvml.write(state)
    stopped = wait_until(lambda: (signals / name).exists() and (signals / name).read_text(), "the SIGTERM", timeout=60)
    seconds = float(stopped) - start
    nvml.write(eight_gpus())
    subprocess.run([sys.executable, "-m", "agent", "release", f"--node={NODE_NAME}",
                    f"--kubeconfig={node.plane.admin_kubeconfig}"], check=True, capture_output=True, cwd=REPO)

    def released() -> bool:
        return not any(t.key.startswith("gpu-health-agent.io/") for t in node.node().spec.taints or [])

    wait_until(released, "the release applied (the agent's taint gone)", timeout=60)
    with contextlib.suppress(ApiException):  # evicted: gone already, or still terminating
        node.plane.core.delete_namespaced_pod(name, "trainers", grace_period_seconds=0)
    return seconds


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    runs = int(args[0]) if args else 20
    archive = subprocess.run([str(REPO / "scripts" / "build-image")], check=True, capture_output=True,
                             text=True).stdout.strip().splitlines()[-1]
    with tempfile.TemporaryDirectory(prefix="bench-realnode-") as name:
        work = Path(name)
        nvml = FakeNvml(work / "nvml-state.json")
        nvml.write(eight_gpus())
        runtime = Containerd(work / "containerd", work / "logs", PAUSE_IMAGE)
        plane = ControlPlane(work / "plane", extra_controllers=("daemonset", "garbage-collector"))
        node: RealNode | None = None
        try:
            runtime.start()
            image = runtime.import_image(Path(archive), IMAGE_NAME)
            runtime.import_image(REPO / "tests" / "realnode" / "bin" / "pause-image.tar", PAUSE_IMAGE.rsplit(":", 1)[0])
            plane.start()
            (work / "node").mkdir()
            node = RealNode(work / "node", plane, runtime, nvml.path, image).start()
            plane.ensure_namespace("trainers")
            directory, port = agent.overlay(work / "overlay", plane, nvml.path, "remediate", env=BENCH_ENV)
            agent.install(plane, directory)
            pod = wait_until(lambda: next((p for p in agent.agent_pods(plane) if p.status.container_statuses
                                           and all(c.ready for c in p.status.container_statuses)), None),
                             "the agent's pod Ready", timeout=120)
            print("sources up: " + ", ".join(line.split("{", 1)[1] for line in agent.metrics(port).splitlines()
                                             if line.startswith("gpu_health_source_up{")))
            seconds = sorted(one_fault(node, nvml, image, run, work / "signals") for run in range(runs))
            p99 = seconds[min(len(seconds) - 1, round(0.99 * (len(seconds) - 1)))]
            print(f"fault -> container killed (Xid 79 in the fake NVML's state to the trainer's SIGTERM), {runs} runs: "
                  f"p50 {statistics.median(seconds):.2f} s, p99 {p99:.2f} s, min {seconds[0]:.2f} s, "
                  f"max {seconds[-1]:.2f} s")
            pid = agent.agent_pid(node, pod)
            rss = next(line.split()[1] for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                       if line.startswith("VmRSS"))
            print(f"the agent's RSS in its pod (cluster mode, remediate, after {runs} faults): "
                  f"{int(rss) / 1024:.1f} MiB - target <= 64 MiB")
            grpcio = "cygrpc" in Path(f"/proc/{pid}/maps").read_text()  # grpcio's native module, mapped once imported
            print(f"grpcio loaded in the agent's process: {'yes' if grpcio else 'no'}")
        finally:
            if node is not None:
                node.stop()
            plane.stop()
            runtime.stop()
            shutil.rmtree(AGENT_STATE, ignore_errors=True)
    if "--bench-memory" in sys.argv:
        done = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_memory.py")], capture_output=True,
                              text=True, check=True)
        print("bench_memory: " + next(line for line in done.stdout.splitlines() if line.startswith("cluster mode")))


if __name__ == "__main__":
    main()
