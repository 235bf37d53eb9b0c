"""Who holds the budget slot after a pass: a node whose pods a NoExecute device taint removes is disrupted."""

from __future__ import annotations

from agent.model import DeviceRef, NodeInventory, Signal, StepKind, StepResult
from agent.pipeline import LocalActuator, Pipeline
from agent.remediation import GateReading, GuardPolicy, Mode
from agent.remediation.record import NodeObservation
from agent.remediation.state import DeviceIsolation
from tests.conftest import gpu, obs
from tests.unit.test_pipeline import NODE

DEVICE = DeviceRef("gpu.nvidia.com", "node-1", "gpu-0")


class _DraNode(LocalActuator):
    """A node isolating GPUs one by one with DeviceTaintRules of `effect`; every step applied."""

    def __init__(self, effect: str) -> None:
        super().__init__()
        self.effect = effect
        self.kinds: list[StepKind] = []

    def observe(self, devices: bool = True) -> NodeObservation:
        return NodeObservation({}, False, False, frozenset(), device_taints=None,
                               devices=DeviceIsolation({gpu(0).uuid: (DEVICE,)}, effect=self.effect))

    def apply(self, step):
        self.kinds.append(step.kind)
        return StepResult.APPLIED, "ok"


class _Gate:
    """The cluster gate with room for this node: counts what the pass takes, renews and gives back."""

    maybe_held = False
    lingering = False

    def __init__(self) -> None:
        self.acquired = 0
        self.released = 0

    def read(self) -> GateReading:
        return GateReading()

    def acquire(self, rules: frozenset[str] = frozenset()) -> GateReading:
        self.acquired += 1
        return GateReading(held=True)

    def release(self) -> None:
        self.released += 1

    def show(self, holding: bool) -> None:
        return None


def _after_a_fault(rules, effect: str) -> tuple[_Gate, _DraNode]:
    gate, actuator = _Gate(), _DraNode(effect)
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
