"""The `gpu-health-agent` command line: thin wrappers over the daemon, simulator, rules and journal."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import shutil
import signal
import sqlite3
import stat
import sys
import textwrap
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import click

from agent import __version__
from agent.check import CheckReport, CheckStatus, check_node, exporter_reading, kmsg_snapshot, nvml_reading
from agent.config import Config, RemediationConfig, config_as_yaml, load_config
from agent.daemon import Daemon, device_reset_of, rules_dir_of
from agent.engine import RuleSet, builtin_rules_dir, lint_rules, load_rules
from agent.errors import AgentError, InputError, InputErrors
from agent.explain import CATALOG_XIDS, explain_signal, explain_xid
from agent.fleetctl.commands import fleet
from agent.gpu.helper import serve as serve_resets
from agent.hot_path import describe as describe_storm_path
from agent.httpserver import AgentHttpServer
from agent.journal import Journal
from agent.k8s.detect import cluster_configured
from agent.logs import configure_logging
from agent.model import AttrValue, GpuRef, Observation, Signal, StepKind, StepResult, VerdictKind, normalise_pci
from agent.remediation import GuardPolicy, Mode
from agent.sources.dcgm_exporter import ExporterReader
from agent.sources.kernel_log import KernelLogParser, KernelRecord
from agent.sources.kmsg import RecordReader
from agent.sources.nvml import NvmlSource, load_pynvml, probe_calls
from agent.sources.scenario import ScaledClock, ScenarioSource, builtin_names, inventory, load_scenario

if TYPE_CHECKING:
    from agent.simulate import SimulationReport, TimelineLine

F = TypeVar("F", bound=Callable[..., Any])
# Exit codes (README "Exit codes"): 0 done, 1 could not do it (runtime failure, no cluster, no journal),
# 2 bad input or usage; `check` follows the monitoring-plugin convention instead (agent.check.CheckStatus).
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2


POSITIVE = click.FloatRange(min=0, min_open=True)
DEFAULT_MODE = Config.model_fields["mode"].default
DEFAULT_REMEDIATION = RemediationConfig()


class LateMetric:
    """Hands cluster-side figures to metrics that exist only once the daemon does."""

    def __init__(self) -> None:
        self.target: Callable[..., object] | None = None

    def __call__(self, *values: int) -> None:
        if self.target is not None:
            self.target(*values)


def _fail(lines: list[str], code: int = EXIT_BAD_INPUT) -> NoReturn:
    for line in lines:
        click.echo(line, err=True)
    sys.exit(code)


def _reporting_bad_input(func: F) -> F:
    """Bad input becomes one line per problem on stderr and exit code 2, never a traceback."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except InputErrors as exc:
            _fail([p.line() for p in exc.problems])
        except InputError as exc:
            _fail([exc.line()])
        except AgentError as exc:
            _fail([f"gpu-health-agent: {exc}"], code=EXIT_FAILED)
        except OSError as exc:
            where = f" ({exc.filename})" if exc.filename else ""
            _fail([f"gpu-health-agent {func.__name__.removesuffix('_command')}: "
                   f"{exc.strerror or exc}{where}"], code=EXIT_FAILED)

    wrapper.__name__ = func.__name__
    wrapper.__doc__ = func.__doc__
    return wrapper  # type: ignore[return-value]


def _config(path: str | None) -> Config:
    return load_config(Path(path) if path else None)


def _open_journal(path: str | Path) -> Journal:
    """The journal a command was given, or one line saying why it cannot be opened (unwritable place, not a
    SQLite file); unlike the agent's own start, a command never moves a damaged file aside."""
    try:
        return Journal(path, recover=False)
    except sqlite3.DatabaseError as exc:
        problem = "not a journal (not a SQLite database)" if "not a database" in str(exc) else f"cannot open: {exc}"
        raise InputError(problem, file=str(path)) from None
    except OSError as exc:
        raise InputError(f"cannot create the journal: {exc.strerror or exc}", file=str(path)) from None


def _check_journal_place(path: str | Path) -> None:
    """run: a journal the agent cannot create is one line before anything starts (a damaged one is the
    daemon's to move aside and recreate, with an Event)."""
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"cannot create the journal: {exc.strerror or exc}", file=str(path)) from None
    place = Path(path) if Path(path).exists() else Path(path).parent
    if not os.access(place, os.W_OK):
        raise InputError("cannot create the journal: Permission denied", file=str(path))


class _OneLineGroup(click.Group):
    """Usage errors are one line on stderr (`gpu-health-agent CMD: problem (see CMD --help)`), never a traceback."""

    def main(self, *args: Any, **kwargs: Any) -> Any:
        kwargs["standalone_mode"] = False
        try:
            result = super().main(*args, **kwargs)
        except click.exceptions.NoArgsIsHelpError as exc:
            click.echo(exc.ctx.get_help() if exc.ctx else str(exc), err=True)
            sys.exit(EXIT_BAD_INPUT)
        except click.ClickException as exc:
            name = exc.ctx.command_path if getattr(exc, "ctx", None) else "gpu-health-agent"  # type: ignore[attr-defined]
            hint = f" (see {name} --help)" if isinstance(exc, click.UsageError) else ""
            click.echo(f"{name}: {' '.join(exc.format_message().split())}{hint}", err=True)
            sys.exit(exc.exit_code)
        except click.exceptions.Abort:
            click.echo("gpu-health-agent: interrupted", err=True)
            sys.exit(130)
        except KeyboardInterrupt:
            click.echo("gpu-health-agent: interrupted", err=True)
            sys.exit(130)
        except Exception as exc:
            # The last line of defence: a bug still gets one line; GPU_HEALTH_DEBUG=1 shows the traceback.
            if os.environ.get("GPU_HEALTH_DEBUG"):
                raise
            click.echo(f"gpu-health-agent: internal error: {type(exc).__name__}: {exc} "
                       "(GPU_HEALTH_DEBUG=1 shows the traceback; please report it)", err=True)
            sys.exit(EXIT_FAILED)
        sys.exit(result if isinstance(result, int) else 0)


