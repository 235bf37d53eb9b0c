#!/usr/bin/env python3
"""Rewrites the allow-list import contracts in pyproject.toml: each lists every agent module but its allowed place.

Run after adding or removing a module under agent/ (tests/unit/test_import_contracts.py names a missing one).
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: Where each guarded import may stand; every other module of agent is a source of its forbidden contract.
ALLOWED = {
    "pynvml": {"agent.sources.nvml"},
    "urllib3": {"agent.k8s.client", "agent.k8s.errors", "agent.k8s.watch"},
    "subprocess": {"agent.diagnostics", "agent.gpu.reset", "agent.k8s.exec_credential"},
}


def agent_modules() -> list[str]:
    modules = []
    for path in sorted((ROOT / "agent").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules.append(".".join(parts))
    return sorted(modules)


def main() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    modules = agent_modules()
    for name, allowed in ALLOWED.items():
        listed = "".join(f'    "{m}",\n' for m in modules if m not in allowed)
        body = f'source_modules = [\n{listed}]\nforbidden_modules = ["{name}"]'
        end_marker = f'\nforbidden_modules = ["{name}"]'
        end = text.find(end_marker)
        start = text.rfind("source_modules = [", 0, end)
        if end < 0 or start < 0:
            raise SystemExit(f"pyproject.toml: the {name} contract's source_modules not found")
        text = text[:start] + body + text[end + len(end_marker):]
    (ROOT / "pyproject.toml").write_text(text)
    print(f"pyproject.toml: allow-lists rewritten over {len(modules)} modules")


if __name__ == "__main__":
    main()
