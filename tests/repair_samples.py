"""The node-repair samples in docs/repair-tools and the conditions each acts on, in each tool's own shape."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

SAMPLES = Path(__file__).resolve().parents[1] / "docs" / "repair-tools"


def sample_files() -> list[Path]:
    return sorted(SAMPLES.glob("*.yaml"))


def load_sample(path: Path) -> dict[str, Any]:
    """The one object a sample file holds."""
    [sample] = list(yaml.safe_load_all(path.read_text()))
    return dict(sample)


def unhealthy_conditions(sample: dict[str, Any]) -> list[tuple[str, str, object]]:
    """(type, status, wait) of each Node condition the object remediates on: Cluster API v1beta1
    spec.unhealthyConditions[].timeout, v1beta2 spec.checks.unhealthyNodeConditions[].timeoutSeconds,
    medik8s spec.unhealthyConditions[].duration. Empty where the object has none."""
    spec = sample.get("spec", {})
    if sample["apiVersion"] == "cluster.x-k8s.io/v1beta2":
        conditions, wait = spec.get("checks", {}).get("unhealthyNodeConditions", []), "timeoutSeconds"
    else:
        conditions = spec.get("unhealthyConditions", [])
        wait = "timeout" if sample["kind"] == "MachineHealthCheck" else "duration"
    return [(c.get("type"), c.get("status"), c.get(wait)) for c in conditions]
