"""The three Kubernetes patch types, as the API server applies them: JSON patch, merge patch, strategic merge."""

from __future__ import annotations

import copy
from typing import Any

# Lists that strategic merge patch merges by a key (the rest are replaced whole, as for Node spec.taints).
MERGE_KEYS: dict[tuple[str, ...], str] = {
    ("status", "conditions"): "type",
    ("status", "addresses"): "type",
    ("spec", "containers"): "name",
    ("metadata", "ownerReferences"): "uid",
}


class PatchError(ValueError):
    """The patch cannot be applied (bad document, failed test operation, missing path)."""


def json_merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: objects merge, null deletes, everything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = json_merge_patch(result.get(key), value)
    return result


def strategic_merge_patch(target: Any, patch: Any, path: tuple[str, ...] = ()) -> Any:
    """Merge patch, plus: lists with a merge key merge item by item; `$patch: delete` removes an item;
    `$setElementOrder/...` and `$retainKeys` directives are accepted."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    if patch.get("$patch") == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if key.startswith("$setElementOrder/") or key in {"$retainKeys", "$patch"}:
            continue
        if key.startswith("$deleteFromPrimitiveList/"):
            field = key.split("/", 1)[1]
            result[field] = [item for item in result.get(field, []) if item not in value]
            continue
        child_path = (*path, key)
        if value is None:
            result.pop(key, None)
        elif isinstance(value, list) and child_path in MERGE_KEYS:
            result[key] = _merge_list(result.get(key) or [], value, MERGE_KEYS[child_path])
        else:
            result[key] = strategic_merge_patch(result.get(key), value, child_path)
    return result


def _merge_list(current: list[Any], patch: list[Any], key: str) -> list[Any]:
    merged = [copy.deepcopy(item) for item in current]
    for item in patch:
        if not isinstance(item, dict) or key not in item:
            raise PatchError(f"list item without its merge key {key!r}")
        position = next((i for i, existing in enumerate(merged) if existing.get(key) == item[key]), None)
        if item.get("$patch") == "delete":
            if position is not None:
                del merged[position]
        elif position is None:
            merged.append({k: v for k, v in item.items() if not k.startswith("$")})
        else:
            merged[position] = strategic_merge_patch(merged[position], item)
    return merged


def json_patch(target: Any, operations: Any) -> Any:
    """RFC 6902: add, remove, replace, move, copy, test."""
    if not isinstance(operations, list):
        raise PatchError("a JSON patch is a list of operations")
    document = copy.deepcopy(target)
    for operation in operations:
        if not isinstance(operation, dict) or "op" not in operation or "path" not in operation:
            raise PatchError(f"bad operation {operation!r}")
        op, path = operation["op"], _pointer(operation["path"])
        if op == "add":
            document = _add(document, path, copy.deepcopy(operation.get("value")))
        elif op == "remove":
            document, _ = _remove(document, path)
        elif op == "replace":
            document, _ = _remove(document, path)
            document = _add(document, path, copy.deepcopy(operation.get("value")))
        elif op in {"move", "copy"}:
            source = _pointer(operation.get("from", ""))
            value = copy.deepcopy(_get(document, source))
            if op == "move":
                document, _ = _remove(document, source)
            document = _add(document, path, value)
        elif op == "test":
            if _get(document, path) != operation.get("value"):
                raise PatchError(f"test failed at {operation['path']}")
        else:
            raise PatchError(f"unknown op {op!r}")
    return document


def _pointer(text: str) -> list[str]:
    if text == "":
        return []
    if not text.startswith("/"):
        raise PatchError(f"bad JSON pointer {text!r}")
    return [part.replace("~1", "/").replace("~0", "~") for part in text[1:].split("/")]


def _parent(document: Any, path: list[str]) -> Any:
    node = document
    for part in path[:-1]:
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node


def _get(document: Any, path: list[str]) -> Any:
    try:
        node = document
        for part in path:
            node = node[int(part)] if isinstance(node, list) else node[part]
        return node
    except (KeyError, IndexError, ValueError, TypeError):
        raise PatchError(f"path /{'/'.join(path)} does not exist") from None


def _add(document: Any, path: list[str], value: Any) -> Any:
    if not path:
        return value
    try:
        parent = _parent(document, path)
    except (KeyError, IndexError, ValueError, TypeError):
        raise PatchError(f"parent of /{'/'.join(path)} does not exist") from None
    last = path[-1]
    if isinstance(parent, list):
        parent.insert(len(parent) if last == "-" else int(last), value)
    elif isinstance(parent, dict):
        parent[last] = value
    else:
        raise PatchError(f"cannot add at /{'/'.join(path)}")
    return document


def _remove(document: Any, path: list[str]) -> tuple[Any, Any]:
    _get(document, path)
    parent = _parent(document, path)
    last = path[-1]
    value = parent.pop(int(last)) if isinstance(parent, list) else parent.pop(last)
    return document, value
