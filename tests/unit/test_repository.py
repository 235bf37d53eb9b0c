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
