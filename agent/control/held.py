"""Resets the GPU's holders kept from running: blocked and asked again after the cooldown, failed past the cap."""

from __future__ import annotations

from agent.model import Step, StepResult


class HeldResets:
    """Per GPU, the resets in a row the procedure found the GPU still held for (not idle yet: asked again once
    the guard's reset cooldown has passed, never charged as failed, until as many as its attempt cap allows
    within the hour say that it stays held), and when each may be asked again."""

    def __init__(self, *, cooldown_seconds: float, max_attempts_per_hour: int) -> None:
        self.cooldown_seconds = cooldown_seconds
        self.bound = max(1, max_attempts_per_hour)
        self.counts: dict[str, int] = {}
        #: Per GPU found held, when its reset may be asked again (the guard's cooldown): not before, not recorded.
        self.until: dict[str, float] = {}

    def waiting(self, gpu_key: str, now: float) -> bool:
        """Whether the GPU's reset waits for its cooldown after it was found held."""
        return now < self.until.get(gpu_key, 0.0)

    def bounded(self, step: Step, result: StepResult, message: str, now: float) -> tuple[StepResult, str]:
        """A reset the GPU's holders kept from running is blocked (asked again after the guard's cooldown), as
        many times in a row as the attempt cap allows within the hour: then it failed, saying so (the failed
        reset's own rule takes over: a GPU that stays held needs a person or a reboot)."""
        key = step.gpu_key
        self.until.pop(key, None)
        if result is not StepResult.BLOCKED:
            self.counts.pop(key, None)
            return result, message
        self.until[key] = now + self.cooldown_seconds
        held = self.counts[key] = self.counts.get(key, 0) + 1
        if held < self.bound:
            return result, f"{message} (held {held} of {self.bound} times: asked again after the cooldown)"
        del self.counts[key]
        return StepResult.FAILED, f"the GPU stayed held through {held} reset attempts: {message}"
