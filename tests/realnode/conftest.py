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

import pytest

from tests.realnode.runtime import REPO, Containerd, NodeError

IMAGE_NAME = "ghcr.io/gpu-health-agent/gpu-health-agent"
PAUSE_IMAGE = "registry.k8s.io/pause:3.10"
_TOOLS = ("containerd", "ctr", "runc", "mmdebstrap", "umoci")
_LOGS: list[Path] = []


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
