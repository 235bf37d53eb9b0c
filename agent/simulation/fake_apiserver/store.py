"""The fake cluster's objects: create, read, replace, patch, graceful delete and evict, with their watch history."""

from __future__ import annotations

import copy
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agent.simulation.fake_apiserver.errors import ApiError, conflict_message, invalid_object
from agent.simulation.fake_apiserver.evictions import (
    DEFAULT_GRACE_SECONDS,
    budget_ignored,
    check_budgets,
    disruption_target,
    grace_period,
)
from agent.simulation.fake_apiserver.patch import PatchError, json_merge_patch, json_patch, strategic_merge_patch
from agent.simulation.fake_apiserver.resources import BY_PATH, RESOURCES, Resource, now_rfc3339
from agent.simulation.fake_apiserver.selectors import fields_match, labels_match, selector_matches
from agent.simulation.fake_apiserver.validation import (
    FieldError,
    validate_device_taint_rule,
    validate_event,
    validate_node,
)
from agent.simulation.fake_apiserver.watch import WatchHistory


@dataclass(slots=True)
class Faults:
    """What to break: every request answered 503 while down, extra latency, the next writes (or the next
    reads of a path) failed."""

    down: bool = False
    latency_seconds: float = 0.0
    fail_next_writes: list[int] = field(default_factory=list)
    #: The next GETs of one path answered with these codes (503, 429, ...), one each, as a loaded server or
    #: a failing etcd answers one read and not the next; and every GET of a path answered with one code
    #: while it is set (a watch is not).
    fail_next_reads: dict[str, list[int]] = field(default_factory=dict)
    fail_reads: dict[str, int] = field(default_factory=dict)
    conflict_first_write: bool = False
    requests: int = 0
    writes: int = 0
    _conflicted: set[str] = field(default_factory=set)


