"""What an operator installs: manifests, RBAC, alerts and runbooks, checked as files."""

import json
import re
from pathlib import Path

import pytest
import yaml

from agent.config import Config, load_config
from agent.fleet.published import HOLDS_CONFIGMAP, LEASE_NAME
from tests.conftest import REPO

DEPLOY = REPO / "daemonset"
ALERTS = yaml.safe_load((DEPLOY / "alerts" / "gpu-health-alerts.yaml").read_text())
FLEET_ALERTS = yaml.safe_load((DEPLOY / "alerts" / "gpu-health-fleet-alerts.yaml").read_text())
ALERT_RULES = [r for g in ALERTS["groups"] for r in g["rules"]]
FLEET_ALERT_RULES = [r for g in FLEET_ALERTS["groups"] for r in g["rules"]]


def manifests(name):
    return [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d]


def test_the_deployed_rules_are_the_repository_rules():
    shipped = {p.name: p.read_bytes() for p in (REPO / "rules").glob("*.yaml")}
    deployed = {p.name: p.read_bytes() for p in (DEPLOY / "rules").glob("*.yaml")}
    assert deployed == shipped, "run scripts/sync-deploy-rules"


def test_the_kustomization_generates_every_rules_file():
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    [rules] = [g for g in kustomization["configMapGenerator"] if g["name"] == "gpu-health-agent-rules"]
    assert sorted(rules["files"]) == sorted(f"rules/{p.name}" for p in (REPO / "rules").glob("*.yaml"))


def test_the_prometheus_rule_wraps_the_alert_file():
    [rule] = manifests("prometheusrule.yaml")
    assert rule["spec"]["groups"] == ALERTS["groups"], "run scripts/sync-deploy-rules"


def test_the_fleet_controllers_prometheus_rule_wraps_its_alert_file():
    """The alerts for the controller's own absence ship with the controller only (daemonset/fleet)."""
    [rule] = manifests("fleet/prometheusrule.yaml")
    assert rule["spec"]["groups"] == FLEET_ALERTS["groups"], "run scripts/sync-deploy-rules"


@pytest.mark.parametrize("rule", ALERT_RULES + FLEET_ALERT_RULES, ids=lambda r: r["alert"])
def test_every_alert_has_severity_summary_description_and_a_runbook(rule):
    assert rule["labels"]["severity"] in {"critical", "warning", "info"}
    assert rule["annotations"]["summary"] and rule["annotations"]["description"]
    url = rule["annotations"]["runbook_url"]
    assert url.endswith(f"docs/runbooks/{rule['alert']}.md")
    assert (REPO / "docs" / "runbooks" / f"{rule['alert']}.md").is_file()


def test_every_alert_has_a_promtool_test():
    tests = (DEPLOY / "alerts" / "tests.yaml").read_text()
    for rule in ALERT_RULES:
        assert f"alertname: {rule['alert']}" in tests
    fleet_tests = (DEPLOY / "alerts" / "fleet-tests.yaml").read_text()
    for rule in FLEET_ALERT_RULES:
        assert f"alertname: {rule['alert']}" in fleet_tests


@pytest.mark.parametrize("rule", [r for r in ALERT_RULES if "gpu_health_gpu_status" in r["expr"]],
                         ids=lambda r: r["alert"])
def test_a_gpu_alert_keeps_every_label_dcgm_exporter_names_a_gpu_by(rule):
    """An alert per GPU keeps gpu (the index), UUID, pci_bus_id, modelName and Hostname, so a route or an
    inhibition can match dcgm-exporter's alerts on the same GPU."""
    from agent.metrics import GPU_LABELS
    [grouped] = re.findall(r"by \(([^)]*)\)", rule["expr"])
    assert set(GPU_LABELS) <= {label.strip() for label in grouped.split(",")}


@pytest.mark.parametrize("fault_class", ["application", "driver", "hardware", "interconnect", "telemetry"])
def test_every_fault_class_has_a_runbook(fault_class):
    text = (REPO / "docs" / "runbooks" / f"fault-class-{fault_class}.md").read_text()
    for section in ("What it means", "How to confirm", "What the agent already did", "What to do next",
                    "How to release the node"):
        assert f"## {section}" in text


