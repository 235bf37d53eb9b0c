"""Golden test: every row of NVIDIA's Xid catalog against the policy of rules/xid.yaml."""

import csv
import filecmp
from pathlib import Path

import pytest

from agent.engine import EngineState, evaluate
from agent.explain import explain_xid, xid_catalog
from agent.model import Severity, Signal
from tests.conftest import REPO, gpu, obs

QUARANTINING_BUCKETS = {"RESET_GPU", "RESTART_BM", "RESTART_VM", "WORKFLOW_XID_48"}
HARMLESS_BUCKETS = {"RESTART_APP", "IGNORE"}
#: Departures recorded in docs/rules.md: Xid 94 (contained ECC error) keeps new work off until its reset.
KEEPS_NEW_WORK_OFF = {94}
CATALOG = list(csv.DictReader((REPO / "agent" / "data" / "xid_catalog.csv").read_text(encoding="utf-8").splitlines()))


def test_the_catalog_lists_xid_1_to_172():
    assert [int(r["xid"]) for r in CATALOG] == list(range(1, 173))


def test_the_vendored_catalog_equals_the_shared_reference():
    shared = REPO.parent / "shared" / "data"
    if not shared.is_dir():
        pytest.skip("no ../shared/data beside this checkout")
    for name in ("xid_catalog.csv", "xid_144_150_decode.csv", "xid154_recovery_actions.csv",
                 "xid_resolution_buckets.csv"):
        assert filecmp.cmp(shared / name, REPO / "agent" / "data" / name, shallow=False), name


@pytest.mark.parametrize("row", CATALOG, ids=lambda r: f"xid{r['xid']}")
def test_every_xid_has_a_rule_on_purpose(shipped_rules, row):
    xid = int(row["xid"])
    rules = [r for r in shipped_rules.for_signal(Signal.XID) if xid in r.codes and not r.id.startswith("xid-app-")]
    assert rules, f"Xid {xid} has no rule of its own"
    for rule in rules:
        assert rule.nvidia_action == (row["immediate_action"] or "(none in catalog)")
        assert rule.source
        departs = rule.action.quarantines != (row["immediate_action"] in QUARANTINING_BUCKETS)
        if departs or not row["immediate_action"]:
            assert rule.reason, f"{rule.id} departs from NVIDIA's bucket without a reason"


@pytest.mark.parametrize("row", CATALOG, ids=lambda r: f"xid{r['xid']}")
def test_one_occurrence_follows_the_bucket(shipped_rules, row):
    xid = int(row["xid"])
    bucket = row["immediate_action"]
    verdicts = evaluate(obs(Signal.XID, xid), EngineState(), 0.0, rules=shipped_rules)
    assert verdicts, f"Xid {xid} raised nothing"
    quarantines = any(v.quarantines for v in verdicts)
    if bucket in QUARANTINING_BUCKETS:
        assert quarantines, f"one Xid {xid} ({bucket}) must quarantine"
    if bucket in HARMLESS_BUCKETS and xid in KEEPS_NEW_WORK_OFF:
        assert quarantines and not any(v.action.evicts for v in verdicts), f"Xid {xid}: NoSchedule, nobody evicted"
    elif bucket in HARMLESS_BUCKETS:
        assert not quarantines, f"one Xid {xid} ({bucket}) must never quarantine"
    if row["description"].strip().lower() == "unused":
        assert not quarantines


def test_unknown_codes_warn_and_never_quarantine(shipped_rules):
    for xid in (0, 173, 250, 999, 65535):
        [verdict] = evaluate(obs(Signal.XID, xid), EngineState(), 0.0, rules=shipped_rules)
        assert (verdict.rule_id, verdict.severity, verdict.quarantines) == ("xid-unknown", Severity.WARNING, False)


@pytest.mark.parametrize(("action", "severity", "quarantines"), [
    (0, "info", False), (1, "fatal", True), (2, "fatal", True), (3, "degraded", True), (4, "degraded", True),
])
def test_xid_154_follows_the_reported_recovery_action(shipped_rules, action, severity, quarantines):
    [verdict] = evaluate(obs(Signal.XID, 154, recovery_action=action), EngineState(), 0.0, rules=shipped_rules)
    assert (str(verdict.severity), verdict.quarantines) == (severity, quarantines)


def test_xid_45_defers_to_the_xid_that_caused_it(shipped_rules):
    [follows] = evaluate(obs(Signal.XID, 45, caused_by=79), EngineState(), 0.0, rules=shipped_rules)
    [solo] = evaluate(obs(Signal.XID, 45), EngineState(), 0.0, rules=shipped_rules)
    assert (follows.rule_id, follows.severity) == ("xid-45-follows", Severity.INFO)
    assert (solo.rule_id, solo.quarantines) == ("xid-45-solo", False)


@pytest.mark.parametrize("xid", range(144, 151))
def test_nvlink5_xids_follow_the_decoded_bucket(shipped_rules, xid):
    def verdict_for(**attrs):
        [v] = evaluate(obs(Signal.XID, xid, **attrs), EngineState(), 0.0, rules=shipped_rules)
        return v
    assert verdict_for(decoded_action="RESET_GPU").quarantines
    assert verdict_for(decoded_action="IGNORE").severity is Severity.INFO
    undecoded = verdict_for()
    assert (undecoded.rule_id, undecoded.quarantines) == (f"xid-{xid}-undecoded", False)


def test_repeated_application_xids_across_workloads_quarantine(shipped_rules):
    state = EngineState()
    verdicts = []
    for n, workload in enumerate(("pod-a", "pod-b", "pod-c")):
        verdicts += evaluate(obs(Signal.XID, 13, n * 600.0, workload=workload), state, n * 600.0, rules=shipped_rules)
    assert any(v.rule_id == "xid-app-faults-across-workloads" and v.quarantines for v in verdicts)


def test_explain_matches_the_catalog_names(shipped_rules):
    for xid, row in xid_catalog().items():
        assert explain_xid(shipped_rules, xid)["name"] == row.mnemonic


def test_the_generated_file_is_current():
    import subprocess
    import sys
    generated = subprocess.run([sys.executable, str(REPO / "scripts" / "gen_xid_rules.py")], check=True,
                               capture_output=True, text=True).stdout
    assert generated == (REPO / "rules" / "xid.yaml").read_text(encoding="utf-8")


def test_gpu_helper_is_stable():
    assert gpu(1).index == 1
    assert Path(REPO / "rules").is_dir()


def test_xid_74_quarantines_only_when_its_registers_say_so(shipped_rules):
    def verdict_for(**attrs):
        [v] = evaluate(obs(Signal.XID, 74, **attrs), EngineState(), 0.0, rules=shipped_rules)
        return v
    assert not verdict_for(nvlink_error_class="IGNORE").quarantines
    assert not verdict_for(nvlink_error_class="SYMPATHETIC").quarantines
    assert verdict_for(nvlink_error_class="INVESTIGATE").quarantines
    assert verdict_for().quarantines  # registers that could not be read keep the caution
