"""containerd (Debian's, with its runc) in a temporary root for the real-node tests: its own socket, state,
runc root and image store, the CRI plugin set for what this kind of machine allows (see docs/testing.md), and
a registry host configuration (hosts.toml) that lets it pull from the suite's plain-HTTP loopback registry."""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import subprocess
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
# util-linux's setpriv kills each component when the test process dies, even killed (SIGKILL).
_DIE_WITH_PARENT = ("setpriv", "--pdeathsig", "KILL", "--") if shutil.which("setpriv") else ()
NAMESPACE = "k8s.io"  # the CRI plugin's containerd namespace: images imported there are the kubelet's
CNI_BIN = Path("/usr/lib/cni")  # Debian's containernetworking-plugins
# Only loopback addresses exist for these tests: the one CNI network is loopback-only, so only
# hostNetwork pods start (others get no eth0).
LOOPBACK_CNI = {"cniVersion": "0.4.0", "name": "loopback-only", "plugins": [{"type": "loopback"}]}


class NodeError(RuntimeError):
    """A part of the real node could not start, or did not do what it must in time."""


def wait_until(predicate: Any, what: str, timeout: float = 60.0, interval: float = 0.1) -> Any:
    """Poll `predicate` until it returns something truthy; NodeError naming `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            result = predicate()
            if result:
                return result
        except (OSError, ValueError, subprocess.SubprocessError) as exc:
            last = exc
        time.sleep(interval)
    raise NodeError(f"timed out after {timeout:.0f}s waiting for {what}" + (f" (last: {last})" if last else ""))


@dataclass(slots=True)
class Process:
    """One started component, its log, and how to stop it."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, timeout: float = 15.0) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()

    def tail(self, lines: int = 20) -> str:
        text = self.log.read_text(errors="replace").splitlines()[-lines:] if self.log.exists() else []
        return f"---- {self.log} (last {len(text)} lines)\n" + "\n".join(text)


def spawn(name: str, argv: list[str], logs: Path, cwd: Path) -> Process:
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{name}.log"
    with log.open("ab") as out:
        popen = subprocess.Popen([*_DIE_WITH_PARENT, *argv], stdout=out, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, cwd=cwd, start_new_session=True)
    return Process(name, popen, log)


