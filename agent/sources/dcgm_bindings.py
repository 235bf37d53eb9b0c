"""Reads DCGM through its Python bindings (pydcgm, shipped with DCGM, not on PyPI): health watches
with their incidents, and the latest values of the fields the rules need."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from agent.model import GpuRef, Observation, Signal, frozen_attrs
from agent.sources.dcgm_exporter import DcgmTranslator, ScrapedGpu, is_blank

# DCGM field ids (dcgm_fields.h; ids are stable across the 4.6 renames) -> our reading names.
FIELD_IDS: dict[int, str] = {
    230: "xid", 150: "temp", 140: "mem_temp", 158: "slowdown_temp", 159: "shutdown_temp", 151: "mem_max_temp",
    155: "power", 164: "power_limit", 112: "clock_reasons", 310: "sbe_vol", 311: "dbe_vol", 390: "retired_sbe",
    391: "retired_dbe", 392: "retired_pending", 393: "remap_unc", 394: "remap_corr", 395: "remap_failure",
    396: "remap_pending", 1523: "recovery_action", 202: "pcie_replay", 409: "nvlink_crc_flit",
    419: "nvlink_crc_data", 429: "nvlink_replay", 439: "nvlink_recovery", 346: "sram_exceeded",
    1507: "memory_unrepairable",
}
# dcgm_field_entity_group_t (dcgm_fields.h): only a GPU entity's id is a GPU id.
ENTITY_GPU = 1
ENTITY_GROUPS = {0: "none", 1: "gpu", 2: "vgpu", 3: "switch", 4: "gpu_instance", 5: "compute_instance", 6: "link",
                 7: "cpu", 8: "cpu_core", 9: "connectx"}
# dcgmHealthSystems_t bits (dcgm_structs.h) -> names for messages.
HEALTH_SYSTEMS = {0x1: "pcie", 0x2: "nvlink", 0x4: "pmu", 0x8: "mcu", 0x10: "mem", 0x20: "sm", 0x40: "inforom",
                  0x80: "thermal", 0x100: "power", 0x200: "driver", 0x400: "nvswitch_nonfatal",
                  0x800: "nvswitch_fatal", 0x1000: "connectx"}
HEALTH_WATCH_ALL = 0xFFFFFFFF
BINDING_MODULES = ("pydcgm", "dcgm_structs", "dcgm_fields", "dcgm_agent")


def import_bindings() -> dict[str, ModuleType]:
    """DCGM's bindings, or ImportError naming the one that is missing."""
    return {name: importlib.import_module(name) for name in BINDING_MODULES}


class BindingsReader:
    """Connects to nv-hostengine (or starts DCGM embedded), sets the health watches, watches the fields."""

    def __init__(self, modules: dict[str, ModuleType], *, host: str = "", update_seconds: float = 10.0,
                 source: str = "dcgm") -> None:
        self.pydcgm: Any = modules["pydcgm"]
        self.structs: Any = modules["dcgm_structs"]
        self.host = host
        self.update_seconds = update_seconds
        self.translator = DcgmTranslator(source=source)
        self.gpus: dict[int, GpuRef] = {}
        self._handle: Any = None
        self._group: Any = None
        self._fields: Any = None

    def connect(self) -> None:
        mode = self.structs.DCGM_OPERATION_MODE_AUTO
        self._handle = self.pydcgm.DcgmHandle(ipAddress=self.host or None, opMode=mode)
        discovery = self._handle.GetSystem().discovery
        for index, gpu_id in enumerate(discovery.GetAllSupportedGpuIds()):
            ids = discovery.GetGpuAttributes(gpu_id).identifiers
            self.gpus[int(gpu_id)] = GpuRef(index, _text(ids.uuid), _text(ids.pciBusId).lower(),
                                            _text(ids.deviceName))
        self._group = self.pydcgm.DcgmGroup(self._handle, groupName="gpu-health-agent",
                                            groupType=self.structs.DCGM_GROUP_DEFAULT)
        self._group.health.Set(HEALTH_WATCH_ALL)
        self._fields = self.pydcgm.DcgmFieldGroup(self._handle, name="gpu-health-agent", fieldIds=list(FIELD_IDS))
        update_us = int(self.update_seconds * 1_000_000)
        self._group.samples.WatchFields(self._fields, update_us, 3600.0, 0)

    def read(self, now: float) -> list[Observation]:
        """Latest field values and the health check; DCGM down gives Unknown, never a GPU fault."""
        try:
            if self._handle is None:
                self.connect()
            latest = self._group.samples.GetLatest(self._fields).values
            health = self._group.health.Check()
        except Exception as exc:  # noqa: BLE001 - any bindings failure means: DCGM cannot be read now
            self._handle = None
            return self.translator.unreadable(now, f"DCGM: {exc}")
        out: list[Observation] = []
        for gpu_id, ref in self.gpus.items():
            scraped = ScrapedGpu(ref)
            for field_id, samples in dict(latest.get(gpu_id, {})).items():
                key = FIELD_IDS.get(int(field_id))
                sample = samples[-1] if samples else None
                if key is None or sample is None or getattr(sample, "isBlank", False):
                    continue
                value = float(sample.value)
                if is_blank(value):
                    continue
                scraped.values[key] = value
                if key == "xid":
                    scraped.xid_labels = {"ts": str(getattr(sample, "ts", ""))}
            out.extend(self.translator.observations(scraped, now))
        out.extend(self._incidents(health, now))
        return out

    def _incidents(self, health: Any, now: float) -> list[Observation]:
        """The worst incident per GPU, and the worst of every other entity (NVSwitch, link, MIG instance, CPU,
        ConnectX) as one node-level reading: an incident is charged to a GPU only when its entity is a GPU."""
        worst: dict[int, tuple[int, str]] = {}
        elsewhere: tuple[int, str, str, int] = (0, "pass", "", -1)
        for position in range(int(getattr(health, "incidentCount", 0))):
            incident = health.incidents[position]
            entity = incident.entityInfo
            group_id = getattr(entity, "entityGroupId", None)
            entity_id = int(entity.entityId)
            system = HEALTH_SYSTEMS.get(int(incident.system), str(incident.system))
            message = f"{system}: {_text(incident.error.msg)} (code {int(incident.error.code)})"
            level = int(incident.health)
            if group_id is not None and int(group_id) == ENTITY_GPU:
                if level > worst.get(entity_id, (-1, ""))[0]:
                    worst[entity_id] = (level, message)
            elif level > elsewhere[0]:
                group = ENTITY_GROUPS.get(int(group_id), str(group_id)) if group_id is not None else "unknown"
                elsewhere = (level, f"{group} {entity_id}: {message}", group, entity_id)
        out = []
        for gpu_id, ref in self.gpus.items():
            level, message = worst.get(gpu_id, (0, "pass"))
            out.append(Observation(Signal.DCGM_HEALTH, level, now, self.translator.source, ref,
                                   frozen_attrs({"message": message, "entity_group": "gpu"})))
        level, message, group, entity_id = elsewhere
        attrs: dict[str, str | int] = {"message": message}
        if group:
            attrs.update(entity_group=group, entity_id=entity_id)
        out.append(Observation(Signal.DCGM_HEALTH, level, now, self.translator.source, None, frozen_attrs(attrs)))
        return out


def _text(value: Any) -> str:
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)
