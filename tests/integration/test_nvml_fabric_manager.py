"""Fabric Manager liveness (issue 41 row 4): the host's nv-fabricmanager seen through a /proc tree in the kernel's
own layout, beside the real pynvml over the fake library whose fabric keeps reading Completed (as NVML does)."""

import shutil
from pathlib import Path

import pytest

from agent.engine import builtin_rules_dir, load_rules
from agent.logs import capture_logs
from agent.model import NodeInventory, Signal
from agent.pipeline import Pipeline
from agent.remediation import GuardPolicy, Mode
from agent.sources.fabric_manager import FabricManagerWatch
from agent.sources.node_memory import InMemory
from agent.sources.nvml import NvmlSource, load_pynvml
from tests.conftest import eight_gpus
from tests.integration.test_nvml_expected_gpus import baseboard

RULES = load_rules(builtin_rules_dir())
BOOT = "6f0c1c1e-2b7e-4d7a-9c55-0a3c5d1e2f10"


class HostProc:
    """The host's /proc as the kernel lays it out: per process comm (15 characters), cmdline (NUL-separated),
    stat (starttime is field 22), and the boot id."""

    def __init__(self, root: Path, *, init: str = "/sbin/init") -> None:
        self.root = root
        (root / "sys" / "kernel" / "random").mkdir(parents=True)
        (root / "sys" / "kernel" / "random" / "boot_id").write_text(BOOT + "\n")
        self.process(1, init, 1)
        self.process(812, "/usr/sbin/sshd", 900)

    def process(self, pid: int, argv0: str, started: int) -> None:
        directory = self.root / str(pid)
        directory.mkdir()
        name = Path(argv0).name
        (directory / "comm").write_text(name[:15] + "\n")
        (directory / "cmdline").write_bytes(argv0.encode() + b"\0-c\0/usr/share/nvidia/nvswitch/fabricmanager.cfg\0")
        fields = ["S", "1", str(pid), str(pid), "0", "-1", "4194560"] + ["0"] * 12 + [str(started)] + ["0"] * 30
        (directory / "stat").write_text(f"{pid} ({name[:15]}) " + " ".join(fields) + "\n")

    def end(self, pid: int) -> None:
        shutil.rmtree(self.root / str(pid))


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


class Node:
    """An HGX node (NVSwitches on the bus, every GPU's fabric Completed), polled every 10 s on a virtual clock."""

    def __init__(self, fake_nvml, tmp_path: Path, *, nvswitches: bool = True, init: str = "/sbin/init") -> None:
        fake_nvml.write(eight_gpus(**{str(i): {"fabric": {"state": 3, "status": 0}} for i in range(8)}))
        self.proc = HostProc(tmp_path / "proc", init=init)
        self.clock = Clock()
        bus = baseboard(tmp_path / "sys")
        if not nvswitches:
            shutil.rmtree(bus / "0000:05:00.0")
        self.memory = InMemory()
        self.nvml = self._source(bus)
        self.pipeline = Pipeline(rules=RULES, inventory=NodeInventory("n"), policy=GuardPolicy(mode=Mode.OBSERVE),
                                 clock=self.clock)
        self.bus = bus

    def _source(self, bus: Path) -> NvmlSource:
        nvml = NvmlSource(load_pynvml(), poll_seconds=10.0, call_timeout_seconds=2.0, clock=self.clock,
                          memory=self.memory, pci_devices=bus, fabric_manager=FabricManagerWatch(self.proc.root))
        nvml.start()
        return nvml

    def restart_agent(self) -> None:
        self.nvml.stop()
        self.nvml = self._source(self.bus)

    def over(self, seconds: float) -> list:
        """Poll for `seconds`: the verdicts raised or cleared."""
        verdicts = []
        end = self.clock.now + seconds
        while self.clock.now <= end:
            for o in self.nvml.poll():
                verdicts += self.pipeline.handle(o, o.at).verdicts
            self.clock.now += 10.0
        return verdicts

    def fabric(self, index: int):
        [reading] = [o for o in self.nvml.poll() if o.signal is Signal.GPU_FABRIC and o.gpu.index == index]
        return reading

    def stop(self) -> None:
        self.nvml.stop()


def raised(verdicts, rule_id):
    return sorted(v.gpu.index for v in verdicts if v.rule_id == rule_id and str(v.kind) == "fault")


@pytest.fixture
def hgx(fake_nvml, tmp_path):
    """An HGX node whose nv-fabricmanager (pid 4242) runs from the start."""
    node = Node(fake_nvml, tmp_path)
    node.proc.process(4242, "/usr/bin/nv-fabricmanager", 1500)
    yield node
    node.stop()