class _MonitoringPluginCommand(click.Command):
    """`check`: even a usage error exits UNKNOWN (3), so a monitoring system never reads it as CRITICAL (2)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as exc:
            setattr(exc, "exit_code", int(CheckStatus.UNKNOWN))  # noqa: B010 - an instance attribute on purpose
            raise


def _show_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if not value or ctx.resilient_parsing:
        return
    click.echo(f"gpu-health-agent, version {__version__} ({describe_storm_path()})")
    ctx.exit()


@click.group(cls=_OneLineGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=_show_version,
              help="Show the version, and whether the storm path is compiled, and exit.")
def main() -> None:
    """Node-level GPU health and self-healing agent for Kubernetes."""


main.add_command(fleet)


@main.command()
@click.option("--config", "config_path", type=click.Path(), help="Config file (YAML).")
@click.option("--mode", type=click.Choice([m.value for m in Mode]), help="Override the configured mode.")
@click.option("--dry-run", is_flag=True, default=None, help="Record what would be done; change nothing.")
@click.option("--port", type=click.IntRange(0, 65535), help="Port for /metrics and /healthz (0: any free port).")
@click.option("--scenario", help="Also replay a scenario (built-in name or file) in real time.")
@click.option("--speed", type=POSITIVE, default=1.0, show_default=True, help="Scenario replay speed-up (> 0).")
@click.option("--duration", type=POSITIVE, help="Stop after this many seconds (default: until SIGTERM).")
@_reporting_bad_input
def run(config_path: str | None, mode: str | None, dry_run: bool | None, port: int | None,
        scenario: str | None, speed: float, duration: float | None) -> None:
    """Run the agent: watch the GPUs, classify, act (per mode), serve /metrics and /healthz."""
    config = _config(config_path)
    overrides: dict[str, Any] = {}
    if mode:
        overrides["mode"] = Mode(mode)
    if dry_run:
        overrides["dry_run"] = True
    if port is not None:
        overrides["http"] = config.http.model_copy(update={"port": port})
    config = config.model_copy(update=overrides)
    configure_logging(config.log.level, config.log.format)
    _check_journal_place(config.journal_path)
    rules = load_rules(rules_dir_of(config))
    node = None
    extra = []
    # A sped-up scenario runs the agent on the same sped-up clock, so its windows (debounce, quiet windows
    # before a clear) pass as fast as its observations come.
    clock = ScaledClock(speed) if scenario and speed != 1.0 else time.time
    if scenario:
        replay = load_scenario(scenario)
        node = dataclasses.replace(inventory(replay), name=config.node_name)
        extra.append(ScenarioSource(replay, node, speed=speed, stamp=clock))
    how = "no in-cluster configuration and no kubeconfig"
    cluster = None
    stuck, budget = LateMetric(), LateMetric()
    if cluster_configured(config.remediation.kubeconfig or None):
        # The Kubernetes client is large: it is loaded only where there is a cluster to talk to. A cluster
        # that is configured but unusable (ClientConfigError) ends the start with one line, exit 1.
        from agent.k8s.client import Timeouts, load_api_client  # noqa: PLC0415
        from agent.k8s.cluster import build_cluster_side  # noqa: PLC0415

        api_client, how = load_api_client(kubeconfig=config.remediation.kubeconfig or None,
                                          timeouts=Timeouts(connect=config.remediation.api_connect_timeout_seconds,
                                                            read=config.remediation.api_read_timeout_seconds))
        cluster = build_cluster_side(api_client, config, on_stuck=lambda pod: stuck(1), on_budget=budget)
    daemon = Daemon(config, rules=rules, inventory=node, extra_sources=extra, cluster=cluster, clock=clock)
    stuck.target = lambda _: daemon.metrics.evictions_stuck.inc()
    budget.target = daemon.metrics.set_budget
    server = _serve(config, daemon)
    click.echo(f"gpu-health-agent: node {config.node_name}, mode {config.mode}"
               f"{' (dry-run)' if config.dry_run else ''}, "
               f"{'cluster via ' + how if cluster else 'local mode (' + how + ')'}, "
               f"sources {', '.join(s.name for s in daemon.sources)}, http :{server.port}", err=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    if duration is not None:
        timer = threading.Timer(duration, stop.set)
        timer.daemon = True
        timer.start()
    try:
        daemon.run(stop)
    finally:
        server.close()


@main.command(name="reset-helper")
@click.option("--config", "config_path", type=click.Path(), help="Config file (YAML): remediation.reset_*.")
@_reporting_bad_input
def reset_helper(config_path: str | None) -> None:
    """Serve GPU resets on remediation.reset_helper_socket (the DaemonSet's privileged gpu-reset container)."""
    config = _config(config_path)
    configure_logging(config.log.level, config.log.format)
    socket_path = config.remediation.reset_helper_socket
    if not socket_path:
        raise AgentError("remediation.reset_helper_socket is not set: the reset helper has nowhere to listen")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    click.echo(f"gpu-health-agent reset helper: listening on {socket_path}", err=True)
    try:
        serve_resets(socket_path, device_reset_of(config), stop=stop)
    except OSError as exc:
        raise AgentError(f"cannot listen on {socket_path}: {exc.strerror or exc}") from None


def _serve(config: Config, daemon: Daemon) -> AgentHttpServer:
    """/metrics and /healthz, started; a port already taken is one line, not a traceback."""
    try:
        server = AgentHttpServer(config.http.host, config.http.port, metrics=daemon.metrics.exposition,
                                 health=daemon.health, timeout_seconds=config.http.timeout_seconds,
                                 max_connections=config.http.max_connections,
                                 on_refused=daemon.metrics.http_refused.inc)
    except OSError as exc:
        reason = "in use by another process" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
        raise AgentError(f"cannot serve /metrics on {config.http.host} port {config.http.port}: {reason}") from None
    server.start()
    return server


@main.command()
@click.option("--node", "node_name", help="The node (default: NODE_NAME or this host's name).")
@click.option("--gpu", "gpu_uuid", default="all", show_default=True, help="A GPU UUID, or all.")
@click.option("--kubeconfig", type=click.Path(), help="Kubeconfig (default: in-cluster, then KUBECONFIG).")
@_reporting_bad_input
def release(node_name: str | None, gpu_uuid: str, kubeconfig: str | None) -> None:
    """Release faults only an operator may clear (needs-replacement, ...): the node's agent clears them."""
    from agent.k8s.client import load_api_client  # noqa: PLC0415 - the client is loaded only when needed
    from agent.k8s.cluster import request_release  # noqa: PLC0415

    config = load_config(None)
    name = node_name or config.node_name
    if not cluster_configured(kubeconfig or config.remediation.kubeconfig or None):
        _fail(["release: no cluster (no in-cluster configuration and no kubeconfig)"], code=1)
    api_client, _ = load_api_client(kubeconfig=kubeconfig or config.remediation.kubeconfig or None)
    with api_client:
        request_release(api_client, name, gpu_uuid)
    click.echo(f"node/{name}: release of {gpu_uuid} requested; the agent applies it within "
               f"{config.remediation.node_sync_seconds:g}s")


@main.command()
@click.option("--all-nodes", is_flag=True, help="Every node of the cluster, plus DeviceTaintRules and Leases.")
@click.option("--node", "nodes", multiple=True, help="Only this node (repeatable).")
@click.option("--dry-run", is_flag=True, help="List what would be removed; change nothing.")
@click.option("--force", is_flag=True, help="Clean even while agent pods still run (they will set marks again).")
@click.option("--config", "config_path", type=click.Path(), help="The agent's config (its taint key, namespace).")
@click.option("--kubeconfig", type=click.Path(), help="Kubeconfig with operator credentials (default: KUBECONFIG).")
@_reporting_bad_input
def cleanup(all_nodes: bool, nodes: tuple[str, ...], dry_run: bool, force: bool, config_path: str | None,
            kubeconfig: str | None) -> None:
    """Remove every mark the agent left (taint, its cordon, conditions, labels, annotations, DeviceTaintRules,
    its Lease) and nothing it did not set. Run after uninstalling; --dry-run lists them first."""
    from agent.k8s.cleanup import Cleaner, Scope  # noqa: PLC0415 - the client is loaded only when needed
    from agent.k8s.client import load_api_client  # noqa: PLC0415

    if all_nodes == bool(nodes):
        _fail(["cleanup: give --all-nodes or --node NAME (not both)"])
    config = _config(config_path)
    api_client, how = load_api_client(kubeconfig=kubeconfig)
    if api_client is None:
        _fail([f"cleanup: no cluster ({how})"], code=EXIT_FAILED)
    with api_client:
        cleaner = Cleaner.connect(api_client, Scope(taint_key=config.remediation.taint_key,
                                                    namespace=config.remediation.namespace, nodes=nodes))

        def say(line: str) -> None:
            click.echo(f"cleanup: {line}", err=True)

        say(f"cluster via {how}")
        running = cleaner.agent_pods()
        if running and not dry_run and not force:
            _fail([f"cleanup: {len(running)} agent pod(s) still run in namespace {config.remediation.namespace} and "
                   "would set their marks again: uninstall first (or --force)"], code=EXIT_FAILED)
        marks = cleaner.find(progress=say)
        for mark in marks:
            if dry_run:
                click.echo(f"would remove {mark.line()}")
            else:
                click.echo(f"{'removed' if cleaner.remove(mark) else 'already gone'}: {mark.line()}")
        if all_nodes and cleaner.pause_lease_present():
            say(f"left lease/{config.remediation.namespace}/gpu-health-pause: an operator's pause switch "
                "(kubectl delete lease it yourself)")
        done = "would remove" if dry_run else "removed"
        say(f"{done} {len(marks)} mark(s)" + ("; run again without --dry-run to remove them" if dry_run and marks
                                              else "" if marks else " (nothing the agent set was found)"))


_ALERT_FOR = {"fatal": "GpuHealthFatalFault", "degraded": "GpuHealthDegradedForLong",
              "unknown": "GpuHealthSourceUnknown"}


@main.command()
@click.option("--node", "named_node", help="This node's name; required for --full (default: NODE_NAME).")
@click.option("--pci", help="The GPU's PCI address as the driver logs it (default: NVML's GPU 0).")
@click.option("--xid", type=click.IntRange(min=1), default=79, show_default=True, help="The Xid to drill.")
@click.option("--full", is_flag=True, help="Act for real per the agent's mode (taint, evict...): needs --node.")
@click.option("--wait", "wait_seconds", type=POSITIVE, default=30.0, show_default=True,
              help="Seconds to wait for the agent to admit the drill record.")
@click.option("--config", "config_path", type=click.Path(), help="The agent's config (state dir, kmsg path).")
@_reporting_bad_input
def drill(named_node: str | None, pci: str | None, xid: int, full: bool, wait_seconds: float,
          config_path: str | None) -> None:
    """Prove the whole path on this node without hurting it: a marked Xid record through the real kernel log
    -> verdict -> Event, condition, metric -> alert -> runbook. Run as root on the node (or in the agent pod)."""
    from agent.drill import DrillBox, DrillError, drills_dir, new_request, write_kmsg  # noqa: PLC0415

    config = _config(config_path)
    node = config.node_name
    if named_node is not None and named_node != node:
        _fail([f"drill: this is node {node}, not {named_node}: run the drill on the node it is for"])
    if full and named_node is None:
        _fail(["drill: a full drill acts for real (taint, evictions, per the agent's mode): name this node with "
               "--node"])
    pci = pci or _first_gpu_pci(config)
    ruleset = load_rules(rules_dir_of(config))
    expected = explain_xid(ruleset, xid)
    box = DrillBox(drills_dir(config.journal_path))
    request = new_request(node=node, pci=pci, xid=xid, full=full, now=time.time(),
                          requested_by=os.environ.get("SUDO_USER") or os.environ.get("USER") or f"uid {os.getuid()}")
    try:
        box.file(request)
    except DrillError as exc:
        _fail([f"drill: {exc}"], code=EXIT_FAILED)
    kind = "FULL drill (acts per the agent's mode)" if full else "drill (no taint, eviction, reset or reboot)"
    click.echo(f"drill 1/3: {kind} {request.drill_id} filed for node {node}, GPU {pci}, Xid {xid}", err=True)
    try:
        write_kmsg(request.kmsg_line(pid=os.getpid()), Path(config.sources.kmsg.path))
    except OSError as exc:
        box.withdraw(request.drill_id)
        _fail([f"drill: cannot write to {config.sources.kmsg.path}: {exc.strerror} (run as root)"], code=EXIT_FAILED)
    click.echo(f"drill 2/3: record written to {config.sources.kmsg.path}", err=True)
    click.echo(f"drill 3/3: waiting up to {wait_seconds:g}s for the agent on {node} to admit it", err=True)
    deadline = time.monotonic() + wait_seconds
    while box.pending(request.drill_id) and time.monotonic() < deadline:
        time.sleep(0.1)
    if box.withdraw(request.drill_id):
        _fail([f"drill: the agent did not admit drill {request.drill_id} within {wait_seconds:g}s (is it running "
               f"on this node, with the same state directory {box.directory}?); request withdrawn"],
              code=EXIT_FAILED)
    severity = str(expected["severity"])
    alert = _ALERT_FOR.get(severity)
    click.echo(f"admitted: drill {request.drill_id} reached the agent through the kernel log")
    click.echo(f"expect:   verdict {severity} {expected['rule_id']} marked drill={request.drill_id}; an Event and "
               f"condition on node/{node}; metrics with drill=\"true\"")
    if alert:
        click.echo(f"then:     alert {alert} (runbook docs/runbooks/{alert}.md)")
    click.echo(f"see:      kubectl get events --field-selector involvedObject.name={node} | grep drill")


def _first_gpu_pci(config: Config) -> str:
    sources: dict[str, str] = {}
    nvml_source = _nvml_or_reason(config, sources)
    if nvml_source is None:
        _fail([f"drill: no --pci given and NVML cannot name a GPU ({sources['nvml']})"])
    try:
        if not nvml_source.gpus:
            _fail(["drill: no --pci given and NVML found no GPU"])
        return normalise_pci(nvml_source.gpus[0].ref.pci_bus_id)
    finally:
        nvml_source.stop()


@main.command(name="simulate")
@click.argument("scenario", required=False)
@click.option("--list", "list_only", is_flag=True, help="List the built-in scenarios.")
@click.option("--json", "as_json", is_flag=True, help="One JSON document with verdicts and actions.")
@click.option("--mode", type=click.Choice([m.value for m in Mode]), default=str(DEFAULT_MODE), show_default=True,
              help="The agent's mode (default: the agent's own default).")
@click.option("--dry-run", is_flag=True, help="Record what would be done.")
@click.option("--rules", "rules_dir", type=click.Path(), help="Rules directory (default: the shipped rules).")
@click.option("--journal", "journal_path", type=click.Path(), help="Also record into this journal file.")
@click.option("--local", is_flag=True, help="No fake cluster: steps are only planned (local mode).")
@_reporting_bad_input
def simulate_command(scenario: str | None, list_only: bool, as_json: bool, mode: str, dry_run: bool,
                     rules_dir: str | None, journal_path: str | None, local: bool) -> None:
    """Replay a fault scenario (built-in NAME or FILE) through the agent on a virtual clock."""
    if list_only:
        described = [(name, " ".join(load_scenario(name).description.split())) for name in builtin_names()]
        if as_json:
            click.echo(json.dumps([{"name": n, "description": d} for n, d in described], indent=2))
            return
        width = max(len(n) for n, _ in described)
        for name, description in described:
            click.echo(f"{name:{width}}  {description}")
        return
    if not scenario:
        _fail(["simulate: give a scenario name or file, or --list"])
    from agent.simulate import simulate, simulate_in_cluster  # noqa: PLC0415 - brings the fake cluster

    loaded = load_scenario(scenario)
    rules = load_rules(Path(rules_dir) if rules_dir else builtin_rules_dir())
    configure_logging("error", "auto")
    journal = _open_journal(journal_path) if journal_path else None
    try:
        policy = GuardPolicy(mode=Mode(mode), dry_run=dry_run)
        runner = simulate if local else simulate_in_cluster
        report = runner(loaded, rules=rules, policy=policy, journal=journal)
    finally:
        if journal:
            journal.close()
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=2, default=str))
    else:
        click.echo(render_report(report))