class Containerd:
    """containerd with the CRI plugin, in `workdir`; `ctr` against it; images pulled from `registry_host`
    (plain HTTP, as its hosts.toml says) or imported from OCI archives."""

    def __init__(self, workdir: Path, logs: Path, sandbox_image: str, registry_host: str = "") -> None:
        self.dir = workdir
        self.logs = logs
        self.socket = workdir / "containerd.sock"
        self.sandbox_image = sandbox_image
        self.registry_host = registry_host
        self.hosts_dir = workdir / "certs.d"
        self.process: Process | None = None

    def config(self) -> str:
        cri = 'plugins."io.containerd.grpc.v1.cri"'
        return "\n".join([
            "version = 2",
            f'root = "{self.dir / "root"}"',
            f'state = "{self.dir / "state"}"',
            'disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",'
            ' "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs"]',
            "[grpc]", f'  address = "{self.socket}"',
            "[ttrpc]", f'  address = "{self.dir / "containerd.sock.ttrpc"}"',
            '[plugins."io.containerd.internal.v1.opt"]', f'  path = "{self.dir / "opt"}"',
            f"[{cri}]",
            f'  sandbox_image = "{self.sandbox_image}"',
            # This VM's root has no CAP_SYS_RESOURCE: a negative oom_score_adj fails every sandbox in runc.
            "  restrict_oom_score_adj = true",
            "  disable_apparmor = true",
            f"[{cri}.containerd]", '  snapshotter = "overlayfs"', '  default_runtime_name = "runc"',
            f"[{cri}.containerd.runtimes.runc]", '  runtime_type = "io.containerd.runc.v2"',
            f"[{cri}.containerd.runtimes.runc.options]", "  SystemdCgroup = false",
            f'  Root = "{self.dir / "runc"}"',
            f"[{cri}.cni]", f'  bin_dir = "{CNI_BIN}"', f'  conf_dir = "{self.dir / "cni"}"',
            # Registry hosts as containerd reads them for each pull: certs.d/<host>/hosts.toml.
            f"[{cri}.registry]", f'  config_path = "{self.hosts_dir}"',
        ]) + "\n"

    def hosts_toml(self) -> str:
        """The loopback registry served over plain HTTP: containerd would otherwise speak TLS to it."""
        server = f"http://{self.registry_host}"
        return f'server = "{server}"\n\n[host."{server}"]\n  capabilities = ["pull", "resolve"]\n'

    def start(self) -> None:
        (self.dir / "cni").mkdir(parents=True, exist_ok=True)
        (self.dir / "cni" / "10-loopback.conflist").write_text(json.dumps(LOOPBACK_CNI))
        config = self.dir / "config.toml"
        config.write_text(self.config())
        if self.registry_host:
            (self.hosts_dir / self.registry_host).mkdir(parents=True, exist_ok=True)
            (self.hosts_dir / self.registry_host / "hosts.toml").write_text(self.hosts_toml())
        self.process = spawn("containerd", ["containerd", f"--config={config}"], self.logs, self.dir)

        def serving() -> bool:
            self.check_alive()
            return self.ctr("version", check=False).returncode == 0

        wait_until(serving, "containerd to answer on its socket", timeout=30)

    def check_alive(self) -> None:
        if self.process is not None and not self.process.alive():
            raise NodeError(f"containerd exited with {self.process.popen.returncode}:\n{self.process.tail()}")

    def ctr(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(["ctr", f"--address={self.socket}", f"--namespace={NAMESPACE}", *args],
                              capture_output=True, text=True, check=False, timeout=timeout)
        if check and done.returncode != 0:
            raise NodeError(f"ctr {' '.join(args)}: {done.stderr.strip()}")
        return done

    def pull(self, reference: str) -> str:
        """`ctr images pull` from the registry, as the CRI plugin pulls (the same hosts.toml); the digest."""
        self.ctr("images", "pull", f"--hosts-dir={self.hosts_dir}", reference, timeout=300)
        return self.image_digest(reference)

    def image_digest(self, reference: str) -> str:
        """The manifest digest containerd holds for `reference` ("" when it has none)."""
        listed = self.ctr("images", "list").stdout.splitlines()[1:]  # REF TYPE DIGEST ...
        return next((line.split()[2] for line in listed if line.split()[0] == reference), "")

    def import_image(self, archive: Path, name: str) -> str:
        """Load an OCI archive (one tagged image) as `name:<its tag>`; the reference containerd now has."""
        tag = oci_tag(archive)
        self.ctr("images", "import", f"--base-name={name}", str(archive))
        reference = f"{name}:{tag}"
        if reference not in self.ctr("images", "list", "--quiet").stdout.split():
            raise NodeError(f"{archive} imported, but containerd has no {reference}")
        return reference

    def tasks(self) -> list[str]:
        """Running tasks (containers with a process) in the CRI namespace."""
        return [line.split()[0] for line in self.ctr("tasks", "list").stdout.splitlines()[1:] if line.strip()]

    def stop(self) -> None:
        """Tasks a failed teardown left are killed first (their shims would outlive containerd), then it
        stops, and what stays mounted under its root is unmounted."""
        if self.process is not None:
            with contextlib.suppress(NodeError, OSError, subprocess.SubprocessError):
                for task in self.tasks():
                    self.ctr("tasks", "kill", "--all", "--signal=SIGKILL", task, check=False)
                    wait_until(lambda task=task: task not in self.tasks(), f"task {task} killed", timeout=15)
                    self.ctr("tasks", "delete", task, check=False)
            self.process.stop()
            self.process = None
        mounts = [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()]
        for mount in sorted((m for m in mounts if m.startswith(str(self.dir))), key=len, reverse=True):
            subprocess.run(["umount", "-l", mount], check=False, capture_output=True)


def oci_tag(archive: Path) -> str:
    """The tag (org.opencontainers.image.ref.name) of the one image in an OCI archive."""
    with tarfile.open(archive) as tar:
        member = tar.extractfile("index.json")
        if member is None:
            raise NodeError(f"{archive}: no index.json")
        index = json.load(member)
    names = [m.get("annotations", {}).get("org.opencontainers.image.ref.name") for m in index["manifests"]]
    if len(names) != 1 or not names[0]:
        raise NodeError(f"{archive}: expected one tagged image, found {names}")
    return str(names[0])


def oci_config(archive: Path) -> dict[str, Any]:
    """The image configuration (entrypoint, env, user...) of the one image in an OCI archive."""
    with tarfile.open(archive) as tar:
        def blob(descriptor: dict[str, Any]) -> Any:
            algorithm, digest = descriptor["digest"].split(":")
            member = tar.extractfile(f"blobs/{algorithm}/{digest}")
            if member is None:
                raise NodeError(f"{archive}: blob {digest} missing")
            return json.load(member)

        index_file = tar.extractfile("index.json")
        if index_file is None:
            raise NodeError(f"{archive}: no index.json")
        manifest = blob(json.load(index_file)["manifests"][0])
        return dict(blob(manifest["config"]))
