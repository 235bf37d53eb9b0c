"""The text renderers of `check`, `simulate` and `explain`."""

from __future__ import annotations

import shutil
import textwrap
from collections import Counter
from datetime import datetime
from typing import TYPE_CHECKING, Any

from agent.check import CheckReport
from agent.config import RemediationConfig
from agent.model import StepKind, StepResult, VerdictKind
from agent.remediation import Mode

if TYPE_CHECKING:
    from agent.simulate import SimulationReport, TimelineLine
    from agent.simulate_fleet import FleetReport


DEFAULT_REMEDIATION = RemediationConfig()


def render_report(report: SimulationReport) -> str:
    scenario = report.scenario
    node = report.pipeline.inventory
    models = sorted({g.model for g in node.gpus})
    mode = report.pipeline.policy.mode
    lines = [f"scenario {scenario.name}: {' '.join(scenario.description.split())}",
             f"node {node.name}: {len(node.gpus)} x {', '.join(models)}; mode {mode}"
             f"{' (dry-run)' if report.pipeline.policy.dry_run else ''}; "
             f"{'fake cluster (real HTTP, real actuators)' if report.cluster else 'local mode (no cluster)'}"]
    if mode is not Mode.REMEDIATE:
        lines.append(f"in mode {mode} evictions, GPU resets and reboot requests are skipped "
                     "(--mode remediate shows them)")
    lines.append("")
    skipped: set[tuple[str, str, str]] = set()
    hidden = 0
    for line in report.lines:
        rendered, repeats = render_line(line, skipped)
        lines.extend(rendered)
        hidden += repeats
    lines.append("")
    if hidden:
        lines.append(f"({hidden} repeat(s) of a step already reported as skipped are not shown)")
    lines.append("GPU status: " + ", ".join(
        f"{key[:12]}={status}" for key, status in report.pipeline.gpu_statuses().items() if status != "healthy"
    ) if any(s != "healthy" for s in report.pipeline.gpu_statuses().values()) else "GPU status: all healthy")
    for (key, rule_id), fault in sorted(report.pipeline.active.items()):
        lines.append(f"active: {rule_id} on {key} ({fault.severity}, {fault.action}), "
                     f"{report.pipeline.occurrences(key, rule_id)} occurrence(s)")
    return "\n".join(lines)


def render_fleet_report(report: FleetReport, mode: Mode, dry_run: bool) -> str:
    """The fleet's totals, each correlation the controller announced, the holds and units left, then one line a node
    that took anything or saw a fault."""
    scenario, fleet = report.scenario, report.scenario.fleet
    totals = report.totals()
    lines = [f"scenario {scenario.name}: {' '.join(scenario.description.split())}",
             f"fleet of {totals['nodes']} nodes; mode {mode}{' (dry-run)' if dry_run else ''}; fleet controller "
             f"{'on' if fleet is None or fleet.controller else 'off (the quarantine brake alone)'}; "
             "one fake cluster (real HTTP, real actuators), one agent per node", ""]
    lines.append(f"nodes with a fault: {totals['nodes_faulted']}; tainted at any time: {totals['nodes_tainted_ever']}, "
                 f"at the end: {totals['nodes_tainted_at_end']}; pods evicted: {totals['pods_evicted']}; "
                 f"GPUs reset: {totals['gpus_reset']}; reboot requests: {totals['nodes_reboot_requested']}")
    data = report.to_json()
    for correlation in data["correlations"]:
        lines.append(f"correlated at {correlation['at']:g}s ({correlation['after_first_fault_seconds']:g}s after the "
                     f"first fault): {correlation['cause']}")
    for hold in data["holds_at_end"]:
        taken = " (taken out as one unit, counted as one node by the budget and the brake)" \
            if hold.get("kind") == "unit" else ""
        lines.append(f"{hold.get('kind', 'hold')} {hold['id']} on {len(hold['nodes'])} nodes{taken}"
                     f"{' (spent)' if hold.get('spent') else ''}")
    if data["events"]:
        lines.append("events: " + ", ".join(f"{reason} x{count}" for reason, count in data["events"].items()))
    lines.append("")
    lines += [_fleet_node_line(row) for row in data["nodes"]
              if row["first_fault_at"] is not None or row["tainted_ever"] or row["evicted"]]
    return "\n".join(lines)


def _fleet_node_line(row: dict[str, Any]) -> str:
    took = [what for what, done in (
        ("tainted", row["tainted_ever"]), ("untainted", row["tainted_ever"] and not row["tainted_at_end"]),
        (f"{row['evicted']} pod(s) evicted", row["evicted"]), (f"{row['reset']} GPU(s) reset", row["reset"]),
        ("reboot requested", row["reboot_requested"]), (f"{row['blocked']} step(s) blocked", row["blocked"]))
        if done]
    seen = f"first fault at {row['first_fault_at']:g}s; " if row["first_fault_at"] is not None else ""
    return f"{row['node']}: {seen}{', '.join(took) or 'nothing taken'}"


_STEP_NOTE = {
    StepKind.TAINT: f"{DEFAULT_REMEDIATION.taint_key}:{DEFAULT_REMEDIATION.taint_effect}",
    StepKind.UNTAINT: DEFAULT_REMEDIATION.taint_key,
    StepKind.REBOOT_REQUEST: "a request for a reboot tool such as kured; the agent never reboots",
}


