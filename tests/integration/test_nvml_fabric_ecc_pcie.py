"""GPU fabric, ECC mode and PCIe link readings, on the real pynvml over the fake library, judged over time."""

from agent.engine import builtin_rules_dir, load_rules
from agent.model import NodeInventory, Signal
from agent.pipeline import Pipeline
from agent.remediation import GuardPolicy, Mode
from agent.sources.nvml import NvmlSource, load_pynvml
from tests.conftest import eight_gpus

RULES = load_rules(builtin_rules_dir())
COMPLETED, NOT_STARTED = 3, 1
DEGRADED_BW_TRUE, ROUTE_UNHEALTHY_FALSE = 1 << 0, 2 << 4
ROUTE_RECOVERY_TRUE, ACCESS_TIMEOUT_RECOVERY_TRUE = 1 << 2, 1 << 6  # NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_* 2 and 6


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def polled_over(fake_nvml, state, *, seconds: float, every: float = 10.0):
    """Poll a node in `state` every `every` seconds of a virtual clock for `seconds`: verdicts, pipeline, source."""
    fake_nvml.write(state)
    clock = Clock()
    nvml = NvmlSource(load_pynvml(), poll_seconds=every, call_timeout_seconds=2.0, clock=clock)
    nvml.start()
    pipeline = Pipeline(rules=RULES, inventory=NodeInventory("n"), policy=GuardPolicy(mode=Mode.OBSERVE),
                        clock=clock)
    verdicts, observations = [], []
    try:
        end = clock.now + seconds
        while clock.now <= end:
            for o in nvml.poll():
                observations.append(o)
                verdicts += pipeline.handle(o, o.at).verdicts
            clock.now += every
    finally:
        nvml.stop()
    return verdicts, pipeline, observations, nvml


def of_gpu(verdicts, index):
    return [(v.rule_id, str(v.severity), str(v.action)) for v in verdicts if v.gpu and v.gpu.index == index]


def everywhere(**gpu):
    return eight_gpus(**{str(i): dict(gpu) for i in range(8)})


# ---- fabric ----
def test_a_fabric_not_completed_quarantines_the_node(fake_nvml):
    """Fabric Manager down (state NotStarted on every GPU) for two minutes: every GPU fatal, quarantined."""
    verdicts, pipeline, _, _ = polled_over(fake_nvml, everywhere(fabric={"state": NOT_STARTED}), seconds=130)
    assert {tuple(of_gpu(verdicts, i)) for i in range(8)} == {(("fabric-not-registered", "fatal", "quarantine"),)}
    assert set(pipeline.gpu_statuses().values()) == {"fatal"}
    assert "NotStarted" in next(v.summary for v in verdicts if v.rule_id == "fabric-not-registered")


def test_a_fabric_registering_for_a_moment_after_boot_is_not_judged(fake_nvml):
    """InProgress for one minute (registration after a driver load) quarantines nothing."""
    verdicts, _, observations, _ = polled_over(fake_nvml, everywhere(fabric={"state": 2}), seconds=60)
    assert [v for v in verdicts if v.rule_id.startswith("fabric")] == []
    assert {o.value for o in observations if o.signal is Signal.GPU_FABRIC} == {2}


def test_a_fabric_completed_with_an_error_status_quarantines_at_once(fake_nvml):
    """State Completed but status not success: the GPU did not join the fabric."""
    state = eight_gpus(**{"4": {"fabric": {"state": COMPLETED, "status": 999}}})
    verdicts, _, observations, _ = polled_over(fake_nvml, state, seconds=0)
    assert of_gpu(verdicts, 4) == [("fabric-registration-failed", "fatal", "quarantine")]
    [fabric] = [o for o in observations if o.signal is Signal.GPU_FABRIC]
    assert (fabric.attrs["status"], fabric.attrs["status_text"]) == (999, "Unknown Error")


def test_degraded_bandwidth_in_the_fabric_health_mask_is_degraded(fake_nvml):
    """GB200's health mask says bandwidth is degraded: degraded, not quarantined."""
    fabric = {"state": COMPLETED, "health_mask": DEGRADED_BW_TRUE | ROUTE_UNHEALTHY_FALSE, "health_summary": 3}
    verdicts, _, observations, _ = polled_over(fake_nvml, eight_gpus(**{"6": {"fabric": fabric}}), seconds=70)
    assert of_gpu(verdicts, 6) == [("fabric-degraded-bandwidth", "degraded", "notify")]
    last = [o for o in observations if o.signal is Signal.GPU_FABRIC][-1]
    assert (last.attrs["degraded_bandwidth"], last.attrs["route_unhealthy"]) == (1, 0)
    assert last.attrs["health_summary"] == "limited capacity"


