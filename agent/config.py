"""The agent's configuration: one YAML file plus GPU_HEALTH_* environment overrides, validated strictly."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, TypedDict

import msgspec
import yaml
from msgspec import Meta

from agent.errors import ConfigError
from agent.fleet.summary import RACK_LABEL, ZONE_LABEL
from agent.remediation.guard import Mode
from agent.remediation.planner import INCIDENT_SETTLE_SECONDS
from agent.strict import FieldProblem, RecordInvalid, Strict, convert
from agent.yamlload import safe_load

ENV_PREFIX = "GPU_HEALTH_"


#: A source's `enabled`: YAML reads a bare on/off as a boolean, taken as the word that was meant (`_toggles`).
Toggle = Literal["auto", "on", "off"]
Positive = Annotated[float, Meta(gt=0)]
NonNegative = Annotated[float, Meta(ge=0)]


def _toggle(value: Any) -> Any:
    """YAML reads a bare on/off as a boolean; take it as the word that was meant."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return value


def _toggles(data: dict[str, Any]) -> dict[str, Any]:
    """`data` with each source's `enabled` read by `_toggle` (the one field of type Toggle)."""
    sources = data.get("sources")
    if not isinstance(sources, dict):
        return data
    fixed = {name: {**section, "enabled": _toggle(section["enabled"])}
             if isinstance(section, dict) and "enabled" in section else section for name, section in sources.items()}
    return {**data, "sources": fixed}


class KmsgConfig(Strict, frozen=True, kw_only=True):
    enabled: Toggle = "auto"
    path: str = "/dev/kmsg"
    admit_user_records: bool = False
    #: Where /proc/<pid>/cgroup is read to charge an Xid to its pod (the DaemonSet mounts the host's /proc
    #: read-only at /host/proc instead of joining the host PID namespace).
    proc_root: str = "/proc"


class NvmlConfig(Strict, frozen=True, kw_only=True):
    enabled: Toggle = "auto"
    poll_seconds: Positive = 10.0
    call_timeout_seconds: Positive = 2.0


class DcgmConfig(Strict, frozen=True, kw_only=True):
    enabled: Toggle = "auto"
    exporter_url: str = ""
    hostengine: str = ""
    poll_seconds: Positive = 30.0
    timeout_seconds: Positive = 5.0


class SourcesConfig(Strict, frozen=True, kw_only=True):
    kmsg: KmsgConfig = msgspec.field(default_factory=KmsgConfig)
    nvml: NvmlConfig = msgspec.field(default_factory=NvmlConfig)
    dcgm: DcgmConfig = msgspec.field(default_factory=DcgmConfig)


#: The only reset commands there are (nvidia-smi from the NVIDIA container runtime, `{uuid}` the GPU's UUID,
#: checked against the driver's table): a reset runs with CAP_SYS_ADMIN, so its argv is not the config's to choose.
RESET_COMMANDS: tuple[tuple[str, ...], ...] = (
    ("nvidia-smi", "--gpu-reset", "-i", "{uuid}"),
    ("nvidia-smi", "-r", "-i", "{uuid}"),
)