def render_report(report: SimulationReport) -> str:
    scenario = report.scenario
    node = report.pipeline.inventory
    models = sorted({g.model for g in node.gpus})
    mode = report.pipeline.policy.mode
    lines = [f"scenario {scenario.name}: {' '.join(scenario.description.split())}",
             f"node {node.name}: {len(node.gpus)} x {', '.join(models)}; mode {mode}"
             f"{' (dry-run)' if report.pipeline.policy.dry_run else ''}; "
             f"{'fake cluster (real HTTP, real actuators)' if report.cluster else 'local mode (no cluster)'}"]
    if mode is not Mode.REMEDIATE:
        lines.append(f"in mode {mode} evictions, GPU resets and reboot requests are skipped "
                     "(--mode remediate shows them)")
    lines.append("")
    skipped: set[tuple[str, str, str]] = set()
    hidden = 0
    for line in report.lines:
        rendered, repeats = _render_line(line, skipped)
        lines.extend(rendered)
        hidden += repeats
    lines.append("")
    if hidden:
        lines.append(f"({hidden} repeat(s) of a step already reported as skipped are not shown)")
    lines.append("GPU status: " + ", ".join(
        f"{key[:12]}={status}" for key, status in report.pipeline.gpu_statuses().items() if status != "healthy"
    ) if any(s != "healthy" for s in report.pipeline.gpu_statuses().values()) else "GPU status: all healthy")
    for (key, rule_id), fault in sorted(report.pipeline.active.items()):
        lines.append(f"active: {rule_id} on {key} ({fault.severity}, {fault.action}), "
                     f"{report.pipeline.occurrences(key, rule_id)} occurrence(s)")
    return "\n".join(lines)


