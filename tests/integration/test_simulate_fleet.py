"""`simulate` of a fleet: one agent per node, wired as the daemon wires them, and the fleet controller on one
fake API server and one virtual clock (issue 24: replay a fleet-wide cause on a laptop)."""

from __future__ import annotations

import msgspec
import pytest
from click.testing import CliRunner

from agent.cli import main
from agent.engine import builtin_rules_dir, load_rules
from agent.remediation import GuardPolicy, Mode
from agent.simulate_fleet import FleetReport, simulate_fleet
from agent.sources.scenario import Scenario, fleet_timeline, load_scenario, parse_scenario

RULES = load_rules(builtin_rules_dir())


def gsp_storm(**fleet: object) -> Scenario:
    scenario = load_scenario("fleet-gsp-timeout")
    assert scenario.fleet is not None
    return msgspec.structs.replace(scenario, fleet=msgspec.structs.replace(scenario.fleet, **fleet))


def run(scenario: Scenario, mode: Mode = Mode.QUARANTINE) -> FleetReport:
    return simulate_fleet(scenario, rules=RULES, policy=GuardPolicy(mode=mode))


def test_a_fleet_entry_lands_on_the_nodes_it_names_one_stagger_apart():
    """`nodes: [1, "3-4"]` with `stagger: 2`: node 1 at 5 s, node 3 at 7 s, node 4 at 9 s; every node boots."""
    scenario = parse_scenario("""
name: t
fleet: {nodes: 5}
timeline:
  - {at: 5, gpu: 0, signal: xid, value: 79, nodes: [1, "3-4"], stagger: 2}
""", origin="t.yaml")
    timed = fleet_timeline(scenario)
    assert sorted(n for n, t in timed if t.entry == -1) == [0, 1, 2, 3, 4]
    assert [(n, t.observation.at) for n, t in timed if t.entry == 0] == [(1, 5.0), (3, 7.0), (4, 9.0)]
    assert scenario.end == 9.0


@pytest.mark.parametrize(("text", "said"), [
    ("fleet: {nodes: 3}\ntimeline:\n  - {at: 1, signal: xid, value: 79, nodes: [3]}\n",
     "nodes 3 but the fleet has nodes 0-2"),
    ("timeline:\n  - {at: 1, signal: xid, value: 79, nodes: [0]}\n", "nodes and stagger need a fleet"),
], ids=["a node the fleet does not have", "nodes without a fleet"])
def test_a_fleet_entry_naming_nodes_that_cannot_be_is_one_clear_line(tmp_path, text, said):
    """Nodes past the fleet's, or nodes on a one-node scenario: refused with the reason, exit 2, no traceback."""
    path = tmp_path / "bad.yaml"
    path.write_text("name: t\n" + text)
    result = CliRunner().invoke(main, ["simulate", str(path)])
    assert result.exit_code == 2
    assert said in result.output
    assert "Traceback" not in result.output


def test_a_driver_wide_cause_is_held_and_leaves_no_node_tainted():
    """GSP timeouts on every node of one driver: the controller names that driver version, holds the rule on
    its ten nodes, and the nodes tainted before the hold reached them are untainted; nothing is evicted."""
    report = run(gsp_storm(), Mode.REMEDIATE)
    totals = report.totals()
    assert totals["nodes_faulted"] == 10
    assert totals["nodes_tainted_at_end"] == 0
    assert totals["nodes_reboot_requested"] == 0 and totals["gpus_reset"] == 0
    causes = {(str(s.correlation.dimension), s.correlation.key) for s in report.correlations}
    assert causes == {("driver-version", "575.51.03")}
    assert {len(h.nodes) for h in report.holds} == {10}


def test_the_healthy_nodes_of_a_group_count_in_it_before_they_fault():
    """Each agent publishes its summary at its first pass, healthy or not: the correlation's group is the ten
    nodes of that driver, not only those that faulted so far (the share's denominator)."""
    report = run(gsp_storm())
    assert {len(s.correlation.group) for s in report.correlations} == {10}


def test_without_the_fleet_controller_the_brake_alone_bounds_the_quarantines():
    """No controller: the quarantine brake lets at most max(2, 15 % of 20) = 3 nodes be newly quarantined."""
    report = run(gsp_storm(controller=False))
    totals = report.totals()
    assert totals["nodes_faulted"] == 10
    assert totals["nodes_tainted_ever"] == 3
    assert not report.correlations


def test_a_fleet_runs_only_in_a_fake_cluster():
    """`--local` (no cluster) cannot run a fleet: one line, exit 2."""
    result = CliRunner().invoke(main, ["simulate", "fleet-gsp-timeout", "--local"])
    assert result.exit_code == 2
    assert "is a fleet" in result.output


def test_a_broken_gpu_of_its_own_is_quarantined_inside_a_hold():
    """Inside a driver-version hold, the node with a double-bit ECC error of its own ends tainted, alone."""
    report = run(load_scenario("fleet-broken-gpu-in-a-hold"))
    assert [r["node"] for r in report.node_rows() if r["tainted_at_end"]] == ["gpu-6"]
    assert {h.id for h in report.holds} == {"xid-119/driver-version/575.51.03"}


def test_links_down_on_one_fabric_domain_take_that_domain_out_as_one_unit():
    """Every NVLink down on the 18 nodes of fabric-0: the cause named is that domain, one unit of its 18 nodes
    and no other, and all 18 end tainted (the brake counting them as one), the other domain untouched."""
    report = run(load_scenario("fleet-nvlink-fabric-domain"))
    assert {(str(s.correlation.dimension), s.correlation.key) for s in report.correlations} == \
        {("fabric-domain", "fabric-0")}
    [unit] = report.holds
    assert unit.unit and unit.nodes == frozenset(f"gpu-{n}" for n in range(18))
    assert [r["node"] for r in report.node_rows() if r["tainted_at_end"]] == [f"gpu-{n}" for n in range(18)]


def test_links_down_on_every_fabric_domain_at_once_are_held_not_taken_out():
    """Every NVLink down on all six domains (a fleet-wide event): holds only, no unit, no node ends tainted."""
    report = run(load_scenario("fleet-nvlink-many-domains"))
    assert report.holds and not any(h.unit for h in report.holds)
    assert report.totals()["nodes_tainted_at_end"] == 0
