"""The Helm chart: with default values it renders what the kustomize base does, and its values reach the pods."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import REPO

CHART = REPO / "daemonset" / "helm" / "gpu-health-agent"
MONITORING = ["--api-versions", "monitoring.coreos.com/v1/ServiceMonitor",
              "--api-versions", "monitoring.coreos.com/v1/PrometheusRule"]
# What Helm adds and the kustomize base has no use for: release bookkeeping, and a rollout on config changes.
HELM_ONLY_LABELS = {"app.kubernetes.io/instance", "app.kubernetes.io/managed-by", "app.kubernetes.io/version",
                    "helm.sh/chart"}
HELM_ONLY_ANNOTATIONS = {"checksum/config"}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "ValidatingAdmissionPolicy",
                  "ValidatingAdmissionPolicyBinding"}


@pytest.fixture(scope="module")
def helm() -> str:
    if shutil.which("go") is None and not (REPO / ".tools" / "bin" / "helm").exists():
        pytest.skip("helm is built from Go modules by scripts/build-helm; no Go here")
    built = subprocess.run([str(REPO / "scripts" / "build-helm")], capture_output=True, text=True, check=True,
                           timeout=1200)
    return built.stdout.strip().splitlines()[-1]


def render(helm: str, *args: str, check: bool = True, tests: bool = False) -> subprocess.CompletedProcess[str]:
    """What `helm install` creates (with `tests`: and what `helm test` creates, its hooks)."""
    return subprocess.run([helm, "template", "gha", str(CHART), "--namespace", "gpu-health", *args,
                           *(() if tests else ("--skip-tests",))],
                          capture_output=True, text=True, timeout=120, check=check)


def objects(text: str) -> dict[tuple[str, str], dict[str, Any]]:
    return {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(text) if d}


def comparable(obj: dict[str, Any]) -> dict[str, Any]:
    """One object with what only Helm adds taken out, and the config file parsed so key order does not count."""
    obj = yaml.safe_load(yaml.safe_dump(obj))
    for meta in (obj["metadata"], obj.get("spec", {}).get("template", {}).get("metadata")):
        if not meta:
            continue
        for field, drop in (("labels", HELM_ONLY_LABELS), ("annotations", HELM_ONLY_ANNOTATIONS)):
            kept = {k: v for k, v in (meta.get(field) or {}).items() if k not in drop}
            meta.pop(field, None)
            if kept:
                meta[field] = kept
    if obj["kind"] in CLUSTER_SCOPED:
        obj["metadata"].pop("namespace", None)
    if obj["kind"] == "ConfigMap" and "config.yaml" in obj.get("data", {}):
        obj["data"]["config.yaml"] = yaml.safe_load(obj["data"]["config.yaml"])
    return obj


@pytest.fixture(scope="module")
def kustomized() -> dict[tuple[str, str], dict[str, Any]]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is installed by scripts/test")
    out = subprocess.run(["kubectl", "kustomize", str(REPO / "daemonset")], capture_output=True, text=True,
                         check=True, timeout=120).stdout
    return {key: comparable(obj) for key, obj in objects(out).items()}


def test_the_default_chart_renders_every_object_of_the_kustomize_base(helm, kustomized):
    """Default values on a cluster with the Prometheus Operator: the same objects, field for field."""
    charted = {key: comparable(obj) for key, obj in objects(render(helm, *MONITORING).stdout).items()}
    base = {key: obj for key, obj in kustomized.items() if key[0] != "Namespace"}
    assert sorted(charted) == sorted(base)
    for key, obj in base.items():
        assert charted[key] == obj, f"{key[0]}/{key[1]} differs between the chart and daemonset/"


def test_the_chart_creates_the_base_namespace_only_when_asked(helm, kustomized):
    """namespace.create renders the base's Namespace with its Pod Security label; the default leaves it to helm."""
    assert not any(kind == "Namespace" for kind, _ in objects(render(helm).stdout))
    created = objects(render(helm, "--set", "namespace.create=true").stdout)
    assert comparable(created[("Namespace", "gpu-health")]) == kustomized[("Namespace", "gpu-health")]


def test_without_the_prometheus_operator_no_monitoring_object_is_rendered(helm):
    """The ServiceMonitor and PrometheusRule need their CRDs: without the API the chart still installs."""
    kinds = {kind for kind, _ in objects(render(helm).stdout)}
    assert "ServiceMonitor" not in kinds and "PrometheusRule" not in kinds
    assert "DaemonSet" in kinds


