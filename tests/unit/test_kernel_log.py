"""The kernel-log parser against every log form (fixtures under tests/fixtures/kmsg)."""

import re

from hypothesis import given, settings
from hypothesis import strategies as st

from agent.sources.kernel_log import KernelLogParser, Prefix, strip_prefix, strip_prefixes_one_by_one
from tests.conftest import FIXTURES

KMSG = FIXTURES / "kmsg"


def parse_file(name):
    parser = KernelLogParser()
    lines = (KMSG / name).read_text(encoding="utf-8").splitlines()
    return [r for n, line in enumerate(lines, 1) if (r := parser.feed(line, n)) is not None], parser


def xids(name):
    return [r for r in parse_file(name)[0] if r.kind == "xid"]


def test_dmesg_lines_give_code_pci_pid_process_and_message():
    first = xids("dmesg.log")[0]
    assert (first.line, first.code, first.pci, first.pid, first.process, first.message) == (
        5, 79, "0000:3b:00", 1234, "python3", "GPU has fallen off the bus.")


def test_the_legacy_form_without_pci_prefix_is_read():
    assert xids("dmesg.log")[1].pci == "0000:01:00"


def test_a_process_name_with_a_space_is_kept_whole():
    assert xids("dmesg.log")[1].process == "pt_main thread"


def test_a_message_with_commas_is_verbatim():
    assert xids("dmesg.log")[1].message.startswith("Ch 00000008, intr 10000000. MMU Fault: ENGINE GRAPHICS")


def test_a_non_zero_pci_domain_and_a_bracketed_name():
    record = xids("dmesg.log")[2]
    assert (record.pci, record.process) == ("0002:cb:00", "[kworker/0:1]")


def test_unknown_pid_and_name_are_null():
    record = xids("dmesg.log")[3]
    assert (record.code, record.pid, record.process) == (13, None, None)


def test_a_pid_without_a_name():
    record = xids("dmesg.log")[4]
    assert (record.code, record.pid, record.process, record.message) == (
        94, 77, None, "Contained: SM (0x1). RST: No, D-RST: No")


def test_irregular_spacing_is_tolerated():
    record = xids("dmesg.log")[5]
    assert (record.code, record.pci, record.pid, record.process, record.message) == (
        43, "0000:3b:00", 8, "a.out", "Ch 00000010")


def test_a_name_cut_at_15_characters():
    assert xids("dmesg.log")[6].process == "python3.10-trai"


def test_dmesg_minus_t_timestamps_with_padding():
    assert [(r.code, r.line) for r in xids("dmesg-T.log")] == [(13, 2), (109, 3)]


def test_dmesg_decode_prefixes():
    assert [r.code for r in xids("dmesg-decode.log")] == [119, 120]


def test_syslog_forms_with_and_without_host_ident_and_localised_months():
    assert [r.code for r in xids("syslog.log")] == [154, 45, 63, 64, 74, 92, 95]


def test_a_user_space_program_quoting_an_xid_is_not_an_xid():
    assert 79 not in [r.code for r in xids("syslog.log")]


def test_a_device_plugin_xid_message_is_not_an_xid():
    assert 69 not in [r.code for r in xids("syslog.log")]


def test_xid_154_gives_the_recovery_action():
    record = xids("syslog.log")[0]
    assert (record.pci, record.extras["recovery_action_from"], record.extras["recovery_action"]) == (
        "0000:3b:00", 0, 2)


def test_xid_45_gives_the_causing_xid():
    assert xids("syslog.log")[1].extras["caused_by"] == 79


def test_xid_74_gives_link_and_registers():
    extras = xids("syslog.log")[4].extras
    assert (extras["link"], extras["reg0"], extras["reg2"], extras["reg6"]) == (14, "0x0", "0x10000", "0x0")


def test_raw_kmsg_records_give_sequence_and_facility():
    first = xids("kmsg-raw.log")[0]
    assert (first.code, first.prefix.seq, first.prefix.facility, first.prefix.level) == (79, 1202, 0, 4)


def test_a_priority_prefix_is_stripped():
    assert xids("kmsg-raw.log")[1].code == 145


def test_nvlink5_xids_are_decoded_with_nvidias_table():
    records = xids("kmsg-raw.log")
    remap, netir = records[1].extras, records[2].extras
    assert (remap["subcomponent"], remap["link"], remap["decoded_action"]) == ("RLW_REMAP", 12, "XID_154_EVAL")
    assert (netir["fatal"], netir["link"], netir["decoded_action"]) == (True, 3, "RESET_GPU")


def test_user_space_kmsg_records_carry_their_facility():
    assert xids("kmsg-raw.log")[-1].prefix.facility == 1


def test_the_gpu_banner_feeds_the_pci_to_uuid_map():
    _, parser = parse_file("dmesg.log")
    assert parser.pci_to_uuid == {"0000:3b:00": "GPU-0f9a5c0e-1234-5678-9abc-def012345678"}


