"""The idle agent (`run` with only the kernel log, no cluster) loads what a pass needs and nothing that only the
fleet controller, the other CLI commands, the other sources, the GPU edge or grpcio use."""

import subprocess
import sys

import click

from agent.cli import COMMANDS, main

#: What only the CLI's other commands load (the fleet controller, check, simulate, the inspection commands).
OTHER_COMMANDS = ("agent.fleetctl", "agent.fleetctl.commands", "agent.check", "agent.cli.check", "agent.cli.inspect",
                  "agent.cli.simulate", "agent.simulate", "agent.cli.drill", "agent.cli.kmsgdevice", "agent.cli.nvml")


def loaded_after(code: str, names: tuple[str, ...]) -> list[str]:
    """Those of `names` that a fresh interpreter holds in sys.modules after running `code`."""
    script = f"import sys\n{code}\nprint('\\n'.join(n for n in {names!r} if n in sys.modules))"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.split()


def test_the_run_command_loads_none_of_the_other_commands():
    """`gpu-health-agent run` resolves its command without importing the modules of the others."""
    code = "import click\nfrom agent.cli import main\nmain.get_command(click.Context(main), 'run')"
    assert loaded_after(code, OTHER_COMMANDS) == []


def test_each_command_the_cli_imports_by_name_is_the_command_of_that_name():
    """The table of lazily imported commands cannot drift from the commands themselves."""
    context = click.Context(main)
    assert {name: getattr(main.get_command(context, name), "name", None) for name in COMMANDS} == \
        {name: name for name in COMMANDS}
