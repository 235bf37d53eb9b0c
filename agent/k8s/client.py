"""Finds the cluster (in-cluster service account, then a kubeconfig) and gives a client whose every call is bounded."""

from __future__ import annotations

import base64
import os
import ssl
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlsplit

import urllib3
import yaml

from agent.k8s.detect import kubeconfig_path
from agent.k8s.errors import ClientConfigError, Unavailable, status_error, translate
from agent.k8s.exec_credential import ExecPlugin
from agent.k8s.kubeconfig import Selected, proxy_for
from agent.k8s.kubeconfig import load as load_kubeconfig
from agent.k8s.retry import remaining_seconds

#: Where the kubelet mounts a pod's service-account token and the cluster's CA bundle.
SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
#: Connections kept open to the API server: the pipeline, the node sync and the HTTP server's threads.
POOL_SIZE = 4


@dataclass(frozen=True, slots=True)
class Timeouts:
    """How long one request may take to connect, and to wait for each read of the answer."""

    connect: float = 3.0
    read: float = 10.0

    def within(self, remaining: float | None) -> tuple[float, float]:
        """(connect, read) for one request, cut to what is left of the caller's retry deadline."""
        if remaining is None:
            return self.connect, self.read
        left = max(remaining, 0.05)
        return min(self.connect, left), min(self.read, left)


@dataclass(frozen=True, slots=True)
class Credentials:
    """How the agent proves who it is: a bearer token (fixed, a file re-read when it rotates, or an exec
    plugin's), or nothing beyond the client certificate of the TLS context."""

    token: str = ""
    token_file: str = ""
    basic: str = ""  # "user:password" from a kubeconfig
    exec_plugin: ExecPlugin | None = None


