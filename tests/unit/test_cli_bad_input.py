"""Every command, given bad arguments or files: one line on stderr, no traceback, a documented exit code."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest
from click.testing import CliRunner

from agent.cli import main

USAGE, FAILED, UNKNOWN = 2, 1, 3


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    binary = tmp_path / "binary"
    binary.write_bytes(bytes(range(256)) * 4)
    latin = tmp_path / "latin1.yaml"
    latin.write_bytes("mode: caf\xe9\n".encode("latin-1"))
    not_sqlite = tmp_path / "journal.db"
    not_sqlite.write_text("this is not a database\n" * 20)
    rules = tmp_path / "rules"
    rules.mkdir()
    (rules / "bad.yaml").write_bytes(b"\xff\xfe\x00rules")
    return {"BIN": str(binary), "LATIN": str(latin), "NOTDB": str(not_sqlite), "RULES": str(rules),
            "UNWRITABLE": "/proc/no-such-dir/journal.db", "MISSING": str(tmp_path / "missing.yaml"),
            "JOURNAL": str(tmp_path / "fresh.db")}


def local_env(files: dict[str, str], **extra: str) -> dict[str, str]:
    """No cluster, no GPU, no kernel log: the commands fail only on what the case gives them."""
    return {"KUBECONFIG": "/nonexistent/kubeconfig", "KUBERNETES_SERVICE_HOST": "", "NODE_NAME": "n1",
            "GPU_HEALTH_SOURCES__KMSG__ENABLED": "off", "GPU_HEALTH_SOURCES__NVML__ENABLED": "off",
            "GPU_HEALTH_JOURNAL_PATH": files["JOURNAL"], "GPU_HEALTH_HTTP__HOST": "127.0.0.1", **extra}


#: The agent's configured default (agent/config.py): a test that binds it fails wherever something else does.
DEFAULT_PORT = 9402


def served_port(output: str) -> int:
    """The port `run` says it serves on (its start line ends `http :PORT`)."""
    match = re.search(r"http :(\d+)$", output, re.MULTILINE)
    assert match, output
    return int(match.group(1))


CASES = [
    # (arguments with placeholders, expected exit code)
    ("nonsense-command", USAGE),
    ("check --config BIN", UNKNOWN),
    ("check --config LATIN", UNKNOWN),
    ("check --config MISSING", UNKNOWN),
    ("check --no-such-option", UNKNOWN),
    ("run --config BIN", USAGE),
    ("run --config LATIN", USAGE),
    ("run --port 70000", USAGE),
    ("run --port -1", USAGE),
    ("run --speed 0 --scenario xid79", USAGE),
    ("run --speed -2 --scenario xid79", USAGE),
    ("run --duration -1", USAGE),
    ("run --duration 0", USAGE),
    ("run --scenario BIN", USAGE),
    ("simulate xid79 --journal NOTDB", USAGE),
    ("simulate xid79 --journal UNWRITABLE", USAGE),
    ("simulate BIN", USAGE),
    ("simulate no-such-scenario", USAGE),
    ("simulate xid79 --rules RULES", USAGE),
    ("simulate xid79 --mode sideways", USAGE),
    ("history --journal NOTDB", USAGE),
    ("history --journal BIN", USAGE),
    ("history --config BIN", USAGE),
    ("history --journal MISSING", FAILED),
    ("history --limit many", USAGE),
    ("explain --xid -1", USAGE),
    ("explain --xid 0", USAGE),
    ("explain --xid seventy", USAGE),
    ("explain --signal temperature", USAGE),
    ("explain --signal no-such-signal --value 1", USAGE),
    ("explain --xid 79 --attr novalue", USAGE),
    ("explain --xid 79 --rules RULES", USAGE),
    ("explain", USAGE),
    ("kmsg parse BIN", USAGE),
    ("kmsg parse MISSING", USAGE),
    ("rules lint RULES", USAGE),
    ("rules lint MISSING", USAGE),
    ("config show --config BIN", USAGE),
    ("config show --config LATIN", USAGE),
    ("release --kubeconfig MISSING", FAILED),
    ("drill --xid 0 --pci 0000:3b:00", USAGE),
    ("drill --wait 0 --pci 0000:3b:00", USAGE),
    ("drill --full --pci 0000:3b:00", USAGE),
    ("drill --node someone-else --pci 0000:3b:00", USAGE),
    ("drill --config BIN", USAGE),
    ("cleanup", USAGE),
    ("cleanup --all-nodes --node n1", USAGE),
    ("cleanup --all-nodes --kubeconfig MISSING", FAILED),
    ("cleanup --all-nodes --config LATIN", USAGE),
    ("reset-helper", FAILED),
    ("reset-helper --config BIN", USAGE),
]


def substitute(args: str, files: dict[str, str]) -> list[str]:
    return [files.get(word, word) for word in args.split()]


@pytest.mark.parametrize(("args", "code"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_on_stderr_with_a_documented_exit_code(args: str, code: int, files):
    """One readable line, never a traceback or an internal error, and the exit code the README documents."""
    result = CliRunner().invoke(main, substitute(args, files), env=local_env(files))
    assert result.exit_code == code, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.output and "internal error" not in result.stderr


def test_a_journal_that_is_not_sqlite_is_moved_aside_and_run_goes_on(files):
    """A damaged journal never leaves the node unmonitored: run moves it aside, says so in one line, runs."""
    env = local_env(files, GPU_HEALTH_JOURNAL_PATH=files["NOTDB"])
    result = CliRunner().invoke(main, ["run", "--port", "0", "--duration", "1", "--scenario", "xid79"], env=env)
    assert result.exit_code == 0, result.output
    assert "journal_recreated" in result.output and "Traceback" not in result.output
    assert list(Path(files["NOTDB"]).parent.glob(Path(files["NOTDB"]).name + ".damaged-*"))
    assert served_port(result.output) != DEFAULT_PORT  # any free port: another process may hold the default


def test_history_never_moves_a_damaged_journal(files):
    """Reading a file an operator named changes nothing: history refuses it and leaves it where it is."""
    before = Path(files["NOTDB"]).read_bytes()
    result = CliRunner().invoke(main, ["history", "--journal", files["NOTDB"]])
    assert result.exit_code == USAGE
    assert Path(files["NOTDB"]).read_bytes() == before


def test_journal_in_an_unwritable_place_stops_run_with_one_line(files):
    """A journal path the agent cannot create is named with the reason."""
    env = local_env(files, GPU_HEALTH_JOURNAL_PATH=files["UNWRITABLE"])
    result = CliRunner().invoke(main, ["run", "--port", "0", "--duration", "5"], env=env)
    assert result.exit_code == USAGE
    assert result.stderr.strip().startswith(f"{files['UNWRITABLE']}: cannot create the journal")


def test_a_port_in_use_stops_run_with_one_line(files):
    """Another process on the metrics port: one line naming the port, exit 1, no traceback."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = ["run", "--port", str(port), "--duration", "5", "--scenario", "xid79"]
        result = CliRunner().invoke(main, args, env=local_env(files))
    assert result.exit_code == FAILED
    assert f"port {port}" in result.stderr and "in use" in result.stderr
    assert "Traceback" not in result.output