def test_gpu_loss_without_an_xid_is_its_own_record():
    lost = [r for r in parse_file("dmesg.log")[0] if r.kind == "gpu_lost"]
    assert [(r.line, r.pci) for r in lost] == [(6, "0000:3b:00")]


def test_the_multi_line_gpu_loss_of_newer_drivers():
    lost = [r for r in parse_file("kmsg-raw.log")[0] if r.kind == "gpu_lost"]
    assert [(r.line, r.pci, r.extras["multi_line"]) for r in lost] == [(9, "0000:5d:00.0", True)]


def test_sxid_first_lines_carry_severity_and_link():
    sxids = [r for r in parse_file("nvswitch.log")[0] if not r.extras["continuation"]]
    assert [(r.code, r.pci, r.extras["severity"], r.extras["link"], r.extras["switch"]) for r in sxids] == [
        (20034, "0000:06:00.0", "fatal", 48, "nvidia-nvswitch3"),
        (12028, "0000:86:00.0", "non-fatal", 32, "nvidia-nvswitch0")]
    assert sxids[0].message == "Link 48 LTSSM Fault Up"


def test_sxid_continuation_lines_belong_to_their_report():
    records, _ = parse_file("nvswitch.log")
    continuations = [r for r in records if r.extras["continuation"]]
    assert [(r.line, r.code, r.extras["severity"]) for r in continuations] == [
        (2, 20034, "fatal"), (3, 20034, "fatal"), (5, 12028, "non-fatal")]


def test_other_kernel_lines_are_ignored():
    assert strip_prefix("[  372.000000] usb 1-1: new high-speed USB device")[0].startswith("usb 1-1")
    assert KernelLogParser().feed("[  372.000000] usb 1-1: new high-speed USB device") is None


@settings(max_examples=500, deadline=None)
@given(st.text(max_size=300))
def test_arbitrary_text_never_raises(text):
    parser = KernelLogParser()
    parser.feed(text)
    parser.feed("NVRM: Xid (PCI:0000:3b:00): " + text)
    parser.feed("nvidia-nvswitch0: SXid (PCI:0000:06:00.0): 1, " + text)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["NVRM: ", "Xid ", "(PCI:", "0000:3b:00", "): ", "79", ", ", "pid=", "name=",
                                 "<unknown>", "'", "[ 1.0] ", "<4>", "4,1,2,-;", "Link 3 ", "(0x1 0x2)", "\n",
                                 "nvidia-nvswitch1: SXid ", "Fatal", "caused by previous Xid ", "0x2 (x)"]),
                max_size=20).map("".join))
def test_near_miss_records_never_raise(text):
    KernelLogParser().feed(text)


def _read(line):
    record = KernelLogParser().feed(line)
    return None if record is None else {k: v for k, v in record.to_json().items() if k != "seq"}


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(["0000:3B:00", "0000:3b:00.0", "3b:00.0", "PCI:0000:3b:00", "0000:3b:00 GPU-I:05"]),
       st.lists(st.sampled_from(["13", "31", "74", "1234567"]), min_size=1, max_size=1),
       st.lists(st.sampled_from([", pid=", ",pid=", ", pid = ", " pid="]), min_size=1, max_size=1),
       st.lists(st.sampled_from(["1234", "12345678901", "'<unknown>'", "<unknown>"]), min_size=1, max_size=1),
       st.lists(st.sampled_from([", name=", ",name=", ", name= ", ", name = ", "  "]), min_size=1, max_size=1),
       st.lists(st.sampled_from(["python3", "pt main", "'", "<unknown>", ", ", ",", " ", "\t", "\n", "x",
                                 "(GPC 1, TPC 2, SM 0)", "link 3 (0x1, 0x2, 0x0, 0x0, 0x0)", "caused by Xid 79"]),
                max_size=8))
def test_a_raw_kmsg_xid_reads_as_its_priority_form_does(address, code, pid, pid_value, name, tail):
    """The raw /dev/kmsg form of an Xid (read by one pattern when it is the driver's own) gives the same record
    as the same body behind a `<4>` prefix (read the long way)."""
    body = f"NVRM: Xid (PCI:{address.removeprefix('PCI:')}): " + "".join([*code, *pid, *pid_value, *name, *tail])
    assert _read("4,7,9,-;" + body) == _read("<4>" + body)


