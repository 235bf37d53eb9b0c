"""The node summary the fleet reads: compact, bounded, and one clear line when damaged."""

from __future__ import annotations

import pytest

from agent.errors import InputError
from agent.fleet import FaultSummary, NodeSummary
from agent.fleet.summary import MAX_FAULTS
from agent.model import Action, FaultClass, Severity


def test_a_summary_reads_back_as_written():
    """What an agent publishes is what the fleet controller reads."""
    summary = NodeSummary(node="n1", gpu_model="NVIDIA H200", driver_version="570.86.15", fabric_domain="c1/7",
                          rack="r1", zone="z1", boot_id="b1", uptime_seconds=120.0, workloads=("ml/Job/a",),
                          faults=(FaultSummary("xid-79", FaultClass.HARDWARE, Severity.FATAL, Action.DRAIN, 1,
                                               ("ml/Job/a",)),))
    assert NodeSummary.from_json(summary.to_json()) == summary


def test_a_summary_keeps_the_most_severe_faults_within_its_bound():
    """A node with hundreds of faults publishes the worst MAX_FAULTS and says how many more there are."""
    faults = tuple(FaultSummary(f"r{i}", FaultClass.DRIVER, Severity.WARNING, Action.NOTIFY) for i in range(300))
    worst = FaultSummary("xid-79", FaultClass.HARDWARE, Severity.FATAL, Action.DRAIN)
    text = NodeSummary(node="n1", faults=(*faults, worst)).to_json()
    read = NodeSummary.from_json(text)
    assert len(read.faults) == MAX_FAULTS and read.faults[0] == worst
    assert '"more":269' in text


@pytest.mark.parametrize("text", ["{", "[]", '{"v": 2}', '{"v": 1, "faults": [{"rule": "x", "class": "bogus"}]}',
                                  '{"v": 1, "uptime": -5}'])
def test_a_damaged_summary_is_one_input_error(text):
    """Bad JSON, another version or a bad field: one line naming the object, never a traceback."""
    with pytest.raises(InputError, match=r"^node/n1: "):
        NodeSummary.from_json(text, source="node/n1")
