"""The DCGM source over real HTTP (a stub dcgm-exporter), through the CLI, and with fake DCGM bindings."""
# ruff: noqa: N802, N803 - the fake bindings keep DCGM's own CamelCase names

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import ModuleType, SimpleNamespace

import pytest
from click.testing import CliRunner

from agent.cli import main
from agent.config import load_config
from agent.discovery import SourceContext, discover_sources
from agent.journal import Journal
from agent.model import Signal
from agent.sources.dcgm import DcgmSource
from agent.sources.dcgm_bindings import BindingsReader
from agent.sources.dcgm_exporter import ExporterReader
from tests.conftest import FIXTURES, wait_for

DEFAULT = (FIXTURES / "dcgm" / "default-8gpu.prom").read_text()
FAULTS = (FIXTURES / "dcgm" / "faults.prom").read_text()


class StubExporter:
    """A dcgm-exporter stand-in on loopback whose answer each test sets: page, status, delay."""

    def __init__(self):
        self.page, self.status, self.delay = DEFAULT, 200, 0.0
        self.closing = threading.Event()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                if stub.closing.wait(stub.delay):
                    return
                body = stub.page.encode()
                self.send_response(stub.status)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                return

        # Handler threads are joined on close (not daemons), so none outlives its test and writes to a
        # socket the client has closed: that BrokenPipeError used to land in a later test's CLI output.
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = False
        self.server.block_on_close = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/metrics"

    def close(self):
        self.closing.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def exporter():
    stub = StubExporter()
    yield stub
    stub.close()


def test_a_live_scrape_reads_every_gpu(exporter):
    observations = ExporterReader(exporter.url, timeout_seconds=2).read(0.0)
    temps = [o for o in observations if o.signal is Signal.TEMPERATURE]
    assert [o.gpu.index for o in temps] == list(range(8))


@pytest.mark.parametrize(("status", "page", "delay"), [(500, "oops", 0.0), (200, "\x00garbage{{", 0.0),
                                                       (200, DEFAULT, 1.5)])
def test_a_failing_exporter_is_unknown_never_a_fault(exporter, status, page, delay):
    reader = ExporterReader(exporter.url, timeout_seconds=0.5)
    reader.read(0.0)
    exporter.status, exporter.page, exporter.delay = status, page, delay
    observations = reader.read(30.0)
    assert {(o.signal, o.value) for o in observations} == {(Signal.SOURCE_UNREADABLE, 1)}
    assert len(observations) == 8


def test_the_dcgm_source_emits_until_stopped(exporter):
    seen, stop = [], threading.Event()
    source = DcgmSource(ExporterReader(exporter.url, timeout_seconds=2), poll_seconds=0.05)
    thread = threading.Thread(target=source.run, args=(seen.append, stop), daemon=True)
    thread.start()
    try:
        exporter.page = DEFAULT
        assert wait_for(lambda: len([o for o in seen if o.signal is Signal.TEMPERATURE]) >= 16)
        exporter.page = FAULTS
        assert wait_for(lambda: any(o.signal is Signal.XID and o.value == 79 for o in seen))
    finally:
        stop.set()
        thread.join(5)


def test_check_with_an_exporter_file_uses_only_that_source():
    result = CliRunner().invoke(main, ["check", "--dcgm-exporter", str(FIXTURES / "dcgm" / "faults.prom"), "--json"])
    assert result.exit_code == 2, result.output  # CRITICAL: GPUs 3, 4 and 7 are fatal
    document = json.loads(result.stdout)
    statuses = {g["index"]: g["status"] for g in document["gpus"]}
    # GPU 5 is past its slowdown threshold in this one reading: a sustained rule, reported but not judged
    assert statuses == {0: "healthy", 1: "healthy", 2: "degraded", 3: "fatal", 4: "fatal", 5: "healthy",
                        6: "healthy", 7: "fatal"}
    assert set(document["sources"]) == {"dcgm"}
    assert all(set(g) >= {"uuid", "status", "verdicts"} for g in document["gpus"])


def test_check_with_an_unreachable_exporter_is_unknown(exporter):
    url = exporter.url
    exporter.close()
    result = CliRunner().invoke(main, ["check", "--dcgm-exporter", url, "--json"])
    document = json.loads(result.stdout)
    assert document["gpus"] == []
    assert [v["severity"] for v in document["node"]["verdicts"]] == ["unknown"]


