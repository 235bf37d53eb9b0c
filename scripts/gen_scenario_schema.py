"""Writes docs/scenario.schema.json, the JSON Schema of the scenario format, from the loader's own model.

tests/unit/test_scenario_schema.py fails when the committed file and the model differ: run this script.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import msgspec

from agent.sources.scenario import Scenario

TARGET = Path(__file__).resolve().parent.parent / "docs" / "scenario.schema.json"


def scenario_schema() -> dict[str, object]:
    (_,), components = msgspec.json.schema_components([Scenario])
    schema = {**components.pop("Scenario"), "$defs": dict(sorted(components.items()))}
    return {"$schema": "https://json-schema.org/draft/2020-12/schema",
            "$id": "https://github.com/gpu-health-agent/gpu-health-agent/blob/main/docs/scenario.schema.json",
            "title": "gpu-health-agent fault scenario",
            **{k: v for k, v in schema.items() if k not in {"title", "description"}},
            "description": "A node and a timeline of observations replayed on a virtual clock (docs/scenarios.md)."}


def render() -> str:
    return json.dumps(scenario_schema(), indent=2, sort_keys=False) + "\n"


if __name__ == "__main__":
    TARGET.write_text(render())
    print(f"wrote {TARGET}", file=sys.stderr)
