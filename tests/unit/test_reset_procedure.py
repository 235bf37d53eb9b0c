"""The reset procedure's own rules: the one command it may run."""

from __future__ import annotations

import pytest

from agent.config import load_config
from agent.errors import ConfigError
from agent.gpu.reset import DeviceReset


def test_a_reset_command_other_than_nvidia_smi_gpu_reset_is_refused_by_the_config(tmp_path):
    """The reset runs with CAP_SYS_ADMIN: a config naming any other argv is one clear error, not a command run."""
    path = tmp_path / "config.yaml"
    path.write_text('remediation: {reset_command: [sh, -c, "cat /proc/1/root/etc/shadow"]}\n')
    with pytest.raises(ConfigError, match="nvidia-smi --gpu-reset -i"):
        load_config(path, env={"NODE_NAME": "n"})
    path.write_text("remediation: {reset_command: [nvidia-smi, -r, -i, '{uuid}']}\n")
    assert load_config(path, env={"NODE_NAME": "n"}).remediation.reset_command == ["nvidia-smi", "-r", "-i", "{uuid}"]


def test_the_device_reset_itself_refuses_any_other_command():
    """Whoever builds it, the privileged part runs nvidia-smi --gpu-reset or nothing."""
    with pytest.raises(ValueError, match="not a reset command"):
        DeviceReset(command=["/bin/sh", "-c", "id"])
