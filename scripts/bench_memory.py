#!/usr/bin/env python3
"""Prints the agent's resident memory with 8 fake GPUs and every source on (kernel log, NVML, DCGM), once in
local mode and once in cluster mode against the real control plane of tests/realcluster, then the
packages that cost the most memory to import.

Cluster mode: kube-apiserver 1.37.2 + etcd + kwok (tests/controlplane/bin, scripts/build-controlplane),
started by the same code as the tests' `control_plane` fixture; the agent runs as `gpu-health-agent run`
in its own process with its own ServiceAccount token (bound to its pod on the node) under the shipped RBAC
and admission policy. RSS is read from /proc once it has settled (three samples 1 s apart within 0.1 MiB,
after at least `SETTLE` seconds). Targets (issue 14): cluster mode <= 64 MiB, local mode <= 48 MiB.
Usage: scripts/bench_memory.py [SETTLE_SECONDS]
"""

from __future__ import annotations

import http.server
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FAKE_DIR = REPO / "tests" / "fakenvml" / "build"
# The tree this interpreter's `agent` comes from: the checkout (.venv), or the copy whose storm path
# scripts/bench-all compiled (.bench-venv). The agent measured runs from it.
_AGENT = importlib.util.find_spec("agent")
TREE = Path(_AGENT.origin).parent.parent if _AGENT is not None and _AGENT.origin else REPO
sys.path.insert(0, str(TREE))

from tests.conftest import FIXTURES, eight_gpus  # noqa: E402

NODE = "bench-node"
#: What the agent imports in each mode (the daemon, the CLI, and in cluster mode its Kubernetes side).
AGENT_MODULES = ("agent.cli", "agent.daemon", "agent.cluster_side", "agent.k8s.client", "agent.k8s.dra")


def _status(pid: int, field: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _exporter() -> tuple[http.server.ThreadingHTTPServer, str]:
    """A dcgm-exporter stand-in on loopback serving a healthy 8-GPU page."""
    page = (FIXTURES / "dcgm" / "default-8gpu.prom").read_bytes()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            self.wfile.write(page)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/metrics"


def settled_rss(folder: Path, exporter_url: str, settle: float, kubeconfig: Path | None) -> tuple[float, float, str]:
    """(RSS, peak RSS, the agent's mode line) of `gpu-health-agent run` once its memory stopped moving."""
    state = folder / "nvml.json"
    state.write_text(json.dumps(eight_gpus()))
    kmsg = folder / f"kmsg-{os.getpid()}-{time.monotonic_ns()}"
    os.mkfifo(kmsg)
    keep_open = os.open(kmsg, os.O_RDWR | os.O_NONBLOCK)
    env = dict(os.environ, LD_LIBRARY_PATH=str(FAKE_DIR), FAKE_NVML_STATE=str(state), NODE_NAME=NODE,
               GPU_HEALTH_SOURCES__KMSG__ENABLED="on", GPU_HEALTH_SOURCES__KMSG__PATH=str(kmsg),
               GPU_HEALTH_SOURCES__NVML__ENABLED="on", GPU_HEALTH_SOURCES__DCGM__ENABLED="on",
               GPU_HEALTH_SOURCES__DCGM__EXPORTER_URL=exporter_url, GPU_HEALTH_SOURCES__DCGM__POLL_SECONDS="2",
               GPU_HEALTH_JOURNAL_PATH=str(folder / f"journal-{time.monotonic_ns()}.db"),
               GPU_HEALTH_HTTP__HOST="127.0.0.1", GPU_HEALTH_LOG__LEVEL="info", GPU_HEALTH_LOG__FORMAT="json",
               GPU_HEALTH_MODE="quarantine", KUBECONFIG=str(kubeconfig or folder / "no-kubeconfig"))
    env.pop("KUBERNETES_SERVICE_HOST", None)
    log = folder / f"agent-{time.monotonic_ns()}.log"
    with log.open("wb") as stderr:
        agent = subprocess.Popen([sys.executable, "-m", "agent", "run", "--port", "0"], env=env,
                                 stdout=subprocess.DEVNULL, stderr=stderr, cwd=TREE)
    try:
        started = time.monotonic()
        samples: list[float] = []
        while True:
            time.sleep(1.0)
            if agent.poll() is not None:
                raise SystemExit(f"the agent exited ({agent.returncode}): {log.read_text()[-2000:]}")
            samples.append(_status(agent.pid, "VmRSS"))
            recent = samples[-3:]
            if time.monotonic() - started >= settle and len(recent) == 3 and max(recent) - min(recent) < 0.1:
                break
            if time.monotonic() - started > settle + 60:
                break
        rss, peak = samples[-1], _status(agent.pid, "VmHWM")
    finally:
        agent.terminate()
        agent.wait(15)
        os.close(keep_open)
    start = next((line for line in log.read_text().splitlines() if line.startswith("gpu-health-agent: node")), "")
    return rss, peak, start


RSS_OF_SELF = ("def rss():\n    for line in open('/proc/self/status'):\n        if line.startswith('VmRSS:'):\n"
               "            return int(line.split()[1]) / 1024\n")


def import_costs(top: int = 12) -> list[tuple[str, float, float]]:
    """The top-level packages the agent's cluster mode loads: (name, RSS its import adds in the agent's own
    load order, RSS it adds alone to a bare interpreter with its dependencies), largest first by the former."""
    listing = (f"import importlib, sys\nbefore = set(sys.modules)\nfor name in {AGENT_MODULES!r}:\n"
               "    importlib.import_module(name)\norder = []\n"
               "for n in sys.modules:\n    top = n.split('.')[0]\n"
               "    if n not in before and sys.modules[n] is not None and not top.startswith('_') and top not in order:\n"
               "        order.append(top)\nprint(' '.join(order))")
    names = subprocess.run([sys.executable, "-c", listing], capture_output=True, text=True, cwd=TREE,
                           check=True).stdout.split()
    in_order = (f"{RSS_OF_SELF}import importlib, json\nlast = rss()\ncosts = {{}}\n"
                f"for name in {names!r}:\n    importlib.import_module(name)\n    now = rss()\n"
                "    costs[name] = now - last\n    last = now\n"
                f"for name in {AGENT_MODULES!r}:\n    importlib.import_module(name)\n"
                "costs['agent'] = costs.get('agent', 0) + rss() - last\nprint(json.dumps(costs))")
    added = json.loads(subprocess.run([sys.executable, "-c", in_order], capture_output=True, text=True, cwd=TREE,
                                      check=True).stdout)

    def rss_after(statement: str) -> float:
        code = f"{RSS_OF_SELF}{statement}\nprint(rss())"
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=TREE, check=False)
        return float(done.stdout.strip() or "nan")

    bare = rss_after("")
    ranked = sorted(names, key=lambda n: -float(added.get(n, 0.0)))[:top]
    return [(name, float(added.get(name, 0.0)), rss_after(f"import {name}") - bare) for name in ranked]


