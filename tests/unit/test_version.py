"""One version for the package, the image and the chart, from agent/__init__.py; scripts/set-version writes it."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO

CHART = Path("daemonset/helm/gpu-health-agent/Chart.yaml")
MANIFESTS = (Path("daemonset/daemonset.yaml"), Path("daemonset/kmsg-device-plugin.yaml"),
             Path("daemonset/fleet/deployment.yaml"))
IMAGE = "ghcr.io/gpu-health-agent/gpu-health-agent"


def versions(root: Path) -> dict[str, str]:
    """Every place a version is written, read independently of scripts/set-version."""
    [package] = re.findall(r'^__version__ = "([^"]*)"$', (root / "agent" / "__init__.py").read_text(), re.M)
    chart = yaml.safe_load((root / CHART).read_text())
    found = {"package": package, "chart version": str(chart["version"]), "chart appVersion": str(chart["appVersion"])}
    for manifest in MANIFESTS:
        for n, tag in enumerate(re.findall(rf"image: {re.escape(IMAGE)}:(\S+)$", (root / manifest).read_text(), re.M)):
            found[f"{manifest} image {n}"] = tag
    return found


def build_image_tag() -> str:
    """scripts/build-image's own tag() (the script has no .py suffix: loaded by path)."""
    loader = importlib.machinery.SourceFileLoader("build_image", str(REPO / "scripts" / "build-image"))
    spec = importlib.util.spec_from_loader("build_image", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["build_image"] = module  # its dataclasses look their module up
    try:
        loader.exec_module(module)
        return str(module.tag())
    finally:
        del sys.modules["build_image"]


def test_the_package_image_chart_and_manifests_carry_one_version():
    """Chart version and appVersion, every manifest's image tag and the image scripts/build-image tags are the
    package's __version__, which hatch reads (pyproject.toml holds no version of its own)."""
    from agent import __version__

    assert set(versions(REPO).values()) == {__version__}, versions(REPO)
    assert build_image_tag() == __version__
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "version" not in project["project"] and project["project"]["dynamic"] == ["version"]
    assert project["tool"]["hatch"]["version"]["path"] == "agent/__init__.py"


def _copy(tmp_path: Path) -> Path:
    for name in (Path("agent/__init__.py"), Path("CHANGELOG.md"), CHART, *MANIFESTS):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / name, tmp_path / name)
    return tmp_path


def set_version(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(REPO / "scripts" / "set-version"), *args], capture_output=True,
                          text=True, timeout=60, check=False)


def test_set_version_writes_every_copy_and_releases_the_changelog(tmp_path: Path):
    """On a copy of the files: every place reads the new version; Unreleased becomes the release's section."""
    root = _copy(tmp_path)
    result = set_version("0.2.0", "--date", "2027-01-15", "--root", str(root))
    assert result.returncode == 0, result.stderr
    assert set(versions(root).values()) == {"0.2.0"}
    changelog = (root / "CHANGELOG.md").read_text()
    assert "## [Unreleased]\n\n## [0.2.0] - 2027-01-15\n" in changelog
    assert changelog.count("## [Unreleased]") == 1


@pytest.mark.parametrize("version", ["0.2", "v0.2.0", "0.2.0-beta"])
def test_set_version_refuses_a_version_that_is_not_x_y_z(tmp_path: Path, version: str):
    """Helm wants SemVer; the tag is `v` + the version: only X.Y.Z or X.Y.Z-rc.N, and nothing is written."""
    root = _copy(tmp_path)
    before = versions(root)
    result = set_version(version, "--root", str(root))
    assert result.returncode == 2 and "Usage: scripts/set-version" in result.stderr
    assert versions(root) == before


def test_set_version_refuses_a_version_released_already(tmp_path: Path):
    """A second release of one version would leave two CHANGELOG sections for it."""
    root = _copy(tmp_path)
    assert set_version("0.2.0", "--root", str(root)).returncode == 0
    result = set_version("0.2.0", "--root", str(root))
    assert result.returncode == 1 and "0.2.0 is released already" in result.stderr


def _head_tags() -> list[str]:
    if not (REPO / ".git").exists() or shutil.which("git") is None:
        return []
    done = subprocess.run(["git", "-C", str(REPO), "tag", "--points-at", "HEAD", "--list", "v*"],
                          capture_output=True, text=True, check=False)
    return done.stdout.split()


@pytest.mark.skipif(not _head_tags(), reason="HEAD carries no release tag (v*)")
def test_a_tagged_commit_carries_the_version_of_its_tag():
    """A release tag vX.Y.Z sits on the commit whose version is X.Y.Z (docs/release.md)."""
    from agent import __version__

    assert [f"v{__version__}"] == _head_tags()
