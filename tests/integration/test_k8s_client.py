"""The Kubernetes client layer: every call bounded in time, every failure one of the agent's own errors."""

from __future__ import annotations

import threading

import pytest
import yaml

from agent.k8s import retry
from agent.k8s.client import Timeouts, client_for, load_api_client
from agent.k8s.errors import ApiTimeout, ClientConfigError, K8sError, Unavailable
from agent.k8s.raw import RawApi
from tests.conftest import FIXTURES
from tests.net_helpers import refused_url, silent_server


def call_in_thread(func) -> tuple[threading.Thread, list[BaseException]]:
    raised: list[BaseException] = []

    def run() -> None:
        try:
            func()
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, raised


def test_a_server_that_never_answers_fails_the_call_at_the_read_timeout():
    """A hung API server turns into ApiTimeout once the read timeout passes, not a call blocked for ever."""
    with silent_server() as url:
        core = RawApi(client_for(url, timeouts=Timeouts(connect=0.5, read=0.5)))
        thread, raised = call_in_thread(lambda: core.get("/api/v1/nodes/n1"))
        thread.join(timeout=60)
        assert not thread.is_alive(), "the call was still blocked a minute later"
    assert len(raised) == 1 and isinstance(raised[0], ApiTimeout)


def test_the_timeout_of_a_kubeconfig_client_is_the_one_asked_for(tmp_path):
    """load_api_client's timeouts reach every call of the client it returns."""
    with silent_server() as url:
        kubeconfig = tmp_path / "config"
        kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "c",
            "clusters": [{"name": "c", "cluster": {"server": url}}],
            "users": [{"name": "u", "user": {"token": "t"}}],
            "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}]}))
        api_client, _ = load_api_client(kubeconfig=str(kubeconfig), timeouts=Timeouts(connect=0.5, read=0.7))
        core = RawApi(api_client)
        thread, raised = call_in_thread(lambda: core.get("/api/v1/nodes"))
        thread.join(timeout=60)
        assert not thread.is_alive(), "the call was still blocked a minute later"
    assert len(raised) == 1 and isinstance(raised[0], ApiTimeout)
    assert "within 0.7s" in str(raised[0])


def test_a_timeout_is_one_line_naming_the_request_and_the_bound():
    """The operator reads what timed out and after how long, not urllib3's retry wrapper."""
    with silent_server() as url:
        core = RawApi(client_for(url, timeouts=Timeouts(connect=0.5, read=0.5)))
        thread, raised = call_in_thread(lambda: core.get("/api/v1/nodes/n1"))
        thread.join(timeout=60)
        assert not thread.is_alive(), "the call was still blocked a minute later"
    assert len(raised) == 1 and isinstance(raised[0], ApiTimeout) and raised[0].transient
    message = str(raised[0])
    assert "\n" not in message
    assert "GET /api/v1/nodes/n1" in message and "within 0.5s" in message
    assert "Max retries" not in message


def test_retries_of_a_hung_server_stop_at_the_deadline():
    """Timeouts are retried as transient, and the deadline cuts the last attempt short."""
    with silent_server() as url:
        core = RawApi(client_for(url, timeouts=Timeouts(connect=0.2, read=30.0)))
        calls = []

        def read() -> object:
            calls.append(1)
            return core.get("/api/v1/nodes/n1")

        thread, raised = call_in_thread(lambda: retry.with_retries(read, deadline_seconds=1.0))
        thread.join(timeout=20)
        assert not thread.is_alive(), "the retries outlived their deadline by far"
    assert len(raised) == 1 and isinstance(raised[0], ApiTimeout)


def test_an_unreachable_server_is_unavailable_in_one_line():
    """Connection refused becomes Unavailable with the server's address, without urllib3's wrapper text."""
    url = refused_url()
    core = RawApi(client_for(url))
    with pytest.raises(Unavailable) as caught:
        core.get("/api/v1/nodes/n1")
    message = str(caught.value)
    assert "\n" not in message and url.removeprefix("http://") in message
    assert "Max retries" not in message and "HTTPConnection" not in message


def test_in_cluster_environment_without_its_token_is_a_config_error(tmp_path, monkeypatch):
    """The service-account mount missing its token fails the load with one line, never local mode."""
    (tmp_path / "ca.crt").write_text("not read before the token")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    with pytest.raises(ClientConfigError) as caught:
        load_api_client(service_account_dir=tmp_path)
    assert "\n" not in str(caught.value) and "token" in str(caught.value)


