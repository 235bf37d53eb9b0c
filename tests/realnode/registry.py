"""The suite's own OCI registry: `crane registry serve` (go-containerregistry, built by
scripts/build-release-tools) on a loopback port chosen when it starts, with the release published to it as
a release is (scripts/publish: the image's OCI layout and the packaged chart) and the sandbox image beside
them, and the previous release beside it for the upgrade test; containerd pulls from it over plain HTTP
(runtime.py's hosts.toml), helm installs the chart from it."""

from __future__ import annotations

import subprocess
import tarfile
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from tests.realcluster.controlplane import free_port
from tests.realnode.runtime import REPO, NodeError, Process, spawn, wait_until

IMAGE_REPOSITORY = "gpu-health-agent/gpu-health-agent"  # the image's path in the registry, as on ghcr.io
PAUSE_REPOSITORY = "pause"
PAUSE_TAG = "3.10"
PREVIOUS_PREFIX = "previous"  # where the previous release is published in the registry (the upgrade test)


@dataclass(slots=True)
class Published:
    """What scripts/publish reported: the image by digest, the chart by reference and version."""

    image_repository: str
    digest: str
    chart: str
    version: str
    commit: str = ""  # the previous release's: the commit it was built from, and why that one
    chosen: str = ""

    @property
    def image(self) -> str:
        return f"{self.image_repository}:{self.version}"


class Registry:
    """crane's registry on 127.0.0.1:<free port>, blobs on disk under `workdir`."""

    def __init__(self, workdir: Path, logs: Path) -> None:
        self.dir = workdir
        self.logs = logs
        self.host = ""
        self.process: Process | None = None

    def start(self, attempts: int = 3) -> None:
        crane = self.tools() / "crane"
        (self.dir / "blobs").mkdir(parents=True, exist_ok=True)  # crane writes its uploads there, makes none
        for _ in range(attempts):  # a port free when chosen may be taken before crane binds it
            self.host = f"127.0.0.1:{free_port()}"
            self.process = spawn("registry", [str(crane), "registry", "serve", "--address", self.host,
                                              "--disk", str(self.dir / "blobs")], self.logs, self.dir)
            try:
                wait_until(self._serving, f"the registry to answer on {self.host}", timeout=20)
                return
            except NodeError:
                self.stop()
        raise NodeError(f"the registry did not start:\n{self.process.tail() if self.process else ''}")

    def _serving(self) -> bool:
        if self.process is not None and not self.process.alive():
            raise NodeError(f"crane registry serve exited:\n{self.process.tail()}")
        try:
            with urllib.request.urlopen(f"http://{self.host}/v2/", timeout=2) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, ConnectionError):
            return False

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()
            self.process = None

    @staticmethod
    def tools() -> Path:
        return Path(_run([str(REPO / "scripts" / "build-release-tools")]).splitlines()[-1])

    def publish(self) -> Published:
        """The release published as docs/release.md says, with scripts/publish, to this registry."""
        return _published(_run([str(REPO / "scripts" / "publish"), "--plain-http", f"{self.host}/{IMAGE_REPOSITORY}",
                                f"oci://{self.host}"]))

    def publish_previous(self) -> Published:
        """The previous release (scripts/publish-previous-release: its own commit, built and published by its own
        scripts), under PREVIOUS_PREFIX/ in this registry, beside the release under test."""
        out = _run([str(REPO / "scripts" / "publish-previous-release"), "--plain-http",
                    f"{self.host}/{PREVIOUS_PREFIX}/{IMAGE_REPOSITORY}", f"oci://{self.host}/{PREVIOUS_PREFIX}"])
        which = next(line for line in out.splitlines() if line.startswith("previous: "))
        return _published(out, commit=which.split()[1], chosen=which.split(maxsplit=2)[2])

    def push_sandbox_image(self) -> str:
        """The pause image (scripts/build-node's OCI archive) pushed, for containerd to pull as its sandbox."""
        archive = REPO / "tests" / "realnode" / "bin" / "pause-image.tar"
        if not archive.is_file():
            raise NodeError(f"{archive} missing: run scripts/build-node")
        reference = f"{self.host}/{PAUSE_REPOSITORY}:{PAUSE_TAG}"
        with tempfile.TemporaryDirectory() as layout:
            with tarfile.open(archive) as tar:
                tar.extractall(layout, filter="data")
            _run([str(self.tools() / "crane"), "push", "--insecure", layout, reference])
        return reference


def _published(out: str, **which: str) -> Published:
    """scripts/publish's last two lines: REPOSITORY@DIGEST, then CHART VERSION."""
    image, chart = out.splitlines()[-2:]
    repository, digest = image.split("@")
    return Published(repository, digest, *chart.split(), **which)


def _run(argv: list[str]) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=1200)
    if done.returncode != 0:
        raise NodeError(f"{' '.join(argv[:3])} exited with {done.returncode}: {done.stderr.strip()[-3000:]}")
    return done.stdout
