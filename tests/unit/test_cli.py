"""The command line as an operator uses it: exit codes, output shapes, one-line errors."""

import json
import re
from pathlib import Path

from click.testing import CliRunner

from agent.cli import main
from agent.journal import Journal
from tests.conftest import FIXTURES


def invoke(*args, env=None):
    return CliRunner().invoke(main, list(args), env=env or {}, catch_exceptions=False)


def test_simulate_list_prints_each_name_with_its_description():
    """One line per built-in scenario: the name, then what it shows."""
    result = invoke("simulate", "--list")
    assert result.exit_code == 0
    [line] = [line for line in result.output.splitlines() if line.split()[0] == "xid79"]
    assert "GPU 3 falls off the bus (Xid 79)" in line


def test_simulate_list_honours_json():
    """--list --json: a list of {name, description} objects."""
    document = json.loads(invoke("simulate", "--list", "--json").output)
    assert {"name": "xid79"} .items() <= next(d for d in document if d["name"] == "xid79").items()
    assert all(d["description"] for d in document)


def test_simulate_json_has_verdicts_and_actions_with_kind_target_result():
    result = invoke("simulate", "xid79", "--json")
    document = json.loads(result.stdout)
    assert document["verdicts"][0]["severity"] == "fatal"
    assert all({"kind", "target", "result"} <= set(a) for a in document["actions"])


def test_simulate_prints_a_readable_timeline():
    result = invoke("simulate", "xid79", "--mode", "remediate")
    assert "observed  xid 79" in result.output
    assert "FATAL xid-79" in result.output
    assert "evict ml/trainer-3: applied" in result.output


def test_simulate_local_only_plans():
    result = invoke("simulate", "xid79", "--local", "--mode", "remediate")
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


def own_lines(output: str) -> list[str]:
    """The lines this command printed itself. CliRunner captures the process's stderr while it runs, so a JSON
    log record from a thread an earlier test left behind (a daemon's node reader still retrying) can land in
    `output`; the command's own message is plain text."""
    return [line for line in output.strip().splitlines() if not line.startswith('{"event": ')]


def test_run_in_a_pod_with_a_broken_service_account_config_exits_1_with_one_line(tmp_path: Path):
    """The in-cluster environment present but unusable is a failed start, never a silent local mode."""
    result = run_briefly(tmp_path, KUBERNETES_SERVICE_HOST="10.96.0.1")
    assert result.exit_code == 1
    assert len(own_lines(result.output)) == 1
    assert "in-cluster configuration" in result.output and "local mode" not in result.output


def test_run_with_a_configured_kubeconfig_that_is_broken_exits_1_with_one_line(tmp_path: Path):
    """A kubeconfig the config names but that does not parse stops the start with its path."""
    broken = tmp_path / "kubeconfig"
    broken.write_text("clusters: [this is not a kubeconfig")
    result = run_briefly(tmp_path, GPU_HEALTH_REMEDIATION__KUBECONFIG=str(broken))
    assert result.exit_code == 1
    assert len(own_lines(result.output)) == 1
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


def exporter_page(tmp_path: Path, *, gpus: set[int]) -> str:
    """The faults fixture cut down to some of its GPUs (0, 1, 6 healthy; 2 degraded; 3, 4, 7 fatal; 5 past its
    slowdown threshold in this one reading: a warning, since a sustained rule cannot be judged from one)."""
    lines = (FIXTURES / "dcgm" / "faults.prom").read_text().splitlines()
    kept = [line for line in lines if not (m := re.search(r'gpu="(\d+)"', line)) or int(m.group(1)) in gpus]
    page = tmp_path / "metrics.prom"
    page.write_text("\n".join(kept) + "\n")
    return str(page)


def test_check_exits_0_ok_when_every_gpu_is_healthy(tmp_path: Path):
    """Monitoring-plugin convention: OK is 0, and the first line says so."""
    result = invoke("check", "--dcgm-exporter", exporter_page(tmp_path, gpus={0, 1, 6}))
    assert result.exit_code == 0
    assert result.output.splitlines()[0] == "gpu-health-agent check: OK - 3 GPUs (3 healthy)"


def test_check_exits_1_warning_when_a_gpu_is_degraded(tmp_path: Path):
    """A GPU with a row remap pending is WARNING (1)."""
    result = invoke("check", "--dcgm-exporter", exporter_page(tmp_path, gpus={0, 2}))
    assert result.exit_code == 1
    assert result.output.startswith("gpu-health-agent check: WARNING - 2 GPUs (1 degraded, 1 healthy)")


