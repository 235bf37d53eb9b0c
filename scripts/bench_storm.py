#!/usr/bin/env python3
"""Prints, for the agent and for node-problem-detector (NPD) in the same run, the rows of issue 14's table
that a kernel log drives: idle RSS; a storm of distinct Xid lines at 10,000 lines/s for 30 s (CPU per line,
time to catch up after it ended, new kinds of fault seen); the same storm of repeating lines; a 1 M-line log
with 1 % NVRM lines (lines/s).

Both tools follow the same kind of syslog-format kernel log file (`Nov 30 12:00:00 host kernel: [  1.0] ...`),
written by this script as the storm goes; each is its own process, measured through /proc and its /metrics.
The agent runs as `gpu-health-agent run` in local mode with only the kernel-log source. NPD is built at
benchmark time from the Go module proxy into a temporary directory (never vendored or committed) and runs
its system-log monitor (filelog plugin) with its stock kernel rules plus one rule per Xid code used here.
With `--npd-source DIR` (a checkout of NPD, e.g. its main branch, carrying `vendor/`), that tree is built
too, offline (`go build -mod=vendor -tags NPD_TAGS ./cmd/nodeproblemdetector`), and measured as a column of
its own beside the release, named by its commit. The agent runs from the tree this script imports `agent`
from (printed first; PYTHONPATH=. measures a worktree rather than the one .venv was installed from).

Usage: python scripts/bench_storm.py [--quick] [--seconds 30] [--rate 10000] [--mixed-lines N] [--no-npd]
       [--npd-source DIR] [--tools agent,agent+backlog,npd]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from prometheus_client import CollectorRegistry, start_http_server

import agent
from agent.engine import builtin_rules_dir, load_rules
from agent.journal import Journal
from agent.logs import configure_logging
from agent.metrics import Metrics
from agent.model import NodeInventory
from agent.pipeline import Pipeline
from agent.remediation import GuardPolicy
from agent.sources.backlog import Backlog
from agent.sources.kmsg import KmsgSource

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import kernel_log, repeating_storm

NPD_MODULE = "k8s.io/node-problem-detector"
NPD_VERSIONS = ("v0.8.20", "v0.8.21", "v0.8.19", "v0.8.12")
NPD_TAGS = "disable_custom_plugin_monitor disable_system_stats_monitor disable_stackdriver_exporter"
#: New kinds of fault injected during the storm (code, PCI bus): each must come out the other end.
NEW_KINDS = ((48, "e1"), (63, "e2"), (94, "e3"), (119, "e4"), (74, "e5"))
MARKER = (79, "ee")
CLOCK_TICK = os.sysconf("SC_CLK_TCK")
#: The tree the agent measured comes from: the one this script imported `agent` from.
AGENT_TREE = Path(agent.__file__).resolve().parent.parent
#: How often "caught up" is looked for once a storm ended (a scrape of the tool's /metrics each time).
CATCH_UP_POLL_SECONDS = 0.01


def syslog_line(body: str, now: float) -> str:
    """One kernel record as rsyslog writes it (and NPD's filelog plugin reads it)."""
    return f"{time.strftime('%b %e %H:%M:%S', time.localtime(now))} benchnode kernel: [{now % 1e5:12.6f}] {body}\n"


def body_of(raw: str) -> str:
    return raw.split(";", 1)[1]


def xid_body(code: int, bus: str) -> str:
    return f"NVRM: Xid (PCI:0000:{bus}:00): {code}, pid=4242, name=bench, injected kind {code}"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICK


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def scrape(port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
            return response.read().decode()
    except OSError:
        return ""


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.05) -> float | None:
    """Seconds until `predicate` held, or None after `timeout`."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if predicate():
            return time.monotonic() - start
        time.sleep(interval)
    return None


class Tool:
    """One detector process following one log file."""

    name = ""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def slug(self) -> str:
        """The name as it may appear in a file name."""
        return re.sub(r"[^A-Za-z0-9.+-]", "_", self.name)

    def command(self, log: Path) -> list[str]:
        raise NotImplementedError

    def seen(self, metrics: str, code: int, bus: str) -> bool:
        raise NotImplementedError

    def start(self, log: Path) -> None:
        log.touch()
        stderr = (self.workdir / f"{self.slug}.stderr").open("ab")
        self.process = subprocess.Popen(self.command(log), stdout=subprocess.DEVNULL, stderr=stderr,
                                        cwd=self.workdir, env=self.env())
        if wait_until(lambda: bool(scrape(self.port)), 60) is None:
            raise RuntimeError(f"{self.name} did not start; see {self.workdir / (self.slug + '.stderr')}")

    def env(self) -> dict[str, str]:
        return {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            self.process = None

    @property
    def pid(self) -> int:
        assert self.process is not None  # noqa: S101 - started before use
        return self.process.pid


class Agent(Tool):
    name = "agent"

    def env(self) -> dict[str, str]:
        """The agent from AGENT_TREE, whichever tree the interpreter's own install points at."""
        env = super().env()
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(AGENT_TREE), env.get("PYTHONPATH", "")) if p)
        return env

    def command(self, log: Path) -> list[str]:
        config = self.workdir / "agent.yaml"
        config.write_text(json.dumps({
            "node_name": "benchnode", "journal_path": str(self.workdir / f"{self.slug}-{log.stem}.db"),
            "sources": {"kmsg": {"enabled": "on", "path": str(log)}, "nvml": {"enabled": "off"},
                        "dcgm": {"enabled": "off"}},
            "http": {"host": "127.0.0.1", "port": self.port}, "log": {"level": "warning", "format": "json"},
        }))
        return [str(Path(sys.executable).with_name("gpu-health-agent")), "run", "--config", str(config)]

    def seen(self, metrics: str, code: int, bus: str) -> bool:
        return bool(re.search(rf'gpu_health_verdicts_total{{[^}}]*kind="fault"[^}}]*rule_id="xid-{code}(?:-[^"]*)?"[^}}]*}} ',
                              metrics))