class ApiClient:
    """One API server over one keep-alive connection pool; answers are (status, body bytes), failures the
    agent's K8sError family. No generated classes: callers speak JSON on paths (agent.k8s.raw.RawApi)."""

    def __init__(self, host: str, *, ssl_context: ssl.SSLContext | None = None,
                 credentials: Credentials = Credentials(), timeouts: Timeouts = Timeouts(),
                 server_name: str = "", proxy: str = "") -> None:
        """`proxy`: an http(s) proxy URL (user:password@ for basic auth): https goes through a CONNECT
        tunnel, http as absolute-form requests."""
        self.host = host.rstrip("/")
        self.timeouts = timeouts
        self.credentials = credentials
        parts = urlsplit(self.host)
        self._prefix = parts.path.rstrip("/")
        options: dict[str, Any] = {"maxsize": POOL_SIZE, "block": False, "retries": False}
        if parts.scheme == "https":
            options["ssl_context"] = ssl_context or ssl.create_default_context()
            if server_name:
                options["server_hostname"] = server_name
        #: Requests to an http server through a proxy name the whole URL (absolute form).
        self._origin = f"{parts.scheme}://{parts.netloc}" if proxy and parts.scheme == "http" else ""
        if proxy:
            self.pool = _proxied_pool(proxy, parts.scheme, parts.hostname or "", parts.port, options)
        else:
            self.pool = urllib3.connectionpool.connection_from_url(f"{parts.scheme}://{parts.netloc}", **options)
        self._token_lock = threading.Lock()
        self._token = credentials.token
        self._token_stamp: tuple[int, int] | None = None

    def request(self, method: str, path: str, *, query: Mapping[str, str] | None = None, body: bytes | None = None,
                content_type: str = "application/json", read_timeout: float | None = None) -> bytes:
        """One request; the body of a 2xx answer, else K8sError (NotFound, Conflict, Unavailable, ...)."""
        url = self._origin + self._prefix + path + (f"?{urlencode(dict(query))}" if query else "")
        connect, read = self.timeouts.within(remaining_seconds())
        if read_timeout is not None:
            read = min(read, read_timeout)
        headers = {"Accept": "application/json", "User-Agent": "gpu-health-agent"}
        if self._origin:
            headers["Host"] = urlsplit(self._origin).netloc  # the server's, not the proxy's
        if body is not None:
            headers["Content-Type"] = content_type
        for attempt in (1, 2):
            authorization = self._authorization()
            if authorization:
                headers["Authorization"] = authorization
            try:
                response = self.pool.urlopen(method, url, body=body, headers=headers, retries=False, redirect=False,
                                             timeout=urllib3.Timeout(connect=connect, read=read),
                                             preload_content=True, assert_same_host=not self._origin)
            except (urllib3.exceptions.HTTPError, OSError) as exc:
                raise translate(exc, request=f"{method} {path}", timeout=(connect, read),
                                server=f"{self.pool.host}:{self.pool.port}") from None
            # A refused token (rotated early, revoked, an exec plugin's expired without saying when): fetched
            # again and the request sent once more, as kubectl does; a second 401 is the answer.
            if response.status != 401 or attempt == 2 or not self._refresh_credentials():
                break
        data: bytes = response.data or b""
        if not 200 <= response.status <= 299:
            raise status_error(response.status, response.reason or "", data.decode("utf-8", errors="replace"))
        return data

    def stream(self, path: str, *, query: Mapping[str, str] | None = None, accept: str = "application/json",
               read_timeout: float | None = None) -> Any:
        """A GET whose answer is read as it comes (a watch, a large list): the open urllib3 response, each
        read bounded by `read_timeout`; the caller reads and releases it. Failures as in `request`."""
        url = self._prefix + path + (f"?{urlencode(dict(query))}" if query else "")
        connect, read = self.timeouts.connect, self.timeouts.read if read_timeout is None else read_timeout
        headers = {"Accept": accept, "User-Agent": "gpu-health-agent"}
        for attempt in (1, 2):
            authorization = self._authorization()
            if authorization:
                headers["Authorization"] = authorization
            try:
                response = self.pool.urlopen("GET", url, headers=headers, retries=False, redirect=False,
                                             timeout=urllib3.Timeout(connect=connect, read=read),
                                             preload_content=False)
            except (urllib3.exceptions.HTTPError, OSError) as exc:
                raise translate(exc, request=f"GET {path}", timeout=(connect, read),
                                server=f"{self.pool.host}:{self.pool.port}") from None
            if response.status != 401 or attempt == 2 or not self._refresh_credentials():
                break
            response.release_conn()
        if not 200 <= response.status <= 299:
            data = response.read() or b""
            response.release_conn()
            raise status_error(response.status, response.reason or "", data.decode("utf-8", errors="replace"))
        return response

    def _authorization(self) -> str:
        credentials = self.credentials
        if credentials.exec_plugin is not None:
            return f"Bearer {credentials.exec_plugin.token()}"
        if credentials.token_file:
            return f"Bearer {self._current_token(credentials.token_file)}"
        if credentials.token:
            return f"Bearer {credentials.token}"
        if credentials.basic:
            return "Basic " + base64.b64encode(credentials.basic.encode()).decode()
        return ""

    def _refresh_credentials(self) -> bool:
        """Forget a token that can be fetched again (exec plugin, token file); False when none can."""
        credentials = self.credentials
        if credentials.exec_plugin is not None:
            credentials.exec_plugin.invalidate()
            return True
        if credentials.token_file:
            with self._token_lock:
                self._token_stamp = None
            return True
        return False

    def _current_token(self, path: str) -> str:
        """The token file's content, re-read when the kubelet rotated it (its mtime or size changed)."""
        try:
            stat = os.stat(path)
            stamp = (stat.st_mtime_ns, stat.st_size)
            with self._token_lock:
                if stamp != self._token_stamp:
                    self._token = Path(path).read_text().strip()
                    self._token_stamp = stamp
                return self._token
        except OSError as exc:
            raise Unavailable(f"API credentials could not be refreshed: token file {path}: "
                              f"{exc.strerror or type(exc).__name__}") from None

    def close(self) -> None:
        self.pool.close()

    def __enter__(self) -> ApiClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def load_api_client(*, kubeconfig: str | None = None, timeouts: Timeouts | None = None,
                    service_account_dir: Path = SERVICE_ACCOUNT_DIR) -> tuple[ApiClient, str]:
    """(ApiClient, how it was found); ClientConfigError when a configured cluster cannot be used.

    Whether a cluster is configured at all is `agent.k8s.detect.cluster_configured`'s question: this is
    asked only where one is, so a failure here is a broken pod or kubeconfig, never local mode.
    """
    kubeconfig_file = kubeconfig
    if kubeconfig_file is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        return _in_cluster(service_account_dir, timeouts or Timeouts()), "in-cluster service account"
    try:
        selected = load_kubeconfig(kubeconfig_file)
        client = _from_kubeconfig(selected, timeouts or Timeouts())
    except (OSError, ValueError, TypeError, KeyError, AttributeError, yaml.YAMLError) as exc:
        raise ClientConfigError(f"kubeconfig {kubeconfig_path(kubeconfig_file)} is unusable: "
                                f"{_one_line(exc)}") from None
    return client, f"kubeconfig {os.pathsep.join(str(p) for p in selected.files)}"


def client_for(url: str, *, timeouts: Timeouts | None = None) -> ApiClient:
    """An ApiClient for a server URL with no credentials (the fake API server)."""
    return ApiClient(url, timeouts=timeouts or Timeouts())


def _in_cluster(folder: Path, timeouts: Timeouts) -> ApiClient:
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST", ""), os.environ.get("KUBERNETES_SERVICE_PORT", "")
    if not port:
        raise ClientConfigError("in-cluster configuration is unusable: KUBERNETES_SERVICE_HOST is set "
                                "but KUBERNETES_SERVICE_PORT is not")
    token = folder / "token"
    try:
        if not token.read_text().strip():
            raise ClientConfigError(f"in-cluster configuration ({folder}) is unusable: the token file is empty")
    except OSError as exc:
        raise ClientConfigError(f"in-cluster configuration ({folder}) is unusable: token file {token}: "
                                f"{exc.strerror or type(exc).__name__}") from None
    context = _tls_context(ca_file=str(folder / "ca.crt"))
    address = f"[{host}]" if ":" in host else host
    return ApiClient(f"https://{address}:{port}", ssl_context=context,
                     credentials=Credentials(token_file=str(token)), timeouts=timeouts)


