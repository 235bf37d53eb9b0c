"""Kubeconfig as kubectl reads it: every $KUBECONFIG file merged, and the proxy a connection goes through."""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from agent.k8s.detect import kubeconfig_paths
from agent.yamlload import safe_load

_SECTIONS = (("clusters", "cluster"), ("contexts", "context"), ("users", "user"))
_DEFAULT_PORTS = {"http": 80, "https": 443}


@dataclass(frozen=True, slots=True)
class Entry:
    """A named cluster, context or user, with the folder of the file that defined it (its relative paths are
    relative to that file, as kubectl resolves them)."""

    fields: dict[str, Any]
    folder: Path


@dataclass(frozen=True, slots=True)
class Selected:
    """The current context's cluster and user, from the merged files."""

    context: str
    cluster: Entry
    user: Entry | None
    files: tuple[Path, ...]


def load(explicit: str | None = None, env: Mapping[str, str] | None = None) -> Selected:
    """The current context of the kubeconfig kubectl would use: the file given, else every file of
    $KUBECONFIG (missing ones skipped) merged, else ~/.kube/config. Merging is kubectl's: the first file to
    name a cluster, context or user, and the first to set current-context, wins. ValueError (one line) when
    no file is there or the context, its cluster or its user is missing."""
    paths = kubeconfig_paths(explicit, env)
    files = [p for p in paths if explicit or p.is_file()]
    if not files:
        raise ValueError(f"no kubeconfig file found (looked at {', '.join(str(p) for p in paths)})")
    current = ""
    named: dict[str, dict[str, Entry]] = {section: {} for section, _ in _SECTIONS}
    for path in files:
        document = safe_load(path.read_text()) or {}
        if not isinstance(document, dict):
            raise ValueError(f"{path} is not a kubeconfig (no mapping at the top)")
        current = current or str(document.get("current-context") or "")
        for section, field in _SECTIONS:
            for item in document.get(section) or []:
                if isinstance(item, dict) and item.get("name") is not None:
                    value = item.get(field)
                    named[section].setdefault(str(item["name"]), Entry(value if isinstance(value, dict) else {},
                                                                       path.parent))
    contexts = named["contexts"]
    if not current and len(contexts) == 1:
        current = next(iter(contexts))
    if current not in contexts:
        raise ValueError(f"no context named {current!r}" if current else "no current-context")
    context = contexts[current].fields
    cluster = named["clusters"].get(str(context.get("cluster", "")))
    if cluster is None:
        raise ValueError(f"no cluster named {str(context.get('cluster', ''))!r}")
    user = None
    if context.get("user"):
        user = named["users"].get(str(context["user"]))
        if user is None:
            raise ValueError(f"no user named {str(context['user'])!r}")
    return Selected(current, cluster, user, tuple(files))


def proxy_for(server: str, *, proxy_url: str = "", env: Mapping[str, str] | None = None) -> str:
    """The proxy a connection to `server` goes through ("" for none), as kubectl chooses it: the cluster's
    `proxy-url`, else HTTPS_PROXY (HTTP_PROXY for an http server; lower-case names too) unless NO_PROXY
    exempts the host; localhost and loopback addresses are never sent to an environment proxy."""
    if proxy_url:
        return proxy_url
    env = os.environ if env is None else env
    parts = urlsplit(server)
    host = (parts.hostname or "").lower()
    if not host or host == "localhost" or _loopback(host):
        return ""
    name = "HTTPS_PROXY" if parts.scheme == "https" else "HTTP_PROXY"
    proxy = env.get(name) or env.get(name.lower()) or ""
    if not proxy:
        return ""
    port = parts.port or _DEFAULT_PORTS.get(parts.scheme, 443)
    if _exempt(host, port, env.get("NO_PROXY") or env.get("no_proxy") or ""):
        return ""
    return proxy if "://" in proxy else f"http://{proxy}"


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _exempt(host: str, port: int, no_proxy: str) -> bool:
    """NO_PROXY as Go reads it: `*`; an IP or CIDR; a domain (and its subdomains; `.domain` subdomains
    only); each optionally with `:port`."""
    for raw in (part.strip().lower() for part in no_proxy.split(",")):
        if not raw:
            continue
        if raw == "*":
            return True
        entry, wanted_port = raw, None
        if entry.count(":") == 1 and not entry.endswith("]"):
            entry, _, text = entry.partition(":")
            wanted_port = int(text) if text.isdigit() else None
        entry = entry.strip("[]")
        if wanted_port is not None and wanted_port != port:
            continue
        if _ip_match(host, entry) or host == entry or host.endswith("." + entry.lstrip(".")):
            return True
    return False


def _ip_match(host: str, entry: str) -> bool:
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    try:
        return address in ipaddress.ip_network(entry, strict=False)
    except ValueError:
        return False
