"""A GPU whose readings all fail, or whose calls hang, is Unknown on its own: the other GPUs keep being read."""

from agent.model import Action, NodeInventory, Signal
from agent.pipeline import Pipeline
from agent.remediation import GuardPolicy, Mode
from agent.sources.nvml import NvmlSource, load_pynvml
from tests.conftest import eight_gpus, wait_for
from tests.integration.test_nvml import RULES, judge, source

#: Every call of the fake library that returns a health reading (identity, MIG layout, limits,
#: utilisation and the process list are auxiliary: they may still answer on a GPU that reads nothing).
READING_CALLS = [
    "nvmlDeviceGetTemperatureV", "nvmlDeviceGetTemperature", "nvmlDeviceGetFieldValues", "nvmlDeviceGetPowerUsage",
    "nvmlDeviceGetEnforcedPowerLimit", "nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetEccMode",
    "nvmlDeviceGetTotalEccErrors", "nvmlDeviceGetMemoryErrorCounter", "nvmlDeviceGetSramEccErrorStatus",
    "nvmlDeviceGetRetiredPages", "nvmlDeviceGetRetiredPages_v2", "nvmlDeviceGetRetiredPagesPendingStatus",
    "nvmlDeviceGetRemappedRows", "nvmlDeviceGetNvLinkState", "nvmlDeviceGetCurrPcieLinkWidth",
    "nvmlDeviceGetCurrPcieLinkGeneration", "nvmlDeviceGetGpuFabricInfoV"]
UNKNOWN = 999


def unreadable_of(observations, index):
    return [o.value for o in observations if o.signal is Signal.SOURCE_UNREADABLE and o.gpu.index == index]


def test_a_gpu_none_of_whose_readings_succeed_is_unknown_though_it_still_names_itself(fake_nvml):
    """NVML_ERROR_UNKNOWN on every reading, the handle, MIG mode and process list still answering: Unknown."""
    nvml = source()
    try:
        nvml.poll()
        fake_nvml.write(eight_gpus(**{"2": {"errors": dict.fromkeys(READING_CALLS, UNKNOWN)}}))
        observations = nvml.poll()
        assert unreadable_of(observations, 2) == [1]
        verdicts, pipeline = judge(observations)
        assert [(v.rule_id, str(v.severity)) for v in verdicts if v.gpu.index == 2] == [
            ("source-unreadable", "unknown")]
        assert pipeline.gpu_statuses()[nvml.gpus[2].ref.key] == "unknown"
        assert [o for o in observations if o.signal is Signal.GPU_POLLED and o.gpu.index == 2] == []
    finally:
        nvml.stop()


def test_field_values_whose_every_field_fails_are_a_failed_reading_though_the_call_answers(fake_nvml):
    """nvmlDeviceGetFieldValues answers NVML_SUCCESS with NVML_ERROR_UNKNOWN in every field: a failed call."""
    nvml = source()
    try:
        nvml.poll()
        fake_nvml.write(eight_gpus(**{"4": {"errors": {"nvmlDeviceGetFieldValues": UNKNOWN}}}))
        observations = nvml.poll()
        assert "Unknown" in nvml.gpus[4].readings["errors"]["nvmlDeviceGetFieldValues"]
        assert unreadable_of(observations, 4) == [0]  # its other readings still answer
        assert [o for o in observations if o.signal is Signal.RECOVERY_ACTION and o.gpu.index == 4] == []
    finally:
        nvml.stop()


def test_an_nvlink_state_that_cannot_be_read_is_no_reading_of_links_up(fake_nvml):
    """A failing nvmlDeviceGetNvLinkState never reads as "no link down"."""
    nvml = source()
    try:
        nvml.poll()
        fake_nvml.write(eight_gpus(**{"1": {"errors": {"nvmlDeviceGetNvLinkState": UNKNOWN}}}))
        observations = nvml.poll()
        assert [o for o in observations if o.signal is Signal.NVLINK_DOWN and o.gpu.index == 1] == []
        assert "nvmlDeviceGetNvLinkState" in nvml.gpus[1].readings["errors"]
    finally:
        nvml.stop()


def test_a_gpu_whose_calls_hang_is_unknown_and_the_other_seven_keep_being_read(fake_nvml):
    """Poll after poll, a hung GPU costs one thread: it is Unknown; the others stay read and healthy."""
    fake_nvml.write(eight_gpus(**{"5": {"hang": ["nvmlDeviceGetPowerUsage"]}}))
    nvml = source(timeout=0.2)
    try:
        for _ in range(12):  # more polls than the node-wide bound on hung calls (8)
            observations = nvml.poll()
            assert unreadable_of(observations, 5) == [1]
            assert all(unreadable_of(observations, i) == [0] for i in range(8) if i != 5)
            assert {o.gpu.index for o in observations if o.signal is Signal.TEMPERATURE} >= {0, 1, 2, 3, 4, 6, 7}
            assert nvml.caller.hung <= 1
        [message] = [o.attrs["message"] for o in observations if o.signal is Signal.SOURCE_UNREADABLE and o.value]
        assert "nvmlDeviceGetPowerUsage is still hung" in str(message)
        _, pipeline = judge(observations)
        statuses = pipeline.gpu_statuses()
        assert statuses[nvml.gpus[5].ref.key] == "unknown"
        assert {statuses[g.ref.key] for g in nvml.gpus if g.ref.index != 5} == {"healthy"}
        fake_nvml.write(eight_gpus())
        assert wait_for(lambda: nvml.caller.hung == 0, timeout=5)
        assert unreadable_of(nvml.poll(), 5) == [0]
    finally:
        nvml.stop()


