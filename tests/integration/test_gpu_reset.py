"""The GPU reset procedure end to end without a GPU: real processes hold fake device files, the real /proc is
scanned, and a fake nvidia-smi refuses to reset while any process holds the GPU (tests/fixtures/gpu)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from agent.gpu.helper import HelperClient, serve
from agent.gpu.holders import device_minor, holders_of
from agent.gpu.reset import DeviceReset, ResetOutcome, ResetProcedure
from tests.conftest import REPO, gpu, wait_for

FAKE_SMI = Path(__file__).resolve().parents[1] / "fixtures" / "gpu" / "nvidia-smi"
GPUS = [gpu(i) for i in range(8)]


class Node:
    """A fake GPU node: the driver's GPU table, /dev/nvidiaN as plain files, processes that hold them, and the
    node's /proc as the scan sees it: the test's own process and those it starts (links into the real /proc;
    this machine's other processes are not the node's)."""

    def __init__(self, root: Path, env: pytest.MonkeyPatch) -> None:
        self.driver, self.dev, self.log = root / "driver", root / "dev", root / "resets.log"
        self.dev.mkdir()
        self.proc = root / "proc"
        self.proc.mkdir()
        self.show(os.getpid())
        for g in GPUS:
            entry = self.driver / g.pci_bus_id
            entry.mkdir(parents=True)
            entry.joinpath("information").write_text(
                f"Model: \t\t {g.model}\nGPU UUID: \t {g.uuid}\nBus Location: \t {g.pci_bus_id}\n"
                f"Device Minor: \t {g.index}\n")
            self.device(g.index or 0).touch()
        self.processes: list[subprocess.Popen[bytes]] = []
        for name, value in (("FAKE_NVIDIA_DRIVER", self.driver), ("FAKE_NVIDIA_DEV", self.dev),
                            ("FAKE_NVIDIA_LOG", self.log)):
            env.setenv(name, str(value))
        env.setenv("PATH", f"{FAKE_SMI.parent}{os.pathsep}{os.environ['PATH']}")  # `nvidia-smi` is the fake

    def show(self, pid: int) -> None:
        (self.proc / str(pid)).symlink_to(f"/proc/{pid}")

    def device(self, index: int) -> Path:
        return self.dev / f"nvidia{index}"

    def hold(self, *indices: int) -> subprocess.Popen[bytes]:
        """A process (`sleep`) with these GPUs' device files open, as a CUDA job or an operand has them."""
        opens = " ".join(f"exec {3 + n}<{self.device(i)};" for n, i in enumerate(indices))
        process = subprocess.Popen(["bash", "-c", f"{opens} exec sleep 600"])
        self.processes.append(process)
        self.show(process.pid)
        assert wait_for(lambda: all(any(h.pid == process.pid for h in
                                        holders_of(self.device(i), proc_root=self.proc).holders) for i in indices))
        return process

    def resets(self) -> list[str]:
        """The resets the fake nvidia-smi did (its log also has the persistence-mode changes)."""
        lines = self.log.read_text().splitlines() if self.log.exists() else []
        return [line for line in lines if line.startswith("reset ")]

    def reset_command(self, *, holder_wait: float = 0.0, ignored: frozenset[str] = frozenset(),
                      proc_root: Path | None = None) -> DeviceReset:
        return DeviceReset(holder_wait_seconds=holder_wait, proc_root=proc_root or self.proc, driver_root=self.driver,
                           dev_root=self.dev, ignored_holders=ignored, poll_seconds=0.05)

    def close(self) -> None:
        for process in self.processes:
            process.kill()
            process.wait()


class Operands:
    """The GPU Operator's operands as the procedure sees them: pausing one stops its pod (the process holding
    every GPU goes, as the DaemonSet controller deletes it); restoring starts it again."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.pod = node.hold(*range(8))
        self.calls: list[str] = []

    def pause(self) -> str:
        self.calls.append("pause")
        self.pod.kill()
        self.pod.wait()
        return "paused device-plugin, dcgm-exporter"

    def restore(self) -> str:
        self.calls.append("restore")
        self.pod = self.node.hold(*range(8))
        return "restored 2 operand label(s)"


class OwnNvml:
    """The agent's own NVML session: while initialised it holds every GPU's device file open (in this process)."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.files = [node.device(i).open("rb") for i in range(8)]
        self.calls: list[str] = []
        self.listed: dict[str, list[int]] = {}  # the processes NVML lists per GPU (CUDA contexts)
        self.reset_gpus: list[str] = []  # what reacquire was told was reset ("" after a failed reset)

    def processes_on(self, uuid: str) -> list[int]:
        return self.listed.get(uuid, [])

    def release_for_reset(self) -> None:
        self.calls.append("release")
        for f in self.files:
            f.close()

    def reacquire_after_reset(self, reset_uuid: str = "") -> None:
        self.calls.append("reacquire")
        self.reset_gpus.append(reset_uuid)
        self.files = [self.node.device(i).open("rb") for i in range(8)]

    def close(self) -> None:
        for f in self.files:
            f.close()


