"""The bounded mirror of the record (the Node's state annotation): whole when it fits, else cut with a marker."""

from __future__ import annotations

import json

from agent.remediation.record import MIRROR_MAX_BYTES, mirror_of


def _fault(gpu: int, rule: str, action: str = "notify", severity: str = "warning", since: float = 1.0) -> dict:
    return {"rule_id": rule, "gpu_key": f"GPU-{gpu}", "action": action, "severity": severity, "since": since,
            "summary": "s" * 400}


def _document(faults: list[dict], owed: int = 0) -> dict:
    return {"generation": 7, "faults": faults, "remediation": {"tainted": True},
            "owed": [{"id": f"e{i}", "note": "n" * 200} for i in range(owed)], "gpus": [],
            "cursors": {"kmsg": "boot:9", "boot_id": "boot"}}


def _size(document: dict) -> int:
    return len(json.dumps(document, sort_keys=True, separators=(",", ":")).encode())


def test_a_record_that_fits_is_mirrored_whole():
    """Under the bound nothing is cut and no marker is added."""
    document = _document([_fault(0, "xid-1")], owed=3)
    assert mirror_of(document) == document


def test_a_record_past_the_bound_is_cut_to_it_with_counts_and_a_marker():
    """1,000 faults: the mirror fits the bound, counts all faults by severity, and says how many it kept."""
    faults = [_fault(g, f"xid-{r}") for g in range(8) for r in range(125)]
    mirrored = mirror_of(_document(faults, owed=50))
    assert _size(mirrored) <= MIRROR_MAX_BYTES
    marker = mirrored["truncated"]
    assert (marker["faults"], marker["severities"], marker["owed"]) == (1000, {"warning": 1000}, 50)
    assert marker["kept_faults"] == len(mirrored["faults"]) and 0 < marker["kept_faults"] < 1000
    assert mirrored["remediation"] == {"tainted": True} and mirrored["generation"] == 7


def test_a_cut_mirror_keeps_each_gpus_worst_fault_and_the_most_severe_first():
    """The faults that decide isolation survive the cut: every GPU's worst, then by action and severity."""
    faults = [_fault(g, f"xid-{r}") for g in range(8) for r in range(300)]
    faults += [_fault(g, "xid-79", action="reboot_node", severity="fatal") for g in range(8)]
    faults.append(_fault(3, "xid-48", action="reset_gpu", severity="fatal"))
    kept = {(f["gpu_key"], f["rule_id"]) for f in mirror_of(_document(faults))["faults"]}
    assert {(f"GPU-{g}", "xid-79") for g in range(8)} | {("GPU-3", "xid-48")} <= kept


def test_a_cut_mirror_leaves_out_the_kernel_log_cursor_so_a_lost_journal_reads_it_again():
    """What the mirror dropped can be raised again only if the kernel log is read again: its cursor is withheld."""
    faults = [_fault(g, f"xid-{r}") for g in range(8) for r in range(125)]
    mirrored = mirror_of(_document(faults))
    assert mirrored["cursors"] == {"boot_id": "boot"}
    assert mirrored["truncated"]["cursors_left_out"] == ["kmsg"]
