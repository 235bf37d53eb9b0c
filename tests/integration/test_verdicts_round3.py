"""Issue 26 (third round of verdicts): a replacement mark stays, failed resets keep their fault's family,
the contained ECC incident decides, and every quarantine has a way back."""

from agent.model import Observation, Signal, frozen_attrs
from agent.remediation import Mode
from tests.k8s_helpers import gpu_node, grace_period_passes, make_agent

REPLACE_LABEL = "gpu-health-agent.io/needs-replacement"


def boot(agent, boot_id: str, at: float):
    return agent.pipeline.handle(Observation(Signal.BOOT, 0, at, "kmsg", None, frozen_attrs({"boot_id": boot_id})), at)


def xid48_three_times_each_reset_verified(agent):
    for round_ in range(2):
        agent.fault(2, xid=48, at=1000.0 * round_ + 1)
        grace_period_passes(agent.cluster)
        agent.pipeline.tick(1000.0 * round_ + 11)
        agent.poll(2, at=1000.0 * round_ + 12)
    return agent.fault(2, xid=48, at=3000.0)


def test_a_reboot_does_not_clear_a_replacement_escalated_from_a_reset_fault(fake):
    """Xid 48 back after two verified resets is marked for replacement; a reboot for a kernel patch keeps it."""
    cluster, server = fake
    agent = make_agent(cluster, server, gpu_node("n1"))
    boot(agent, "boot-a", 0.5)
    assert xid48_three_times_each_reset_verified(agent).verdicts[0].action == "replace_gpu"
    cleared = boot(agent, "boot-b", 5000.0)
    assert [v.rule_id for v in cleared.verdicts if v.gpu_key == "GPU-n1-0002"] == []
    assert cluster.node("n1")["metadata"]["labels"][REPLACE_LABEL] == "true"
    assert agent.pipeline.gpu_statuses()["GPU-n1-0002"] == "fatal"


def test_a_reboot_does_not_clear_a_replacement_escalated_from_xid_79(fake):
    """Xid 79 three times, each cleared by a reboot: the third is a replacement and the next reboot keeps it."""
    cluster, server = fake
    agent = make_agent(cluster, server, gpu_node("n1"))
    boot(agent, "boot-0", 0.5)
    for n in range(2):
        agent.fault(2, xid=79, at=1000.0 * n + 1)
        boot(agent, f"boot-{n + 1}", 1000.0 * n + 500)
    assert agent.fault(2, xid=79, at=3000.0).verdicts[0].action == "replace_gpu"
    boot(agent, "boot-9", 4000.0)
    assert cluster.node("n1")["metadata"]["labels"][REPLACE_LABEL] == "true"


def test_an_escalated_replacement_survives_a_restart_and_the_next_reboot(fake):
    """Restarted from the Node's copy of the record, the replacement still clears only by a release."""
    from tests.k8s_helpers import restart
    cluster, server = fake
    agent = make_agent(cluster, server, gpu_node("n1"))
    boot(agent, "boot-a", 0.5)
    xid48_three_times_each_reset_verified(agent)
    again = restart(agent)
    boot(again, "boot-b", 5000.0)
    assert again.pipeline.gpu_statuses()["GPU-n1-0002"] == "fatal"
    assert cluster.node("n1")["metadata"]["labels"][REPLACE_LABEL] == "true"


def test_an_operator_release_clears_an_escalated_replacement(fake):
    """The one way out of an escalated replacement (short of a new board) is the operator's release."""
    from agent.cluster_side import request_release
    from tests.k8s_helpers import operator_client
    cluster, server = fake
    agent = make_agent(cluster, server, gpu_node("n1"))
    boot(agent, "boot-a", 0.5)
    xid48_three_times_each_reset_verified(agent)
    request_release(operator_client(server), "n1", "GPU-n1-0002")
    agent.pipeline.reconcile(5000.0)
    assert REPLACE_LABEL not in cluster.node("n1")["metadata"]["labels"]


def test_a_failed_reset_of_a_driver_fault_never_counts_towards_replacement(fake):
    """Xid 119 (GSP timeout, driver class) weekly, each reset failing and a reboot fixing it: never a replacement."""
    cluster, server = fake
    agent = make_agent(cluster, server, gpu_node("n1"), reset=lambda uuid: (False, "Insufficient Permissions"))
    boot(agent, "boot-0", 0.5)
    failed = []
    for week in range(3):
        start = week * 7 * 86400.0 + 1
        agent.fault(2, xid=119, at=start)
        grace_period_passes(cluster)
        outcome = agent.pipeline.tick(start + 10)
        failed += [v for v in outcome.verdicts if v.rule_id == "gpu-reset-failed" and v.kind == "fault"]
        boot(agent, f"boot-{week + 1}", start + 600)
    assert [(v.action, v.fault_class) for v in failed] == [("reboot_node", "driver")] * 3
    assert agent.pipeline.node.recoveries.to_json() == {}


