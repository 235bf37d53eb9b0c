"""Who holds the budget slot after a pass: a node whose pods a NoExecute device taint removes is disrupted."""

from __future__ import annotations

from agent.model import DeviceRef, NodeInventory, Signal, StepKind
from agent.pipeline import Pipeline
from agent.remediation import GuardPolicy, Mode
from agent.remediation.record import NodeObservation
from agent.remediation.state import DeviceIsolation
from tests.conftest import gpu, obs
from tests.unit.test_admission import Applied, Gate
from tests.unit.test_pipeline import NODE

DEVICE = DeviceRef("gpu.nvidia.com", "node-1", "gpu-0")


class _DraNode(Applied):
    """A node isolating GPUs one by one with DeviceTaintRules of `effect`; every step applied."""

    def __init__(self, effect: str) -> None:
        super().__init__()
        self.effect = effect

    def observe(self, devices: bool = True) -> NodeObservation:
        return NodeObservation({}, False, False, frozenset(), device_taints=None,
                               devices=DeviceIsolation({gpu(0).uuid: (DEVICE,)}, effect=self.effect))


def _after_a_fault(rules, effect: str) -> tuple[Gate, _DraNode]:
    gate, actuator = Gate(), _DraNode(effect)
    idle = NodeInventory("node-1", NODE.gpus, ())
    p = Pipeline(rules=rules, inventory=idle, policy=GuardPolicy(mode=Mode.REMEDIATE), actuator=actuator, gate=gate,
                 clock=lambda: 100.0)
    p.handle(obs(Signal.XID, 95, 1.0), 1.0)
    return gate, actuator


def test_a_node_whose_gpu_has_a_noexecute_device_taint_keeps_its_slot(shipped_rules):
    """The NoExecute DeviceTaintRule deletes the GPU's pods as an eviction would: the slot it took is kept."""
    gate, actuator = _after_a_fault(shipped_rules, "NoExecute")
    assert StepKind.TAINT_DEVICE in actuator.kinds
    assert gate.acquired >= 1 and gate.released == 0


def test_a_node_whose_gpu_has_a_noschedule_device_taint_only_holds_no_slot(shipped_rules):
    """A NoSchedule DeviceTaintRule disrupts nobody: no slot is taken or kept for it."""
    gate, actuator = _after_a_fault(shipped_rules, "NoSchedule")
    assert StepKind.TAINT_DEVICE in actuator.kinds
    assert gate.acquired == 0
