"""The repository itself: what a fresh clone gets."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not (REPO / ".git").exists() or shutil.which("git") is None, reason="not a git checkout")
def test_the_repository_tracks_no_symbolic_links():
    """A committed link (a worktree's link to a build folder) breaks a fresh clone's build: none is tracked."""
    listed = subprocess.run(["git", "-C", str(REPO), "ls-files", "-s"], capture_output=True, text=True, check=True)
    links = [line.split("\t", 1)[1] for line in listed.stdout.splitlines() if line.startswith("120000 ")]
    assert links == []


def test_the_license_is_the_apache_license_2_0_unchanged():
    """LICENSE is the Apache License 2.0's text byte for byte (the sha256 of apache.org's LICENSE-2.0.txt), the
    license pyproject.toml declares and the wheel and image carry (hatch puts it in the dist-info)."""
    import hashlib
    import tomllib

    text = (REPO / "LICENSE").read_bytes()
    assert hashlib.sha256(text).hexdigest() == "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"
    assert tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["license"] == {"text": "Apache-2.0"}
    assert "COPY pyproject.toml README.md LICENSE ./" in (REPO / "Dockerfile").read_text()


def test_the_changelog_keeps_an_unreleased_section_above_the_releases():
    """Keep a Changelog: `## [Unreleased]` first, then `## [X.Y.Z] - YYYY-MM-DD` sections, newest first."""
    import re

    headings = re.findall(r"^## (.*)$", (REPO / "CHANGELOG.md").read_text(), re.MULTILINE)
    assert headings[0] == "[Unreleased]"
    released = [re.fullmatch(r"\[(\d+)\.(\d+)\.(\d+)(?:-rc\.\d+)?\] - \d{4}-\d\d-\d\d", h) for h in headings[1:]]
    assert all(released), headings
    numbers = [tuple(int(n) for n in m.groups()) for m in released if m]
    assert numbers == sorted(numbers, reverse=True)


def test_no_two_module_level_classes_of_the_agent_share_a_name():
    """One name per idea: a class name names one class in agent/ (issue 40 found FleetView, _Strict and
    _VirtualClock twice each)."""
    import ast
    from collections import defaultdict

    found: dict[str, list[str]] = defaultdict(list)
    for path in sorted((REPO / "agent").rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                found[node.name].append(str(path.relative_to(REPO)))
    assert {name: paths for name, paths in found.items() if len(paths) > 1} == {}


def test_no_two_modules_of_the_shared_rooms_share_a_file_name():
    """One name per idea: control/, fleet/, fleetapi/, fleetctl/ and k8s/ never hold two modules of one file name (issue
    40 found brake.py, confirm.py and store.py twice each)."""
    from collections import defaultdict

    found: dict[str, list[str]] = defaultdict(list)
    for room in ("control", "fleet", "fleetapi", "fleetctl", "k8s"):
        for path in sorted((REPO / "agent" / room).glob("*.py")):
            if path.name != "__init__.py":
                found[path.name].append(room)
    assert {name: rooms for name, rooms in found.items() if len(rooms) > 1} == {}


def test_the_objects_several_agents_share_are_handled_in_agent_fleetapi_only():
    """Issue 40's room for what nodes share: Leases (the budget's slots, the brake's claims, the leader) are
    read and written in agent/fleetapi/ (and undone by agent/cleanup.py), never in agent/k8s/, which keeps the
    client and this node's actuators (bodies.py only types their bodies)."""
    agent = REPO / "agent"
    places = sorted(str(path.relative_to(agent)) for path in agent.rglob("*.py")
                    if "coordination.k8s.io" in path.read_text() and not path.is_relative_to(agent / "simulation"))
    assert [p for p in places if not p.startswith("fleetapi/")] == ["cleanup.py", "k8s/bodies.py"]
