#!/usr/bin/env python3
"""Prints how long `gpu-health-agent run --duration D` takes to exit while the API server is hung or down.

The agent replays the xid79 scenario (no GPU needed) with a kubeconfig pointing at
- "hung": a server that accepts every connection and never answers a byte;
- "refused": a port nobody listens on.
A bounded agent exits soon after D seconds; an unbounded one sits in an API call. Each run is killed
after D + 120 s. `--source DIR` runs another checkout of the agent (e.g. an older commit) for comparison.
Usage: scripts/bench_api_outage.py [--duration D] [--source DIR]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.net_helpers import refused_url, silent_server  # noqa: E402


def kubeconfig(directory: Path, url: str) -> Path:
    path = directory / "kubeconfig"
    path.write_text(f"""apiVersion: v1
kind: Config
current-context: c
clusters: [{{name: c, cluster: {{server: "{url}"}}}}]
users: [{{name: u, user: {{token: t}}}}]
contexts: [{{name: c, context: {{cluster: c, user: u}}}}]
""")
    return path


def run_agent(config: Path, journal: Path, duration: float, source: Path) -> tuple[float, int | None]:
    env = dict(os.environ, KUBECONFIG=str(config), GPU_HEALTH_JOURNAL_PATH=str(journal),
               GPU_HEALTH_HTTP__HOST="127.0.0.1", GPU_HEALTH_SOURCES__KMSG__ENABLED="off",
               GPU_HEALTH_SOURCES__NVML__ENABLED="off", GPU_HEALTH_SOURCES__DCGM__ENABLED="off",
               GPU_HEALTH_MODE="remediate", NODE_NAME="bench-node", PYTHONPATH=str(source))
    env.pop("KUBERNETES_SERVICE_HOST", None)
    started = time.monotonic()
    process = subprocess.Popen([sys.executable, "-m", "agent", "run", "--port", "0", "--duration", str(duration),
                                "--scenario", "xid79", "--speed", "10"], env=env, cwd=source,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        code = process.wait(timeout=duration + 120)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        code = None
    return time.monotonic() - started, code


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=15.0)
    parser.add_argument("--source", type=Path, default=REPO)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        with silent_server() as hung:
            for name, url in {"hung": hung, "refused": refused_url()}.items():
                seconds, code = run_agent(kubeconfig(directory, url), directory / f"{name}.db", args.duration,
                                          args.source)
                outcome = f"exit {code}" if code is not None else "killed (did not exit)"
                print(f"api {name:8s} run --duration {args.duration:g}: {seconds:6.1f} s to exit ({outcome})")


if __name__ == "__main__":
    main()
