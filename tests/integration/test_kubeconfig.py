"""The kubeconfig as kubectl reads it: $KUBECONFIG's files merged, and the cluster's or the environment's proxy."""

from __future__ import annotations

import http.client
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from agent.k8s.client import load_api_client
from agent.k8s.detect import cluster_configured
from agent.k8s.kubeconfig import load, proxy_for
from agent.k8s.raw import RawApi
from tests.k8s_helpers import start_cluster


def _write(path: Path, **document: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "Config", **document}))
    return path


def _cluster(name: str, **fields: Any) -> dict[str, Any]:
    return {"name": name, "cluster": fields}


def _context(name: str, cluster: str, user: str = "") -> dict[str, Any]:
    return {"name": name, "context": {"cluster": cluster, **({"user": user} if user else {})}}


def _env(*paths: Path) -> dict[str, str]:
    return {"KUBECONFIG": os.pathsep.join(str(p) for p in paths)}


def test_every_kubeconfig_entry_is_merged_as_kubectl_merges_them(tmp_path: Path):
    """The current context in one file, its cluster and user in another: one configuration."""
    first = _write(tmp_path / "a" / "config", **{"current-context": "work"},
                   users=[{"name": "me", "user": {"token": "t"}}])
    second = _write(tmp_path / "b" / "config", contexts=[_context("work", "prod", "me")],
                    clusters=[_cluster("prod", server="https://prod.example:6443")])
    selected = load(env=_env(first, second))
    assert selected.cluster.fields["server"] == "https://prod.example:6443"
    assert selected.user is not None and selected.user.fields == {"token": "t"}


def test_the_first_file_to_name_an_entry_or_set_the_context_wins(tmp_path: Path):
    """A cluster named in two files is the first file's, and so is current-context."""
    first = _write(tmp_path / "a", **{"current-context": "one"}, clusters=[_cluster("c", server="https://first:1")],
                   contexts=[_context("one", "c")])
    second = _write(tmp_path / "b", **{"current-context": "two"}, clusters=[_cluster("c", server="https://second:2")],
                    contexts=[_context("two", "c")])
    selected = load(env=_env(first, second))
    assert (selected.context, selected.cluster.fields["server"]) == ("one", "https://first:1")


def test_a_relative_path_is_relative_to_the_file_that_named_it(tmp_path: Path):
    """The cluster's certificate-authority is found beside the file that defined the cluster."""
    first = _write(tmp_path / "a" / "config", **{"current-context": "w"}, contexts=[_context("w", "c")])
    second = _write(tmp_path / "b" / "config", clusters=[_cluster("c", server="https://h:1",
                                                                  **{"certificate-authority": "ca.crt"})])
    assert load(env=_env(first, second)).cluster.folder == tmp_path / "b"


def test_a_missing_kubeconfig_entry_is_skipped_and_none_at_all_is_one_line(tmp_path: Path):
    """$KUBECONFIG naming a file that is not there skips it, as kubectl does; no file at all is a ValueError."""
    real = _write(tmp_path / "config", **{"current-context": "w"}, contexts=[_context("w", "c")],
                  clusters=[_cluster("c", server="https://h:1")])
    assert load(env=_env(tmp_path / "gone", real)).cluster.fields["server"] == "https://h:1"
    with pytest.raises(ValueError, match="no kubeconfig file found"):
        load(env=_env(tmp_path / "gone"))


def test_a_cluster_is_configured_when_any_kubeconfig_entry_is_a_file(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch):
    """Not only the first entry of $KUBECONFIG decides between a cluster and local mode."""
    real = _write(tmp_path / "config", clusters=[])
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", os.pathsep.join([str(tmp_path / "gone"), str(real)]))
    assert cluster_configured()


def test_load_api_client_reaches_the_server_of_a_merged_kubeconfig(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch):
    """The operator's laptop case: $KUBECONFIG=contexts:clusters, and `release` reaches the cluster."""
    _, server = start_cluster()
    try:
        first = _write(tmp_path / "a", **{"current-context": "w"}, contexts=[_context("w", "fake")])
        second = _write(tmp_path / "b", clusters=[_cluster("fake", server=server.url)])
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        monkeypatch.setenv("KUBECONFIG", os.pathsep.join([str(first), str(second)]))
        api_client, how = load_api_client()
        assert RawApi(api_client).get("/api/v1/nodes")["items"] == []
        assert str(first) in how and str(second) in how
    finally:
        server.stop()


