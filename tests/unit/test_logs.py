"""The agent's process never loads the dev tools that structlog would pick up when they are installed."""

import subprocess
import sys

import pytest


@pytest.mark.parametrize("module", ["rich", "pygments"])
def test_the_agent_runtime_loads_no_dev_tool(module: str):
    """Run in a fresh interpreter: this test process may have loaded them for its own reasons."""
    code = ("import sys, agent.cli, agent.logs\n"
            "agent.logs.configure_logging(fmt='console')\n"
            f"print(sys.modules.get({module!r}) is not None)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert result.stdout.strip() == "False"
