"""The `gpu-health-agent` command line: thin wrappers over the daemon, simulator, rules and journal."""

from __future__ import annotations

import dataclasses
import json
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import click

from agent import __version__
from agent.check import check_node, exporter_reading, kmsg_snapshot, nvml_reading
from agent.config import Config, config_as_yaml, load_config
from agent.daemon import Daemon, rules_dir_of
from agent.engine import RuleSet, builtin_rules_dir, lint_rules, load_rules
from agent.errors import AgentError, InputError, InputErrors
from agent.explain import CATALOG_XIDS, explain_signal, explain_xid
from agent.httpserver import AgentHttpServer
from agent.journal import Journal
from agent.k8s.detect import cluster_configured
from agent.logs import configure_logging
from agent.model import AttrValue, GpuRef, Observation, Signal, VerdictKind
from agent.remediation import GuardPolicy, Mode
from agent.sources.dcgm_exporter import ExporterReader
from agent.sources.kernel_log import KernelLogParser
from agent.sources.nvml import NvmlSource, load_pynvml, probe_calls
from agent.sources.scenario import ScenarioSource, builtin_names, inventory, load_scenario

if TYPE_CHECKING:
    from agent.simulate import SimulationReport, TimelineLine

F = TypeVar("F", bound=Callable[..., Any])
EXIT_BAD_INPUT = 2


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
            _fail([f"gpu-health-agent: {exc}"], code=1)

    wrapper.__name__ = func.__name__
    wrapper.__doc__ = func.__doc__
    return wrapper  # type: ignore[return-value]


def _config(path: str | None) -> Config:
    return load_config(Path(path) if path else None)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="gpu-health-agent")
def main() -> None:
    """Node-level GPU health and self-healing agent for Kubernetes."""


@main.command()
@click.option("--config", "config_path", type=click.Path(), help="Config file (YAML).")
@click.option("--mode", type=click.Choice([m.value for m in Mode]), help="Override the configured mode.")
@click.option("--dry-run", is_flag=True, default=None, help="Record what would be done; change nothing.")
@click.option("--port", type=int, help="Port for /metrics and /healthz.")
@click.option("--scenario", help="Also replay a scenario (built-in name or file) in real time.")
@click.option("--speed", type=float, default=1.0, show_default=True, help="Scenario replay speed-up.")
@click.option("--duration", type=float, help="Stop after this many seconds (default: until SIGTERM).")
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
    rules = load_rules(rules_dir_of(config))
    node = None
    extra = []
    if scenario:
        replay = load_scenario(scenario)
        node = dataclasses.replace(inventory(replay), name=config.node_name)
        extra.append(ScenarioSource(replay, node, speed=speed))
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
    daemon = Daemon(config, rules=rules, inventory=node, extra_sources=extra, cluster=cluster)
    stuck.target = lambda _: daemon.metrics.evictions_stuck.inc()
    budget.target = daemon.metrics.set_budget
    server = AgentHttpServer(config.http.host, config.http.port, metrics=daemon.metrics.exposition,
                             health=daemon.health)
    server.start()
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
    request_release(api_client, name, gpu_uuid)
    click.echo(f"node/{name}: release of {gpu_uuid} requested; the agent applies it within "
               f"{config.remediation.node_sync_seconds:g}s")


@main.command(name="simulate")
@click.argument("scenario", required=False)
@click.option("--list", "list_only", is_flag=True, help="List the built-in scenarios.")
@click.option("--json", "as_json", is_flag=True, help="One JSON document with verdicts and actions.")
@click.option("--mode", type=click.Choice([m.value for m in Mode]), default=Mode.REMEDIATE.value,
              show_default=True)
