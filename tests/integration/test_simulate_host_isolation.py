"""A simulation never asks the machine it runs on: a kubelet's PodResources socket there (a GPU node's, or the
real-node tests') answers with that node's GPUs, none of the simulated ones, which would read as every simulated
GPU withheld by a device plugin, so quarantine mode would taint nothing (the CI failure of stop 45)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from agent.config import Config
from agent.engine import builtin_rules_dir, load_rules
from agent.k8s.podresources import PodDevices
from agent.remediation import GuardPolicy, Mode
from agent.simulate import simulate_in_cluster
from agent.simulate_fleet import simulate_fleet
from agent.sources.scenario import Scenario, load_scenario
from tests.fake_kubelet import serving_kubelet

RULES = load_rules(builtin_rules_dir())
#: What the host's kubelet answers: its own GPU and pod, none of a scenario's.
HOST_GPU = "GPU-99999999-8888-7777-6666-555555555555"
HOST_PODS = [PodDevices("ml", "host-trainer", {"nvidia.com/gpu": [HOST_GPU]})]


def with_remediation(**settings: str) -> Config:
    """The shipped configuration with these remediation settings."""
    config = Config()
    return msgspec.structs.replace(config, remediation=msgspec.structs.replace(config.remediation, **settings))


@pytest.fixture
def host_kubelet(tmp_path: Path):
    """A kubelet serving at the socket the configuration names; yields (the configuration, the methods asked)."""
    socket = tmp_path / "kubelet.sock"
    with serving_kubelet(socket, HOST_PODS, {"nvidia.com/gpu": [HOST_GPU]}) as asked:
        yield with_remediation(pod_resources_socket=str(socket)), asked


def gsp_storm_without_controller() -> Scenario:
    scenario = load_scenario("fleet-gsp-timeout")
    assert scenario.fleet is not None
    return msgspec.structs.replace(scenario, fleet=msgspec.structs.replace(scenario.fleet, controller=False))


def test_a_fleet_simulation_never_asks_the_hosts_kubelet(host_kubelet):
    """GSP timeouts on 10 of 20 nodes with the host's kubelet at the configured socket: none of its answers is
    asked for, and the brake lets its 3 quarantines through as without one."""
    config, asked = host_kubelet
    report = simulate_fleet(gsp_storm_without_controller(), rules=RULES, policy=GuardPolicy(mode=Mode.QUARANTINE),
                            config=config)
    assert asked == []
    assert report.totals()["nodes_tainted_ever"] == 3


def test_a_dra_node_simulation_never_asks_the_hosts_kubelet(host_kubelet):
    """A DRA node (no device plugin simulated to say what is offered) awaiting a reset: the host's kubelet is never
    asked which GPUs it offers."""
    config, asked = host_kubelet
    simulate_in_cluster(load_scenario("gpu-calls-hung"), rules=RULES, policy=GuardPolicy(mode=Mode.QUARANTINE),
                        config=config)
    assert asked == []


def test_a_simulated_reboot_request_never_reaches_the_host(tmp_path):
    """The NVLink ladder's reboot request (later withdrawn, after its reboot), with a reboot sentinel configured
    where no file can be made: the request is applied in the report, no write of the sentinel was tried (it
    would have failed the step), and no file is there."""
    sentinel = tmp_path / "no-such-directory" / "reboot-required"
    config = with_remediation(reboot_sentinel_path=str(sentinel))
    scenario = load_scenario("nvlink-untrained-ladder")
    report = simulate_in_cluster(scenario, rules=RULES, policy=GuardPolicy(mode=Mode(scenario.mode or Config().mode)),
                                 config=config)
    requests = [a for a in report.to_json()["actions"] if a["kind"] == "reboot_request"]
    assert requests and all(a["result"] == "applied" for a in requests)
    assert not sentinel.exists()
