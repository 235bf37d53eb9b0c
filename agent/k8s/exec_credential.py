"""Runs a kubeconfig's exec credential plugin (aws, gke-gcloud-auth-plugin, kubelogin) so that an operator's
CLI commands work against managed clusters; the token is kept until the plugin's own expiry."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from agent.k8s.errors import Unavailable
from agent.timefmt import parse_rfc3339

#: A plugin that has not answered within this many seconds is given up on (it may be waiting for a browser).
EXEC_TIMEOUT_SECONDS = 30.0
#: A token this close to its expiry is fetched again rather than sent.
EXPIRY_MARGIN_SECONDS = 30.0


class ExecPlugin:
    """One `users[].user.exec` entry: run on first use, its ExecCredential's token cached until it expires."""

    def __init__(self, spec: Mapping[str, Any], *, folder: Path,
                 clock: Callable[[], float] = time.time) -> None:
        command = str(spec.get("command") or "")
        if not command:
            raise ValueError("exec credential plugin has no command")
        # Kubernetes resolves a relative command that names a path against the kubeconfig's folder.
        self.command = str(folder / command) if os.sep in command and not os.path.isabs(command) else command
        self.args = [str(a) for a in spec.get("args") or []]
        self.env = {str(e.get("name")): str(e.get("value", "")) for e in spec.get("env") or []
                    if isinstance(e, Mapping) and e.get("name")}
        self.api_version = str(spec.get("apiVersion") or "client.authentication.k8s.io/v1")
        self.clock = clock
        self._lock = threading.Lock()
        self._token = ""
        self._expires = 0.0

    def token(self) -> str:
        """The current token, running the plugin when none is held or the held one is about to expire."""
        with self._lock:
            if self._token and self.clock() < self._expires - EXPIRY_MARGIN_SECONDS:
                return self._token
            self._token, self._expires = self._run()
            return self._token

    def invalidate(self) -> None:
        """The server refused the held token (401): the next request runs the plugin again."""
        with self._lock:
            self._token, self._expires = "", 0.0

    def _run(self) -> tuple[str, float]:
        info = {"apiVersion": self.api_version, "kind": "ExecCredential", "spec": {"interactive": False}}
        environment = {**os.environ, **self.env, "KUBERNETES_EXEC_INFO": json.dumps(info)}
        name = Path(self.command).name
        try:
            done = subprocess.run(  # noqa: S603 - the operator's own kubeconfig names the plugin
                [self.command, *self.args], env=environment, stdin=subprocess.DEVNULL, capture_output=True,
                text=True, timeout=EXEC_TIMEOUT_SECONDS, check=False)
        except subprocess.TimeoutExpired:
            raise Unavailable(f"API credentials: exec plugin {name} did not answer within "
                              f"{EXEC_TIMEOUT_SECONDS:.0f} s") from None
        except OSError as exc:
            raise Unavailable(f"API credentials: exec plugin {name}: {exc.strerror or type(exc).__name__}") from None
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or [""])[-1]
            raise Unavailable(f"API credentials: exec plugin {name} exited {done.returncode}: {last}".rstrip(": "))
        return parse_exec_credential(done.stdout, plugin=name)


def parse_exec_credential(text: str, *, plugin: str) -> tuple[str, float]:
    """(token, expiry as a Unix time; infinity when the plugin gave none) from a plugin's ExecCredential."""
    try:
        document = json.loads(text)
    except ValueError:
        raise Unavailable(f"API credentials: exec plugin {plugin} did not print an ExecCredential") from None
    status = document.get("status") if isinstance(document, dict) else None
    token = status.get("token") if isinstance(status, dict) else None
    if not isinstance(token, str) or not token:
        has_certificate = isinstance(status, dict) and status.get("clientCertificateData")
        why = "gave a client certificate, which is not supported (only tokens)" if has_certificate \
            else "gave no token"
        raise Unavailable(f"API credentials: exec plugin {plugin} {why}")
    stamp = status.get("expirationTimestamp") if isinstance(status, dict) else None
    if not stamp:
        return token, float("inf")
    try:
        return token, parse_rfc3339(str(stamp))
    except ValueError:
        raise Unavailable(f"API credentials: exec plugin {plugin} gave an unreadable expirationTimestamp "
                          f"{str(stamp)[:40]!r}") from None
