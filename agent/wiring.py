"""The agent's pipeline built from its configuration and cluster side: the one wiring `run`, `simulate` and the
fleet simulate share, so a replay decides with the policy, options and cluster side the agent itself has."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from agent.config import Config, pipeline_options
from agent.engine import RuleSet
from agent.journal import Journal
from agent.metrics import Metrics
from agent.model import NodeInventory, Verdict
from agent.pipeline import Pipeline
from agent.remediation import GuardPolicy

if TYPE_CHECKING:
    from agent.cluster_side import ClusterSide


def guard_policy_of(config: Config) -> GuardPolicy:
    """The guard's policy as configured: mode, dry-run, attempts an hour, cool-down."""
    return GuardPolicy(
        mode=config.mode,
        dry_run=config.dry_run,
        max_attempts_per_hour=config.remediation.max_attempts_per_hour,
        cooldown_seconds=config.remediation.cooldown_seconds,
    )


def pipeline_of(config: Config, *, rules: RuleSet, inventory: NodeInventory, cluster: ClusterSide | None,
                journal: Journal | None = None, metrics: Metrics | None = None,
                clock: Callable[[], float] = time.time, inline: bool = True, live_pods: bool = True,
                on_released: Callable[[Verdict], None] | None = None,
                diagnostic_available: bool | None = None, own_pod: str | None = None) -> Pipeline:
    """The pipeline for `config`, acting through `cluster` (None: local mode, steps only planned).

    `inline` reconciles after each change (simulate, tests; the daemon's reconciler has a thread of its own);
    `live_pods` lists the node's pods through the cluster side each pass (the agent; a replay whose pods hold
    their GPUs only in its scenario keeps the inventory's list); `own_pod` the agent's pod where there is no
    cluster side to say it (a local replay)."""
    return Pipeline(
        rules=rules,
        inventory=inventory,
        policy=guard_policy_of(config),
        journal=journal,
        metrics=metrics,
        clock=clock,
        actuator=cluster.actuator if cluster else None,
        gate=cluster.gate if cluster else None,
        own_pod=own_pod if own_pod is not None else cluster.own_pod if cluster else "",
        pods=cluster.pods.pods if cluster and live_pods else None,
        offered=cluster.pods.offered if cluster else None,
        **pipeline_options(config),
        inline=inline,
        on_released=on_released,
        fleet=cluster.fleet if cluster else None,
        diagnostic_available=diagnostic_available,
    )
