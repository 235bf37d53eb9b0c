"""The validation a real kube-apiserver does on what the agent writes (Nodes, Events, DeviceTaintRules)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

TAINT_EFFECTS = ("NoExecute", "NoSchedule", "PreferNoSchedule")
DEVICE_TAINT_EFFECTS = ("None", "NoSchedule", "NoExecute")
EVENT_TYPES = ("Normal", "Warning")
#: The most all of an object's annotations may hold, keys and values (apimachinery TotalAnnotationSizeLimitB).
TOTAL_ANNOTATION_BYTES = 256 * 1024
#: Namespaces where an Event about a cluster-scoped object (no regarding.namespace) may live.
CLUSTER_EVENT_NAMESPACES = ("default", "kube-system")
_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


@dataclass(frozen=True, slots=True)
class FieldError:
    """One `field.Error` of apimachinery: the field path, its reason (a StatusCause type) and the text."""

    field: str
    reason: str
    message: str

    def cause(self) -> dict[str, str]:
        return {"reason": self.reason, "message": f"{self.field}: {self.message}", "field": self.field}


def required(path: str) -> FieldError:
    return FieldError(path, "FieldValueRequired", "Required value")


def invalid(path: str, value: Any, why: str) -> FieldError:
    return FieldError(path, "FieldValueInvalid", f"Invalid value: {_quoted(value)}: {why}")


def unsupported(path: str, value: Any, supported: tuple[str, ...]) -> FieldError:
    return FieldError(path, "FieldValueNotSupported", f"Unsupported value: {_quoted(value)}: supported values: "
                      + ", ".join(f'"{s}"' for s in supported))


def too_long(path: str, limit: int) -> FieldError:
    return FieldError(path, "FieldValueTooLong", f"Too long: may not be more than {limit} bytes")


def _quoted(value: Any) -> str:
    return f'"{value}"' if isinstance(value, str) else str(value)


def qualified_name(path: str, value: str) -> list[FieldError]:
    """A label key or taint key: an optional DNS-subdomain prefix, a slash, a name of at most 63 characters."""
    prefix, _, name = value.rpartition("/")
    if not value:
        return [required(path)]
    if (prefix and (len(prefix) > 253 or not _DNS_SUBDOMAIN.match(prefix))) or len(name) > 63 \
            or not _NAME.match(name):
        return [invalid(path, value, "name part must consist of alphanumeric characters, '-', '_' or '.', "
                                     "and must start and end with an alphanumeric character")]
    return []


def label_value(path: str, value: Any) -> list[FieldError]:
    if not isinstance(value, str) or len(value) > 63 or not _LABEL_VALUE.match(value):
        return [invalid(path, value, "a valid label must be an empty string or consist of alphanumeric "
                                     "characters, '-', '_' or '.', at most 63 characters")]
    return []


def validate_metadata(obj: dict[str, Any]) -> list[FieldError]:
    meta = obj.get("metadata") or {}
    errors: list[FieldError] = []
    for key, value in (meta.get("labels") or {}).items():
        errors += qualified_name(f"metadata.labels: {key}", key)
        errors += label_value(f"metadata.labels: {key}", value)
    annotations = meta.get("annotations") or {}
    for key in annotations:
        errors += qualified_name(f"metadata.annotations: {key}", key)
    # apimachinery's ValidateAnnotations: keys and values together, in bytes, at most 256 KiB.
    total = sum(len(str(k).encode()) + len(str(v).encode()) for k, v in annotations.items())
    if total > TOTAL_ANNOTATION_BYTES:
        errors.append(too_long("metadata.annotations", TOTAL_ANNOTATION_BYTES))
    return errors


def validate_node(node: dict[str, Any]) -> list[FieldError]:
    """Taints: a valid key, a label-like value, a supported effect, unique by (key, effect)."""
    errors = validate_metadata(node)
    seen: set[tuple[str, str]] = set()
    for i, taint in enumerate((node.get("spec") or {}).get("taints") or []):
        path = f"spec.taints[{i}]"
        if not isinstance(taint, dict):
            errors.append(invalid(path, taint, "a taint is an object"))
            continue
        errors += qualified_name(f"{path}.key", str(taint.get("key") or ""))
        if taint.get("value"):
            errors += label_value(f"{path}.value", taint["value"])
        effect = taint.get("effect") or ""
        if not effect:
            errors.append(required(f"{path}.effect"))
        elif effect not in TAINT_EFFECTS:
            errors.append(unsupported(f"{path}.effect", effect, TAINT_EFFECTS))
        pair = (str(taint.get("key")), str(effect))
        if pair in seen:
            errors.append(FieldError(path, "FieldValueDuplicate", f"Duplicate value: \"{pair[0]}:{pair[1]}\": "
                                                                  "taints must be unique by key and effect pair"))
        seen.add(pair)
    return errors


def validate_event(event: dict[str, Any], namespace: str) -> list[FieldError]:
    """events.k8s.io/v1 creation (ValidateEventCreate): the fields a new-style Event must carry."""
    errors = validate_metadata(event)
    if not event.get("eventTime"):
        errors.append(required("eventTime"))
    if event.get("type") not in EVENT_TYPES:
        errors.append(invalid("type", "", f"has invalid value: {event.get('type', '')}"))
    regarding = event.get("regarding") or {}
    if not regarding.get("namespace") and namespace not in CLUSTER_EVENT_NAMESPACES:
        errors.append(invalid("regarding.namespace", "", "does not match event.namespace"))
    controller = event.get("reportingController") or ""
    errors += [required("reportingController")] if not controller else qualified_name("reportingController",
                                                                                      controller)
    for name, limit in (("reportingInstance", 128), ("action", 128), ("reason", 128)):
        value = event.get(name) or ""
        if not value:
            errors.append(required(name))
        elif len(value) > limit:
            errors.append(too_long(name, limit))
    if len(event.get("note") or "") > 1024:
        errors.append(too_long("note", 1024))
    series = event.get("series")
    if series is not None:
        if int(series.get("count") or 0) < 2:
            errors.append(invalid("series.count", series.get("count", 0), "should be at least 2"))
        if not series.get("lastObservedTime"):
            errors.append(required("series.lastObservedTime"))
    for deprecated in ("deprecatedFirstTimestamp", "deprecatedLastTimestamp", "deprecatedCount"):
        if event.get(deprecated):
            errors.append(invalid(deprecated, "", "needs to be unset"))
    return errors


def validate_device_taint_rule(rule: dict[str, Any]) -> list[FieldError]:
    """resource.k8s.io DeviceTaintRule: a DNS-subdomain name, a taint with a qualified key and a known effect."""
    errors = validate_metadata(rule)
    name = str((rule.get("metadata") or {}).get("name", ""))
    if name and not _DNS_SUBDOMAIN.match(name):
        errors.append(invalid("metadata.name", name, "a lowercase RFC 1123 subdomain must consist of lower case "
                                                      "alphanumeric characters, '-' or '.'"))
    taint = (rule.get("spec") or {}).get("taint")
    if not isinstance(taint, dict):
        return [*errors, required("spec.taint")]
    if not taint.get("key"):
        errors.append(required("spec.taint.key"))
    else:
        errors.extend(qualified_name("spec.taint.key", str(taint["key"])))
    if taint.get("effect") not in DEVICE_TAINT_EFFECTS:
        errors.append(unsupported("spec.taint.effect", taint.get("effect"), DEVICE_TAINT_EFFECTS))
    return errors