_STEP_NOTE = {
    StepKind.TAINT: f"{DEFAULT_REMEDIATION.taint_key}:{DEFAULT_REMEDIATION.taint_effect}",
    StepKind.UNTAINT: DEFAULT_REMEDIATION.taint_key,
    StepKind.REBOOT_REQUEST: "a request for a reboot tool such as kured; the agent never reboots",
}


def _render_line(line: TimelineLine, skipped: set[tuple[str, str, str]]) -> tuple[list[str], int]:
    """The lines for one timeline entry, and how many repeated skipped steps were left out."""
    out = []
    stamp = f"t={line.at:9.3f}s"
    if line.observation is not None:
        obs = line.observation
        gpu = obs.gpu.describe() if obs.gpu else "node"
        repeats = f" x{line.repeats}" if line.repeats > 1 else ""
        out.append(f"{stamp}  observed  {obs.signal} {_num(obs.value)}{repeats} on {gpu} from {obs.source}")
    else:
        out.append(f"{stamp}  tick")
    for verdict in line.outcome.verdicts:
        when = f" (at t={verdict.at:g}s)" if verdict.at != line.at else ""
        if verdict.kind is VerdictKind.CLEARED:
            out.append(f"{'':13}  verdict   CLEARED {verdict.rule_id}: {verdict.summary}{when}")
        else:
            out.append(f"{'':13}  verdict   {verdict.severity.upper()} {verdict.rule_id}: {verdict.summary} "
                       f"-> {verdict.action} [{verdict.fault_class}]{when}")
    hidden = 0
    for action in line.outcome.actions:
        if action.result is StepResult.SKIPPED:
            key = (str(action.step.kind), action.step.target, action.step.rule_id)
            if key in skipped:
                hidden += 1
                continue
            skipped.add(key)
        said = action.result.value not in {"planned", "applied"} or action.step.kind is StepKind.RESET_GPU
        why = f" ({action.message})" if action.message and said else ""  # a reset says how it went
        note = f" ({_STEP_NOTE[action.step.kind]})" if action.step.kind in _STEP_NOTE else ""
        out.append(f"{'':13}  action    {action.step.kind} {action.step.target}{note}: {action.result}{why}")
    return out, hidden


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def _monitoring_plugin(func: F) -> F:
    """Exit with the CheckStatus the command returns; any failure to check at all is UNKNOWN (3)."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            status = func(*args, **kwargs)
        except SystemExit as exc:
            sys.exit(exc.code if exc.code in (None, 0) else CheckStatus.UNKNOWN)
        sys.exit(int(status))

    wrapper.__name__ = func.__name__
    wrapper.__doc__ = func.__doc__
    return wrapper  # type: ignore[return-value]


@main.command(cls=_MonitoringPluginCommand)
@click.option("--config", "config_path", type=click.Path(), help="Config file (YAML).")
@click.option("--json", "as_json", is_flag=True, help='{"status", "summary", "gpus": [{"uuid", "status", ...}]}')
@click.option("--dcgm-exporter", "exporter", help="Read only this dcgm-exporter /metrics URL or file.")
@_monitoring_plugin
@_reporting_bad_input
def check(config_path: str | None, as_json: bool, exporter: str | None) -> CheckStatus:
    """Read every available source once and print each GPU's status and why (read-only).

    Exit status as a monitoring plugin: 0 OK, 1 WARNING (a GPU degraded), 2 CRITICAL (a GPU fatal),
    3 UNKNOWN (a GPU or source unreadable, no GPU found, or the check itself could not run).
    """
    config = _config(config_path)
    configure_logging("error", "auto")
    ruleset = load_rules(rules_dir_of(config))
    now = time.time()
    sources: dict[str, str] = {}
    unreadable: list[str] = []
    gpus: list[tuple[GpuRef, dict[str, Any]]] = []
    observations: list[Observation] = []
    if exporter:
        reader = ExporterReader(exporter, timeout_seconds=config.sources.dcgm.timeout_seconds, baseline_xid=False)
        gpus, observations = exporter_reading(reader, now)
        sources["dcgm"] = f"dcgm-exporter {exporter}: {len(gpus)} GPUs"
        if not gpus:
            sources["dcgm"] = f"dcgm-exporter {exporter}: unreadable"
            unreadable.append("dcgm")
    else:
        nvml_source = _nvml_or_reason(config, sources)
        if nvml_source is not None:
            try:
                gpus, observations = nvml_reading(nvml_source)
            finally:
                nvml_source.stop()
        elif config.sources.nvml.enabled == "on":
            unreadable.append("nvml")
        observations += _kmsg_or_reason(config, sources, now)
        if sources["kmsg"].startswith("cannot read") and config.sources.kmsg.enabled == "on":
            unreadable.append("kmsg")
        if nvml_source is None and not sources["kmsg"].startswith("read"):
            reasons = "; ".join(f"{k}: {v}" for k, v in sources.items())
            _fail([f"gpu-health-agent check: UNKNOWN - no source to read ({reasons})"], code=CheckStatus.UNKNOWN)
    report = check_node(ruleset, gpus=gpus, observations=observations, now=now, sources=sources,
                        unreadable=unreadable)
    status, summary = report.status()
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=2, default=str))
        return status
    click.echo(f"gpu-health-agent check: {summary}")
    click.echo(render_check_table(report))
    for name, state in report.sources.items():
        click.echo(f"source {name}: {state}", err=True)
    return status


def render_check_table(report: CheckReport, *, width: int | None = None) -> str:
    """One row per GPU under labelled columns; the reason is cut to fit the terminal (--json has it whole)."""
    header = (f"{'GPU':>3}  {'UUID':40}  {'TEMP/SLOW/SHUT C':>16}  {'POWER/LIMIT W':>13}  "
              f"{'ECC SBE/DBE':>11}  {'REMAP':7}  {'STATUS':8}  REASON")
    columns = width or shutil.get_terminal_size((160, 24)).columns
    room = max(20, columns - len(header) + len("REASON"))
    models = Counter(g.gpu.model or "unknown model" for g in report.gpus)
    lines = [f"{', '.join(f'{n} x {m}' for m, n in models.items())}" if models else "", header]
    cut = False
    for gpu in report.gpus:
        r = gpu.readings
        temp = f"{_num_or(r.get('temperature_c'))}/{_num_or(r.get('slowdown_c'))}/{_num_or(r.get('shutdown_c'))}"
        power = f"{_num_or(r.get('power_w'))}/{_num_or(r.get('power_limit_w'))}"
        ecc = f"{_num_or(r.get('ecc_sbe_volatile'))}/{_num_or(r.get('ecc_dbe_volatile'))}"
        remap = "pending" if r.get("remap_pending") else ("failed" if r.get("remap_failure") else "ok")
        remap = remap if "remap_pending" in r else "-"
        index = gpu.gpu.index if gpu.gpu.index is not None else "-"
        reason = gpu.short_why
        if len(reason) > room:
            reason, cut = reason[:room - 3] + "...", True
        lines.append(f"{index:>3}  {gpu.gpu.uuid or gpu.gpu.pci_bus_id:40}  {temp:>16}  "
                     f"{power:>13}  {ecc:>11}  {remap:7}  {gpu.status:8}  {reason}")
    if not report.gpus:
        lines.append("(no GPU found)")
    if cut:
        lines.append("")
        for gpu in report.gpus:
            if gpu.short_why != "-":
                lines.extend(textwrap.wrap(f"GPU {gpu.gpu.index}: {gpu.short_why}", width=max(40, columns),
                                           subsequent_indent="    "))
    for verdict in report.node_verdicts:
        lines.append(f"node: {verdict.severity} {verdict.rule_id}: {verdict.summary}")
    return "\n".join(lines)


def _num_or(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.0f}"
    return str(value)


def _kmsg_or_reason(config: Config, sources: dict[str, str], now: float) -> list[Observation]:
    path = Path(config.sources.kmsg.path)
    if config.sources.kmsg.enabled == "off":
        sources["kmsg"] = "disabled in config"
        return []
    try:
        observations = kmsg_snapshot(path, now=now)
    except OSError as exc:
        sources["kmsg"] = f"cannot read {path}: {exc.strerror}"
        return []
    sources["kmsg"] = f"read {path}"
    return observations


def _nvml_or_reason(config: Config, sources: dict[str, str]) -> NvmlSource | None:
    if config.sources.nvml.enabled == "off":
        sources["nvml"] = "disabled in config"
        return None
    try:
        source = NvmlSource(load_pynvml(), call_timeout_seconds=config.sources.nvml.call_timeout_seconds)
        source.start()
    except Exception as exc:  # noqa: BLE001 - isolation: one failure must not stop the rest
        sources["nvml"] = f"unavailable: {exc}"
        return None
    sources["nvml"] = f"{len(source.gpus)} GPUs, driver {source.driver_version}"
    return source


@main.group()
def nvml() -> None:
    """Work with NVML directly (read-only)."""


@nvml.command(name="probe")
@_reporting_bad_input
def nvml_probe() -> None:
    """One line per GPU and NVML call the agent makes: supported, NotSupported or error."""
    sources: dict[str, str] = {}
    source = _nvml_or_reason(load_config(None), sources)
    if source is None:
        _fail([f"nvml: {sources['nvml']}"], code=1)
    try:
        click.echo(f"# {sources['nvml']}")
        for index, call, status in probe_calls(source):
            click.echo(f"gpu {index}  {call:48} {status}")
    finally:
        source.stop()


@main.group()
def kmsg() -> None:
    """Work with kernel logs."""


@kmsg.command(name="parse")
@click.argument("path", type=click.Path(dir_okay=False, allow_dash=True))
@click.option("--json", "as_json", is_flag=True, help="One JSON object per recognised Xid or SXid line.")
@click.option("--all", "all_kinds", is_flag=True, help="Also GPU-loss and GPU banner records.")
@_reporting_bad_input
def kmsg_parse(path: str, as_json: bool, all_kinds: bool) -> None:
    """Parse a kernel log (dmesg, syslog, journalctl or raw /dev/kmsg records) for NVIDIA records.

    On /dev/kmsg it reads the records now in the kernel's ring buffer and stops (`run` follows it).
    A summary (lines read, records found, Xid lines not recognised) goes to stderr.
    """
    tally = ParseTally()
    parser = KernelLogParser()
    with contextlib.ExitStack() as files:
        if path != "-" and Path(path).exists() and stat.S_ISCHR(Path(path).stat().st_mode):
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
            try:
                lines: Iterable[str] = list(RecordReader(fd, tally.lost).available())
            finally:
                os.close(fd)
            tally.device = True
        else:
            try:
                handle = sys.stdin.buffer if path == "-" else files.enter_context(open(path, "rb"))
            except OSError as exc:
                _fail([f"{path}: cannot read: {exc.strerror}"])
            if looks_binary(handle.peek(8192)[:8192] if hasattr(handle, "peek") else b""):
                _fail([f"{path}: binary data, not a kernel log (give a text log: dmesg, syslog, journalctl)"])
            lines = (raw.decode("utf-8", errors="replace") for raw in handle)
        records = [r for r in tally.count(parser, lines) if r is not None]
    shown = [r for r in records if all_kinds or r.kind in {"xid", "sxid"}]
    if as_json:
        for record in shown:
            click.echo(json.dumps(record.to_json(), default=str))
    else:
        click.echo(f"{'line':>6}  {'kind':8} {'code':>6}  {'pci':14} {'pid':>8}  {'process':16} message")
        for r in shown:
            click.echo(f"{r.line:>6}  {r.kind:8} {r.code if r.code is not None else '-':>6}  {r.pci:14} "
                       f"{r.pid if r.pid is not None else '-':>8}  {(r.process or '-')[:16]:16} {r.message}")
    click.echo(tally.summary(path, records=len(records), shown=len(shown)), err=True)


def looks_binary(head: bytes) -> bool:
    """NUL bytes, or mostly bytes that are not UTF-8 text: not a log."""
    if b"\0" in head:
        return True
    text = head.decode("utf-8", errors="replace")
    return bool(head) and text.count("\ufffd") > len(text) // 10


@dataclasses.dataclass(slots=True)
class ParseTally:
    """What `kmsg parse` read: lines, Xid-looking lines the parser did not recognise, records lost (EPIPE)."""

    lines: int = 0
    unrecognised: int = 0
    records_lost: int = 0
    device: bool = False

    def lost(self) -> None:
        self.records_lost += 1

    def count(self, parser: KernelLogParser, lines: Iterable[str]) -> Iterator[KernelRecord | None]:
        for number, line in enumerate(lines, 1):
            self.lines = number
            record = parser.feed(line, number)
            if record is None and ("Xid" in line and ("NVRM" in line or "SXid" in line)):
                self.unrecognised += 1
            yield record

    def summary(self, path: str, *, records: int, shown: int) -> str:
        what = f"{self.lines} record(s) in the kernel ring buffer" if self.device else f"{self.lines} line(s)"
        extra = f", {self.records_lost} overwritten before they were read" if self.records_lost else ""
        hidden = f" ({records - shown} more with --all)" if records > shown else ""
        follow = "; stopped at the end of the buffer (not following)" if self.device else ""
        return (f"{path}: read {what}{extra}: {shown} NVIDIA record(s) shown{hidden}, "
                f"{self.unrecognised} Xid line(s) not recognised{follow}")


@main.group()
def rules() -> None:
    """Work with rule files."""


@rules.command(name="lint")
@click.argument("directory", required=False, type=click.Path())
def rules_lint(directory: str | None) -> None:
    """Validate a rules directory: exit 0 when valid, else 2 with one line per problem."""
    target = Path(directory) if directory else builtin_rules_dir()
    problems = lint_rules(target)
    if problems:
        _fail([p.line() for p in problems])
    ruleset = load_rules(target)
    click.echo(f"{target}: {len(ruleset.rules)} rules in {len(ruleset.files)} files, all valid")


@main.group(name="config")
def config_group() -> None:
    """Inspect the configuration."""


@config_group.command(name="show")
@click.option("--config", "config_path", type=click.Path(), help="Config file (YAML).")
@_reporting_bad_input
def config_show(config_path: str | None) -> None:
    """Print the effective configuration (file, then GPU_HEALTH_* environment overrides)."""
    click.echo(config_as_yaml(_config(config_path)), nl=False)


@main.command()
@click.option("--config", "config_path", type=click.Path(), help="Config file (YAML).")
@click.option("--journal", "journal_path", type=click.Path(), help="Journal file (default: from config).")
@click.option("--limit", type=int, default=50, show_default=True)
@click.option("--json", "as_json", is_flag=True)
@_reporting_bad_input
def history(config_path: str | None, journal_path: str | None, limit: int, as_json: bool) -> None:
    """Show the newest verdicts and actions from the local journal."""
    path = journal_path or _config(config_path).journal_path
    if not Path(path).exists():
        _fail([f"{path}: no journal yet (the agent has not run here)"], code=1)
    journal = _open_journal(path)
    try:
        entries = journal.history(limit=limit)
    finally:
        journal.close()
    if as_json:
        click.echo(json.dumps(entries, indent=2, default=str))
        return
    if not entries:
        click.echo(f"{path}: the journal is empty (no verdict or action recorded yet)", err=True)
        return
    for entry in entries:
        when = _local_time(entry["at"])
        if entry["type"] == "verdict":
            click.echo(f"{when}  verdict {entry['kind']:7} {entry['severity']:8} {entry['gpu_key']} "
                       f"{entry['rule_id']}: {entry['summary']}")
        else:
            click.echo(f"{when}  action  {entry['kind']:15} {entry['result']:8} {entry['target']}"
                       f"{': ' + entry['message'] if entry['message'] else ''}")


def _local_time(epoch: float) -> str:
    """A journal time in this host's time zone, with the zone named (operators compare it with dmesg -T)."""
    return datetime.fromtimestamp(epoch).astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")


