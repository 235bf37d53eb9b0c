"""NVML readings that decide a verdict, on the real pynvml over the fake libnvidia-ml.so.1."""

import threading
import time

from agent.model import Signal
from agent.sources.node_memory import InMemory, JsonFileMemory
from agent.sources.nvml import NvmlSource, load_pynvml
from tests.conftest import eight_gpus, wait_for
from tests.integration.test_nvml import judge, source

GPU5 = "GPU-fa4e0000-0000-0000-0000-000000000005"


def of(observations, signal, index):
    return [o for o in observations if o.signal is signal and o.gpu is not None and o.gpu.index == index]


def started(memory=None, clock=None, reprobe_seconds=600.0) -> NvmlSource:
    nvml = NvmlSource(load_pynvml(), poll_seconds=0.05, call_timeout_seconds=2.0, event_wait_ms=50,
                      memory=memory, reprobe_seconds=reprobe_seconds, **({"clock": clock} if clock else {}))
    nvml.start()
    return nvml


def test_reset_required_is_a_fatal_reset(fake_nvml):
    """NVML_ERROR_RESET_REQUIRED on a GPU's calls: the GPU needs a reset, it is not healthy."""
    fake_nvml.write(eight_gpus(**{"3": {"fail_all": 16}}))
    nvml = source()
    try:
        observations = nvml.poll()
        [required] = of(observations, Signal.RESET_REQUIRED, 3)
        assert required.value == 1
        verdicts, pipeline = judge(observations)
        assert [(v.rule_id, v.action) for v in verdicts if v.gpu and v.gpu.index == 3] == [
            ("nvml-reset-required", "reset_gpu")]
        assert pipeline.gpu_statuses()[nvml.gpus[3].ref.key] == "fatal"
    finally:
        nvml.stop()


def test_a_gpu_whose_every_call_fails_is_unknown_not_healthy(fake_nvml):
    fake_nvml.write(eight_gpus(**{"2": {"fail_all": 999}}))
    nvml = source()
    try:
        observations = nvml.poll()
        [unreadable] = of(observations, Signal.SOURCE_UNREADABLE, 2)
        assert unreadable.value == 1 and "no NVML reading succeeded" in unreadable.attrs["message"]
        _, pipeline = judge(observations)
        assert pipeline.gpu_statuses()[nvml.gpus[2].ref.key] == "unknown"
    finally:
        nvml.stop()


def test_an_absurd_threshold_is_ignored_not_trusted(fake_nvml):
    """A shutdown threshold of 0 C would drain a GPU at room temperature: it is ignored with a warning."""
    fake_nvml.write(eight_gpus(**{"1": {"thresholds": {"shutdown": 0, "slowdown": 90, "mem_max": 95}}}))
    nvml = source()
    try:
        observations = nvml.poll()
        assert nvml.gpus[1].shutdown_c is None and nvml.gpus[1].readings["ignored_thresholds"] == {"shutdown": 0}
        verdicts, _ = judge(observations)
        assert [v for v in verdicts if v.gpu and v.gpu.index == 1] == []
    finally:
        nvml.stop()


def test_not_supported_is_probed_again_when_mig_mode_changes(fake_nvml):
    """Remapped rows are NotSupported while MIG is on; once it is off they are read again at the next poll."""
    fake_nvml.write(eight_gpus(**{"4": {"mig_mode": 1, "remapped_rows": None}}))
    nvml = source()
    try:
        nvml.poll()
        assert "nvmlDeviceGetRemappedRows" in nvml.gpus[4].unsupported
        fake_nvml.write(eight_gpus(**{"4": {"mig_mode": 0, "remapped_rows": {"pending": 1}}}))
        [pending] = of(nvml.poll(), Signal.ROW_REMAP_PENDING, 4)
        assert pending.value == 1
    finally:
        nvml.stop()


def test_not_supported_is_probed_again_periodically(fake_nvml):
    now = [1000.0]
    fake_nvml.write(eight_gpus(**{"4": {"remapped_rows": None}}))
    nvml = started(clock=lambda: now[0], reprobe_seconds=600)
    try:
        nvml.poll()
        fake_nvml.write(eight_gpus(**{"4": {"remapped_rows": {"pending": 1}}}))
        assert of(nvml.poll(), Signal.ROW_REMAP_PENDING, 4) == []
        now[0] += 600
        assert [o.value for o in of(nvml.poll(), Signal.ROW_REMAP_PENDING, 4)] == [1]
    finally:
        nvml.stop()