def test_check_exits_2_critical_when_any_gpu_is_fatal():
    """A fatal GPU is CRITICAL (2), whatever the other GPUs say."""
    result = invoke("check", "--dcgm-exporter", str(FIXTURES / "dcgm" / "faults.prom"))
    assert result.exit_code == 2
    assert result.output.startswith("gpu-health-agent check: CRITICAL - 8 GPUs (3 fatal")


def test_check_exits_3_unknown_when_the_only_source_cannot_be_read():
    """No GPU found and an unreadable exporter is UNKNOWN (3), never OK."""
    result = invoke("check", "--dcgm-exporter", "/nonexistent")
    assert result.exit_code == 3
    assert "UNKNOWN - 0 GPUs; no GPU found; source dcgm unreadable" in result.output.splitlines()[0]


def test_check_json_carries_the_status_and_exit_code():
    """--json has the same verdict as the exit code, for scripts that parse it."""
    result = invoke("check", "--dcgm-exporter", str(FIXTURES / "dcgm" / "faults.prom"), "--json")
    document = json.loads(result.output)
    assert (document["status"], document["exit_code"], result.exit_code) == ("CRITICAL", 2, 2)


def test_check_table_labels_its_columns_and_keeps_reasons_free_of_the_gpu_identity():
    """The reason column does not repeat the UUID and PCI address that the row already shows."""
    result = invoke("check", "--dcgm-exporter", str(FIXTURES / "dcgm" / "faults.prom"))
    lines = result.output.splitlines()
    header = next(line for line in lines if line.lstrip().startswith("GPU  UUID"))
    assert all(label in header for label in ("TEMP/SLOW/SHUT C", "POWER/LIMIT W", "ECC SBE/DBE", "STATUS", "REASON"))
    [row] = [line for line in lines if line.startswith("  3  ")]
    reason = row.split("fatal", 1)[1]
    assert "xid-79" in reason
    assert "GPU-5d1c0f3a" not in reason and "PCI" not in reason


def test_check_table_fits_a_narrow_terminal_and_lists_whole_reasons_below(tmp_path: Path):
    """Cut reasons end in '...' and appear whole under the table."""
    from agent.check import check_node, exporter_reading
    from agent.cli.render import render_check_table
    from agent.engine import builtin_rules_dir, load_rules
    from agent.sources.dcgm_exporter import ExporterReader

    reader = ExporterReader(str(FIXTURES / "dcgm" / "faults.prom"), timeout_seconds=1, baseline_xid=False)
    gpus, observations = exporter_reading(reader, 0.0)
    report = check_node(load_rules(builtin_rules_dir()), gpus=gpus, observations=observations, now=0.0, sources={})
    text = render_check_table(report, width=160)
    table = text.split("\n\n")[0].splitlines()
    assert all(len(line) <= 160 for line in table[1:])
    assert any(line.startswith("GPU 3: xid-79: Xid 79 (ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS)")
               for line in text.splitlines())


def test_explain_an_xid_shows_what_it_is_what_to_do_and_how_it_clears():
    """Description, NVIDIA's action, our action and the way the fault clears, each labelled."""
    output = " ".join(invoke("explain", "--xid", "79").output.split())
    assert "what it is: GPU has fallen off the bus" in output
    assert "NVIDIA's action: RESTART_BM" in output
    assert "our action: fatal, reboot_node [hardware], quarantine yes, rule xid-79" in output
    assert "how it clears: after a reboot" in output


def test_explain_a_signal_says_which_attributes_the_rules_read():
    """Without the attributes the verdict cannot be judged: explain names the missing ones."""
    output = " ".join(invoke("explain", "--signal", "temperature", "--value", "95").output.split())
    assert "attributes read: shutdown_c, slowdown_c (not given: shutdown_c, slowdown_c" in output


