"""The node-repair samples in docs/repair-tools are objects the real Cluster API and medik8s CRDs accept
(created server-side with dry-run, strict field validation), acting on the agent's conditions only."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.k8s.node import AGENT_CONDITIONS, POSITIVE_CONDITIONS
from tests.realcluster.repair_crds import CrdUnavailable, load, pinned
from tests.repair_samples import load_sample, sample_files, unhealthy_conditions


@pytest.fixture(scope="module")
def repair_crds(control_plane) -> Any:
    """Each pinned CRD installed and Established, by API group (controller-gen names the file GROUP_PLURAL.yaml);
    a one-line reason where it is unavailable."""
    installed: dict[str, dict[str, Any] | str] = {}
    for source in pinned():
        try:
            crd = load(source)
        except CrdUnavailable as exc:
            installed[Path(source.path).stem.split("_")[0]] = str(exc)
            continue
        control_plane.kubectl("apply", "--server-side", "-f", "-", input_text=yaml.safe_dump(crd))
        name = crd["metadata"]["name"]
        control_plane.kubectl("wait", "--for=condition=Established", "--timeout=60s", f"crd/{name}")
        installed[crd["spec"]["group"]] = crd
    yield installed
    names = [crd["metadata"]["name"] for crd in installed.values() if isinstance(crd, dict)]
    if names:
        control_plane.kubectl("delete", "--wait=false", *(f"crd/{name}" for name in names))


@pytest.mark.parametrize("path", sample_files(), ids=lambda p: p.name)
def test_the_tools_crd_accepts_the_sample_acting_on_the_agents_problem_conditions(path: Path, repair_crds,
                                                                                  control_plane):
    """Created with dry-run=All against the real CRD, the object names only the agent's conditions, each with the
    status it writes for a problem (False for AcceleratedHardwareReady, True for the others) and a wait."""
    sample = load_sample(path)
    group, version = sample["apiVersion"].split("/")
    crd = repair_crds.get(group)
    assert crd is not None, f"no CRD pinned in tests/controlplane/repair-crds.txt for {group}"
    if isinstance(crd, str):
        pytest.skip(crd)
    assert crd["spec"]["names"]["kind"] == sample["kind"]
    assert version in {v["name"] for v in crd["spec"]["versions"] if v["served"]}
    created = json.loads(control_plane.kubectl("create", "--dry-run=server", "--validate=strict", "-o", "json",
                                               "-f", "-", input_text=yaml.safe_dump(sample)))
    conditions = unhealthy_conditions(created)
    assert conditions, f"the object the server kept has no unhealthy conditions: {created['spec']}"
    assert {kind for kind, _, _ in conditions} <= set(AGENT_CONDITIONS)
    for kind, status, wait in conditions:
        assert (status, bool(wait)) == ("False" if kind in POSITIVE_CONDITIONS else "True", True), kind
