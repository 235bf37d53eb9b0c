"""The `gpu-health-agent` command line: thin wrappers over the daemon, simulator, rules and journal.

Each command's module is imported when that command runs (or `--help` lists them all): the agent's
`run` never loads what only the fleet controller, `check`, `simulate` or the inspection commands use.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

import click

from agent import __version__
from agent.cli.common import EXIT_BAD_INPUT, EXIT_FAILED
from agent.hot_path import describe as describe_storm_path

#: Each command's name -> the module and attribute that define it.
COMMANDS = {
    "fleet": ("agent.fleetctl.commands", "fleet"),
    "run": ("agent.cli.run", "run"),
    "reset-helper": ("agent.cli.run", "reset_helper"),
    "release": ("agent.cli.cluster", "release"),
    "cleanup": ("agent.cli.cluster", "cleanup"),
    "drill": ("agent.cli.drill", "drill"),
    "simulate": ("agent.cli.simulate", "simulate_command"),
    "check": ("agent.cli.check", "check"),
    "nvml": ("agent.cli.nvml", "nvml"),
    "kmsg": ("agent.cli.kmsg", "kmsg"),
    "kmsg-device-plugin": ("agent.cli.kmsgdevice", "kmsg_device_plugin"),
    "driver-files": ("agent.cli.kmsgdevice", "driver_files"),
    "rules": ("agent.cli.inspect", "rules"),
    "config": ("agent.cli.inspect", "config_group"),
    "history": ("agent.cli.inspect", "history"),
    "explain": ("agent.cli.inspect", "explain"),
    "probe": ("agent.cli.probe", "probe"),
}


class _OneLineGroup(click.Group):
    """Usage errors are one line on stderr (`gpu-health-agent CMD: problem (see CMD --help)`), never a traceback.

    Its commands are imported by name when asked for (COMMANDS), not when the command line is built."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*COMMANDS, *super().list_commands(ctx)})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        where = COMMANDS.get(cmd_name)
        if where is None:
            return super().get_command(ctx, cmd_name)
        command = getattr(importlib.import_module(where[0]), where[1])
        if not isinstance(command, click.Command):
            raise TypeError(f"{where[0]}.{where[1]} is not a click command")
        return command

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
