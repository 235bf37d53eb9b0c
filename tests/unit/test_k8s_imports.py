"""The agent's Kubernetes side runs on its own small client: the official client package is never loaded."""

import subprocess
import sys

#: Every module of the agent's cluster mode, and the CLI commands that talk to a cluster.
CLUSTER_MODULES = ("agent.cli", "agent.daemon", "agent.cluster_side", "agent.k8s.client", "agent.cleanup",
                   "agent.k8s.dra", "agent.simulate")


def test_the_cluster_side_loads_no_part_of_the_kubernetes_package():
    """Run in a fresh interpreter, with a client built: this test process loads the package for its checks."""
    code = (f"import sys, importlib\nfor name in {CLUSTER_MODULES!r}:\n    importlib.import_module(name)\n"
            "from agent.k8s.client import client_for\nfrom agent.k8s.raw import RawApi\n"
            "RawApi(client_for('http://127.0.0.1:9'))\n"
            "print(sorted(n for n in sys.modules if n.split('.')[0] == 'kubernetes'))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert result.stdout.strip() == "[]"


def test_local_mode_loads_no_http_client_library():
    """Without a cluster the agent imports neither urllib3 nor its Kubernetes client."""
    code = ("import sys, agent.cli, agent.daemon\n"
            "print(sorted(n for n in ('urllib3', 'agent.k8s.client', 'agent.k8s.raw') if n in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert result.stdout.strip() == "[]"
