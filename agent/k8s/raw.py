"""JSON requests on raw API paths through the official client's connection pool, without its generated
classes: for API groups the agent reads as plain documents (resource.k8s.io), and every call bounded in time."""

from __future__ import annotations

import json
from typing import Any

from kubernetes.client.exceptions import ApiException

from agent.k8s.errors import api_call

JsonDocument = dict[str, Any]
MERGE_PATCH = "application/merge-patch+json"


class RawApi:
    """One API server, spoken to as JSON on paths; errors come out as the agent's K8sError family."""

    def __init__(self, api_client: Any, *, timeout_seconds: float = 10.0) -> None:
        self.api_client = api_client
        self.timeout_seconds = timeout_seconds

    def get(self, path: str, *, query: dict[str, str] | None = None) -> JsonDocument:
        return self.request("GET", path, query=query)

    def create(self, path: str, body: JsonDocument) -> JsonDocument:
        return self.request("POST", path, body=body)

    def merge_patch(self, path: str, body: JsonDocument) -> JsonDocument:
        return self.request("PATCH", path, body=body, content_type=MERGE_PATCH)

    def delete(self, path: str, *, resource_version: str = "") -> JsonDocument:
        body = {"preconditions": {"resourceVersion": resource_version}} if resource_version else None
        return self.request("DELETE", path, body=body)

    def request(self, method: str, path: str, *, query: dict[str, str] | None = None,
                body: JsonDocument | None = None, content_type: str = "application/json") -> JsonDocument:
        """One request; raises K8sError (NotFound, Conflict, Forbidden, Unavailable, ...) on failure."""
        return api_call(self._request, method, path, query, body, content_type)

    def _request(self, method: str, path: str, query: dict[str, str] | None, body: JsonDocument | None,
                 content_type: str) -> JsonDocument:
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type
        serialized = self.api_client.param_serialize(
            method, path, query_params=list((query or {}).items()), header_params=headers, body=body,
            auth_settings=["BearerToken"])
        response = self.api_client.call_api(*serialized, _request_timeout=self.timeout_seconds)
        data = response.read()
        text = data.decode("utf-8", errors="replace") if data else ""
        if not 200 <= response.status <= 299:
            raise ApiException(http_resp=response, body=text, data=None)
        document = json.loads(text) if text else {}
        return document if isinstance(document, dict) else {}
