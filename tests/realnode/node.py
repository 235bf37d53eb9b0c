"""A real node for the tests: the kubelet (tests/realnode/bin, scripts/build-node) registered to the suite's
control plane as node 127.0.0.1, over containerd (runtime.py), with the fake device plugin advertising the
fake NVML's GPUs. One per machine (a lock): the kubelet's paths under /var/lib/kubelet are fixed. Stopped
in the order the kubelet needs (it does not stop containers when it exits)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import ssl
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from tests.realcluster.controlplane import ControlPlane, free_port
from tests.realnode.runtime import REPO, Containerd, NodeError, Process, spawn, wait_until

BIN = REPO / "tests" / "realnode" / "bin"
NODE_NAME = "127.0.0.1"  # the kubelet refuses a loopback node IP unless the node is named by it
KUBELET_ROOT = Path("/var/lib/kubelet")  # device plugins register under it whatever --root-dir says
DEVICE_PLUGINS = KUBELET_ROOT / "device-plugins"
POD_RESOURCES = KUBELET_ROOT / "pod-resources" / "kubelet.sock"
AGENT_STATE = Path("/var/lib/gpu-health-agent")  # the DaemonSet's state hostPath: survives runs, so wiped
LOCK = Path("/run/gpu-health-agent-realnode.lock")
GPU_RESOURCE = "nvidia.com/gpu"
NODE_LABELS = {"nvidia.com/gpu.present": "true"}


def kubelet_config(containerd: Containerd, workdir: Path, ca_file: Path) -> dict[str, Any]:
    """The KubeletConfiguration this kind of machine needs (docs/testing.md, "The real node")."""
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
        "failCgroupV1": False,  # these machines mount cgroup v1, which 1.37 refuses by default
        "cgroupDriver": "cgroupfs", "containerRuntimeEndpoint": f"unix://{containerd.socket}",
        "address": "127.0.0.1", "port": free_port(), "healthzBindAddress": "127.0.0.1",
        "healthzPort": free_port(), "readOnlyPort": 0, "failSwapOn": False,
        "podLogsDir": str(workdir / "pod-logs"),
        # The API server has no kubelet client certificate: anonymous, AlwaysAllow, on loopback only.
        "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False},
                           "x509": {"clientCAFile": str(ca_file)}},
        "authorization": {"mode": "AlwaysAllow"},
        # Never collect images (the benchmark imports its own, which cannot be pulled back); a small disk must
        # not evict pods.
        "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
        "evictionHard": {"memory.available": "50Mi", "nodefs.available": "1%", "nodefs.inodesFree": "1%",
                         "imagefs.available": "1%"},
        "resolvConf": "/etc/resolv.conf", "serializeImagePulls": False,
        "nodeStatusUpdateFrequency": "2s", "syncFrequency": "5s",
    }


class RealNode:
    """containerd, the kubelet and the device plugin; `start` returns once the Node is Ready with GPUs."""

    def __init__(self, workdir: Path, plane: ControlPlane, containerd: Containerd, nvml_state: Path,
                 image: str) -> None:
        self.dir = workdir
        self.image = image  # the agent's image, as the node's pods name it (pulled or imported)
        self.logs = workdir / "logs"
        self.plane = plane
        self.containerd = containerd
        self.nvml_state = nvml_state
        self.kubelet: Process | None = None
        self.plugin: Process | None = None
        self._lock: int | None = None
        self._kubelet_args: list[str] = []
        self.kubelet_port = 0

    # ---- lifecycle ----
    def start(self) -> RealNode:
        missing = [b for b in ("kubelet", "fake-device-plugin") if not (BIN / b).is_file()]
        if missing:
            raise NodeError(f"{', '.join(missing)} missing in {BIN}: run scripts/build-node")
        self._take_lock()
        self._clean_host()
        # A systemd node's / is a shared mount; this machine's (a container's) is private, and containerd
        # refuses a hostPath of / mounted with HostToContainer propagation (the agent's driver-files init
        # container: "path / is mounted on / but it is not a shared or slave mount"). As on a real node.
        subprocess.run(["mount", "--make-rshared", "/"], check=True, capture_output=True)
        cert, key = self.plane.pki.client_pair(f"system:node:{NODE_NAME}", "system:nodes")
        kubeconfig = self.dir / "kubelet.kubeconfig"
        kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "node",
            "clusters": [{"name": "test", "cluster": {"server": self.plane.url,
                                                      "certificate-authority": str(self.plane.ca_file)}}],
            "users": [{"name": "node", "user": {"client-certificate": str(cert), "client-key": str(key)}}],
            "contexts": [{"name": "node", "context": {"cluster": "test", "user": "node"}}]}))
        config = self.dir / "kubelet-config.yaml"
        settings = kubelet_config(self.containerd, self.dir, self.plane.ca_file)
        self.kubelet_port = int(settings["port"])
        config.write_text(yaml.safe_dump(settings))
        labels = ",".join(f"{k}={v}" for k, v in NODE_LABELS.items())
        self._kubelet_args = [str(BIN / "kubelet"), f"--config={config}", f"--kubeconfig={kubeconfig}",
                              f"--root-dir={KUBELET_ROOT}", f"--hostname-override={NODE_NAME}",
                              f"--cert-dir={self.dir / 'kubelet-pki'}", f"--node-labels={labels}", "--v=2"]
        self.start_kubelet()
        wait_until(self._node_ready, "node 127.0.0.1 Ready", timeout=60)
        self.start_plugin()
        wait_until(lambda: self.allocatable_gpus() > 0, "the device plugin's nvidia.com/gpu allocatable",
                   timeout=60)
        return self

    def start_kubelet(self) -> None:
        self.kubelet = spawn("kubelet", self._kubelet_args, self.logs, self.dir)

    def stop_kubelet(self) -> None:
        if self.kubelet is not None:
            self.kubelet.stop()

    def restart_kubelet(self) -> None:
        """The kubelet stopped and started again (as an upgrade or a crash does); returns once the Node is
        Ready again. Containers keep running meanwhile: the kubelet does not stop them when it exits."""
        self.stop_kubelet()
        self.start_kubelet()
        wait_until(self._node_ready, "node 127.0.0.1 Ready after the kubelet's restart", timeout=60)

    def start_plugin(self, replicas: int = 1) -> None:
        """The fake device plugin, advertising each device `replicas` times (time-slicing) when above 1."""
        if self.plugin is not None:
            self.plugin.stop()
        self.plugin = spawn("fake-device-plugin", [str(BIN / "fake-device-plugin"), f"--state={self.nvml_state}",
                                                   f"--dir={DEVICE_PLUGINS}", f"--replicas={replicas}"],
                            self.logs, self.dir)

    def stop(self) -> None:
        """Pods deleted while the kubelet runs, their tasks gone, then plugin, kubelet; mounts and cgroups."""
        try:
            if self.kubelet is not None and self.kubelet.alive():
                self._delete_pods()
                wait_until(lambda: not self.containerd.tasks(), "the runtime to have no task left", timeout=60)
        finally:
            for process in (self.plugin, self.kubelet):
                if process is not None:
                    process.stop()
            self._clean_host()
            with contextlib.suppress(ApiException):
                self.plane.core.delete_node(NODE_NAME)
            if self._lock is not None:
                os.close(self._lock)
                self._lock = None

    def check_alive(self) -> None:
        for process in (self.kubelet, self.plugin, self.containerd.process):
            if process is not None and not process.alive():
                raise NodeError(f"{process.name} exited with {process.popen.returncode}:\n{process.tail()}")

    # ---- what tests read ----
    def node(self) -> Any:
        return self.plane.core.read_node(NODE_NAME)

    def allocatable_gpus(self) -> int:
        self.check_alive()
        return int((self.node().status.allocatable or {}).get(GPU_RESOURCE, "0"))

    def probe_results(self, container: str) -> dict[tuple[str, str], float]:
        """The kubelet's own count of the probes it ran on `container`, by (probe type, result), from its
        /metrics/probes endpoint (loopback, anonymous: kubelet_config)."""
        context = ssl.create_default_context()
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE  # the kubelet's self-signed serving cert
        url = f"https://127.0.0.1:{self.kubelet_port}/metrics/probes"
        with urllib.request.urlopen(url, timeout=5, context=context) as response:
            text = response.read().decode()
        counts: dict[tuple[str, str], float] = {}
        for line in text.splitlines():
            if line.startswith("prober_probe_total{") and f'container="{container}"' in line:
                labels = dict(part.split("=", 1) for part in line.split("{", 1)[1].split("}", 1)[0].split(","))
                key = (labels["probe_type"].strip('"'), labels["result"].strip('"'))
                counts[key] = counts.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
        return counts

    def _node_ready(self) -> bool:
        self.check_alive()
        try:
            node = self.node()
        except ApiException:
            return False
        conditions = node.status.conditions or []
        return any(c.type == "Ready" and c.status == "True" for c in conditions)

    # ---- host state the kubelet leaves behind ----
    def _take_lock(self) -> None:
        self._lock = os.open(LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        deadline = time.monotonic() + 600
        while True:
            try:
                fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise NodeError(f"another real node holds {LOCK} on this machine") from None
                time.sleep(1)

    def _delete_pods(self) -> None:
        """Every pod on the node deleted at once, DaemonSets first (they would make theirs again)."""
        apps = client.AppsV1Api(self.plane.admin)
        for daemonset in apps.list_daemon_set_for_all_namespaces().items:
            with contextlib.suppress(ApiException):
                apps.delete_namespaced_daemon_set(daemonset.metadata.name, daemonset.metadata.namespace)
        pods = self.plane.core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={NODE_NAME}").items
        for pod in pods:
            try:
                self.plane.core.delete_namespaced_pod(pod.metadata.name, pod.metadata.namespace,
                                                      grace_period_seconds=0)
            except ApiException as exc:
                if exc.status != 404:
                    raise

    def _clean_host(self) -> None:
        """Unmount what is left under /var/lib/kubelet, empty it and the agent's state, drop /kubepods."""
        mounts = [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()]
        for mount in sorted((m for m in mounts if m.startswith(str(KUBELET_ROOT))), key=len, reverse=True):
            subprocess.run(["umount", "-l", mount], check=False, capture_output=True)
        for path in (KUBELET_ROOT, AGENT_STATE):
            shutil.rmtree(path, ignore_errors=True)
        for hierarchy in Path("/sys/fs/cgroup").iterdir():
            kubepods = hierarchy / "kubepods"
            if kubepods.is_dir():
                for group in sorted((p for p in kubepods.rglob("*") if p.is_dir()), key=lambda p: len(p.parts),
                                    reverse=True):
                    with contextlib.suppress(OSError):
                        group.rmdir()
                with contextlib.suppress(OSError):
                    kubepods.rmdir()