def test_in_cluster_environment_with_a_broken_ca_is_a_config_error(tmp_path, monkeypatch):
    """A CA bundle that is not a certificate fails at start, not at the first API call."""
    (tmp_path / "token").write_text("t")
    (tmp_path / "ca.crt").write_text("not a certificate")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    with pytest.raises(ClientConfigError) as caught:
        load_api_client(service_account_dir=tmp_path)
    assert "\n" not in str(caught.value) and "ca.crt" in str(caught.value)


def test_in_cluster_environment_without_a_port_is_a_config_error(tmp_path, monkeypatch):
    """KUBERNETES_SERVICE_HOST without its port is a broken pod, reported as such."""
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    monkeypatch.delenv("KUBERNETES_SERVICE_PORT", raising=False)
    with pytest.raises(ClientConfigError):
        load_api_client(service_account_dir=tmp_path)


def in_cluster_client(folder, monkeypatch, token: str = "sa-token"):
    """A client loaded as in a pod: service-account token and CA in `folder`, the service address set."""
    (folder / "token").write_text(token)
    (folder / "ca.crt").write_text((FIXTURES / "k8s" / "ca.crt").read_text())
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    return load_api_client(service_account_dir=folder)


def test_a_complete_in_cluster_environment_gives_a_client_for_the_service_address(tmp_path, monkeypatch):
    """Token, CA and service address present: the client talks to https://HOST:PORT with the bearer token."""
    api_client, how = in_cluster_client(tmp_path, monkeypatch)
    assert how == "in-cluster service account"
    assert api_client.host == "https://10.96.0.1:443"
    assert api_client._authorization() == "Bearer sa-token"


def test_a_token_that_cannot_be_refreshed_is_unavailable_in_one_line(tmp_path, monkeypatch):
    """The rotated service-account token unreadable at call time is a transient API error, not a crash."""
    api_client, _ = in_cluster_client(tmp_path, monkeypatch)
    (tmp_path / "token").unlink()
    with pytest.raises(Unavailable) as caught:
        RawApi(api_client).get("/api/v1/nodes/n1")
    assert "\n" not in str(caught.value) and "token" in str(caught.value)


def test_a_rotated_service_account_token_is_sent_from_the_next_request_on(tmp_path, monkeypatch):
    """The kubelet rewrites the token file; the client sends the new token without being rebuilt."""
    api_client, _ = in_cluster_client(tmp_path, monkeypatch, token="first-token")
    assert api_client._authorization() == "Bearer first-token"
    (tmp_path / "token").write_text("second-token-after-rotation")
    assert api_client._authorization() == "Bearer second-token-after-rotation"


def test_an_answer_that_is_not_json_is_one_error_line():
    """A proxy's HTML page where the API's JSON was expected is a K8sError naming the request."""
    import http.server

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", "15")
            self.end_headers()
            self.wfile.write(b"<html>hi</html>")

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with client_for(f"http://127.0.0.1:{server.server_address[1]}") as api, pytest.raises(K8sError) as caught:
            RawApi(api).get("/api/v1/nodes/n1")
    finally:
        server.shutdown()
        server.server_close()
    assert str(caught.value) == "GET /api/v1/nodes/n1: the API server's answer is not JSON"


def kubeconfig_with_user(folder, user: dict, cluster: dict) -> str:
    path = folder / "config"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": cluster}], "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}]}))
    return str(path)


def exec_plugin_user(folder, *, token: str = "exec-token", expires: str = "", exit_code: int = 0) -> dict:
    """A kubeconfig user whose exec plugin is a small script: it counts its runs in `runs` and prints an
    ExecCredential (or fails), as aws / gke-gcloud-auth-plugin / kubelogin do."""
    import json
    import sys

    status = {"token": token, **({"expirationTimestamp": expires} if expires else {})}
    script = folder / "plugin.py"
    script.write_text(
        "import json, os, pathlib, sys\n"
        f"runs = pathlib.Path({str(folder / 'runs')!r})\n"
        "runs.write_text(str(int(runs.read_text() or 0) + 1) if runs.exists() else '1')\n"
        "info = json.loads(os.environ['KUBERNETES_EXEC_INFO'])\n"
        "assert info['spec']['interactive'] is False and os.environ['PLUGIN_REGION'] == 'eu'\n"
        f"sys.stderr.write('token expired, run login\\n') if {exit_code} else None\n"
        f"print(json.dumps({{'apiVersion': info['apiVersion'], 'kind': 'ExecCredential', "
        f"'status': {json.dumps(status)}}}))\n"
        f"sys.exit({exit_code})\n")
    return {"exec": {"apiVersion": "client.authentication.k8s.io/v1", "command": sys.executable,
                     "args": [str(script)], "env": [{"name": "PLUGIN_REGION", "value": "eu"}],
                     "interactiveMode": "Never"}}


