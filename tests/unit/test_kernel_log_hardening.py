"""The kernel-log parser against hostile, mangled and newer forms: it reads them or skips them, never raises."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.sources import xid_fields
from agent.sources.kernel_log import KernelLogParser

XID_74 = ("NVRM: Xid (PCI:0000:3b:00): 74, pid=99, name=nccl, NVLink: fatal error detected on link 14"
          "(0x0, 0x0, 0x10000, 0x0, 0x0, 0x0, 0x0)")


def one(line: str):
    return KernelLogParser().feed(line)


def test_xid_154_with_a_plain_recovery_value_parses():
    """`to 02 (...)` is the value 2 written without 0x; it used to raise ValueError and stop the source."""
    record = one("NVRM: Xid (PCI:0000:48:00): 154, GPU recovery action changed from 0x0 (None) to 02 "
                 "(Node Reboot Required)")
    assert (record.code, record.extras["recovery_action_from"], record.extras["recovery_action"]) == (154, 0, 2)


def test_a_line_that_breaks_a_decoder_is_skipped_and_counted(monkeypatch):
    """Whatever goes wrong inside the parser, the line is dropped and counted, and the next line is read.
    The fault is injected into the NVLink5 decoder, a module the parser calls by name at each line in the
    interpreted and the compiled build alike."""
    def broken(code, intr_info, error_status):
        raise ValueError("decoder bug")
    monkeypatch.setattr(xid_fields, "decode", broken)
    parser = KernelLogParser()
    assert parser.feed("NVRM: Xid (PCI:0000:3b:00): 145, RLW_REMAP Nonfatal XC0 i0 Link 12 (0x4 0x2 0x0)") is None
    assert parser.skipped == 1
    assert parser.feed("NVRM: GPU at PCI:0000:3b:00: GPU-0f9a5c0e-1234-5678-9abc-def012345678").kind == "gpu_uuid"


def test_a_crafted_process_name_cannot_shift_the_xid_74_registers():
    """The registers close the line; a name like `a, link 0 (0xff` is the process's text, not the driver's."""
    record = one(XID_74.replace("name=nccl", "name=a, link 0 (0xff"))
    assert (record.extras["link"], record.extras["reg0"], record.extras["reg2"]) == (14, "0x0", "0x10000")


def test_a_crafted_process_name_cannot_forge_the_recovery_action():
    record = one("NVRM: Xid (PCI:0000:48:00): 154, pid=5, name=x, recovery action changed from 0x0 (None) to "
                 "0x2 (Node Reboot Required)x, GPU recovery action changed from 0x0 (None) to 0x0 (None)")
    assert record.extras["recovery_action"] == 0


def test_a_mig_attributed_xid_keeps_its_instance():
    """The driver's form for a fault inside a MIG instance names the GPU instance and compute instance."""
    record = one("NVRM: Xid (PCI:0000:3b:00 GPU-I:05 GPU-CI:02): 31, pid=4242, name=python, Ch 00000008, "
                 "intr 10000000. MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_0 faulted @ 0x7f12_34560000")
    assert (record.kind, record.code, record.pci, record.pid) == ("xid", 31, "0000:3b:00", 4242)
    assert (record.extras["gpu_instance"], record.extras["compute_instance"]) == (5, 2)


def test_a_mig_xid_with_only_a_gpu_instance():
    record = one("NVRM: Xid (PCI:0000:3b:00 GPU-I:01): 43, pid=8, name=a.out, Ch 00000010")
    assert (record.pci, record.extras["gpu_instance"], "compute_instance" in record.extras) == (
        "0000:3b:00", 1, False)


@pytest.mark.parametrize("address", ["PCI:XXXX:XX:XX", "PCI:<redacted>", "", "PCI:0000:3b", "????"])
def test_an_xid_with_a_redacted_or_mangled_address_is_an_xid_on_an_unknown_gpu(address):
    record = one(f"NVRM: Xid ({address}): 79, pid=1234, name=python3, GPU has fallen off the bus.")
    assert (record.kind, record.code, record.pci, record.extras["address_unreadable"]) == ("xid", 79, "", True)


@pytest.mark.parametrize("line", [
    # journalctl -k -o short-precise
    "Nov 30 23:33:39.123456 gpu-node-07 kernel: NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=x, GPU has fallen off",
    # journalctl -k -o short-monotonic
    "[ 1234.567890] gpu-node-07 kernel: NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=x, GPU has fallen off",
    # journalctl -k -o short-full
    "Mon 2026-11-30 23:33:39 UTC gpu-node-07 kernel: NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=x, GPU off",
    # journalctl -k -o short-iso-precise
    "2026-11-30T23:33:39.123456+00:00 gpu-node-07 kernel: NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=x, off",
])
def test_journalctl_text_outputs_parse(line):
    record = one(line)
    assert (record.code, record.pci, record.pid) == (79, "0000:3b:00", 1)


def test_journalctl_json_output_parses_and_carries_the_kernel_facility():
    entry = {"__REALTIME_TIMESTAMP": "1764545619123456", "_TRANSPORT": "kernel", "PRIORITY": "4",
             "SYSLOG_FACILITY": "0", "_SOURCE_MONOTONIC_TIMESTAMP": "365969681",
             "MESSAGE": "NVRM: Xid (PCI:0000:3b:00): 48, pid=1, name=x, An uncorrectable double bit error"}
    record = one(json.dumps(entry))
    assert (record.code, record.pci, record.prefix.facility, record.prefix.level) == (48, "0000:3b:00", 0, 4)


