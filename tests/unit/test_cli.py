"""The command line as an operator uses it: exit codes, output shapes, one-line errors."""

import json
from pathlib import Path

from click.testing import CliRunner

from agent.cli import main


def invoke(*args, env=None):
    return CliRunner().invoke(main, list(args), env=env or {}, catch_exceptions=False)


def test_simulate_list_prints_one_name_per_line():
    result = invoke("simulate", "--list")
    assert result.exit_code == 0
    assert "xid79" in result.output.splitlines()


def test_simulate_json_has_verdicts_and_actions_with_kind_target_result():
    result = invoke("simulate", "xid79", "--json")
    document = json.loads(result.stdout)
    assert document["verdicts"][0]["severity"] == "fatal"
    assert all({"kind", "target", "result"} <= set(a) for a in document["actions"])


def test_simulate_prints_a_readable_timeline():
    result = invoke("simulate", "xid79")
    assert "observed  xid 79" in result.output
    assert "FATAL xid-79" in result.output
    assert "evict ml/trainer-3: applied" in result.output


def test_simulate_local_only_plans():
    result = invoke("simulate", "xid79", "--local")
    assert "evict ml/trainer-3: planned" in result.output
    assert "local mode" in result.output


def test_simulate_a_malformed_file_is_one_line_and_exit_2(tmp_path: Path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ntimeline: []\n")
    result = CliRunner().invoke(main, ["simulate", str(bad)])
    assert result.exit_code == 2
    assert result.output.strip().startswith(f"{bad}: field timeline:")
    assert "Traceback" not in result.output


def test_rules_lint_is_clean_on_the_shipped_rules():
    result = invoke("rules", "lint")
    assert result.exit_code == 0
    assert "all valid" in result.output


def test_rules_lint_lists_each_problem_and_exits_2(tmp_path: Path):
    (tmp_path / "r.yaml").write_text("rules:\n- {id: a, signal: xid, severity: fatal}\n")
    result = CliRunner().invoke(main, ["rules", "lint", str(tmp_path)])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert lines and all(line.startswith(f"{tmp_path / 'r.yaml'}: rule a: field ") for line in lines)


def test_explain_one_xid_as_json():
    document = json.loads(invoke("explain", "--xid", "79", "--json").output)
    assert {k: document[k] for k in ("xid", "name", "nvidia_action", "severity", "quarantine", "rule_id")} == {
        "xid": 79, "name": "ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS", "nvidia_action": "RESTART_BM",
        "severity": "fatal", "quarantine": True, "rule_id": "xid-79"}


def test_explain_all_gives_every_catalog_xid():
    document = json.loads(invoke("explain", "--xid", "all", "--json").output)
    assert [d["xid"] for d in document] == list(range(1, 173))
    assert all({"name", "nvidia_action", "severity", "action", "fault_class", "quarantine", "rule_id"} <= set(d)
               for d in document)


def test_explain_a_signal_with_its_attributes():
    document = json.loads(invoke("explain", "--signal", "temperature", "--value", "95", "--attr", "shutdown_c=92",
                                 "--attr", "slowdown_c=90", "--json").output)
    assert (document["rule_id"], document["severity"]) == ("gpu-temp-shutdown", "fatal")


def test_explain_rejects_a_non_number():
    result = CliRunner().invoke(main, ["explain", "--xid", "seventy"])
    assert result.exit_code == 2


def test_config_show_prints_the_effective_config():
    result = invoke("config", "show", env={"GPU_HEALTH_MODE": "observe", "NODE_NAME": "n7"})
    assert "mode: observe" in result.output
    assert "node_name: n7" in result.output


def test_config_show_rejects_an_unknown_key(tmp_path: Path):
    path = tmp_path / "c.yaml"
    path.write_text("colour: blue\n")
    result = CliRunner().invoke(main, ["config", "show", "--config", str(path)])
    assert result.exit_code == 2
    assert result.output.strip() == f"{path}: field colour: unknown key"


def test_history_reads_what_simulate_journalled(tmp_path: Path):
    journal = tmp_path / "j.db"
    invoke("simulate", "xid79", "--journal", str(journal))
    document = json.loads(invoke("history", "--journal", str(journal), "--json").output)
    assert {e["type"] for e in document} == {"verdict", "action"}
    assert any(e.get("rule_id") == "xid-79" for e in document)


def test_history_without_a_journal_says_so(tmp_path: Path):
    result = CliRunner().invoke(main, ["history", "--journal", str(tmp_path / "none.db")])
    assert result.exit_code == 1
    assert "no journal yet" in result.output


def run_briefly(tmp_path: Path, **env: str | None):
    """`run --duration 0.2` on a scenario instead of GPU sources, with only the given cluster settings."""
    base: dict[str, str | None] = {
        "GPU_HEALTH_JOURNAL_PATH": str(tmp_path / "j.db"), "GPU_HEALTH_HTTP__HOST": "127.0.0.1",
        "GPU_HEALTH_SOURCES__KMSG__ENABLED": "off", "GPU_HEALTH_SOURCES__NVML__ENABLED": "off",
        "GPU_HEALTH_SOURCES__DCGM__ENABLED": "off", "NODE_NAME": "cli-node", "HOME": str(tmp_path),
        "KUBECONFIG": None, "KUBERNETES_SERVICE_HOST": None, "KUBERNETES_SERVICE_PORT": None,
    }
    return CliRunner().invoke(main, ["run", "--port", "0", "--duration", "0.2", "--scenario", "xid79"],
                              env={**base, **env})


def test_run_in_a_pod_with_a_broken_service_account_config_exits_1_with_one_line(tmp_path: Path):
    """The in-cluster environment present but unusable is a failed start, never a silent local mode."""
    result = run_briefly(tmp_path, KUBERNETES_SERVICE_HOST="10.96.0.1")
    assert result.exit_code == 1
    assert result.output.strip().count("\n") == 0
    assert "in-cluster configuration" in result.output and "local mode" not in result.output


def test_run_with_a_configured_kubeconfig_that_is_broken_exits_1_with_one_line(tmp_path: Path):
    """A kubeconfig the config names but that does not parse stops the start with its path."""
    broken = tmp_path / "kubeconfig"
    broken.write_text("clusters: [this is not a kubeconfig")
    result = run_briefly(tmp_path, GPU_HEALTH_REMEDIATION__KUBECONFIG=str(broken))
    assert result.exit_code == 1
    assert result.output.strip().count("\n") == 0
    assert str(broken) in result.output


def test_run_with_a_configured_kubeconfig_that_is_missing_exits_1(tmp_path: Path):
    """Naming a kubeconfig in the config means cluster mode: a missing file is an error, not local mode."""
    result = run_briefly(tmp_path, GPU_HEALTH_REMEDIATION__KUBECONFIG=str(tmp_path / "absent"))
    assert result.exit_code == 1
    assert "local mode" not in result.output


def test_run_with_no_cluster_configured_at_all_runs_in_local_mode(tmp_path: Path):
    """No service-account environment and no kubeconfig anywhere: local mode, exit 0."""
    result = run_briefly(tmp_path)
    assert result.exit_code == 0, result.output
    assert "local mode" in result.output
