"""The control plane the Kubernetes tests run against is the one they are meant to run against."""

from __future__ import annotations

from kubernetes import client


def test_the_api_server_is_kubernetes_1_37(control_plane):
    """Built from k8s.io/kubernetes v1.37.2 (scripts/build-controlplane stamps the version)."""
    assert client.VersionApi(control_plane.admin).get_code().git_version == "v1.37.2"


def test_dra_device_taints_are_served_for_the_dra_work(control_plane):
    """resource.k8s.io/v1 ResourceSlices and DeviceTaintRules (GA in 1.37) exist to be written."""
    resources = client.ApisApi(control_plane.admin).get_api_versions()
    [group] = [g for g in resources.groups if g.name == "resource.k8s.io"]
    assert "resource.k8s.io/v1" in {v.group_version for v in group.versions}
    listed = control_plane.rest("GET", "/apis/resource.k8s.io/v1")
    assert {"resourceslices", "devicetaintrules"} <= {r["name"] for r in listed["resources"]}
