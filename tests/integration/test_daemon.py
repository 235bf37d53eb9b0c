"""The agent as a process: real threads, real HTTP, SIGTERM, journal on disk, rules hot reload."""

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from prometheus_client import CollectorRegistry

from agent.config import load_config
from agent.daemon import Daemon
from agent.engine import builtin_rules_dir, load_rules
from agent.journal import Journal
from agent.model import Observation, Signal
from tests.conftest import gpu, served_port, wait_for


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_the_agent_runs_serves_metrics_and_stops_cleanly_on_sigterm(tmp_path: Path):
    env = dict(os.environ, GPU_HEALTH_JOURNAL_PATH=str(tmp_path / "j.db"), GPU_HEALTH_HTTP__HOST="127.0.0.1",
               GPU_HEALTH_SOURCES__KMSG__ENABLED="off", GPU_HEALTH_SOURCES__NVML__ENABLED="off",
               GPU_HEALTH_SOURCES__DCGM__ENABLED="off", NODE_NAME="it-node", KUBECONFIG="/nonexistent/kubeconfig")
    log = tmp_path / "agent.log"
    with log.open("w") as sink:
        process = subprocess.Popen([sys.executable, "-m", "agent", "run", "--scenario", "xid79", "--speed", "50",
                                    "--port", "0"], env=env, stdout=subprocess.PIPE, stderr=sink, text=True)
    try:
        port = served_port(log)
        assert wait_for(lambda: _metric_seen(port, 'rule_id="xid-79"'))
        status, body = get(f"http://127.0.0.1:{port}/healthz")
        assert status == 200
        assert json.loads(body)["ok"] is True
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=15)
        assert process.returncode == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert '"event": "agent_stopped"' in log.read_text()
    history = Journal(tmp_path / "j.db").history()
    assert any(e.get("rule_id") == "xid-79" for e in history)


def _metric_seen(port: int, text: str) -> bool:
    try:
        return text in get(f"http://127.0.0.1:{port}/metrics")[1]
    except OSError:
        return False


