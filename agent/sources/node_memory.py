"""What a source must remember across restarts and reboots (the node's GPUs, the NVLinks seen up), behind a
small Protocol so the daemon can keep it in its state directory and tests in memory."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any, Protocol

from agent.logs import get_logger

log = get_logger("agent.sources.node_memory")


class NodeMemory(Protocol):
    """A small durable key -> JSON value store."""

    def load(self, key: str) -> Any: ...

    def save(self, key: str, value: Any) -> None: ...


class InMemory:
    """A NodeMemory that lives as long as the process (tests; a node without a state directory)."""

    def __init__(self) -> None:
        self._values: dict[str, Any] = {}

    def load(self, key: str) -> Any:
        return json.loads(json.dumps(self._values.get(key)))

    def save(self, key: str, value: Any) -> None:
        self._values[key] = json.loads(json.dumps(value))


class JsonFileMemory:
    """A NodeMemory in one JSON file, replaced atomically on every save; a damaged file reads as empty."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()

    def load(self, key: str) -> Any:
        return self._read().get(key)

    def save(self, key: str, value: Any) -> None:
        with self._lock:
            document = self._read()
            document[key] = value
            temporary = self.path.with_name(self.path.name + ".tmp")
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                temporary.write_text(json.dumps(document, sort_keys=True), encoding="utf-8")
                os.replace(temporary, self.path)
            except OSError as exc:
                log.warning("node_memory_unwritable", path=str(self.path), error=str(exc))

    def _read(self) -> dict[str, Any]:
        try:
            document = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            log.warning("node_memory_unreadable", path=str(self.path), error=str(exc))
            return {}
        return document if isinstance(document, dict) else {}