class BacklogAgent(Agent):
    """The agent's detection path with the backlog between source and engine, as the daemon is to wire it:
    the real KmsgSource, Backlog, Pipeline (local mode, journal) and Metrics, in a process of its own."""

    name = "agent+backlog"

    def command(self, log: Path) -> list[str]:
        journal = self.workdir / f"{self.slug}-{log.stem}.db"
        return [sys.executable, str(Path(__file__).resolve()), "--serve", str(log), str(self.port), str(journal)]


def serve(log: Path, port: int, journal: Path) -> None:
    """Run BacklogAgent's process until terminated."""
    configure_logging("warning", "json")
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    backlog = Backlog(capacity=10_000)
    metrics.watch_backlog(backlog)
    pipeline = Pipeline(rules=load_rules(builtin_rules_dir()), inventory=NodeInventory(name="benchnode"),
                        policy=GuardPolicy(), metrics=metrics, journal=Journal(journal))
    stop = threading.Event()
    threading.Thread(target=KmsgSource(path=log).run, args=(backlog.put, stop), daemon=True).start()
    start_http_server(port, addr="127.0.0.1", registry=registry)
    while True:
        observation = backlog.get(timeout=1.0)
        if observation is None:
            pipeline.tick()
        else:
            pipeline.handle(observation)


class Npd(Tool):
    """One NPD build: its column is named by its version (the release's tag, or the checkout's commit)."""

    def __init__(self, workdir: Path, built: BuiltNpd) -> None:
        super().__init__(workdir)
        self.name = f"npd {built.label}"
        self.binary = built.binary
        self.stock_rules = built.stock_rules

    def command(self, log: Path) -> list[str]:
        xid_rules = [{"type": "temporary", "reason": f"NvidiaXid{code}",
                      "pattern": rf"NVRM: Xid \(PCI:[0-9a-fA-F:.]+\): {code},.*"} for code in
                     sorted({code for code, _ in (*NEW_KINDS, MARKER)} | {13, 31, 43})]
        path = self.workdir / f"{self.slug}-kernel-monitor.json"
        path.write_text(json.dumps(npd_kernel_monitor(log, self.stock_rules, [], xid_rules), indent=1))
        return [str(self.binary), "--enable-k8s-exporter=false", f"--config.system-log-monitor={path}",
                "--prometheus-address=127.0.0.1", f"--prometheus-port={self.port}", "--hostname-override=benchnode",
                "--logtostderr"]

    def seen(self, metrics: str, code: int, bus: str) -> bool:
        match = re.search(rf'problem_counter{{[^}}]*reason="NvidiaXid{code}"[^}}]*}} (\S+)', metrics)
        return match is not None and float(match.group(1)) >= 1


