"""The facts the fleet controller correlates on, as a real agent publishes them: the daemon's NVML source over
the fake library, its cluster side built as in production, the summary read back from the Node."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.cluster_side import build_cluster_side
from agent.config import load_config
from agent.daemon import Daemon
from agent.engine import builtin_rules_dir, load_rules
from agent.fleet import NodeSummary
from agent.fleet.published import SUMMARY_ANNOTATION
from agent.k8s.client import client_for
from agent.model import Observation, Signal
from agent.simulation.fake_apiserver import FakeApiServer, FakeCluster
from agent.sources.nvml import NvmlSource, load_pynvml
from tests.conftest import eight_gpus

pytestmark = pytest.mark.usefixtures("no_retry_sleep")
RULES = load_rules(builtin_rules_dir())


def published_summary(fake_nvml, tmp_path: Path, state: dict[str, object],
                      labels: dict[str, str] | None = None) -> NodeSummary:
    """One NVML poll and one Xid 79 through a daemon wired as in production (its Node labelled `labels` too);
    the summary its Node carries."""
    fake_nvml.write(state)
    server = FakeApiServer(FakeCluster()).start()
    try:
        server.cluster.add("nodes", {"metadata": {"name": "hgx-1", "labels": {"nvidia.com/gpu.present": "true",
                                                                            **(labels or {})}}})
        config = load_config(None, env={"NODE_NAME": "hgx-1", "GPU_HEALTH_JOURNAL_PATH": str(tmp_path / "j.db"),
                                        "GPU_HEALTH_MODE": "quarantine"})
        nvml = NvmlSource(load_pynvml(), poll_seconds=10.0)
        api = client_for(server.url)
        daemon = Daemon(config, rules=RULES, sources=[nvml],
                        cluster_of=lambda hooks: build_cluster_side(api, config, hooks, on_stuck=lambda pod: None))
        nvml.start()
        try:
            for observation in nvml.poll():
                daemon.pipeline.handle(observation, observation.at)
            gpu = nvml.gpus[0].ref
            daemon.pipeline.handle(Observation(Signal.XID, 79, 1.0, "kmsg", gpu), 1.0)
            daemon.pipeline.reconcile()
        finally:
            nvml.stop()
            daemon.journal.close()
        node = server.cluster.node("hgx-1")
        return NodeSummary.from_json(node["metadata"]["annotations"][SUMMARY_ANNOTATION])
    finally:
        server.stop()


def fabric(**info: object) -> dict[str, object]:
    return eight_gpus(**{str(i): {"fabric": {"state": 3, **info}} for i in range(8)})


def test_the_summary_names_the_nvlink_fabric_domain_nvml_reports(fake_nvml, tmp_path):
    """GPUs registered in clique 7 of the fabric: the Node's summary says `<cluster UUID>/7`."""
    state = fabric(clique_id=7, cluster_uuid="0123456789abcdef0123456789abcdef")
    assert published_summary(fake_nvml, tmp_path, state).fabric_domain == "01234567-89ab-cdef-0123-456789abcdef/7"


def test_a_gpu_whose_fabric_registration_has_not_completed_names_no_domain(fake_nvml, tmp_path):
    """Fabric Manager not started (state NotStarted, NVML's cluster UUID all zero): no domain is published."""
    assert published_summary(fake_nvml, tmp_path, fabric(state=1)).fabric_domain == ""


def test_a_pcie_only_node_publishes_no_fabric_domain(fake_nvml, tmp_path):
    """No fabric (NVML: NotSupported) is no domain: the node is grouped with no other by fabric."""
    assert published_summary(fake_nvml, tmp_path, eight_gpus()).fabric_domain == ""


def test_the_summary_names_the_gpu_model_and_driver_nvml_reports(fake_nvml, tmp_path):
    """The model and the driver version come from NVML, as the controller's gpu-model and driver keys need."""
    summary = published_summary(fake_nvml, tmp_path, eight_gpus())
    assert (summary.gpu_model, bool(summary.driver_version)) == ("NVIDIA H100 80GB HBM3", True)


def test_the_summary_names_the_rack_and_zone_its_nodes_topology_labels_give(fake_nvml, tmp_path):
    """Issue 38: the agent reads its own Node's topology labels, so a hold scoped to a rack or a zone is judged
    by the reader itself (agent.fleet.scope)."""
    labels = {"topology.kubernetes.io/rack": "rack-12", "topology.kubernetes.io/zone": "us-west-2a"}
    summary = published_summary(fake_nvml, tmp_path, eight_gpus(), labels)
    assert (summary.rack, summary.zone) == ("rack-12", "us-west-2a")


def test_a_node_without_topology_labels_names_no_rack_or_zone(fake_nvml, tmp_path):
    """No topology labels: the summary's rack and zone are empty, and no scoped rack or zone hold covers it."""
    summary = published_summary(fake_nvml, tmp_path, eight_gpus())
    assert (summary.rack, summary.zone) == ("", "")
