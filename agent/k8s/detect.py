"""Whether a cluster is configured at all, decided without importing the (large) Kubernetes client."""

from __future__ import annotations

import os
from pathlib import Path


def kubeconfig_path(explicit: str | None = None) -> Path:
    return Path(explicit or os.environ.get("KUBECONFIG", "").split(os.pathsep)[0] or Path.home() / ".kube/config")


def cluster_configured(kubeconfig: str | None = None) -> bool:
    """Whether this node is meant to talk to a cluster: the in-cluster service-account environment, a
    kubeconfig named in the agent's config (present or not: naming one means it), or a kubeconfig file where
    kubectl looks ($KUBECONFIG, ~/.kube/config). Only where none of these is there is the agent in local mode."""
    return (bool(os.environ.get("KUBERNETES_SERVICE_HOST")) or bool(kubeconfig)
            or kubeconfig_path(None).is_file())
