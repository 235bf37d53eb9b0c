"""gpu-health-agent: detect, classify and remediate GPU faults on a Kubernetes node."""

import agent.logs  # noqa: F401 - first, so structlog never loads the dev tools (see agent.logs)

__version__ = "0.1.0"
