"""What only a real kubelet shows: the node registers with the device plugin's GPUs, a GPU pod runs with
the device the kubelet allocated, PodResources (read by the agent's own decoder) names it, and a device
the plugin reports unhealthy leaves allocatable and is not given to a new pod."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kubernetes.client.exceptions import ApiException

from tests.conftest import FakeNvml, eight_gpus
from tests.realnode.node import NODE_NAME, POD_RESOURCES, RealNode
from tests.realnode.runtime import NodeError, wait_until

GPU_UUIDS = [gpu["uuid"] for gpu in eight_gpus()["gpus"]]  # type: ignore[index, union-attr]


def gpu_pod(node: RealNode, name: str, gpus: int = 1) -> dict[str, Any]:
    """A hostNetwork pod (the only kind a loopback-only node can run) holding `gpus` GPUs, scheduled by the
    real scheduler; it prints the devices it was given and waits, and records the signal that stops it."""
    plane = node.plane
    plane.ensure_namespace("trainers")
    (signals_dir(node) / name).unlink(missing_ok=True)  # a pod of this name in an earlier test
    # An earlier test's pods are deleted at once in the API, but the kubelet holds their GPUs until their
    # containers stop; a pod admitted before then fails for want of devices (UnexpectedAdmissionError).
    wait_until(lambda: not stale_trainers(node), "the kubelet to stop the containers of deleted trainer pods",
               timeout=60)
    pod = plane.core.create_namespaced_pod("trainers", {
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": {"hostNetwork": True, "nodeSelector": {"kubernetes.io/hostname": NODE_NAME},
                 "terminationGracePeriodSeconds": 5, "restartPolicy": "Never",
                 "containers": [{"name": "main", "image": node.image, "imagePullPolicy": "IfNotPresent",
                                 "command": ["/usr/bin/python3", "-c",
                                             "import os, signal, time\n"
                                             "print('devices', os.environ.get('NVIDIA_VISIBLE_DEVICES'), flush=True)\n"
                                             "def stop(*_):\n"
                                             f"    open('/signals/{name}', 'w').write('SIGTERM')\n"
                                             "    os._exit(143)\n"
                                             "signal.signal(signal.SIGTERM, stop)\n"
                                             "time.sleep(3600)\n"],
                                 "volumeMounts": [{"name": "signals", "mountPath": "/signals"}],
                                 "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}],
                 "volumes": [{"name": "signals", "hostPath": {"path": str(signals_dir(node)),
                                                               "type": "DirectoryOrCreate"}}]}})
    plane.forget("", "pods", "trainers", name)
    wait_until(lambda: running(node, name), f"pod trainers/{name} Running on the real node", timeout=90)
    return dict(plane.admin.sanitize_for_serialization(pod))


def stale_trainers(node: RealNode) -> list[str]:
    """Running containers of trainer pods the API server no longer has (deleted, not yet stopped)."""
    live = {pod.metadata.uid for pod in node.plane.core.list_namespaced_pod("trainers").items}
    listing = node.containerd.ctr("tasks", "list").stdout.splitlines()[1:]  # TASK PID STATUS
    running = {fields[0] for fields in (line.split() for line in listing) if fields[-1:] == ["RUNNING"]}
    trainers = node.containerd.ctr("containers", "list", "--quiet",
                                   'labels."io.kubernetes.pod.namespace"==trainers').stdout.split()
    stale = []
    for container in (c for c in trainers if c in running):
        info = json.loads(node.containerd.ctr("containers", "info", container).stdout or "{}")
        if info.get("Labels", {}).get("io.kubernetes.pod.uid") not in live:
            stale.append(container)
    return stale


def signals_dir(node: RealNode) -> Path:
    """Where a trainer pod writes the signal that stopped it (a hostPath: it outlives the container)."""
    return node.dir / "trainer-signals"


def stopped_by(node: RealNode, name: str) -> str:
    path = signals_dir(node) / name
    return path.read_text() if path.exists() else ""


def running(node: RealNode, name: str) -> bool:
    """Running; a pod the kubelet failed (it never runs again, restartPolicy Never) ends the wait with why."""
    node.check_alive()
    pod = node.plane.core.read_namespaced_pod(name, "trainers")
    if pod.status.phase == "Failed":
        raise NodeError(f"the kubelet failed pod trainers/{name}: {pod.status.reason}: {pod.status.message}")
    return bool(pod.status.phase == "Running")


def given_devices(node: RealNode, name: str) -> list[str]:
    """The NVIDIA_VISIBLE_DEVICES the kubelet gave the container (from the device plugin's Allocate)."""
    def printed() -> str:
        try:
            log = node.plane.core.read_namespaced_pod_log(name, "trainers")
        except ApiException:
            return ""
        return str(log) if "devices" in log else ""

    line = wait_until(printed, f"pod {name}'s log, read through the kubelet", timeout=30)
    return sorted(line.split()[1].split(","))


def test_the_node_registers_ready_with_the_device_plugins_gpus(real_node: RealNode, healthy_gpus: FakeNvml):
    """The kubelet registers node 127.0.0.1 and reports the fake plugin's eight GPUs as allocatable."""
    wait_until(lambda: real_node.allocatable_gpus() == 8, "eight nvidia.com/gpu allocatable", timeout=30)
    assert real_node.node().metadata.labels["nvidia.com/gpu.present"] == "true"


def test_pod_resources_names_the_device_the_kubelet_allocated(real_node: RealNode, healthy_gpus: FakeNvml):
    """The agent's own PodResources decoder, against the real kubelet, names the GPU the pod was given."""
    from agent.k8s.podresources import list_pod_devices

    gpu_pod(real_node, "holder", gpus=2)
    given = given_devices(real_node, "holder")
    assert len(given) == 2 and set(given) <= set(GPU_UUIDS)
    pods = {(p.namespace, p.name): p for p in list_pod_devices(str(POD_RESOURCES))}
    assert pods[("trainers", "holder")].gpu_ids() == given


def test_a_device_the_plugin_marks_unhealthy_leaves_allocatable_and_is_not_given(real_node: RealNode,
                                                                                healthy_gpus: FakeNvml):
    """A GPU the fake NVML reports lost is Unhealthy to the kubelet: allocatable drops to 7 and a pod asking
    for seven GPUs gets every one but it."""
    healthy_gpus.write(eight_gpus(**{"3": {"lost": True}}))
    wait_until(lambda: real_node.allocatable_gpus() == 7, "allocatable nvidia.com/gpu to drop to 7", timeout=30)
    gpu_pod(real_node, "seven", gpus=7)
    given = given_devices(real_node, "seven")
    assert GPU_UUIDS[3] not in given and len(given) == 7


def test_the_kubelet_offers_every_gpu_but_the_one_its_plugin_marks_unhealthy(real_node: RealNode,
                                                                             healthy_gpus: FakeNvml):
    """PodResources' GetAllocatableResources on the real kubelet (what the agent asks in quarantine mode to know
    a GPU waiting for a reset is kept off by the device plugin): all eight GPUs by UUID, then, GPU 3 reported
    lost, every one but GPU 3, exactly."""
    from agent.k8s.podresources import allocatable_devices, offered_gpus

    wait_until(lambda: offered_gpus(allocatable_devices(str(POD_RESOURCES)), {}) == set(GPU_UUIDS),
               "the kubelet to offer all eight GPUs", timeout=30)
    healthy_gpus.write(eight_gpus(**{"3": {"lost": True}}))
    wait_until(lambda: offered_gpus(allocatable_devices(str(POD_RESOURCES)), {}) == set(GPU_UUIDS) - {GPU_UUIDS[3]},
               "the kubelet to offer every GPU but GPU 3", timeout=30)
