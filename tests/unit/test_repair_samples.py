"""The node-repair samples in docs/repair-tools name only conditions the agent writes, with the status it
writes when the node needs repair (offline; tests/realcluster/test_repair_samples.py creates them against the
tools' real CRDs)."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.k8s.node import AGENT_CONDITIONS, CONDITION_REBOOT, POSITIVE_CONDITIONS
from agent.remediation.repair_condition import CONDITION
from tests.repair_samples import load_sample, sample_files, unhealthy_conditions


def test_there_is_a_sample_for_cluster_api_and_for_medik8s():
    """One MachineHealthCheck and one NodeHealthCheck, each acting on AcceleratedHardwareReady and GpuRebootRequired."""
    samples = [load_sample(path) for path in sample_files()]
    assert sorted(s["kind"] for s in samples) == ["MachineHealthCheck", "NodeHealthCheck"]
    for sample in samples:
        assert {kind for kind, _, _ in unhealthy_conditions(sample)} == {CONDITION, CONDITION_REBOOT}


@pytest.mark.parametrize("path", sample_files(), ids=lambda p: p.name)
def test_a_repair_sample_names_the_agents_conditions_as_it_writes_them(path: Path):
    """Each unhealthy condition is one the agent sets, with its needs-repair status and a wait."""
    for kind, status, wait in unhealthy_conditions(load_sample(path)):
        assert kind in AGENT_CONDITIONS
        assert status == ("False" if kind in POSITIVE_CONDITIONS else "True") and wait, kind