def test_rbac_grants_nothing_on_secrets_and_deletes_only_leases():
    """No secrets, no wildcard, no deletecollection; delete only on Leases (the admission policy narrows it to the
    agent's own budget slot)."""
    for document in manifests("rbac.yaml"):
        for rule in document.get("rules", []):
            assert "secrets" not in rule["resources"]
            assert "deletecollection" not in rule["verbs"]
            assert "delete" not in rule["verbs"] or rule["resources"] == ["leases"]
            assert "*" not in rule["verbs"] and "*" not in rule["resources"]


def test_rbac_grants_exactly_what_the_agent_does():
    [cluster_role] = [d for d in manifests("rbac.yaml") if d["kind"] == "ClusterRole"]
    grants = {(g, r): set(rule["verbs"]) for rule in cluster_role["rules"] for g in rule["apiGroups"]
              for r in rule["resources"]}
    # The real server's audit log decides this set: tests/realcluster/test_rbac_from_use.py.
    assert grants == {("", "nodes"): {"get", "list", "watch", "patch"}, ("", "nodes/status"): {"patch"},
                      ("", "pods"): {"list"}, ("", "pods/eviction"): {"create"},
                      ("events.k8s.io", "events"): {"create", "patch"}}
    [role] = [d for d in manifests("rbac.yaml") if d["kind"] == "Role"]
    assert role["metadata"]["namespace"] == "gpu-health"
    assert [(r["resources"], r.get("resourceNames")) for r in role["rules"]] == [
        (["leases"], None), (["configmaps"], [HOLDS_CONFIGMAP])]  # the fleet's holds: get, by name only


def test_the_fleet_controller_is_granted_exactly_what_it_does():
    """daemonset/fleet/rbac.yaml: nodes list/watch, Events create; in its namespace only the holds ConfigMap
    and the leader Lease by name (create cannot be limited by name); nothing else, never delete."""
    documents = manifests("fleet/rbac.yaml")
    [cluster_role] = [d for d in documents if d["kind"] == "ClusterRole"]
    assert {(g, r): set(rule["verbs"]) for rule in cluster_role["rules"] for g in rule["apiGroups"]
            for r in rule["resources"]} == {("", "nodes"): {"list", "watch"}, ("events.k8s.io", "events"): {"create"}}
    [role] = [d for d in documents if d["kind"] == "Role"]
    assert role["metadata"]["namespace"] == "gpu-health"
    grants = {(g, r, tuple(rule.get("resourceNames", ())), v) for rule in role["rules"] for g in rule["apiGroups"]
              for r in rule["resources"] for v in rule["verbs"]}
    assert grants == {("", "configmaps", (), "create"), ("coordination.k8s.io", "leases", (), "create"),
                      ("", "configmaps", (HOLDS_CONFIGMAP,), "get"), ("", "configmaps", (HOLDS_CONFIGMAP,), "update"),
                      ("coordination.k8s.io", "leases", (LEASE_NAME,), "get"),
                      ("coordination.k8s.io", "leases", (LEASE_NAME,), "update")}
    bound = {d["kind"]: d["subjects"][0]["name"] for d in documents if d["kind"].endswith("Binding")}
    assert bound == {"ClusterRoleBinding": "gpu-health-fleet", "RoleBinding": "gpu-health-fleet"}


def test_the_fleet_controller_runs_unprivileged_as_the_fleet_service_account():
    """No root, no host access, a read-only root filesystem; `fleet run` on its own ServiceAccount."""
    [deployment] = manifests("fleet/deployment.yaml")
    spec = deployment["spec"]["template"]["spec"]
    [container] = spec["containers"]
    assert spec["serviceAccountName"] == "gpu-health-fleet" and container["args"][:2] == ["fleet", "run"]
    assert container["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert not {"hostPID", "hostNetwork", "volumes"} & set(spec)


def test_the_fleet_controllers_probes_have_their_own_port_that_nothing_else_reaches():
    """Liveness and readiness on `health` (`fleet run --health-port`), which neither the Service nor the
    NetworkPolicy opens: a flood of connections to the metrics port never fails a probe."""
    [deployment] = manifests("fleet/deployment.yaml")
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"metrics": 9102, "health": 9103}
    assert container["livenessProbe"]["httpGet"]["port"] == container["readinessProbe"]["httpGet"]["port"] == "health"
    [service] = manifests("fleet/service.yaml")
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["metrics"]
    [policy] = manifests("fleet/networkpolicy.yaml")
    [rule] = policy["spec"]["ingress"]
    assert policy["spec"]["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": "gpu-health-fleet"}}
    assert rule["ports"] == [{"port": "metrics", "protocol": "TCP"}]


