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


def _refusal(path: Path, text: str) -> str:
    """The one line load_config refuses this file with."""
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_config(path, env={})
    return caught.value.line()


def test_an_unknown_key_names_file_and_field(tmp_path: Path):
    path = tmp_path / "c.yaml"
    assert _refusal(path, "remediation: {tiant_key: x}\n") == f"{path}: field remediation.tiant_key: unknown key"


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


def test_a_bare_on_or_off_is_read_as_the_word(tmp_path: Path):
    """YAML reads `enabled: on` as a boolean; the source's toggle takes it as the word meant, file and env alike."""
    path = tmp_path / "c.yaml"
    path.write_text("sources: {kmsg: {enabled: on}, nvml: {enabled: off}}\n")
    config = load_config(path, env={"GPU_HEALTH_SOURCES__DCGM__ENABLED": "off"})
    assert (config.sources.kmsg.enabled, config.sources.nvml.enabled, config.sources.dcgm.enabled) == \
        ("on", "off", "off")


def test_a_validator_names_the_field_it_refuses():
    """A reset command other than nvidia-smi's is refused at remediation.reset_command, not at its section."""
    with pytest.raises(ConfigError) as caught:
        load_config(None, env={"GPU_HEALTH_REMEDIATION__RESET_COMMAND": "[rm, -rf, /]"})
    assert (caught.value.file, caught.value.field) == ("environment GPU_HEALTH_REMEDIATION__RESET_COMMAND",
                                                       "remediation.reset_command")
    assert "nvidia-smi --gpu-reset -i {uuid}" in caught.value.message


def test_a_constraint_names_the_field_and_the_bound(tmp_path: Path):
    """A value outside its bound is one line naming the file, the field and the bound."""
    path = tmp_path / "c.yaml"
    assert _refusal(path, "http: {port: 70000}\n") == f"{path}: field http.port: Expected `int` <= 65535"


def test_a_loaded_configuration_cannot_be_changed():
    """The configuration is frozen: a component cannot change what the others read."""
    config = load_config(None, env={"NODE_NAME": "n1"})
    with pytest.raises(AttributeError):
        config.remediation.cordon = True  # type: ignore[misc]
