"""The image the real-node tests run is the Dockerfile's: built from it by scripts/build-image, its
configuration is the Dockerfile's, it runs under containerd and runc, and its storm path is compiled; it is
described (OCI annotations from the commit, an SBOM listing every package in it)."""

from __future__ import annotations

import datetime
import email.parser
import json
import re
import shlex
import subprocess
import tarfile
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from agent import __version__
from tests.realnode.registry import Published
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
    recorded = {line.split(",")[0] for line in _image_files(image_archive, lambda p: p == record[0])[record[0]]
                .decode().splitlines() if line}
    assert {f"{site}/{p}" for p in recorded if not p.startswith("..")} <= installed
    assert any(p.startswith(f"{site}/agent/") and p.endswith(".so") for p in installed)
    assert not [p for p in installed if not p.startswith("opt/gpu-health-agent/")]


def test_the_image_pulled_from_the_registry_is_the_build_and_runs_its_storm_path_compiled(
        containerd: Containerd, published: Published, image_archive: Path):
    """containerd pulls the image from the suite's registry at the digest scripts/build-image printed, and
    `gpu-health-agent --version`, run by containerd and runc from it, says compiled."""
    assert containerd.pull(published.image) == published.digest
    assert published.digest == json.loads(image_archive.with_suffix(".json").read_text())["digest"]
    done = containerd.ctr("run", "--rm", "--net-host", published.image, "image-version", "gpu-health-agent",
                          "--version")
    assert "storm path compiled with mypyc" in done.stdout, done.stdout + done.stderr


def _image_files(archive: Path, wanted: Any) -> dict[str, bytes]:
    """The image's root filesystem's files whose path `wanted` accepts, its layers applied in order (a later
    layer's file replaces an earlier one's, a whiteout deletes it)."""
    import gzip
    import io
    import tarfile

    files: dict[str, bytes] = {}
    with tarfile.open(archive) as outer:
        def blob(digest: str) -> bytes:
            member = outer.extractfile(f"blobs/sha256/{digest.split(':')[1]}")
            assert member is not None
            return member.read()

        manifest = json.loads(blob(json.loads(blob_index(outer))["manifests"][0]["digest"]))
        for layer in manifest["layers"]:
            with tarfile.open(fileobj=io.BytesIO(gzip.decompress(blob(layer["digest"])))) as inner:
                for member in inner:
                    path = member.name.removeprefix("./")
                    head, _, name = path.rpartition("/")
                    if name.startswith(".wh."):
                        files.pop(f"{head}/{name.removeprefix('.wh.')}".lstrip("/"), None)
                    elif member.isfile() and wanted(path):
                        extracted = inner.extractfile(member)
                        assert extracted is not None
                        files[path] = extracted.read()
    return files


def blob_index(outer: Any) -> bytes:
    member = outer.extractfile("index.json")
    assert member is not None
    return bytes(member.read())


def _normal(name: str) -> str:
    """A Python distribution's name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def test_the_sbom_lists_every_debian_and_python_package_in_the_image(image_archive: Path):
    """The SPDX SBOM beside the archive lists exactly the Debian packages dpkg's database in the image holds
    and the Python distributions whose dist-info is in its site-packages, each at the installed version."""
    files = _image_files(image_archive, lambda p: p == "var/lib/dpkg/status"
                         or re.fullmatch(r".*/site-packages/[^/]+\.dist-info/METADATA", p) is not None)
    debian = set()
    for paragraph in files.pop("var/lib/dpkg/status").decode().split("\n\n"):
        fields = email.parser.Parser().parsestr(paragraph)
        if (fields["Status"] or "").endswith(" installed"):
            debian.add((fields["Package"], fields["Version"]))
    python = {(_normal(meta["Name"]), meta["Version"])
              for meta in (email.parser.BytesParser().parsebytes(text) for text in files.values())}
    sbom = json.loads(image_archive.with_suffix(".spdx.json").read_text())
    listed: dict[str, set[tuple[str, str]]] = {"deb": set(), "pypi": set()}
    for package in sbom["packages"]:
        purls = [r["referenceLocator"] for r in package.get("externalRefs", []) if r["referenceType"] == "purl"]
        kind = purls[0].removeprefix("pkg:").split("/", 1)[0] if purls else "none"
        name = _normal(package["name"]) if kind == "pypi" else package["name"]
        # The image itself is the document's subject, named by its digest.
        version = unquote(purls[0].split("@", 1)[1].split("?")[0]) if kind == "oci" else package["versionInfo"]
        listed.setdefault(kind, set()).add((name, version))
    assert len(debian) > 50 and len(python) > 10  # the image's own count, read without the SBOM's tool
    assert listed["deb"] == debian
    assert listed["pypi"] == python
    digest = json.loads(image_archive.with_suffix(".json").read_text())["digest"]
    assert listed.pop("oci") == {("gpu-health-agent", digest)}
    assert set(listed) == {"deb", "pypi"}, sorted(listed)
    assert image_archive.with_suffix(".cdx.json").is_file()


def test_the_image_carries_the_commits_oci_annotations(image_archive: Path):
    """The manifest's annotations and the configuration's labels name the source, the commit built, the
    project's version and licence, and `created` is the commit's time, as the image's own `created` is."""
    with tarfile.open(image_archive) as outer:
        index = json.loads(blob_index(outer))
        member = outer.extractfile(f"blobs/sha256/{index['manifests'][0]['digest'].split(':')[1]}")
        assert member is not None
        annotations = json.loads(member.read())["annotations"]
    config = oci_config(image_archive)
    commit = subprocess.run(["git", "-C", str(REPO), "log", "-1", "--format=%H %ct"], capture_output=True,
                            text=True, check=True).stdout.split()
    created = datetime.datetime.fromtimestamp(int(commit[1]), tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    assert annotations["org.opencontainers.image.revision"].removesuffix("-dirty") == commit[0]
    assert annotations["org.opencontainers.image.created"] == created == config["created"]
    assert annotations["org.opencontainers.image.version"] == __version__
    assert annotations["org.opencontainers.image.licenses"] == "Apache-2.0"
    assert annotations["org.opencontainers.image.source"].startswith("https://github.com/")
    assert config["config"]["Labels"] == annotations
    assert {entry["created"] for entry in config["history"]} == {created}
