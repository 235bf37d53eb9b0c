"""One agent install on the real node at a time; a `shares_install` test reuses its variant's last one."""

from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from tests.conftest import FakeNvml, eight_gpus
from tests.realnode import agent
from tests.realnode.node import AGENT_STATE, RealNode
from tests.realnode.registry import Published
from tests.realnode.runtime import REPO, wait_until

REPAIR_CONDITION_ENV = {"GPU_HEALTH_REMEDIATION__ACCELERATED_HARDWARE_CONDITION": "true"}


@dataclass(slots=True)
class Install:
    """One install: its variant ("MODE" or "MODE:fast-liveness|repair-condition|helm"), pod and metrics port."""

    key: str
    pod: Any
    port: int

    @property
    def mode(self) -> str:
        return self.key.partition(":")[0]

    @property
    def variant(self) -> str:
        return self.key.partition(":")[2]


class Installs:
    """At most one agent installed on the node; `get` reuses it for a sharing test of the same variant."""

    def __init__(self, node: RealNode, nvml: FakeNvml, tmp: pytest.TempPathFactory, published: Published) -> None:
        self.node = node
        self.published = published
        self.nvml = nvml
        self.tmp = tmp
        self.current: Install | None = None
        self.made = 0  # installs made in this session (a figure for the report)

    def get(self, key: str, *, shared: bool) -> Install:
        self.nvml.write(eight_gpus())
        if shared and self.current is not None and self.current.key == key and self._still_ready(self.current):
            return self.current
        self.release()
        self.current = self._install(key)
        return self.current

    def track(self, install: Install) -> None:
        """An install a test made itself (the upgrade test's helm releases), uninstalled as the pool's are: by
        the next `get`, the test's own `release` or the session's end (the test released the last one first)."""
        assert self.current is None, f"{self.current.key} still installed"
        self.current = install

    def release(self) -> None:
        """Uninstalled as docs/operations.md says: the DaemonSet deleted (or `helm uninstall`), then `cleanup`
        with operator credentials removes the marks the agent left; the state hostPath wiped, so the next
        install starts on a node without them."""
        current, self.current = self.current, None
        if current is None:
            return
        print_agent_log(self.node)
        plane = self.node.plane
        if current.variant == "helm":
            agent.helm_uninstall(plane)
        else:
            plane.kubectl("delete", "daemonset", "-n", agent.AGENT_NAMESPACE, "gpu-health-agent", "--wait=false",
                          "--ignore-not-found")  # a test may have uninstalled it itself
        wait_until(lambda: not agent.agent_pods(plane), "the agent's pod gone", timeout=90)
        done = subprocess.run([sys.executable, "-m", "agent", "cleanup", "--all-nodes",
                               f"--kubeconfig={plane.admin_kubeconfig}"], capture_output=True, text=True,
                              check=False, cwd=REPO)
        assert done.returncode == 0, done.stdout + done.stderr
        shutil.rmtree(AGENT_STATE, ignore_errors=True)

    def _install(self, key: str) -> Install:
        mode, _, variant = key.partition(":")
        plane = self.node.plane
        directory, port = agent.overlay(self.tmp.mktemp(f"overlay-{mode}"), plane, self.nvml.path, mode,
                                        fast_liveness=variant == "fast-liveness", helm=variant == "helm",
                                        env=REPAIR_CONDITION_ENV if variant == "repair-condition" else None,
                                        image_repository=self.published.image_repository)
        if variant == "helm":
            agent.helm_install(plane, directory, mode, self.published)
        else:
            agent.install(plane, directory)
        self.made += 1
        try:
            pod = wait_until(self._ready_pod, f"the agent's pod Ready on the real node ({key})", timeout=120)
        except Exception:
            print_agent_log(self.node)
            raise
        return Install(key, pod, port)

    def _ready_pod(self) -> Any:
        self.node.check_alive()
        for pod in agent.agent_pods(self.node.plane):
            conditions = pod.status.conditions or []
            if pod.metadata.deletion_timestamp is None and any(
                    c.type == "Ready" and c.status == "True" for c in conditions):
                return pod
        return None

    def _still_ready(self, install: Install) -> bool:
        pod = self._ready_pod()
        return pod is not None and pod.metadata.uid == install.pod.metadata.uid


def print_agent_log(node: RealNode) -> None:
    for pod in agent.agent_pods(node.plane):
        try:
            print(node.plane.core.read_namespaced_pod_log(pod.metadata.name, agent.AGENT_NAMESPACE, tail_lines=40))
        except ApiException as exc:
            print(f"no log of {pod.metadata.name}: {exc.reason}")


def shared_key(item: pytest.Item) -> str | None:
    """The install variant a `shares_install` test asks for; None for a test that shares none."""
    if item.get_closest_marker("shares_install") is None or "installed" not in getattr(item, "fixturenames", ()):
        return None
    callspec = getattr(item, "callspec", None)
    return str(callspec.params.get("installed", "quarantine")) if callspec is not None else "quarantine"


def grouped(items: list[pytest.Item], here: Path) -> list[pytest.Item]:
    """The real node's sharing tests of one variant moved together, where the first of them was (after
    pytest-randomly's shuffle), so each variant is installed once; every other test keeps its place."""
    first: dict[str, int] = {}
    places: list[int] = []
    for index, item in enumerate(items):
        key = shared_key(item) if here in Path(str(item.path)).parents else None
        places.append(first.setdefault(key, index) if key is not None else index)
    return [item for _, _, item in sorted(zip(places, range(len(items)), items, strict=True),
                                          key=lambda entry: (entry[0], entry[1]))]