def test_a_json_entry_from_user_space_is_marked_as_such():
    """A forged record written with logger or to /dev/kmsg from user space must not pass for the kernel's."""
    entry = {"_TRANSPORT": "syslog", "SYSLOG_FACILITY": "1", "MESSAGE": "NVRM: Xid (PCI:0000:3b:00): 79, forged"}
    assert one(json.dumps(entry)).prefix.facility == 1


def test_a_json_message_written_as_bytes_parses():
    message = list("NVRM: Xid (PCI:0000:3b:00): 31, pid=3, name=\xff, MMU Fault".encode("latin-1"))
    assert one(json.dumps({"_TRANSPORT": "kernel", "MESSAGE": message})).code == 31


@pytest.mark.parametrize("line", [
    # docs.nvidia.com/deploy/xid-errors: "Viewing Xid messages", the example with its elided prefix
    "[…] NVRM: Xid (0000:03:00): 14, Channel 00000001",
    "[...] NVRM: Xid (0000:03:00): 14, Channel 00000001",
])
def test_nvidias_documented_xid_example_parses(line):
    record = one(line)
    assert (record.code, record.pci, record.message) == (14, "0000:03:00", "Channel 00000001")


def test_nvidias_documented_banner_example_feeds_the_uuid_map():
    parser = KernelLogParser()
    parser.feed("[…] NVRM: GPU at 0000:03:00: GPU-b850f46d-d5ea-c752-ddf3-c4453e44d3f7")
    assert parser.pci_to_uuid == {"0000:03:00": "GPU-b850f46d-d5ea-c752-ddf3-c4453e44d3f7"}


def test_the_catalogs_recovery_action_text_parses():
    """The catalog's own Xid 154 example text, inside a kernel-log record."""
    record = one("NVRM: Xid (PCI:0000:3b:00): 154, GPU recovery action changed from 0x0 (None) to 0x2 "
                 "(Node Reboot Required)")
    assert (record.extras["recovery_action"], record.extras["recovery_action_name"]) == (2, "Node Reboot Required")


def test_xid_13_carries_the_sm_location():
    """NVIDIA's Xid 13 workflow asks whether faults repeat on the same GPC and TPC."""
    record = one("NVRM: Xid (PCI:0000:3b:00): 13, pid=5, name=python, Graphics SM Warp Exception on "
                 "(GPC 4, TPC 1, SM 0): Out Of Range Address")
    assert (record.extras["gpc"], record.extras["tpc"], record.extras["sm"], record.extras["sm_location"]) == (
        4, 1, 0, "GPC 4, TPC 1")


def test_xid_13_location_is_the_drivers_not_one_a_process_name_spells():
    """The driver prints the SM location last: a process named "(GPC 9, TPC 9)" cannot move it."""
    record = one("NVRM: Xid (PCI:0000:3b:00): 13, pid=5, name=x (GPC 9, TPC 9, SM 9), Graphics SM Warp Exception on "
                 "(GPC 4, TPC 1, SM 0): Out Of Range Address")
    assert (record.extras["gpc"], record.extras["tpc"], record.extras["sm"]) == (4, 1, 0)


def test_a_number_longer_than_python_converts_is_skipped_not_raised():
    parser = KernelLogParser()
    assert parser.feed("NVRM: Xid (PCI:0000:48:00): " + "9" * 5000 + ", x") is None
    assert parser.feed("NVRM: Xid (PCI:0000:48:00): 79, pid=" + "9" * 5000 + ", name=x, y").code == 79
    assert parser.feed("4,1,2,-;NVRM: Xid (PCI:0000:48:00): 45, caused by previous Xid " + "7" * 5000).code == 45


def test_a_long_nvlink5_line_is_still_decoded():
    record = one("NVRM: Xid (PCI:0000:3b:00): 145, " + "Fatal " * 3000 + "RLW_REMAP Nonfatal XC0 i0 Link 12 "
                 "(0x00000004 0x00000002 0x0 0x0 0x0 0x0 0x0)")
    assert (record.extras["subcomponent"], record.extras["link"]) == ("RLW_REMAP", 12)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([XID_74, "NVRM: Xid (PCI:0000:3b:00): 145, RLW_REMAP Nonfatal XC0 i0 Link 12 (0x4 0x2 0x0)",
                        "NVRM: Xid (PCI:0000:48:00): 154, GPU recovery action changed from 0x0 (None) to 02 (x)",
                        '{"_TRANSPORT": "kernel", "MESSAGE": "NVRM: Xid (PCI:0000:3b:00): 13, pid=1, name=a, b"}']),
       st.lists(st.tuples(st.integers(0, 400), st.text(max_size=8)), max_size=6))
def test_mutated_real_records_never_raise(line, edits):
    """Real records with characters inserted, deleted or replaced anywhere: parsed or skipped, never raised."""
    text = line
    for position, insert in edits:
        at = position % (len(text) + 1)
        text = text[:at] + insert + text[at + len(insert) // 2:]
    KernelLogParser().feed(text)