def test_an_unhealthy_fabric_health_summary_keeps_new_work_off_the_gpu(fake_nvml):
    """GB200: the v3 health summary says Unhealthy for a minute: degraded, quarantined (nothing evicted)."""
    fabric = {"state": COMPLETED, "health_mask": ROUTE_UNHEALTHY_FALSE, "health_summary": 2}
    verdicts, _, _, _ = polled_over(fake_nvml, eight_gpus(**{"2": {"fabric": fabric}}), seconds=70)
    assert of_gpu(verdicts, 2) == [("fabric-health-unhealthy", "degraded", "quarantine")]


def test_an_access_timeout_recovery_is_reported_and_quarantines_only_when_it_does_not_end(fake_nvml):
    """Recovery in progress: a warning at once; still in progress ten minutes later: quarantined."""
    fabric = {"state": COMPLETED, "health_mask": ACCESS_TIMEOUT_RECOVERY_TRUE, "health_summary": 2}
    verdicts, _, observations, _ = polled_over(fake_nvml, eight_gpus(**{"5": {"fabric": fabric}}), seconds=610)
    judged = [rule for rule, _, _ in of_gpu(verdicts, 5)]
    assert judged == ["fabric-access-timeout-recovery", "fabric-health-unhealthy",
                      "fabric-access-timeout-recovery-stuck"]
    assert [o for o in observations if o.signal is Signal.GPU_FABRIC][-1].attrs["access_timeout_recovery"] == 1


def test_a_route_recovery_is_reported_not_quarantined(fake_nvml):
    fabric = {"state": COMPLETED, "health_mask": ROUTE_RECOVERY_TRUE, "health_summary": 1}
    verdicts, _, _, _ = polled_over(fake_nvml, eight_gpus(**{"1": {"fabric": fabric}}), seconds=120)
    assert of_gpu(verdicts, 1) == [("fabric-route-recovery", "warning", "notify")]


def test_a_pcie_only_gpu_without_a_fabric_gives_no_fabric_reading(fake_nvml):
    """NotSupported (no NVSwitch) is nothing: no reading, no verdict, and the GPU stays healthy."""
    verdicts, pipeline, observations, nvml = polled_over(fake_nvml, eight_gpus(), seconds=0)
    assert [o for o in observations if o.signal is Signal.GPU_FABRIC] == []
    assert [v for v in verdicts if v.rule_id.startswith("fabric")] == []
    assert "nvmlDeviceGetGpuFabricInfoV" in nvml.gpus[0].unsupported
    assert set(pipeline.gpu_statuses().values()) == {"healthy"}


def test_a_driver_that_takes_only_the_v2_fabric_struct_is_still_read(fake_nvml):
    """An older driver refuses the v3 struct (version mismatch): the v2 struct is asked for instead."""
    state = eight_gpus(**{"1": {"fabric": {"state": NOT_STARTED, "version": 2}}})
    _, _, observations, nvml = polled_over(fake_nvml, state, seconds=0)
    [fabric] = [o for o in observations if o.signal is Signal.GPU_FABRIC]
    assert (fabric.gpu.index, fabric.value, nvml.gpus[1].fabric_version) == (1, NOT_STARTED, 2)


# ---- ECC mode ----
def test_ecc_off_on_an_hbm_gpu_is_degraded_memory_not_protected(fake_nvml):
    """ECC off on an H100 (HBM3): degraded, "memory not protected"; the counters then read NotSupported."""
    state = eight_gpus(**{"3": {"ecc_mode": {"current": 0, "pending": 0}}})
    verdicts, _, _, nvml = polled_over(fake_nvml, state, seconds=0)
    assert of_gpu(verdicts, 3) == [("ecc-disabled", "degraded", "notify")]
    assert "memory not protected" in next(v.summary for v in verdicts if v.rule_id == "ecc-disabled")
    assert "nvmlDeviceGetRemappedRows" in nvml.gpus[3].unsupported