def test_a_drain_never_takes_both_fleet_controller_replicas():
    """A PodDisruptionBudget keeps one of the two replicas through voluntary evictions (a drain, an agent's)."""
    [pdb] = manifests("fleet/pdb.yaml")
    [deployment] = manifests("fleet/deployment.yaml")
    assert pdb["spec"]["minAvailable"] == 1 and deployment["spec"]["replicas"] == 2
    assert pdb["spec"]["selector"] == deployment["spec"]["selector"]


def test_every_rbac_rule_says_why():
    text = (DEPLOY / "rbac.yaml").read_text()
    cluster_role = text.split("---")[0]
    assert len(re.findall(r"^# ", cluster_role, re.M)) >= 1 + len(manifests("rbac.yaml")[0]["rules"])


def daemonset():
    [ds] = manifests("daemonset.yaml")
    return ds["spec"]["template"]["spec"]


def containers() -> dict[str, dict]:
    return {c["name"]: c for c in daemonset()["containers"]}


def test_the_daemonset_runs_least_privileged():
    container = containers()["agent"]
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"], "add": ["SYSLOG"]}
    assert security["privileged"] is False


def test_the_agent_gets_the_kernel_log_from_the_kmsg_device_plugin_not_a_host_path():
    """/dev/kmsg is requested as the plugin's resource (the device cgroup allows it only so), never mounted."""
    agent = containers()["agent"]
    assert agent["resources"]["limits"]["gpu-health-agent.io/kmsg"] == "1"  # a string, as API clients validate it
    assert not any(m["mountPath"] == "/dev/kmsg" for m in agent["volumeMounts"])
    assert not any(v.get("hostPath", {}).get("path") == "/dev/kmsg" for v in daemonset()["volumes"])
    [plugin] = manifests("kmsg-device-plugin.yaml")
    assert plugin["spec"]["template"]["spec"]["affinity"] == daemonset()["affinity"]
    assert "kmsg-device-plugin.yaml" in yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())["resources"]


def test_the_kmsg_device_plugin_holds_no_capability_and_mounts_only_the_device_plugin_directory():
    """No capability, no privilege, a read-only root, no API token; the kubelet's plugin directory, and for the
    NVIDIA device nodes' container the host's /dev read-only (listed, never opened)."""
    [plugin] = manifests("kmsg-device-plugin.yaml")
    spec = plugin["spec"]["template"]["spec"]
    kmsg, nvidia = spec["containers"]
    for container in (kmsg, nvidia):
        security = container["securityContext"]
        assert security["capabilities"] == {"drop": ["ALL"]}
        assert (security["privileged"], security["allowPrivilegeEscalation"],
                security["readOnlyRootFilesystem"]) == (False, False, True)
    assert kmsg["args"][:3] == ["kmsg-device-plugin", "--resource", "gpu-health-agent.io/kmsg"]
    assert nvidia["args"][:3] == ["kmsg-device-plugin", "--resource", "gpu-health-agent.io/nvidia-devices"]
    assert [m["name"] for m in kmsg["volumeMounts"]] == ["device-plugins"]
    assert {m["name"]: m.get("readOnly", False) for m in nvidia["volumeMounts"]} == {"device-plugins": False,
                                                                                     "host-dev": True}
    assert spec["automountServiceAccountToken"] is False
    assert [v["hostPath"]["path"] for v in spec["volumes"]] == ["/var/lib/kubelet/device-plugins", "/dev"]
    assert not any(spec.get(k) for k in ("hostPID", "hostNetwork", "hostIPC"))
    assert spec["tolerations"] == daemonset()["tolerations"]