def test_the_sram_threshold_flag_marks_the_gpu_for_replacement(fake_nvml):
    fake_nvml.write(eight_gpus(**{"6": {"sram": {"threshold_exceeded": 1, "volatile_unc_parity": 2}}}))
    nvml = source()
    try:
        observations = nvml.poll()
        [sram] = of(observations, Signal.SRAM_THRESHOLD_EXCEEDED, 6)
        assert (sram.value, sram.attrs["volatile_uncorrected"]) == (1, 2)
        verdicts, _ = judge(observations)
        assert ("sram-threshold-exceeded", "replace_gpu") in {(v.rule_id, v.action) for v in verdicts}
    finally:
        nvml.stop()


def test_an_xid_64_while_the_remap_state_is_unreadable_is_a_replacement_candidate(fake_nvml):
    fake_nvml.write(eight_gpus(**{"5": {"mig_mode": 1, "remapped_rows": None}}))
    nvml = NvmlSource(load_pynvml(), poll_seconds=0.05, event_wait_ms=50)
    seen, stop = [], threading.Event()
    thread = threading.Thread(target=nvml.run, args=(seen.append, stop), daemon=True)
    thread.start()
    try:
        assert nvml.ready.wait(5) and wait_for(lambda: any(o.signal is Signal.ROW_REMAP_PENDING for o in seen))
        state = eight_gpus(**{"5": {"mig_mode": 1, "remapped_rows": None}})
        state["events"] = [{"id": 1, "gpu": 5, "type": 8, "data": 64}]
        fake_nvml.write(state)
        assert wait_for(lambda: any(o.signal is Signal.XID for o in seen))
        [xid] = [o for o in seen if o.signal is Signal.XID]
        assert xid.attrs["remap_state"] == "unreadable"
        verdicts, _ = judge([xid])
        assert "xid-64-remap-state-unreadable" in {v.rule_id for v in verdicts}
    finally:
        stop.set()
        thread.join(5)


def test_a_gpu_the_node_had_before_and_is_missing_now_is_fatal(fake_nvml, tmp_path):
    """The inventory survives the restart (a file in the state directory); after the boot GPU 5 is gone."""
    memory = JsonFileMemory(tmp_path / "nvml-memory.json")
    first = started(memory=memory)
    first.stop()
    state = eight_gpus()
    state["gpus"] = [g for g in state["gpus"] if g["uuid"] != GPU5]
    fake_nvml.write(state)
    after_boot = started(memory=JsonFileMemory(tmp_path / "nvml-memory.json"))
    try:
        observations = after_boot.poll()
        [missing] = [o for o in observations if o.signal is Signal.GPU_MISSING and o.value == 1]
        assert missing.gpu.uuid == GPU5
        verdicts, _ = judge(observations)
        assert [(v.rule_id, v.severity) for v in verdicts if v.gpu_key == GPU5] == [("gpu-missing", "fatal")]
    finally:
        after_boot.stop()


def test_a_missing_gpu_released_by_an_operator_is_forgotten(fake_nvml):
    memory = InMemory()
    started(memory=memory).stop()
    state = eight_gpus()
    state["gpus"] = [g for g in state["gpus"] if g["uuid"] != GPU5]
    fake_nvml.write(state)
    nvml = started(memory=memory)
    try:
        nvml.forget_gpu(GPU5)
        assert [o for o in nvml.poll() if o.signal is Signal.GPU_MISSING and o.value == 1] == []
        assert GPU5 not in {g["uuid"] for g in memory.load("nvml.inventory")}
    finally:
        nvml.stop()


def test_a_link_seen_up_before_a_restart_and_down_after_it_is_down(fake_nvml):
    """The NVLink baseline survives the restart: link 3 was up, now it is down, and that is a reading."""
    memory = InMemory()
    first = started(memory=memory)
    first.poll()
    first.stop()
    fake_nvml.write(eight_gpus(**{"0": {"nvlink": {"links": 18, "down": [3]}}}))
    after = started(memory=memory)
    try:
        [down] = of(after.poll(), Signal.NVLINK_DOWN, 0)
        assert (down.value, down.attrs["links"]) == (1, "3")
    finally:
        after.stop()


