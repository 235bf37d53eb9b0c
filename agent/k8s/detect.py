"""Whether a cluster is configured at all, decided without importing the (large) Kubernetes client."""

from __future__ import annotations

import os
from pathlib import Path


def kubeconfig_path(explicit: str | None = None) -> Path:
    return Path(explicit or os.environ.get("KUBECONFIG", "").split(os.pathsep)[0] or Path.home() / ".kube/config")


def cluster_configured(kubeconfig: str | None = None) -> bool:
    """In-cluster service-account environment, or a kubeconfig file: only then is the client loaded."""
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST")) or kubeconfig_path(kubeconfig).is_file()
