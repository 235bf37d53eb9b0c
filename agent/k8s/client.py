"""Finds the cluster: in-cluster configuration first, then a kubeconfig; none means local mode."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes import client, config
from kubernetes.config.config_exception import ConfigException

from agent.k8s.detect import kubeconfig_path


@dataclass(frozen=True, slots=True)
class Apis:
    """The API groups the agent uses, sharing one connection pool."""

    core: Any
    events: Any
    coordination: Any

    @classmethod
    def of(cls, api_client: Any) -> Apis:
        return cls(client.CoreV1Api(api_client), client.EventsV1Api(api_client),
                   client.CoordinationV1Api(api_client))


def load_api_client(*, kubeconfig: str | None = None, request_timeout: float = 10.0) -> tuple[Any | None, str]:
    """(ApiClient, how it was found), or (None, why not) when there is no cluster to talk to."""
    if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        try:
            config.load_incluster_config()  # type: ignore[no-untyped-call]
            return _client(request_timeout), "in-cluster service account"
        except ConfigException as exc:
            return None, f"in-cluster configuration failed: {exc}"
    path = str(kubeconfig_path(kubeconfig))
    if not Path(path).is_file():
        return None, "no in-cluster configuration and no kubeconfig"
    try:
        configuration = client.Configuration()
        config.load_kube_config(config_file=path, client_configuration=configuration)  # type: ignore[no-untyped-call]
    except (ConfigException, OSError, ValueError, TypeError) as exc:
        return None, f"kubeconfig {path} is unusable: {exc}"
    configuration.retries = 0
    return client.ApiClient(configuration), f"kubeconfig {path}"


def client_for(url: str) -> Any:
    """An ApiClient for a server URL with no credentials (the fake API server)."""
    configuration = client.Configuration()
    configuration.host = url
    configuration.retries = 0
    return client.ApiClient(configuration)


def _client(request_timeout: float) -> Any:
    configuration = client.Configuration.get_default_copy()
    configuration.retries = 0
    return client.ApiClient(configuration)
