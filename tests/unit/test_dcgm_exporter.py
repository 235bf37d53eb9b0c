"""dcgm-exporter pages -> observations (fixtures written from dcgm-exporter's documented format)."""

import pytest

from agent.model import Signal
from agent.sources.dcgm_exporter import ExporterParseError, ExporterReader, is_blank, parse_exporter_text
from tests.conftest import FIXTURES

DEFAULT = (FIXTURES / "dcgm" / "default-8gpu.prom").read_text()
FAULTS = (FIXTURES / "dcgm" / "faults.prom").read_text()


def reader_of(*pages, baseline_xid=True):
    pages = list(pages)
    return ExporterReader("fixture", fetcher=lambda target, timeout: pages.pop(0) if len(pages) > 1 else pages[0],
                          baseline_xid=baseline_xid)


def test_gpus_are_identified_by_uuid_and_pci_bus_id():
    gpus = parse_exporter_text(DEFAULT)
    assert [g.ref.index for g in gpus] == list(range(8))
    assert gpus[3].ref.uuid == "GPU-5d1c0f3a-7b2e-4c11-9a0d-000000000003"
    assert gpus[3].ref.pci_bus_id == "00000000:5d:00.0"
    assert gpus[3].ref.model == "NVIDIA H100 80GB HBM3"


def test_pod_labels_do_not_split_a_gpu():
    page = DEFAULT + DEFAULT.replace('pod="trainer-0"', 'pod="other"').split("\n", 2)[2]
    assert len(parse_exporter_text(page)) == 8


def test_the_default_counter_set_without_ecc_gives_no_ecc_observation():
    observations = reader_of(DEFAULT).read(0.0)
    signals = {o.signal for o in observations}
    assert Signal.ECC_DBE not in signals
    assert {Signal.TEMPERATURE, Signal.POWER, Signal.ROW_REMAP_FAILURE} <= signals


def test_blank_sentinels_are_no_value():
    assert is_blank(2146435072) and is_blank(9218868437227405312) and is_blank(140737488355328.0)
    assert not is_blank(0) and not is_blank(92)
    gpus = {g.ref.index: g for g in parse_exporter_text(FAULTS) if g.ref.mig_gpu_instance is None}
    assert "shutdown_temp" not in gpus[6].values
    assert gpus[5].values["shutdown_temp"] == 92


def test_dcgm_46_names_are_read():
    gpus = {g.ref.index: g for g in parse_exporter_text(FAULTS) if g.ref.mig_gpu_instance is None}
    assert gpus[7].values["recovery_action"] == 2
    assert gpus[0].values["pcie_replay"] == 3
    assert gpus[0].values["retired_pending"] == 0


def test_mig_labels_name_the_instance_and_its_parent():
    [mig] = [g for g in parse_exporter_text(FAULTS) if g.ref.mig_gpu_instance is not None]
    assert (mig.ref.mig_gpu_instance, mig.ref.key) == (9, "GPU-5d1c0f3a-7b2e-4c11-9a0d-000000000001")


def test_the_last_xid_is_a_baseline_on_the_first_scrape():
    reader = reader_of(FAULTS)
    assert [o for o in reader.read(0.0) if o.signal is Signal.XID] == []


def test_a_new_last_xid_is_one_observation_and_not_counted_twice():
    reader = reader_of(DEFAULT, FAULTS)
    reader.read(0.0)
    [xid] = [o for o in reader.read(30.0) if o.signal is Signal.XID]
    assert (xid.value, xid.gpu.index, xid.attrs["err_code"], xid.attrs["message"]) == (
        79, 3, "79", "GPU has fallen off the bus")
    assert [o for o in reader.read(60.0) if o.signal is Signal.XID] == []


def test_a_one_shot_read_reports_the_last_xid():
    reader = reader_of(FAULTS, baseline_xid=False)
    assert [o.value for o in reader.read(0.0) if o.signal is Signal.XID] == [79]


def test_counters_become_deltas_between_scrapes():
    reader = reader_of(FAULTS)
    first = [o for o in reader.read(0.0) if o.signal is Signal.ECC_DBE]
    assert [(o.gpu.index, o.value) for o in first] == [(4, 2)]
    assert [o for o in reader.read(30.0) if o.signal is Signal.ECC_DBE] == []


def test_garbage_is_unknown_not_a_fault():
    reader = reader_of(DEFAULT, "<html>502 Bad Gateway</html>")
    reader.read(0.0)
    observations = reader.read(30.0)
    assert {o.signal for o in observations} == {Signal.SOURCE_UNREADABLE}
    assert len(observations) == 8
    assert "not Prometheus text" in str(observations[0].attrs["message"]) or "no DCGM" in str(
        observations[0].attrs["message"])


def test_a_page_without_dcgm_metrics_is_an_error():
    with pytest.raises(ExporterParseError):
        parse_exporter_text("# TYPE up gauge\nup 1\n")


def test_an_unreachable_exporter_before_any_scrape_is_a_node_level_unknown():
    def refuse(target, timeout):
        raise ConnectionRefusedError(111, "Connection refused")
    [observation] = ExporterReader("http://127.0.0.1:9", fetcher=refuse).read(0.0)
    assert (observation.signal, observation.gpu, observation.value) == (Signal.SOURCE_UNREADABLE, None, 1)


def test_each_scraped_gpu_gives_the_poll_that_verifies_a_reset():
    """A DCGM-only node can verify resets too: recovery action, pending remap of each GPU in one reading."""
    polls = {o.gpu.index: o for o in reader_of(FAULTS).read(0.0) if o.signal is Signal.GPU_POLLED}
    assert set(polls) == set(range(8))  # full GPUs only, never a MIG instance
    assert (polls[2].attrs["remap_pending"], polls[7].attrs["recovery_action"]) == (1, 2)
    assert (polls[0].attrs["remap_pending"], polls[0].attrs["retirement_pending"]) == (0, 0)
