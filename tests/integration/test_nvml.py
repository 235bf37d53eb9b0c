"""The NVML source on the real pynvml, through the fake libnvidia-ml.so.1 built from tests/fakenvml."""

import contextlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agent.engine import builtin_rules_dir, load_rules
from agent.model import NodeInventory, Signal
from agent.pipeline import Pipeline
from agent.remediation import GuardPolicy, Mode
from agent.sources.attribution import gpus_by_pod_uid
from agent.sources.nvml import NvmlSource, load_pynvml, probe_calls
from tests.conftest import FAKE_NVML_DIR, eight_gpus, wait_for

RULES = load_rules(builtin_rules_dir())


def source(timeout: float = 2.0) -> NvmlSource:
    nvml_source = NvmlSource(load_pynvml(), poll_seconds=0.05, call_timeout_seconds=timeout, event_wait_ms=50)
    nvml_source.start()
    return nvml_source


def judge(observations):
    pipeline = Pipeline(rules=RULES, inventory=NodeInventory("n"), policy=GuardPolicy(mode=Mode.OBSERVE),
                        clock=lambda: 0.0)
    verdicts = []
    for o in observations:
        verdicts += pipeline.handle(o, o.at).verdicts
    return verdicts, pipeline


def test_a_healthy_eight_gpu_node_is_healthy(fake_nvml):
    nvml = source()
    try:
        assert [g.ref.index for g in nvml.gpus] == list(range(8))
        assert nvml.gpus[3].ref.uuid == "GPU-fa4e0000-0000-0000-0000-000000000003"
        assert nvml.gpus[3].ref.pci_bus_id == "00000000:48:00.0"
        verdicts, pipeline = judge(nvml.poll() + nvml.poll())
        assert [v for v in verdicts if v.severity.rank > 1] == []
        assert set(pipeline.gpu_statuses().values()) == {"healthy"}
    finally:
        nvml.stop()


def test_a_dbe_increment_between_polls_is_fatal(fake_nvml):
    nvml = source()
    try:
        first = nvml.poll()
        fake_nvml.write(eight_gpus(**{"5": {"ecc": {"dbe_volatile": 1, "dbe_aggregate": 4,
                                                     "locations": {"2": 1}}}}))
        second = nvml.poll()
        [dbe_reading] = [o for o in second if o.signal is Signal.ECC_DBE]
        assert (dbe_reading.attrs["aggregate_total"], dbe_reading.attrs["dbe_dram"]) == (4, 1)
        verdicts, _ = judge(first + second)
        [dbe] = [v for v in verdicts if v.rule_id == "ecc-dbe"]
        assert (dbe.severity, dbe.gpu.index) == ("fatal", 5)
    finally:
        nvml.stop()


def test_correctable_errors_become_counted_deltas(fake_nvml):
    nvml = source()
    try:
        nvml.poll()
        fake_nvml.write(eight_gpus(**{"2": {"ecc": {"sbe_volatile": 40}}}))
        [sbe] = [o for o in nvml.poll() if o.signal is Signal.ECC_SBE]
        assert (sbe.value, sbe.count, sbe.gpu.index) == (40, 40, 2)
    finally:
        nvml.stop()


def test_a_pending_row_remap_is_degraded_not_fatal(fake_nvml):
    fake_nvml.write(eight_gpus(**{"2": {"remapped_rows": {"pending": 1, "unc": 1}}}))
    nvml = source()
    try:
        verdicts, _ = judge(nvml.poll())
        [remap] = [v for v in verdicts if v.rule_id == "row-remap-pending"]
        assert (remap.severity, remap.action, remap.gpu.index) == ("degraded", "reset_when_idle", 2)
    finally:
        nvml.stop()


def test_an_xid_79_event_arrives_without_polling(fake_nvml):
    nvml = NvmlSource(load_pynvml(), poll_seconds=3600, event_wait_ms=50)
    seen, stop = [], threading.Event()
    thread = threading.Thread(target=nvml.run, args=(seen.append, stop), daemon=True)
    thread.start()
    try:
        assert nvml.ready.wait(5)
        state = eight_gpus()
        state["events"] = [{"id": 1, "gpu": 4, "type": 8, "data": 79}]
        fake_nvml.write(state)
        assert wait_for(lambda: any(o.signal is Signal.XID for o in seen))
        [xid] = [o for o in seen if o.signal is Signal.XID]
        assert (xid.value, xid.gpu.index, xid.source) == (79, 4, "nvml-event")
        verdicts, _ = judge([xid])
        assert verdicts[0].rule_id == "xid-79"
    finally:
        stop.set()
        thread.join(5)


