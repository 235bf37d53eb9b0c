"""The import contracts forbid each guarded import (pynvml, urllib3, h2, subprocess) in the whole package but in its
named places: an import outside them fails them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

#: Where each guarded import is allowed (the contract's named exceptions), as pyproject.toml declares it.
ALLOWED = {
    "pynvml": {"agent.sources.nvml"},
    "urllib3": {"agent.k8s.client", "agent.k8s.errors", "agent.k8s.watch"},
    "h2": {"agent.k8s.grpc_unary"},
    "subprocess": {"agent.diagnostics", "agent.gpu.reset", "agent.k8s.exec_credential"},
}

#: Modules outside each allowed place: the edges next to the allowed one, the wiring, a package's __init__.
OUTSIDE = [
    ("pynvml", "agent/sources/dcgm.py"),
    ("pynvml", "agent/sources/__init__.py"),
    ("pynvml", "agent/k8s/actuator.py"),
    ("pynvml", "agent/daemon.py"),
    ("pynvml", "agent/check.py"),
    ("urllib3", "agent/k8s/node.py"),
    ("urllib3", "agent/pipeline.py"),
    ("urllib3", "agent/engine/evaluate.py"),
    ("h2", "agent/k8s/podresources.py"),
    ("hpack", "agent/k8s/grpc_unary.py"),
    ("h2", "agent/k8s/__init__.py"),
    ("subprocess", "agent/daemon.py"),
    ("subprocess", "agent/sources/kmsg.py"),
    ("subprocess", "agent/remediation/planner.py"),
    ("subprocess", "agent/cli/__init__.py"),
    ("subprocess", "agent/cli/drill.py"),
    ("subprocess", "agent/control/steps.py"),
    # The control loop past its seams (issue 40): the Node writer, the GPU reset, the fleet gate.
    ("agent.k8s.node", "agent/control/reconciler.py"),
    ("agent.gpu.reset", "agent/control/steps.py"),
    ("agent.fleetapi.fleet_gate", "agent/control/brake_waits.py"),
    # pydantic is a dev dependency (issue 42): the image does not install it.
    ("pydantic", "agent/config.py"),
    ("pydantic", "agent/sources/scenario.py"),
]


def _lint_imports() -> str:
    beside = Path(sys.executable).with_name("lint-imports")
    found = str(beside) if beside.exists() else shutil.which("lint-imports")
    assert found, "lint-imports is not installed (pip install -e .[dev])"
    return found


def _tree(tmp_path: Path) -> Path:
    """A copy of the package and pyproject.toml, to add an import to."""
    shutil.copytree(REPO / "agent", tmp_path / "agent", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def _run(tree: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run([_lint_imports(), "--no-cache"], cwd=tree, env=env, capture_output=True, text=True,
                          timeout=300, check=False)


def test_the_unchanged_copy_keeps_every_contract(tmp_path: Path):
    """The copy itself passes: a failure below comes from the added import, not from copying."""
    result = _run(_tree(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(("module", "path"), OUTSIDE, ids=[f"{m}-in-{p}" for m, p in OUTSIDE])
def test_an_import_outside_its_allowed_place_fails_lint_imports(tmp_path: Path, module: str, path: str):
    """`import MODULE` added to a module outside its allow-list breaks a contract."""
    tree = _tree(tmp_path)
    target = tree / path
    target.write_text(target.read_text() + f"\nimport {module}  # noqa: E402, F401\n")
    result = _run(tree)
    assert result.returncode != 0, result.stdout
    assert "BROKEN" in result.stdout


def test_each_guarded_import_is_forbidden_in_the_whole_package_but_its_named_places():
    """Each contract's source is the whole package (a new module is checked from the start) and its only
    exceptions are the imports of the guarded module from its allowed places."""
    contracts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    for module, allowed in ALLOWED.items():
        (contract,) = [c for c in contracts if c["type"] == "forbidden" and module in c["forbidden_modules"]
                       and c.get("ignore_imports")]
        assert contract["source_modules"] == ["agent"] and contract.get("as_packages", True), module
        assert {line.split(" -> ")[0] for line in contract["ignore_imports"]} == allowed, module
        assert {line.split(" -> ")[1] for line in contract["ignore_imports"]} == {module}, module


def test_a_new_module_placed_in_no_layer_fails_lint_imports(tmp_path: Path):
    """The layers contract is exhaustive: a module of agent in no layer breaks it."""
    tree = _tree(tmp_path)
    (tree / "agent" / "unplaced.py").write_text('"""A module nobody placed."""\n')
    result = _run(tree)
    assert result.returncode != 0, result.stdout
    assert "agent.unplaced" in result.stdout
