"""The image the real-node tests run is the Dockerfile's: built from it by scripts/build-image, its
configuration is the Dockerfile's, it runs under containerd and runc, and its storm path is compiled."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from tests.realnode.conftest import IMAGE_NAME
from tests.realnode.runtime import REPO, Containerd, oci_config


def _dockerfile_runtime_stage() -> dict[str, object]:
    """ENTRYPOINT, CMD, ENV and USER of the Dockerfile's last stage, read here independently of the builder."""
    text = (REPO / "Dockerfile").read_text()
    last = text.rsplit("\nFROM ", 1)[1]
    found: dict[str, object] = {"Env": {}}
    for line in last.splitlines():
        keyword, _, rest = line.partition(" ")
        if keyword in {"ENTRYPOINT", "CMD"}:
            found[keyword.title()] = json.loads(rest)
        elif keyword == "ENV":
            found["Env"] = dict(word.split("=", 1) for word in shlex.split(rest))
        elif keyword == "USER":
            found["User"] = rest
    return found


def test_the_image_configuration_is_the_dockerfiles(image_archive: Path):
    """Entrypoint, command, environment and user in the built image are those the Dockerfile's last stage sets."""
    config = oci_config(image_archive)["config"]
    expected = _dockerfile_runtime_stage()
    assert config["Entrypoint"] == expected["Entrypoint"]
    assert config["Cmd"] == expected["Cmd"]
    assert config["User"] == expected["User"]
    assert dict(e.split("=", 1) for e in config["Env"]) == expected["Env"]


def test_the_image_holds_exactly_what_pip_installed(image_archive: Path):
    """The image's agent layer is the virtualenv scripts/install-agent made: every file pip recorded for the
    agent is there, the compiled storm path among them, and nothing from the build stage came along."""
    manifest = json.loads(image_archive.with_suffix(".json").read_text())
    installed = set(manifest["installed"])
    site = "opt/gpu-health-agent/lib/python3.11/site-packages"
    record = [p for p in installed if p.startswith(f"{site}/gpu_health_agent-") and p.endswith("/RECORD")]
    assert len(record) == 1, record
    recorded = {line.split(",")[0] for line in _layer_file(image_archive, record[0]).splitlines() if line}
    assert {f"{site}/{p}" for p in recorded if not p.startswith("..")} <= installed
    assert any(p.startswith(f"{site}/agent/") and p.endswith(".so") for p in installed)
    assert not [p for p in installed if not p.startswith("opt/gpu-health-agent/")]


def test_the_image_runs_its_storm_path_compiled_under_containerd(containerd: Containerd):
    """`gpu-health-agent --version`, run by containerd and runc from the imported image, says compiled."""
    reference = f"{IMAGE_NAME}:{oci_tag_of(containerd)}"
    done = containerd.ctr("run", "--rm", "--net-host", reference, "image-version", "gpu-health-agent", "--version")
    assert "storm path compiled with mypyc" in done.stdout, done.stdout + done.stderr


def oci_tag_of(containerd: Containerd) -> str:
    names = [n for n in containerd.ctr("images", "list", "--quiet").stdout.split() if n.startswith(IMAGE_NAME + ":")]
    assert len(names) == 1, names
    return names[0].rsplit(":", 1)[1]


def _layer_file(archive: Path, path: str) -> str:
    """One file of the image's last layer."""
    import gzip
    import io
    import tarfile

    with tarfile.open(archive) as outer:
        def blob(digest: str) -> bytes:
            member = outer.extractfile(f"./blobs/sha256/{digest.split(':')[1]}")
            assert member is not None
            return member.read()

        index = json.loads(blob(json.loads(outer.extractfile("./index.json").read())["manifests"][0]["digest"]))  # type: ignore[union-attr]
        layer = gzip.decompress(blob(index["layers"][-1]["digest"]))
    with tarfile.open(fileobj=io.BytesIO(layer)) as inner:
        member = inner.extractfile(f"./{path}")
        assert member is not None
        return member.read().decode()
