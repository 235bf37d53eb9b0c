"""The chart's values.schema.json closes every value: a misspelt key anywhere is an error, never ignored."""

from __future__ import annotations

import json
import sys
from typing import Any

import jsonschema
import pytest
import yaml

from tests.conftest import REPO

CHART = REPO / "daemonset" / "helm" / "gpu-health-agent"
SCHEMA = json.loads((CHART / "values.schema.json").read_text())
VALUES = yaml.safe_load((CHART / "values.yaml").read_text())
#: Maps whose keys are the user's own (labels, annotations, node selectors, rule file names) or the API server's
#: to check (the contents of an affinity kind); each with why it may hold any key.
OPEN_MAPS = {
    "/fleet/nodeSelector": "node labels",
    "/nodeSelector": "node labels",
    "/podAnnotations": "annotations",
    "/serviceMonitor/labels": "labels",
    "/prometheusRule/labels": "labels",
    "/rules/overrides": "rule file names (propertyNames: *.yaml)",
    "/networkPolicy/from/0/podSelector/matchLabels": "pod labels",
    "/affinity/nodeAffinity": "core/v1 NodeAffinity, checked by the API server",
    "/affinity/podAffinity": "core/v1 PodAffinity, checked by the API server",
    "/affinity/podAntiAffinity": "core/v1 PodAntiAffinity, checked by the API server",
}


def resolve(schema: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        schema = SCHEMA["$defs"][schema["$ref"].removeprefix("#/$defs/")]
    return schema


def closed_objects(value: object, schema: dict[str, Any], path: str = "") -> list[str]:
    """The paths of values.yaml whose object is open to unknown keys (or has no schema at all)."""
    schema = resolve(schema)
    problems = []
    if isinstance(value, dict):
        if "properties" not in schema:
            names = schema.get("propertyNames")
            if path not in OPEN_MAPS and not names:
                problems.append(f"{path}: a map open to any key")
            return problems
        if schema.get("additionalProperties") is not False:
            problems.append(f"{path}: additionalProperties is not false")
        for key, item in value.items():
            if key not in schema["properties"]:
                problems.append(f"{path}/{key}: no schema")
            else:
                problems.extend(closed_objects(item, schema["properties"][key], f"{path}/{key}"))
    elif isinstance(value, list) and "items" in schema:
        for n, item in enumerate(value):
            problems.extend(closed_objects(item, schema["items"], f"{path}/{n}"))
    return problems


def test_the_committed_schema_has_the_agents_configuration_model():
    """extraConfig and the agentConfig definitions are generated from agent.config.Config."""
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        from gen_values_schema import render
    finally:
        sys.path.remove(str(REPO / "scripts"))
    assert (CHART / "values.schema.json").read_text() == render(SCHEMA), "run scripts/gen_values_schema.py"


def test_every_value_of_values_yaml_is_under_a_closed_schema():
    """Every key of values.yaml has a schema and every object of them refuses unknown keys, but the maps whose
    keys are the user's own (OPEN_MAPS, each with why)."""
    assert closed_objects(VALUES, SCHEMA) == []


def test_the_shipped_values_are_valid():
    jsonschema.Draft202012Validator(SCHEMA).validate(VALUES)


def test_the_agents_deployed_configuration_is_valid_extra_config():
    """The kustomize base's config.yaml, a whole configuration of the agent, passes as extraConfig: the schema
    accepts what the agent accepts."""
    config = yaml.safe_load((REPO / "daemonset" / "config.yaml").read_text())
    config = yaml.safe_load(config["data"]["config.yaml"]) if "data" in config else config
    jsonschema.Draft202012Validator(SCHEMA).validate({**VALUES, "extraConfig": config})


@pytest.mark.parametrize(("path", "misspelt"), [
    (("extraConfig", "remediation"), "taint_keyy"),
    (("extraConfig",), "tick_second"),
    (("resources", "limits"), "cpuu"),
    (("fleet", "resources"), "limts"),
    (("affinity",), "nodeAfinity"),
])
def test_a_misspelt_key_is_rejected(path: tuple[str, ...], misspelt: str):
    """Checked here with the schema itself (tests/unit/test_helm_chart.py: helm lint --strict does the same)."""
    values = json.loads(json.dumps(VALUES))
    node = values
    for key in path:
        node = node.setdefault(key, {})
    node[misspelt] = "1"
    errors = list(jsonschema.Draft202012Validator(SCHEMA).iter_errors(values))
    assert errors and misspelt in " ".join(e.message for e in errors)