def render_line(line: TimelineLine, skipped: set[tuple[str, str, str]]) -> tuple[list[str], int]:
    """The lines for one timeline entry, and how many repeated skipped steps were left out."""
    out = []
    stamp = f"t={line.at:9.3f}s"
    if line.observation is not None:
        obs = line.observation
        gpu = obs.gpu.describe() if obs.gpu else "node"
        repeats = f" x{line.repeats}" if line.repeats > 1 else ""
        out.append(f"{stamp}  observed  {obs.signal} {num(obs.value)}{repeats} on {gpu} from {obs.source}")
    else:
        out.append(f"{stamp}  tick")
    for verdict in line.outcome.verdicts:
        when = f" (at t={verdict.at:g}s)" if verdict.at != line.at else ""
        if verdict.kind is VerdictKind.CLEARED:
            out.append(f"{'':13}  verdict   CLEARED {verdict.rule_id}: {verdict.summary}{when}")
        else:
            out.append(f"{'':13}  verdict   {verdict.severity.upper()} {verdict.rule_id}: {verdict.summary} "
                       f"-> {verdict.action} [{verdict.fault_class}]{when}")
    hidden = 0
    for action in line.outcome.actions:
        if action.result is StepResult.SKIPPED:
            key = (str(action.step.kind), action.step.target, action.step.rule_id)
            if key in skipped:
                hidden += 1
                continue
            skipped.add(key)
        said = action.result.value not in {"planned", "applied"} or action.step.kind is StepKind.RESET_GPU
        why = f" ({action.message})" if action.message and said else ""  # a reset says how it went
        note = f" ({_STEP_NOTE[action.step.kind]})" if action.step.kind in _STEP_NOTE else ""
        out.append(f"{'':13}  action    {action.step.kind} {action.step.target}{note}: {action.result}{why}")
    return out, hidden


def num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def render_check_table(report: CheckReport, *, width: int | None = None) -> str:
    """One row per GPU under labelled columns; the reason is cut to fit the terminal (--json has it whole)."""
    header = (f"{'GPU':>3}  {'UUID':40}  {'TEMP/SLOW/SHUT C':>16}  {'POWER/LIMIT W':>13}  "
              f"{'ECC SBE/DBE':>11}  {'REMAP':7}  {'STATUS':8}  REASON")
    columns = width or shutil.get_terminal_size((160, 24)).columns
    room = max(20, columns - len(header) + len("REASON"))
    models = Counter(g.gpu.model or "unknown model" for g in report.gpus)
    lines = [f"{', '.join(f'{n} x {m}' for m, n in models.items())}" if models else "", header]
    cut = False
    for gpu in report.gpus:
        r = gpu.readings
        temp = f"{num_or(r.get('temperature_c'))}/{num_or(r.get('slowdown_c'))}/{num_or(r.get('shutdown_c'))}"
        power = f"{num_or(r.get('power_w'))}/{num_or(r.get('power_limit_w'))}"
        ecc = f"{num_or(r.get('ecc_sbe_volatile'))}/{num_or(r.get('ecc_dbe_volatile'))}"
        remap = "pending" if r.get("remap_pending") else ("failed" if r.get("remap_failure") else "ok")
        remap = remap if "remap_pending" in r else "-"
        index = gpu.gpu.index if gpu.gpu.index is not None else "-"
        reason = gpu.short_why
        if len(reason) > room:
            reason, cut = reason[:room - 3] + "...", True
        lines.append(f"{index:>3}  {gpu.gpu.uuid or gpu.gpu.pci_bus_id:40}  {temp:>16}  "
                     f"{power:>13}  {ecc:>11}  {remap:7}  {gpu.status:8}  {reason}")
    if not report.gpus:
        lines.append("(no GPU found)")
    if cut:
        lines.append("")
        for gpu in report.gpus:
            if gpu.short_why != "-":
                lines.extend(textwrap.wrap(f"GPU {gpu.gpu.index}: {gpu.short_why}", width=max(40, columns),
                                           subsequent_indent="    "))
    for verdict in report.node_verdicts:
        lines.append(f"node: {verdict.severity} {verdict.rule_id}: {verdict.summary}")
    return "\n".join(lines)


def num_or(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.0f}"
    return str(value)


def local_time(epoch: float) -> str:
    """A journal time in this host's time zone, with the zone named (operators compare it with dmesg -T)."""
    return datetime.fromtimestamp(epoch).astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")


def render_explanation(item: dict[str, Any], *, brief: bool = False) -> str:
    """What a fault is, what NVIDIA says to do, what the agent does, and how it clears (one line with --xid all)."""
    head = f"Xid {item['xid']} {item['name']}" if "xid" in item else f"{item['signal']} = {num(item['value'])}"
    ours = (f"{item['severity']}, {item['action']} [{item['fault_class']}], "
            f"quarantine {'yes' if item['quarantine'] else 'no'}, rule {item['rule_id'] or '-'}")
    if brief:
        bucket = f"; NVIDIA: {item['nvidia_action']}" if item.get("nvidia_action") is not None else ""
        return f"{head}: {ours}{bucket}"
    nvidia: str | None = item.get("nvidia_action")
    if "xid" in item:
        nvidia = (item.get("nvidia_action") or "-") + (f" (then: {item['nvidia_investigatory_action']})"
                                                      if item.get("nvidia_investigatory_action") else "")
    rows = [("what it is", item.get("description")), ("NVIDIA's action", nvidia), ("our action", ours),
            ("why", item.get("reason")), ("how it clears", item.get("clears")),
            ("attributes read", item.get("needs")), ("note", item.get("note"))]
    return "\n".join([head, *(f"  {label + ':':17} {text}" for label, text in rows if text)])
