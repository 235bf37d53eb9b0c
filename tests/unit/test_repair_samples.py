"""The node-repair samples in docs/repair-tools parse and name only conditions the agent writes, with the
status it writes when the node needs repair (their CRDs are absent here: YAML and field checks only)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from agent.k8s.node import AGENT_CONDITIONS, CONDITION_REBOOT
from agent.remediation.repair_condition import CONDITION

SAMPLES = Path(__file__).resolve().parents[2] / "docs" / "repair-tools"
UNHEALTHY = {CONDITION: "False", CONDITION_REBOOT: "True"}  # what each says while the node needs repair


@pytest.mark.parametrize(("name", "kind", "wait"), [("machinehealthcheck.yaml", "MachineHealthCheck", "timeout"),
                                                    ("nodehealthcheck.yaml", "NodeHealthCheck", "duration")])
def test_a_repair_sample_names_the_agents_conditions_as_it_writes_them(name: str, kind: str, wait: str):
    """Each unhealthy condition is one the agent sets, with its needs-repair status and a wait."""
    [sample] = list(yaml.safe_load_all((SAMPLES / name).read_text()))
    assert sample["kind"] == kind
    conditions = sample["spec"]["unhealthyConditions"]
    assert {c["type"] for c in conditions} == set(UNHEALTHY) and set(UNHEALTHY) <= set(AGENT_CONDITIONS)
    for condition in conditions:
        assert condition["status"] == UNHEALTHY[condition["type"]] and condition[wait].endswith("m")