@click.option("--dry-run", is_flag=True, help="Record what would be done.")
@click.option("--rules", "rules_dir", type=click.Path(), help="Rules directory (default: the shipped rules).")
@click.option("--journal", "journal_path", type=click.Path(), help="Also record into this journal file.")
@click.option("--local", is_flag=True, help="No fake cluster: steps are only planned (local mode).")
@_reporting_bad_input
def simulate_command(scenario: str | None, list_only: bool, as_json: bool, mode: str, dry_run: bool,
                     rules_dir: str | None, journal_path: str | None, local: bool) -> None:
    """Replay a fault scenario (built-in NAME or FILE) through the agent on a virtual clock."""
    if list_only:
        for name in builtin_names():
            click.echo(name)
        return
    if not scenario:
        _fail(["simulate: give a scenario name or file, or --list"])
    from agent.simulate import simulate, simulate_in_cluster  # noqa: PLC0415 - brings the fake cluster

    loaded = load_scenario(scenario)
    rules = load_rules(Path(rules_dir) if rules_dir else builtin_rules_dir())
    configure_logging("error", "auto")
    journal = Journal(journal_path) if journal_path else None
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
    lines = [f"scenario {scenario.name}: {' '.join(scenario.description.split())}",
             f"node {node.name}: {len(node.gpus)} x {', '.join(models)}; mode {report.pipeline.policy.mode}"
             f"{' (dry-run)' if report.pipeline.policy.dry_run else ''}; "
             f"{'fake cluster (real HTTP, real actuators)' if report.cluster else 'local mode (no cluster)'}", ""]
    for line in report.lines:
        lines.extend(_render_line(line))
    lines.append("")
    lines.append("GPU status: " + ", ".join(
        f"{key[:12]}={status}" for key, status in report.pipeline.gpu_statuses().items() if status != "healthy"
    ) if any(s != "healthy" for s in report.pipeline.gpu_statuses().values()) else "GPU status: all healthy")
    for (key, rule_id), fault in sorted(report.pipeline.active.items()):
        lines.append(f"active: {rule_id} on {key} ({fault.severity}, {fault.action}), "
                     f"{report.pipeline.occurrences(key, rule_id)} occurrence(s)")
    return "\n".join(lines)


def _render_line(line: TimelineLine) -> list[str]:
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
    for action in line.outcome.actions:
        why = f" ({action.message})" if action.message and action.result.value not in {"planned", "applied"} else ""
        out.append(f"{'':13}  action    {action.step.kind} {action.step.target}: {action.result}{why}")
    return out


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


