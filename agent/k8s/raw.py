"""JSON requests on raw API paths over the agent's one connection pool: every Kubernetes call the agent makes,
as plain documents (no generated classes), each bounded in time, errors as the agent's K8sError family."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

from agent.k8s.errors import K8sError

JsonDocument = dict[str, Any]
#: A body sent: a plain dict, or one of agent.k8s.bodies' TypedDicts.
Body = Mapping[str, object]
MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"


def api_path(group: str, version: str, resource: str, *, namespace: str = "", name: str = "",
             subresource: str = "") -> str:
    """/api/v1/... for the core group, /apis/GROUP/VERSION/... otherwise; names are quoted."""
    path = f"/api/{version}" if not group else f"/apis/{group}/{version}"
    if namespace:
        path += f"/namespaces/{quote(namespace, safe='')}"
    path += f"/{resource}"
    if name:
        path += f"/{quote(name, safe='')}"
    if subresource:
        path += f"/{subresource}"
    return path


class RawApi:
    """One API server, spoken to as JSON on paths; errors come out as the agent's K8sError family."""

    def __init__(self, api_client: Any, *, timeout_seconds: float = 10.0) -> None:
        self.api_client = api_client
        self.timeout_seconds = timeout_seconds

    def get(self, path: str, *, query: dict[str, str] | None = None) -> JsonDocument:
        return self.request("GET", path, query=query)

    def create(self, path: str, body: Body) -> JsonDocument:
        return self.request("POST", path, body=body)

    def merge_patch(self, path: str, body: Body) -> JsonDocument:
        return self.request("PATCH", path, body=body, content_type=MERGE_PATCH)

    def strategic_patch(self, path: str, body: Body) -> JsonDocument:
        """Strategic merge: lists with a merge key (node conditions by type) merge item by item."""
        return self.request("PATCH", path, body=body, content_type=STRATEGIC_MERGE_PATCH)

    def delete(self, path: str, *, resource_version: str = "") -> JsonDocument:
        body = {"preconditions": {"resourceVersion": resource_version}} if resource_version else None
        return self.request("DELETE", path, body=body)

    def request(self, method: str, path: str, *, query: dict[str, str] | None = None,
                body: Body | None = None,
                content_type: str = "application/json") -> JsonDocument:
        """One request; raises K8sError (NotFound, Conflict, Forbidden, Unavailable, ...) on failure."""
        data = None if body is None else json.dumps(body, separators=(",", ":")).encode()
        text = self.api_client.request(method, path, query=query, body=data, content_type=content_type,
                                       read_timeout=self.timeout_seconds)
        try:
            document = json.loads(text) if text else {}
        except ValueError:
            raise K8sError(f"{method} {path}: the API server's answer is not JSON") from None
        return document if isinstance(document, dict) else {}
