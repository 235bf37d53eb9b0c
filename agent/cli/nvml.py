"""`nvml probe`, and the NVML source a read-only command opens."""

from __future__ import annotations

import click

from agent.cli.common import fail, reporting_bad_input
from agent.config import Config, load_config
from agent.sources.nvml import NvmlSource, load_pynvml, probe_calls


def nvml_or_reason(config: Config, sources: dict[str, str]) -> NvmlSource | None:
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


@click.group()
def nvml() -> None:
    """Work with NVML directly (read-only)."""


@nvml.command(name="probe")
@reporting_bad_input
def nvml_probe() -> None:
    """One line per GPU and NVML call the agent makes: supported, NotSupported or error."""
    sources: dict[str, str] = {}
    source = nvml_or_reason(load_config(None), sources)
    if source is None:
        fail([f"nvml: {sources['nvml']}"], code=1)
    try:
        click.echo(f"# {sources['nvml']}")
        for index, call, status in probe_calls(source):
            click.echo(f"gpu {index}  {call:48} {status}")
    finally:
        source.stop()