class BuiltNpd(NamedTuple):
    """An NPD binary, its stock kernel-monitor.json and its version: the release's tag (built from the module
    proxy), or the commit and date of the checkout it was built from (`--npd-source`)."""

    binary: Path
    stock_rules: Path
    version: str
    label: str = ""


def npd_kernel_monitor(log: Path, stock_rules: Path, conditions: list[dict[str, str]],
                       rules: list[dict[str, str]]) -> dict[str, Any]:
    """NPD's system-log monitor config: the filelog plugin on a syslog-format kernel log, stock rules and more."""
    stock = json.loads(stock_rules.read_text())
    return {
        "plugin": "filelog",
        "pluginConfig": {"timestamp": "^.{15}", "message": r"kernel: \[.*\] (.*)",
                         "timestampFormat": "Jan _2 15:04:05"},
        "logPath": str(log), "lookback": "5m", "bufferSize": 10, "source": "kernel-monitor",
        "metricsReporting": True, "conditions": [*stock["conditions"], *conditions],
        "rules": [*stock["rules"], *rules],
    }


def build_npd(workdir: Path) -> BuiltNpd | str:
    """NPD built from the module proxy, or why not."""
    go = shutil.which("go")
    if go is None:
        return "no Go toolchain on PATH"
    env = {**os.environ, "GOFLAGS": "-mod=mod", "GONOSUMDB": NPD_MODULE, "GOTOOLCHAIN": "local"}
    why = ""
    for version in NPD_VERSIONS:
        fetched = subprocess.run([go, "mod", "download", "-json", f"{NPD_MODULE}@{version}"], capture_output=True,
                                 text=True, env=env, timeout=600, check=False)
        info = json.loads(fetched.stdout or "{}")
        if fetched.returncode != 0 or not info.get("Dir"):
            why = f"{NPD_MODULE}@{version}: {info.get('Error') or fetched.stderr.strip()[:200]}"
            continue
        source = workdir / f"npd-{version}"
        shutil.copytree(info["Dir"], source)
        for path in source.rglob("*"):
            path.chmod(path.stat().st_mode | 0o200)
        shutil.rmtree(source / "vendor", ignore_errors=True)  # module zips carry only vendor/modules.txt
        binary = workdir / "node-problem-detector"
        built = subprocess.run([go, "build", "-tags", NPD_TAGS, "-o", str(binary), "./cmd/nodeproblemdetector"],
                               cwd=source, capture_output=True, text=True, env=env, timeout=1800, check=False)
        if built.returncode != 0:
            why = f"building {NPD_MODULE}@{version} failed: {built.stderr.strip()[-300:]}"
            continue
        print(f"# NPD {version} built from the Go module proxy into {binary}")
        return BuiltNpd(binary, source / "config" / "kernel-monitor.json", version, version)
    return why or "no NPD version could be fetched"


def build_npd_source(source: Path, workdir: Path) -> BuiltNpd | str:
    """NPD built offline from a local checkout that carries `vendor/` (its main branch, say), or why not."""
    go = shutil.which("go")
    if go is None:
        return "no Go toolchain on PATH"
    source = source.resolve()
    if not (source / "cmd" / "nodeproblemdetector").is_dir():
        return f"{source} is not a node-problem-detector checkout (no cmd/nodeproblemdetector)"
    if not (source / "vendor" / "modules.txt").is_file():
        return f"{source} has no vendor/modules.txt: `go build -mod=vendor` needs the vendored modules"
    commit, date = source_commit(source)
    binary = workdir / f"node-problem-detector-{commit}"
    env = {**os.environ, "GOFLAGS": "-mod=vendor -buildvcs=false", "GOTOOLCHAIN": "local", "GOPROXY": "off"}
    built = subprocess.run([go, "build", "-mod=vendor", "-tags", NPD_TAGS, "-o", str(binary),
                            "./cmd/nodeproblemdetector"], cwd=source, capture_output=True, text=True, env=env,
                           timeout=1800, check=False)
    if built.returncode != 0:
        return f"building {source} failed: {built.stderr.strip()[-300:]}"
    version = f"{commit} ({date})" if date else commit
    print(f"# NPD {version} built from the checkout {source} (-mod=vendor) into {binary}")
    return BuiltNpd(binary, source / "config" / "kernel-monitor.json", version, commit)


