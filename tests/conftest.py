"""Shared test helpers: the shipped rules, GPUs and observations built in one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.engine import RuleSet, builtin_rules_dir, load_rules
from agent.k8s.podresources import DEFAULT_SOCKET
from agent.k8s.pods import PodFinder
from agent.model import GpuRef, Observation, Signal, frozen_attrs

pytest_plugins = ["tests.fault_table"]

REPO = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"


@pytest.fixture(autouse=True)
def _no_host_kubelet(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process agents never ask the host's kubelet at its fixed socket: the real-node tests run one there for
    the whole session, whose answer (its pods, its GPUs) is of another node. The agent then sees what it sees on
    a machine with no kubelet socket; a test that wants a kubelet serves one on a socket of its own. The
    real-node tests' own reads of that kubelet are theirs to make."""
    if Path(str(request.node.fspath)).is_relative_to(REPO / "tests" / "realnode"):
        return
    asked = PodFinder._ask_kubelet

    def ask(finder: PodFinder, method):  # type: ignore[no-untyped-def]
        return None if finder.socket_path == DEFAULT_SOCKET else asked(finder, method)

    monkeypatch.setattr(PodFinder, "_ask_kubelet", ask)


@pytest.fixture(scope="session")
def shipped_rules() -> RuleSet:
    return load_rules(builtin_rules_dir())


def gpu(index: int = 0, model: str = "NVIDIA H100 80GB HBM3") -> GpuRef:
    return GpuRef(index=index, uuid=f"GPU-0000000{index}-aaaa-bbbb-cccc-dddddddddddd",
                  pci_bus_id=f"0000:{0x18 + index:02x}:00.0", model=model)


def obs(signal: Signal, value: float, at: float = 0.0, *, gpu_ref: GpuRef | None = None,
        count: int = 1, source: str = "test", **attrs: object) -> Observation:
    return Observation(signal, value, at, source, gpu_ref if gpu_ref is not None else gpu(),
                       frozen_attrs(attrs), count)  # type: ignore[arg-type]


def served_port(log: Path, timeout: float = 30.0) -> int:
    """The port an agent started with `run --port 0` serves on, from the start line in its log (`http :PORT`):
    tests never pick a port themselves, since another process may take it first."""
    import re
    ports: list[int] = []

    def started() -> bool:
        match = re.search(r"http :(\d+)$", log.read_text(encoding="utf-8", errors="replace"), re.MULTILINE)
        if match:
            ports.append(int(match.group(1)))
        return bool(match)

    assert wait_for(started, timeout), log.read_text(encoding="utf-8", errors="replace")
    return ports[0]


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.01) -> bool:
    """Poll `predicate` until it holds or `timeout` passes (integration tests on real threads)."""
    import time
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False


FAKE_NVML_DIR = Path(__file__).resolve().parent / "fakenvml" / "build"
FAKE_NVML = FAKE_NVML_DIR / "libnvidia-ml.so.1"


def eight_gpus(**overrides: object) -> dict[str, object]:
    """A healthy HGX node in the fake library's state format; `overrides` maps GPU index to changes."""
    gpus = []
    for index in range(8):
        gpu: dict[str, object] = {"uuid": f"GPU-fa4e0000-0000-0000-0000-00000000000{index}",
                                  "pci": f"00000000:{0x18 + index * 0x10:02X}:00.0", "name": "NVIDIA H100 80GB HBM3",
                                  "temp": 35 + index, "retired_pages": None}
        gpu.update(overrides.get(str(index), {}))  # type: ignore[call-overload]
        gpus.append(gpu)
    return {"driver_loaded": True, "gpus": gpus, "events": []}


class FakeNvml:
    """The fake libnvidia-ml's state file; `write` swaps it atomically so the library re-reads it."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def write(self, state: dict[str, object]) -> None:
        import json
        import os
        temporary = self.path.with_suffix(".tmp")
        temporary.write_text(json.dumps(state))
        os.replace(temporary, self.path)


@pytest.fixture
def fake_nvml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The real pynvml bound to the fake library (loaded by its soname), with a fresh state file."""
    import ctypes
    import os
    if not FAKE_NVML.exists():
        pytest.fail(f"{FAKE_NVML} is missing: run tests/fakenvml/build.sh (scripts/test does)")
    ctypes.CDLL(str(FAKE_NVML), mode=os.RTLD_NOW | ctypes.RTLD_GLOBAL)
    fake = FakeNvml(tmp_path / "nvml-state.json")
    fake.write(eight_gpus())
    monkeypatch.setenv("FAKE_NVML_STATE", str(fake.path))
    return fake


