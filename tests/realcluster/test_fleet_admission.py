"""daemonset/fleet/admission-policy.yaml on the real control plane: the fleet controller's token may create
its holds ConfigMap and its leader Lease, and no other ConfigMap or Lease (never the pause or a slot Lease).
Every create here is a dry run (admission runs; nothing is stored, so no other test is paused)."""

from __future__ import annotations

from typing import Any

import pytest

from agent.fleet.published import HOLDS_CONFIGMAP, LEASE_NAME
from agent.k8s.errors import Conflict, Forbidden
from agent.k8s.raw import RawApi, api_path
from tests.realcluster.controlplane import AGENT_NAMESPACE, wait_until
from tests.realcluster.test_fleet import fleet_client

pytestmark = pytest.mark.usefixtures("no_retry_sleep")
POLICY = "gpu-health-fleet-own-objects-only"


def create(raw: RawApi, kind: str, name: str) -> Any:
    """A dry-run create of a ConfigMap or a Lease named `name` in the agent's namespace."""
    if kind == "configmap":
        path = api_path("", "v1", "configmaps", namespace=AGENT_NAMESPACE)
        body: dict[str, Any] = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}}
    else:
        path = api_path("coordination.k8s.io", "v1", "leases", namespace=AGENT_NAMESPACE)
        body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": name}, "spec": {}}
    return raw.request("POST", path, query={"dryRun": "All"}, body=body)


def denied_by_policy(raw: RawApi, kind: str, name: str) -> bool:
    try:
        create(raw, kind, name)
    except Forbidden as exc:
        return POLICY in str(exc)
    except Conflict:  # AlreadyExists comes from storage, after admission: the policy is not enforced yet
        return False
    return False


@pytest.mark.parametrize(("kind", "name"), [("lease", "gpu-health-pause"), ("lease", "gpu-health-slot-n1"),
                                            ("configmap", "gpu-health-agent-config")])
def test_the_fleet_controller_may_not_create_another_lease_or_configmap(control_plane, kind, name):
    """The pause Lease, a budget slot, the agent's own config: denied at admission, naming the policy."""
    raw = RawApi(fleet_client(control_plane))
    assert wait_until(lambda: denied_by_policy(raw, kind, name), f"{POLICY} to deny {kind} {name}")


@pytest.mark.parametrize(("kind", "name"), [("lease", LEASE_NAME), ("configmap", HOLDS_CONFIGMAP)])
def test_the_fleet_controller_may_create_its_own_lease_and_holds(control_plane, kind, name):
    """Its leader Lease and its holds ConfigMap pass admission (once the policy answers at all)."""
    raw = RawApi(fleet_client(control_plane))
    wait_until(lambda: denied_by_policy(raw, "lease", "gpu-health-pause"), f"{POLICY} to be enforced")
    try:
        create(raw, kind, name)
    except Forbidden as exc:
        pytest.fail(f"denied: {exc}")
    except Conflict as exc:  # AlreadyExists (the controller's test made it before): admission passed
        assert "already exists" in str(exc).lower(), exc
