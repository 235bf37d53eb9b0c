"""Line -> observation: attribution to pods, forged records, storm deduplication."""

from pathlib import Path

from agent.model import Signal
from agent.sources.attribution import parse_cgroup, pod_of_pid
from agent.sources.dedup import Deduplicator
from agent.sources.kmsg import KernelLogProcessor
from tests.conftest import obs

POD_UID = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"
CONTAINER = "a" * 64
XID = "4,{seq},1000,-;NVRM: Xid (PCI:0000:3b:00): {code}, pid={pid}, name=python3, {msg}"


def test_cgroup_v1_cgroupfs_paths_name_the_pod_and_container():
    text = f"12:devices:/kubepods/burstable/pod{POD_UID}/{CONTAINER}\n"
    assert parse_cgroup(text).pod_uid == POD_UID
    assert parse_cgroup(text).container_id == CONTAINER


def test_cgroup_v2_systemd_paths_name_the_pod_and_container():
    uid = POD_UID.replace("-", "_")
    text = f"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{uid}.slice/" \
           f"cri-containerd-{CONTAINER}.scope\n"
    attribution = parse_cgroup(text)
    assert (attribution.pod_uid, attribution.container_id) == (POD_UID, CONTAINER)


def test_a_process_outside_kubernetes_has_no_pod():
    assert parse_cgroup("0::/system.slice/sshd.service\n") is None


def test_a_vanished_process_has_no_pod(tmp_path: Path):
    assert pod_of_pid(424242, tmp_path) is None


def fake_proc(tmp_path: Path, pid: int) -> Path:
    (tmp_path / str(pid)).mkdir()
    (tmp_path / str(pid) / "cgroup").write_text(f"0::/kubepods/pod{POD_UID}/{CONTAINER}\n")
    return tmp_path


def test_an_xid_with_a_pid_is_charged_to_its_pod(tmp_path: Path):
    processor = KernelLogProcessor(proc_root=fake_proc(tmp_path, 4321))
    [observation] = processor.handle(XID.format(seq=1, code=13, pid=4321, msg="Graphics Exception"), 5.0)
    assert (observation.signal, observation.value, observation.at) == (Signal.XID, 13, 5.0)
    assert observation.attrs["pod_uid"] == POD_UID
    assert observation.attrs["workload"] == POD_UID
    assert observation.attrs["container_id"] == CONTAINER


def test_without_a_pod_the_workload_is_the_process(tmp_path: Path):
    processor = KernelLogProcessor(proc_root=tmp_path)
    [observation] = processor.handle(XID.format(seq=1, code=13, pid=77, msg="x"), 0.0)
    assert observation.attrs["workload"] == "pid:77"
    assert "pod_uid" not in observation.attrs


def test_user_space_records_are_counted_as_forged_and_ignored():
    counted = []
    processor = KernelLogProcessor(count=lambda name, n: counted.append((name, n)))
    line = "12,9,1000,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=bash, injected"
    assert processor.handle(line, 0.0) == []
    assert counted == [("forged", 1)]
    assert processor.stats.forged == 1


def test_a_switch_admits_user_space_records_for_injection_tests():
    processor = KernelLogProcessor(admit_user_records=True)
    line = "12,9,1000,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=bash, injected"
    assert [o.value for o in processor.handle(line, 0.0)] == [79]


def test_the_banner_gives_the_observation_its_uuid():
    processor = KernelLogProcessor()
    processor.handle("6,1,1,-;NVRM: GPU at PCI:0000:3b:00: GPU-0f9a5c0e-1234-5678-9abc-def012345678", 0.0)
    [observation] = processor.handle(XID.format(seq=2, code=79, pid=1, msg="off the bus"), 0.0)
    assert observation.gpu.uuid == "GPU-0f9a5c0e-1234-5678-9abc-def012345678"
    assert observation.gpu.pci_bus_id == "0000:3b:00"


def test_an_sxid_is_a_node_level_observation():
    processor = KernelLogProcessor()
    [observation] = processor.handle("4,1,1,-;nvidia-nvswitch3: SXid (PCI:0000:06:00.0): 20034, Fatal, Link 48 x", 0)
    assert (observation.signal, observation.gpu, observation.attrs["severity"]) == (Signal.SXID, None, "fatal")


def test_a_storm_passes_the_first_record_and_counts_the_rest():
    processor = KernelLogProcessor(dedup_seconds=1.0)
    emitted = []
    for n in range(100_000):
        emitted += processor.handle(XID.format(seq=n, code=31, pid=9, msg="MMU Fault"), n * 1e-6)
    emitted += processor.flush(10.0)
    assert [o.count for o in emitted] == [1, 99_999]


def test_distinct_messages_are_not_merged():
    processor = KernelLogProcessor()
    first = processor.handle(XID.format(seq=1, code=13, pid=9, msg="GPC 0"), 0.0)
    second = processor.handle(XID.format(seq=2, code=13, pid=9, msg="GPC 1"), 0.0)
    assert len(first) == len(second) == 1


def test_the_deduplicator_bounds_its_memory():
    dedup = Deduplicator(window_seconds=60, max_keys=10)
    for n in range(1000):
        dedup.offer(n, obs(Signal.XID, 13), 0.0)
    assert len(dedup._bursts) == 10


def test_continuation_lines_emit_nothing():
    processor = KernelLogProcessor()
    processor.handle("4,1,1,-;nvidia-nvswitch3: SXid (PCI:0000:06:00.0): 20034, Fatal, Link 48 x", 0)
    assert processor.handle("4,2,1,-;nvidia-nvswitch3: SXid (PCI:0000:06:00.0): 20034, Data {0x0}", 0) == []