class RemediationConfig(Strict, frozen=True, kw_only=True):
    taint_key: Annotated[str, Meta(pattern=r"^([a-z0-9.\-]+/)?[A-Za-z0-9._\-]+$")] = "gpu-health-agent.io/unhealthy"
    taint_effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] = "NoSchedule"
    cordon: bool = False
    opt_out_label: str = "gpu-health-agent.io/opt-out"
    max_attempts_per_hour: Annotated[int, Meta(ge=1)] = 3
    cooldown_seconds: NonNegative = 300.0
    budget_max_nodes: Annotated[int, Meta(ge=0)] = 1
    budget_max_percent: Annotated[float, Meta(ge=0, le=100)] = 10.0
    #: The rate bound beside the concurrency bound: at most this many nodes newly disrupted within an hour,
    #: cluster-wide (0: off); docs/remediation.md argues the default.
    budget_max_nodes_per_hour: Annotated[int, Meta(ge=0)] = 3
    eviction_deadline_seconds: Positive = 600.0
    #: How long a disruptive step the cluster refused (an eviction a PodDisruptionBudget holds, the budget's
    #: slot taken, the gate closed) waits before it is tried again (jittered up to 25 % more); also the cap of
    #: the failed-pass back-off. At most an hour: a refused eviction must be asked again before its deadline.
    retry_seconds: Annotated[float, Meta(gt=0, le=3600)] = 30.0
    #: One of RESET_COMMANDS only: the reset container runs it as root with CAP_SYS_ADMIN, so no other argv.
    reset_command: list[str] = msgspec.field(default_factory=lambda: list(RESET_COMMANDS[0]))
    reset_timeout_seconds: Positive = 120.0
    reset_settle_seconds: NonNegative = 10.0
    #: Faults of one GPU raised within this long of each other are judged as one incident before anything is
    #: evicted: a contained incident (Xid 94, recovery action drain-and-reset) that follows its own DBE, Xid 48
    #: or Xid 64 within it governs them (nobody evicted, reset once idle). docs/remediation.md argues the value.
    incident_settle_seconds: Annotated[float, Meta(ge=0, le=10)] = INCIDENT_SETTLE_SECONDS
    #: The reset container's socket (daemonset/): the privileged part of a reset runs there. Empty: in the
    #: agent's own process (which then needs the privileges itself; docs/remediation.md).
    reset_helper_socket: str = ""
    #: The GPU Operator's per-node operand labels paused for a reset (the operands that hold the GPUs open:
    #: with the device plugin, or in DRA mode (Operator 26.x) the DRA driver's kubelet plugin, which selects
    #: nvidia.com/gpu.deploy.dra-driver), and mig-manager's: paused, it changes no MIG layout under the reset;
    #: back, it applies the node's MIG configuration (nvidia.com/mig.config) again, re-creating the instances
    #: the reset destroyed. A label a node does not carry `true` is left alone.
    reset_operand_labels: list[str] = msgspec.field(default_factory=lambda: [
        "nvidia.com/gpu.deploy.device-plugin", "nvidia.com/gpu.deploy.gpu-feature-discovery",
        "nvidia.com/gpu.deploy.dcgm-exporter", "nvidia.com/gpu.deploy.dcgm", "nvidia.com/gpu.deploy.mig-manager",
        "nvidia.com/gpu.deploy.dra-driver"])
    reset_operand_wait_seconds: Positive = 120.0
    #: How long the GPU's device file may stay held (pods terminating) before the reset gives up, naming who.
    reset_holder_wait_seconds: NonNegative = 30.0
    #: Where the holders are looked for (failing closed) and the driver's GPU table read. The shipped reset
    #: container keeps its own /proc (no host /proc, no CAP_SYS_PTRACE): the driver's refusal is the check there.
    reset_proc_root: str = "/proc"
    #: Process names not waited for: the driver coordinates a reset with its persistence daemon.
    reset_ignored_holders: list[str] = msgspec.field(default_factory=lambda: ["nvidia-persistenced"])
    reboot_sentinel_path: str = ""
    max_faulty_gpus: Annotated[int, Meta(ge=0)] = 2
    replace_after_recoveries: Annotated[int, Meta(ge=1)] = 2
    recovery_window_days: Annotated[float, Meta(gt=0, le=3650)] = 30.0
    reset_verify_seconds: Positive = 300.0
    #: e.g. ["dcgmi", "diag", "--host", "{hostengine}", "-r", "2", "-i", "{uuid}"]; empty: no diagnostic, and the
    #: repeat patterns that only a diagnostic could decide are reported instead of quarantining.
    diagnostic_command: list[str] = msgspec.field(default_factory=list)
    diagnostic_timeout_seconds: Annotated[float, Meta(gt=0, le=7200)] = 900.0
    namespace: str = "gpu-health"
    gpu_node_selector: str = "nvidia.com/gpu.present=true"
    pod_resources_socket: str = "/var/lib/kubelet/pod-resources/kubelet.sock"
    node_sync_seconds: Positive = 30.0
    # A watch of the agent's own Node feeds each pass (re-opened after this many seconds plus up to as many
    # again); 0: no watch, a GET of the Node every pass (docs/fleet.md "API cost per agent").
    node_watch_seconds: NonNegative = 1800.0
    kubeconfig: str = ""
    api_connect_timeout_seconds: Positive = 3.0
    api_read_timeout_seconds: Positive = 10.0
    # node: taint the node; device: a DeviceTaintRule per faulty GPU (resource.k8s.io); auto: device where served.
    isolation: Literal["node", "device", "auto"] = "auto"
    # The device taint where the node would be tainted; NoExecute (deletes pods, no PDB) only as an opt-in.
    device_taint_effect: Literal["NoSchedule", "NoExecute"] = "NoSchedule"
    # A degraded-but-usable GPU gets a `None`-effect DeviceTaintRule (visibility only, nothing moves).
    device_taint_degraded: bool = False
    #: Read the fleet controller's holds (ConfigMap gpu-health-fleet-holds in `namespace`) and publish the
    #: node's fleet summary (docs/fleet.md).
    fleet_holds: bool = True
    #: The Node labels naming the node's rack and zone, as the fleet controller groups by them (its
    #: --rack-label/--zone-label): a hold scoped to a rack or a zone covers this node when its label says so.
    rack_label: str = RACK_LABEL
    zone_label: str = ZONE_LABEL
    #: Where a fleet controller publishes holds, a node not yet quarantined waits this long after a holdable
    #: fault (application, driver, interconnect, telemetry; never hardware) before acting on it, so the
    #: controller sees its summary and a fleet-wide cause is held before any node acts (docs/fleet.md).
    fleet_settle_seconds: Annotated[float, Meta(ge=0, le=120)] = 10.0
    #: Past the settle, while the fleet controller is alive and has not yet heard of the fault (it publishes
    #: what it heard with the holds), the node waits on for its word, until this long after it first saw it.
    fleet_settle_max_seconds: Annotated[float, Meta(ge=0, le=600)] = 60.0
    #: The quarantine brake: at most this share of the GPU nodes (never fewer than min, never more than max)
    #: newly quarantined within the window; a window of 0 turns it off (docs/fleet.md argues the defaults).
    brake_max_share: Annotated[float, Meta(ge=0, le=1)] = 0.15
    brake_min_nodes: Annotated[int, Meta(ge=1)] = 2
    brake_max_nodes: Annotated[int, Meta(ge=1)] = 200
    brake_window_seconds: NonNegative = 600.0

    #: The AcceleratedHardwareReady condition (False while a fault needs the node rebooted or replaced) for
    #: node-repair tools: Karpenter's node repair, MachineHealthCheck, medik8s NHC (docs/operations.md).
    accelerated_hardware_condition: bool = False

    def __post_init__(self) -> None:
        if tuple(self.reset_command) not in RESET_COMMANDS:
            allowed = " or ".join(repr(" ".join(c)) for c in RESET_COMMANDS)
            raise FieldProblem("reset_command",
                               f"must be {allowed}: the reset runs with CAP_SYS_ADMIN, so no other command")


