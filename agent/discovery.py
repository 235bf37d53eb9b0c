"""Which sources this machine can run, per the config: each source's factory and why one cannot run."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from agent.config import Config
from agent.drill import DrillBox, drills_dir
from agent.errors import AgentError
from agent.journal import Journal
from agent.sources.base import Source
from agent.sources.kmsg import KmsgSource

#: What the NVML source remembers across restarts and reboots, in the state directory.
NVML_MEMORY_FILE = "nvml-memory.json"


@dataclass(frozen=True, slots=True)
class SourceProbe:
    """Whether a source can run here, and why not when it cannot."""

    name: str
    source: Source | None
    why_not: str = ""


@dataclass(frozen=True, slots=True)
class SourceContext:
    """What a source factory may use: the config, the journal (for cursors), a counter hook."""

    config: Config
    journal: Journal
    count: Callable[[str, str, int], None]
    #: pod UID -> workload for the pods on this node (empty without a cluster).
    owners: Callable[[], Mapping[str, str]] = dict
    #: The labels of this node's Node as last seen (empty without a cluster, or before the first read).
    node_labels: Callable[[], Mapping[str, str]] = dict


#: What gives the kernel log to the agent's container, where its errno says nothing more particular.
_KMSG_HINT = "the agent needs CAP_SYSLOG and the device in its container"


def _kmsg_hint(error: int) -> str:
    """Why the kernel log cannot be opened, by errno, and what gives it to the agent's container."""
    from agent.kmsgdevice.plugin import RESOURCE  # noqa: PLC0415 - the device plugin's module only for this hint

    hints = {
        errno.EPERM: "the device is not allowed in this container's device cgroup: request the "
                     f"{RESOURCE} resource (the gpu-health-kmsg-device DaemonSet's device plugin) or give the "
                     "container /dev/kmsg another way (CDI, a privileged container)",
        errno.EACCES: "reading the kernel log needs CAP_SYSLOG (securityContext.capabilities.add: [SYSLOG])",
        errno.ENOENT: f"no such device in this container: request the {RESOURCE} resource",
    }
    return hints.get(error, _KMSG_HINT)


DISABLED_IN_CONFIG = "disabled in config"
#: Sources whose absence is logged as a warning even when auto-detected: the primary Xid source.
LOUD_WHEN_MISSING = frozenset({"kmsg"})


def _kmsg_factory(ctx: SourceContext) -> tuple[Source | None, str]:
    settings = ctx.config.sources.kmsg
    path = Path(settings.path)
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK))
    except OSError as exc:
        return None, f"cannot open {path}: {exc.strerror} ({_kmsg_hint(exc.errno or 0)})"
    source = KmsgSource(path=path, admit_user_records=settings.admit_user_records, cursor=ctx.journal,
                        proc_root=Path(settings.proc_root), owners=ctx.owners,
                        drills=DrillBox(drills_dir(ctx.config.journal_path)), node_name=ctx.config.node_name,
                        count=lambda name, amount: ctx.count("kmsg", name, amount))
    return source, ""


def _nvml_factory(ctx: SourceContext) -> tuple[Source | None, str]:
    # Each source's modules are imported only where it is asked for (an idle kernel-log agent loads none of them).
    from agent.sources.expected_gpus import PCI_DEVICES  # noqa: PLC0415
    from agent.sources.fabric_manager import FabricManagerWatch  # noqa: PLC0415
    from agent.sources.node_memory import JsonFileMemory  # noqa: PLC0415
    from agent.sources.nvml import NvmlSource, load_pynvml  # noqa: PLC0415

    settings = ctx.config.sources.nvml
    try:
        nvml = load_pynvml()
    except ImportError as exc:
        return None, f"pynvml is not installed ({exc})"
    probe = NvmlSource(nvml, call_timeout_seconds=settings.call_timeout_seconds)
    try:
        probe.start()
    except Exception as exc:  # noqa: BLE001 - isolation: one failure must not stop the rest
        probe.caller.close()
        return None, f"NVML unavailable: {exc}"
    probe.stop()
    # The node's GPUs and the NVLinks seen up, kept beside the journal: after a reboot a GPU the node had is
    # known to be missing, and a link down is judged against the links it had.
    memory = JsonFileMemory(Path(ctx.config.journal_path).parent / NVML_MEMORY_FILE)
    # A first boot has no remembered GPUs: the PCI bus and GFD's gpu.count label say how many there should be.
    # Fabric Manager is the host's process, seen in the host's /proc (the one the kernel-log source reads).
    return NvmlSource(nvml, poll_seconds=settings.poll_seconds, memory=memory,
                      call_timeout_seconds=settings.call_timeout_seconds, pci_devices=PCI_DEVICES,
                      node_labels=ctx.node_labels,
                      fabric_manager=FabricManagerWatch(Path(ctx.config.sources.kmsg.proc_root))), ""


def _dcgm_factory(ctx: SourceContext) -> tuple[Source | None, str]:
    from agent.sources.dcgm import DcgmSource  # noqa: PLC0415
    from agent.sources.dcgm_bindings import BindingsReader, import_bindings  # noqa: PLC0415
    from agent.sources.dcgm_exporter import ExporterReader  # noqa: PLC0415

    settings = ctx.config.sources.dcgm
    if settings.exporter_url:
        reader: ExporterReader | BindingsReader = ExporterReader(settings.exporter_url,
                                                                 timeout_seconds=settings.timeout_seconds)
        return DcgmSource(reader, poll_seconds=settings.poll_seconds,
                          timeout_seconds=settings.timeout_seconds * 2), ""
    try:
        modules = import_bindings()
    except ImportError as exc:
        return None, f"no DCGM bindings ({exc}) and no sources.dcgm.exporter_url"
    reader = BindingsReader(modules, host=settings.hostengine, update_seconds=settings.poll_seconds)
    return DcgmSource(reader, poll_seconds=settings.poll_seconds, timeout_seconds=settings.timeout_seconds), ""


SourceFactory = Callable[[SourceContext], tuple[Source | None, str]]
SOURCE_FACTORIES: dict[str, SourceFactory] = {"kmsg": _kmsg_factory, "nvml": _nvml_factory, "dcgm": _dcgm_factory}


def discover_sources(ctx: SourceContext) -> list[SourceProbe]:
    """Every source this machine can run, per the config (auto-detected unless forced on or off)."""
    probes: list[SourceProbe] = []
    for name in ctx.config.sources.__struct_fields__:
        toggle = getattr(ctx.config.sources, name).enabled
        factory = SOURCE_FACTORIES.get(name)
        if toggle == "off":
            probes.append(SourceProbe(name, None, DISABLED_IN_CONFIG))
            continue
        if factory is None:
            why_not = "not available in this version of the agent"
            if toggle == "on":
                raise AgentError(f"source {name} is enabled in config but {why_not}")
            probes.append(SourceProbe(name, None, why_not))
            continue
        source, why_not = factory(ctx)
        if source is None and toggle == "on":
            raise AgentError(f"source {name} is enabled in config but cannot run: {why_not}")
        probes.append(SourceProbe(name, source, why_not))
    return probes