def test_a_reset_helper_that_cannot_listen_stops_with_one_line(files):
    """A socket in a place that cannot hold one is one line, not a traceback."""
    env = local_env(files, GPU_HEALTH_REMEDIATION__RESET_HELPER_SOCKET="/proc/no-such-dir/reset.sock")
    result = CliRunner().invoke(main, ["reset-helper"], env=env)
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert "cannot listen on /proc/no-such-dir/reset.sock" in result.output


def test_run_refuses_a_diagnostic_that_its_mode_would_never_run(files, tmp_path: Path):
    """Issue 41: `run --mode quarantine` over a config whose diagnostic only remediate runs: one line, exit 2,
    before anything starts; the same config with remediate is accepted."""
    config = tmp_path / "config.yaml"
    config.write_text('mode: remediate\nremediation: {diagnostic_command: [dcgmi, diag, -r, "3", -i, "{uuid}"]}\n')
    result = CliRunner().invoke(main, ["run", "--config", str(config), "--mode", "quarantine", "--port", "0",
                                       "--duration", "1"], env=local_env(files))
    assert result.exit_code == USAGE, result.output
    [line] = [line for line in result.stderr.splitlines() if line.strip()]
    assert line.startswith("--mode: field mode: remediation.diagnostic_command is set but mode quarantine never runs")


def test_simulate_refuses_a_scenario_diagnostic_in_a_mode_that_never_runs_it():
    """A scenario's node.diagnostic stands for a configured diagnostic: only remediate runs one (one line, 2)."""
    result = CliRunner().invoke(main, ["simulate", "--mode", "quarantine", "app-faults-across-workloads"])
    assert result.exit_code == USAGE, result.output
    [line] = [line for line in result.stderr.splitlines() if line.strip()]
    assert "mode quarantine never runs" in line
