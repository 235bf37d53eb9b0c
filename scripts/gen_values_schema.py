"""Writes the agent's configuration schema into the chart's values.schema.json: `extraConfig` (keys of the agent's
configuration merged over those the chart writes, docs/configuration.md) is checked against the agent's own model,
agent.config.Config, so `helm lint --strict` rejects a misspelt key there as everywhere else. The file's other
entries are written by hand; this script replaces only `extraConfig` and the `$defs` named `agentConfig*`.

tests/unit/test_values_schema.py fails when the committed file and the model differ: run this script.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import msgspec

from agent.config import Config

TARGET = Path(__file__).resolve().parent.parent / "daemonset" / "helm" / "gpu-health-agent" / "values.schema.json"
PREFIX = "agentConfig"


def config_defs() -> dict[str, object]:
    """The model's schema as `$defs` entries: `agentConfig` itself, `agentConfig<Section>` for each section."""
    (_,), components = msgspec.json.schema_components([Config], ref_template=f"#/$defs/{PREFIX}{{name}}")
    schema = dict(components.pop("Config"))
    schema.pop("title", None)
    return {PREFIX: schema, **{f"{PREFIX}{name}": value for name, value in sorted(components.items())}}


def values_schema(current: dict[str, object]) -> dict[str, object]:
    """`current` with extraConfig and the agentConfig definitions as the model has them now."""
    updated = dict(current)
    properties = dict(updated["properties"])  # type: ignore[call-overload]
    properties["extraConfig"] = {
        "description": "more keys of the agent's configuration (docs/configuration.md), merged over those the "
                       "chart writes; checked against the agent's own model (scripts/gen_values_schema.py)",
        "$ref": f"#/$defs/{PREFIX}"}
    updated["properties"] = properties
    kept = {k: v for k, v in dict(updated.get("$defs", {})).items() if not k.startswith(PREFIX)}  # type: ignore[call-overload]
    updated["$defs"] = {**kept, **config_defs()}
    return updated


def render(current: dict[str, object]) -> str:
    return json.dumps(values_schema(current), indent=2) + "\n"


if __name__ == "__main__":
    TARGET.write_text(render(json.loads(TARGET.read_text())))
    print(f"wrote {TARGET}", file=sys.stderr)
