"""Strict records read from the agent's own files (msgspec Structs), and their problems as field path and reason."""

from __future__ import annotations

import re
from typing import Any, TypeVar

import msgspec

T = TypeVar("T")

_LOCATED = re.compile(r"^(?P<reason>.*) - at `\$(?P<path>[^`]*)`$", re.DOTALL)
_STEP = re.compile(r"\.([^.\[]+)|\[([^\]]*)\]")
_NAMED = re.compile(r"^Object (?:contains unknown|missing required) field `(?P<name>[^`]*)`$")


class Strict(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """A record read from a file: an unknown key is an error, the record is immutable once read, and built in code
    its fields are named (required ones may follow defaults, in the order the file format documents them). A subclass
    says `frozen=True, kw_only=True` again for mypy (msgspec inherits them; mypy's dataclass_transform does not)."""


class FieldProblem(ValueError):
    """A validator's objection to one field of its record (`field` relative to the record)."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(reason)
        self.field = field
        self.reason = reason


class RecordInvalid(Exception):
    """Data that does not fit its record: the first problem, with its field path (dotted, list items by index)."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}" if field else reason)
        self.field = field
        self.reason = reason


def convert(data: Any, record: type[T]) -> T:
    """`data` (what YAML or JSON read) as `record`, coerced as a config file's values may need ("8080" -> 8080);
    raise RecordInvalid naming the field."""
    try:
        return msgspec.convert(data, record, strict=False)
    except msgspec.ValidationError as exc:
        raise invalid(exc) from None


def invalid(exc: msgspec.ValidationError) -> RecordInvalid:
    """msgspec's message (`reason - at `$.a.b[0]``) as the field path `a.b.0` and the reason alone."""
    message = str(exc)
    located = _LOCATED.match(message)
    reason, path = (located["reason"], located["path"]) if located else (message, "")
    steps = [name or index for name, index in _STEP.findall(path)]
    named = _NAMED.match(reason)
    if named:
        steps.append(named["name"])
        reason = "unknown key" if "unknown" in reason else "required field missing"
    cause = exc.__cause__
    if isinstance(cause, FieldProblem):
        steps.extend(cause.field.split("."))
        reason = cause.reason
    return RecordInvalid(".".join(steps), reason)
