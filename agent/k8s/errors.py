"""The Kubernetes client's exceptions, translated once into the agent's own errors."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar

import urllib3.exceptions
from kubernetes.client.exceptions import ApiException

from agent.errors import AgentError

T = TypeVar("T")


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


def translate(exc: BaseException) -> K8sError:
    if isinstance(exc, ApiException):
        status = int(exc.status or 0)
        message, reason = _status_message(exc)
        kind: type[K8sError] = {409: Conflict, 404: NotFound, 429: TooManyRequests, 401: Forbidden,
                                403: Forbidden, 400: Invalid, 415: Invalid, 422: Invalid}.get(status, K8sError)
        if status >= 500 or status == 0:
            kind = Unavailable
        return kind(message, status=status, reason=reason)
    if isinstance(exc, urllib3.exceptions.HTTPError | OSError):
        return Unavailable(f"API server unreachable: {exc}")
    return K8sError(f"{type(exc).__name__}: {exc}")


def _status_message(exc: ApiException) -> tuple[str, str]:
    try:
        body = json.loads(exc.body or "{}")
    except (TypeError, ValueError):
        body = {}
    if isinstance(body, dict) and body.get("message"):
        return f"{exc.status} {body.get('reason', '')}: {body['message']}".strip(), str(body.get("reason", ""))
    return f"{exc.status} {exc.reason}", str(exc.reason or "")


def api_call(func: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Call the client and raise only K8sError."""
    try:
        return func(*args, **kwargs)
    except K8sError:
        raise
    except (ApiException, urllib3.exceptions.HTTPError, OSError) as exc:
        raise translate(exc) from exc