@pytest.fixture
def node(tmp_path, monkeypatch):
    node = Node(tmp_path, monkeypatch)
    yield node
    node.close()


@pytest.fixture
def session(node):
    nvml = OwnNvml(node)
    yield nvml
    nvml.close()


def test_an_idle_gpu_is_reset_once_operands_and_the_agents_nvml_let_go_and_the_job_on_the_others_runs_on(
        node, session):
    """GPU 6 idle, a 7-GPU job on the rest: operands paused, NVML released, GPU 6 reset, all put back, job alive."""
    job = node.hold(0, 1, 2, 3, 4, 5, 7)
    operands = Operands(node)
    procedure = ResetProcedure(node.reset_command(holder_wait=10.0), operands=operands, nvml=session)
    ok, message = procedure(GPUS[6].uuid)
    assert ok, message
    assert node.resets() == [f"reset {GPUS[6].uuid}"]
    assert job.poll() is None  # untouched
    assert operands.calls == ["pause", "restore"] and session.calls == ["release", "reacquire"]
    assert "paused device-plugin" in message and "restored" in message
    assert session.reset_gpus == [GPUS[6].uuid]  # it registers with the running Fabric Manager anew


def test_nvml_is_told_no_gpu_was_reset_when_the_reset_failed(node, session):
    """A refused reset re-registered nothing: what the GPU registered with stays as it was."""
    node.hold(6)
    ok, _ = ResetProcedure(node.reset_command(), nvml=session)(GPUS[6].uuid)
    assert not ok and session.reset_gpus == [""]


def test_a_gpu_still_held_is_not_reset_and_the_holder_is_named(node, session):
    """A process the procedure cannot stop keeps GPU 6 busy: no reset is tried, the message names it."""
    rogue = node.hold(6)
    operands = Operands(node)
    ok, message = ResetProcedure(node.reset_command(), operands=operands, nvml=session)(GPUS[6].uuid)
    assert not ok
    assert f"pid {rogue.pid} (sleep)" in message
    assert node.resets() == []
    assert operands.calls == ["pause", "restore"] and session.calls == ["release", "reacquire"]


def test_a_refused_reset_names_the_processes_nvml_listed_on_the_gpu(node, session, tmp_path):
    """No view of the host's processes: the refusal is said, with the host PIDs NVML listed before letting go."""
    rogue = node.hold(6)
    session.listed[GPUS[6].uuid] = [rogue.pid]
    own_proc = tmp_path / "container-proc"
    own_proc.mkdir()
    ok, message = ResetProcedure(node.reset_command(proc_root=own_proc), nvml=session)(GPUS[6].uuid)
    assert not ok and "being used by some other process" in message
    assert f"NVML listed on the GPU before the reset: pid {rogue.pid} (host PIDs)" in message


def test_the_fake_nvidia_smi_refuses_to_reset_a_gpu_a_process_holds(node):
    """The fake is as strict as the real one: a holder the procedure does not wait for makes the reset fail."""
    node.hold(6)
    outcome = node.reset_command(ignored=frozenset({"sleep"}))(GPUS[6].uuid)
    assert not outcome.ok
    assert "being used by some other process" in outcome.message
    assert node.resets() == []


def test_operands_and_nvml_are_put_back_when_the_reset_itself_raises(node, session):
    """Whatever the privileged part does, the operands are restored and NVML is reinitialised."""
    operands = Operands(node)

    def explode(uuid: str) -> ResetOutcome:
        raise RuntimeError("helper crashed")

    ok, message = ResetProcedure(explode, operands=operands, nvml=session)(GPUS[6].uuid)
    assert not ok and "RuntimeError: helper crashed" in message
    assert operands.calls == ["pause", "restore"] and session.calls == ["release", "reacquire"]


