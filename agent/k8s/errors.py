"""The Kubernetes client's exceptions, translated once into the agent's own errors, each one clear line."""

from __future__ import annotations

import json

import urllib3.exceptions

from agent.errors import AgentError


class K8sError(AgentError):
    """An API call failed; `status` is the HTTP status (0 when the server could not be reached)."""

    transient = False

    def __init__(self, message: str, *, status: int = 0, reason: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason


class Conflict(K8sError):
    """409: the object changed since it was read (resourceVersion precondition), or already exists."""


class NotFound(K8sError):
    """404."""


class TooManyRequests(K8sError):
    """429: for an eviction, a PodDisruptionBudget allows no disruption now."""


class Forbidden(K8sError):
    """401/403: RBAC or the admission policy said no."""


class Invalid(K8sError):
    """400/415/422: the request itself is wrong; retrying will not help."""


class Unavailable(K8sError):
    """5xx, or the server could not be reached: worth retrying."""

    transient = True


class ApiTimeout(Unavailable):
    """The server took the connection (or not) and did not answer within the request's timeout."""


class EvictionRefused(K8sError):
    """The API refuses this eviction outright and will keep refusing it (a pod under more than one
    PodDisruptionBudget answers 500): retrying cannot help, a human must decide."""


class ClientConfigError(AgentError):
    """A cluster is configured (service-account environment or kubeconfig) but cannot be used."""


#: The eviction subresource answers a pod matched by two or more PodDisruptionBudgets with a bare 500 Status
#: (no reason, no cause) carrying this text (kubernetes pkg/registry/core/pod/storage/eviction.go).
MULTIPLE_PDBS = "more than one PodDisruptionBudget"


def status_error(status: int, reason: str, body: str) -> K8sError:
    """The one place an HTTP status answer becomes an agent error; `body` is the API's Status (JSON)."""
    message, why = _status_message(status, reason, body)
    kind: type[K8sError] = {409: Conflict, 404: NotFound, 429: TooManyRequests, 401: Forbidden,
                            403: Forbidden, 400: Invalid, 415: Invalid, 422: Invalid}.get(status, K8sError)
    if status >= 500 or status == 0:
        kind = EvictionRefused if status == 500 and MULTIPLE_PDBS in message else Unavailable
    return kind(message, status=status, reason=why)


def translate(exc: BaseException, *, request: str = "", timeout: tuple[float, float] | None = None,
              server: str = "") -> K8sError:
    """The one place a transport exception becomes an agent error; `request` ("GET /api/v1/..."), `timeout`
    (connect, read) and `server` (host:port) name what failed."""
    if isinstance(exc, K8sError):
        return exc
    cause = exc.reason if isinstance(exc, urllib3.exceptions.MaxRetryError) and exc.reason else exc
    server = server or _server_of(exc)
    what = f" ({request})" if request else ""
    if isinstance(cause, urllib3.exceptions.NewConnectionError | ConnectionRefusedError):
        return Unavailable(f"API server {server} refused the connection{what}")
    if isinstance(cause, urllib3.exceptions.ConnectTimeoutError):
        bound = f" within {timeout[0]:.1f}s" if timeout else ""
        return ApiTimeout(f"API server {server} could not be reached{bound}{what}")
    if isinstance(cause, urllib3.exceptions.TimeoutError | TimeoutError):
        bound = f" within {timeout[1]:.1f}s" if timeout else ""
        return ApiTimeout(f"API server {server} did not answer{bound}{what}")
    if isinstance(exc, urllib3.exceptions.HTTPError | OSError):
        return Unavailable(f"API server {server} unreachable{what}: {_one_line(cause)}")
    return K8sError(f"{type(exc).__name__}: {_one_line(exc)}")


def _server_of(exc: BaseException) -> str:
    pool = getattr(exc, "pool", None)
    host, port = getattr(pool, "host", None), getattr(pool, "port", None)
    return f"{host}:{port}" if host else "(unknown address)"


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _status_message(status: int, reason: str, body: str) -> tuple[str, str]:
    try:
        document = json.loads(body or "{}")
    except (TypeError, ValueError):
        document = {}
    if isinstance(document, dict) and document.get("message"):
        why = str(document.get("reason") or "")
        return " ".join(f"{f'{status} {why}'.strip()}: {document['message']}".split()), why
    return " ".join(f"{status} {reason}".split()), reason