def restart_fabric_manager(node: Node, *, registered_for: float) -> None:
    """The GPUs register (polled for `registered_for` s), then systemd restarts Fabric Manager as pid 9001."""
    node.over(registered_for)
    node.proc.end(4242)
    node.proc.process(9001, "/usr/bin/nv-fabricmanager", 88000)


def test_fabric_manager_dying_after_the_gpus_registered_quarantines_every_nvlink_gpu(hgx):
    """NVML keeps reading Completed; the host's process is gone: every GPU of the fabric is quarantined."""
    assert hgx.over(60) == []
    hgx.proc.end(4242)
    verdicts = hgx.over(60)
    assert raised(verdicts, "fabric-manager-down") == list(range(8))
    assert {str(v.action) for v in verdicts if v.rule_id == "fabric-manager-down"} == {"quarantine"}
    assert hgx.fabric(0).attrs["state_name"] == "Completed"


def test_a_fabric_manager_restarted_after_the_gpus_registered_needs_each_gpu_reset(hgx):
    """Another instance after the GPUs registered: the GPUs are reset once idle before they take new work."""
    restart_fabric_manager(hgx, registered_for=30)
    verdicts = hgx.over(30)
    assert raised(verdicts, "fabric-manager-restarted") == list(range(8))
    assert {str(v.action) for v in verdicts if v.rule_id == "fabric-manager-restarted"} == {
        "quarantine_reset_when_idle"}
    assert hgx.fabric(3).attrs["fabric_manager_pid"] == 9001


def test_a_reset_gpu_registers_with_the_running_fabric_manager(hgx):
    """After GPU 2's reset it registers with the running instance: no longer restarted; the others still are."""
    restart_fabric_manager(hgx, registered_for=10)
    hgx.nvml.release_for_reset()
    hgx.nvml.reacquire_after_reset(hgx.nvml.gpus[2].ref.uuid)
    hgx.nvml.poll()
    assert (hgx.fabric(2).attrs["fabric_manager"], hgx.fabric(5).attrs["fabric_manager"]) == ("running", "restarted")


def test_a_gpu_seen_registering_again_registers_with_the_running_fabric_manager(hgx, fake_nvml):
    """Reset by someone else (or its driver reloaded): GPU 4 read InProgress, then Completed, with the new
    instance: no longer restarted."""
    restart_fabric_manager(hgx, registered_for=10)
    fabrics = {str(i): {"fabric": {"state": 3, "status": 0}} for i in range(8)}
    fake_nvml.write(eight_gpus(**{**fabrics, "4": {"fabric": {"state": 2, "status": 0}}}))
    hgx.nvml.poll()
    fake_nvml.write(eight_gpus(**fabrics))
    assert (hgx.fabric(4).attrs["fabric_manager"], hgx.fabric(1).attrs["fabric_manager"]) == ("running", "restarted")


def test_what_the_gpus_registered_with_survives_an_agent_restart(hgx):
    """The agent restarts after Fabric Manager did: the instance the GPUs registered with is remembered."""
    restart_fabric_manager(hgx, registered_for=10)
    hgx.restart_agent()
    assert hgx.fabric(0).attrs["fabric_manager"] == "restarted"


def test_a_running_fabric_manager_is_healthy(hgx):
    assert hgx.over(120) == []
    assert hgx.fabric(0).attrs["fabric_manager"] == "running"


def test_a_gb200_compute_tray_without_nvswitches_or_fabric_manager_is_not_judged(fake_nvml, tmp_path):
    """GB200's fabric is managed off the host (NVLink switch trays): no NVSwitch on the bus, no process, nothing."""
    node = Node(fake_nvml, tmp_path, nvswitches=False)
    try:
        assert node.over(120) == []
        assert "fabric_manager" not in node.fabric(0).attrs
    finally:
        node.stop()


def test_a_process_merely_named_like_fabric_manager_is_not_it(fake_nvml, tmp_path):
    """comm is cut to 15 characters: the command line's program must be nv-fabricmanager itself."""
    node = Node(fake_nvml, tmp_path)
    node.proc.process(4242, "/opt/tools/nv-fabricmanager-exporter", 1500)
    try:
        assert node.fabric(0).attrs["fabric_manager"] == "down"
    finally:
        node.stop()


def test_a_containers_own_proc_is_one_warning_and_fabric_manager_is_not_judged(fake_nvml, tmp_path):
    """The host's /proc not mounted (PID 1 is the agent itself): no Fabric Manager can be seen there, so its
    absence quarantines nothing on an NVSwitch node; one line says what to mount."""
    with capture_logs() as logs:
        node = Node(fake_nvml, tmp_path, init="/usr/local/bin/python3")
        try:
            assert node.over(60) == []
            assert "fabric_manager" not in node.fabric(0).attrs
        finally:
            node.stop()
    assert [e["event"] for e in logs if e["event"] == "fabric_manager_unwatched"] == ["fabric_manager_unwatched"]