# ---- the real control plane (tests/realcluster): started by the first test that asks for it ----
_CONTROL_PLANES: list = []


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory):
    """etcd, kube-apiserver, controller manager, scheduler and kwok on 127.0.0.1, for the whole session."""
    from tests.realcluster.controlplane import ControlPlane, ControlPlaneError
    plane = ControlPlane(tmp_path_factory.mktemp("controlplane"))
    _CONTROL_PLANES.append(plane)
    try:
        plane.start()
    except ControlPlaneError as exc:
        plane.stop()
        pytest.fail(f"the real control plane did not start: {exc}", pytrace=False)
    print(f"\ncontrol plane up in {plane.started_seconds:.1f} s at {plane.url}, logs in {plane.logs}")
    yield plane
    plane.stop()


@pytest.fixture(autouse=True)
def _reset_control_plane():
    """What a test made on the real control plane is deleted after it (a no-op until it is started)."""
    yield
    for plane in _CONTROL_PLANES:
        if plane.url:
            plane.reset()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):
    outcome = yield
    report = outcome.get_result()
    if report.failed and _CONTROL_PLANES and _CONTROL_PLANES[0].url:
        report.sections.append(("control plane logs", _CONTROL_PLANES[0].log_tails()))


#: The least time a request under `no_retry_sleep` gets for its answer.
SLOW_ANSWER_SECONDS = 3.0


@pytest.fixture
def no_retry_sleep(monkeypatch: pytest.MonkeyPatch) -> None:
    """API retries that do not sleep and give up after 0.3 s: a test of failing calls runs in milliseconds.
    A module asks for it with `pytestmark = pytest.mark.usefixtures("no_retry_sleep")`.

    One request still gets at least `SLOW_ANSWER_SECONDS` to be answered: the fake API server runs in the
    test's own process, and on a loaded CI machine one healthy answer took longer than 0.3 s (the request's
    timeout, cut to the retry deadline, failed a test that injected no fault)."""
    from agent.k8s import client, retry
    monkeypatch.setattr(retry, "WAIT", False)
    monkeypatch.setattr(retry, "DEFAULT_DEADLINE_SECONDS", 0.3)

    def remaining_with_floor() -> float | None:
        left = retry.remaining_seconds()
        return None if left is None else max(left, SLOW_ANSWER_SECONDS)

    monkeypatch.setattr(client, "remaining_seconds", remaining_with_floor)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """`k8s_backend` runs a test against the fake API server and the real control plane, unless the test
    is marked fake_only (it drives the fake's fault injection, which a real server has no switch for)."""
    if "k8s_backend" in metafunc.fixturenames:
        backends = ["fake"] if metafunc.definition.get_closest_marker("fake_only") else ["fake", "real"]
        metafunc.parametrize("k8s_backend", backends, indirect=True)


@pytest.fixture
def k8s_backend(request: pytest.FixtureRequest):
    """(cluster, server) for tests/k8s_helpers.make_agent: FakeCluster and FakeApiServer, or their
    real-control-plane counterparts (tests/realcluster/backend.py)."""
    if request.param == "fake":
        from tests.k8s_helpers import start_cluster
        cluster, server = start_cluster()
    else:
        from tests.realcluster.backend import RealCluster, RealServer
        plane = request.getfixturevalue("control_plane")
        cluster, server = RealCluster(plane), RealServer(plane)
    yield cluster, server
    server.stop()


@pytest.fixture
def fake(k8s_backend):
    """The (cluster, server) a test's agents use: the fake API server, and the real control plane for every
    test not marked fake_only (the name is the fixture's history; k8s_backend parametrizes both)."""
    return k8s_backend


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, exitstatus: int,
                            config: pytest.Config) -> None:
    """The random order's seed again at the end, beside the failures: a CI log cut to its tail still says
    how to run the same order again."""
    seed = getattr(config.option, "randomly_seed", None)
    if isinstance(seed, int) and exitstatus != 0:
        terminalreporter.write_line(f"tests ran in random order: rerun this order with --randomly-seed={seed}")