class HttpConfig(Strict, frozen=True, kw_only=True):
    host: str = "0.0.0.0"  # noqa: S104 - the metrics endpoint is scraped from outside the pod
    port: Annotated[int, Meta(ge=0, le=65535)] = 9402
    #: A connection that sends nothing (or stops halfway) for this long is closed.
    timeout_seconds: Positive = 10.0
    #: Connections served at once (a thread each); one more is answered 503 and closed.
    max_connections: Annotated[int, Meta(ge=1, le=1024)] = 16


class LogConfig(Strict, frozen=True, kw_only=True):
    level: Literal["debug", "info", "warning", "error"] = "info"
    format: Literal["auto", "json", "console"] = "auto"


class Config(Strict, frozen=True, kw_only=True):
    """Everything the agent can be told; unknown keys are errors."""

    node_name: str = ""
    mode: Mode = Mode.QUARANTINE
    dry_run: bool = False
    rules_dir: str = ""
    journal_path: str = "/var/lib/gpu-health-agent/journal.db"
    tick_seconds: Positive = 1.0
    sources: SourcesConfig = msgspec.field(default_factory=SourcesConfig)
    remediation: RemediationConfig = msgspec.field(default_factory=RemediationConfig)
    http: HttpConfig = msgspec.field(default_factory=HttpConfig)
    log: LogConfig = msgspec.field(default_factory=LogConfig)

    def __post_init__(self) -> None:
        if any("{hostengine}" in part for part in self.remediation.diagnostic_command) and \
                not self.sources.dcgm.hostengine:
            raise ValueError("remediation.diagnostic_command names {hostengine} but sources.dcgm.hostengine is empty")


