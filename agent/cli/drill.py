"""`drill`: a marked Xid record through this node's real kernel log to the agent, and what to expect."""

from __future__ import annotations

import os
import time
from pathlib import Path

import click

from agent.cli.common import EXIT_FAILED, POSITIVE, config_of, fail, reporting_bad_input
from agent.cli.nvml import nvml_or_reason
from agent.config import Config
from agent.daemon import rules_dir_of
from agent.engine import load_rules
from agent.explain import explain_xid
from agent.model import normalise_pci

_ALERT_FOR = {"fatal": "GpuHealthFatalFault", "degraded": "GpuHealthDegradedForLong",
              "unknown": "GpuHealthSourceUnknown"}


@click.command()
@click.option("--node", "named_node", help="This node's name; required for --full (default: NODE_NAME).")
@click.option("--pci", help="The GPU's PCI address as the driver logs it (default: NVML's GPU 0).")
@click.option("--xid", type=click.IntRange(min=1), default=79, show_default=True, help="The Xid to drill.")
@click.option("--full", is_flag=True, help="Act for real per the agent's mode (taint, evict...): needs --node.")
@click.option("--wait", "wait_seconds", type=POSITIVE, default=30.0, show_default=True,
              help="Seconds to wait for the agent to admit the drill record.")
@click.option("--config", "config_path", type=click.Path(), help="The agent's config (state dir, kmsg path).")
@reporting_bad_input
def drill(named_node: str | None, pci: str | None, xid: int, full: bool, wait_seconds: float,
          config_path: str | None) -> None:
    """Prove the whole path on this node without hurting it: a marked Xid record through the real kernel log
    -> verdict -> Event, condition, metric -> alert -> runbook. Run as root on the node (or in the agent pod)."""
    from agent.drill import DrillBox, DrillError, drills_dir, new_request, write_kmsg  # noqa: PLC0415

    config = config_of(config_path)
    node = config.node_name
    if named_node is not None and named_node != node:
        fail([f"drill: this is node {node}, not {named_node}: run the drill on the node it is for"])
    if full and named_node is None:
        fail(["drill: a full drill acts for real (taint, evictions, per the agent's mode): name this node with "
               "--node"])
    pci = pci or _first_gpu_pci(config)
    ruleset = load_rules(rules_dir_of(config))
    expected = explain_xid(ruleset, xid)
    box = DrillBox(drills_dir(config.journal_path))
    request = new_request(node=node, pci=pci, xid=xid, full=full, now=time.time(),
                          requested_by=os.environ.get("SUDO_USER") or os.environ.get("USER") or f"uid {os.getuid()}")
    try:
        box.file(request)
    except DrillError as exc:
        fail([f"drill: {exc}"], code=EXIT_FAILED)
    kind = "FULL drill (acts per the agent's mode)" if full else "drill (no taint, eviction, reset or reboot)"
    click.echo(f"drill 1/3: {kind} {request.drill_id} filed for node {node}, GPU {pci}, Xid {xid}", err=True)
    try:
        write_kmsg(request.kmsg_line(pid=os.getpid()), Path(config.sources.kmsg.path))
    except OSError as exc:
        box.withdraw(request.drill_id)
        fail([f"drill: cannot write to {config.sources.kmsg.path}: {exc.strerror} (run as root)"], code=EXIT_FAILED)
    click.echo(f"drill 2/3: record written to {config.sources.kmsg.path}", err=True)
    click.echo(f"drill 3/3: waiting up to {wait_seconds:g}s for the agent on {node} to admit it", err=True)
    deadline = time.monotonic() + wait_seconds
    while box.pending(request.drill_id) and time.monotonic() < deadline:
        time.sleep(0.1)
    if box.withdraw(request.drill_id):
        fail([f"drill: the agent did not admit drill {request.drill_id} within {wait_seconds:g}s (is it running "
               f"on this node, with the same state directory {box.directory}?); request withdrawn"],
              code=EXIT_FAILED)
    severity = str(expected["severity"])
    alert = _ALERT_FOR.get(severity)
    click.echo(f"admitted: drill {request.drill_id} reached the agent through the kernel log")
    click.echo(f"expect:   verdict {severity} {expected['rule_id']} marked drill={request.drill_id}; an Event and "
               f"condition on node/{node}; metrics with drill=\"true\"")
    if alert:
        click.echo(f"then:     alert {alert} (runbook docs/runbooks/{alert}.md)")
    click.echo(f"see:      kubectl get events --field-selector involvedObject.name={node} | grep drill")


def _first_gpu_pci(config: Config) -> str:
    sources: dict[str, str] = {}
    nvml_source = nvml_or_reason(config, sources)
    if nvml_source is None:
        fail([f"drill: no --pci given and NVML cannot name a GPU ({sources['nvml']})"])
    try:
        if not nvml_source.gpus:
            fail(["drill: no --pci given and NVML found no GPU"])
        return normalise_pci(nvml_source.gpus[0].ref.pci_bus_id)
    finally:
        nvml_source.stop()
