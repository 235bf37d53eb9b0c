"""Fixtures for the real-node tests: the image built from the Dockerfile (scripts/build-image), containerd,
and (node.py) a kubelet registered to the suite's control plane. Skipped with one line where the machine
cannot run them (not root, not Linux, the Debian tools absent); each part's log is shown when a test fails."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from tests.conftest import FakeNvml, eight_gpus
from tests.realcluster.controlplane import ControlPlane, ControlPlaneError
from tests.realnode import agent
from tests.realnode.node import AGENT_STATE, RealNode
from tests.realnode.runtime import REPO, Containerd, NodeError, wait_until

IMAGE_NAME = "ghcr.io/gpu-health-agent/gpu-health-agent"
PAUSE_IMAGE = "registry.k8s.io/pause:3.10"
_TOOLS = ("containerd", "ctr", "runc", "mmdebstrap", "umoci")
_LOGS: list[Path] = []
REPAIR_CONDITION_ENV = {"GPU_HEALTH_REMEDIATION__ACCELERATED_HARDWARE_CONDITION": "true"}


def _cannot_run() -> str:
    if sys.platform != "linux":
        return "the real node needs Linux"
    if os.geteuid() != 0:
        return "the real node needs root (containerd, runc, the kubelet)"
    missing = [tool for tool in _TOOLS if shutil.which(tool) is None]
    if missing:
        return f"the real node needs {', '.join(missing)} (Debian packages; scripts/test installs them)"
    return ""


@pytest.fixture(scope="session")
def image_archive() -> Path:
    """The OCI archive scripts/build-image made from the Dockerfile (cached; a warm run takes a second)."""
    reason = _cannot_run()
    if reason:
        pytest.skip(reason)
    done = subprocess.run([str(REPO / "scripts" / "build-image")], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.fail(f"scripts/build-image failed:\n{done.stderr[-4000:]}", pytrace=False)
    return Path(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def containerd(tmp_path_factory: pytest.TempPathFactory, image_archive: Path) -> Iterator[Containerd]:
    """containerd in a temporary root with the agent's image imported under the DaemonSet's name."""
    workdir = tmp_path_factory.mktemp("containerd")
    runtime = Containerd(workdir, workdir / "logs", PAUSE_IMAGE)
    _LOGS.append(runtime.logs)
    try:
        runtime.start()
        runtime.import_image(image_archive, IMAGE_NAME)
        pause = REPO / "tests" / "realnode" / "bin" / "pause-image.tar"
        if not pause.is_file():
            raise NodeError(f"{pause} missing: run scripts/build-node")
        runtime.import_image(pause, PAUSE_IMAGE.rsplit(":", 1)[0])
    except NodeError as exc:
        runtime.stop()
        pytest.fail(f"containerd: {exc}", pytrace=False)
    yield runtime
    runtime.stop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for logs in _LOGS:
            for log in sorted(logs.glob("*.log")):
                text = log.read_text(errors="replace").splitlines()[-25:]
                report.sections.append((f"real node: {log.name}", "\n".join(text)))


@pytest.fixture(scope="session")
def node_nvml(tmp_path_factory: pytest.TempPathFactory) -> FakeNvml:
    """The fake NVML state the node's device plugin (and, mounted, the agent's pod) reads: eight H100s."""
    fake = FakeNvml(tmp_path_factory.mktemp("node-nvml") / "nvml-state.json")
    fake.write(eight_gpus())
    return fake


@pytest.fixture(scope="session")
def node_plane(tmp_path_factory: pytest.TempPathFactory, containerd: Containerd) -> Iterator[ControlPlane]:
    """A control plane of the real node's own (with the DaemonSet and garbage collector controllers), so
    nothing the node runs meets the kwok nodes of tests/realcluster's."""
    plane = ControlPlane(tmp_path_factory.mktemp("node-controlplane"),
                         extra_controllers=("daemonset", "garbage-collector"))
    _LOGS.append(plane.logs)
    try:
        plane.start()
    except ControlPlaneError as exc:
        plane.stop()
        pytest.fail(f"the real node's control plane did not start: {exc}", pytrace=False)
    yield plane
    plane.reset()
    plane.stop()


