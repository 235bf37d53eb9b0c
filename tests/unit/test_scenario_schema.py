"""The scenario format's JSON Schema (docs/scenario.schema.json) says what the loader accepts."""

from __future__ import annotations

import json
from importlib import resources

import jsonschema
import pytest
import yaml

from agent.sources.scenario import builtin_names
from tests.conftest import REPO

SCHEMA = json.loads((REPO / "docs" / "scenario.schema.json").read_text())


def builtin(name: str) -> object:
    return yaml.safe_load((resources.files("agent") / "scenarios" / f"{name}.yaml").read_text(encoding="utf-8"))


def test_the_committed_schema_is_the_loaders_model():
    """The file is generated from the loader's model: regenerate it when the format changes."""
    import sys
    sys.path.insert(0, str(REPO / "scripts"))
    from gen_scenario_schema import render

    assert (REPO / "docs" / "scenario.schema.json").read_text() == render(), "run scripts/gen_scenario_schema.py"


@pytest.mark.parametrize("name", builtin_names())
def test_every_built_in_scenario_is_valid_under_the_schema(name: str):
    """Editors and CI that validate with the schema accept what the agent ships."""
    jsonschema.validate(builtin(name), SCHEMA)


def test_the_schema_names_an_unknown_key():
    """A misspelt key fails in the editor too, naming the key."""
    document = builtin("xid79")
    document["timeline"][0]["colour"] = "red"  # type: ignore[index]
    with pytest.raises(jsonschema.ValidationError, match="colour"):
        jsonschema.validate(document, SCHEMA)


def test_the_loader_names_an_unknown_key_with_its_path(tmp_path):
    """The loader's one-line error says where the unknown key is."""
    from agent.errors import ScenarioError
    from agent.sources.scenario import parse_scenario

    with pytest.raises(ScenarioError) as error:
        parse_scenario("name: x\ntimeline:\n- {at: 1, signal: xid, colour: red}\n", origin="s.yaml")
    assert error.value.line() == "s.yaml: field timeline.0.colour: unknown key"