def test_xid_74_registers_are_classified_by_nvidias_workflow():
    from agent.sources.xid_fields import nvlink_error_class
    assert nvlink_error_class([1 << 0 | 1 << 23, 0, 0, 0, 0, 0, 0]) == "IGNORE"
    assert nvlink_error_class([0, 0, 0, 0, 1 << 20, 0, 0]) == "IGNORE"  # an ECC threshold, nothing uncorrected
    assert nvlink_error_class([1 << 1, 0, 0, 1 << 16, 0, 0, 0]) == "SYMPATHETIC"
    assert nvlink_error_class([0, 0, 1 << 16, 0, 0, 0, 0]) == "INVESTIGATE"
    assert nvlink_error_class([1 << 8, 0, 0, 0, 0, 0, 0]) == "INVESTIGATE"  # check the link's mechanics


def test_xid_74_ecc_parity_bits_alone_are_their_own_class():
    """NVIDIA: ECC/parity bits of the first, third and fifth registers are counted per link ("more than 2 times")."""
    from agent.sources.xid_fields import nvlink_error_class
    assert nvlink_error_class([1 << 4, 0, 0, 0, 0, 0, 0]) == "ECC_PARITY"
    assert nvlink_error_class([0, 0, 1 << 6, 0, 0, 0, 0]) == "ECC_PARITY"
    assert nvlink_error_class([1 << 0, 0, 0, 0, 1 << 21 | 1 << 20, 0, 0]) == "ECC_PARITY"
    assert nvlink_error_class([1 << 4 | 1 << 8, 0, 0, 0, 0, 0, 0]) == "INVESTIGATE"  # with a link bit: that decides


def test_xid_74_fourth_register_bit_18_alone_asks_for_a_fabric_reset():
    """NVIDIA: fourth register bit 18 is secondary, "though a reset of the fabric is required": not ignorable."""
    from agent.sources.xid_fields import nvlink_error_class
    assert nvlink_error_class([0, 0, 0, 1 << 18, 0, 0, 0]) == "FABRIC_RESET"
    assert nvlink_error_class([1 << 1, 0, 0, 1 << 18 | 1 << 16, 0, 0, 0]) == "FABRIC_RESET"
    assert nvlink_error_class([0, 0, 0, 1 << 17, 0, 0, 0]) == "SYMPATHETIC"


def test_the_xid_74_line_carries_its_class():
    assert xids("syslog.log")[4].extras["nvlink_error_class"] == "INVESTIGATE"


def test_an_nvlink5_error_of_the_whole_unit_printed_as_link_minus_one_is_decoded():
    """GB200 prints `Link -1` for an error of the whole NVLink unit: it decodes through NVIDIA's table all the same."""
    parser = KernelLogParser()
    record = parser.feed("NVRM: Xid (PCI:0018:01:00): 149, NETIR Fatal XC0 i0 Link -1 "
                         "(0x00000006 0x00000000 0x00000000 0x00000000 0x00000000 0x00000000 0x00000000)")
    assert (record.extras["link"], record.extras["decoded_action"]) == (-1, "RESET_GPU")
    assert record.extras["link_scope"] == "unit"


def test_the_kernels_own_fallen_off_the_bus_line_is_a_lost_gpu():
    """`NVRM: GPU at 0000:01:00.0 has fallen off the bus.` is read as the GPU's loss, before NVML's next poll."""
    record = KernelLogParser().feed("[ 4521.118734] NVRM: GPU at 0000:01:00.0 has fallen off the bus.")
    assert (record.kind, record.pci) == ("gpu_lost", "0000:01:00.0")


def test_the_xid_74_scenario_carries_what_the_parser_reads_from_its_lines():
    """The built-in scenario's Xid 74 observations are the parser's: their attrs hold its decode of each line."""
    from agent.sources.scenario import load_scenario
    from agent.sources.xid_fields import xid_extras
    events = [e for e in load_scenario("xid74-register-workflow").timeline if e.value == 74]
    assert events
    for event in events:
        extras = xid_extras(74, str(event.attrs["message"]))
        assert extras and {k: event.attrs.get(k) for k in extras} == extras



def test_the_one_pattern_rsyslog_form_strips_what_the_forms_one_by_one_strip():
    """Every line of the fixture logs (but raw /dev/kmsg records, whose header only strip_prefix knows), and
    rsyslog's kernel form with and without the dmesg stamp or host, gives the same body and prefix through
    strip_prefix's one-pattern fast path as through the forms stripped one at a time."""
    lines = [line for log in sorted(KMSG.glob("*.log")) for line in log.read_text(encoding="utf-8").splitlines()
             if not re.match(r"\d{1,3},\d+,\d+,", line)]
    lines += ["Dec  7 08:10:00 node-1 kernel: [ 1234.567890] NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=x",
              "Dec 17 08:10:00 kernel[7]: nvidia-nvswitch3: SXid (PCI:0000:3b:00.0): 12028, Non-fatal, Link 32",
              "Dec 17 08:10:00 node-1 kernel: [1.5] <4>NVRM: quoted after another prefix"]
    assert len(lines) > 30
    assert [strip_prefix(line) for line in lines] == [strip_prefixes_one_by_one(line, Prefix()) for line in lines]
