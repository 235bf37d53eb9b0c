"""The agent installed on the real node as users install it: the shipped kustomize base (daemonset/),
applied with a small test overlay for what this machine cannot provide, so the real DaemonSet controller
makes the pod and the real kubelet runs it under its own bound ServiceAccount token."""

from __future__ import annotations

import os
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from tests.conftest import FAKE_NVML, FakeNvml, eight_gpus
from tests.realcluster.controlplane import UNSERVED_KINDS, ControlPlane, free_port
from tests.realnode.registry import Published
from tests.realnode.runtime import REPO

AGENT_NAMESPACE = "gpu-health"
IMAGE_NAME = "ghcr.io/gpu-health-agent/gpu-health-agent"  # the shipped manifests' image
KMSG_DEVICE_DAEMONSET = "gpu-health-kmsg-device"
EVICTION_DEADLINE_SECONDS = 5
# A refused eviction asked again after 2 s (remediation.retry_seconds; shipped 30 s), so a PDB's refusal
# outlasts the deadline within seconds.
RETRY_SECONDS = 2
# The readiness probe every second (shipped 10 s): a new pod is Ready as soon as the agent serves /readyz.
READINESS_PERIOD_SECONDS = 1
# Where Debian's dynamic loader finds libnvidia-ml.so.1 in the image, as the NVIDIA runtime would put it.
IMAGE_NVML = "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"
HELM = REPO / ".tools" / "bin" / "helm"  # scripts/build-helm
HELM_RENDERED = "helm-rendered.yaml"


# The liveness probe's timing in the one test that waits for it to fail (the shipped probe needs about two
# minutes to restart a hung agent: 20 s delay, three misses 20 s apart, a 30 s grace period); its path and
# port stay the shipped ones.
FAST_LIVENESS = {"initialDelaySeconds": 5, "periodSeconds": 3, "timeoutSeconds": 2, "failureThreshold": 2,
                 "terminationGracePeriodSeconds": 2}


