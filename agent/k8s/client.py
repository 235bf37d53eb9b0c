"""Finds the cluster (in-cluster service account, then a kubeconfig) and gives a client whose every call is bounded."""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import urllib3.exceptions
import yaml
from kubernetes import client, config
from kubernetes.config.config_exception import ConfigException
from kubernetes.config.incluster_config import InClusterConfigLoader

from agent.k8s.detect import kubeconfig_path
from agent.k8s.errors import ClientConfigError, translate
from agent.k8s.retry import remaining_seconds

#: Where the kubelet mounts a pod's service-account token and the cluster's CA bundle.
SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


@dataclass(frozen=True, slots=True)
class Timeouts:
    """How long one request may take to connect, and to wait for each read of the answer."""

    connect: float = 3.0
    read: float = 10.0

    def within(self, remaining: float | None) -> tuple[float, float]:
        """(connect, read) for one request, cut to what is left of the caller's retry deadline."""
        if remaining is None:
            return self.connect, self.read
        left = max(remaining, 0.05)
        return min(self.connect, left), min(self.read, left)


class BoundedApiClient(client.ApiClient):
    """An ApiClient that puts a connect and read timeout on every request it sends.

    The generated client sends a request without any timeout unless `_request_timeout` is given to that
    call; urllib3 then waits for ever on a server that accepted the connection and never answers.
    """

    def __init__(self, configuration: Any, *, timeouts: Timeouts) -> None:
        super().__init__(configuration)
        self.timeouts = timeouts

    def call_api(self, method: str, url: str, header_params: Any = None, body: Any = None,
                 post_params: Any = None, _request_timeout: Any = None) -> Any:
        bound = _request_timeout or self.timeouts.within(remaining_seconds())
        try:
            return super().call_api(method, url, header_params, body, post_params, _request_timeout=bound)
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise translate(exc, request=f"{method} {urlsplit(url).path}", timeout=bound) from exc


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


def load_api_client(*, kubeconfig: str | None = None, timeouts: Timeouts | None = None,
                    service_account_dir: Path = SERVICE_ACCOUNT_DIR) -> tuple[Any, str]:
    """(ApiClient, how it was found); ClientConfigError when a configured cluster cannot be used.

    Whether a cluster is configured at all is `agent.k8s.detect.cluster_configured`'s question: this is
    asked only where one is, so a failure here is a broken pod or kubeconfig, never local mode.
    """
    configuration = client.Configuration()
    if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        loader = InClusterConfigLoader(token_filename=str(service_account_dir / "token"),
                                       cert_filename=str(service_account_dir / "ca.crt"))  # type: ignore[no-untyped-call]
        try:
            loader.load_and_set(configuration)  # type: ignore[no-untyped-call]
        except (ConfigException, OSError, ValueError) as exc:
            raise ClientConfigError(f"in-cluster configuration ({service_account_dir}) is unusable: "
                                    f"{_one_line(exc)}") from None
        how = "in-cluster service account"
    else:
        path = kubeconfig_path(kubeconfig)
        try:
            config.load_kube_config(config_file=str(path), client_configuration=configuration)  # type: ignore[no-untyped-call]
        except (ConfigException, OSError, ValueError, TypeError, yaml.YAMLError) as exc:
            raise ClientConfigError(f"kubeconfig {path} is unusable: {_one_line(exc)}") from None
        how = f"kubeconfig {path}"
    _check_tls_files(configuration)
    return _bounded(configuration, timeouts or Timeouts()), how


def client_for(url: str, *, timeouts: Timeouts | None = None) -> Any:
    """An ApiClient for a server URL with no credentials (the fake API server)."""
    configuration = client.Configuration()
    configuration.host = url
    return _bounded(configuration, timeouts or Timeouts())


def _bounded(configuration: Any, timeouts: Timeouts) -> Any:
    configuration.retries = 0  # retries belong to agent.k8s.retry, under a deadline
    return BoundedApiClient(configuration, timeouts=timeouts)


def _check_tls_files(configuration: Any) -> None:
    """A CA bundle or client certificate that cannot be loaded fails now, not at the first API call."""
    ca, cert, key = configuration.ssl_ca_cert, configuration.cert_file, configuration.key_file
    try:
        context = ssl.create_default_context(cafile=ca) if ca else None
    except (ssl.SSLError, OSError) as exc:
        raise ClientConfigError(f"CA bundle {ca} is unusable: {_one_line(exc)}") from None
    if cert and context is not None:
        try:
            context.load_cert_chain(cert, key)
        except (ssl.SSLError, OSError) as exc:
            raise ClientConfigError(f"client certificate {cert} is unusable: {_one_line(exc)}") from None


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__