def test_the_reset_container_holds_exactly_the_privileges_a_reset_needs():
    """CAP_SYS_ADMIN for nvidia-smi --gpu-reset, nothing more: no SYS_PTRACE, no host path (so no host /proc)."""
    assert set(containers()) == {"agent", "gpu-reset"}
    reset = containers()["gpu-reset"]
    security = reset["securityContext"]
    assert security["privileged"] is False and security["allowPrivilegeEscalation"] is False
    assert security["readOnlyRootFilesystem"] is True
    assert security["capabilities"] == {"drop": ["ALL"], "add": ["SYS_ADMIN"]}
    assert reset["args"][0] == "reset-helper"
    assert {m["mountPath"]: m.get("readOnly", False) for m in reset["volumeMounts"]} == {
        "/run/gpu-health-agent": False, "/etc/gpu-health-agent/config": True, "/nvidia": True}
    spec = daemonset()
    host_paths = {v["name"] for v in spec["volumes"] if "hostPath" in v}
    assert not host_paths & {m["name"] for m in reset["volumeMounts"]}
    assert not any(spec.get(k) for k in ("hostPID", "hostNetwork", "hostIPC"))


def test_the_agent_tolerates_its_own_reset_pause_taint():
    """An agent (and its device plugin) restarted mid-reset must start on the node to lift the pause's taint."""
    from agent.k8s.node_marks import RESET_PAUSE_TAINT

    [plugin] = manifests("kmsg-device-plugin.yaml")
    for spec in (daemonset(), plugin["spec"]["template"]["spec"]):
        assert {"key": RESET_PAUSE_TAINT, "operator": "Exists"} in spec["tolerations"]


def test_the_agents_containers_need_no_nvidia_runtime_injection():
    """NVIDIA_VISIBLE_DEVICES=void (the runtime injects nothing, so its failure for a GPU needing a reset cannot
    stop the pod, NVSentinel PR #1243): the device nodes from the agent's plugin, NVML and nvidia-smi from the
    init container's copy."""
    for name in ("agent", "gpu-reset"):
        container = containers()[name]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["NVIDIA_VISIBLE_DEVICES"] == "void" and env["LD_LIBRARY_PATH"] == "/nvidia/lib"
        assert container["resources"]["limits"]["gpu-health-agent.io/nvidia-devices"] == "1"
        assert {"name": "nvidia", "mountPath": "/nvidia", "readOnly": True} in container["volumeMounts"]
    assert env["PATH"].startswith("/nvidia/bin:")  # the reset helper's nvidia-smi


def test_only_the_unprivileged_init_container_mounts_the_driver_root():
    """driver-files reads the host's / read-only with no capability; no running container has the driver root."""
    [init] = daemonset()["initContainers"]
    assert init["args"][:5] == ["driver-files", "--root", "/driver-root", "--to", "/nvidia"]
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert init["securityContext"]["privileged"] is False
    [mount] = [m for m in init["volumeMounts"] if m["name"] == "driver-root"]
    assert mount["readOnly"] is True and mount["mountPropagation"] == "HostToContainer"
    assert not any(m["name"] == "driver-root" for c in containers().values() for m in c["volumeMounts"])
    [root] = [v for v in daemonset()["volumes"] if v["name"] == "driver-root"]
    assert root["hostPath"] == {"path": "/", "type": "Directory"}


def test_the_agent_and_the_reset_container_share_the_configured_socket():
    """The agent asks the gpu-reset container over the socket the shipped config names, in their shared volume."""
    config = load_config(DEPLOY / "config.yaml", env={"NODE_NAME": "n"})
    socket_dir = str(Path(config.remediation.reset_helper_socket).parent)
    for name in ("agent", "gpu-reset"):
        assert socket_dir in {m["mountPath"] for m in containers()[name]["volumeMounts"]}
    assert config.remediation.reset_proc_root == "/proc"  # the reset container's own: it has no host /proc