def test_the_agents_nvml_source_remembers_the_node_in_its_state_directory(fake_nvml, tmp_path):
    """The daemon gives NVML a memory beside the journal (the hostPath), so "GPU missing" survives a reboot."""
    from agent.config import load_config
    from agent.discovery import SourceContext, discover_sources
    from agent.journal import Journal

    config = load_config(None, env={"NODE_NAME": "n", "GPU_HEALTH_JOURNAL_PATH": str(tmp_path / "state" / "j.db"),
                                    "GPU_HEALTH_SOURCES__KMSG__ENABLED": "off",
                                    "GPU_HEALTH_SOURCES__DCGM__ENABLED": "off"})
    journal = Journal(config.journal_path)
    [probe] = [p for p in discover_sources(SourceContext(config, journal, lambda *a: None)) if p.name == "nvml"]
    assert probe.source is not None, probe.why_not
    probe.source.start()
    probe.source.stop()
    journal.close()
    assert GPU5 in {g["uuid"] for g in JsonFileMemory(tmp_path / "state" / "nvml-memory.json").load("nvml.inventory")}


def test_an_operator_release_of_a_missing_gpu_sticks_in_the_running_agent(fake_nvml, tmp_path):
    """Released, the missing GPU is forgotten by the agent's NVML source: the next poll does not raise it."""
    from prometheus_client import CollectorRegistry

    from agent.config import load_config
    from agent.daemon import Daemon
    from agent.engine import builtin_rules_dir, load_rules
    from agent.model import GpuRef, Observation

    config = load_config(None, env={"NODE_NAME": "n", "GPU_HEALTH_JOURNAL_PATH": str(tmp_path / "j.db"),
                                    "GPU_HEALTH_SOURCES__KMSG__ENABLED": "off",
                                    "GPU_HEALTH_SOURCES__DCGM__ENABLED": "off"})
    started(memory=JsonFileMemory(tmp_path / "nvml-memory.json")).stop()  # the node had 8 GPUs
    state = eight_gpus()
    state["gpus"] = [g for g in state["gpus"] if g["uuid"] != GPU5]
    fake_nvml.write(state)  # after a reboot GPU 5 is gone
    daemon = Daemon(config, rules=load_rules(builtin_rules_dir()), registry=CollectorRegistry())
    [nvml] = daemon.sources
    nvml.start()
    try:
        for observation in nvml.poll():
            daemon.pipeline.handle(observation)
        assert daemon.pipeline.gpu_statuses()[GPU5] == "fatal"
        daemon.pipeline.handle(Observation(Signal.OPERATOR_RELEASE, 1, time.time(), "operator", GpuRef(uuid=GPU5)))
        for observation in nvml.poll():
            daemon.pipeline.handle(observation)
        assert daemon.pipeline.gpu_statuses().get(GPU5) != "fatal"
    finally:
        nvml.stop()
        daemon.journal.close()


def test_each_poll_of_a_gpu_ends_with_the_readings_that_verify_a_reset(fake_nvml):
    """gpu_polled carries the recovery action, pending remap and retirement, volatile DBE of one poll."""
    fake_nvml.write(eight_gpus(**{"2": {"remapped_rows": {"pending": 1}, "ecc": {"dbe_volatile": 2}}}))
    nvml = source()
    try:
        observations = nvml.poll()
        [dirty] = of(observations, Signal.GPU_POLLED, 2)
        assert (dirty.attrs["remap_pending"], dirty.attrs["volatile_dbe"], dirty.attrs["recovery_action"]) == (1, 2, 0)
        [clean] = of(observations, Signal.GPU_POLLED, 0)
        assert (clean.attrs["remap_pending"], clean.attrs["volatile_dbe"], clean.attrs["recovery_action"]) == (0, 0, 0)
    finally:
        nvml.stop()


def test_a_gpu_that_cannot_be_read_gives_no_poll_that_could_verify_a_reset(fake_nvml):
    """A GPU whose calls all fail yields no gpu_polled: an unreadable GPU never verifies a reset."""
    fake_nvml.write(eight_gpus(**{"3": {"fail_all": 16}}))
    nvml = source()
    try:
        assert of(nvml.poll(), Signal.GPU_POLLED, 3) == []
    finally:
        nvml.stop()