def test_with_no_source_the_agent_says_why_and_exits(tmp_path: Path):
    env = dict(os.environ, GPU_HEALTH_JOURNAL_PATH=str(tmp_path / "j.db"),
               GPU_HEALTH_SOURCES__KMSG__ENABLED="off", GPU_HEALTH_SOURCES__NVML__ENABLED="off",
               GPU_HEALTH_SOURCES__DCGM__ENABLED="off", KUBECONFIG="/nonexistent/kubeconfig")
    result = subprocess.run([sys.executable, "-m", "agent", "run", "--port", "0"], env=env, capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 1
    assert "no source available on this machine" in result.stderr
    assert "Traceback" not in result.stderr


class _FailingSource:
    name = "broken"

    def __init__(self):
        self.calls = 0

    def run(self, emit, stop):
        self.calls += 1
        raise RuntimeError("driver exploded")


class _OneShotSource:
    name = "oneshot"

    def run(self, emit, stop):
        emit(Observation(Signal.XID, 79, time.time(), "oneshot", gpu(0)))
        stop.wait()


def _daemon(tmp_path: Path, sources, rules_dir: Path | None = None) -> Daemon:
    env = {"NODE_NAME": "n1", "GPU_HEALTH_JOURNAL_PATH": str(tmp_path / "j.db")}
    if rules_dir is not None:
        env["GPU_HEALTH_RULES_DIR"] = str(rules_dir)
    config = load_config(None, env=env)
    rules = load_rules(rules_dir or builtin_rules_dir())
    return Daemon(config, sources=sources, rules=rules, registry=CollectorRegistry(), reload_seconds=0.1)


def test_a_failing_source_never_stops_the_others(tmp_path: Path):
    broken = _FailingSource()
    daemon = _daemon(tmp_path, [broken, _OneShotSource()])
    stop = threading.Event()
    thread = threading.Thread(target=daemon.run, args=(stop,))
    thread.start()
    try:
        assert wait_for(lambda: daemon.pipeline.gpu_statuses().get(gpu(0).key) == "fatal")
        assert daemon.metrics.registry.get_sample_value("gpu_health_source_errors_total", {"source": "broken"}) >= 1
    finally:
        stop.set()
        thread.join(timeout=10)


def test_rules_are_hot_reloaded_and_a_broken_change_is_rejected(tmp_path: Path):
    rules_dir = tmp_path / "rules"
    shutil.copytree(builtin_rules_dir(), rules_dir)
    daemon = _daemon(tmp_path, [_OneShotSource()], rules_dir)
    before = len(daemon.pipeline.rules.rules)
    (rules_dir / "zz-broken.yaml").write_text("rules:\n- {id: x, signal: xid}\n")
    assert daemon.reload_rules_if_changed() is False
    assert len(daemon.pipeline.rules.rules) == before
    assert daemon.metrics.registry.get_sample_value("gpu_health_rules_reload_failures_total") == 1
    (rules_dir / "zz-broken.yaml").write_text(
        "rules:\n- {id: extra, signal: xid, code: 9999, severity: info, action: none, fault_class: driver,"
        " summary: s, source: test, recovery: {kind: quiet, quiet_seconds: 60}}\n")
    assert daemon.reload_rules_if_changed() is True
    assert len(daemon.pipeline.rules.rules) == before + 1


def _cut_before_rule(path: Path, rule_id: str) -> None:
    """The file as a ConfigMap that lost its tail (or a write without an atomic rename) leaves it: valid YAML."""
    text = path.read_text(encoding="utf-8")
    path.write_text(text[:text.index(f"\n- id: {rule_id}\n") + 1], encoding="utf-8")


def test_a_reload_cut_at_a_rule_boundary_is_refused_and_xid_79_still_acts(tmp_path: Path):
    """xid.yaml cut before one rule is valid YAML; the reload loses rules, so it is refused, loud, and counted."""
    rules_dir = tmp_path / "rules"
    shutil.copytree(builtin_rules_dir(), rules_dir)
    daemon = _daemon(tmp_path, [_OneShotSource()], rules_dir)
    before = len(daemon.pipeline.rules.rules)
    _cut_before_rule(rules_dir / "xid.yaml", "xid-31")
    assert daemon.reload_rules_if_changed() is False
    assert len(daemon.pipeline.rules.rules) == before
    value = daemon.metrics.registry.get_sample_value
    assert value("gpu_health_rules_reload_refused_total", {"reason": "rules_lost"}) == 1
    assert value("gpu_health_rules_reload_failures_total") == 1
    [verdict] = daemon.pipeline.handle(Observation(Signal.XID, 79, 1.0, "kmsg", gpu(0)), 1.0).verdicts
    assert verdict.rule_id == "xid-79"


def test_a_reload_refusal_is_one_line_naming_what_would_be_lost(tmp_path: Path, capsys):
    """One error line: the event, how many rules would go, which (the first few), and how to remove on purpose."""
    import json

    from agent import logs
    logs.configure_logging("info", "json")
    rules_dir = tmp_path / "rules"
    shutil.copytree(builtin_rules_dir(), rules_dir)
    daemon = _daemon(tmp_path, [_OneShotSource()], rules_dir)
    _cut_before_rule(rules_dir / "xid.yaml", "xid-31")
    capsys.readouterr()
    daemon.reload_rules_if_changed()
    [line] = [json.loads(raw) for raw in capsys.readouterr().err.splitlines() if "rules_reload_refused" in raw]
    assert (line["level"], line["reason"]) == ("error", "rules_lost")
    assert line["lost"] > 100 and "xid-31" in line["missing"] and "retired" in line["fix"]


def test_rules_removed_on_purpose_are_accepted_when_listed_as_retired(tmp_path: Path):
    """An operator removes a rule by naming it under `retired:` in the same change: the reload goes through."""
    rules_dir = tmp_path / "rules"
    shutil.copytree(builtin_rules_dir(), rules_dir)
    daemon = _daemon(tmp_path, [_OneShotSource()], rules_dir)
    before = len(daemon.pipeline.rules.rules)
    text = (rules_dir / "node.yaml").read_text(encoding="utf-8")
    start = text.index("\n- id: ", text.index("\n- id: ") + 1)  # the file's second rule
    end = text.find("\n- id: ", start + 1)
    removed = text[start + 7:text.index("\n", start + 1)]
    (rules_dir / "node.yaml").write_text(f"retired: [{removed}]\n" + text[:start] + (text[end:] if end > 0 else "\n"),
                                         encoding="utf-8")
    assert daemon.reload_rules_if_changed() is True
    assert len(daemon.pipeline.rules.rules) == before - 1


def test_a_reload_that_leaves_a_catalog_xid_uncovered_is_refused_even_if_retired(tmp_path: Path):
    """Retiring xid-79 with nothing else for code 79 would leave a catalog Xid unhandled: refused."""
    rules_dir = tmp_path / "rules"
    shutil.copytree(builtin_rules_dir(), rules_dir)
    daemon = _daemon(tmp_path, [_OneShotSource()], rules_dir)
    text = (rules_dir / "xid.yaml").read_text(encoding="utf-8")
    start = text.index("\n- id: xid-79\n")
    end = text.index("\n- id: ", start + 1)
    (rules_dir / "xid.yaml").write_text("retired: [xid-79]\n" + text[:start] + text[end:], encoding="utf-8")
    assert daemon.reload_rules_if_changed() is False
    value = daemon.metrics.registry.get_sample_value
    assert value("gpu_health_rules_reload_refused_total", {"reason": "catalog_uncovered"}) == 1
    assert daemon.pipeline.rules.get("xid-79") is not None


def test_a_storm_is_folded_in_the_backlog_and_no_new_kind_is_lost(tmp_path: Path):
    """20,000 repeats of one Xid then one Xid 79 on another GPU, before the engine runs: the repeats fold
    (counted) and the new kind is still classified."""
    daemon = _daemon(tmp_path, [_OneShotSource()])
    for i in range(20_000):
        daemon.emit(Observation(Signal.XID, 13, 1.0 + i * 1e-6, "kmsg", gpu(1)))
    daemon.emit(Observation(Signal.XID, 79, 2.0, "kmsg", gpu(2)))
    assert daemon.backlog.depth < 20_000
    assert daemon.metrics.registry.get_sample_value("gpu_health_backlog_coalesced_total") > 0
    daemon._drain(timeout=0, stop=None)
    assert daemon.pipeline.gpu_statuses().get(gpu(2).key) == "fatal"
    assert daemon.metrics.registry.get_sample_value("gpu_health_backlog_dropped_total") == 0
    daemon.journal.close()


def test_a_source_that_reports_itself_failing_makes_healthz_fail(tmp_path: Path):
    """A kernel-log source whose driver records keep failing to be handled is named in /healthz, not ok."""
    failing = _OneShotSource()
    failing.failing = True  # type: ignore[attr-defined]
    daemon = _daemon(tmp_path, [failing])
    daemon._running[failing.name] = True
    ok, detail = daemon.health()
    assert not ok
    assert detail["failing_sources"] == [failing.name]
    daemon.journal.close()


def test_the_loop_gets_its_tick_back_in_a_storm_that_keeps_the_backlog_full(tmp_path: Path):
    """A drain returns at its deadline though observations still wait, so the loop ticks (quiet windows,
    cursors) and beats (/healthz) all through a storm; the final drain at a stop empties the backlog."""
    import itertools

    ticks = itertools.count()
    config = load_config(None, env={"NODE_NAME": "n1", "GPU_HEALTH_JOURNAL_PATH": str(tmp_path / "j.db")})
    daemon = Daemon(config, sources=[_OneShotSource()], rules=load_rules(builtin_rules_dir()),
                    registry=CollectorRegistry(), clock=lambda: next(ticks) * 0.01)
    for i in range(1_000):  # below the backlog's high-water mark: none folded
        daemon.emit(Observation(Signal.XID, 13, 1.0 + i * 1e-3, "kmsg", gpu(1)))
    daemon._drain(timeout=1.0, stop=threading.Event())
    assert 0 < daemon.backlog.depth < 1_000
    daemon._drain(timeout=0, stop=None)
    assert daemon.backlog.depth == 0
    daemon.journal.close()


class _DiskFills(Journal):
    """The real journal, but while `full` every write fails as SQLite's does on a full disk."""

    full = False

    def _check(self) -> None:
        if self.full:
            raise sqlite3.OperationalError("database or disk is full")

    def save_record(self, *args, **kwargs):
        self._check()
        super().save_record(*args, **kwargs)

    def set_cursor(self, *args, **kwargs):
        self._check()
        super().set_cursor(*args, **kwargs)

    def record_verdict(self, *args, **kwargs):
        self._check()
        super().record_verdict(*args, **kwargs)

    def record_action(self, *args, **kwargs):
        self._check()
        super().record_action(*args, **kwargs)


def test_readyz_fails_while_journal_writes_fail_and_recovers_after_one_succeeds(tmp_path: Path):
    """Disk full: the record cannot be saved, so /readyz answers 503 and why while /healthz (liveness) stays
    200, since a restart frees no space; writes that work clear it."""
    from agent.httpserver import AgentHttpServer
    journal = _DiskFills(tmp_path / "j.db")
    config = load_config(None, env={"NODE_NAME": "n1", "GPU_HEALTH_JOURNAL_PATH": str(tmp_path / "j.db")})
    daemon = Daemon(config, sources=[_OneShotSource()], rules=load_rules(builtin_rules_dir()),
                    registry=CollectorRegistry(), journal=journal)
    server = AgentHttpServer("127.0.0.1", 0, metrics=daemon.metrics.exposition, health=daemon.health)
    server.start()
    stop = threading.Event()
    thread = threading.Thread(target=daemon.run, args=(stop,))
    thread.start()
    url = f"http://127.0.0.1:{server.port}/readyz"
    try:
        assert wait_for(lambda: get(url)[0] == 200)
        journal.full = True
        daemon.emit(Observation(Signal.XID, 79, time.time(), "kmsg", gpu(1)))
        assert wait_for(lambda: get(url)[0] == 503)
        assert "disk is full" in json.loads(get(url)[1])["journal_failing"]
        assert get(f"http://127.0.0.1:{server.port}/healthz")[0] == 200
        assert daemon.metrics.registry.get_sample_value("gpu_health_journal_write_failures_total",
                                                        {"kind": "record"}) >= 1
        journal.full = False
        daemon.emit(Observation(Signal.XID, 79, time.time(), "kmsg", gpu(2)))
        assert wait_for(lambda: get(url)[0] == 200)
    finally:
        stop.set()
        thread.join(timeout=10)
        server.close()


def test_a_kernel_log_the_agent_cannot_open_is_a_warning_naming_why(tmp_path: Path):
    """sources.kmsg auto and no device: the agent runs on, but says so loudly (stderr and a warning event)."""
    env = dict(os.environ, GPU_HEALTH_JOURNAL_PATH=str(tmp_path / "j.db"), GPU_HEALTH_HTTP__HOST="127.0.0.1",
               GPU_HEALTH_SOURCES__KMSG__PATH=str(tmp_path / "no-kmsg"), GPU_HEALTH_SOURCES__NVML__ENABLED="off",
               GPU_HEALTH_SOURCES__DCGM__ENABLED="off", NODE_NAME="it-node", KUBECONFIG="/nonexistent/kubeconfig",
               GPU_HEALTH_LOG__FORMAT="json")
    done = subprocess.run([sys.executable, "-m", "agent", "run", "--scenario", "xid79", "--duration", "0.5",
                           "--port", "0"], env=env, capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert f"warning: source kmsg not running: cannot open {tmp_path / 'no-kmsg'}" in done.stderr
    [event] = [json.loads(line) for line in done.stderr.splitlines() if '"source_not_running"' in line]
    assert event["level"] == "warning" and "gpu-health-agent.io/kmsg" in event["reason"]