class FakeCluster:
    """The objects, with a cluster-wide resourceVersion counter; thread-safe.

    `clock` (seconds since the epoch) is the cluster's own time: deletionTimestamps are set from it, and a
    terminating pod is gone once it passes its deadline, as a kubelet (or kwok) would finish it.
    """

    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._terminating: dict[tuple[str, str, str, str], float] = {}
        self.lock = threading.RLock()
        self.revision = 1
        self.objects: dict[tuple[str, str, str, str], dict[str, Any]] = {}
        self.faults = Faults()
        self.log: list[tuple[str, str, int]] = []
        self.history = WatchHistory()

    def _changed(self, type_: str, key: tuple[str, str, str, str], obj: dict[str, Any]) -> None:
        """Every write lands in the watch history under the revision it made."""
        self.history.record(self.revision, type_, key[0], key[1], key[2], obj)

    # ---- storage ----
    def _key(self, resource: Resource, namespace: str, name: str) -> tuple[str, str, str, str]:
        return (resource.group, resource.plural, namespace if resource.namespaced else "", name)

    def _stamp(self, resource: Resource, obj: dict[str, Any]) -> dict[str, Any]:
        self.revision += 1
        meta = obj.setdefault("metadata", {})
        meta["resourceVersion"] = str(self.revision)
        obj["apiVersion"], obj["kind"] = resource.api_version, resource.kind
        return obj

    def create(self, resource: Resource, namespace: str, obj: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            obj = copy.deepcopy(obj)
            meta = obj.setdefault("metadata", {})
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
            name = meta.get("name")
            if not name:
                raise ApiError(422, "Invalid", f"{resource.kind} without metadata.name")
            if resource.namespaced:
                meta["namespace"] = namespace
            key = self._key(resource, namespace, name)
            if key in self.objects:
                raise ApiError(409, "AlreadyExists", f'{resource.plural} "{name}" already exists')
            meta.setdefault("uid", str(uuid.uuid4()))
            meta.setdefault("creationTimestamp", now_rfc3339(self.clock()))
            if resource.kind == "Pod":
                obj.setdefault("spec", {}).setdefault("terminationGracePeriodSeconds", DEFAULT_GRACE_SECONDS)
            _validate(resource, namespace, obj)
            self.objects[key] = self._stamp(resource, obj)
            self._changed("ADDED", key, self.objects[key])
            return copy.deepcopy(self.objects[key])

    def get(self, resource: Resource, namespace: str, name: str) -> dict[str, Any]:
        with self.lock:
            obj = self.objects.get(self._key(resource, namespace, name))
            if obj is None:
                raise ApiError(404, "NotFound", f'{resource.plural} "{name}" not found',
                               {"name": name, "kind": resource.plural})
            return copy.deepcopy(obj)

    def list_objects(self, resource: Resource, namespace: str | None, label_selector: str = "",
             field_selector: str = "") -> list[dict[str, Any]]:
        with self.lock:
            items = [copy.deepcopy(o) for (g, p, ns, _), o in sorted(self.objects.items())
                     if (g, p) == (resource.group, resource.plural) and (namespace in (None, "") or ns == namespace)]
        return [o for o in items if labels_match(o, label_selector) and fields_match(o, field_selector)]

    def replace(self, resource: Resource, namespace: str, name: str, obj: dict[str, Any],
                subresource: str = "") -> dict[str, Any]:
        """PUT: the body names the object of the URL; resourceVersion, when given, must be current."""
        given = obj.get("metadata", {})
        if given.get("name") and given["name"] != name:
            raise ApiError(400, "BadRequest", f"the name of the object ({given['name']}) does not match the name "
                                              f"on the URL ({name})")
        if resource.namespaced and given.get("namespace") and given["namespace"] != namespace:
            raise ApiError(400, "BadRequest", "the namespace of the provided object does not match the namespace "
                                              "sent on the request")
        return self._update(resource, namespace, name, obj, subresource)

    def _update(self, resource: Resource, namespace: str, name: str, obj: dict[str, Any],
                subresource: str = "") -> dict[str, Any]:
        with self.lock:
            current = self.get(resource, namespace, name)
            wanted = obj.get("metadata", {}).get("resourceVersion")
            if wanted and wanted != current["metadata"]["resourceVersion"]:
                raise ApiError(409, "Conflict", conflict_message(resource.plural, name))
            updated = _keep_parts(resource, current, copy.deepcopy(obj), subresource)
            updated["metadata"]["uid"] = current["metadata"]["uid"]
            updated["metadata"]["creationTimestamp"] = current["metadata"].get("creationTimestamp")
            if resource.namespaced:
                updated["metadata"]["namespace"] = namespace
            updated["metadata"]["name"] = name
            for kept in ("deletionTimestamp", "deletionGracePeriodSeconds"):
                if kept in current["metadata"]:
                    updated["metadata"][kept] = current["metadata"][kept]
            _validate(resource, namespace, updated)
            self.objects[self._key(resource, namespace, name)] = self._stamp(resource, updated)
            self._changed("MODIFIED", self._key(resource, namespace, name), updated)
            return copy.deepcopy(self.objects[self._key(resource, namespace, name)])

    def patch(self, resource: Resource, namespace: str, name: str, content_type: str, body: Any,
              subresource: str = "") -> dict[str, Any]:
        with self.lock:
            current = self.get(resource, namespace, name)
            try:
                if content_type.startswith("application/json-patch+json"):
                    patched = json_patch(current, body)
                elif content_type.startswith("application/merge-patch+json"):
                    patched = json_merge_patch(current, body)
                elif content_type.startswith("application/strategic-merge-patch+json"):
                    patched = strategic_merge_patch(current, body)
                else:
                    raise ApiError(415, "UnsupportedMediaType", f"the body of the request was in an unknown "
                                   f"format - accepted media types include: application/json-patch+json, "
                                   f"application/merge-patch+json, application/strategic-merge-patch+json "
                                   f"(got {content_type})")
            except PatchError as exc:
                raise ApiError(422, "Invalid", str(exc)) from None
            if not isinstance(patched, dict):
                raise ApiError(422, "Invalid", "the patch does not give an object")
            wanted = patched.get("metadata", {}).get("resourceVersion")
            if wanted and wanted != current["metadata"]["resourceVersion"]:
                raise ApiError(409, "Conflict", conflict_message(resource.plural, name))
            renamed = patched.get("metadata", {}).get("name")
            if renamed != name:
                raise invalid_object(resource.kind, name, [FieldError(
                    "metadata.name", "FieldValueInvalid", f'Invalid value: "{renamed}": field is immutable')])
            patched.setdefault("metadata", {})["resourceVersion"] = current["metadata"]["resourceVersion"]
            return self._update(resource, namespace, name, patched, subresource)

    def delete(self, resource: Resource, namespace: str, name: str, *,
               grace_seconds: int | None = None) -> dict[str, Any]:
        """Delete, gracefully for a pod bound to a node: it gets a deletionTimestamp and stays (Terminating)
        until its grace period (the pod's own, or `grace_seconds`) passes; a later, shorter grace period
        moves the deadline in, a longer one never out. Zero, an unbound or a finished pod: gone at once."""
        with self.lock:
            obj = self.get(resource, namespace, name)
            key = self._key(resource, namespace, name)
            if resource.kind == "Pod":
                period = grace_period(obj, grace_seconds)
                if period > 0:
                    return self._terminate(resource, key, obj, period)
            del self.objects[key]
            self._terminating.pop(key, None)
            self.revision += 1
            self._changed("DELETED", key, obj)
            return obj

    def _terminate(self, resource: Resource, key: tuple[str, str, str, str], pod: dict[str, Any],
                   period: int) -> dict[str, Any]:
        deadline = self.clock() + period
        if key in self._terminating and self._terminating[key] <= deadline:
            return pod
        self._terminating[key] = deadline
        pod["metadata"]["deletionTimestamp"] = now_rfc3339(deadline)
        pod["metadata"]["deletionGracePeriodSeconds"] = period
        self.objects[key] = self._stamp(resource, pod)
        self._changed("MODIFIED", key, pod)
        return copy.deepcopy(pod)

    def finish_terminations(self) -> None:
        """Remove the terminating pods whose grace period has passed on the cluster's clock."""
        with self.lock:
            now = self.clock()
            for key in [k for k, deadline in self._terminating.items() if deadline <= now]:
                self._finish(key)

    def finish_termination(self, namespace: str, name: str) -> None:
        """A terminating pod's containers have exited: the kubelet removes it now (grace period 0)."""
        with self.lock:
            key = self._key(BY_PATH[("", "v1", "pods")], namespace, name)
            if key not in self._terminating:
                raise ValueError(f"pod {namespace}/{name} is not terminating")
            self._finish(key)

    def _finish(self, key: tuple[str, str, str, str]) -> None:
        self._terminating.pop(key, None)
        gone = self.objects.pop(key, None)
        if gone is not None:
            self.revision += 1
            self._changed("DELETED", key, gone)

    # ---- eviction ----
    def evict(self, namespace: str, name: str, *, grace_seconds: int | None = None) -> None:
        """Evict a pod as the Eviction API does: a pod already terminating, finished or pending goes without
        asking; a pod under two or more PodDisruptionBudgets is refused with a bare 500; one budget that
        allows no disruption refuses with 429; otherwise the pod is marked DisruptionTarget and deleted
        (gracefully)."""
        pods = BY_PATH[("", "v1", "pods")]
        pdbs = BY_PATH[("policy", "v1", "poddisruptionbudgets")]
        with self.lock:
            pod = self.get(pods, namespace, name)
            if budget_ignored(pod):
                self.delete(pods, namespace, name, grace_seconds=grace_seconds)
                return
            covering = [pdb for pdb in self.list_objects(pdbs, namespace)
                        if selector_matches(pdb.get("spec", {}).get("selector", {}), pod)]
            check_budgets(pod, covering, self.list_objects(pods, namespace))
            conditions = disruption_target(pod, now_rfc3339(self.clock()))
            pod.setdefault("status", {})["conditions"] = conditions
            self.objects[self._key(pods, namespace, name)] = self._stamp(pods, pod)
            self._changed("MODIFIED", self._key(pods, namespace, name), pod)
            self.delete(pods, namespace, name, grace_seconds=grace_seconds)

    # ---- helpers for tests and simulate ----
    def add(self, kind_plural: str, obj: dict[str, Any], *, group: str = "", namespace: str = "") -> dict[str, Any]:
        resource = next(r for r in RESOURCES if r.plural == kind_plural and r.group == group)
        return self.create(resource, namespace or obj.get("metadata", {}).get("namespace", ""), obj)

    def node(self, name: str) -> dict[str, Any]:
        return self.get(BY_PATH[("", "v1", "nodes")], "", name)

    def pods_on(self, node: str) -> list[dict[str, Any]]:
        self.finish_terminations()
        return self.list_objects(BY_PATH[("", "v1", "pods")], None, field_selector=f"spec.nodeName={node}")

    def device_taint_rules(self) -> list[dict[str, Any]]:
        return self.list_objects(next(r for r in RESOURCES if r.plural == "devicetaintrules"), None)

    def events(self) -> list[dict[str, Any]]:
        return self.list_objects(BY_PATH[("events.k8s.io", "v1", "events")], None)


def _keep_parts(resource: Resource, current: dict[str, Any], updated: dict[str, Any],
                subresource: str) -> dict[str, Any]:
    """The main resource ignores status; the status subresource changes only status, but a Node's status
    subresource changes its metadata too (the real server's Node status strategy resets only the spec)."""
    if "status" not in resource.subresources:
        return updated
    if subresource == "status" and resource.kind == "Node":
        updated["spec"] = copy.deepcopy(current.get("spec", {}))
        return updated
    if subresource == "status":
        kept = copy.deepcopy(current)
        kept["status"] = updated.get("status", {})
        kept["metadata"]["resourceVersion"] = updated.get("metadata", {}).get("resourceVersion")
        return kept
    updated["status"] = copy.deepcopy(current.get("status", {}))
    return updated


def _validate(resource: Resource, namespace: str, obj: dict[str, Any]) -> None:
    name = obj.get("metadata", {}).get("name", "")
    if resource.kind == "Node":
        errors = validate_node(obj)
    elif resource.kind == "Event" and resource.group == "events.k8s.io":
        errors = validate_event(obj, namespace)
    elif resource.kind == "DeviceTaintRule":
        errors = validate_device_taint_rule(obj)
    else:
        return
    if errors:
        raise invalid_object(resource.kind, name, errors)
