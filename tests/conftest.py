"""Shared test helpers: the shipped rules, GPUs and observations built in one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.engine import RuleSet, builtin_rules_dir, load_rules
from agent.model import GpuRef, Observation, Signal, frozen_attrs

REPO = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"


@pytest.fixture(scope="session")
def shipped_rules() -> RuleSet:
    return load_rules(builtin_rules_dir())


def gpu(index: int = 0, model: str = "NVIDIA H100 80GB HBM3") -> GpuRef:
    return GpuRef(index=index, uuid=f"GPU-0000000{index}-aaaa-bbbb-cccc-dddddddddddd",
                  pci_bus_id=f"0000:{0x18 + index:02x}:00.0", model=model)


def obs(signal: Signal, value: float, at: float = 0.0, *, gpu_ref: GpuRef | None = None,
        count: int = 1, source: str = "test", **attrs: object) -> Observation:
    return Observation(signal, value, at, source, gpu_ref if gpu_ref is not None else gpu(),
                       frozen_attrs(attrs), count)  # type: ignore[arg-type]


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.01) -> bool:
    """Poll `predicate` until it holds or `timeout` passes (integration tests on real threads)."""
    import time
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False
