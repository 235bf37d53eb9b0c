"""A real Kubernetes control plane on 127.0.0.1 for the tests: etcd, kube-apiserver, the controller
manager, the scheduler and kwok, built by scripts/build-controlplane into tests/controlplane/bin."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from tests.realcluster.pki import Pki

REPO = Path(__file__).resolve().parents[2]
BIN = REPO / "tests" / "controlplane" / "bin"
BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")
# util-linux's setpriv kills each component when the test process dies, even killed (SIGKILL), so no
# component outlives the session (Debian has util-linux in every image; without it, they are not tied).
_DIE_WITH_PARENT = ("setpriv", "--pdeathsig", "KILL", "--") if shutil.which("setpriv") else ()
AGENT_NAMESPACE = "gpu-health"
AGENT_SERVICE_ACCOUNT = "gpu-health-agent"
AGENT_USER = f"system:serviceaccount:{AGENT_NAMESPACE}:{AGENT_SERVICE_ACCOUNT}"
#: The fleet controller's identity (daemonset/fleet), audited like the agent's for its RBAC-from-use test.
FLEET_USER = f"system:serviceaccount:{AGENT_NAMESPACE}:gpu-health-fleet"
NODE_NAME_CLAIM = "authentication.kubernetes.io/node-name"
GPU_LABEL = "nvidia.com/gpu.present"
# kwok manages only the nodes the tests made, so it never touches anything else.
KWOK_LABEL = "gpu-health-agent.io/test-node"
# Kinds the shipped base has that need CRDs (Prometheus operator) this control plane does not serve.
UNSERVED_KINDS = {"ServiceMonitor", "PrometheusRule"}
# What the controller manager runs: PDB status (so eviction is decided for real), namespaces and the
# ServiceAccounts pods need, the CA bundle a projected token volume reads, and the type-checking
# status of ValidatingAdmissionPolicies, node lifecycle (it lifts the not-ready taint admission puts on a
# new node once kwok reports it Ready). No garbage collector, DaemonSet or Job controller: the tests'
# pods are bare or owned by an inert DaemonSet.
CONTROLLERS = ",".join(f"{name}-controller" for name in (
    "disruption", "namespace", "serviceaccount", "root-ca-certificate-publisher",
    "validatingadmissionpolicy-status", "node-lifecycle"))
# DRA (issue 13): the resource.k8s.io APIs and device taints.
FEATURE_GATES = "DRADeviceTaints=true,DRADeviceTaintRules=true"
RUNTIME_CONFIG = "resource.k8s.io/v1beta2=true"
# (group, plural) -> (version, namespaced): the resources tests create or read through rest().
RESOURCES = {
    ("", "nodes"): ("v1", False), ("", "pods"): ("v1", True), ("", "namespaces"): ("v1", False),
    ("policy", "poddisruptionbudgets"): ("v1", True), ("events.k8s.io", "events"): ("v1", True),
    ("coordination.k8s.io", "leases"): ("v1", True), ("apps", "daemonsets"): ("v1", True),
    ("", "configmaps"): ("v1", True),
    ("resource.k8s.io", "resourceslices"): ("v1", False), ("resource.k8s.io", "resourceclaims"): ("v1", True),
    ("resource.k8s.io", "devicetaintrules"): ("v1", False), ("resource.k8s.io", "deviceclasses"): ("v1", False),
}
AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1", "kind": "Policy", "omitStages": ["RequestReceived"],
    "rules": [{"level": "Metadata", "users": [AGENT_USER, FLEET_USER]}, {"level": "None"}],
}


class ControlPlaneError(RuntimeError):
    """The control plane could not be built or did not come up."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(predicate: Callable[[], Any], what: str, timeout: float = 60.0) -> Any:
    """Poll until `predicate` returns something truthy; ControlPlaneError naming `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            result = predicate()
            if result:
                return result
        except (ApiException, OSError, ValueError) as exc:
            last = exc
        time.sleep(0.1)
    raise ControlPlaneError(f"timed out after {timeout:.0f}s waiting for {what}" + (f" (last: {last})" if last else ""))


@dataclass(slots=True)
class _Process:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path


class ControlPlane:
    """Starts the components, hands out clients and fixtures, and tears everything down."""

    def __init__(self, workdir: Path, *, bin_dir: Path = BIN, extra_controllers: tuple[str, ...] = ()) -> None:
        self.workdir = workdir
        self.bin = bin_dir
        # The real node's plane (tests/realnode) also runs the DaemonSet controller, which must not make
        # pods on the kwok nodes of this one.
        self.controllers = ",".join([CONTROLLERS, *(f"{name}-controller" for name in extra_controllers)])
        self.logs = workdir / "logs"
        self.pki = Pki(workdir / "pki")
        self.ca_file = self.pki.ca_file
        self.audit_log = self.logs / "audit.jsonl"
        self.admin_kubeconfig = workdir / "admin.kubeconfig"
        self.url = ""
        self.started_seconds = 0.0
        self._processes: list[_Process] = []
        self._names = itertools.count(1)
        self._created: list[tuple[str, str, str, str]] = []  # (group, plural, namespace, name) for reset()
        self._manifests_applied = False
        self._admin: Any = None
        self._dra_applied = False

    # ---- lifecycle ----
    def start(self) -> ControlPlane:
        missing = [b for b in BINARIES if not (self.bin / b).is_file()]
        if missing:
            raise ControlPlaneError(f"{', '.join(missing)} missing in {self.bin}: run scripts/build-controlplane")
        began = time.monotonic()
        self.logs.mkdir(parents=True, exist_ok=True)
        etcd_port, apiserver_port = free_port(), free_port()
        self._spawn("etcd", "--name=test", f"--data-dir={self.workdir / 'etcd'}",
                    f"--listen-client-urls=http://127.0.0.1:{etcd_port}",
                    f"--advertise-client-urls=http://127.0.0.1:{etcd_port}",
                    f"--listen-peer-urls=http://127.0.0.1:{free_port()}", "--unsafe-no-fsync",
                    "--log-level=warn")
        self.url = f"https://127.0.0.1:{apiserver_port}"
        self._write_admin_kubeconfig()
        audit_policy = self.workdir / "audit-policy.yaml"
        audit_policy.write_text(yaml.safe_dump(AUDIT_POLICY))
        serving_cert, serving_key = self.pki.serving
        self._spawn(
            "kube-apiserver", f"--etcd-servers=http://127.0.0.1:{etcd_port}", "--bind-address=127.0.0.1",
            f"--secure-port={apiserver_port}", "--advertise-address=127.0.0.1",
            f"--tls-cert-file={serving_cert}", f"--tls-private-key-file={serving_key}",
            f"--client-ca-file={self.ca_file}", f"--requestheader-client-ca-file={self.ca_file}",
            "--requestheader-allowed-names=front-proxy", "--requestheader-username-headers=X-Remote-User",
            "--requestheader-group-headers=X-Remote-Group", "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            "--service-account-issuer=https://kubernetes.default.svc",
            f"--service-account-key-file={self.pki.sa_pub}", f"--service-account-signing-key-file={self.pki.sa_key}",
            "--service-cluster-ip-range=10.0.0.0/24", "--authorization-mode=Node,RBAC",
            "--enable-admission-plugins=NodeRestriction,ValidatingAdmissionPolicy",
            f"--feature-gates={FEATURE_GATES}", f"--runtime-config={RUNTIME_CONFIG}",
            f"--audit-policy-file={audit_policy}", f"--audit-log-path={self.audit_log}", "--audit-log-format=json",
            "--audit-log-mode=blocking", "--allow-privileged=true", "--profiling=false",
            "--enable-priority-and-fairness=false", "--endpoint-reconciler-type=none")
        wait_until(self._apiserver_ready, "kube-apiserver /readyz", timeout=120)
        kubeconfig = f"--kubeconfig={self.admin_kubeconfig}"
        delegated = (f"--authentication-kubeconfig={self.admin_kubeconfig}",
                     f"--authorization-kubeconfig={self.admin_kubeconfig}")
        self._spawn("kube-controller-manager", kubeconfig, *delegated, "--bind-address=127.0.0.1",
                    f"--secure-port={free_port()}", "--leader-elect=false", f"--controllers={self.controllers}",
                    f"--root-ca-file={self.ca_file}", f"--feature-gates={FEATURE_GATES}")
        self._spawn("kube-scheduler", kubeconfig, *delegated, "--bind-address=127.0.0.1",
                    f"--secure-port={free_port()}", "--leader-elect=false", f"--feature-gates={FEATURE_GATES}")
        stages = self.workdir / "kwok-stages.yaml"
        shutil.copyfile(Path(__file__).with_name("kwok-stages.yaml"), stages)
        self._spawn("kwok", kubeconfig, f"--config={stages}", f"--manage-nodes-with-label-selector={KWOK_LABEL}",
                    "--node-lease-duration-seconds=40", "--cidr=10.1.0.0/16", "--node-ip=127.0.0.2")
        # The serviceaccount controller has made "default" in a namespace: pods may be created.
        def default_account() -> Any:
            self._check_alive()
            return self.core.read_namespaced_service_account("default", "default")

        wait_until(default_account, "kube-controller-manager (the default ServiceAccount)")
        self.started_seconds = time.monotonic() - began
        return self

    def stop(self) -> None:
        """SIGTERM each component, the clients first and etcd last, waiting for each to exit."""
        if self._admin is not None:
            self._admin.close()
            self._admin = None
        for process in reversed(self._processes):
            if process.popen.poll() is None:
                process.popen.send_signal(signal.SIGTERM)
            try:
                process.popen.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.popen.kill()
                process.popen.wait()
        self._processes.clear()
        self.url = ""  # nothing to reset any more

    def _spawn(self, name: str, *args: str) -> None:
        log = self.logs / f"{name}.log"
        with log.open("ab") as out:
            popen = subprocess.Popen([*_DIE_WITH_PARENT, str(self.bin / name), *args], stdout=out,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=self.workdir,
                                     start_new_session=True)
        self._processes.append(_Process(name, popen, log))

    def _apiserver_ready(self) -> bool:
        self._check_alive()
        context = ssl.create_default_context(cafile=str(self.ca_file))
        context.load_cert_chain(*map(str, self.pki.admin))
        with urllib.request.urlopen(f"{self.url}/readyz", context=context, timeout=5) as response:
            return bool(response.status == 200)

    def _check_alive(self) -> None:
        dead = [p for p in self._processes if p.popen.poll() is not None]
        if dead:
            raise ControlPlaneError(f"{dead[0].name} exited with {dead[0].popen.returncode}:\n"
                                    f"{self.log_tails(only=dead[0].name)}")

    def log_tails(self, lines: int = 15, *, only: str = "") -> str:
        """The last lines of every component's log (for a failing test's report)."""
        parts = []
        for log in sorted(self.logs.glob("*.log")):
            if only and log.stem != only:
                continue
            text = log.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"---- {log} (last {len(text)} lines)\n" + "\n".join(text))
        return "\n".join(parts)

    # ---- clients ----
    def _write_admin_kubeconfig(self) -> None:
        cert, key = self.pki.admin
        self.admin_kubeconfig.write_text(yaml.safe_dump(_kubeconfig(self.url, self.ca_file, "admin",
                                                                    {"client-certificate": str(cert),
                                                                     "client-key": str(key)})))

    @property
    def admin(self) -> Any:
        """An ApiClient as cluster admin (system:masters)."""
        if self._admin is None:
            self._admin = config.new_client_from_config(config_file=str(self.admin_kubeconfig))
        return self._admin

    @property
    def core(self) -> Any:
        return client.CoreV1Api(self.admin)

    def unique(self, prefix: str) -> str:
        """A name no other test of this session uses (nodes, namespaces, pods)."""
        return f"{prefix}-{os.getpid() % 1000}-{next(self._names)}"

    # ---- the shipped manifests ----
    def apply_shipped_manifests(self) -> None:
        """kubectl kustomize daemonset, applied server-side as admin; kinds needing CRDs are left out."""
        if self._manifests_applied:
            return
        self._apply_kustomized(REPO / "daemonset")
        # Admission policies take effect once the apiserver's policy informer has seen them.
        self._policy_enforced()
        self._manifests_applied = True

    def apply_dra_manifests(self) -> None:
        """The opt-in DRA grants and admission policy (kubectl kustomize daemonset/dra), after the base."""
        self.apply_shipped_manifests()
        if self._dra_applied:
            return
        self._apply_kustomized(REPO / "daemonset" / "dra")
        self._dra_applied = True

    def _apply_kustomized(self, directory: Path) -> None:
        """`kubectl kustomize DIRECTORY` applied server-side as admin, less the kinds this server cannot serve."""
        rendered = subprocess.run(["kubectl", "kustomize", str(directory)], check=True,
                                  capture_output=True, text=True).stdout
        documents = [d for d in yaml.safe_load_all(rendered) if d and d.get("kind") not in UNSERVED_KINDS]
        self.kubectl("apply", "--server-side", "--force-conflicts", "--field-manager=gpu-health-tests",
                     "-f", "-", input_text=yaml.safe_dump_all(documents))

    def _policy_enforced(self) -> bool:
        """A dry-run patch by the agent's ServiceAccount (impersonated, so without a node-name claim) is denied."""
        probe = self.unique("policy-probe")
        self.core.create_node({"metadata": {"name": probe}})
        impersonated = config.new_client_from_config(config_file=str(self.admin_kubeconfig))
        impersonated.set_default_header("Impersonate-User", AGENT_USER)

        def denied() -> bool:
            try:
                client.CoreV1Api(impersonated).patch_node(probe, {"metadata": {"labels": {"probe": "x"}}},
                                                          dry_run="All")
            except ApiException as exc:
                return "gpu-health-agent-own-node-only" in str(exc.body)  # loaded: it answers
            return False

        try:
            return bool(wait_until(denied, "the ValidatingAdmissionPolicy to be enforced", timeout=60))
        finally:
            impersonated.close()
            self.core.delete_node(probe)

    def kubectl(self, *args: str, input_text: str | None = None) -> str:
        done = subprocess.run(["kubectl", f"--kubeconfig={self.admin_kubeconfig}", *args], input=input_text,
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise ControlPlaneError(f"kubectl {' '.join(args)}: {done.stderr.strip()}")
        return done.stdout

    # ---- nodes, pods, budgets ----
    def add_gpu_node(self, name: str, gpus: int = 8) -> None:
        """A kwok-managed Node labelled as a GPU node, with nvidia.com/gpu capacity; Ready once kwok saw it."""
        resources = {"nvidia.com/gpu": str(gpus), "cpu": "192", "memory": "2Ti", "pods": "110"}
        self.core.create_node({
            "metadata": {"name": name, "labels": {GPU_LABEL: "true", KWOK_LABEL: "kwok",
                                                  "kubernetes.io/hostname": name},
                         "annotations": {"node.alpha.kubernetes.io/ttl": "0"}},
            "status": {"capacity": resources, "allocatable": resources},
        })
        self._created.append(("", "nodes", "", name))
        wait_until(lambda: _schedulable(self.core.read_node(name)), f"node {name} Ready, without the not-ready taint")

    def ensure_namespace(self, namespace: str) -> None:
        try:
            self.core.create_namespace({"metadata": {"name": namespace}})
        except ApiException as exc:
            if exc.status != 409:
                raise
        wait_until(lambda: self.core.read_namespaced_service_account("default", namespace),
                   f"the default ServiceAccount in {namespace}")

    def add_pod(self, namespace: str, name: str, node: str, gpus: int = 1, *, labels: dict[str, str] | None = None,
                grace_seconds: int = 1, service_account: str = "default",
                owner: dict[str, Any] | None = None, wait: bool = True) -> dict[str, Any]:
        """A pod bound to `node` holding `gpus` GPUs; kwok runs it (Running and Ready) as a kubelet would."""
        self.ensure_namespace(namespace)
        resources = {"limits": {"nvidia.com/gpu": str(gpus)}} if gpus else {}
        meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": labels or {"app": name}}
        if owner:
            meta["ownerReferences"] = [owner]
        created = self.core.create_namespaced_pod(namespace, {
            "metadata": meta,
            "spec": {"nodeName": node, "serviceAccountName": service_account,
                     "terminationGracePeriodSeconds": grace_seconds,
                     "tolerations": [{"operator": "Exists"}],
                     "containers": [{"name": "main", "image": "example.invalid/trainer:1", "resources": resources}]},
        })
        self._created.append(("", "pods", namespace, name))
        if wait:
            self.wait_running(namespace, name)
        return dict(self.admin.sanitize_for_serialization(created))

    def wait_running(self, namespace: str, name: str) -> None:
        wait_until(lambda: _ready(self.core.read_namespaced_pod(name, namespace)),
                   f"kwok to run pod {namespace}/{name}")

    def add_pdb(self, namespace: str, name: str, selector: dict[str, str], min_available: int) -> None:
        """A PodDisruptionBudget; returns once the disruption controller has computed its status."""
        self.ensure_namespace(namespace)
        policy = client.PolicyV1Api(self.admin)
        policy.create_namespaced_pod_disruption_budget(namespace, {
            "metadata": {"name": name}, "spec": {"minAvailable": min_available, "selector": {"matchLabels": selector}}})
        self._created.append(("policy", "poddisruptionbudgets", namespace, name))

        def observed() -> bool:
            pdb = policy.read_namespaced_pod_disruption_budget(name, namespace)
            return bool(pdb.status and pdb.status.observed_generation == pdb.metadata.generation)

        wait_until(observed, f"the disruption controller to compute PDB {namespace}/{name}")

    # ---- the agent's identity ----
    def agent_pod(self, node_name: str) -> dict[str, Any]:
        """The agent's pod on `node_name` (as the DaemonSet would make it), created once."""
        self.apply_shipped_manifests()
        name = f"gpu-health-agent-{node_name}"
        try:
            return dict(self.admin.sanitize_for_serialization(self.core.read_namespaced_pod(name, AGENT_NAMESPACE)))
        except ApiException as exc:
            if exc.status != 404:
                raise
        daemonset = client.AppsV1Api(self.admin).read_namespaced_daemon_set("gpu-health-agent", AGENT_NAMESPACE)
        owner = {"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "gpu-health-agent",
                 "uid": daemonset.metadata.uid, "controller": True, "blockOwnerDeletion": True}
        return self.add_pod(AGENT_NAMESPACE, name, node_name, gpus=0, service_account=AGENT_SERVICE_ACCOUNT,
                            labels={"app.kubernetes.io/name": "gpu-health-agent"}, owner=owner, grace_seconds=30)

    def agent_token(self, node_name: str) -> str:
        """A TokenRequest token for the agent's ServiceAccount bound to its pod on `node_name`."""
        pod = self.agent_pod(node_name)
        request = {"spec": {"expirationSeconds": 3600, "boundObjectRef": {
            "apiVersion": "v1", "kind": "Pod", "name": pod["metadata"]["name"], "uid": pod["metadata"]["uid"]}}}
        answer = self.core.create_namespaced_service_account_token(AGENT_SERVICE_ACCOUNT, AGENT_NAMESPACE, request)
        return str(answer.status.token)

    def agent_kubeconfig(self, node_name: str) -> Path:
        """A kubeconfig as the agent of `node_name`: its ServiceAccount, a token bound to its pod there."""
        path = self.workdir / f"agent-{node_name}-{next(self._names)}.kubeconfig"
        path.write_text(yaml.safe_dump(_kubeconfig(self.url, self.ca_file, AGENT_SERVICE_ACCOUNT,
                                                   {"token": self.agent_token(node_name)})))
        return path

    # ---- between tests ----
    def rest(self, method: str, path: str, body: Any = None, **query: str) -> Any:
        """One admin request to `path` (see api_path); the decoded JSON answer, ApiException on an error."""
        url = self.url + path + (f"?{urllib.parse.urlencode(query)}" if query else "")
        response = self.admin.call_api(method, url, header_params={"Accept": "application/json",
                                                                   "Content-Type": "application/json"}, body=body)
        response.read()
        if not 200 <= response.status < 300:
            raise ApiException(http_resp=response)
        return json.loads(response.data)

    def reset(self) -> None:
        """Delete what the tests made, newest first; pods at once, as if their kubelet were gone.
        Namespaces stay: deleting one takes the namespace controller seconds, and names are reused."""
        for group, plural, namespace, name in reversed(self._created):
            query = {"gracePeriodSeconds": "0"} if plural == "pods" else {}
            try:
                self.rest("DELETE", api_path(group, plural, namespace, name), **query)
            except ApiException as exc:
                if exc.status != 404:
                    raise
        self._created.clear()

    def forget(self, group: str, plural: str, namespace: str, name: str) -> None:
        """Track an object a test made through another client, so reset() deletes it."""
        self._created.append((group, plural, namespace, name))


def api_path(group: str, plural: str, namespace: str = "", name: str = "") -> str:
    version, namespaced = RESOURCES[(group, plural)]
    path = f"/apis/{group}/{version}" if group else f"/api/{version}"
    if namespaced and namespace:
        path += f"/namespaces/{namespace}"
    path += f"/{plural}"
    return f"{path}/{name}" if name else path


def _ready(obj: Any) -> bool:
    conditions = (obj.status.conditions if obj.status else None) or []
    return any(c.type == "Ready" and c.status == "True" for c in conditions)


def _schedulable(node: Any) -> bool:
    """Ready (kwok), and the node lifecycle controller has lifted the taint admission gave the new node."""
    return _ready(node) and not any(t.key.startswith("node.kubernetes.io/") for t in node.spec.taints or [])


def _kubeconfig(url: str, ca_file: Path, user: str, credentials: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Config", "current-context": "test",
        "clusters": [{"name": "test", "cluster": {"server": url, "certificate-authority": str(ca_file)}}],
        "users": [{"name": user, "user": credentials}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": user}}],
    }


def audit_events(path: Path, *, user: str = AGENT_USER,
                 stages: tuple[str, ...] = ("ResponseComplete",)) -> list[dict[str, Any]]:
    """The audit log's events for `user` (ResponseComplete stage only, unless `stages` says more)."""
    events = []
    for line in path.read_text().splitlines():
        event = json.loads(line)
        if event.get("user", {}).get("username") == user and event.get("stage") in stages:
            events.append(event)
    return events


def audit_requests(path: Path, *, user: str = AGENT_USER) -> list[dict[str, Any]]:
    """Every request `user` made, once each (by auditID), in order: those answered and the watches still open
    (a long-running request is logged at ResponseStarted, and again when it ends)."""
    seen: dict[str, dict[str, Any]] = {}
    for event in audit_events(path, user=user, stages=("ResponseStarted", "ResponseComplete")):
        seen.setdefault(event["auditID"], event)
    return list(seen.values())