def test_the_agent_uses_a_configured_exporter(exporter, tmp_path):
    config = load_config(None, env={"GPU_HEALTH_SOURCES__DCGM__EXPORTER_URL": exporter.url,
                                    "GPU_HEALTH_SOURCES__KMSG__ENABLED": "off",
                                    "GPU_HEALTH_SOURCES__NVML__ENABLED": "off", "NODE_NAME": "n"})
    probes = discover_sources(SourceContext(config, Journal(tmp_path / "j.db"), lambda *a: None))
    [dcgm] = [p for p in probes if p.name == "dcgm"]
    assert isinstance(dcgm.source, DcgmSource)


def test_without_bindings_or_exporter_dcgm_says_why(tmp_path):
    config = load_config(None, env={"NODE_NAME": "n", "GPU_HEALTH_SOURCES__KMSG__ENABLED": "off",
                                    "GPU_HEALTH_SOURCES__NVML__ENABLED": "off"})
    probes = discover_sources(SourceContext(config, Journal(tmp_path / "j.db"), lambda *a: None))
    [dcgm] = [p for p in probes if p.name == "dcgm"]
    assert dcgm.source is None
    assert "no DCGM bindings" in dcgm.why_not


# ---- the bindings mode, with fake modules in place of DCGM's pydcgm ----

def fake_bindings(latest, incidents, fail=None):
    structs = ModuleType("dcgm_structs")
    structs.DCGM_OPERATION_MODE_AUTO = 1
    structs.DCGM_GROUP_DEFAULT = 0
    calls = {"watch": None, "health": None}

    class Samples:
        def WatchFields(self, group, update_us, keep_age, keep_samples):
            calls["watch"] = (tuple(group.fieldIds), update_us)

        def GetLatest(self, group):
            if fail:
                raise RuntimeError(fail)
            return SimpleNamespace(values=latest)

    class Health:
        def Set(self, systems):
            calls["health"] = systems

        def Check(self):
            return SimpleNamespace(incidentCount=len(incidents), incidents=incidents)

    class Discovery:
        def GetAllSupportedGpuIds(self):
            return [0, 1]

        def GetGpuAttributes(self, gpu_id):
            return SimpleNamespace(identifiers=SimpleNamespace(uuid=f"GPU-dcgm-{gpu_id}",
                                                               pciBusId=f"00000000:1{gpu_id}:00.0",
                                                               deviceName="NVIDIA H200"))

    pydcgm = ModuleType("pydcgm")
    pydcgm.DcgmHandle = lambda ipAddress=None, opMode=None: SimpleNamespace(
        GetSystem=lambda: SimpleNamespace(discovery=Discovery()))
    pydcgm.DcgmGroup = lambda handle, groupName, groupType: SimpleNamespace(samples=Samples(), health=Health())
    pydcgm.DcgmFieldGroup = lambda handle, name, fieldIds: SimpleNamespace(fieldIds=fieldIds)
    return {"pydcgm": pydcgm, "dcgm_structs": structs, "dcgm_fields": ModuleType("dcgm_fields"),
            "dcgm_agent": ModuleType("dcgm_agent")}, calls


def value(v, ts=1, blank=False):
    return [SimpleNamespace(value=v, ts=ts, isBlank=blank)]


def test_bindings_set_the_health_watches_and_watch_the_fields():
    modules, calls = fake_bindings({}, [])
    BindingsReader(modules).read(0.0)
    assert calls["health"] == 0xFFFFFFFF
    assert {230, 311, 396, 1523} <= set(calls["watch"][0])


def test_bindings_values_become_observations():
    latest = {0: {150: value(95), 158: value(90), 159: value(92), 396: value(1)}, 1: {150: value(40, blank=True)}}
    modules, _ = fake_bindings(latest, [])
    observations = BindingsReader(modules).read(0.0)
    temps = [(o.gpu.uuid, o.value) for o in observations if o.signal is Signal.TEMPERATURE]
    assert temps == [("GPU-dcgm-0", 95)]
    assert any(o.signal is Signal.ROW_REMAP_PENDING and o.value == 1 for o in observations)