def test_a_gpu_the_driver_does_not_list_is_not_reset(node):
    """The UUID must be in the driver's GPU table (its device minor names the device file)."""
    assert device_minor(GPUS[3].uuid, driver_root=node.driver) == 3
    outcome = node.reset_command()("GPU-99999999-aaaa-bbbb-cccc-dddddddddddd")
    assert not outcome.ok and "not in the driver's GPU table" in outcome.message
    assert node.resets() == []


def test_the_reset_container_answers_the_agent_over_its_socket(node):
    """The agent's HelperClient gets the reset container's outcome, holders included."""
    rogue = node.hold(6)
    directory = tempfile.mkdtemp(prefix="gha")  # short: a Unix socket path is at most 107 bytes
    socket_path = os.path.join(directory, "reset.sock")
    stop = threading.Event()
    server = threading.Thread(target=serve, args=(socket_path, node.reset_command()), kwargs={"stop": stop},
                              daemon=True)
    server.start()
    try:
        assert wait_for(lambda: os.path.exists(socket_path))
        outcome = HelperClient(socket_path, timeout_seconds=30)(GPUS[6].uuid)
        assert not outcome.ok and [h.pid for h in outcome.holders] == [rogue.pid]
        rogue.kill()
        rogue.wait()
        assert HelperClient(socket_path, timeout_seconds=30)(GPUS[6].uuid).ok
        assert not HelperClient(socket_path)("; rm -rf /").ok  # only a GPU UUID is ever passed on
    finally:
        stop.set()
        server.join(5)
        shutil.rmtree(directory, ignore_errors=True)
    assert node.resets() == [f"reset {GPUS[6].uuid}"]


