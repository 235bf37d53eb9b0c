"""gpu-health-agent: detect, classify and remediate GPU faults on a Kubernetes node."""

__version__ = "0.1.0"
