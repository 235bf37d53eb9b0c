"""The FakeCluster/FakeApiServer calls the remediation tests make, answered by the real control plane.

`RealCluster` reads and writes as cluster admin (what a test's own checks and set-ups do);
`RealServer.agent_client(node)` is the agent's identity on that node (its ServiceAccount, a token
bound to its pod there), so everything the agent does goes through the real authorizer and admission.
"""

from __future__ import annotations

from typing import Any

from kubernetes.client.exceptions import ApiException

from agent.model import NodeInventory
from tests.realcluster.controlplane import AGENT_NAMESPACE, ControlPlane, api_path, audit_events, wait_until

# Events these made are the control plane's own, not the agent's (the fake has no such reporters).
_COMPONENTS = {"kube-controller-manager", "kube-scheduler", "kwok", "kube-apiserver"}
# Namespaces the agent writes Events and Leases into during the remediation tests.
_AGENT_WRITES = ("default", "ml", AGENT_NAMESPACE)


class RealCluster:
    """FakeCluster's test-side surface (node, pods_on, events, add, replace, delete) over the real API."""

    def __init__(self, plane: ControlPlane) -> None:
        self.plane = plane

    def _call(self, method: str, path: str, body: Any = None, **query: str) -> Any:
        return self.plane.rest(method, path, body, **query)

    def populate(self, inventory: NodeInventory) -> None:
        """The node and its pods as the fake's populate() makes them; the agent's pod is its DaemonSet's."""
        self.plane.add_gpu_node(inventory.name, len(inventory.gpus))
        for pod in inventory.pods:
            if pod.daemonset:
                self.plane.agent_pod(inventory.name)
                continue
            self.plane.add_pod(pod.namespace, pod.name, inventory.name, gpus=len(pod.gpu_uuids),
                               labels={"app": pod.name.rsplit("-", 1)[0]}, wait=False)
        for pod in inventory.pods:
            if not pod.daemonset:
                self.plane.wait_running(pod.namespace, pod.name)

    @property
    def faults(self) -> AuditedWrites:
        """Only `writes` of the fake's fault switches: a real server has no switch to turn it down."""
        return AuditedWrites(self)

    @property
    def log(self) -> list[tuple[str, str, int]]:
        """(verb, request URI, status) of every request the agents made, from the audit log (the fake's log
        holds every request; the audit policy records the agent's ServiceAccount only)."""
        return [(e["verb"], e["requestURI"].split("?", 1)[0], e["responseStatus"]["code"])
                for e in audit_events(self.plane.audit_log)]

    def wait_terminations_finished(self) -> None:
        """Until no pod is Terminating: kwok ends each after its grace period, as a kubelet would."""
        def finished() -> bool:
            pods = self.plane.core.list_pod_for_all_namespaces().items
            return not any(p.metadata.deletion_timestamp for p in pods)
        wait_until(finished, "kwok to finish the terminating pods")

    def node(self, name: str) -> dict[str, Any]:
        return dict(self._call("GET", api_path("", "nodes", name=name)))

    def pods_on(self, node: str) -> list[dict[str, Any]]:
        """The node's pods that are not terminating (the fake deletes an evicted pod at once; a real one
        stays Terminating for its grace period: `pods_on(node, terminating=True)` includes those)."""
        return self.pods(node, terminating=False)

    def pods(self, node: str, *, terminating: bool = True) -> list[dict[str, Any]]:
        items = self._call("GET", api_path("", "pods"), fieldSelector=f"spec.nodeName={node}")["items"]
        return [p for p in items if terminating or not p["metadata"].get("deletionTimestamp")]

    def events(self) -> list[dict[str, Any]]:
        """events.k8s.io Events, less those the control plane's own components reported."""
        items = self._call("GET", api_path("events.k8s.io", "events"))["items"]
        return [e for e in items
                if not {m.get("manager") for m in e["metadata"].get("managedFields") or []} & _COMPONENTS]

    def add(self, kind_plural: str, obj: dict[str, Any], *, group: str = "", namespace: str = "") -> dict[str, Any]:
        namespace = namespace or obj.get("metadata", {}).get("namespace", "")
        created = dict(self._call("POST", api_path(group, kind_plural, namespace), obj))
        self.plane.forget(group, kind_plural, namespace, created["metadata"]["name"])
        if kind_plural == "poddisruptionbudgets":
            self._wait_observed(namespace, created["metadata"]["name"])
        return created

    def _wait_observed(self, namespace: str, name: str) -> None:
        def observed() -> bool:
            pdb = self._call("GET", api_path("policy", "poddisruptionbudgets", namespace, name))
            return bool(pdb.get("status", {}).get("observedGeneration") == pdb["metadata"]["generation"])

        wait_until(observed, f"the disruption controller to compute PDB {namespace}/{name}")

    def replace(self, resource: Any, namespace: str, name: str, obj: dict[str, Any]) -> dict[str, Any]:
        return dict(self._call("PUT", api_path(resource.group, resource.plural, namespace, name), obj))

    def delete(self, resource: Any, namespace: str, name: str) -> dict[str, Any]:
        return dict(self._call("DELETE", api_path(resource.group, resource.plural, namespace, name)))

    def clear_agent_writes(self) -> None:
        """Events and Leases the agents of a test wrote, so the next test starts from an empty budget."""
        for namespace in _AGENT_WRITES:
            for group, plural in (("events.k8s.io", "events"), ("coordination.k8s.io", "leases")):
                if plural == "leases" and namespace != AGENT_NAMESPACE:
                    continue
                try:
                    self._call("DELETE", api_path(group, plural, namespace))
                except ApiException as exc:
                    if exc.status != 404:
                        raise


class AuditedWrites:
    """The agents' writes (create, update, patch, delete), counted from the audit log."""

    def __init__(self, cluster: RealCluster) -> None:
        self.cluster = cluster

    @property
    def writes(self) -> int:
        return sum(1 for verb, _, _ in self.cluster.log if verb in {"create", "update", "patch", "delete"})


class RealServer:
    """FakeApiServer's place: hands out the agent's client for a node, and an operator's (admin) client."""

    def __init__(self, plane: ControlPlane) -> None:
        self.plane = plane
        self.url = plane.url
        self._handed_out: list[Any] = []

    def agent_client(self, node_name: str) -> Any:
        """The agent's ApiClient built as the agent builds it, from a kubeconfig of its own identity."""
        from agent.k8s.client import load_api_client
        api_client, how = load_api_client(kubeconfig=str(self.plane.agent_kubeconfig(node_name)))
        assert api_client is not None, how
        self._handed_out.append(api_client)
        return api_client

    def operator_client(self) -> Any:
        """The operator's client as the agent's CLI builds it, from the admin kubeconfig (client certificate)."""
        from agent.k8s.client import load_api_client
        api_client, _ = load_api_client(kubeconfig=str(self.plane.admin_kubeconfig))
        self._handed_out.append(api_client)
        return api_client

    def stop(self) -> None:
        for api_client in self._handed_out:
            api_client.close()
        self._handed_out.clear()
        RealCluster(self.plane).clear_agent_writes()
