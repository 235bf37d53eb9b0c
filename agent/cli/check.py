"""`check`: every source read once, each GPU's status, exit status as a monitoring plugin."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import click

from agent.check import CheckStatus, check_node, exporter_reading, kmsg_snapshot, nvml_reading
from agent.cli.common import F, config_of, fail, reporting_bad_input
from agent.cli.nvml import nvml_or_reason
from agent.cli.render import render_check_table
from agent.config import Config
from agent.daemon import rules_dir_of
from agent.engine import load_rules
from agent.logs import configure_logging
from agent.model import GpuRef, Observation
from agent.sources.dcgm_exporter import ExporterReader


class _MonitoringPluginCommand(click.Command):
    """`check`: even a usage error exits UNKNOWN (3), so a monitoring system never reads it as CRITICAL (2)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as exc:
            setattr(exc, "exit_code", int(CheckStatus.UNKNOWN))  # noqa: B010 - an instance attribute on purpose
            raise


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


@click.command(cls=_MonitoringPluginCommand)
@click.option("--config", "config_path", type=click.Path(), help="Config file (YAML).")
@click.option("--json", "as_json", is_flag=True, help='{"status", "summary", "gpus": [{"uuid", "status", ...}]}')
@click.option("--dcgm-exporter", "exporter", help="Read only this dcgm-exporter /metrics URL or file.")
@_monitoring_plugin
@reporting_bad_input
def check(config_path: str | None, as_json: bool, exporter: str | None) -> CheckStatus:
    """Read every available source once and print each GPU's status and why (read-only).

    Exit status as a monitoring plugin: 0 OK, 1 WARNING (a GPU degraded), 2 CRITICAL (a GPU fatal),
    3 UNKNOWN (a GPU or source unreadable, no GPU found, or the check itself could not run).
    """
    config = config_of(config_path)
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
        nvml_source = nvml_or_reason(config, sources)
        if nvml_source is not None:
            try:
                gpus, observations = nvml_reading(nvml_source)
            finally:
                nvml_source.stop()
        elif config.sources.nvml.enabled == "on":
            unreadable.append("nvml")
        observations += kmsg_or_reason(config, sources, now)
        if sources["kmsg"].startswith("cannot read") and config.sources.kmsg.enabled == "on":
            unreadable.append("kmsg")
        if nvml_source is None and not sources["kmsg"].startswith("read"):
            reasons = "; ".join(f"{k}: {v}" for k, v in sources.items())
            fail([f"gpu-health-agent check: UNKNOWN - no source to read ({reasons})"], code=CheckStatus.UNKNOWN)
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


def kmsg_or_reason(config: Config, sources: dict[str, str], now: float) -> list[Observation]:
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
