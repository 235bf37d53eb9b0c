"""Whether a cluster is configured at all, decided without importing the (large) Kubernetes client."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path


def kubeconfig_paths(explicit: str | None = None, env: Mapping[str, str] | None = None) -> list[Path]:
    """The kubeconfig files kubectl reads, in order: the one given; else every entry of $KUBECONFIG (empty
    and repeated ones dropped), merged; else ~/.kube/config."""
    if explicit:
        return [Path(explicit)]
    listed = (os.environ if env is None else env).get("KUBECONFIG", "")
    paths = list(dict.fromkeys(Path(entry) for entry in listed.split(os.pathsep) if entry))
    return paths or [Path.home() / ".kube/config"]


def kubeconfig_path(explicit: str | None = None) -> Path:
    """The first kubeconfig file there is (as kubeconfig_paths orders them), for messages."""
    paths = kubeconfig_paths(explicit)
    return next((p for p in paths if p.is_file()), paths[0])


def cluster_configured(kubeconfig: str | None = None) -> bool:
    """Whether this node is meant to talk to a cluster: the in-cluster service-account environment, a
    kubeconfig named in the agent's config (present or not: naming one means it), or a kubeconfig file where
    kubectl looks ($KUBECONFIG, ~/.kube/config). Only where none of these is there is the agent in local mode."""
    return (bool(os.environ.get("KUBERNETES_SERVICE_HOST")) or bool(kubeconfig)
            or any(path.is_file() for path in kubeconfig_paths(None)))