def overlay(directory: Path, plane: ControlPlane, nvml_state: Path, mode: str, fast_liveness: bool = False,
            env: dict[str, str] | None = None, helm: bool = False, image_repository: str = "") -> tuple[Path, int]:
    """Write the test overlay over daemonset/ into `directory`; its path and the agent's metrics port.

    What it changes and why (nothing else): hostNetwork, for the agent and the kmsg device plugin (the
    node's only CNI is loopback: no pod network);
    the API server's loopback address instead of the Service IP the kubelet injects (nothing serves it
    here); a free metrics port (on the host's network a fixed one could clash); the image from the suite's
    registry, `image_repository` (kustomize's image transformer; with `helm`, the chart's image.repository
    does it), or, without one, imagePullPolicy Never (the image imported); the fake libnvidia-ml and its
    state file mounted where the NVIDIA container runtime would inject the real one; the mode under test; a
    short eviction deadline and retry (remediation.retry_seconds), so an eviction a PodDisruptionBudget
    refuses is reported stuck within seconds; the readiness probe every second, so a new pod is Ready as
    soon as it serves."""
    port = free_port()
    api_port = plane.url.rsplit(":", 1)[1]
    directory.mkdir(parents=True, exist_ok=True)
    patch = {
        "apiVersion": "apps/v1", "kind": "DaemonSet",
        "metadata": {"name": "gpu-health-agent", "namespace": AGENT_NAMESPACE},
        "spec": {"template": {"spec": {
            "hostNetwork": True, "dnsPolicy": "ClusterFirstWithHostNet",
            "containers": [{
                "name": "agent", **({} if image_repository else {"imagePullPolicy": "Never"}),
                "env": [{"name": "KUBERNETES_SERVICE_HOST", "value": "127.0.0.1"},
                        {"name": "KUBERNETES_SERVICE_PORT", "value": api_port},
                        {"name": "GPU_HEALTH_HTTP__PORT", "value": str(port)},
                        {"name": "GPU_HEALTH_MODE", "value": mode},
                        {"name": "GPU_HEALTH_REMEDIATION__EVICTION_DEADLINE_SECONDS",
                         "value": str(EVICTION_DEADLINE_SECONDS)},
                        {"name": "GPU_HEALTH_REMEDIATION__RETRY_SECONDS", "value": str(RETRY_SECONDS)},
                        {"name": "FAKE_NVML_STATE", "value": f"/run/fake-nvml/{nvml_state.name}"},
                        *({"name": k, "value": v} for k, v in (env or {}).items())],
                "volumeMounts": [{"name": "fake-nvml-lib", "mountPath": IMAGE_NVML, "readOnly": True},
                                 {"name": "fake-nvml-state", "mountPath": "/run/fake-nvml", "readOnly": True}]}],
            "volumes": [{"name": "fake-nvml-lib", "hostPath": {"path": str(FAKE_NVML), "type": "File"}},
                        {"name": "fake-nvml-state",
                         "hostPath": {"path": str(nvml_state.parent), "type": "Directory"}}]}}}}
    port_patch: list[dict[str, object]] = [
        {"op": "replace", "path": "/spec/template/spec/containers/0/ports/0/containerPort", "value": port},
        {"op": "replace", "path": "/spec/template/spec/containers/0/readinessProbe/periodSeconds",
         "value": READINESS_PERIOD_SECONDS}]
    if fast_liveness:
        port_patch += [{"op": "add", "path": f"/spec/template/spec/containers/0/livenessProbe/{key}", "value": value}
                       for key, value in FAST_LIVENESS.items()]
    # The kmsg device plugin's pod, for the same reason as the agent's: no pod network (it uses none).
    plugin_patch = {"apiVersion": "apps/v1", "kind": "DaemonSet",
                    "metadata": {"name": KMSG_DEVICE_DAEMONSET, "namespace": AGENT_NAMESPACE},
                    "spec": {"template": {"spec": {"hostNetwork": True}}}}
    (directory / "agent-patch.yaml").write_text(yaml.safe_dump(patch))
    (directory / "kmsg-device-patch.yaml").write_text(yaml.safe_dump(plugin_patch))
    (directory / "port-patch.yaml").write_text(yaml.safe_dump(port_patch))
    images = [{"name": IMAGE_NAME, "newName": image_repository}] if image_repository and not helm else []
    (directory / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        # kustomize takes no absolute base; with `helm`, the chart's rendering (helm_install's post-renderer)
        "resources": [HELM_RENDERED if helm else os.path.relpath(REPO / "daemonset", directory)],
        "patches": [{"path": "agent-patch.yaml"}, {"path": "kmsg-device-patch.yaml"},
                    {"path": "port-patch.yaml", "target": {"kind": "DaemonSet", "name": "gpu-health-agent"}}],
        **({"images": images} if images else {})}))
    return directory, port


def helm_install(plane: ControlPlane, directory: Path, mode: str, published: Published) -> None:
    """The chart installed as docs/operations.md says, from the registry (`helm install oci://... --version`,
    into the labelled namespace made first), its image the registry's; the overlay applied to what helm
    renders by a post-renderer (`kubectl kustomize` of the overlay)."""
    _delete_kustomized_leftovers(plane)
    if AGENT_NAMESPACE not in plane.kubectl("get", "namespaces", "-o", "name"):
        plane.kubectl("create", "namespace", AGENT_NAMESPACE)
    plane.kubectl("label", "--overwrite", "namespace", AGENT_NAMESPACE, "pod-security.kubernetes.io/enforce=privileged")
    _helm_release(plane, "install", directory, mode, published)
    plane._policy_enforced()


def helm_upgrade(plane: ControlPlane, directory: Path, mode: str, published: Published) -> None:
    """`helm upgrade` of the installed release to `published`'s chart and image, as docs/operations.md says
    (the same values and overlay as its install)."""
    _helm_release(plane, "upgrade", directory, mode, published)


