"""The node-repair tools' CRDs, read from their Go modules at the versions tests/controlplane/repair-crds.txt pins
(or, where the module proxy does not serve one, from the copy vendored in tests/controlplane/vendored-crds)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

PINS = Path(__file__).resolve().parents[1] / "controlplane" / "repair-crds.txt"
#: CRDs copied from a tool's repository at the pinned tag, for a module the Go module proxy does not serve;
#: each file's header names source, tag, commit and licence.
VENDORED = PINS.parent / "vendored-crds"
#: A folder of CRD files (by their names in the module) read instead of the module cache, for a machine
#: whose module proxy does not serve a tool's module.
OVERRIDE_ENV = "REPAIR_TOOL_CRDS"
FETCH_SECONDS = 90


class CrdUnavailable(Exception):
    """The CRD could not be had here (no Go, or the module proxy does not serve the module): one line why."""


@dataclass(frozen=True, slots=True)
class CrdSource:
    module: str
    version: str
    path: str

    def __str__(self) -> str:
        return f"{self.module} {self.version}"


def pinned() -> list[CrdSource]:
    """The pins file's lines: MODULE VERSION PATH, '#' comments."""
    lines = PINS.read_text().splitlines()
    return [CrdSource(*line.split()) for line in lines if line.strip() and not line.lstrip().startswith("#")]


def load(source: CrdSource) -> dict[str, Any]:
    """The CRD as a dict: from the override folder if set, else from Go's module cache (downloading at most
    FETCH_SECONDS once; scripts/build-controlplane fetched it before), else from its vendored copy.
    CrdUnavailable only where the module cannot be had and nothing is vendored; a module without the pinned
    file, or a vendored copy of another tag than the pin's, is an error."""
    override = os.environ.get(OVERRIDE_ENV)
    try:
        file = Path(override) / Path(source.path).name if override else Path(_module_dir(source)) / source.path
    except CrdUnavailable as unavailable:
        file = _vendored(source, unavailable)
    if not file.is_file():  # a wrong pin, or an override folder without it: a failure, not a skip
        raise FileNotFoundError(f"{source}: no {source.path} in {file.parent}")
    crd: dict[str, Any] = yaml.safe_load(file.read_text())
    return crd


def _vendored(source: CrdSource, unavailable: CrdUnavailable) -> Path:
    """The vendored copy of the pinned CRD, checked to be of the pinned tag (its header's `# Tag:` line);
    `unavailable` (why the module could not be had) where none is vendored."""
    file = VENDORED / Path(source.path).name
    if not file.is_file():
        raise unavailable
    tags = [line.split()[2] for line in file.read_text().splitlines() if line.startswith("# Tag: ")]
    if tags != [source.version]:
        raise ValueError(f"{file}: vendored at tag {', '.join(tags) or '(no # Tag: line)'}, "
                         f"the pin is {source.version}: copy the pinned tag's file")
    return file


def _module_dir(source: CrdSource) -> str:
    go = shutil.which("go")
    if go is None:
        raise CrdUnavailable(f"{source}: no go on PATH to fetch it with")
    # Outside any module, so no go.mod or go.sum is touched.
    with tempfile.TemporaryDirectory() as outside:
        try:
            done = subprocess.run([go, "mod", "download", "-json", f"{source.module}@{source.version}"],
                                  cwd=outside, capture_output=True, text=True, timeout=FETCH_SECONDS,
                                  env={**os.environ, "GOTOOLCHAIN": "local"}, check=False)
        except subprocess.TimeoutExpired:
            raise CrdUnavailable(f"{source}: go mod download took over {FETCH_SECONDS} s") from None
    try:
        answer = json.loads(done.stdout)
    except ValueError:
        raise CrdUnavailable(f"{source}: go mod download: {_first_line(done.stderr)}") from None
    if "Error" in answer or "Dir" not in answer:
        why = _first_line(answer.get("Error", "")).rsplit(": ", 1)[-1]
        raise CrdUnavailable(f"{source}: the Go module proxy does not serve it ({why}); {OVERRIDE_ENV}=DIR reads "
                             f"{Path(source.path).name} from DIR instead")
    return str(answer["Dir"])


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else "no output"