@main.command()
@click.option("--xid", help="An Xid number, or 'all' for every Xid of NVIDIA's catalog.")
@click.option("--signal", "signal_name", type=click.Choice([s.value for s in Signal]), help="A non-Xid signal.")
@click.option("--value", type=float, help="The signal's value.")
@click.option("--attr", "attrs", multiple=True, help="KEY=VALUE attribute (e.g. slowdown_c=90), repeatable.")
@click.option("--model", default="", help="GPU model name, for per-model overrides.")
@click.option("--rules", "rules_dir", type=click.Path(), help="Rules directory (default: the shipped rules).")
@click.option("--json", "as_json", is_flag=True)
@_reporting_bad_input
def explain(xid: str | None, signal_name: str | None, value: float | None, attrs: tuple[str, ...], model: str,
            rules_dir: str | None, as_json: bool) -> None:
    """Explain the verdict for an Xid or a signal value, and why."""
    ruleset: RuleSet = load_rules(Path(rules_dir) if rules_dir else builtin_rules_dir())
    parsed = _parse_attrs(attrs)
    if xid is not None:
        if xid == "all":
            results: Any = [explain_xid(ruleset, n, model=model) for n in CATALOG_XIDS]
        else:
            try:
                number = int(xid, 0)
            except ValueError:
                _fail([f"--xid: {xid!r} is not a number or 'all'"])
            if number < 1:
                _fail([f"--xid: {number} is not an Xid (Xids are numbered from 1)"])
            results = explain_xid(ruleset, number, attrs=parsed, model=model)
    elif signal_name is not None:
        if value is None:
            _fail(["--signal needs --value"])
        results = explain_signal(ruleset, Signal(signal_name), value, attrs=parsed, model=model)
    else:
        _fail(["explain: give --xid N|all or --signal NAME --value V"])
    if as_json:
        click.echo(json.dumps(results, indent=2, default=str))
        return
    items = results if isinstance(results, list) else [results]
    for item in items:
        click.echo(render_explanation(item, brief=len(items) > 1))


