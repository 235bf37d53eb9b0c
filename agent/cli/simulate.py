"""`simulate`: replay a fault scenario through the agent on a virtual clock."""

from __future__ import annotations

import json
from pathlib import Path

import click

from agent.cli.common import fail, open_journal, reporting_bad_input
from agent.cli.render import render_fleet_report, render_report
from agent.config import Config
from agent.engine import builtin_rules_dir, load_rules
from agent.logs import configure_logging
from agent.remediation import GuardPolicy, Mode
from agent.sources.scenario import builtin_names, load_scenario

DEFAULT_MODE = Config().mode


@click.command(name="simulate")
@click.argument("scenario", required=False)
@click.option("--list", "list_only", is_flag=True, help="List the built-in scenarios.")
@click.option("--json", "as_json", is_flag=True, help="One JSON document with verdicts and actions.")
@click.option("--mode", type=click.Choice([m.value for m in Mode]), default=None,
              help=f"The agent's mode (default: the scenario's `mode`, else the agent's own default, {DEFAULT_MODE}).")
@click.option("--dry-run", is_flag=True, help="Record what would be done.")
@click.option("--rules", "rules_dir", type=click.Path(), help="Rules directory (default: the shipped rules).")
@click.option("--journal", "journal_path", type=click.Path(), help="Also record into this journal file.")
@click.option("--local", is_flag=True, help="No fake cluster: steps are only planned (local mode).")
@reporting_bad_input
def simulate_command(scenario: str | None, list_only: bool, as_json: bool, mode: str | None, dry_run: bool,
                     rules_dir: str | None, journal_path: str | None, local: bool) -> None:
    """Replay a fault scenario (built-in NAME or FILE) through the agent on a virtual clock."""
    if list_only:
        described = [(name, " ".join(load_scenario(name).description.split())) for name in builtin_names()]
        if as_json:
            click.echo(json.dumps([{"name": n, "description": d} for n, d in described], indent=2))
            return
        width = max(len(n) for n, _ in described)
        for name, description in described:
            click.echo(f"{name:{width}}  {description}")
        return
    if not scenario:
        fail(["simulate: give a scenario name or file, or --list"])
    from agent.simulate import simulate, simulate_in_cluster  # noqa: PLC0415 - brings the fake cluster

    loaded = load_scenario(scenario)
    mode = mode or loaded.mode or str(DEFAULT_MODE)
    if loaded.node.diagnostic and Mode(mode) is not Mode.REMEDIATE:
        fail([f"simulate: {scenario}: node.diagnostic stands for a configured diagnostic, which mode {mode} never "
              "runs (only remediate does; the agent refuses that configuration at load)"])
    rules = load_rules(Path(rules_dir) if rules_dir else builtin_rules_dir())
    configure_logging("error", "auto")
    if loaded.fleet is not None:
        if local or journal_path:
            fail([f"simulate: {scenario} is a fleet: it runs in a fake cluster, one agent and journal per node "
                  "(no --local, no --journal)"])
        from agent.simulate_fleet import simulate_fleet  # noqa: PLC0415 - brings the fake cluster

        fleet = simulate_fleet(loaded, rules=rules, policy=GuardPolicy(mode=Mode(mode), dry_run=dry_run))
        click.echo(json.dumps(fleet.to_json(), indent=2, default=str) if as_json else
                   render_fleet_report(fleet, Mode(mode), dry_run))
        return
    journal = open_journal(journal_path) if journal_path else None
    try:
        policy = GuardPolicy(mode=Mode(mode), dry_run=dry_run)
        runner = simulate if local else simulate_in_cluster
        report = runner(loaded, rules=rules, policy=policy, journal=journal)
    finally:
        if journal:
            journal.close()
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=2, default=str))
    else:
        click.echo(render_report(report))