def diagnostic_mode_problem(config: Config) -> str:
    """Why a configured diagnostic can never run in the configured mode ("" when it can): only `remediate` runs
    one (a disruptive step), and with one configured the Xid 13/31 repeat patterns quarantine to wait for it, so
    in `observe` or `quarantine` they would wait for an operator for ever."""
    if not config.remediation.diagnostic_command or config.mode is Mode.REMEDIATE:
        return ""
    return (f"remediation.diagnostic_command is set but mode {config.mode} never runs a diagnostic (only remediate "
            "does): the repeat patterns would quarantine and wait for it for ever; set mode remediate, or leave "
            "diagnostic_command empty (the patterns are then reported, not quarantined)")


class PipelineOptions(TypedDict):
    """The pipeline's remediation settings, as the configuration gives them (the daemon's and `simulate`'s)."""

    max_faulty_gpus: int
    replace_after_recoveries: int
    reset_settle_seconds: float
    incident_settle_seconds: float
    reset_verify_seconds: float
    recovery_window_days: float
    diagnose: bool
    repair_condition: bool
    sync_seconds: float
    retry_seconds: float


def pipeline_options(config: Config) -> PipelineOptions:
    settings = config.remediation
    return PipelineOptions(
        max_faulty_gpus=settings.max_faulty_gpus, replace_after_recoveries=settings.replace_after_recoveries,
        reset_settle_seconds=settings.reset_settle_seconds, reset_verify_seconds=settings.reset_verify_seconds,
        incident_settle_seconds=settings.incident_settle_seconds,
        recovery_window_days=settings.recovery_window_days, diagnose=bool(settings.diagnostic_command),
        repair_condition=settings.accelerated_hardware_condition, sync_seconds=settings.node_sync_seconds,
        retry_seconds=settings.retry_seconds)


def load_config(path: Path | None = None, env: Mapping[str, str] | None = None, *,
                mode: Mode | None = None) -> Config:
    """Read the file (if any), apply GPU_HEALTH_* overrides and `mode` (a command's --mode), validate; raise
    ConfigError on any problem."""
    environment = os.environ if env is None else env
    data: dict[str, Any] = _read_file(path) if path is not None else {}
    origin: dict[str, str] = {}
    for name, raw in sorted(environment.items()):
        if not name.startswith(ENV_PREFIX):
            continue
        keys = [part.lower() for part in name[len(ENV_PREFIX):].split("__")]
        _set_nested(data, keys, _parse_scalar(raw))
        origin[".".join(keys)] = f"environment {name}"
    if mode is not None:
        data["mode"] = str(mode)
        origin["mode"] = "--mode"
    if not data.get("node_name"):
        data["node_name"] = environment.get("NODE_NAME") or socket.gethostname()
    try:
        config = parse_config(data)
    except RecordInvalid as exc:
        where = origin.get(exc.field) or (str(path) if path else "<defaults>")
        raise ConfigError(exc.reason, file=where, field=exc.field) from None
    problem = diagnostic_mode_problem(config)
    if problem:
        raise ConfigError(problem, file=origin.get("mode") or (str(path) if path else "<defaults>"), field="mode")
    return config


def parse_config(data: dict[str, Any]) -> Config:
    """The configuration these keys give (a file's, as YAML read it); raise RecordInvalid naming the first bad field."""
    return convert(_toggles(data), Config)


def _read_file(path: Path) -> dict[str, Any]:
    try:
        data = safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read: {exc.strerror}", file=str(path)) from None
    except UnicodeDecodeError:
        raise ConfigError("not UTF-8 text (a binary file?)", file=str(path)) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"not valid YAML{where}", file=str(path)) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError("expected a mapping at the top level", file=str(path))
    return data


def _set_nested(data: dict[str, Any], keys: list[str], value: Any) -> None:
    node = data
    for key in keys[:-1]:
        child = node.get(key)
        if not isinstance(child, dict):
            child = {}
            node[key] = child
        node = child
    node[keys[-1]] = value


def _parse_scalar(raw: str) -> Any:
    try:
        return safe_load(raw) if raw.strip() else raw
    except yaml.YAMLError:
        return raw


def config_as_yaml(config: Config) -> str:
    return yaml.safe_dump(msgspec.to_builtins(config), sort_keys=False)