def test_a_health_incident_is_reported_per_gpu():
    incident = SimpleNamespace(entityInfo=SimpleNamespace(entityGroupId=1, entityId=1), system=0x10, health=20,
                               error=SimpleNamespace(msg="Volatile DBE detected", code=3))
    modules, _ = fake_bindings({}, [incident])
    health = [o for o in BindingsReader(modules).read(0.0) if o.signal is Signal.DCGM_HEALTH]
    assert [(o.gpu.uuid if o.gpu else None, o.value) for o in health] == [
        ("GPU-dcgm-0", 0), ("GPU-dcgm-1", 20), (None, 0)]
    assert "mem: Volatile DBE detected" in str(health[1].attrs["message"])


def test_dcgm_down_is_unknown_never_a_fault():
    modules, _ = fake_bindings({}, [], fail="host engine connection lost")
    reader = BindingsReader(modules)
    observations = reader.read(0.0)
    assert {(o.signal, o.value) for o in observations} == {(Signal.SOURCE_UNREADABLE, 1)}


def test_a_hung_dcgm_read_is_unknown_never_a_fault():
    release = threading.Event()

    class Hangs:
        def __init__(self):
            from agent.sources.dcgm_exporter import DcgmTranslator
            self.translator = DcgmTranslator()

        def read(self, now):
            release.wait(10)
            return []

    source = DcgmSource(Hangs(), timeout_seconds=0.2)
    try:
        observations = source.read(0.0)
        assert {(o.signal, o.value) for o in observations} == {(Signal.SOURCE_UNREADABLE, 1)}
        assert "timed out" in str(observations[0].attrs["message"])
    finally:
        release.set()
        source.caller.close()


def test_a_switch_or_link_incident_is_never_charged_to_the_gpu_with_the_same_id():
    """DCGM numbers each entity group on its own: NVSwitch 1 and link 0 are not GPU 1 and GPU 0."""
    switch = SimpleNamespace(entityInfo=SimpleNamespace(entityGroupId=3, entityId=1), system=0x800, health=20,
                             error=SimpleNamespace(msg="NVSwitch fatal error", code=52))
    link = SimpleNamespace(entityInfo=SimpleNamespace(entityGroupId=6, entityId=0), system=0x2, health=10,
                           error=SimpleNamespace(msg="link down", code=9))
    modules, _ = fake_bindings({}, [switch, link])
    health = [o for o in BindingsReader(modules).read(0.0) if o.signal is Signal.DCGM_HEALTH]
    assert [(o.gpu.uuid, o.value) for o in health if o.gpu] == [("GPU-dcgm-0", 0), ("GPU-dcgm-1", 0)]
    [node] = [o for o in health if o.gpu is None]
    assert (node.value, node.attrs["entity_group"], node.attrs["entity_id"]) == (20, "switch", 1)


def test_dcgm_sram_threshold_and_unrepairable_memory_are_read():
    latest = {0: {346: value(1), 1507: value(1)}, 1: {346: value(0), 1507: value(0)}}
    modules, _ = fake_bindings(latest, [])
    observations = BindingsReader(modules).read(0.0)
    flags = {(o.signal, o.gpu.uuid, o.value) for o in observations
             if o.signal in {Signal.SRAM_THRESHOLD_EXCEEDED, Signal.MEMORY_UNREPAIRABLE}}
    assert flags == {(Signal.SRAM_THRESHOLD_EXCEEDED, "GPU-dcgm-0", 1), (Signal.MEMORY_UNREPAIRABLE, "GPU-dcgm-0", 1),
                     (Signal.SRAM_THRESHOLD_EXCEEDED, "GPU-dcgm-1", 0), (Signal.MEMORY_UNREPAIRABLE, "GPU-dcgm-1", 0)}


def test_an_absurd_dcgm_threshold_is_ignored():
    latest = {0: {150: value(35), 158: value(0), 159: value(0)}}
    modules, _ = fake_bindings(latest, [])
    [temperature] = [o for o in BindingsReader(modules).read(0.0) if o.signal is Signal.TEMPERATURE]
    assert "shutdown_c" not in temperature.attrs and "slowdown_c" not in temperature.attrs