def test_the_daemonset_knows_its_node_and_is_probed():
    spec = daemonset()
    container = containers()["agent"]
    env = {e["name"]: e for e in container["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert spec["priorityClassName"] == "system-node-critical"
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert {"/var/lib/kubelet/pod-resources", "/var/lib/gpu-health-agent"} <= mounts


def test_the_daemonset_tolerates_the_agents_own_taint():
    keys = {t["key"] for t in daemonset()["tolerations"]}
    assert Config().remediation.taint_key in keys


def test_the_deployed_config_is_valid(tmp_path: Path):
    config = load_config(DEPLOY / "config.yaml", env={"NODE_NAME": "n"})
    assert config.rules_dir == "/etc/gpu-health-agent/rules"
    assert config.remediation.taint_effect == "NoSchedule"


def test_the_admission_policy_pins_the_agent_to_its_own_node():
    policy, binding, *_ = manifests("admission-policy.yaml")
    expression = policy["spec"]["validations"][0]["expression"]
    assert "authentication.kubernetes.io/node-name" in expression and "object.metadata.name" in expression
    assert "system:serviceaccount:gpu-health:gpu-health-agent" in policy["spec"]["matchConditions"][0]["expression"]
    assert binding["spec"]["validationActions"] == ["Deny"]


def test_the_admission_policy_pins_every_lease_write_to_the_agents_own_slot():
    """Create, update and delete of any Lease by the agent must name its own node's slot (its token's node)."""
    *_, policy, binding = manifests("admission-policy.yaml")
    [rule] = policy["spec"]["matchConstraints"]["resourceRules"]
    assert (rule["resources"], set(rule["operations"])) == (["leases"], {"CREATE", "UPDATE", "DELETE"})
    variables = {v["name"]: v["expression"] for v in policy["spec"]["variables"]}
    assert "authentication.kubernetes.io/node-name" in variables["nodes"]
    assert "'gpu-health-slot-' + variables.nodes[0]" in variables["own"]
    assert policy["spec"]["validations"][0]["expression"] == "variables.own"
    assert (binding["spec"]["policyName"], binding["spec"]["validationActions"]) == (policy["metadata"]["name"],
                                                                                    ["Deny"])


def test_the_fleet_controller_may_create_only_its_holds_and_its_lease():
    """daemonset/fleet/admission-policy.yaml: the fleet ServiceAccount's creates of ConfigMaps and Leases must
    name its holds object and its leader Lease (never the pause Lease or a slot)."""
    policy, binding = manifests("fleet/admission-policy.yaml")
    rules = {(tuple(r["apiGroups"]), tuple(r["resources"]), tuple(r["operations"]))
             for r in policy["spec"]["matchConstraints"]["resourceRules"]}
    assert rules == {(("",), ("configmaps",), ("CREATE",)), (("coordination.k8s.io",), ("leases",), ("CREATE",))}
    assert ":gpu-health-fleet'" in policy["spec"]["matchConditions"][0]["expression"]
    [validation] = policy["spec"]["validations"]
    assert f"== '{HOLDS_CONFIGMAP}'" in validation["expression"] and f"== '{LEASE_NAME}'" in validation["expression"]
    assert (binding["spec"]["policyName"], binding["spec"]["validationActions"]) == (policy["metadata"]["name"],
                                                                                    ["Deny"])
    assert "admission-policy.yaml" in (DEPLOY / "fleet" / "kustomization.yaml").read_text()


def test_the_dashboard_covers_what_operators_ask():
    dashboard = json.loads((REPO / "docs" / "grafana" / "gpu-health-dashboard.json").read_text())
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p["targets"])
    for metric in ("gpu_health_gpu_status", "gpu_health_verdicts_total", "gpu_health_remediation_steps_total",
                   "gpu_health_detection_latency_seconds_bucket", "gpu_health_time_to_recovery_seconds_bucket"):
        assert metric in exprs


def test_the_dashboard_joins_dcgm_exporter_on_the_labels_the_agent_exports():
    """Its GPU panels name GPUs by dcgm-exporter's labels and join DCGM_FI_* series on UUID, never on `gpu`."""
    dashboard = json.loads((REPO / "docs" / "grafana" / "gpu-health-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert any("DCGM_FI_" in e and "on (UUID)" in e for e in exprs)
    assert not [e for e in exprs if re.search(r"\bon \(gpu\)|\bby \(gpu\)|\bby \(model,", e)]
