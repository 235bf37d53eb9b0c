"""Fixtures for the real-node tests: the image built from the Dockerfile (scripts/build-image), the suite's
OCI registry with the release published to it (registry.py), containerd pulling from it, and (node.py) a
kubelet registered to the suite's control plane. Skipped with one line where the machine
cannot run them (not root, not Linux, the Debian tools absent); each part's log is shown when a test fails."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol, TypeVar

import pytest

from tests.conftest import FakeNvml, eight_gpus
from tests.realcluster.controlplane import ControlPlane, ControlPlaneError
from tests.realnode.installs import Installs, grouped, print_agent_log
from tests.realnode.node import RealNode
from tests.realnode.registry import Published, Registry
from tests.realnode.runtime import REPO, Containerd, NodeError

PAUSE_IMAGE = "registry.k8s.io/pause:3.10"  # scripts/bench_realnode.py's imported sandbox image
_TOOLS = ("containerd", "ctr", "runc", "mmdebstrap", "umoci")
_LOGS: list[Path] = []


class _Startable(Protocol):
    logs: Path

    def start(self) -> object: ...

    def stop(self) -> None: ...


_Part = TypeVar("_Part", bound=_Startable)


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
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    """`crane registry serve` on a free loopback port (registry.py)."""
    reason = _cannot_run()
    if reason:
        pytest.skip(reason)
    workdir = tmp_path_factory.mktemp("registry")
    served = _started(Registry(workdir, workdir / "logs"), "the registry")
    yield served
    served.stop()


@pytest.fixture(scope="session")
def published(registry: Registry, image_archive: Path) -> Published:
    """The release published to the suite's registry by scripts/publish: the image (at the digest
    scripts/build-image printed) and the packaged chart."""
    try:
        return registry.publish()
    except NodeError as exc:
        pytest.fail(f"scripts/publish: {exc}", pytrace=False)


@pytest.fixture(scope="session")
def previous_published(registry: Registry) -> Published:
    """The previous release (docs/release.md, "The upgrade test": the newest release tag before HEAD, or HEAD's
    first parent before the first release), built from its own commit by its own scripts and published beside
    the release under test by scripts/publish-previous-release."""
    try:
        return registry.publish_previous()
    except NodeError as exc:
        pytest.fail(f"scripts/publish-previous-release: {exc}", pytrace=False)


@pytest.fixture(scope="session")
def containerd(tmp_path_factory: pytest.TempPathFactory, registry: Registry) -> Iterator[Containerd]:
    """containerd in a temporary root that pulls from the suite's registry: its sandbox image too."""
    workdir = tmp_path_factory.mktemp("containerd")
    try:
        sandbox = registry.push_sandbox_image()
    except NodeError as exc:
        pytest.fail(f"the sandbox image: {exc}", pytrace=False)
    runtime = _started(Containerd(workdir, workdir / "logs", sandbox, registry.host), "containerd")
    yield runtime
    runtime.stop()


def _started(part: _Part, what: str, error: type[Exception] = NodeError) -> _Part:
    """A part of the node started, its log attached to failing tests; the session failed with one line if
    it cannot start."""
    _LOGS.append(part.logs)
    try:
        part.start()
    except error as exc:
        part.stop()
        pytest.fail(f"{what}: {exc}", pytrace=False)
    return part


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        item.realnode_failed = True  # type: ignore[attr-defined]  # its shared install is not reused
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
    plane = _started(ControlPlane(tmp_path_factory.mktemp("node-controlplane"),
                                  extra_controllers=("daemonset", "garbage-collector")),
                     "the real node's control plane did not start", ControlPlaneError)
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
              node_nvml: FakeNvml, published: Published) -> Iterator[RealNode]:
    """The kubelet registered as node 127.0.0.1, Ready, with the fake device plugin's GPUs allocatable."""
    workdir = tmp_path_factory.mktemp("realnode")
    node = _started(RealNode(workdir, node_plane, containerd, node_nvml.path, published.image),
                    "the real node did not start")
    yield node
    node.stop()


@pytest.fixture
def healthy_gpus(node_nvml: FakeNvml, real_node: RealNode) -> Iterator[FakeNvml]:
    """The node's GPUs all healthy before and after the test (a test may mark one lost)."""
    node_nvml.write(eight_gpus())
    yield node_nvml
    node_nvml.write(eight_gpus())


@pytest.fixture(scope="session")
def installs(real_node: RealNode, node_nvml: FakeNvml, tmp_path_factory: pytest.TempPathFactory,
             published: Published) -> Iterator[Installs]:
    """The one agent install on the node (installs.py), its image and chart from the registry; the last one
    uninstalled at the end."""
    pool = Installs(real_node, node_nvml, tmp_path_factory, published)
    yield pool
    pool.release()


@pytest.fixture
def installed(request: pytest.FixtureRequest, installs: Installs) -> Iterator[tuple[str, Any, int]]:
    """The overlay applied (in the shipped mode, quarantine, unless parametrized "MODE",
    "MODE:fast-liveness", "MODE:repair-condition" or "MODE:helm" for the Helm chart), the agent's pod Ready
    by the kubelet's probes. A test marked `shares_install` may find it installed by the last test of its
    variant; any other test's install is uninstalled after it, and so is a shared one after a failed test,
    so each starts on a node without another test's marks."""
    shared = request.node.get_closest_marker("shares_install") is not None
    current = installs.get(str(getattr(request, "param", "quarantine")), shared=shared)
    yield current.mode, current.pod, current.port  # the metrics port: where probes (and a test) reach it
    if not shared or getattr(request.node, "realnode_failed", False):
        installs.release()
    else:
        print_agent_log(installs.node)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Each variant's sharing tests one after another (after pytest-randomly's shuffle): one install each."""
    items[:] = grouped(items, Path(__file__).parent)
