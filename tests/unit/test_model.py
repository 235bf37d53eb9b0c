import dataclasses

import pytest

from agent.model import (
    Action,
    GpuRef,
    NodeInventory,
    Observation,
    PodRef,
    Severity,
    Signal,
    StepKind,
    frozen_attrs,
    new_observation,
    normalise_pci,
)


def test_severities_rank_from_ok_to_fatal():
    ranks = [s.rank for s in (Severity.OK, Severity.INFO, Severity.WARNING, Severity.UNKNOWN, Severity.DEGRADED,
                              Severity.FATAL)]
    assert ranks == sorted(ranks)


def test_only_quarantine_and_above_keep_new_work_off():
    assert [a for a in Action if a.quarantines] == [
        Action.QUARANTINE, Action.QUARANTINE_RESET_WHEN_IDLE, Action.DRAIN, Action.RESET_GPU, Action.REBOOT_NODE,
        Action.REPLACE_GPU]


def test_a_quarantine_that_resets_when_idle_keeps_new_work_off_evicts_nobody_and_resets():
    """Xid 94's remedy: NoSchedule, nobody running moved, a reset once the GPU is idle."""
    action = Action.QUARANTINE_RESET_WHEN_IDLE
    assert (action.quarantines, action.evicts, action.resets) == (True, False, True)


def test_restart_app_neither_quarantines_nor_evicts():
    assert not Action.RESTART_APP.quarantines
    assert not Action.RESTART_APP.evicts


def test_disruptive_steps_are_eviction_reset_reboot_request_and_diagnostic():
    """A diagnostic holds the GPU and takes a budget slot like a reset."""
    assert {k for k in StepKind if k.disruptive} == {StepKind.EVICT, StepKind.RESET_GPU, StepKind.REBOOT_REQUEST,
                                                     StepKind.RUN_DIAGNOSTIC}


def test_pci_ids_compare_whatever_the_printed_form():
    assert normalise_pci("PCI:0000:3B:00") == "0000:3b:00"
    assert normalise_pci("00000000:3b:00.0") == "0000:3b:00"
    assert normalise_pci("3b:00") == "0000:3b:00"
    assert normalise_pci("0002:3b:00.0") == "0002:3b:00"


def test_gpu_key_prefers_mig_parent_then_uuid_then_pci_then_index():
    assert GpuRef(uuid="MIG-1", mig_parent_uuid="GPU-P").key == "GPU-P"
    assert GpuRef(uuid="GPU-A", pci_bus_id="0000:01:00.0").key == "GPU-A"
    assert GpuRef(pci_bus_id="0000:01:00.0").key == "pci:0000:01:00.0"
    assert GpuRef(index=3).key == "index:3"


def test_inventory_resolves_a_pci_only_identity_to_the_full_gpu():
    full = GpuRef(2, "GPU-X", "0000:3a:00.0", "H100")
    node = NodeInventory("n", (full,))
    assert node.resolve(GpuRef(pci_bus_id="PCI:0000:3a:00")) == full
    assert node.resolve(GpuRef(pci_bus_id="0000:99:00.0")) == GpuRef(pci_bus_id="0000:99:00.0")


def test_inventory_lists_the_pods_holding_a_gpu():
    node = NodeInventory("n", (), (PodRef("a", "p1", gpu_uuids=("GPU-1",)), PodRef("a", "p2", gpu_uuids=("GPU-2",))))
    assert [p.name for p in node.pods_holding("GPU-2")] == ["p2"]


def test_the_storm_paths_observation_factory_builds_what_the_constructor_builds():
    """new_observation sets every field (a field it missed would be unset, and the comparison would fail)."""
    gpu = GpuRef(pci_bus_id="0000:18:00.0", uuid="GPU-1")
    attrs = frozen_attrs({"pid": 7, "message": "fault"})
    fast = new_observation(Signal.XID, 31.0, 5.0, "kmsg", gpu, attrs)
    assert fast == Observation(Signal.XID, 31.0, 5.0, "kmsg", gpu, attrs)
    assert [getattr(fast, f.name) for f in dataclasses.fields(Observation)] == [
        Signal.XID, 31.0, 5.0, "kmsg", gpu, attrs, 1]


def test_the_observation_factory_keeps_a_folded_count():
    """A storm's folded repeats survive being rebuilt with a resolved GPU."""
    attrs = frozen_attrs({"pid": 7})
    assert new_observation(Signal.XID, 31.0, 5.0, "kmsg", None, attrs, 12) == \
        Observation(Signal.XID, 31.0, 5.0, "kmsg", None, attrs, 12)


def test_an_observation_from_the_factory_is_still_frozen():
    """Bypassing the frozen __init__ must not leave a writable observation behind."""
    observation = new_observation(Signal.XID, 79.0, 1.0, "kmsg", None, frozen_attrs({}))
    with pytest.raises(dataclasses.FrozenInstanceError):
        observation.value = 1.0  # type: ignore[misc]