def test_a_failed_reset_of_a_hardware_fault_counts_as_hardware(fake):
    """The reset of an Xid 48 that failed is charged to the hardware family, like the Xid 48 itself."""
    cluster, server = fake
    agent = make_agent(cluster, server, gpu_node("n1"), reset=lambda uuid: (False, "reset refused"))
    boot(agent, "boot-0", 0.5)
    agent.fault(2, xid=48, at=1.0)
    grace_period_passes(cluster)
    outcome = agent.pipeline.tick(11.0)
    assert [v.fault_class for v in outcome.verdicts if v.rule_id == "gpu-reset-failed"] == ["hardware"]


def xid154(agent, gpu: int, before: int, after: int, at: float):
    attrs = frozen_attrs({"recovery_action_from": before, "recovery_action": after})
    return agent.pipeline.handle(Observation(Signal.XID, 154, at, "kmsg", agent.inventory.gpus[gpu], attrs), at)


def test_an_imex_domain_recovery_clears_once_the_driver_reports_none_and_a_poll_is_clean(fake):
    """Xid 154 0 -> 5 (recover the IMEX domain), then the driver's 5 -> 0 and a clean poll: the fault clears."""
    cluster, server = fake
    agent = make_agent(cluster, server, gpu_node("n1"))
    raised = xid154(agent, 3, 0, 5, 1.0)
    assert [v.rule_id for v in raised.verdicts] == ["xid-154-action-5"]
    xid154(agent, 3, 5, 0, 600.0)
    cleared = agent.poll(3, at=601.0)
    assert [(v.rule_id, v.kind) for v in cleared.verdicts] == [("xid-154-action-5", "cleared")]
    assert agent.pipeline.gpu_statuses()["GPU-n1-0003"] == "healthy"


def test_xid_74_whose_registers_cannot_be_read_is_reset_once_idle_and_clears(fake):
    """Xid 74 on an A100 (no register decode): new work stays off, the GPU is reset once idle, a clean poll clears."""
    from agent.model import GpuRef, NodeInventory, PodRef
    cluster, server = fake
    gpus = tuple(GpuRef(i, f"GPU-a-{i:04d}", f"0000:{0x18 + i:02x}:00.0", "NVIDIA A100-SXM4-80GB") for i in range(2))
    pods = (PodRef("gpu-health", "gpu-health-agent-a", "uid-agent-a", (), daemonset=True),)
    resets = []
    agent = make_agent(cluster, server, NodeInventory("a", gpus, pods),
                       reset=lambda uuid: (resets.append(uuid) or True, "reset"))
    raised = agent.fault(1, xid=74, at=1.0)
    assert [(v.rule_id, v.action) for v in raised.verdicts] == [("xid-74", "quarantine_reset_when_idle")]
    agent.pipeline.tick(30.0)
    assert resets == ["GPU-a-0001"]
    cleared = agent.poll(1, at=31.0)
    assert [(v.rule_id, v.kind) for v in cleared.verdicts] == [("xid-74", "cleared")]


def time_sliced_node():
    """GPU 2 shared by three pods (time-slicing); GPUs 0 and 1 with a pod each."""
    from agent.model import NodeInventory, PodRef
    base = gpu_node("n1", gpus=3)
    shared = base.gpus[2].uuid
    pods = (PodRef("ml", "n1-trainer-0", "uid-0", (base.gpus[0].uuid,)),
            PodRef("ml", "n1-trainer-1", "uid-1", (base.gpus[1].uuid,)),
            *(PodRef("ml", f"n1-tenant-{t}", f"uid-t{t}", (shared,)) for t in "abc"),
            PodRef("gpu-health", "gpu-health-agent-n1", "uid-agent-n1", (), daemonset=True))
    return NodeInventory("n1", base.gpus, pods)


def test_a_contained_ecc_error_evicts_no_co_tenant_and_the_reset_waits_for_idle(fake):
    """Xid 94, Xid 154 0 -> 4, then NVML's volatile DBE 1 on a time-sliced GPU: ecc-dbe defers to the contained
    incident: nobody is evicted (only the faulting application restarts, by itself), the reset waits for idle."""
    from agent.model import StepKind
    cluster, server = fake
    resets = []
    inventory = time_sliced_node()
    agent = make_agent(cluster, server, inventory, reset=lambda uuid: (resets.append(uuid) or True, "reset"))
    actions = [*agent.fault(2, xid=94, at=1.0).actions, *xid154(agent, 2, 0, 4, 1.1).actions]
    dbe = agent.pipeline.handle(Observation(Signal.ECC_DBE, 1, 5.0, "nvml", inventory.gpus[2],
                                            frozen_attrs({"volatile_total": 1})), 5.0)
    actions += dbe.actions + agent.pipeline.tick(60.0).actions
    assert [(v.rule_id, v.action) for v in dbe.verdicts] == [("ecc-dbe-contained", "quarantine_reset_when_idle")]
    assert [a for a in actions if a.step.kind is StepKind.EVICT] == []
    assert resets == []
    assert len([p for p in cluster.pods_on("n1") if "tenant" in p["metadata"]["name"]]) == 3