def main() -> None:
    settle = float(sys.argv[1]) if len(sys.argv) > 1 else 15.0
    from agent.hot_path import describe  # noqa: PLC0415 - after the path is set
    from tests.realcluster.controlplane import ControlPlane  # noqa: PLC0415 - after the path is set

    print(f"the agent from {TREE}, python {sys.version.split()[0]}, {describe()}")
    exporter, url = _exporter()
    with tempfile.TemporaryDirectory() as name:
        folder = Path(name)
        rss, peak, start = settled_rss(folder, url, settle, None)
        print(f"  {start}")
        print(f"local mode, 8 GPUs, kmsg+NVML+DCGM: RSS {rss:.1f} MiB (peak {peak:.1f}) - target <= 48 MiB")
        plane = ControlPlane(folder / "controlplane").start()
        try:
            plane.apply_shipped_manifests()
            plane.add_gpu_node(NODE, 8)
            plane.agent_pod(NODE)
            kubeconfig = plane.agent_kubeconfig(NODE)
            rss, peak, start = settled_rss(folder, url, settle, kubeconfig)
            print(f"  {start}")
            print(f"cluster mode (real kube-apiserver 1.37.2, the agent's ServiceAccount token), 8 GPUs, "
                  f"kmsg+NVML+DCGM: RSS {rss:.1f} MiB (peak {peak:.1f}) - target <= 64 MiB")
        finally:
            plane.stop()
    exporter.shutdown()
    print("import cost by package, MiB: added in the agent's load order / alone in a bare interpreter "
          "(alone includes its dependencies, so those figures overlap)")
    for package, added, alone in import_costs():
        print(f"  {added:6.1f} / {alone:6.1f}  {package}")
    loaded = subprocess.run([sys.executable, "-c", "import sys; " + "; ".join(f"import {m}" for m in AGENT_MODULES)
                             + "; print(' '.join(sorted(n for n in ('kubernetes', 'rich', 'pygments', "
                             "'import_linter', 'pytest') if sys.modules.get(n) is not None)))"],
                            capture_output=True, text=True, cwd=TREE, check=True).stdout.strip()
    print(f"kubernetes package / dev tools loaded: {loaded or 'none'}")


if __name__ == "__main__":
    main()
