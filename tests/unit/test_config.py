from pathlib import Path

import pytest

from agent.config import load_config, pipeline_options
from agent.errors import ConfigError
from agent.remediation import Mode


def test_defaults_are_safe():
    config = load_config(None, env={"NODE_NAME": "n1"})
    assert (config.node_name, config.mode, config.dry_run) == ("n1", Mode.QUARANTINE, False)
    assert config.remediation.taint_effect == "NoSchedule"


def test_a_file_sets_values(tmp_path: Path):
    path = tmp_path / "c.yaml"
    path.write_text("mode: remediate\nhttp: {port: 9999}\n")
    config = load_config(path, env={})
    assert (config.mode, config.http.port) == (Mode.REMEDIATE, 9999)


def test_the_environment_overrides_the_file(tmp_path: Path):
    path = tmp_path / "c.yaml"
    path.write_text("mode: remediate\n")
    config = load_config(path, env={"GPU_HEALTH_MODE": "observe", "GPU_HEALTH_HTTP__PORT": "9500",
                                    "GPU_HEALTH_DRY_RUN": "true"})
    assert (config.mode, config.http.port, config.dry_run) == (Mode.OBSERVE, 9500, True)


def test_an_unknown_key_names_file_and_field(tmp_path: Path):
    path = tmp_path / "c.yaml"
    path.write_text("remediation: {tiant_key: x}\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path, env={})
    assert caught.value.line() == f"{path}: field remediation.tiant_key: unknown key"


def test_a_bad_environment_value_names_the_variable():
    with pytest.raises(ConfigError) as caught:
        load_config(None, env={"GPU_HEALTH_HTTP__PORT": "not-a-port"})
    assert caught.value.file == "environment GPU_HEALTH_HTTP__PORT"
    assert caught.value.field == "http.port"


def test_an_unknown_environment_key_is_an_error():
    with pytest.raises(ConfigError, match="unknown key"):
        load_config(None, env={"GPU_HEALTH_MOOD": "happy"})


def test_noexecute_is_possible_but_not_the_default():
    assert load_config(None, env={"GPU_HEALTH_REMEDIATION__TAINT_EFFECT": "NoExecute"}).remediation.taint_effect \
        == "NoExecute"


def test_broken_yaml_is_reported_with_the_file(tmp_path: Path):
    path = tmp_path / "c.yaml"
    path.write_text("mode: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(path, env={})


def test_a_diagnostic_naming_the_hostengine_needs_one_configured(tmp_path: Path):
    """A diagnostic command that asks a DCGM host engine, with none configured, fails at load with one line."""
    path = tmp_path / "config.yaml"
    path.write_text('remediation: {diagnostic_command: [dcgmi, diag, --host, "{hostengine}", -r, "2", -i, "{uuid}"]}\n')
    with pytest.raises(ConfigError, match=r"sources\.dcgm\.hostengine is empty"):
        load_config(path, env={})
    path.write_text('mode: remediate\nremediation: {diagnostic_command: [dcgmi, diag, --host, "{hostengine}"]}\n'
                    'sources: {dcgm: {hostengine: "10.0.0.5:5555"}}\n')
    assert load_config(path, env={}).sources.dcgm.hostengine == "10.0.0.5:5555"


def test_a_diagnostic_configured_in_a_mode_that_never_runs_it_is_refused_at_load(tmp_path: Path):
    """Issue 41: only remediate runs a diagnostic; in observe or quarantine the repeat patterns it was configured
    to decide would quarantine and wait for ever. The configured mode, GPU_HEALTH_MODE and run --mode alike."""
    path = tmp_path / "config.yaml"
    path.write_text('mode: remediate\nremediation: {diagnostic_command: [dcgmi, diag, -r, "3", -i, "{uuid}"]}\n')
    assert load_config(path, env={}).mode is Mode.REMEDIATE
    for refused in (lambda: load_config(path, env={"GPU_HEALTH_MODE": "quarantine"}),
                    lambda: load_config(path, env={}, mode=Mode.OBSERVE)):
        with pytest.raises(ConfigError, match=r"diagnostic_command is set but mode (quarantine|observe) never runs"):
            refused()
    path.write_text('remediation: {diagnostic_command: [dcgmi, diag, -r, "3", -i, "{uuid}"]}\n')
    with pytest.raises(ConfigError, match="mode quarantine never runs a diagnostic"):
        load_config(path, env={})
    assert load_config(path, env={}, mode=Mode.REMEDIATE).remediation.diagnostic_command


def test_the_retry_of_a_refused_step_is_a_setting_the_pipeline_gets():
    """remediation.retry_seconds (default 30) reaches the pipeline's options; 0 and over an hour are refused."""
    assert pipeline_options(load_config(None, env={}))["retry_seconds"] == 30.0
    config = load_config(None, env={"GPU_HEALTH_REMEDIATION__RETRY_SECONDS": "2"})
    assert pipeline_options(config)["retry_seconds"] == 2.0
    for bad in ("0", "3601"):
        with pytest.raises(ConfigError) as caught:
            load_config(None, env={"GPU_HEALTH_REMEDIATION__RETRY_SECONDS": bad})
        assert caught.value.field == "remediation.retry_seconds"
