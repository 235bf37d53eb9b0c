"""The agent installed on the real node as users install it: the shipped kustomize base (daemonset/),
applied with a small test overlay for what this machine cannot provide, so the real DaemonSet controller
makes the pod and the real kubelet runs it under its own bound ServiceAccount token."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from tests.conftest import FAKE_NVML
from tests.realcluster.controlplane import ControlPlane, free_port
from tests.realnode.runtime import REPO

AGENT_NAMESPACE = "gpu-health"
# Where Debian's dynamic loader finds libnvidia-ml.so.1 in the image, as the NVIDIA runtime would put it.
EVICTION_DEADLINE_SECONDS = 5
IMAGE_NVML = "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"


def overlay(directory: Path, plane: ControlPlane, nvml_state: Path, mode: str) -> tuple[Path, int]:
    """Write the test overlay over daemonset/ into `directory`; its path and the agent's metrics port.

    What it changes and why (nothing else): hostNetwork (the node's only CNI is loopback: no pod network);
    the API server's loopback address instead of the Service IP the kubelet injects (nothing serves it
    here); a free metrics port (on the host's network a fixed one could clash); imagePullPolicy Never (no
    registry: the image is imported); the fake libnvidia-ml and its state file mounted where the NVIDIA
    container runtime would inject the real one; the mode under test; a short eviction deadline, so an
    eviction a PodDisruptionBudget refuses is reported stuck within a test."""
    port = free_port()
    api_port = plane.url.rsplit(":", 1)[1]
    directory.mkdir(parents=True, exist_ok=True)
    patch = {
        "apiVersion": "apps/v1", "kind": "DaemonSet",
        "metadata": {"name": "gpu-health-agent", "namespace": AGENT_NAMESPACE},
        "spec": {"template": {"spec": {
            "hostNetwork": True, "dnsPolicy": "ClusterFirstWithHostNet",
            "containers": [{
                "name": "agent", "imagePullPolicy": "Never",
                "env": [{"name": "KUBERNETES_SERVICE_HOST", "value": "127.0.0.1"},
                        {"name": "KUBERNETES_SERVICE_PORT", "value": api_port},
                        {"name": "GPU_HEALTH_HTTP__PORT", "value": str(port)},
                        {"name": "GPU_HEALTH_MODE", "value": mode},
                        {"name": "GPU_HEALTH_REMEDIATION__EVICTION_DEADLINE_SECONDS",
                         "value": str(EVICTION_DEADLINE_SECONDS)},
                        {"name": "FAKE_NVML_STATE", "value": f"/run/fake-nvml/{nvml_state.name}"}],
                "volumeMounts": [{"name": "fake-nvml-lib", "mountPath": IMAGE_NVML, "readOnly": True},
                                 {"name": "fake-nvml-state", "mountPath": "/run/fake-nvml", "readOnly": True}]}],
            "volumes": [{"name": "fake-nvml-lib", "hostPath": {"path": str(FAKE_NVML), "type": "File"}},
                        {"name": "fake-nvml-state",
                         "hostPath": {"path": str(nvml_state.parent), "type": "Directory"}}]}}}}
    port_patch = [{"op": "replace", "path": "/spec/template/spec/containers/0/ports/0/containerPort",
                   "value": port}]
    (directory / "agent-patch.yaml").write_text(yaml.safe_dump(patch))
    (directory / "port-patch.yaml").write_text(yaml.safe_dump(port_patch))
    (directory / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(REPO / "daemonset", directory)],  # kustomize takes no absolute base
        "patches": [{"path": "agent-patch.yaml"},
                    {"path": "port-patch.yaml", "target": {"kind": "DaemonSet", "name": "gpu-health-agent"}}]}))
    return directory, port


def install(plane: ControlPlane, directory: Path) -> None:
    """`kubectl kustomize` of the overlay, applied server-side (less the kinds that need CRDs)."""
    plane._apply_kustomized(directory)
    plane._policy_enforced()  # the admission policy loaded before the agent's first Node change


def agent_pods(plane: ControlPlane) -> list[Any]:
    return list(plane.core.list_namespaced_pod(AGENT_NAMESPACE,
                                               label_selector="app.kubernetes.io/name=gpu-health-agent").items)
