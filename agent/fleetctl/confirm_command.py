"""`gpu-health-agent fleet confirm`: an operator lets the taint the quarantine brake keeps waiting on a node
through at its agent's next pass, by annotating the Node (the agent consumes the annotation)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from agent.errors import InputError
from agent.fleet.confirm import confirm_value
from agent.k8s.node import CONFIRM_ANNOTATION, NodeView, NodeWriter
from agent.k8s.raw import RawApi
from agent.remediation.guard import BRAKED

#: What its one-line refusals are prefixed with.
COMMAND = "gpu-health-agent fleet confirm"


def waits_on_brake(view: NodeView) -> bool:
    """Whether the node's agent says a new taint waits on the quarantine brake: one of its conditions reports a
    problem whose message ends so."""
    return any(c.status and BRAKED in c.message for c in view.observation().conditions.values())


def confirm(api: Any, names: list[str], *, selected: bool, dry_run: bool,
            wall: Callable[[], float] = time.time) -> list[tuple[str, str]]:
    """(node, value written) for each node of `names` whose taint waits on the brake. A node named on its own
    (not `selected` by a label selector) that has nothing waiting is refused before anything is written; of
    a selection, those with nothing waiting are left out, and none waiting is refused."""
    raw = RawApi(api)
    writers = {name: NodeWriter(raw, name, taint_key="") for name in names}
    waiting = [name for name, writer in writers.items() if waits_on_brake(writer.read())]
    idle = sorted(set(names) - set(waiting))
    if idle and not selected:
        raise InputError(f"node {', '.join(idle)}: no taint waits on the quarantine brake (its conditions do not "
                         "say 'quarantine brake: the taint waits'), nothing to confirm", file=COMMAND)
    if not waiting:
        raise InputError("no selected node has a taint waiting on the quarantine brake, nothing to confirm",
                         file=COMMAND)
    value = confirm_value(wall())
    if not dry_run:
        for name in waiting:
            writers[name].set_metadata(annotations={CONFIRM_ANNOTATION: value})
    return [(name, value) for name in sorted(waiting)]


__all__ = ["COMMAND", "CONFIRM_ANNOTATION", "confirm", "waits_on_brake"]