def render_explanation(item: dict[str, Any], *, brief: bool = False) -> str:
    """What a fault is, what NVIDIA says to do, what the agent does, and how it clears (one line with --xid all)."""
    head = f"Xid {item['xid']} {item['name']}" if "xid" in item else f"{item['signal']} = {_num(item['value'])}"
    ours = (f"{item['severity']}, {item['action']} [{item['fault_class']}], "
            f"quarantine {'yes' if item['quarantine'] else 'no'}, rule {item['rule_id'] or '-'}")
    if brief:
        bucket = f"; NVIDIA: {item['nvidia_action']}" if item.get("nvidia_action") is not None else ""
        return f"{head}: {ours}{bucket}"
    nvidia: str | None = item.get("nvidia_action")
    if "xid" in item:
        nvidia = (item.get("nvidia_action") or "-") + (f" (then: {item['nvidia_investigatory_action']})"
                                                      if item.get("nvidia_investigatory_action") else "")
    rows = [("what it is", item.get("description")), ("NVIDIA's action", nvidia), ("our action", ours),
            ("why", item.get("reason")), ("how it clears", item.get("clears")),
            ("attributes read", item.get("needs")), ("note", item.get("note"))]
    return "\n".join([head, *(f"  {label + ':':17} {text}" for label, text in rows if text)])


def _parse_attrs(attrs: tuple[str, ...]) -> dict[str, AttrValue]:
    parsed: dict[str, AttrValue] = {}
    for item in attrs:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            _fail([f"--attr: {item!r} is not KEY=VALUE"])
        parsed[key] = _scalar(raw)
    return parsed


def _scalar(raw: str) -> AttrValue:
    if raw.lower() in {"true", "false"}:
        return raw.lower() == "true"
    try:
        return int(raw, 0)
    except ValueError:
        pass
    try:
        return float(raw)
    except ValueError:
        return raw
