"""A source's position in its input, opaque to the pipeline: which observation moves it, and to what."""

from __future__ import annotations

from typing import Protocol

from agent.model import Observation


class InputCheckpoint(Protocol):
    """How one source's checkpoint is read off its observations. The pipeline stores the value (a string it
    never parses) under `name`, in the same journal transaction as the record the observation changed."""

    @property
    def name(self) -> str: ...

    def position(self, observation: Observation, boot_id: str) -> str | None:
        """The checkpoint once this observation is handled (None: it is not this source's, or has no place)."""
        ...

    def newer(self, value: str, than: str | None) -> bool:
        """True when `value` moves the checkpoint on from `than` (an older one is never written back)."""
        ...