@pytest.fixture(autouse=True)
def _reset_node_plane(request: pytest.FixtureRequest) -> Iterator[None]:
    """What a test made on the node's control plane is deleted after it, while the kubelet still runs."""
    yield
    if "node_plane" in request.fixturenames:
        plane = request.getfixturevalue("node_plane")
        if plane.url:
            plane.reset()


@pytest.fixture(scope="session")
def real_node(tmp_path_factory: pytest.TempPathFactory, node_plane: ControlPlane, containerd: Containerd,
              node_nvml: FakeNvml) -> Iterator[RealNode]:
    """The kubelet registered as node 127.0.0.1, Ready, with the fake device plugin's GPUs allocatable."""
    workdir = tmp_path_factory.mktemp("realnode")
    node = RealNode(workdir, node_plane, containerd, node_nvml.path)
    _LOGS.append(node.logs)
    try:
        node.start()
    except NodeError as exc:
        node.stop()
        pytest.fail(f"the real node did not start: {exc}", pytrace=False)
    yield node
    node.stop()


@pytest.fixture
def healthy_gpus(node_nvml: FakeNvml, real_node: RealNode) -> Iterator[FakeNvml]:
    """The node's GPUs all healthy before and after the test (a test may mark one lost)."""
    node_nvml.write(eight_gpus())
    yield node_nvml
    node_nvml.write(eight_gpus())


@pytest.fixture
def installed(request: pytest.FixtureRequest, real_node: RealNode, node_nvml: FakeNvml,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Any, int]]:
    """The overlay applied (in the shipped mode, quarantine, unless parametrized "MODE",
    "MODE:fast-liveness", "MODE:repair-condition" or "MODE:helm" for the Helm chart), the agent's pod Ready
    by the kubelet's probes; uninstalled after the test, so each test starts on a node without its marks."""
    mode, _, variant = str(getattr(request, "param", "quarantine")).partition(":")
    node_nvml.write(eight_gpus())
    directory, port = agent.overlay(tmp_path_factory.mktemp(f"overlay-{mode}"), real_node.plane, node_nvml.path, mode,
                                    fast_liveness=variant == "fast-liveness", helm=variant == "helm",
                                    env=REPAIR_CONDITION_ENV if variant == "repair-condition" else None)
    if variant == "helm":
        agent.helm_install(real_node.plane, directory, mode)
    else:
        agent.install(real_node.plane, directory)

    def ready_pod() -> Any:
        real_node.check_alive()
        for pod in agent.agent_pods(real_node.plane):
            conditions = pod.status.conditions or []
            if pod.metadata.deletion_timestamp is None and any(
                    c.type == "Ready" and c.status == "True" for c in conditions):
                return pod
        return None

    try:
        pod = wait_until(ready_pod, f"the agent's pod Ready on the real node ({mode})", timeout=120)
    except Exception:
        _print_agent_log(real_node)
        raise
    yield mode, pod, port  # the metrics port: where probes (and a test) reach it, on the host's network
    _print_agent_log(real_node)
    # Uninstalled as docs/operations.md says: the DaemonSet deleted, then `cleanup` with operator credentials
    # removes the marks the agent left; the state hostPath wiped, so the next mode starts on a fresh node.
    if variant == "helm":
        agent.helm_uninstall(real_node.plane)
    else:
        real_node.plane.kubectl("delete", "daemonset", "-n", agent.AGENT_NAMESPACE, "gpu-health-agent", "--wait=false")
    wait_until(lambda: not agent.agent_pods(real_node.plane), "the agent's pod gone", timeout=90)
    done = subprocess.run([sys.executable, "-m", "agent", "cleanup", "--all-nodes",
                           f"--kubeconfig={real_node.plane.admin_kubeconfig}"], capture_output=True, text=True,
                          check=False, cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    shutil.rmtree(AGENT_STATE, ignore_errors=True)


def _print_agent_log(node: RealNode) -> None:
    for pod in agent.agent_pods(node.plane):
        try:
            print(node.plane.core.read_namespaced_pod_log(pod.metadata.name, agent.AGENT_NAMESPACE, tail_lines=40))
        except ApiException as exc:
            print(f"no log of {pod.metadata.name}: {exc.reason}")
