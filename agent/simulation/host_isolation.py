"""A simulated node's configuration: the agent's own, with every path it reads or writes on a real node cleared.

A simulation runs anywhere, a GPU node included, and must not see or touch that machine: the kubelet's
PodResources socket there would answer with that node's devices and pods (its GPUs, none of the simulated ones,
so each simulated GPU would read as withheld by a device plugin and quarantine mode would not taint), and a
reboot sentinel would ask that machine to reboot. What a simulated node's kubelet offers comes from the
simulation itself (agent.simulation.device_plugin), or from nowhere (the agent then cannot tell, as without a
socket)."""

from __future__ import annotations

import msgspec

from agent.config import Config
from agent.remediation import GuardPolicy


def simulated_node_config(base: Config, *, node_name: str, policy: GuardPolicy) -> Config:
    """`base` for the simulated node `node_name` under `policy`, with no host path to read or write."""
    remediation = msgspec.structs.replace(base.remediation, pod_resources_socket="", reboot_sentinel_path="")
    return msgspec.structs.replace(base, node_name=node_name, mode=policy.mode, dry_run=policy.dry_run,
                                   remediation=remediation)
