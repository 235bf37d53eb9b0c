"""A faithful fake Kubernetes API server (real HTTP) and a GPU node to put in it, for tests and `simulate`."""

from agent.simulation.fake_apiserver.gpu_node import populate
from agent.simulation.fake_apiserver.server import ApiError, FakeApiServer, FakeCluster

__all__ = ["ApiError", "FakeApiServer", "FakeCluster", "populate"]