def test_history_prints_local_times_with_the_zone(tmp_path: Path):
    """Journal times are the host's local time, the zone named, not epoch seconds."""
    journal = tmp_path / "j.db"
    invoke("simulate", "xid79", "--journal", str(journal))
    result = invoke("history", "--journal", str(journal), env={"TZ": "UTC"})
    first = result.output.splitlines()[0]
    assert re.match(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC  (verdict|action)", first), first


def test_history_of_an_empty_journal_says_it_is_empty(tmp_path: Path):
    """An empty journal is not silence: one line says so, exit 0."""
    from agent.journal import Journal

    Journal(tmp_path / "j.db").close()
    result = invoke("history", "--journal", str(tmp_path / "j.db"))
    assert result.exit_code == 0
    assert "the journal is empty" in result.stderr


def test_kmsg_parse_says_how_many_lines_it_read_and_did_not_recognise(tmp_path: Path):
    """The summary on stderr: lines read, records shown, Xid lines the parser did not recognise."""
    log = tmp_path / "k.log"
    log.write_text("boot\nNVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=x, GPU has fallen off the bus.\n"
                   "NVRM: Xid (PCI:0000:3b:00): garbled\n")
    result = invoke("kmsg", "parse", str(log))
    assert result.stderr.strip() == (f"{log}: read 3 line(s): 1 NVIDIA record(s) shown, "
                                     "1 Xid line(s) not recognised")


def test_simulate_defaults_to_the_agents_own_mode_and_says_what_it_skips():
    """The agent's default is quarantine: simulate shows that, and says what remediate would add."""
    output = invoke("simulate", "xid79").output
    assert "mode quarantine" in output.splitlines()[1]
    assert "in mode quarantine evictions, GPU resets and reboot requests are skipped" in output


def test_simulate_names_the_taint_and_calls_a_reboot_request_a_request():
    """The taint step shows key and effect; a reboot request is a request for a reboot tool."""
    output = invoke("simulate", "xid79", "--mode", "remediate").output
    assert "taint gpu-node-1 (gpu-health-agent.io/unhealthy:NoSchedule): applied" in output
    assert "reboot_request gpu-node-1 (a request for a reboot tool such as kured; the agent never reboots)" in output


def test_simulate_reports_a_skipped_step_once_per_fault():
    """A step the mode skips is reported once, not on every observation of the fault."""
    output = invoke("simulate", "recovery").output
    skipped = [line for line in output.splitlines() if ": skipped" in line]
    assert skipped and len(skipped) == len(set(skipped))


def test_a_sped_up_scenario_runs_its_recovery_window_at_the_same_speed(tmp_path: Path):
    """`run --scenario recovery --speed 1000`: the 10-minute quiet window passes in under a second, so the
    fault the scenario raises is also cleared within a few seconds of wall time."""
    env = {"GPU_HEALTH_JOURNAL_PATH": str(tmp_path / "j.db"), "GPU_HEALTH_HTTP__HOST": "127.0.0.1",
           "GPU_HEALTH_SOURCES__KMSG__ENABLED": "off", "GPU_HEALTH_SOURCES__NVML__ENABLED": "off",
           "GPU_HEALTH_SOURCES__DCGM__ENABLED": "off", "NODE_NAME": "cli-node", "HOME": str(tmp_path),
           "KUBECONFIG": None, "KUBERNETES_SERVICE_HOST": None, "KUBERNETES_SERVICE_PORT": None}
    result = CliRunner().invoke(main, ["run", "--port", "0", "--duration", "4", "--scenario", "recovery",
                                       "--speed", "1000"], env=env)
    assert result.exit_code == 0, result.output
    journal = Journal(tmp_path / "j.db")
    kinds = [entry["kind"] for entry in journal.history() if entry["type"] == "verdict"]
    journal.close()
    assert kinds == ["fault", "cleared"]


def test_explain_a_signal_shows_nvidia_s_guidance_beside_our_action():
    """A changed non-Xid rule (recovery action 4) prints NVIDIA's guidance and ours side by side."""
    output = invoke("explain", "--signal", "recovery_action", "--value", "4").output
    assert "NVIDIA's action:  DRAIN_AND_RESET" in output
    assert "our action:       degraded, quarantine_reset_when_idle" in output


def test_explain_says_a_diagnostic_clears_the_repeat_pattern():
    """xid-app-13-repeat-gpc-tpc clears by a passing diagnostic, never a timer."""
    output = invoke("explain", "--xid", "13", "--attr", "sm_location_workloads=3").output
    assert "when the diagnostic run on the idle GPU passes" in output


def test_check_reports_a_sustained_rule_seen_once_without_judging_it(tmp_path: Path):
    """GPU 5 is past its slowdown threshold in the one reading: OK, and the reason says what one reading cannot tell."""
    result = invoke("check", "--dcgm-exporter", exporter_page(tmp_path, gpus={5}))
    assert result.exit_code == 0
    assert "cannot be judged from one reading" in " ".join(result.output.split())