class _Proxy(BaseHTTPRequestHandler):
    """A forwarding HTTP proxy: takes absolute-form requests, records their target, passes them on."""

    seen: list[str] = []

    def do_GET(self) -> None:
        self.seen.append(self.path)
        target = urlsplit(self.path)
        upstream = http.client.HTTPConnection(target.netloc, timeout=10)
        upstream.request("GET", target.path + (f"?{target.query}" if target.query else ""),
                         headers={"Accept": "application/json"})
        answer = upstream.getresponse()
        body = answer.read()
        self.send_response(answer.status)
        self.send_header("Content-Type", answer.getheader("Content-Type") or "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        upstream.close()

    def log_message(self, format: str, *args: object) -> None:
        pass


@contextmanager
def _forwarding_proxy() -> Iterator[tuple[str, list[str]]]:
    seen: list[str] = []
    handler = type("Proxy", (_Proxy,), {"seen": seen})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", seen
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_the_clusters_proxy_url_carries_every_request(tmp_path: Path):
    """`proxy-url` in the cluster entry: the agent's requests reach the server through that proxy."""
    _, server = start_cluster()
    try:
        with _forwarding_proxy() as (proxy, seen):
            path = _write(tmp_path / "config", **{"current-context": "w"}, contexts=[_context("w", "fake")],
                          clusters=[_cluster("fake", server=server.url, **{"proxy-url": proxy})])
            api_client, _ = load_api_client(kubeconfig=str(path))
            assert RawApi(api_client).get("/api/v1/nodes")["items"] == []
            assert seen == [f"{server.url}/api/v1/nodes"]
    finally:
        server.stop()


def test_https_proxy_from_the_environment_is_used_for_an_https_server(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch):
    """HTTPS_PROXY with no proxy-url: the client's connections go to the proxy (a CONNECT tunnel)."""
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.corp:3128")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    path = _write(tmp_path / "config", **{"current-context": "w"}, contexts=[_context("w", "c")],
                  clusters=[_cluster("c", server="https://api.example.com:6443",
                                     **{"insecure-skip-tls-verify": True})])
    api_client, _ = load_api_client(kubeconfig=str(path))
    assert (api_client.pool.proxy.host, api_client.pool.proxy.port) == ("proxy.corp", 3128)
    monkeypatch.setenv("NO_PROXY", ".example.com")
    assert load_api_client(kubeconfig=str(path))[0].pool.proxy is None


@pytest.mark.parametrize(("server", "env", "expected"), [
    ("https://api.example.com", {"HTTPS_PROXY": "http://p:1"}, "http://p:1"),
    ("https://api.example.com", {"https_proxy": "p:1"}, "http://p:1"),
    ("http://api.example.com", {"HTTPS_PROXY": "http://p:1"}, ""),
    ("http://api.example.com", {"HTTP_PROXY": "http://p:2"}, "http://p:2"),
    ("https://api.example.com", {"HTTPS_PROXY": "http://p:1", "NO_PROXY": "example.com"}, ""),
    ("https://example.com", {"HTTPS_PROXY": "http://p:1", "NO_PROXY": ".example.com"}, "http://p:1"),
    ("https://10.1.2.3:6443", {"HTTPS_PROXY": "http://p:1", "NO_PROXY": "10.0.0.0/8"}, ""),
    ("https://10.1.2.3:6443", {"HTTPS_PROXY": "http://p:1", "NO_PROXY": "10.1.2.3:443"}, "http://p:1"),
    ("https://10.1.2.3:6443", {"HTTPS_PROXY": "http://p:1", "no_proxy": "10.1.2.3:6443"}, ""),
    ("https://api.example.com", {"HTTPS_PROXY": "http://p:1", "NO_PROXY": "*"}, ""),
    ("https://localhost:6443", {"HTTPS_PROXY": "http://p:1"}, ""),
    ("https://127.0.0.1:6443", {"HTTPS_PROXY": "http://p:1"}, ""),
    ("https://[::1]:6443", {"HTTPS_PROXY": "http://p:1"}, ""),
])
def test_the_environment_proxy_is_chosen_as_kubectl_chooses_it(server: str, env: dict[str, str], expected: str):
    """HTTPS_PROXY/HTTP_PROXY by the server's scheme, NO_PROXY's domains, CIDRs and ports; never loopback."""
    assert proxy_for(server, env=env) == expected


def test_the_clusters_proxy_url_wins_over_the_environment():
    """proxy-url is used as it is, NO_PROXY and loopback notwithstanding (kubectl's http.ProxyURL)."""
    assert proxy_for("https://127.0.0.1:6443", proxy_url="http://p:9", env={"NO_PROXY": "*"}) == "http://p:9"


def test_a_socks_proxy_is_refused_with_one_line(tmp_path: Path):
    """A proxy scheme the client cannot speak is a ClientConfigError naming it, not a traceback."""
    from agent.k8s.errors import ClientConfigError
    path = _write(tmp_path / "config", **{"current-context": "w"}, contexts=[_context("w", "c")],
                  clusters=[_cluster("c", server="https://h:6443", **{"proxy-url": "socks5://p:1080"})])
    with pytest.raises(ClientConfigError, match="only http and https proxies"):
        load_api_client(kubeconfig=str(path))
