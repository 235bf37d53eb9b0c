"""Line -> observation: attribution to pods, forged records, storm deduplication."""

from pathlib import Path

from agent.model import Signal
from agent.sources.attribution import parse_cgroup, pod_of_pid
from agent.sources.dedup import Deduplicator
from agent.sources.kmsg import FAILING_AFTER, KernelLogProcessor
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
    assert observation.attrs["workload"] == f"pod/{POD_UID}"
    assert observation.attrs["container_id"] == CONTAINER


def test_a_storm_of_new_pids_reads_proc_at_most_so_often_a_second(tmp_path: Path):
    """Past ATTRIBUTIONS_PER_SECOND /proc reads in a second the rest are charged to their process name; the
    next second reads again."""
    from agent.sources.kmsg import ATTRIBUTIONS_PER_SECOND
    for pid in (1, 2, 3):
        fake_proc(tmp_path, 100_000 + ATTRIBUTIONS_PER_SECOND + pid)
    processor = KernelLogProcessor(proc_root=tmp_path)
    for pid in range(100_000, 100_000 + ATTRIBUTIONS_PER_SECOND):
        processor.handle(XID.format(seq=pid, code=13, pid=pid, msg=f"storm {pid}"), 5.0)
    [late] = processor.handle(XID.format(seq=1, code=13, pid=100_000 + ATTRIBUTIONS_PER_SECOND + 1, msg="x"), 5.9)
    [next_second] = processor.handle(XID.format(seq=2, code=13, pid=100_000 + ATTRIBUTIONS_PER_SECOND + 2,
                                                msg="y"), 6.0)
    assert (processor.stats.unattributed, late.attrs["workload"], next_second.attrs["workload"]) == (
        1, "process/python3", f"pod/{POD_UID}")


def test_an_xid_is_charged_to_the_workload_that_owns_its_pod(tmp_path: Path):
    """The pod listing names the pod's controller: every pod of one job is one workload."""
    owners = {POD_UID: "ml/Deployment/trainer"}
    processor = KernelLogProcessor(proc_root=fake_proc(tmp_path, 4321), owners=lambda: owners)
    [observation] = processor.handle(XID.format(seq=1, code=13, pid=4321, msg="Graphics Exception"), 5.0)
    assert observation.attrs["workload"] == "ml/Deployment/trainer"


def test_without_a_pod_the_workload_is_the_process_name_never_the_pid(tmp_path: Path):
    processor = KernelLogProcessor(proc_root=tmp_path)
    [observation] = processor.handle(XID.format(seq=1, code=13, pid=77, msg="x"), 0.0)
    assert observation.attrs["workload"] == f"process/{observation.attrs['process']}"
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


BANNER = "NVRM: GPU at PCI:0000:3b:00: GPU-0f9a5c0e-1234-5678-9abc-def012345678"


def test_a_banner_forged_from_user_space_does_not_name_a_gpu():
    """A user-space record is dropped before the parser learns anything from it."""
    processor = KernelLogProcessor()
    assert processor.handle(f"12,1,1,-;{BANNER}", 0.0) == []
    assert processor.handle(f"<14>{BANNER}", 0.0) == []
    [observation] = processor.handle(XID.format(seq=2, code=79, pid=1, msg="off the bus"), 0.0)
    assert observation.gpu.uuid == ""
    assert processor.stats.forged == 2


def test_a_kernel_banner_in_a_text_log_still_names_the_gpu():
    processor = KernelLogProcessor()
    processor.handle(f"<6>{BANNER}", 0.0)
    [observation] = processor.handle("<4>NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=x, off the bus", 0.0)
    assert observation.gpu.uuid == "GPU-0f9a5c0e-1234-5678-9abc-def012345678"


class _BrokenPodListing:
    """The pod listing (the `owners` callable) failing for the records marked "boom": something inside the
    handling of one record raises, as the parser once did for some Xid 154 lines. A dependency of the
    processor, so the fault is injected the same way into the interpreted and the compiled storm path."""

    def __init__(self) -> None:
        self.failing = False

    def __call__(self) -> dict[str, str]:
        if self.failing:
            raise ValueError("invalid literal for int() with base 0: '02'")
        return {}


def _handle(processor: KernelLogProcessor, owners: _BrokenPodListing, line: str, now: float) -> list:
    owners.failing = "boom" in line
    return processor.handle(line, now)


def test_a_record_that_cannot_be_handled_is_skipped_and_counted(tmp_path: Path):
    """The record is dropped and counted as unreadable; the next record is handled."""
    counted = []
    owners = _BrokenPodListing()
    processor = KernelLogProcessor(proc_root=fake_proc(tmp_path, 1), owners=owners,
                                   count=lambda name, n: counted.append((name, n)))
    assert _handle(processor, owners, XID.format(seq=1, code=154, pid=1, msg="boom"), 0.0) == []
    [observation] = _handle(processor, owners, XID.format(seq=2, code=79, pid=1, msg="off the bus"), 1.0)
    assert observation.value == 79
    assert (counted, processor.stats.unreadable) == ([("unreadable", 1)], 1)


def test_a_source_whose_records_keep_failing_is_failing_until_one_is_handled(tmp_path: Path):
    """FAILING_AFTER unreadable records in a row make the source failing; one handled record ends it."""
    owners = _BrokenPodListing()
    processor = KernelLogProcessor(proc_root=fake_proc(tmp_path, 1), owners=owners)
    for n in range(FAILING_AFTER):
        assert not processor.failing
        _handle(processor, owners, XID.format(seq=n, code=154, pid=1, msg=f"boom {n}"), float(n))
    assert processor.failing
    _handle(processor, owners, XID.format(seq=99, code=79, pid=1, msg="off the bus"), 99.0)
    assert not processor.failing


def test_the_xid_154_line_that_once_stopped_the_source_does_not_hide_the_next_xid():
    processor = KernelLogProcessor()
    processor.handle("4,1,1,-;NVRM: Xid (PCI:0000:48:00): 154, GPU recovery action changed from 0x0 (None) to "
                     "02 (Node Reboot Required)", 0.0)
    assert [o.value for o in processor.handle(XID.format(seq=2, code=79, pid=1, msg="x"), 1.0)] == [79]


def test_a_burst_is_closed_by_whatever_line_comes_after_its_window():
    processor = KernelLogProcessor(dedup_seconds=1.0)
    for n in range(5):
        processor.handle(XID.format(seq=n, code=31, pid=9, msg="MMU Fault"), n * 0.1)
    assert processor.handle("6,9,1,-;usb 1-1: new device", 0.9) == []
    [summary] = processor.handle("6,10,1,-;usb 1-1: new device", 1.5)
    assert summary.count == 4