def test_a_mig_event_carries_the_instance_and_the_parent_gpu(fake_nvml):
    nvml = NvmlSource(load_pynvml(), poll_seconds=3600, event_wait_ms=50)
    seen, stop = [], threading.Event()
    thread = threading.Thread(target=nvml.run, args=(seen.append, stop), daemon=True)
    state = eight_gpus(**{"1": {"mig_mode": 1}})
    fake_nvml.write(state)
    thread.start()
    try:
        assert nvml.ready.wait(5)
        state["events"] = [{"id": 7, "gpu": 1, "type": 8, "data": 31, "gi": 3, "ci": 0}]
        fake_nvml.write(state)
        assert wait_for(lambda: any(o.signal is Signal.XID for o in seen))
        [xid] = [o for o in seen if o.signal is Signal.XID]
        assert (xid.gpu.mig_gpu_instance, xid.gpu.mig_compute_instance) == (3, 0)
        assert xid.gpu.key == "GPU-fa4e0000-0000-0000-0000-000000000001"
    finally:
        stop.set()
        thread.join(5)


def test_a_lost_gpu_is_its_own_fatal_observation(fake_nvml):
    nvml = source()
    try:
        nvml.poll()
        fake_nvml.write(eight_gpus(**{"6": {"lost": True}}))
        observations = nvml.poll()
        lost = [o for o in observations if o.signal is Signal.GPU_LOST]
        assert [o.gpu.index for o in lost] == [6]
        verdicts, _ = judge(observations)
        assert [v.rule_id for v in verdicts if v.severity == "fatal"] == ["gpu-lost"]
    finally:
        nvml.stop()


def test_driver_not_loaded_is_a_clear_error(fake_nvml):
    fake_nvml.write({"driver_loaded": False, "gpus": []})
    nvml = NvmlSource(load_pynvml())
    with pytest.raises(load_pynvml().NVMLError, match="Driver Not Loaded"):
        nvml.start()
    nvml.caller.close()


def test_a_hanging_call_makes_the_gpu_unknown_and_never_a_fault(fake_nvml):
    fake_nvml.write(eight_gpus(**{"5": {"hang": ["nvmlDeviceGetPowerUsage"]}}))
    nvml = source(timeout=0.3)
    try:
        observations = nvml.poll()
        unreadable = [o for o in observations if o.signal is Signal.SOURCE_UNREADABLE and o.value == 1]
        assert [o.gpu.index for o in unreadable] == [5]
        assert "timed out" in str(unreadable[0].attrs["message"])
        verdicts, pipeline = judge(observations)
        assert {str(v.severity) for v in verdicts if v.gpu.index == 5} == {"unknown"}
        assert pipeline.gpu_statuses()["GPU-fa4e0000-0000-0000-0000-000000000005"] == "unknown"
        assert [o.gpu.index for o in observations if o.signal is Signal.TEMPERATURE] == list(range(8))
        fake_nvml.write(eight_gpus())
        assert wait_for(lambda: nvml.caller.hung == 0, timeout=5)
        healthy = [o for o in nvml.poll() if o.signal is Signal.SOURCE_UNREADABLE and o.gpu.index == 5]
        assert healthy[0].value == 0
    finally:
        nvml.stop()


def test_not_supported_is_remembered_per_gpu_and_call(fake_nvml):
    nvml = source()
    try:
        nvml.poll()
        assert {"retired.sbe", "retired.dbe", "retired.pending"} <= nvml.gpus[0].unsupported
        assert "errors" not in nvml.gpus[0].readings
    finally:
        nvml.stop()


def test_an_nvlink_that_was_up_and_went_down_is_counted(fake_nvml):
    nvml = source()
    try:
        nvml.poll()
        fake_nvml.write(eight_gpus(**{"0": {"nvlink": {"links": 18, "down": [3, 7]}}}))
        [down] = [o for o in nvml.poll() if o.signal is Signal.NVLINK_DOWN and o.gpu.index == 0]
        assert (down.value, down.attrs["links"]) == (2, "3,7")
    finally:
        nvml.stop()


def test_a_link_down_since_boot_that_nothing_judges_gives_no_reading_never_a_healthy_one(fake_nvml):
    """No baseline for link 3, a model that names no link count (a PCIe card) and no peer of its model: the agent
    cannot tell, so no NVLink reading at all, neither down nor healthy."""
    fake_nvml.write(eight_gpus(**{"0": {"nvlink": {"links": 18, "down": [3]}, "name": "NVIDIA H100 PCIe"}}))
    nvml = source()
    try:
        assert [o for o in nvml.poll() if o.signal is Signal.NVLINK_DOWN and o.gpu.index == 0] == []
        assert nvml.gpus[0].readings["nvlinks_without_baseline"] == 1
    finally:
        nvml.stop()