def test_ecc_off_on_a_gddr_gpu_is_not_judged(fake_nvml):
    """An L40S (GDDR6, 384-bit bus) with ECC off is a choice, not a fault."""
    state = eight_gpus(**{"3": {"name": "NVIDIA L40S", "memory_bus_width": 384,
                                "ecc_mode": {"current": 0, "pending": 0}}})
    verdicts, _, _, _ = polled_over(fake_nvml, state, seconds=0)
    assert of_gpu(verdicts, 3) == []


def test_a_pending_ecc_mode_change_is_said(fake_nvml):
    """ECC off now, on after the next reset: a warning that says so (and the off state is still degraded)."""
    state = eight_gpus(**{"2": {"ecc_mode": {"current": 0, "pending": 1}}})
    verdicts, _, _, _ = polled_over(fake_nvml, state, seconds=0)
    assert ("ecc-mode-change-pending", "warning", "notify") in of_gpu(verdicts, 2)
    pending = next(v for v in verdicts if v.rule_id == "ecc-mode-change-pending")
    assert "is off and changes to on" in pending.summary


# ---- PCIe ----
def test_a_busy_gpu_below_its_pcie_generation_is_degraded_over_time(fake_nvml):
    """Gen3 on a Gen5 link while 95% busy for five minutes: degraded, and the summary says to re-seat."""
    state = eight_gpus(**{"7": {"pcie": {"gen": 3, "max_gen": 5}, "utilization": {"gpu": 95}}})
    verdicts, _, _, _ = polled_over(fake_nvml, state, seconds=310)
    assert of_gpu(verdicts, 7) == [("pcie-link-gen-downtrained", "degraded", "notify")]
    assert "re-seat" in next(v.summary for v in verdicts if v.rule_id == "pcie-link-gen-downtrained")


def test_one_busy_sample_below_the_pcie_generation_is_not_judged(fake_nvml):
    """A single reading is no judgement: the generation is judged over minutes of busy readings."""
    state = eight_gpus(**{"7": {"pcie": {"gen": 3, "max_gen": 5}, "utilization": {"gpu": 95}}})
    verdicts, _, _, _ = polled_over(fake_nvml, state, seconds=0)
    assert of_gpu(verdicts, 7) == []


def test_an_idle_gpu_at_a_lower_pcie_generation_is_healthy(fake_nvml):
    """Idle, a GPU lowers its link generation to save power: no generation reading, no verdict."""
    state = eight_gpus(**{"7": {"pcie": {"gen": 1, "max_gen": 5}, "utilization": {"gpu": 0}}})
    verdicts, pipeline, observations, _ = polled_over(fake_nvml, state, seconds=610)
    assert of_gpu(verdicts, 7) == []
    assert [o for o in observations if o.signal is Signal.PCIE_LINK_GEN] == []
    assert set(pipeline.gpu_statuses().values()) == {"healthy"}


def test_a_narrowed_pcie_width_is_degraded_and_says_to_reseat(fake_nvml):
    """x8 on an x16 link for five minutes: degraded, with what to check."""
    state = eight_gpus(**{"0": {"pcie": {"width": 8, "max_width": 16}}})
    verdicts, pipeline, _, nvml = polled_over(fake_nvml, state, seconds=310)
    assert of_gpu(verdicts, 0) == [("pcie-link-downtrained", "degraded", "notify")]
    assert "re-seat" in next(v.summary for v in verdicts if v.rule_id == "pcie-link-downtrained")
    assert pipeline.gpu_statuses()[nvml.gpus[0].ref.key] == "degraded"


def test_a_pynvml_without_the_v3_fabric_struct_reads_the_v2_one(fake_nvml, monkeypatch):
    """An older nvidia-ml-py lacks c_nvmlGpuFabricInfo_v3_t: the v2 struct is used, the fabric still read."""
    import pynvml
    monkeypatch.delattr(pynvml, "c_nvmlGpuFabricInfo_v3_t")
    _, _, observations, nvml = polled_over(fake_nvml, everywhere(fabric={"state": NOT_STARTED}), seconds=0)
    assert {o.gpu.index for o in observations if o.signal is Signal.GPU_FABRIC} == set(range(8))
    assert nvml.gpus[0].fabric_version == 2
