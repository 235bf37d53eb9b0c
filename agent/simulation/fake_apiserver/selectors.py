"""Label selectors (query strings and LabelSelector objects) and field selectors, as the API server matches them."""

from __future__ import annotations

import re
from typing import Any

from agent.fleet.node_selector import labels_match_selector


def selector_matches(selector: dict[str, Any], obj: dict[str, Any]) -> bool:
    labels = obj.get("metadata", {}).get("labels", {}) or {}
    if not selector:
        return False
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expression in selector.get("matchExpressions") or []:
        key, op, values = expression["key"], expression["operator"], expression.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and labels.get(key) in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def labels_match(obj: dict[str, Any], selector: str) -> bool:
    return labels_match_selector(obj.get("metadata", {}).get("labels", {}) or {}, selector)


def fields_match(obj: dict[str, Any], selector: str) -> bool:
    for term in filter(None, (t.strip() for t in selector.split(","))):
        negate = "!=" in term
        key, value = re.split(r"==|!=|=", term, maxsplit=1)
        actual: Any = obj
        for part in key.strip().split("."):
            actual = actual.get(part, "") if isinstance(actual, dict) else ""
        if (str(actual) == value.strip()) == negate:
            return False
    return True