@main.command()
@click.option("--config", "config_path", type=click.Path(), help="Config file (YAML).")
@click.option("--json", "as_json", is_flag=True, help='{"gpus": [{"uuid", "status", "verdicts", ...}]}')
@click.option("--dcgm-exporter", "exporter", help="Read only this dcgm-exporter /metrics URL or file.")
@_reporting_bad_input
def check(config_path: str | None, as_json: bool, exporter: str | None) -> None:
    """Read every available source once and print each GPU's status and why (read-only)."""
    config = _config(config_path)
    configure_logging("error", "auto")
    ruleset = load_rules(rules_dir_of(config))
    now = time.time()
    sources: dict[str, str] = {}
    gpus: list[tuple[GpuRef, dict[str, Any]]] = []
    observations: list[Observation] = []
    if exporter:
        reader = ExporterReader(exporter, timeout_seconds=config.sources.dcgm.timeout_seconds, baseline_xid=False)
        gpus, observations = exporter_reading(reader, now)
        sources["dcgm"] = f"dcgm-exporter {exporter}: {len(gpus)} GPUs"
        if not gpus:
            sources["dcgm"] = f"dcgm-exporter {exporter}: unreadable"
    else:
        nvml_source = _nvml_or_reason(config, sources)
        if nvml_source is not None:
            try:
                gpus, observations = nvml_reading(nvml_source)
            finally:
                nvml_source.stop()
        observations += _kmsg_or_reason(config, sources, now)
        if nvml_source is None and not sources["kmsg"].startswith("read"):
            reasons = "; ".join(f"{k}: {v}" for k, v in sources.items())
            _fail([f"gpu-health-agent check: no source to read ({reasons})"], code=1)
    report = check_node(ruleset, gpus=gpus, observations=observations, now=now, sources=sources)
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=2, default=str))
        return
    click.echo(f"{'idx':>3}  {'uuid':40} {'model':24} {'temp':>9} {'power':>13} {'ecc sbe/dbe':>11} "
               f"{'remap':>7}  status    why")
    for gpu in report.gpus:
        r = gpu.readings
        temp = f"{_num_or(r.get('temperature_c'))}/{_num_or(r.get('slowdown_c'))}/{_num_or(r.get('shutdown_c'))}"
        power = f"{_num_or(r.get('power_w'))}/{_num_or(r.get('power_limit_w'))}W"
        ecc = f"{_num_or(r.get('ecc_sbe_volatile'))}/{_num_or(r.get('ecc_dbe_volatile'))}"
        remap = "pending" if r.get("remap_pending") else ("failed" if r.get("remap_failure") else "ok")
        remap = remap if "remap_pending" in r else "-"
        index = gpu.gpu.index if gpu.gpu.index is not None else "-"
        click.echo(f"{index:>3}  {gpu.gpu.uuid or gpu.gpu.pci_bus_id:40} {gpu.gpu.model[:24]:24} {temp:>9} "
                   f"{power:>13} {ecc:>11} {remap:>7}  {gpu.status:9} {gpu.why}")
    for verdict in report.node_verdicts:
        click.echo(f"node: {verdict.severity} {verdict.rule_id}: {verdict.summary}")
    for name, state in report.sources.items():
        click.echo(f"source {name}: {state}", err=True)


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
def kmsg_parse(path: str, as_json: bool, all_kinds: bool) -> None:
    """Parse a kernel log (dmesg, syslog, journalctl or raw /dev/kmsg records) for NVIDIA records."""
    parser = KernelLogParser()
    try:
        handle = sys.stdin if path == "-" else open(path, encoding="utf-8", errors="replace")  # noqa: SIM115
    except OSError as exc:
        _fail([f"{path}: cannot read: {exc.strerror}"])
    with handle:
        records = [r for n, line in enumerate(handle, 1) if (r := parser.feed(line, n)) is not None]
    shown = [r for r in records if all_kinds or r.kind in {"xid", "sxid"}]
    if as_json:
        for record in shown:
            click.echo(json.dumps(record.to_json(), default=str))
        return
    click.echo(f"{'line':>6}  {'kind':8} {'code':>6}  {'pci':14} {'pid':>8}  {'process':16} message")
    for r in shown:
        click.echo(f"{r.line:>6}  {r.kind:8} {r.code if r.code is not None else '-':>6}  {r.pci:14} "
                   f"{r.pid if r.pid is not None else '-':>8}  {(r.process or '-')[:16]:16} {r.message}")


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
    journal = Journal(path)
    try:
        entries = journal.history(limit=limit)
    finally:
        journal.close()
    if as_json:
        click.echo(json.dumps(entries, indent=2, default=str))
        return
    for entry in entries:
        if entry["type"] == "verdict":
            click.echo(f"{entry['at']:.3f} verdict {entry['kind']:7} {entry['severity']:8} {entry['gpu_key']} "
                       f"{entry['rule_id']}: {entry['summary']}")
        else:
            click.echo(f"{entry['at']:.3f} action  {entry['kind']:15} {entry['result']:8} {entry['target']}"
                       f"{': ' + entry['message'] if entry['message'] else ''}")


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
    for item in results if isinstance(results, list) else [results]:
        head = f"Xid {item['xid']} {item['name']}" if "xid" in item else f"{item['signal']} = {_num(item['value'])}"
        nvidia = f"; NVIDIA: {item['nvidia_action']}" if item.get("nvidia_action") is not None else ""
        click.echo(f"{head}: {item['severity']}, {item['action']} [{item['fault_class']}], "
                   f"quarantine={'yes' if item['quarantine'] else 'no'}, rule {item['rule_id']}{nvidia}")
        if item.get("reason"):
            click.echo(f"  why: {item['reason']}")


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