def helm_rollback(plane: ControlPlane, revision: int) -> None:
    """`helm rollback` to `revision`: helm applies that revision's stored (post-rendered) manifest again."""
    helm("rollback", "gpu-health-agent", str(revision), "--wait=false", plane=plane)


def helm(*args: str, plane: ControlPlane) -> str:
    """helm on the release's namespace with the admin's kubeconfig; its stdout, or RuntimeError with its stderr."""
    done = subprocess.run([str(HELM), *args, "-n", AGENT_NAMESPACE, f"--kubeconfig={plane.admin_kubeconfig}"],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"helm {args[0]}: {done.stderr.strip()}")
    return done.stdout


def _helm_release(plane: ControlPlane, verb: str, directory: Path, mode: str, published: Published) -> None:
    renderer = directory / "post-render"
    renderer.write_text(f'#!/bin/sh\ncat > "{directory / HELM_RENDERED}"\nexec kubectl kustomize "{directory}"\n')
    renderer.chmod(0o755)
    # Prometheus Operator kinds off: this API server serves no monitoring.coreos.com (as the docs say to do).
    helm(verb, "gpu-health-agent", published.chart, "--version", published.version, "--plain-http",
         "--set", f"image.repository={published.image_repository}", "--set", f"mode={mode}",
         "--set", "serviceMonitor.enabled=false", "--set", "prometheusRule.enabled=false",
         "--post-renderer", str(renderer), plane=plane)


def _delete_kustomized_leftovers(plane: ControlPlane) -> None:
    """What an earlier kustomize install left (its teardown deletes only the DaemonSet) deleted, but the
    namespace: helm refuses to take over objects it did not make."""
    rendered = subprocess.run(["kubectl", "kustomize", str(REPO / "daemonset")], check=True, capture_output=True,
                              text=True).stdout
    documents = [d for d in yaml.safe_load_all(rendered)
                 if d and d.get("kind") not in {*UNSERVED_KINDS, "Namespace"}]
    plane.kubectl("delete", "--ignore-not-found", "--wait=true", "-f", "-", input_text=yaml.safe_dump_all(documents))


def helm_uninstall(plane: ControlPlane) -> None:
    helm("uninstall", "gpu-health-agent", "--wait=false", plane=plane)


def install(plane: ControlPlane, directory: Path) -> None:
    """`kubectl kustomize` of the overlay, applied server-side (less the kinds that need CRDs)."""
    plane._apply_kustomized(directory)
    plane._policy_enforced()  # the admission policy loaded before the agent's first Node change


def agent_pods(plane: ControlPlane) -> list[Any]:
    return list(plane.core.list_namespaced_pod(AGENT_NAMESPACE,
                                               label_selector="app.kubernetes.io/name=gpu-health-agent").items)


def agent_pid(node: Any, pod: Any) -> int:
    """The host PID of the agent container's process (hostNetwork, no hostPID: seen from the host)."""
    container = next(c for c in pod.status.container_statuses if c.name == "agent").container_id.split("://", 1)[1]
    return int(node.containerd.ctr("tasks", "list").stdout.split(container, 1)[1].split()[0])


def metrics(port: int) -> str:
    """The agent's /metrics text (hostNetwork: on the host's loopback)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return str(response.read().decode())


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples whose labels include `labels` (0 when there is none)."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line[len(name):len(name) + 1] not in {" ", "{"}:
            continue
        if all(f'{key}="{value}"' in line for key, value in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def xid(state: FakeNvml, gpu_index: int, code: int = 79) -> None:
    """The fake NVML delivers an Xid event on one GPU, as the driver would."""
    current = eight_gpus()
    current["events"] = [{"id": int(time.time() * 1000) % 1_000_000, "gpu": gpu_index, "type": 8, "data": code,
                          "gi": 4294967295, "ci": 4294967295}]
    state.write(current)
