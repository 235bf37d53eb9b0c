"""`rules lint`, `config show`, `history` and `explain`: read-only looks at rules, config and journal."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from agent.cli.common import config_of, fail, open_journal, reporting_bad_input
from agent.cli.render import local_time, render_explanation
from agent.config import config_as_yaml
from agent.engine import RuleSet, builtin_rules_dir, lint_rules, load_rules, unreached_recoveries
from agent.explain import CATALOG_XIDS, explain_signal, explain_xid
from agent.model import AttrValue, Signal
from agent.remediation import Mode


@click.group()
def rules() -> None:
    """Work with rule files."""


@rules.command(name="lint")
@click.argument("directory", required=False, type=click.Path())
@click.option("--mode", type=click.Choice([str(m) for m in Mode]), default=None,
              help="Also say which rules' quarantine the recovery in this mode never reaches (warnings, exit 0).")
def rules_lint(directory: str | None, mode: str | None) -> None:
    """Validate a rules directory: exit 0 when valid, else 2 with one line per problem."""
    target = Path(directory) if directory else builtin_rules_dir()
    problems = lint_rules(target)
    if problems:
        fail([p.line() for p in problems])
    ruleset = load_rules(target)
    if mode is not None:
        for line in unreached_recoveries(ruleset, quarantines=Mode(mode) is not Mode.OBSERVE,
                                         resets=Mode(mode) is Mode.REMEDIATE, reboots=Mode(mode) is Mode.REMEDIATE):
            click.echo(f"{target}: warning: mode {mode}: {line}")
    click.echo(f"{target}: {len(ruleset.rules)} rules in {len(ruleset.files)} files, all valid")


@click.group(name="config")
def config_group() -> None:
    """Inspect the configuration."""


@config_group.command(name="show")
@click.option("--config", "config_path", type=click.Path(), help="Config file (YAML).")
@reporting_bad_input
def config_show(config_path: str | None) -> None:
    """Print the effective configuration (file, then GPU_HEALTH_* environment overrides)."""
    click.echo(config_as_yaml(config_of(config_path)), nl=False)


@click.command()
@click.option("--config", "config_path", type=click.Path(), help="Config file (YAML).")
@click.option("--journal", "journal_path", type=click.Path(), help="Journal file (default: from config).")
@click.option("--limit", type=int, default=50, show_default=True)
@click.option("--json", "as_json", is_flag=True)
@reporting_bad_input
def history(config_path: str | None, journal_path: str | None, limit: int, as_json: bool) -> None:
    """Show the newest verdicts and actions from the local journal."""
    path = journal_path or config_of(config_path).journal_path
    if not Path(path).exists():
        fail([f"{path}: no journal yet (the agent has not run here)"], code=1)
    journal = open_journal(path)
    try:
        entries = journal.history(limit=limit)
    finally:
        journal.close()
    if as_json:
        click.echo(json.dumps(entries, indent=2, default=str))
        return
    if not entries:
        click.echo(f"{path}: the journal is empty (no verdict or action recorded yet)", err=True)
        return
    for entry in entries:
        when = local_time(entry["at"])
        if entry["type"] == "verdict":
            click.echo(f"{when}  verdict {entry['kind']:7} {entry['severity']:8} {entry['gpu_key']} "
                       f"{entry['rule_id']}: {entry['summary']}")
        else:
            click.echo(f"{when}  action  {entry['kind']:15} {entry['result']:8} {entry['target']}"
                       f"{': ' + entry['message'] if entry['message'] else ''}")


@click.command()
@click.option("--xid", help="An Xid number, or 'all' for every Xid of NVIDIA's catalog.")
@click.option("--signal", "signal_name", type=click.Choice([s.value for s in Signal]), help="A non-Xid signal.")
@click.option("--value", type=float, help="The signal's value.")
@click.option("--attr", "attrs", multiple=True, help="KEY=VALUE attribute (e.g. slowdown_c=90), repeatable.")
@click.option("--model", default="", help="GPU model name, for per-model overrides.")
@click.option("--rules", "rules_dir", type=click.Path(), help="Rules directory (default: the shipped rules).")
@click.option("--json", "as_json", is_flag=True)
@reporting_bad_input
def explain(xid: str | None, signal_name: str | None, value: float | None, attrs: tuple[str, ...], model: str,
            rules_dir: str | None, as_json: bool) -> None:
    """Explain the verdict for an Xid or a signal value, and why."""
    ruleset: RuleSet = load_rules(Path(rules_dir) if rules_dir else builtin_rules_dir())
    parsed = _parse_attrs(attrs)
    if xid is not None:
        if xid == "all":
            results: Any = [explain_xid(ruleset, n, model=model) for n in CATALOG_XIDS]
        else:
            try:
                number = int(xid, 0)
            except ValueError:
                fail([f"--xid: {xid!r} is not a number or 'all'"])
            if number < 1:
                fail([f"--xid: {number} is not an Xid (Xids are numbered from 1)"])
            results = explain_xid(ruleset, number, attrs=parsed, model=model)
    elif signal_name is not None:
        if value is None:
            fail(["--signal needs --value"])
        results = explain_signal(ruleset, Signal(signal_name), value, attrs=parsed, model=model)
    else:
        fail(["explain: give --xid N|all or --signal NAME --value V"])
    if as_json:
        click.echo(json.dumps(results, indent=2, default=str))
        return
    items = results if isinstance(results, list) else [results]
    for item in items:
        click.echo(render_explanation(item, brief=len(items) > 1))


def _parse_attrs(attrs: tuple[str, ...]) -> dict[str, AttrValue]:
    parsed: dict[str, AttrValue] = {}
    for item in attrs:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            fail([f"--attr: {item!r} is not KEY=VALUE"])
        parsed[key] = _scalar(raw)
    return parsed


def _scalar(raw: str) -> AttrValue:
    if raw.lower() in {"true", "false"}:
        return raw.lower() == "true"
    try:
        return int(raw, 0)
    except ValueError:
        pass
    try:
        return float(raw)
    except ValueError:
        return raw
