"""`gpu-health-agent probe` (the chart's `helm test`): every node the DaemonSet should run on has an agent pod
that is Ready and answers /healthz and /readyz on its metrics port; read from the API, asked over HTTP, judged
by `judge` (pure)."""

from __future__ import annotations

import dataclasses
import json
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from agent.k8s.client import ApiClient
from agent.k8s.raw import RawApi, api_path
from agent.k8s.retry import with_retries

#: Each endpoint the probe asks, each answer bounded by the command's timeout.
ENDPOINTS = ("/healthz", "/readyz")
#: Pod IPs are asked directly, never through an HTTP_PROXY the pod's environment may name.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@dataclass(frozen=True, slots=True)
class Answer:
    """One endpoint's answer: its HTTP status (0: none came), the JSON it sent, or why nothing came."""

    status: int
    body: dict[str, Any] = field(default_factory=dict)
    error: str = ""


@dataclass(frozen=True, slots=True)
class AgentPod:
    """One agent pod as the API lists it, with what its endpoints answered."""

    name: str
    node: str
    ip: str
    ready: bool
    phase: str
    answers: dict[str, Answer] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ProbeVerdict:
    ok: bool
    lines: list[str]


def judge(desired: int, pods: Sequence[AgentPod]) -> ProbeVerdict:
    """One line per agent pod, then the summary: ok when the DaemonSet schedules at least one pod, as many run
    as it should (one a node), and every one is Ready and answers 200 on each endpoint."""
    lines, good = [], 0
    for pod in sorted(pods, key=lambda p: (p.node, p.name)):
        problems = _problems(pod)
        good += not problems
        lines.append(f"node {pod.node or '(unscheduled)'}: pod {pod.name} "
                     + ("answers: " + _described(pod) if not problems else "; ".join(problems)))
    if desired == 0:
        lines.append("the DaemonSet is to run on no node: no node matches its nodeSelector and tolerations "
                     "(GPU nodes are labelled nvidia.com/gpu.present=true by GPU feature discovery)")
        return ProbeVerdict(False, lines)
    ok = good == desired == len(pods)
    missing = f", {desired - len(pods)} missing" if len(pods) < desired else ""
    lines.append(f"{good} of {desired} agent(s) answer{missing}" + ("" if ok else ": not every node is covered"))
    return ProbeVerdict(ok, lines)


def _problems(pod: AgentPod) -> list[str]:
    problems = [] if pod.ready else [f"not Ready (phase {pod.phase or 'unknown'})"]
    if not pod.ip:
        return [*problems, "no pod IP yet"]
    for path in ENDPOINTS:
        answer = pod.answers.get(path, Answer(0, error="not asked"))
        if answer.status != 200:
            said = answer.error or _summary(answer.body) or "no body"
            problems.append(f"{path} answered {answer.status}: {said}" if answer.status
                            else f"{path} unreachable: {said}")
    return problems


def _described(pod: AgentPod) -> str:
    body = pod.answers[ENDPOINTS[0]].body
    return _summary(body) or "ok"


def _summary(body: dict[str, Any]) -> str:
    """What an agent's health answer says about itself, in one line."""
    parts = []
    if body.get("mode"):
        parts.append(f"mode {body['mode']}" + (" (dry run)" if body.get("dry_run") else ""))
    if isinstance(body.get("sources"), list):
        parts.append("sources " + (",".join(str(s) for s in body["sources"]) or "none"))
    if body.get("failing_sources"):
        parts.append("failing " + ",".join(str(s) for s in body["failing_sources"]))
    if body.get("journal_failing"):
        parts.append(f"journal failing: {body['journal_failing']}")
    if "loop_age_seconds" in body:
        parts.append(f"loop {body['loop_age_seconds']}s ago")
    return ", ".join(parts)


def read_agent_pods(api: ApiClient, namespace: str, daemonset: str) -> tuple[int, list[AgentPod]]:
    """(desiredNumberScheduled, the pods the DaemonSet's selector lists); a transient error asked again, any other
    K8sError as it comes."""
    raw = RawApi(api)
    ds = with_retries(lambda: raw.get(api_path("apps", "v1", "daemonsets", namespace=namespace, name=daemonset)))
    desired = int((ds.get("status") or {}).get("desiredNumberScheduled") or 0)
    labels = ((ds.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
    selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
    listed = with_retries(lambda: raw.get(api_path("", "v1", "pods", namespace=namespace),
                                          query={"labelSelector": selector}))
    pods = []
    for item in listed.get("items") or []:
        meta, spec, status = item.get("metadata") or {}, item.get("spec") or {}, item.get("status") or {}
        if meta.get("deletionTimestamp"):
            continue  # on its way out (a rollout): its successor is the one that counts
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
        pods.append(AgentPod(name=str(meta.get("name", "")), node=str(spec.get("nodeName", "")),
                             ip=str(status.get("podIP", "")), ready=ready, phase=str(status.get("phase", ""))))
    return desired, pods


def ask(ip: str, port: int, path: str, timeout_seconds: float) -> Answer:
    """GET http://IP:PORT/PATH within the timeout: its status and JSON body, or why none came."""
    host = f"[{ip}]" if ":" in ip else ip
    try:
        with _DIRECT.open(f"http://{host}:{port}{path}", timeout=timeout_seconds) as response:
            return Answer(response.status, _json(response.read()))
    except urllib.error.HTTPError as exc:
        return Answer(exc.code, _json(exc.read()))
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        return Answer(0, error=str(reason) or type(reason).__name__)


def asked(pods: Sequence[AgentPod], port: int, timeout_seconds: float,
          get: Callable[[str, int, str, float], Answer] = ask) -> list[AgentPod]:
    """Each pod with its endpoints' answers (a pod with no IP yet is not asked)."""
    return [dataclasses.replace(p, answers={path: get(p.ip, port, path, timeout_seconds) for path in ENDPOINTS})
            if p.ip else p for p in pods]


def _json(data: bytes) -> dict[str, Any]:
    try:
        value = json.loads(data)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
