"""The image's lock files (lock/, scripts/lock-image) pin everything the image and its build stage install:
every Python requirement of the package at a version that satisfies it, each with hashes, and every Debian
base's package list; the Dockerfile copies the Python locks and the installer takes them with --require-hashes."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
LOCK = REPO / "lock"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def _pins(lock: Path) -> dict[str, tuple[Version, list[str]]]:
    """Each pinned distribution of a pip lock file: its version and its hashes."""
    text = lock.read_text().replace("\\\n", " ")
    pins: dict[str, tuple[Version, list[str]]] = {}
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        requirement = Requirement(line.split(" --hash")[0].strip())
        (specifier,) = requirement.specifier
        assert specifier.operator == "==", line
        pins[canonicalize_name(requirement.name)] = (Version(specifier.version), re.findall(r"--hash=(\S+)", line))
    return pins


def _requirements(*extras: str, build_backend: bool = False) -> list[Requirement]:
    found = [*PYPROJECT["project"]["dependencies"]]
    for extra in extras:
        found += PYPROJECT["project"]["optional-dependencies"][extra]
    if build_backend:
        found += PYPROJECT["build-system"]["requires"]
    return [Requirement(r) for r in found]


def _assert_locked(lock: Path, requirements: list[Requirement]) -> None:
    pins = _pins(lock)
    for requirement in requirements:
        version, _ = pins[canonicalize_name(requirement.name)]
        assert requirement.specifier.contains(version, prereleases=True), (requirement, version)
    for name, (_, hashes) in pins.items():
        assert hashes and all(h.startswith("sha256:") for h in hashes), name


def test_the_runtime_lock_pins_every_requirement_of_the_package_and_its_deviceplugin_extra():
    """lock/python-runtime.txt pins each dependency and grpcio (the extra the image installs) at a version its
    specifier allows, every pin with its sha256 hashes."""
    _assert_locked(LOCK / "python-runtime.txt", _requirements("deviceplugin"))


def test_the_build_lock_pins_the_compile_extra_and_the_build_backend():
    """lock/python-build.txt pins what the build stage installs: the runtime's packages (mypy checks against
    them), the compile extra (mypyc) and hatchling, which builds the wheel without build isolation."""
    _assert_locked(LOCK / "python-build.txt", _requirements("deviceplugin", "compile", build_backend=True))


def test_the_build_lock_holds_the_runtime_locks_versions():
    """The storm path is compiled against the very versions the image runs."""
    runtime, build = _pins(LOCK / "python-runtime.txt"), _pins(LOCK / "python-build.txt")
    assert {name: pin[0] for name, pin in runtime.items()} == {name: build[name][0] for name in runtime}


def test_every_debian_base_is_pinned_package_by_package():
    """Each base scripts/build-image makes has a lock naming every package as name=version, its --include
    list among them."""
    source = (REPO / "scripts" / "build-image").read_text()
    bases = dict(re.findall(r'"(BASE|BUILD_BASE)": \(([^)]*)\)', source))
    assert set(bases) == {"BASE", "BUILD_BASE"}
    for which, listed in bases.items():
        lock = LOCK / f"debian-{which.lower().replace('_', '-')}-amd64.txt"
        pins = dict(line.split("=", 1) for line in lock.read_text().splitlines() if line and not line.startswith("#"))
        assert all(re.fullmatch(r"[a-z0-9][a-z0-9+.-]+", name) and version for name, version in pins.items())
        assert set(re.findall(r'"([^"]+)"', listed)) <= set(pins), which


def test_the_image_installs_python_packages_only_from_the_locks_with_their_hashes():
    """The Dockerfile copies both locks into the build stage, and scripts/install-agent installs every
    package from them with --require-hashes (the agent's own wheel, built there, with --no-deps)."""
    dockerfile = (REPO / "Dockerfile").read_text()
    installer = (REPO / "scripts" / "install-agent").read_text()
    assert re.search(r"^COPY lock/python-build.txt lock/python-runtime.txt ", dockerfile, re.M)
    assert "--require-hashes --no-deps" in installer
    installs = [line for line in installer.splitlines() if re.search(r"\bpip\"? install\b", line)]
    assert installs and all("--no-deps" in line for line in installs), installs
