"""`run` and `reset-helper`: the agent's own long-running processes."""

from __future__ import annotations

import dataclasses
import errno
import os
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import click
import msgspec

from agent.cli.common import POSITIVE, config_of, reporting_bad_input
from agent.config import Config
from agent.daemon import Daemon, device_reset_of, rules_dir_of
from agent.engine import load_rules
from agent.errors import AgentError, InputError
from agent.httpserver import AgentHttpServer
from agent.k8s.detect import cluster_configured
from agent.logs import configure_logging
from agent.remediation import Mode
from agent.shutdown import stop_event


class LateMetric:
    """Hands cluster-side figures to metrics that exist only once the daemon does."""

    def __init__(self) -> None:
        self.target: Callable[..., object] | None = None

    def __call__(self, *values: int) -> None:
        if self.target is not None:
            self.target(*values)


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


@click.command()
@click.option("--config", "config_path", type=click.Path(), help="Config file (YAML).")
@click.option("--mode", type=click.Choice([m.value for m in Mode]), help="Override the configured mode.")
@click.option("--dry-run", is_flag=True, default=None, help="Record what would be done; change nothing.")
@click.option("--port", type=click.IntRange(0, 65535), help="Port for /metrics and /healthz (0: any free port).")
@click.option("--scenario", help="Also replay a scenario (built-in name or file) in real time.")
@click.option("--speed", type=POSITIVE, default=1.0, show_default=True, help="Scenario replay speed-up (> 0).")
@click.option("--duration", type=POSITIVE, help="Stop after this many seconds (default: until SIGTERM).")
@reporting_bad_input
def run(config_path: str | None, mode: str | None, dry_run: bool | None, port: int | None,
        scenario: str | None, speed: float, duration: float | None) -> None:
    """Run the agent: watch the GPUs, classify, act (per mode), serve /metrics and /healthz."""
    # The mode is validated with the rest (a diagnostic configured in a mode that never runs it is refused).
    config = config_of(config_path, mode=Mode(mode) if mode else None)
    overrides: dict[str, Any] = {}
    if dry_run:
        overrides["dry_run"] = True
    if port is not None:
        overrides["http"] = msgspec.structs.replace(config.http, port=port)
    config = msgspec.structs.replace(config, **overrides)
    configure_logging(config.log.level, config.log.format)
    _check_journal_place(config.journal_path)
    rules = load_rules(rules_dir_of(config))
    node = None
    extra = []
    # A sped-up scenario runs the agent on the same sped-up clock, so its windows (debounce, quiet windows
    # before a clear) pass as fast as its observations come.
    clock: Callable[[], float] = time.time
    if scenario:
        # The scenario player is loaded only for a replay.
        from agent.sources.scenario import ScaledClock, ScenarioSource, inventory, load_scenario  # noqa: PLC0415

        clock = ScaledClock(speed) if speed != 1.0 else time.time
        replay = load_scenario(scenario)
        node = dataclasses.replace(inventory(replay), name=config.node_name)
        extra.append(ScenarioSource(replay, node, speed=speed, stamp=clock))
    how = "no in-cluster configuration and no kubeconfig"
    cluster_of = None
    stuck, budget = LateMetric(), LateMetric()
    if cluster_configured(config.remediation.kubeconfig or None):
        # The Kubernetes client is large: it is loaded only where there is a cluster to talk to. A cluster
        # that is configured but unusable (ClientConfigError) ends the start with one line, exit 1.
        from agent.cluster_side import build_cluster_side  # noqa: PLC0415
        from agent.k8s.client import Timeouts, load_api_client  # noqa: PLC0415

        api_client, how = load_api_client(kubeconfig=config.remediation.kubeconfig or None,
                                          timeouts=Timeouts(connect=config.remediation.api_connect_timeout_seconds,
                                                            read=config.remediation.api_read_timeout_seconds))
        cluster_of = partial(build_cluster_side, api_client, config, on_stuck=lambda pod: stuck(1), on_budget=budget)
    daemon = Daemon(config, rules=rules, inventory=node, extra_sources=extra, cluster_of=cluster_of, clock=clock)
    stuck.target = lambda _: daemon.metrics.evictions_stuck.inc()
    budget.target = daemon.metrics.set_budget
    server = _serve(config, daemon)
    click.echo(f"gpu-health-agent: node {config.node_name}, mode {config.mode}"
               f"{' (dry-run)' if config.dry_run else ''}, "
               f"{'cluster via ' + how if daemon.cluster else 'local mode (' + how + ')'}, "
               f"sources {', '.join(s.name for s in daemon.sources)}, http :{server.port}", err=True)
    for probe in daemon.missing_loud_sources():
        click.echo(f"gpu-health-agent: warning: source {probe.name} not running: {probe.why_not}", err=True)
    stop = stop_event(duration)
    try:
        daemon.run(stop)
    finally:
        server.close()


@click.command(name="reset-helper")
@click.option("--config", "config_path", type=click.Path(), help="Config file (YAML): remediation.reset_*.")
@reporting_bad_input
def reset_helper(config_path: str | None) -> None:
    """Serve GPU resets on remediation.reset_helper_socket (the DaemonSet's privileged gpu-reset container)."""
    config = config_of(config_path)
    configure_logging(config.log.level, config.log.format)
    socket_path = config.remediation.reset_helper_socket
    if not socket_path:
        raise AgentError("remediation.reset_helper_socket is not set: the reset helper has nowhere to listen")
    from agent.gpu.helper import serve as serve_resets  # noqa: PLC0415 - only the reset container serves resets

    stop = stop_event()
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