def first_poll_links(fake_nvml, **overrides):
    """GPU 0's NVLink reading at the first poll of a node with no remembered baseline (a first boot)."""
    fake_nvml.write(eight_gpus(**overrides))
    nvml = source()
    try:
        readings = [o for o in nvml.poll() if o.signal is Signal.NVLINK_DOWN and o.gpu.index == 0]
        return readings, nvml.gpus[0].readings
    finally:
        nvml.stop()


def test_a_first_boot_with_12_of_18_links_trained_is_judged_by_the_model(fake_nvml):
    """An H100 SXM has 18 NVLinks on its baseboard: six that never came up are six short, with no baseline."""
    [links], readings = first_poll_links(fake_nvml, **{"0": {"nvlink": {"links": 18, "down": list(range(12, 18))}}})
    assert (links.value, links.attrs["untrained"], links.attrs["expected"], links.attrs["expected_from"]) == (
        6, 6, 18, "model")
    assert readings["nvlinks_down"] == list(range(12, 18))  # what the reset's clean poll must see up again


def test_links_not_trained_while_the_gpu_has_not_registered_with_the_fabric_are_not_judged(fake_nvml):
    """Fabric Manager not started at boot: no link trains, and fabric-not-registered says why; the links are not
    a fault of their own (a reset could not train them)."""
    fake_nvml.write(eight_gpus(**{"0": {"nvlink": {"links": 18, "down": list(range(18))}, "fabric": {"state": 1}}}))
    nvml = source()
    try:
        nvml.poll()  # the first poll reads the fabric after the links
        assert [o for o in nvml.poll() if o.signal is Signal.NVLINK_DOWN and o.gpu.index == 0] == []
    finally:
        nvml.stop()


def test_a_board_of_an_unlisted_model_is_judged_against_its_peers(fake_nvml):
    """A new board (no baseline) of a model the table does not name: its peers on the node have 18 links up."""
    model = {"name": "NVIDIA Future SXM"}
    overrides = {str(i): dict(model) for i in range(8)}
    overrides["7"]["nvlink"] = {"links": 18, "down": [0, 1, 2, 3, 4, 5]}
    fake_nvml.write(eight_gpus(**overrides))
    nvml = source()
    try:
        nvml.poll()  # every GPU's links read once: the peers' baselines
        [links] = [o for o in nvml.poll() if o.signal is Signal.NVLINK_DOWN and o.gpu.index == 7]
        assert (links.value, links.attrs["expected"], links.attrs["expected_from"]) == (6, 18, "peers")
    finally:
        nvml.stop()


def test_a_pcie_gpu_with_no_link_up_stays_unjudged(fake_nvml):
    """PCIe cards without bridges: every link inactive on every GPU, no model count, no peer with a link: nothing."""
    pcie = {"name": "NVIDIA H100 PCIe", "nvlink": {"links": 18, "down": list(range(18))}}
    readings, _ = first_poll_links(fake_nvml, **{str(i): dict(pcie) for i in range(8)})
    assert readings == []


def test_the_probe_lists_every_call(fake_nvml):
    nvml = source()
    try:
        results = probe_calls(nvml)
        assert ("nvmlDeviceGetRetiredPages(DBE)", "NotSupported") in [(c, s) for i, c, s in results if i == 0]
        assert ("nvmlDeviceGetRemappedRows", "supported") in [(c, s) for i, c, s in results if i == 0]
    finally:
        nvml.stop()


def _agent_env(tmp_path: Path, state: Path) -> dict[str, str]:
    return dict(os.environ, LD_LIBRARY_PATH=str(FAKE_NVML_DIR), FAKE_NVML_STATE=str(state),
                GPU_HEALTH_SOURCES__KMSG__ENABLED="off", GPU_HEALTH_JOURNAL_PATH=str(tmp_path / "j.db"),
                GPU_HEALTH_HTTP__HOST="127.0.0.1", NODE_NAME="nvml-node",
                KUBECONFIG="/nonexistent/kubeconfig")