def test_an_uncontained_ecc_error_still_resets_at_once(fake):
    """A volatile DBE with no contained incident on its GPU keeps ecc-dbe's fatal reset."""
    cluster, server = fake
    inventory = gpu_node("n1")
    agent = make_agent(cluster, server, inventory)
    dbe = agent.pipeline.handle(Observation(Signal.ECC_DBE, 1, 5.0, "nvml", inventory.gpus[2]), 5.0)
    assert [(v.rule_id, v.action) for v in dbe.verdicts] == [("ecc-dbe", "reset_gpu")]


def test_a_recovery_the_driver_reports_done_never_counts_towards_replacement(fake):
    """An IMEX domain recovered (5 -> 0, a clean poll) is no recovery of the GPU's hardware: nothing is counted."""
    cluster, server = fake
    agent = make_agent(cluster, server, gpu_node("n1"))
    xid154(agent, 3, 0, 5, 1.0)
    xid154(agent, 3, 5, 0, 600.0)
    agent.poll(3, at=601.0)
    assert agent.pipeline.node.recoveries.to_json() == {}


def test_a_new_board_in_the_slot_of_a_gpu_marked_for_replacement_clears_the_mark(fake):
    """The GPU at PCI 0000:1a:00.0 reads with another UUID after the replacement: the old board's faults end."""
    import dataclasses
    cluster, server = fake
    agent = make_agent(cluster, server, gpu_node("n1"))
    boot(agent, "boot-a", 0.5)
    xid48_three_times_each_reset_verified(agent)
    boot(agent, "boot-b", 5000.0)  # the board was swapped during the downtime
    new_board = dataclasses.replace(agent.inventory.gpus[2], uuid="GPU-n1-new-board")
    attrs = frozen_attrs({"recovery_action": 0, "remap_pending": 0, "retirement_pending": 0, "volatile_dbe": 0,
                          "links_down": 0})
    polled = agent.pipeline.handle(Observation(Signal.GPU_POLLED, 1, 5010.0, "nvml", new_board, attrs), 5010.0)
    assert [(v.rule_id, v.kind) for v in polled.verdicts] == [("xid-48", "cleared")]
    assert "replaced" in polled.verdicts[0].summary
    assert REPLACE_LABEL not in cluster.node("n1")["metadata"]["labels"]
    assert agent.pipeline.gpu_statuses().get("GPU-n1-0002") is None


def test_an_imex_recovery_no_clean_poll_verifies_is_charged_to_the_interconnect(fake):
    """The driver's 5 -> 0 with no clean poll within the deadline: a failed recovery of the interconnect family."""
    cluster, server = fake
    agent = make_agent(cluster, server, gpu_node("n1"))
    xid154(agent, 3, 0, 5, 1.0)
    xid154(agent, 3, 5, 0, 600.0)
    agent.poll(3, at=601.0, recovery_action=5)  # not clean
    failed = agent.pipeline.tick(1000.0)
    assert [(v.rule_id, v.fault_class) for v in failed.verdicts if v.kind == "fault"] == [
        ("gpu-reset-failed", "interconnect")]


def test_an_imex_recovery_clears_only_the_imex_fault_not_a_gsp_timeout_nothing_reset(fake):
    """Issue 41 row 5: Xid 119 active, then Xid 154 0 -> 5 -> 0 and a clean poll, nothing reset (quarantine
    mode runs no reset): only the IMEX fault clears; the GSP timeout still wants its reset."""
    cluster, server = fake
    agent = make_agent(cluster, server, gpu_node("n1"), mode=Mode.QUARANTINE)
    agent.fault(3, xid=119, at=1.0)
    xid154(agent, 3, 0, 5, 2.0)
    xid154(agent, 3, 5, 0, 600.0)
    cleared = agent.poll(3, at=601.0)
    assert [(v.rule_id, v.kind) for v in cleared.verdicts] == [("xid-154-action-5", "cleared")]
    assert ("GPU-n1-0003", "xid-119") in agent.pipeline.shared.record.faults
    assert agent.pipeline.gpu_statuses()["GPU-n1-0003"] == "fatal"
