"""grpcio is the kmsg device plugin's extra: the agent installs, imports and runs without it."""

import subprocess
import sys
import tomllib
from pathlib import Path

from tests.conftest import REPO

#: A fresh interpreter in which grpcio is not installed (`import grpc` raises ImportError), then the CLI.
WITHOUT_GRPC = ("import sys\nsys.modules['grpc'] = None\n"
                "from agent.cli import main\nsys.argv[0] = 'gpu-health-agent'\nmain()\n")


def without_grpc(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "KUBECONFIG": "/nonexistent/kubeconfig",
           "GPU_HEALTH_JOURNAL_PATH": str(cwd / "journal.db"), "GPU_HEALTH_SOURCES__KMSG__ENABLED": "off",
           "GPU_HEALTH_HTTP__HOST": "127.0.0.1", "NODE_NAME": "no-grpc"}
    return subprocess.run([sys.executable, "-c", WITHOUT_GRPC, *argv], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=120, check=False)


def test_grpcio_is_the_deviceplugin_extra_not_a_dependency():
    """pip install gpu-health-agent leaves grpcio out; [deviceplugin] brings it, and the image installs that."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if d.startswith("grpcio")]
    assert [d for d in project["optional-dependencies"]["deviceplugin"] if d.startswith("grpcio")]
    # The image's runtime lock is resolved with the extra (scripts/lock-image) and the install checks it is there.
    assert "(\"python-runtime.txt\", [\"deviceplugin\"]" in (REPO / "scripts" / "lock-image").read_text()
    assert any(line.startswith("grpcio==") for line in (REPO / "lock" / "python-runtime.txt").read_text().splitlines())
    assert 'import grpc' in (REPO / "scripts" / "install-agent").read_text()


def test_the_agents_run_path_loads_no_grpc():
    """A fresh interpreter that imports the CLI and everything `run` wires has not loaded grpc."""
    code = ("import sys, agent.cli, agent.cli.run, agent.daemon, agent.pipeline, agent.cluster_side, "
            "agent.k8s.podresources, agent.discovery\n"
            "print(sorted(n for n in sys.modules if n.split('.')[0] == 'grpc'))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60,
                            cwd=REPO)
    assert result.stdout.strip() == "[]"


def test_the_agent_runs_a_scenario_without_grpcio(tmp_path: Path):
    """`run --scenario xid79` with grpcio absent: the agent starts, judges the fault and stops cleanly."""
    result = without_grpc("run", "--scenario", "xid79", "--speed", "100", "--port", "0", "--duration", "3",
                          cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert '"event": "agent_stopped"' in result.stderr and '"rule_id": "xid-79"' in result.stderr
    assert "Traceback" not in result.stderr


def test_the_device_plugin_without_grpcio_says_what_to_install(tmp_path: Path):
    """One line naming the extra, exit 1, no traceback."""
    result = without_grpc("kmsg-device-plugin", "--dir", str(tmp_path), cwd=tmp_path)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "kmsg-device-plugin: grpcio is not installed (it is the `deviceplugin` extra: "
        "pip install 'gpu-health-agent[deviceplugin]'; the agent's image has it)"]
