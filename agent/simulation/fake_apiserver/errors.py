"""The API server's failure answers: a Status body with its code, reason and causes."""

from __future__ import annotations

from typing import Any

from agent.simulation.fake_apiserver.validation import FieldError


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code, self.reason, self.message, self.details = code, reason, message, details or {}

    def status(self) -> dict[str, Any]:
        body: dict[str, Any] = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                                "message": self.message, "code": self.code}
        if self.reason:
            body["reason"] = self.reason
        if self.details:
            body["details"] = self.details
        return body


def invalid_object(kind: str, name: str, errors: list[FieldError]) -> ApiError:
    """422 Invalid as the API server words it: every field error in the message and as a cause."""
    return ApiError(422, "Invalid", f'{kind} "{name}" is invalid: '
                    + ", ".join(f"{e.field}: {e.message}" for e in errors),
                    {"name": name, "kind": kind, "causes": [e.cause() for e in errors]})


def conflict_message(plural: str, name: str) -> str:
    return (f'Operation cannot be fulfilled on {plural} "{name}": the object has been modified; '
            "please apply your changes to the latest version and try again")
