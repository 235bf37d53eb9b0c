"""`gpu-health-agent fleet run|hold|release|status|confirm`: the fleet controller, an operator's holds and
confirms of braked taints."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from agent.engine import builtin_rules_dir, load_rules
from agent.errors import AgentError, InputError, InputErrors
from agent.fleet import CorrelationPolicy, Dimension, Hold, holdable
from agent.fleet.published import HOLDS_CONFIGMAP, HOLDS_KEY, LEASE_NAME, encode
from agent.fleet.summary import RACK_LABEL, ZONE_LABEL
from agent.fleetctl.settings import FleetSettings
from agent.fleetctl.view import GPU_NODE_SELECTOR, Labels
from agent.logs import configure_logging
from agent.shutdown import stop_event

if TYPE_CHECKING:
    from agent.fleetapi.holds_store import HoldsStore

DEFAULT_NAMESPACE = "gpu-health"
#: The longest hold an operator may set in one command (renewed by running `hold` again).
MAX_OPERATOR_SECONDS = 7 * 86400.0
_POLICY, _SETTINGS = CorrelationPolicy(), FleetSettings()
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def _guarded(func: Callable[..., None]) -> Callable[..., None]:
    """Bad input: one line and exit 2; a cluster that cannot be used: one line and exit 1."""

    def wrapper(*args: Any, **kwargs: Any) -> None:
        try:
            func(*args, **kwargs)
        except InputErrors as exc:
            for problem in exc.problems:
                click.echo(problem.line(), err=True)
            sys.exit(2)
        except InputError as exc:
            click.echo(exc.line(), err=True)
            sys.exit(2)
        except AgentError as exc:
            click.echo(f"gpu-health-agent fleet: {exc}", err=True)
            sys.exit(1)

    wrapper.__name__, wrapper.__doc__ = func.__name__, func.__doc__
    return wrapper


def parse_duration(text: str) -> float:
    """`90`, `90s`, `30m`, `2h`, `1d` in seconds; more than MAX_OPERATOR_SECONDS or not positive is refused."""
    raw = text.strip().lower()
    unit = _UNITS.get(raw[-1:], 0.0)
    try:
        seconds = float(raw[:-1] if unit else raw) * (unit or 1.0)
    except ValueError:
        raise InputError(f"--duration {text!r} is not a duration (90s, 30m, 2h, 1d)") from None
    if not 0 < seconds <= MAX_OPERATOR_SECONDS:
        raise InputError(f"--duration {text!r} must be more than 0 and at most 7d")
    return seconds


def _client(kubeconfig: str | None) -> Any:
    from agent.k8s.client import load_api_client  # noqa: PLC0415 - the client loads only where it is used

    return load_api_client(kubeconfig=kubeconfig)[0]


def _namespace(value: str | None) -> str:
    return value or os.environ.get("POD_NAMESPACE") or DEFAULT_NAMESPACE


_namespace_option = click.option("--namespace", help="The agent's namespace, where the holds ConfigMap lives "
                                                     "(default: $POD_NAMESPACE, else gpu-health).")
_kubeconfig_option = click.option("--kubeconfig", type=click.Path(), help="Kubeconfig (default: in-cluster, "
                                                                          "$KUBECONFIG, ~/.kube/config).")


@click.group(name="fleet")
def fleet() -> None:
    """The fleet view: correlated faults held fleet-wide (docs/fleet.md)."""


@fleet.command(name="run")
@_namespace_option
@_kubeconfig_option
@click.option("--identity", help="This candidate's Lease holder identity (default: $POD_NAME, else the host).")
@click.option("--rack-label", default=RACK_LABEL, show_default=True, help="The node label naming its rack.")
@click.option("--zone-label", default=ZONE_LABEL, show_default=True, help="The node label naming its zone.")
@click.option("--gpu-node-selector", default=GPU_NODE_SELECTOR, show_default=True,
              help="The agents' remediation.gpu_node_selector: the GPU nodes the quarantine brake's census counts.")
@click.option("--min-nodes", type=click.IntRange(min=2), default=_POLICY.min_nodes, show_default=True,
              help="Nodes sharing a key that make a correlation.")
@click.option("--min-share", type=click.FloatRange(0, 1, min_open=True), default=_POLICY.min_share,
              show_default=True, help="Or this share of a group of at least --min-group nodes.")
@click.option("--min-group", type=click.IntRange(min=2), default=_POLICY.min_group, show_default=True)
@click.option("--window", type=click.FloatRange(min=1), default=_POLICY.window_seconds, show_default=True,
              help="Seconds within which first sightings count together.")
@click.option("--base-rate", type=click.FloatRange(0, 1), default=_POLICY.base_rate, show_default=True,
              help="The least rate of a rule's independent faults per node and window: a group's faults must be "
              "beyond what it gives the group by chance.")
@click.option("--chance", type=click.FloatRange(0, 1, min_open=True, max_open=True), default=_POLICY.chance,
              show_default=True, help="The chance above which a group's faults count as independent.")
@click.option("--hold", "hold_seconds", type=click.FloatRange(min=1), default=_SETTINGS.hold_seconds,
              show_default=True, help="Seconds a hold lasts after its correlation was last seen standing.")
@click.option("--max-hold", type=click.FloatRange(min=1), default=_SETTINGS.max_hold_seconds, show_default=True,
              help="Seconds after its start beyond which a hold is not renewed.")
@click.option("--tick", type=click.FloatRange(min=0.1), default=_SETTINGS.tick_seconds, show_default=True,
              help="Seconds between passes when nothing changes.")
@click.option("--unit-settle", type=click.FloatRange(min=0), default=_SETTINGS.unit_settle_seconds,
              show_default=True, help="Seconds a fabric fault must stay confined to one domain before the domain "
              "is taken out as one unit.")
@click.option("--port", type=click.IntRange(0, 65535), default=9102, show_default=True,
              help="Port for /metrics and /healthz (0: any free port).")
@click.option("--health-port", type=click.IntRange(0, 65535), default=9103, show_default=True,
              help="Port for the probes' /healthz alone, a listener of its own so that scrapes (or anyone who "
              "can reach the metrics port) never take the connections a probe needs (0: any free port).")
@click.option("--duration", type=click.FloatRange(min=0, min_open=True), help="Stop after this many seconds.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info")
@_guarded
def run_command(namespace: str | None, kubeconfig: str | None, identity: str | None, rack_label: str,
                zone_label: str, gpu_node_selector: str, min_nodes: int, min_share: float, min_group: int,
                window: float, base_rate: float, chance: float, hold_seconds: float, max_hold: float, tick: float,
                unit_settle: float, port: int, health_port: int, duration: float | None, log_level: str) -> None:
    """Run the fleet controller (a Deployment): leader-elected, it watches the nodes' summaries and
    publishes holds for the faults it correlates."""
    from agent.fleetapi.leader import LeaderElector, LeaseConfig  # noqa: PLC0415
    from agent.fleetctl.controller import FleetController  # noqa: PLC0415
    from agent.fleetctl.metrics import FleetMetrics  # noqa: PLC0415
    from agent.httpserver import AgentHttpServer  # noqa: PLC0415
    from agent.k8s.events import EventRecorder  # noqa: PLC0415
    from agent.k8s.raw import RawApi  # noqa: PLC0415
    from agent.k8s.watch import ListWatch, WatchOptions  # noqa: PLC0415

    configure_logging(log_level)
    if max_hold < hold_seconds:
        raise InputError("--max-hold must be at least --hold")
    ns = _namespace(namespace)
    me = identity or os.environ.get("POD_NAME") or socket.gethostname()
    api = _client(kubeconfig)
    raw = RawApi(api)
    settings = FleetSettings(namespace=ns, labels=Labels(rack=rack_label, zone=zone_label, gpu_nodes=gpu_node_selector),
                             policy=CorrelationPolicy(min_nodes=min_nodes, min_share=min_share, min_group=min_group,
                                                      window_seconds=window, base_rate=base_rate, chance=chance),
                             hold_seconds=hold_seconds, max_hold_seconds=max_hold, tick_seconds=tick,
                             unit_settle_seconds=unit_settle)
    metrics = FleetMetrics()
    elector = LeaderElector(raw, LeaseConfig(namespace=ns, name=LEASE_NAME, identity=me))
    controller = FleetController(raw, settings, identity=me, metrics=metrics, fence=lambda: elector.leading,
                                 events=EventRecorder(raw, instance=me, namespace=ns, fold_seconds=0.0))  # create only
    nodes = ListWatch(api, "/api/v1/nodes", WatchOptions(metadata_only=True))

    def health() -> tuple[bool, dict[str, object]]:
        return bool(nodes.resource_version), {"leading": elector.leading, "nodes": len(controller.view.nodes),
                                              "holds": len(controller.holds)}

    servers = []
    for what, at, serve in (("/metrics", port, metrics.exposition), ("/healthz", health_port, lambda: b"")):
        try:
            servers.append(AgentHttpServer("0.0.0.0", at, metrics=serve, health=health))  # noqa: S104
        except OSError as exc:
            for started in servers:
                started.close()
            raise AgentError(f"cannot serve {what} on port {at}: {exc.strerror or exc}") from None
    for server in servers:
        server.start()
    click.echo(f"gpu-health-agent fleet: controller {me} in namespace {ns}, http :{servers[0].port} "
               f"(probes :{servers[1].port})", err=True)
    stop = stop_event(duration)
    try:
        controller.run(stop, nodes=nodes, elector=elector)
    finally:
        for server in servers:
            server.close()
        api.close()


def _rule_class(rule_id: str, rules_dir: str | None) -> Any:
    rules = {r.id: r for r in load_rules(Path(rules_dir) if rules_dir else builtin_rules_dir()).rules}
    rule = rules.get(rule_id)
    if rule is None:
        raise InputError(f"--rule {rule_id!r} is not a rule (see `gpu-health-agent rules list`)")
    if not holdable(rule.fault_class):
        raise InputError(f"--rule {rule_id!r} is a {rule.fault_class} fault: a hardware fault is never held")
    return rule.fault_class


def _selected(api: Any, nodes: tuple[str, ...], selector: str | None, *, named: str = "--node NAME (repeatable)",
              command: str = "") -> list[str]:
    from agent.k8s.watch import ListWatch, WatchOptions  # noqa: PLC0415

    if selector is None and not nodes:
        raise InputError(f"name the nodes: {named} or --selector LABELS", file=command)
    listed, _ = ListWatch(api, "/api/v1/nodes", WatchOptions(label_selector=selector or "",
                                                             metadata_only=True)).list_all()
    names = {str((n.get("metadata") or {}).get("name")) for n in listed}
    missing = sorted(set(nodes) - names)
    if missing:
        option = f"{named.split(maxsplit=1)[0]}: " if named.startswith("-") else ""
        raise InputError(f"{option}no such node: {', '.join(missing)}"
                         + (f" (among those matching {selector!r})" if selector else ""), file=command)
    chosen = sorted(set(nodes) or names)
    if not chosen:
        raise InputError(f"--selector {selector!r} matches no node", file=command)
    return chosen


def _show(store: HoldsStore, holds: list[Hold], dry_run: bool, what: str) -> None:
    data = encode(holds, now=store.clock(), wall=store.write_wall(), writer=store.writer)
    if dry_run:
        click.echo(f"would write configmap {store.namespace}/{HOLDS_CONFIGMAP} ({what}):")
        click.echo(json.dumps({**data, HOLDS_KEY: json.loads(data[HOLDS_KEY])}, indent=2, sort_keys=True))
    else:
        click.echo(what)


@fleet.command(name="hold")
@click.option("--rule", "rule_id", required=True, help="The rule to hold (never a hardware rule).")
@click.option("--node", "nodes", multiple=True, help="A node to hold it on (repeatable).")
@click.option("--selector", help="Or every node matching this label selector.")
@click.option("--duration", required=True, help="How long: 90s, 30m, 2h, 1d (at most 7d).")
@click.option("--reason", default="", help="Why, for the record (shown by `fleet status`).")
@click.option("--rules-dir", type=click.Path(), help="Rules directory (default: the built-in rules).")
@click.option("--dry-run", is_flag=True, help="Print what would be written; write nothing.")
@_namespace_option
@_kubeconfig_option
@_guarded
def hold_command(rule_id: str, nodes: tuple[str, ...], selector: str | None, duration: str, reason: str,
                 rules_dir: str | None, dry_run: bool, namespace: str | None, kubeconfig: str | None) -> None:
    """Hold one rule on some nodes: they keep conditions and Events but take no taint, eviction, reset or
    reboot for it until the hold ends or is released."""
    from agent.fleetapi.holds_store import HoldsStore  # noqa: PLC0415
    from agent.k8s.raw import RawApi  # noqa: PLC0415

    seconds = parse_duration(duration)
    fault_class = _rule_class(rule_id, rules_dir)
    api = _client(kubeconfig)
    chosen = _selected(api, nodes, selector)
    key = selector or ",".join(chosen)
    hold_id = f"operator/{rule_id}/{hashlib.sha256(key.encode()).hexdigest()[:10]}"
    store = HoldsStore(RawApi(api), _namespace(namespace), writer="operator", own_clock=False)
    cause = f"held by an operator: {reason}" if reason else "held by an operator"

    def change(holds: list[Hold]) -> list[Hold]:
        now = store.clock()
        wanted = Hold(hold_id, rule_id, fault_class, Dimension.OPERATOR, key, cause, frozenset(chosen), now,
                      now + seconds, by_operator=True)
        return [h for h in holds if h.id != hold_id] + [wanted]

    if dry_run:
        _show(store, change(store.read()[0]), True, f"hold {hold_id}")
        return
    store.update(change)
    click.echo(f"hold {hold_id}: {rule_id} on {len(chosen)} node(s) for {seconds:.0f}s")


@fleet.command(name="release")
@click.argument("hold_id")
@click.option("--dry-run", is_flag=True, help="Print what would be written; write nothing.")
@_namespace_option
@_kubeconfig_option
@_guarded
def release_command(hold_id: str, dry_run: bool, namespace: str | None, kubeconfig: str | None) -> None:
    """End a hold now: its nodes act on its rule as ever. A correlated hold stays spent (covering nothing)
    while its cause stands, so the controller does not start it again."""
    from agent.fleetapi.holds_store import HoldsStore  # noqa: PLC0415
    from agent.k8s.raw import RawApi  # noqa: PLC0415

    store = HoldsStore(RawApi(_client(kubeconfig)), _namespace(namespace), writer="operator", own_clock=False)

    def change(holds: list[Hold]) -> list[Hold]:
        if hold_id not in {h.id for h in holds}:
            raise InputError(f"no hold {hold_id!r} (see `gpu-health-agent fleet status`)")
        now = store.clock()
        return [replace(h, spent=True, expires_at=min(h.expires_at, now)) if h.id == hold_id else h for h in holds]

    if dry_run:
        _show(store, change(store.read()[0]), True, f"release {hold_id}")
        return
    store.update(change)
    click.echo(f"released {hold_id}")


@fleet.command(name="confirm")
@click.argument("nodes", nargs=-1)
@click.option("--selector", help="Or every node matching this label selector whose taint waits.")
@click.option("--dry-run", is_flag=True, help="Print what would be written; write nothing.")
@_kubeconfig_option
@_guarded
def confirm_command(nodes: tuple[str, ...], selector: str | None, dry_run: bool, kubeconfig: str | None) -> None:
    """Let the taint the quarantine brake keeps waiting on these nodes through at their agents' next pass.
    Nothing else: holds, the disruption budget and the mode decide as ever; unused, it expires."""
    from agent.fleet.confirm import CONFIRM_SECONDS  # noqa: PLC0415
    from agent.fleetctl.confirm_command import COMMAND, CONFIRM_ANNOTATION, confirm  # noqa: PLC0415

    if nodes and selector is not None:
        raise InputError("name the nodes or give --selector, not both", file=COMMAND)
    api = _client(kubeconfig)
    chosen = _selected(api, nodes, selector, named="NODE...", command=COMMAND)
    for name, value in confirm(api, chosen, selected=selector is not None, dry_run=dry_run):
        if dry_run:
            click.echo(f"would annotate node {name} {CONFIRM_ANNOTATION}={value}")
        else:
            click.echo(f"node {name}: the taint waiting on the quarantine brake goes at its agent's next pass "
                       f"(unused, the confirm expires in {CONFIRM_SECONDS / 60:.0f}m)")


@fleet.command(name="status")
@click.option("--output", type=click.Choice(["text", "json"]), default="text", show_default=True)
@_namespace_option
@_kubeconfig_option
@_guarded
def status_command(output: str, namespace: str | None, kubeconfig: str | None) -> None:
    """The published holds: which rule, on how many nodes, why, and for how much longer."""
    from agent.fleetapi.holds_store import HoldsStore  # noqa: PLC0415
    from agent.k8s.raw import RawApi  # noqa: PLC0415

    store = HoldsStore(RawApi(_client(kubeconfig)), _namespace(namespace), writer="operator", own_clock=False)
    holds, _ = store.read()
    now = store.clock()
    rows: list[dict[str, Any]] = [{"id": h.id, "kind": h.kind, "rule": h.rule_id, "state": _state(h, now),
                                   "nodes": sorted(h.nodes), "scope": _scope(h),
             "remaining_seconds": max(0, round(h.expires_at - now)), "cause": h.cause} for h in holds]
    if output == "json":
        click.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        click.echo(f"no holds in {store.source}")
    for row in rows:
        covers = f"every node whose own {row['scope']}" if row["scope"] else f"{len(row['nodes'])} node(s)"
        click.echo(f"{row['id']}  {row['kind']}  {row['state']}  {covers}  "
                   f"{row['remaining_seconds']}s left  {row['cause']}")


def _scope(hold: Hold) -> str:
    """What a scoped hold covers in words ("" for one that covers the nodes it names only)."""
    if not hold.scope:
        return ""
    if hold.domains:
        return f"{hold.dimension} is one of {len(hold.domains)} it touched"
    return f"{hold.dimension} is {hold.key}" + (f" (named: {len(hold.nodes)})" if hold.nodes else "")


def _state(hold: Hold, now: float) -> str:
    if hold.spent:
        return "spent"
    return "live" if now < hold.expires_at else "ended"


__all__ = ["fleet", "parse_duration"]
