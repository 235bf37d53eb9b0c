#!/usr/bin/env python3
"""Prints the RSS a PodResources call costs the agent: the h2 client (agent.k8s.grpc_unary) against grpcio.

A fake kubelet (a grpcio server, in its own process so its memory is not counted) answers List with PODS pods;
each client runs in a fresh interpreter that first imports what the agent's cluster mode imports, then calls
List CALLS times (as an agent does once per fault). Usage: scripts/bench_podresources.py [PODS] [CALLS]
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SETUP = ("import time\n"
         "def rss():\n    for line in open('/proc/self/status'):\n        if line.startswith('VmRSS:'):\n"
         "            return int(line.split()[1]) / 1024\n"
         "for name in ('agent.cli', 'agent.daemon', 'agent.cluster_side', 'agent.k8s.client', 'agent.k8s.dra', "
         "'agent.k8s.pods'):\n    __import__(name)\n"
         "base = rss()\n")
STDLIB = ("from agent.k8s.podresources import list_pod_devices\n"
          "started = time.monotonic()\n"
          "for _ in range(CALLS):\n    pods = list_pod_devices(SOCKET)\n")
# What agent.k8s.podresources did before: grpcio's channel, one call per channel.
GRPCIO = ("import grpc\nfrom agent.k8s.podresources import LIST_METHOD, decode_list_response\n"
          "started = time.monotonic()\n"
          "for _ in range(CALLS):\n"
          "    with grpc.insecure_channel(f'unix://{SOCKET}') as channel:\n"
          "        pods = channel.unary_unary(LIST_METHOD, request_serializer=lambda _: b'',\n"
          "                                   response_deserializer=decode_list_response)(None, timeout=5)\n")
REPORT = "print(f'{base:.1f} {rss():.1f} {len(pods)} {(time.monotonic() - started) / CALLS * 1000:.1f}')\n"


def serve(socket_path: str, pods: int) -> None:
    from concurrent import futures  # noqa: PLC0415

    import grpc  # noqa: PLC0415

    from agent.k8s.podresources import PodDevices, encode_list_response  # noqa: PLC0415

    answer = encode_list_response([PodDevices(f"ns-{i % 50}", f"pod-{i:05d}", {"nvidia.com/gpu": [f"GPU-{i:032x}"]})
                                   for i in range(pods)])
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("v1.PodResourcesLister", {
        "List": grpc.unary_unary_rpc_method_handler(lambda _request, _context: answer)}),))
    server.add_insecure_port(f"unix://{socket_path}")
    server.start()
    print(len(answer), flush=True)
    server.wait_for_termination()


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--serve":
        serve(sys.argv[2], int(sys.argv[3]))
        return
    pods = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    calls = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    env = dict(os.environ, PYTHONPATH=str(REPO))
    with tempfile.TemporaryDirectory() as folder:
        socket_path = f"{folder}/kubelet.sock"
        kubelet = subprocess.Popen([sys.executable, __file__, "--serve", socket_path, str(pods)], env=env,
                                   stdout=subprocess.PIPE, text=True)
        try:
            size = int(kubelet.stdout.readline()) if kubelet.stdout else 0
            while not os.path.exists(socket_path):
                time.sleep(0.05)
            print(f"python {sys.version.split()[0]}; a fake kubelet (grpcio server) answering {pods} pods "
                  f"({size} bytes); {calls} List calls per client")
            for name, body in (("h2 client (agent.k8s.grpc_unary)", STDLIB), ("grpcio (before)", GRPCIO)):
                code = f"SOCKET = {socket_path!r}\nCALLS = {calls}\n{SETUP}{body}{REPORT}"
                done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                      check=False, cwd=REPO)
                if done.returncode:
                    raise SystemExit(f"{name} failed: {done.stderr.strip().splitlines()[-1:]}")
                base, after, listed, per_call = done.stdout.split()
                print(f"  {name:38s} RSS {base} MiB after the agent's imports -> {after} MiB after the calls "
                      f"(+{float(after) - float(base):.1f}); {listed} pods; {per_call} ms a call")
        finally:
            kubelet.terminate()
            kubelet.wait(10)


if __name__ == "__main__":
    main()
