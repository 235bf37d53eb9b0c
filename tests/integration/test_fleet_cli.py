"""`gpu-health-agent fleet hold|release|status` against the fake API server."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from agent.cli import main
from agent.errors import InputError
from agent.fleet.published import HOLDS_CONFIGMAP, decode
from agent.fleetctl.commands import parse_duration
from agent.simulation.fake_apiserver import ApiError, FakeApiServer, FakeCluster
from agent.simulation.fake_apiserver.resources import RESOURCES

pytestmark = pytest.mark.usefixtures("no_retry_sleep")
CONFIGMAPS = next(r for r in RESOURCES if r.plural == "configmaps")


@pytest.fixture
def server() -> Iterator[FakeApiServer]:
    fake = FakeApiServer(FakeCluster()).start()
    for i in range(3):
        fake.cluster.add("nodes", {"metadata": {"name": f"gpu-{i}", "labels": {"rack": "r1" if i < 2 else "r2"}}})
    yield fake
    fake.stop()


@pytest.fixture
def kubeconfig(server: FakeApiServer, tmp_path: Path) -> str:
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(server.kubeconfig()))
    return str(path)


def fleet(kubeconfig: str, *args: str):
    return CliRunner().invoke(main, ["fleet", *args, "--kubeconfig", kubeconfig, "--namespace", "gpu-health"],
                              catch_exceptions=False)


def holds(server: FakeApiServer) -> list:
    try:
        obj = server.cluster.get(CONFIGMAPS, "gpu-health", HOLDS_CONFIGMAP)
    except ApiError:
        return []
    return decode(obj.get("data"), observed_at=0.0)


def test_hold_by_selector_publishes_an_operator_hold_on_the_matching_nodes(server, kubeconfig):
    """`fleet hold --rule --selector --duration` writes one operator hold covering the selected nodes."""
    result = fleet(kubeconfig, "hold", "--rule", "xid-13", "--selector", "rack=r1", "--duration", "2h")
    assert result.exit_code == 0, result.output
    [held] = holds(server)
    assert held.by_operator and held.rule_id == "xid-13" and held.nodes == {"gpu-0", "gpu-1"}
    assert held.expires_at - held.started_at == pytest.approx(7200.0)


def test_hold_with_dry_run_prints_the_object_and_writes_nothing(server, kubeconfig):
    """--dry-run prints the ConfigMap data it would write; the API sees no write."""
    writes = server.cluster.faults.writes
    result = fleet(kubeconfig, "hold", "--rule", "xid-13", "--node", "gpu-2", "--duration", "30m", "--dry-run")
    assert result.exit_code == 0, result.output
    assert "would write configmap gpu-health/gpu-health-fleet-holds" in result.output
    assert '"gpu-2"' in result.output
    assert server.cluster.faults.writes == writes and holds(server) == []


def test_a_hardware_rule_cannot_be_held(server, kubeconfig):
    """Holds never cover hardware faults: --rule xid-48 (double-bit ECC) is one line, exit 2."""
    result = fleet(kubeconfig, "hold", "--rule", "xid-48", "--node", "gpu-0", "--duration", "1h")
    assert result.exit_code == 2
    assert "hardware fault is never held" in result.output and "Traceback" not in result.output


def test_an_unknown_node_is_one_line_and_no_write(server, kubeconfig):
    """A node that does not exist is refused before anything is written."""
    result = fleet(kubeconfig, "hold", "--rule", "xid-13", "--node", "gpu-9", "--duration", "1h")
    assert result.exit_code == 2 and "no such node: gpu-9" in result.output
    assert holds(server) == []


def test_release_ends_a_hold_and_status_shows_it_spent(server, kubeconfig):
    """release ID marks the hold spent and ended now; status lists it as spent; its nodes act again."""
    fleet(kubeconfig, "hold", "--rule", "xid-13", "--node", "gpu-0", "--duration", "1h")
    [held] = holds(server)
    assert fleet(kubeconfig, "release", held.id).exit_code == 0
    [after] = holds(server)
    assert after.spent and after.expires_at <= held.expires_at - 3000
    shown = json.loads(fleet(kubeconfig, "status", "--output", "json").output)
    assert [(row["id"], row["state"]) for row in shown] == [(held.id, "spent")]


def test_releasing_an_unknown_hold_is_one_line(server, kubeconfig):
    """An id that is not published: one line naming it, exit 2."""
    result = fleet(kubeconfig, "release", "no/such/hold")
    assert result.exit_code == 2 and "no hold 'no/such/hold'" in result.output


def test_release_dry_run_writes_nothing(server, kubeconfig):
    """release --dry-run prints the spent hold it would write and leaves the object as it was."""
    fleet(kubeconfig, "hold", "--rule", "xid-13", "--node", "gpu-0", "--duration", "1h")
    [held] = holds(server)
    result = fleet(kubeconfig, "release", held.id, "--dry-run")
    assert result.exit_code == 0 and '"spent": true' in result.output
    assert not holds(server)[0].spent


@pytest.mark.parametrize("text, seconds", [("90", 90.0), ("90s", 90.0), ("30m", 1800.0), ("2h", 7200.0),
                                           ("1d", 86400.0)])
def test_durations_read_with_their_unit(text, seconds):
    """90, 90s, 30m, 2h and 1d are seconds, minutes, hours and days."""
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "soon", "0", "-5m", "8d"])
def test_a_bad_or_unbounded_duration_is_refused(text):
    """Not a duration, not positive, or past 7 days: one InputError."""
    with pytest.raises(InputError):
        parse_duration(text)


def test_fleet_run_answers_its_probes_on_a_listener_of_its_own(server, kubeconfig, tmp_path):
    """`fleet run` serves /healthz on --health-port beside /metrics on --port: the probes' port answers
    while the metrics port's connections are all taken (its cap of 16), and serves no metrics."""
    import re
    import socket
    import subprocess
    import sys
    import time
    import urllib.error
    import urllib.request

    log = tmp_path / "fleet.log"
    with log.open("w") as sink:
        process = subprocess.Popen([sys.executable, "-m", "agent", "fleet", "run", "--kubeconfig", kubeconfig,
                                    "--namespace", "gpu-health", "--port", "0", "--health-port", "0",
                                    "--duration", "60"], stdout=sink, stderr=subprocess.STDOUT, text=True)
    held: list[socket.socket] = []
    try:
        deadline = time.monotonic() + 30
        while not (found := re.search(r"http :(\d+) \(probes :(\d+)\)", log.read_text())):
            assert time.monotonic() < deadline and process.poll() is None, log.read_text()
            time.sleep(0.1)
        metrics_port, health_port = int(found.group(1)), int(found.group(2))
        held = [socket.create_connection(("127.0.0.1", metrics_port)) for _ in range(20)]  # every slot taken
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{health_port}/healthz", timeout=5) as answer:
                    assert answer.status == 200
                    break
            except urllib.error.HTTPError as exc:  # 503 until its first list of the nodes
                assert exc.code == 503 and time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)
        with urllib.request.urlopen(f"http://127.0.0.1:{health_port}/metrics", timeout=5) as answer:
            assert b"gpu_health_fleet" not in answer.read()
    finally:
        for connection in held:
            connection.close()
        process.terminate()
        process.wait(timeout=15)


def test_status_says_what_a_scoped_hold_covers(server, kubeconfig, monkeypatch):
    """A controller's hold published by its key alone (past LISTED_NODES): status says it covers every node
    of that driver version, not "0 node(s)"."""
    from agent.fleet import published
    from agent.fleet.correlate import Dimension
    from agent.fleet.hold import Hold
    from agent.model import FaultClass
    monkeypatch.setattr(published, "LISTED_NODES", 0)
    driver = Hold("xid-119/driver-version/570.86.15", "xid-119", FaultClass.DRIVER, Dimension.DRIVER_VERSION,
                  "570.86.15", "the driver version 570.86.15", frozenset({"gpu-0", "gpu-1"}), 0.0, 3600.0)
    server.cluster.add("configmaps", {"metadata": {"name": HOLDS_CONFIGMAP, "namespace": "gpu-health"},
                                      "data": published.encode([driver], now=0.0, wall=1.7e9, writer="fleet-a")})
    result = fleet(kubeconfig, "status")
    assert result.exit_code == 0, result.output
    assert "every node whose own driver-version is 570.86.15" in result.output and "0 node(s)" not in result.output
