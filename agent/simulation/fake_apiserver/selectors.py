"""Label selectors (query strings and LabelSelector objects) and field selectors, as the API server matches them."""

from __future__ import annotations

import re
from typing import Any


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


_LABEL_TERM = re.compile(r"^\s*([\w./-]+)\s*(==|=|!=)\s*([\w./-]*)\s*$")


def labels_match(obj: dict[str, Any], selector: str) -> bool:
    if not selector:
        return True
    labels = obj.get("metadata", {}).get("labels", {}) or {}
    for term in _split_selector(selector):
        match = _LABEL_TERM.match(term)
        if match:
            key, op, value = match.groups()
            if (labels.get(key) == value) != (op in {"=", "=="}):
                return False
        elif term.startswith("!"):
            if term[1:].strip() in labels:
                return False
        elif " in " in term or " notin " in term:
            key, op, rest = re.split(r"\s+(in|notin)\s+", term.strip(), maxsplit=1)
            values = {v.strip() for v in rest.strip("() ").split(",")}
            if (labels.get(key) in values) != (op == "in"):
                return False
        elif term.strip() not in labels:
            return False
    return True


def _split_selector(selector: str) -> list[str]:
    terms, depth, current = [], 0, ""
    for char in selector:
        depth += char == "("
        depth -= char == ")"
        if char == "," and depth == 0:
            terms.append(current)
            current = ""
        else:
            current += char
    return [t for t in [*terms, current] if t.strip()]


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
