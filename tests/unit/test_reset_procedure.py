"""The reset procedure's own rules: the one command it may run, and one lock for a reset and every restore."""

from __future__ import annotations

import threading

import pytest

from agent.config import load_config
from agent.errors import ConfigError
from agent.gpu.reset import DeviceReset, ResetOutcome, ResetProcedure

UUID = "GPU-6a6a6a6a-0000-1111-2222-333333333333"


class Operands:
    """OperandControl as the procedure sees it: a pause on the Node until a restore succeeds."""

    def __init__(self, *, failing_restores: int = 0) -> None:
        self.paused = False
        self.failing = failing_restores
        self.calls: list[str] = []

    def pause(self) -> str:
        self.calls.append("pause")
        self.paused = True
        return "paused device-plugin"

    def restore(self) -> str:
        self.calls.append("restore")
        if not self.paused:
            return ""
        if self.failing:
            self.failing -= 1
            raise ConnectionError("API server unreachable")
        self.paused = False
        return "restored 1 operand label(s)"


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


def test_restore_if_needed_restores_nothing_while_a_reset_holds_the_lock():
    """A restore asked for mid-reset (the start-up restore, a reconcile pass) waits out the reset's pause."""
    operands = Operands()
    inside, finish = threading.Event(), threading.Event()

    def execute(uuid: str) -> ResetOutcome:
        inside.set()
        finish.wait(10)
        return ResetOutcome(True, "reset")

    procedure = ResetProcedure(execute, operands=operands)
    reset = threading.Thread(target=procedure, args=(UUID,))
    reset.start()
    try:
        assert inside.wait(10)
        assert procedure.restore_if_needed() == ""
        assert operands.calls == ["pause"] and operands.paused
    finally:
        finish.set()
        reset.join(10)
    assert operands.calls == ["pause", "restore"] and not operands.paused
    assert procedure.restore_if_needed() == ""


def test_a_restore_that_failed_is_tried_again_at_the_next_call_and_never_raises():
    """A reset whose restore failed leaves the pause; each restore_if_needed tries again until one succeeds."""
    operands = Operands(failing_restores=2)
    ok, message = ResetProcedure(lambda uuid: ResetOutcome(True, "reset"), operands=operands)(UUID)
    assert ok and "operands not restored yet (the next reconcile pass restores them)" in message
    procedure = ResetProcedure(lambda uuid: ResetOutcome(True, "reset"), operands=operands)
    assert "operands not restored (tried again next pass): ConnectionError" in procedure.restore_if_needed()
    assert operands.paused
    assert procedure.restore_if_needed() == "restored 1 operand label(s)"
    assert not operands.paused


def test_a_gpu_still_held_when_the_wait_ends_is_not_idle_yet_not_a_failed_reset():
    """The privileged part gave up because the GPU is held: the procedure says None (asked again), not False."""
    held = ResetProcedure(lambda uuid: ResetOutcome(False, "not reset: the driver still refuses", held=True))
    assert held(UUID) == (None, "not reset: the driver still refuses")
    failed = ResetProcedure(lambda uuid: ResetOutcome(False, "nvidia-smi exit 3: Not Supported"))
    assert failed(UUID)[0] is False