def test_check_json_reports_every_gpu_with_status_and_why(fake_nvml, tmp_path: Path):
    fake_nvml.write(eight_gpus(**{"1": {"temp": 93}, "3": {"ecc": {"dbe_volatile": 1}}}))
    env = _agent_env(tmp_path, fake_nvml.path)
    result = subprocess.run([sys.executable, "-m", "agent", "check", "--json"], env=env, capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 2, result.stderr  # CRITICAL: a GPU is fatal
    document = json.loads(result.stdout)
    statuses = {g["index"]: g["status"] for g in document["gpus"]}
    assert statuses == {0: "healthy", 1: "fatal", 2: "healthy", 3: "fatal", 4: "healthy", 5: "healthy",
                        6: "healthy", 7: "healthy"}
    gpu3 = document["gpus"][3]
    assert gpu3["uuid"] == "GPU-fa4e0000-0000-0000-0000-000000000003"
    assert [v["rule_id"] for v in gpu3["verdicts"]] == ["ecc-dbe"]
    assert gpu3["readings"]["temperature_c"] == 38


@contextlib.contextmanager
def _running_agent(tmp_path: Path, state: Path, gpu: str) -> Iterator[Callable[[str], bool]]:
    """An agent run on the fake library (polling every 0.2 s); yields `status_is(status)`: whether its /metrics
    gives the GPU `gpu` names (its labels, as dcgm-exporter's) that gpu_health_gpu_status now."""
    from tests.conftest import served_port
    from tests.integration.test_daemon import get
    env = _agent_env(tmp_path, state) | {"GPU_HEALTH_SOURCES__NVML__POLL_SECONDS": "0.2"}
    log = tmp_path / "agent.log"
    with log.open("w") as sink:
        process = subprocess.Popen([sys.executable, "-m", "agent", "run", "--port", "0", "--duration", "60"],
                                   env=env, stdout=sink, stderr=subprocess.STDOUT, text=True)
    try:
        port = served_port(log)

        def status_is(status: str) -> bool:
            try:
                body = get(f"http://127.0.0.1:{port}/metrics")[1]
            except OSError:
                return False
            return f'gpu_health_gpu_status{{{gpu},status="{status}"}} 1.0' in body  # labels sorted by name

        yield status_is
    finally:
        process.terminate()
        process.wait(timeout=15)


#: GPU 2 of the fake library, labelled as dcgm-exporter labels it.
GPU2 = ('Hostname="nvml-node",UUID="GPU-fa4e0000-0000-0000-0000-000000000002",gpu="2",'
        'modelName="NVIDIA H100 80GB HBM3",pci_bus_id="00000000:38:00.0"')


def test_the_running_agent_sees_a_state_change(fake_nvml, tmp_path: Path):
    with _running_agent(tmp_path, fake_nvml.path, GPU2) as status_is:
        assert wait_for(lambda: status_is("healthy"), timeout=30), (tmp_path / "agent.log").read_text()
        fake_nvml.write(eight_gpus(**{"2": {"ecc": {"dbe_volatile": 3}}}))
        assert wait_for(lambda: status_is("fatal"), timeout=30), (tmp_path / "agent.log").read_text()


def test_the_running_agent_shows_a_gpu_whose_every_call_fails_as_unknown(fake_nvml, tmp_path: Path):
    """Issue 41 row 16: NVML_ERROR_UNKNOWN from every call of GPU 2 (field values too, in each field, as NVML
    answers them): gpu_health_gpu_status says unknown, never healthy."""
    with _running_agent(tmp_path, fake_nvml.path, GPU2) as status_is:
        assert wait_for(lambda: status_is("healthy"), timeout=30), (tmp_path / "agent.log").read_text()
        fake_nvml.write(eight_gpus(**{"2": {"fail_all": 999}}))
        assert wait_for(lambda: status_is("unknown"), timeout=30), (tmp_path / "agent.log").read_text()


def test_dbe_page_retirements_of_the_last_week_are_counted(fake_nvml):
    import time as clock
    now = clock.time()
    old, recent = now - 30 * 86400, now - 3600
    pages = {"sbe": 0, "dbe": 17, "pending": 0, "dbe_timestamps": [old] * 15 + [recent, recent]}
    fake_nvml.write(eight_gpus(**{"4": {"retired_pages": pages}}))
    nvml = source()
    try:
        [retired] = [o for o in nvml.poll() if o.signal is Signal.RETIRED_PAGES]
        assert (retired.gpu.index, retired.value, retired.attrs["dbe_new_last_week"]) == (4, 17, 2)
        verdicts, _ = judge([retired])
        assert [v.rule_id for v in verdicts] == ["retired-pages-dbe-soft-limit"]
    finally:
        nvml.stop()


def test_running_processes_are_charged_to_their_pods(fake_nvml, tmp_path: Path):
    uid = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"
    (tmp_path / "4242").mkdir()
    (tmp_path / "4242" / "cgroup").write_text(f"0::/kubepods/burstable/pod{uid}/{'c' * 64}\n")
    fake_nvml.write(eight_gpus(**{"6": {"processes": [4242, 999999]}}))
    nvml = source()
    try:
        nvml.poll()
        assert nvml.pids_by_gpu()["GPU-fa4e0000-0000-0000-0000-000000000006"] == [4242, 999999]
        assert gpus_by_pod_uid(nvml.pids_by_gpu(), tmp_path) == {uid: ["GPU-fa4e0000-0000-0000-0000-000000000006"]}
    finally:
        nvml.stop()


def test_the_processes_on_a_gpu_are_read_live_for_a_reset_compute_and_graphics(fake_nvml):
    """The reset's view of who runs on the GPU: NVML's compute and graphics lists now, not the last poll's."""
    fake_nvml.write(eight_gpus())
    nvml = source()
    try:
        uuid = "GPU-fa4e0000-0000-0000-0000-000000000006"
        assert nvml.processes_on(uuid) == []
        fake_nvml.write(eight_gpus(**{"6": {"processes": [4343, 4242], "graphics_processes": [4242, 77]}}))
        assert nvml.processes_on(uuid) == [77, 4242, 4343]
        assert nvml.processes_on("GPU-00000000-0000-0000-0000-00000000dead") == []
    finally:
        nvml.stop()


def test_a_mig_gpu_names_its_mig_devices(fake_nvml):
    fake_nvml.write(eight_gpus(**{"1": {"mig_mode": 1, "mig_devices": ["MIG-aaaa", "MIG-bbbb"]}}))
    nvml = source()
    try:
        assert nvml.mig_parents() == {"MIG-aaaa": "GPU-fa4e0000-0000-0000-0000-000000000001",
                                      "MIG-bbbb": "GPU-fa4e0000-0000-0000-0000-000000000001"}
    finally:
        nvml.stop()


def test_nvml_let_go_for_a_reset_reads_nothing_and_reads_and_waits_for_events_again_after(fake_nvml):
    """The GPU reset's seam: released, no poll touches NVML; reacquired, polls and events resume."""
    nvml = NvmlSource(load_pynvml(), poll_seconds=3600, event_wait_ms=50)
    seen, stop = [], threading.Event()
    thread = threading.Thread(target=nvml.run, args=(seen.append, stop), daemon=True)
    thread.start()
    try:
        assert nvml.ready.wait(5)
        nvml.release_for_reset()
        assert nvml.poll() == []
        nvml.reacquire_after_reset()
        assert len([o for o in nvml.poll() if o.signal is Signal.GPU_POLLED]) == 8
        state = eight_gpus()
        state["events"] = [{"id": 1, "gpu": 4, "type": 8, "data": 79}]
        fake_nvml.write(state)
        assert wait_for(lambda: any(o.signal is Signal.XID for o in seen))
    finally:
        stop.set()
        thread.join(5)


def test_the_daemon_hands_the_cluster_side_nvml_processes_charged_through_the_hosts_proc(fake_nvml, tmp_path: Path):
    """Built by the daemon, the pod finder charges NVML's host PIDs through the configured host /proc."""
    from functools import partial

    from prometheus_client import CollectorRegistry

    from agent.cluster_side import build_cluster_side
    from agent.config import load_config
    from agent.daemon import Daemon
    from agent.k8s.client import client_for
    from tests.k8s_helpers import RULES, start_cluster

    uid = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"
    host_proc = tmp_path / "host-proc"
    (host_proc / "4242").mkdir(parents=True)
    (host_proc / "4242" / "cgroup").write_text(f"0::/kubepods/burstable/pod{uid}/{'c' * 64}\n")
    fake_nvml.write(eight_gpus(**{"6": {"processes": [4242]}}))
    _cluster, server = start_cluster()
    config = load_config(None, env={"NODE_NAME": "n1", "GPU_HEALTH_JOURNAL_PATH": str(tmp_path / "j.db"),
                                    "GPU_HEALTH_SOURCES__KMSG__PROC_ROOT": str(host_proc)})
    nvml = source()
    try:
        nvml.poll()
        daemon = Daemon(config, rules=RULES, sources=[nvml], registry=CollectorRegistry(),
                        cluster_of=partial(build_cluster_side, client_for(server.url), config,
                                           on_stuck=lambda pod: None))
        assert daemon.cluster is not None and daemon.cluster.pods.gpus_by_pod_uid is not None
        assert daemon.cluster.pods.gpus_by_pod_uid() == {uid: ["GPU-fa4e0000-0000-0000-0000-000000000006"]}
        daemon.journal.close()
    finally:
        nvml.stop()
        server.stop()