def _from_kubeconfig(selected: Selected, timeouts: Timeouts) -> ApiClient:
    """The current context's server, CA, proxy and user (token, token file, exec plugin, client certificate,
    basic auth); each relative path is relative to the file that defined its entry."""
    cluster, cluster_folder = selected.cluster.fields, selected.cluster.folder
    user = selected.user.fields if selected.user else {}
    folder = selected.user.folder if selected.user else cluster_folder
    if user.get("auth-provider"):
        raise ValueError("auth-provider credentials (removed from kubectl in 1.26) are not supported: "
                         "use an exec plugin, a token or a client certificate")
    server = str(cluster.get("server") or "")
    if not server:
        raise ValueError(f"the cluster of context {selected.context!r} has no server")

    def file_or_data(key: str) -> tuple[str, bytes]:
        entry, base = (cluster, cluster_folder) if key == "certificate-authority" else (user, folder)
        data = entry.get(f"{key}-data")
        if data:
            return "", base64.b64decode(data)
        name = entry.get(key)
        return (str(base / name) if name else ""), b""

    context_tls = None
    if server.startswith("https://"):
        ca_file, ca_data = file_or_data("certificate-authority")
        cert_file, cert_data = file_or_data("client-certificate")
        key_file, key_data = file_or_data("client-key")
        context_tls = _tls_context(ca_file=ca_file, ca_data=ca_data, cert_file=cert_file, cert_data=cert_data,
                                   key_file=key_file, key_data=key_data,
                                   insecure=bool(cluster.get("insecure-skip-tls-verify")))
    token = str(user.get("token") or "")
    token_file = str(folder / user["tokenFile"]) if user.get("tokenFile") else ""
    basic = f"{user['username']}:{user.get('password', '')}" if user.get("username") else ""
    plugin = ExecPlugin(user["exec"], folder=folder) if isinstance(user.get("exec"), dict) else None
    proxy = proxy_for(server, proxy_url=str(cluster.get("proxy-url") or ""))
    return ApiClient(server, ssl_context=context_tls, credentials=Credentials(token, token_file, basic, plugin),
                     timeouts=timeouts, server_name=str(cluster.get("tls-server-name") or ""), proxy=proxy)


def _proxied_pool(proxy: str, scheme: str, host: str, port: int | None,
                  options: dict[str, Any]) -> urllib3.HTTPConnectionPool:
    """A pool whose connections go through an http(s) proxy (basic auth from the proxy URL's user:password)."""
    parsed = urllib3.util.parse_url(proxy)
    if parsed.scheme not in ("http", "https"):
        raise ClientConfigError(f"proxy {parsed.scheme}://{parsed.host}: only http and https proxies are supported")
    headers = urllib3.util.make_headers(proxy_basic_auth=parsed.auth) if parsed.auth else None
    manager = urllib3.ProxyManager(proxy, num_pools=1, proxy_headers=headers)
    return manager.connection_from_host(host, port, scheme, pool_kwargs=options)


def _tls_context(*, ca_file: str = "", ca_data: bytes = b"", cert_file: str = "", cert_data: bytes = b"",
                 key_file: str = "", key_data: bytes = b"", insecure: bool = False) -> ssl.SSLContext:
    """The TLS context of every connection; a CA bundle or client certificate that cannot be loaded fails
    now, not at the first API call."""
    try:
        context = ssl.create_default_context(cafile=ca_file or None,
                                             cadata=ca_data.decode() if ca_data else None)
    except (ssl.SSLError, OSError, ValueError) as exc:
        raise ClientConfigError(f"CA bundle {ca_file or '(inline data)'} is unusable: {_one_line(exc)}") from None
    if insecure:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    if cert_file or cert_data:
        try:
            _load_cert_chain(context, cert_file, cert_data, key_file, key_data)
        except (ssl.SSLError, OSError) as exc:
            raise ClientConfigError(f"client certificate {cert_file or '(inline data)'} is unusable: "
                                    f"{_one_line(exc)}") from None
    return context


def _load_cert_chain(context: ssl.SSLContext, cert_file: str, cert_data: bytes, key_file: str,
                     key_data: bytes) -> None:
    """ssl loads a certificate and key from files only: inline data passes through a private temporary file
    that is gone again once loaded."""
    with tempfile.TemporaryDirectory(prefix="gpu-health-tls-") as folder:
        if cert_data:
            cert_file = os.path.join(folder, "client.crt")
            Path(cert_file).write_bytes(cert_data)
        if key_data:
            key_file = os.path.join(folder, "client.key")
            Path(key_file).write_bytes(key_data)
        context.load_cert_chain(cert_file, key_file or None)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__
