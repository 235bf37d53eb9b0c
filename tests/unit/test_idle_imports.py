"""The idle agent (`run` with only the kernel log, no cluster) loads what a pass needs and nothing that only the
fleet controller, the other CLI commands, the other sources, the GPU edge or grpcio use."""

import subprocess
import sys
from pathlib import Path

import click

from agent.cli import COMMANDS, main

#: What only the CLI's other commands load (the fleet controller, check, simulate, the inspection commands).
OTHER_COMMANDS = ("agent.fleetctl", "agent.fleetctl.commands", "agent.check", "agent.cli.check", "agent.cli.inspect",
                  "agent.cli.simulate", "agent.simulate", "agent.cli.drill", "agent.cli.kmsgdevice", "agent.cli.nvml")

#: What a kernel-log-only agent in local mode does not need: the other sources, the scenario player, the GPU
#: edge's resets, the fleet summary it publishes in a cluster, the Kubernetes client, grpcio, and pydantic (a dev
#: dependency now: the configuration, rules and scenarios are msgspec Structs, ~9 MiB less RSS than its models).
NOT_FOR_THE_IDLE_AGENT = (*OTHER_COMMANDS, "grpc", "kubernetes", "urllib3", "pydantic", "agent.k8s.client",
                          "agent.simulation", "agent.sources.scenario", "agent.sources.nvml", "agent.sources.dcgm",
                          "agent.sources.dcgm_exporter", "agent.sources.dcgm_bindings", "agent.sources.node_memory",
                          "agent.gpu.reset", "agent.gpu.helper", "agent.fleet.summariser", "agent.kmsgdevice.plugin")


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


def test_a_kernel_log_only_agent_loads_none_of_the_modules_it_does_not_need(tmp_path: Path):
    """The daemon built as `run` builds it (kernel log only, no cluster) loads none of NOT_FOR_THE_IDLE_AGENT."""
    log = tmp_path / "kern.log"
    log.write_text("")
    settings = {"node_name": "n", "journal_path": str(tmp_path / "j.db"),
                "sources": {"kmsg": {"enabled": "on", "path": str(log)}, "nvml": {"enabled": "off"},
                            "dcgm": {"enabled": "off"}}}
    code = ("import click\nfrom agent.cli import main\nmain.get_command(click.Context(main), 'run')\n"
            "from agent.config import parse_config\nfrom agent.daemon import Daemon\n"
            "from agent.engine import builtin_rules_dir, load_rules\n"
            f"daemon = Daemon(parse_config({settings!r}), rules=load_rules(builtin_rules_dir()))\n"
            "assert [s.name for s in daemon.sources] == ['kmsg']")
    assert loaded_after(code, NOT_FOR_THE_IDLE_AGENT) == []


def test_each_command_the_cli_imports_by_name_is_the_command_of_that_name():
    """The table of lazily imported commands cannot drift from the commands themselves."""
    context = click.Context(main)
    assert {name: getattr(main.get_command(context, name), "name", None) for name in COMMANDS} == \
        {name: name for name in COMMANDS}
