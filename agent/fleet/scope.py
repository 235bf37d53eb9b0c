"""Which group keys a reader judges itself: a hold scoped by its key covers the nodes whose own key it is.

Pure. A hold published with every node it covers grows with the fleet (10,000 cloud-length names is past the
ConfigMap's 1 MiB); scoped by its cause's group key it is a few hundred bytes, and each reader decides from
its own summary (what its own NVML and pods say) whether it is in the group. Only keys an agent knows of
itself in the form the controller groups by are scoped: the workload, the driver version, the NVLink fabric
domain (a fabric-wide cause: the domains it touched) and the GPU model (GPU Feature Discovery's product
label is the model with its spaces as dashes, maybe "-SHARED" for time-slicing), and the rack and the zone
(the Node's topology labels, read by the agent from its own Node). The boot window, an operator's hold and a
unit stay lists of names.
"""

from __future__ import annotations

from collections.abc import Set

from agent.fleet.correlate import FABRIC_WIDE_KEY, Dimension, group_keys
from agent.fleet.summary import NodeSummary

SCOPABLE = frozenset({Dimension.WORKLOAD, Dimension.DRIVER_VERSION, Dimension.FABRIC_DOMAIN, Dimension.GPU_MODEL,
                      Dimension.RACK, Dimension.ZONE})


def own_key_matches(dimension: Dimension, key: str, domains: Set[str], own: NodeSummary) -> bool:
    """Whether the node whose own summary is `own` has `key` in `dimension` (for the fabric-wide key: a
    fabric domain among `domains`). An empty own key matches nothing."""
    if dimension not in SCOPABLE:
        return False
    keys = group_keys(dimension, own)
    if dimension is Dimension.FABRIC_DOMAIN and key == FABRIC_WIDE_KEY:
        return bool(keys & domains)
    if dimension is Dimension.GPU_MODEL:  # GFD's product label: the model with dashes, maybe -SHARED
        keys |= {form for model in keys for form in (model.replace(" ", "-"), f"{model.replace(' ', '-')}-SHARED")}
    return key in keys