def test_hung_calls_stay_bounded_in_all_when_every_gpu_hangs(fake_nvml):
    """Eight wedged GPUs cost at most eight threads, whatever the number of polls."""
    fake_nvml.write(eight_gpus(**{str(i): {"hang": ["nvmlDeviceGetPowerUsage"]} for i in range(8)}))
    nvml = source(timeout=0.1)
    try:
        for _ in range(3):
            observations = nvml.poll()
            assert [unreadable_of(observations, i) for i in range(8)] == [[1]] * 8
        assert nvml.caller.hung == 8
    finally:
        fake_nvml.write(eight_gpus())
        nvml.stop()


def test_a_gpu_that_hangs_while_it_is_discovered_is_unknown_and_the_others_are_found(fake_nvml):
    """nvmlDeviceGetUUID hung on GPU 5 at start: the source still starts, GPU 5 Unknown, the others healthy."""
    fake_nvml.write(eight_gpus(**{"5": {"hang": ["nvmlDeviceGetUUID"]}}))
    nvml = source(timeout=0.2)
    try:
        assert [bool(g.ref.uuid) for g in nvml.gpus] == [True] * 5 + [False] + [True] * 2
        observations = nvml.poll()
        [message] = [o.attrs["message"] for o in observations if o.signal is Signal.SOURCE_UNREADABLE and o.value]
        assert "nvmlDeviceGetUUID is still hung" in str(message)
        _, pipeline = judge(observations)
        statuses = pipeline.gpu_statuses()
        assert statuses[nvml.gpus[5].ref.key] == "unknown"
        assert {statuses[g.ref.key] for g in nvml.gpus if g.ref.index != 5} == {"healthy"}
    finally:
        fake_nvml.write(eight_gpus())
        nvml.stop()


def test_a_gpu_that_hangs_registering_for_events_leaves_the_others_their_events(fake_nvml):
    """nvmlDeviceGetSupportedEventTypes hung on GPU 2: an Xid on GPU 4 still arrives; the hang is GPU 2's."""
    import threading

    from agent.sources.nvml_events import watch_events

    nvml = source(timeout=0.2)
    seen, stop = [], threading.Event()
    try:
        state = eight_gpus(**{"2": {"hang": ["nvmlDeviceGetSupportedEventTypes"]}})
        state["events"] = [{"id": 1, "gpu": 4, "type": 8, "data": 79}]
        fake_nvml.write(state)
        thread = threading.Thread(target=watch_events, args=(nvml.calls, nvml.gpus, seen.append, stop),
                                  kwargs={"wait_ms": 50, "clock": lambda: 0.0}, daemon=True)
        thread.start()
        assert wait_for(lambda: any(o.signal is Signal.XID for o in seen), timeout=10)
        assert [(o.gpu.index, o.value) for o in seen if o.signal is Signal.XID] == [(4, 79)]
        assert nvml.caller.hung_for(nvml.gpus[2].caller_key) == 1  # charged to GPU 2: its polls wait for it
    finally:
        stop.set()
        fake_nvml.write(eight_gpus())
        nvml.stop()


def test_a_gpu_none_of_whose_calls_return_is_kept_from_new_work_not_only_unknown(fake_nvml):
    """Issue 41 row 10: every NVML call of GPU 5 hangs and no Xid is logged. Past 30 s of it the GPU is kept
    from new work and reset once idle (gpu-calls-hung), beside Unknown; the seven others stay healthy."""
    clock = [1000.0]
    nvml = NvmlSource(load_pynvml(), poll_seconds=0.05, call_timeout_seconds=0.2, event_wait_ms=50,
                      clock=lambda: clock[0])
    nvml.start()
    pipeline = Pipeline(rules=RULES, inventory=NodeInventory("n"), policy=GuardPolicy(mode=Mode.QUARANTINE),
                        clock=lambda: clock[0])
    try:
        fake_nvml.write(eight_gpus(**{"5": {"hang_all": True}}))
        for _ in range(5):  # a poll every 10 s: the first times out, the next four find the call still hung
            for observation in nvml.poll():
                pipeline.handle(observation, observation.at)
            clock[0] += 10.0
        hung = nvml.gpus[5].ref.key
        faults = {rule_id: f for (key, rule_id), f in pipeline.record.faults.items() if key == hung}
        assert set(faults) == {"source-unreadable", "gpu-calls-hung"}
        assert faults["gpu-calls-hung"].action is Action.QUARANTINE_RESET_WHEN_IDLE and pipeline.node.tainted
        statuses = pipeline.gpu_statuses()
        assert statuses[hung] == "degraded"
        assert {statuses[g.ref.key] for g in nvml.gpus if g.ref.index != 5} == {"healthy"}
    finally:
        fake_nvml.write(eight_gpus())
        nvml.stop()
