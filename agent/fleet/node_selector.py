"""Label selectors in their query-string form (`a=b,c!=d,e,!f,g in (h,i)`), matched as the API server does (pure)."""

from __future__ import annotations

import re
from collections.abc import Mapping

_EQUALITY_TERM = re.compile(r"^\s*([\w./-]+)\s*(==|=|!=)\s*([\w./-]*)\s*$")


def labels_match_selector(labels: Mapping[str, str], selector: str) -> bool:
    """Whether `labels` satisfy every term of `selector` (an empty selector matches everything)."""
    for term in split_selector(selector):
        match = _EQUALITY_TERM.match(term)
        if match:
            key, op, value = match.groups()
            if (labels.get(key) == value) != (op in {"=", "=="}):
                return False
        elif term.strip().startswith("!"):
            if term.strip()[1:].strip() in labels:
                return False
        elif " in " in term or " notin " in term:
            key, op, rest = re.split(r"\s+(in|notin)\s+", term.strip(), maxsplit=1)
            values = {v.strip() for v in rest.strip("() ").split(",")}
            if (labels.get(key) in values) != (op == "in"):
                return False
        elif term.strip() not in labels:
            return False
    return True


def split_selector(selector: str) -> list[str]:
    """The selector's terms (commas inside a set's parentheses do not split)."""
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