def test_a_process_whose_open_files_cannot_be_read_may_hold_the_gpu_so_no_reset_is_tried(node):
    """Fail closed: scanning without CAP_SYS_PTRACE (root, no capabilities, as in a container) reads no other
    process's fds, so each may hold the GPU: the reset is refused and the unreadable holder is named."""
    rogue = node.hold(6)
    script = ("import sys; from pathlib import Path; from agent.gpu.reset import DeviceReset; "
              "print(DeviceReset(holder_wait_seconds=0, proc_root=Path(sys.argv[1]), driver_root=Path(sys.argv[2]), "
              "dev_root=Path(sys.argv[3]))(sys.argv[4]).message)")
    done = subprocess.run(["setpriv", "--bounding-set", "-all", "--", sys.executable, "-c", script, str(node.proc),
                           str(node.driver), str(node.dev), GPUS[6].uuid], capture_output=True, text=True, timeout=60,
                          check=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    message = done.stdout.strip()
    assert message.startswith("not reset:") and "may hold it" in message, message
    assert f"pid {rogue.pid} (sleep)" in message
    assert node.resets() == []


def test_where_no_other_process_can_be_seen_the_drivers_refusal_is_reported(node, tmp_path):
    """The reset container's own /proc shows nobody else: nvidia-smi refuses a held GPU, and its words are said."""
    node.hold(6)
    own_proc = tmp_path / "container-proc"
    own_proc.mkdir()
    outcome = node.reset_command(proc_root=own_proc)(GPUS[6].uuid)
    assert not outcome.ok
    assert "the driver still refuses" in outcome.message and "being used by some other process" in outcome.message
    assert node.resets() == []


def test_a_refused_reset_is_tried_again_until_the_holder_lets_go(node, tmp_path):
    """Operand pods still terminating: nvidia-smi's refusal is retried within the holder wait, then it resets."""
    pod = node.hold(6)
    own_proc = tmp_path / "container-proc"
    own_proc.mkdir()
    threading.Timer(0.5, pod.kill).start()
    outcome = node.reset_command(holder_wait=20.0, proc_root=own_proc)(GPUS[6].uuid)
    assert outcome.ok, outcome.message
    assert node.resets() == [f"reset {GPUS[6].uuid}"]


@pytest.mark.parametrize(("driver", "words"), [("unable", "being used by some other process"),
                                                ("client", "In use by another client"),
                                                ("process", "is currently in use by another process")])
def test_every_refusal_wording_is_a_gpu_still_held_not_a_failed_reset(node, tmp_path, monkeypatch, driver, words):
    """Issue 41 row 3: a host holder the container cannot see (nv-hostengine, a host dcgm-exporter): whichever
    way the driver words its refusal, the outcome is `held` (not idle yet), with the driver's words."""
    monkeypatch.setenv("FAKE_NVIDIA_REFUSAL", driver)
    node.hold(6)
    own_proc = tmp_path / "container-proc"
    own_proc.mkdir()
    outcome = node.reset_command(proc_root=own_proc)(GPUS[6].uuid)
    assert not outcome.ok and outcome.held, outcome.message
    assert words in outcome.message
    assert node.resets() == []


def test_a_gpu_in_persistence_mode_resets_only_through_the_procedure_which_turns_it_off_and_back_on(
        node, tmp_path, monkeypatch):
    """nvidia-persistenced's attachment refuses the plain command ("In use by another client"); the procedure
    turns persistence mode off for that GPU alone, resets it, and turns it back on."""
    persistence = tmp_path / "persistence"
    persistence.mkdir()
    for g in GPUS:
        (persistence / g.uuid).touch()
    monkeypatch.setenv("FAKE_NVIDIA_PERSISTENCE", str(persistence))
    plain = subprocess.run(["nvidia-smi", "--gpu-reset", "-i", GPUS[6].uuid], capture_output=True, text=True,
                           check=False)
    assert plain.returncode == 255 and "In use by another client" in plain.stdout
    outcome = node.reset_command()(GPUS[6].uuid)
    assert outcome.ok, outcome.message
    assert "persistence mode turned off for the reset" in outcome.message and "back on" in outcome.message
    log = node.log.read_text().splitlines()
    assert log == [f"persistence 0 {GPUS[6].uuid}", f"reset {GPUS[6].uuid}", f"persistence 1 {GPUS[6].uuid}"]
    assert all((persistence / g.uuid).exists() for g in GPUS)


def test_persistence_mode_is_turned_back_on_when_the_reset_is_refused(node, tmp_path, monkeypatch):
    """A holder keeps the GPU: no reset, and persistence mode is on again as it was (the GPU held, not failed)."""
    persistence = tmp_path / "persistence"
    persistence.mkdir()
    (persistence / GPUS[6].uuid).touch()
    monkeypatch.setenv("FAKE_NVIDIA_PERSISTENCE", str(persistence))
    node.hold(6)
    own_proc = tmp_path / "container-proc"
    own_proc.mkdir()
    outcome = node.reset_command(proc_root=own_proc)(GPUS[6].uuid)
    assert outcome.held and (persistence / GPUS[6].uuid).exists(), outcome.message
    assert node.resets() == []


def test_a_reset_destroys_the_mig_instances_and_is_verified_only_once_they_are_back(node, fake_nvml):
    """Issue 41 row 11: a reset of a MIG GPU leaves its MIG mode on and no MIG device (as a real reset does).
    The poll after it counts none of the 7 recorded before: not verified, until mig-manager has re-created them."""
    from agent.model import Signal
    from agent.remediation.resets import unclean
    from agent.sources.nvml import NvmlSource, load_pynvml
    from tests.conftest import eight_gpus
    migs = [f"MIG-6{n}aaaaaa-0000-0000-0000-000000000000" for n in range(7)]
    state = eight_gpus(**{str(i): {"uuid": g.uuid} for i, g in enumerate(GPUS)})
    state["gpus"][6].update(mig_mode=1, mig_devices=migs)  # type: ignore[index]
    fake_nvml.write(state)
    nvml = NvmlSource(load_pynvml(), poll_seconds=0.05, call_timeout_seconds=2.0, event_wait_ms=50)
    nvml.start()

    def polled():
        [poll] = [o for o in nvml.poll() if o.signal is Signal.GPU_POLLED and o.gpu.uuid == GPUS[6].uuid]
        return poll
    try:
        assert polled().attrs["mig_devices"] == 7
        ok, message = ResetProcedure(node.reset_command(), nvml=nvml)(GPUS[6].uuid)
        assert ok, message
        after = polled()
        assert after.attrs["mig_mode"] == 1 and after.attrs["mig_devices"] == 0
        assert unclean(after, mig_expected=7) == ["MIG devices 0 of the 7 it had before the reset (not re-created "
                                                  "yet)"]
        fake_nvml.write(state)  # mig-manager applied the node's MIG configuration again
        assert unclean(polled(), mig_expected=7) == []
        assert set(nvml.mig_parents()) == set(migs)
    finally:
        nvml.stop()