def test_monitoring_objects_can_be_turned_off_where_the_operator_runs(helm):
    """An enable flag per object, for clusters that scrape another way."""
    rendered = objects(render(helm, *MONITORING, "--set", "serviceMonitor.enabled=false",
                              "--set", "prometheusRule.enabled=false").stdout)
    assert not {kind for kind, _ in rendered} & {"ServiceMonitor", "PrometheusRule"}


def test_the_network_policy_admits_only_the_scraper_and_the_probe_on_the_metrics_port(helm):
    """On by default: the agent pods take connections on the metrics port from the configured peers and from
    `helm test`'s probe in their own namespace only."""
    policy = objects(render(helm).stdout)[("NetworkPolicy", "gpu-health-agent")]["spec"]
    assert policy["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": "gpu-health-agent"}}
    assert policy["policyTypes"] == ["Ingress"]
    rule, probe = policy["ingress"]
    assert rule["ports"] == probe["ports"] == [{"port": "metrics", "protocol": "TCP"}]
    assert rule["from"] == [{"namespaceSelector": {}, "podSelector": {"matchLabels": {
        "app.kubernetes.io/name": "prometheus"}}}]
    assert probe["from"] == [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "gpu-health-agent-probe"}}}]


def test_helm_test_probes_each_agent_with_its_own_account_that_reads_only_the_daemonset_and_pods(helm):
    """`helm test` makes a ServiceAccount, a Role that may get the agent's DaemonSet and list pods (nothing
    else), its binding and a Pod running `gpu-health-agent probe` on the agent's namespace, DaemonSet and port;
    all four test hooks, made in that order, deleted once passed; the Pod is no agent pod (not the selector's)."""
    made = {key: obj for key, obj in objects(render(helm, "--set", "metricsPort=9555", tests=True).stdout).items()
            if "helm.sh/hook" in (obj["metadata"].get("annotations") or {})}
    assert sorted(made) == [("Pod", "gpu-health-agent-probe"), ("Role", "gpu-health-agent-probe"),
                            ("RoleBinding", "gpu-health-agent-probe"), ("ServiceAccount", "gpu-health-agent-probe")]
    for obj in made.values():
        annotations = obj["metadata"]["annotations"]
        assert annotations["helm.sh/hook"] == "test"
        assert annotations["helm.sh/hook-delete-policy"] == "before-hook-creation,hook-succeeded"
    weights = {kind: int(obj["metadata"]["annotations"]["helm.sh/hook-weight"]) for (kind, _), obj in made.items()}
    assert weights["ServiceAccount"] < weights["RoleBinding"] < weights["Pod"]
    assert made[("Role", "gpu-health-agent-probe")]["rules"] == [
        {"apiGroups": ["apps"], "resources": ["daemonsets"], "resourceNames": ["gpu-health-agent"], "verbs": ["get"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}]
    pod = made[("Pod", "gpu-health-agent-probe")]
    assert pod["spec"]["serviceAccountName"] == "gpu-health-agent-probe"
    [container] = pod["spec"]["containers"]
    assert container["args"] == ["probe", "--namespace", "gpu-health", "--daemonset", "gpu-health-agent",
                                 "--port", "9555"]
    assert container["securityContext"]["runAsNonRoot"] is True
    agents = objects(render(helm).stdout)[("DaemonSet", "gpu-health-agent")]["spec"]["selector"]["matchLabels"]
    assert not agents.items() <= pod["metadata"]["labels"].items()


def test_the_network_policy_takes_the_operators_peers_and_can_be_turned_off(helm):
    """networkPolicy.from replaces the default peers (a hostNetwork scraper's node CIDR); enabled=false drops it."""
    peers = render(helm, "--set", "networkPolicy.from[0].ipBlock.cidr=10.0.0.0/16").stdout
    rule, _probe = objects(peers)[("NetworkPolicy", "gpu-health-agent")]["spec"]["ingress"]
    assert rule["from"] == [{"ipBlock": {"cidr": "10.0.0.0/16"}}]
    off = objects(render(helm, "--set", "networkPolicy.enabled=false").stdout)
    assert "NetworkPolicy" not in {kind for kind, _ in off}


def test_dra_enabled_renders_exactly_the_objects_of_daemonset_dra(helm):
    """dra.enabled adds the DRA ClusterRole, its binding and the own-devices-only policy, field for field as
    `kubectl apply -k daemonset/dra` would; off by default, and the policy only with admissionPolicy.enabled."""
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is installed by scripts/test")
    out = subprocess.run(["kubectl", "kustomize", str(REPO / "daemonset" / "dra")], capture_output=True, text=True,
                         check=True, timeout=120).stdout
    dra = {key: comparable(obj) for key, obj in objects(out).items()}
    base = objects(render(helm).stdout)
    enabled = {key: comparable(obj) for key, obj in objects(render(helm, "--set", "dra.enabled=true").stdout).items()
               if key not in base}
    assert enabled == dra
    assert not set(dra) & set(base)
    without_policy = objects(render(helm, "--set", "dra.enabled=true", "--set", "admissionPolicy.enabled=false").stdout)
    assert {kind for kind, _ in set(without_policy) & set(dra)} == {"ClusterRole", "ClusterRoleBinding"}


def test_fleet_enabled_renders_exactly_the_objects_of_daemonset_fleet(helm):
    """fleet.enabled adds the fleet controller's Deployment, ServiceAccount, RBAC, PodDisruptionBudget, Service,
    NetworkPolicy, ServiceMonitor and PrometheusRule, field for field as `kubectl apply -k daemonset/fleet`
    would (on a cluster with the Prometheus Operator); off by default."""
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is installed by scripts/test")
    out = subprocess.run(["kubectl", "kustomize", str(REPO / "daemonset" / "fleet")], capture_output=True, text=True,
                         check=True, timeout=120).stdout
    fleet = {key: comparable(obj) for key, obj in objects(out).items()}
    base = objects(render(helm, *MONITORING).stdout)
    enabled = {key: comparable(obj) for key, obj in
               objects(render(helm, *MONITORING, "--set", "fleet.enabled=true").stdout).items() if key not in base}
    assert enabled == fleet
    assert not set(fleet) & set(base)


def test_fleet_values_reach_the_controller(helm):
    """replicas, the rack label and extra options reach the Deployment."""
    rendered = objects(render(helm, "--set", "fleet.enabled=true", "--set", "fleet.replicas=3",
                              "--set", "fleet.rackLabel=example.com/rack", "--set-json",
                              'fleet.extraArgs=["--min-nodes","5"]').stdout)
    deployment = rendered[("Deployment", "gpu-health-fleet")]
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    assert deployment["spec"]["replicas"] == 3
    assert container["args"] == ["fleet", "run", "--rack-label", "example.com/rack", "--gpu-node-selector",
                                 "nvidia.com/gpu.present=true", "--min-nodes", "5"]


def test_one_gpu_node_selector_reaches_the_agents_and_the_controller(helm):
    """gpuNodeSelector is the agents' remediation.gpu_node_selector and the controller's census selector."""
    rendered = objects(render(helm, "--set", "fleet.enabled=true", "--set", "gpuNodeSelector=example.com/gpu").stdout)
    [container] = rendered[("Deployment", "gpu-health-fleet")]["spec"]["template"]["spec"]["containers"]
    config = yaml.safe_load(rendered[("ConfigMap", "gpu-health-agent-config")]["data"]["config.yaml"])
    assert config["remediation"]["gpu_node_selector"] == "example.com/gpu"
    assert container["args"][container["args"].index("--gpu-node-selector") + 1] == "example.com/gpu"


def test_dra_values_reach_the_agent_config(helm):
    """dra.taintEffect and dra.taintDegraded become remediation.device_taint_effect and device_taint_degraded."""
    rendered = objects(render(helm, "--set", "dra.taintEffect=NoExecute", "--set", "dra.taintDegraded=true").stdout)
    config = yaml.safe_load(rendered[("ConfigMap", "gpu-health-agent-config")]["data"]["config.yaml"])
    assert (config["remediation"]["device_taint_effect"], config["remediation"]["device_taint_degraded"]) == (
        "NoExecute", True)


def test_values_reach_the_agent_config_and_the_pod(helm):
    """Image, mode, budget, isolation, runtime class, node selector, tolerations and resources are honoured."""
    rendered = objects(render(helm, "--namespace", "gpu", "--set", "image.repository=registry.example/gha",
                              "--set", "image.tag=9.9", "--set", "mode=remediate", "--set", "budget.maxNodes=3",
                              "--set", "isolation=device", "--set", "runtimeClassName=nvidia",
                              "--set", "nodeSelector.pool=gpu", "--set", "resources.limits.memory=1Gi",
                              "--set", "tolerations=null").stdout)
    config = yaml.safe_load(rendered[("ConfigMap", "gpu-health-agent-config")]["data"]["config.yaml"])
    assert (config["mode"], config["remediation"]["budget_max_nodes"]) == ("remediate", 3)
    assert (config["remediation"]["isolation"], config["remediation"]["namespace"]) == ("device", "gpu")
    pod = rendered[("DaemonSet", "gpu-health-agent")]["spec"]["template"]["spec"]
    assert [c["image"] for c in pod["containers"]] == ["registry.example/gha:9.9"] * 2  # the agent, gpu-reset
    assert (pod["runtimeClassName"], pod["nodeSelector"]) == ("nvidia", {"pool": "gpu"})
    assert pod["containers"][0]["resources"]["limits"]["memory"] == "1Gi"
    assert pod["tolerations"] == [{"key": "gpu-health-agent.io/unhealthy", "operator": "Exists"},  # its own taints
                                  {"key": "gpu-health-agent.io/gpu-reset-pause", "operator": "Exists"}]


def test_without_the_kmsg_device_plugin_the_agent_mounts_the_kernel_log_by_host_path(helm):
    """kmsgDevicePlugin.enabled=false: no plugin DaemonSet, no resource request, /dev/kmsg by hostPath."""
    rendered = objects(render(helm, "--set", "kmsgDevicePlugin.enabled=false").stdout)
    assert ("DaemonSet", "gpu-health-kmsg-device") not in rendered
    agent = rendered[("DaemonSet", "gpu-health-agent")]["spec"]["template"]["spec"]["containers"][0]
    assert "gpu-health-agent.io/kmsg" not in agent["resources"]["limits"]
    assert {"name": "kmsg", "mountPath": "/dev/kmsg", "readOnly": True} in agent["volumeMounts"]


def test_the_kmsg_device_plugin_values_reach_the_plugin_and_the_agents_request(helm):
    """A renamed resource is both advertised by the plugin and requested by the agent; devices and permissions."""
    rendered = objects(render(helm, "--set", "kmsgDevicePlugin.resourceName=example.com/kmsg",
                              "--set", "kmsgDevicePlugin.devices=2", "--set", "kmsgDevicePlugin.permissions=r").stdout)
    plugin = rendered[("DaemonSet", "gpu-health-kmsg-device")]["spec"]["template"]["spec"]["containers"][0]
    assert plugin["args"] == ["kmsg-device-plugin", "--resource", "example.com/kmsg", "--devices", "2",
                              "--permissions", "r"]
    agent = rendered[("DaemonSet", "gpu-health-agent")]["spec"]["template"]["spec"]["containers"][0]
    assert agent["resources"]["limits"]["example.com/kmsg"] == "1"


def test_the_rendered_config_is_one_the_agent_accepts(helm, tmp_path: Path):
    """The chart's config.yaml passes the agent's own strict validation (unknown keys are errors)."""
    from agent.config import load_config

    rendered = objects(render(helm, "--set", "isolation=node", "--set", "extraConfig.tick_seconds=2").stdout)
    path = tmp_path / "config.yaml"
    path.write_text(rendered[("ConfigMap", "gpu-health-agent-config")]["data"]["config.yaml"])
    config = load_config(path, env={"NODE_NAME": "n"})
    assert (config.remediation.isolation, config.tick_seconds) == ("node", 2.0)


def test_a_rules_override_replaces_a_shipped_file_and_adds_new_ones(helm):
    """rules.overrides maps file names to YAML text: same name replaces, a new name adds."""
    rendered = objects(render(helm, "--set-string", "rules.overrides.local\\.yaml=rules: []",
                              "--set-string", "rules.overrides.xid\\.yaml=rules: []").stdout)
    data = rendered[("ConfigMap", "gpu-health-agent-rules")]["data"]
    assert data["local.yaml"] == "rules: []" and data["xid.yaml"] == "rules: []"
    assert "memory.yaml" in data


def test_the_values_schema_rejects_an_unknown_mode_in_one_line(helm):
    """values.schema.json: a typo in a value fails before anything reaches the cluster."""
    result = render(helm, "--set", "mode=fix-everything", check=False)
    assert result.returncode != 0
    assert "mode" in result.stderr


def test_the_values_schema_rejects_an_unknown_key(helm):
    """A misspelt top-level key is an error, not a silently ignored value."""
    result = render(helm, "--set", "isolaton=device", check=False)
    assert result.returncode != 0
    assert "isolaton" in result.stderr


def lint(helm: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([helm, "lint", "--strict", str(CHART), *args], capture_output=True, text=True, timeout=120,
                          check=False)


@pytest.mark.parametrize("setting, misspelt", [
    ("extraConfig.remediation.taint_keyy=x", "taint_keyy"),  # the agent's own configuration, from its model
    ("extraConfig.sources.nvml.poll_secondz=5", "poll_secondz"),
    ("sources.dcgm.exporter_ulr=http://127.0.0.1:9400/metrics", "exporter_ulr"),
    ("resources.limits.cpuu=1", "cpuu"),
    ("fleet.resources.limts.cpu=1", "limts"),
    ("tolerations[0].efect=NoSchedule", "efect"),
    ("affinity.nodeAfinity.x=1", "nodeAfinity"),
    ("networkPolicy.from[0].podSelectr.x=1", "podSelectr"),
    ("kmsgDevicePlugin.devicez=2", "devicez"),
    ("serviceMonitor.enabeld=true", "enabeld"),
])
def test_helm_lint_strict_rejects_a_misspelt_value_at_any_depth(helm, setting: str, misspelt: str):
    """values.schema.json closes every object (tests/unit/test_values_schema.py): the lint names the key."""
    result = lint(helm, "--set", setting)
    assert result.returncode != 0
    assert misspelt in result.stdout + result.stderr


@pytest.mark.parametrize("setting", [
    "extraConfig.remediation.cordon=true",
    "resources.limits.nvidia\\.com/gpu=1",
    "resources.requests.hugepages-2Mi=1Gi",
    "tolerations[0].key=example.com/x,tolerations[0].operator=Exists,tolerations[0].effect=NoExecute",
])
def test_helm_lint_strict_accepts_what_kubernetes_and_the_agent_accept(helm, setting: str):
    result = lint(helm, "--set", setting)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("copy, source", [
    ("files/rbac.yaml", "daemonset/rbac.yaml"),
    ("files/admission-policy.yaml", "daemonset/admission-policy.yaml"),
    ("files/dra/rbac.yaml", "daemonset/dra/rbac.yaml"),
    ("files/dra/admission-policy.yaml", "daemonset/dra/admission-policy.yaml"),
    ("files/fleet/serviceaccount.yaml", "daemonset/fleet/serviceaccount.yaml"),
    ("files/fleet/rbac.yaml", "daemonset/fleet/rbac.yaml"),
    ("files/fleet/admission-policy.yaml", "daemonset/fleet/admission-policy.yaml"),
    ("files/fleet/pdb.yaml", "daemonset/fleet/pdb.yaml"),
    ("files/fleet/service.yaml", "daemonset/fleet/service.yaml"),
    ("files/alerts/gpu-health-alerts.yaml", "daemonset/alerts/gpu-health-alerts.yaml"),
    ("files/alerts/gpu-health-fleet-alerts.yaml", "daemonset/alerts/gpu-health-fleet-alerts.yaml"),
    *[(f"files/rules/{p.name}", f"rules/{p.name}") for p in sorted((REPO / "rules").glob("*.yaml"))],
])
def test_the_charts_copies_are_current(copy: str, source: str):
    """helm reads nothing outside the chart: its copies of the base's files must equal them."""
    assert (CHART / copy).read_bytes() == (REPO / source).read_bytes(), "run scripts/sync-deploy-rules"


def test_without_driver_files_the_nvidia_runtime_injects_the_driver_as_before(helm):
    """driverFiles.enabled=false: no init container, no NVIDIA device-node resource, NVIDIA_VISIBLE_DEVICES=all."""
    rendered = objects(render(helm, "--set", "driverFiles.enabled=false").stdout)
    spec = rendered[("DaemonSet", "gpu-health-agent")]["spec"]["template"]["spec"]
    assert "initContainers" not in spec
    for container in spec["containers"]:
        assert {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"} in container["env"]
        assert "gpu-health-agent.io/nvidia-devices" not in (container["resources"].get("limits") or {})
    plugin = rendered[("DaemonSet", "gpu-health-kmsg-device")]["spec"]["template"]["spec"]
    assert [c["name"] for c in plugin["containers"]] == ["kmsg-device-plugin"]
    assert [v["name"] for v in plugin["volumes"]] == ["device-plugins"]


def test_the_driver_root_value_reaches_the_init_containers_host_path(helm):
    """driverFiles.driverRoot (e.g. /run/nvidia/driver alone) is the hostPath the init container copies from."""
    rendered = objects(render(helm, "--set", "driverFiles.driverRoot=/run/nvidia/driver",
                              "--set", "driverFiles.waitSeconds=30").stdout)
    spec = rendered[("DaemonSet", "gpu-health-agent")]["spec"]["template"]["spec"]
    [root] = [v for v in spec["volumes"] if v["name"] == "driver-root"]
    assert root["hostPath"]["path"] == "/run/nvidia/driver"
    assert spec["initContainers"][0]["args"][-2:] == ["--wait-seconds", "30"]