def test_an_exec_credential_plugin_token_is_sent_and_kept_until_it_expires(tmp_path):
    """A managed cluster's kubeconfig (exec plugin) works: its token is sent, the plugin runs once."""
    path = kubeconfig_with_user(tmp_path, exec_plugin_user(tmp_path), {"server": "https://10.0.0.1:6443"})
    api_client, _ = load_api_client(kubeconfig=path)
    assert [api_client._authorization() for _ in range(3)] == ["Bearer exec-token"] * 3
    assert (tmp_path / "runs").read_text() == "1"


def test_an_exec_token_about_to_expire_runs_the_plugin_again(tmp_path):
    """A token past (or near) its expirationTimestamp is not sent: the plugin is asked for a new one."""
    user = exec_plugin_user(tmp_path, expires="2020-01-01T00:00:00Z")
    api_client, _ = load_api_client(kubeconfig=kubeconfig_with_user(tmp_path, user, {"server": "https://h:6443"}))
    api_client._authorization()
    api_client._authorization()
    assert (tmp_path / "runs").read_text() == "2"


def test_a_failing_exec_plugin_is_unavailable_in_one_line(tmp_path):
    """A plugin that exits non-zero (expired SSO login) is one line naming the plugin and its last words."""
    user = exec_plugin_user(tmp_path, exit_code=3)
    api_client, _ = load_api_client(kubeconfig=kubeconfig_with_user(tmp_path, user, {"server": "https://h:6443"}))
    with pytest.raises(Unavailable) as caught:
        RawApi(api_client).get("/api/v1/nodes/n1")
    assert "\n" not in str(caught.value) and "exited 3: token expired, run login" in str(caught.value)


def test_an_auth_provider_user_is_refused_in_one_line(tmp_path):
    """auth-provider users (gone from kubectl since 1.26) make the kubeconfig unusable, said in one line."""
    path = kubeconfig_with_user(tmp_path, {"auth-provider": {"name": "gcp"}}, {"server": "https://10.0.0.1:6443"})
    with pytest.raises(ClientConfigError) as caught:
        load_api_client(kubeconfig=path)
    assert "\n" not in str(caught.value) and "auth-provider" in str(caught.value)


def test_an_inline_ca_and_a_token_file_make_a_working_kubeconfig(tmp_path):
    """certificate-authority-data is decoded, and tokenFile is read relative to the kubeconfig."""
    import base64

    (tmp_path / "token").write_text("file-token\n")
    ca = base64.b64encode((FIXTURES / "k8s" / "ca.crt").read_bytes()).decode()
    path = kubeconfig_with_user(tmp_path, {"tokenFile": "token"},
                                {"server": "https://10.0.0.1:6443", "certificate-authority-data": ca})
    api_client, how = load_api_client(kubeconfig=path)
    assert how == f"kubeconfig {path}" and api_client.host == "https://10.0.0.1:6443"
    assert api_client._authorization() == "Bearer file-token"


def test_a_refused_exec_token_is_fetched_again_and_the_request_sent_once_more(tmp_path):
    """A 401 (token revoked or expired without an expirationTimestamp): the plugin runs again, the request is
    retried once with the new token, as kubectl does."""
    import http.server
    import json
    import sys

    seen: list[str] = []

    class Api(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(self.headers.get("Authorization", ""))
            ok = self.headers.get("Authorization") == "Bearer tok-2"
            body = json.dumps({"kind": "Node"} if ok else {"kind": "Status", "code": 401}).encode()
            self.send_response(200 if ok else 401)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    script = tmp_path / "plugin.py"
    script.write_text(
        "import json, pathlib\n"
        f"runs = pathlib.Path({str(tmp_path / 'runs')!r})\n"
        "n = int(runs.read_text()) + 1 if runs.exists() else 1\n"
        "runs.write_text(str(n))\n"
        "print(json.dumps({'apiVersion': 'client.authentication.k8s.io/v1', 'kind': 'ExecCredential',"
        " 'status': {'token': f'tok-{n}'}}))\n")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Api)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        user = {"exec": {"apiVersion": "client.authentication.k8s.io/v1", "command": sys.executable,
                         "args": [str(script)]}}
        path = kubeconfig_with_user(tmp_path, user, {"server": f"http://127.0.0.1:{server.server_address[1]}"})
        api_client, _ = load_api_client(kubeconfig=path)
        with api_client:
            assert RawApi(api_client).get("/api/v1/nodes/n1") == {"kind": "Node"}
    finally:
        server.shutdown()
        server.server_close()
    assert seen == ["Bearer tok-1", "Bearer tok-2"]