def source_commit(source: Path) -> tuple[str, str]:
    """(short commit, commit date) of a git checkout; (the directory's name, "") for a tree that is not one."""
    shown = subprocess.run(["git", "-C", str(source), "log", "-1", "--format=%h %cs"], capture_output=True,
                           text=True, timeout=30, check=False)
    fields = shown.stdout.split()
    if shown.returncode != 0 or len(fields) != 2:
        return source.name, ""
    dirty = subprocess.run(["git", "-C", str(source), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, timeout=30, check=False).stdout.strip()
    return fields[0] + ("+dirty" if dirty else ""), fields[1]


def build_npds(workdir: Path, *, source: Path | None) -> list[BuiltNpd]:
    """The module proxy's release and, with `source`, the checkout: those that built (why not, for the others)."""
    builds: list[BuiltNpd] = []
    for built in (build_npd(workdir), *([build_npd_source(source, workdir)] if source is not None else [])):
        if isinstance(built, str):
            print(f"# NPD not measured: {built}")
        else:
            builds.append(built)
    return builds


class Writer:
    """Appends syslog lines to the log at a steady rate, in 10 ms batches."""

    def __init__(self, log: Path) -> None:
        self.handle = log.open("a", encoding="utf-8")

    def storm(self, bodies: list[str], rate: int, seconds: float, inject: list[tuple[float, str]]) -> int:
        batch = max(1, rate // 100)
        start = time.monotonic()
        sent = 0
        pending = sorted(inject)
        total = int(rate * seconds)
        while sent < total:
            due = start + sent / rate
            delay = due - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            now = time.time()
            chunk = [syslog_line(bodies[(sent + n) % len(bodies)], now) for n in range(min(batch, total - sent))]
            while pending and pending[0][0] <= (sent / total):
                chunk.append(syslog_line(pending.pop(0)[1], now))
            self.handle.write("".join(chunk))
            self.handle.flush()
            sent += batch
        return sent

    def write(self, bodies: list[str]) -> None:
        now = time.time()
        self.handle.write("".join(syslog_line(body, now) for body in bodies))
        self.handle.flush()

    def close(self) -> None:
        self.handle.close()


@dataclass(slots=True)
class StormFigures:
    lines: int
    cpu_us_per_line: float
    catch_up_seconds: float | None
    kinds_seen: int


def storm(tool: Tool, log: Path, bodies: list[str], rate: int, seconds: float) -> StormFigures:
    tool.start(log)
    writer = Writer(log)
    try:
        cpu_before = cpu_seconds(tool.pid)
        inject = [((n + 1) / (len(NEW_KINDS) + 1), xid_body(code, bus)) for n, (code, bus) in enumerate(NEW_KINDS)]
        lines = writer.storm(bodies, rate, seconds, inject)
        writer.write([xid_body(*MARKER)])
        caught_up = wait_until(lambda: tool.seen(scrape(tool.port), *MARKER), timeout=max(120.0, seconds * 10),
                               interval=CATCH_UP_POLL_SECONDS)
        cpu = cpu_seconds(tool.pid) - cpu_before
        metrics = scrape(tool.port)
        kinds = sum(tool.seen(metrics, code, bus) for code, bus in NEW_KINDS)
        return StormFigures(lines + len(NEW_KINDS) + 1, cpu / (lines + len(NEW_KINDS) + 1) * 1e6, caught_up, kinds)
    finally:
        writer.close()
        tool.stop()


def idle_rss(tool: Tool, log: Path) -> float:
    tool.start(log)
    try:
        time.sleep(3)
        return rss_mib(tool.pid)
    finally:
        tool.stop()


def mixed(tool: Tool, log: Path, bodies: list[str]) -> tuple[float | None, float]:
    """(lines/s, CPU us/line) for a whole log appended at once, until its last line is seen."""
    tool.start(log)
    writer = Writer(log)
    try:
        cpu_before = cpu_seconds(tool.pid)
        start = time.monotonic()
        writer.write([*bodies, xid_body(*MARKER)])
        done = wait_until(lambda: tool.seen(scrape(tool.port), *MARKER), timeout=900, interval=0.1)
        cpu = cpu_seconds(tool.pid) - cpu_before
        elapsed = time.monotonic() - start if done is not None else None
        return (len(bodies) + 1) / elapsed if elapsed else None, cpu / (len(bodies) + 1) * 1e6
    finally:
        writer.close()
        tool.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10 s storms and a 200,000-line mixed log")
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--rate", type=int, default=10_000)
    parser.add_argument("--mixed-lines", type=int, help="lines of the mixed log (1,000,000; 200,000 with --quick)")
    parser.add_argument("--no-npd", action="store_true", help="measure the agent only")
    parser.add_argument("--npd-source", type=Path, metavar="DIR",
                        help="also build NPD from this checkout (with vendor/) and measure it beside the release")
    parser.add_argument("--tools", default="agent,agent+backlog,npd",
                        help="which to measure (comma-separated; npd: every NPD build)")
    parser.add_argument("--serve", nargs=3, metavar=("LOG", "PORT", "JOURNAL"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(Path(args.serve[0]), int(args.serve[1]), Path(args.serve[2]))
        return
    seconds = 10.0 if args.quick else args.seconds
    mixed_lines = args.mixed_lines or (200_000 if args.quick else 1_000_000)
    workdir = Path(tempfile.mkdtemp(prefix="bench-storm-"))
    wanted = set(args.tools.split(","))
    print(f"# the agent from {AGENT_TREE}")
    tools: list[Tool] = [tool for tool in (Agent(workdir), BacklogAgent(workdir)) if tool.name in wanted]
    if not args.no_npd and "npd" in wanted:
        tools.extend(Npd(workdir, built) for built in build_npds(workdir, source=args.npd_source))
    distinct = [body_of(line) for line in kernel_log(int(args.rate * seconds), 1.0)]
    repeating = [body_of(line) for line in repeating_storm(29)]
    mixed_log = [body_of(line) for line in kernel_log(mixed_lines, 0.01)]
    rows: dict[str, dict[str, str]] = {}
    for tool in tools:
        def log(label: str, name: str = tool.slug) -> Path:
            return workdir / f"{name}-{label}.log"

        print(f"# measuring {tool.name}", file=sys.stderr, flush=True)
        rows.setdefault("idle RSS (MiB)", {})[tool.name] = f"{idle_rss(tool, log('idle')):.1f}"
        for label, bodies in (("distinct", distinct), ("repeating", repeating)):
            figures = storm(tool, log(label), bodies, args.rate, seconds)
            rows.setdefault(f"{label}-line storm {args.rate:,}/s {seconds:g}s: CPU us/line", {})[tool.name] = \
                f"{figures.cpu_us_per_line:.1f}"
            catch_up = "never" if figures.catch_up_seconds is None else f"{figures.catch_up_seconds:.2f}"
            rows.setdefault(f"{label}-line storm: catch-up after it ended (s)", {})[tool.name] = catch_up
            rows.setdefault(f"{label}-line storm: new kinds seen", {})[tool.name] = \
                f"{figures.kinds_seen}/{len(NEW_KINDS)}"
        rate, cpu = mixed(tool, log("mixed"), mixed_log)
        label = f"{mixed_lines:,}-line log, 1 % NVRM"
        rows.setdefault(f"{label}: lines/s", {})[tool.name] = "never" if rate is None else f"{rate:,.0f}"
        rows.setdefault(f"{label}: CPU us/line", {})[tool.name] = f"{cpu:.2f}"
        print(f"# {tool.name}: " + "; ".join(f"{k}: {v[tool.name]}" for k, v in rows.items() if tool.name in v),
              file=sys.stderr, flush=True)
    names = [tool.name for tool in tools]
    widths = [max(14, len(name)) for name in names]
    print(f"{'figure':58} " + " ".join(f"{name:>{width}}" for name, width in zip(names, widths, strict=True)))
    for figure, values in rows.items():
        print(f"{figure:58} " + " ".join(f"{values.get(name, '-'):>{width}}"
                                         for name, width in zip(names, widths, strict=True)))
    shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
