"""How many GPUs the node should have at a first boot, beside what NVML enumerates: the NVIDIA GPUs on the PCI
bus (sysfs) and GPU Feature Discovery's `nvidia.com/gpu.count` label on the Node."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from agent.logs import get_logger
from agent.model import normalise_pci

log = get_logger("agent.sources.expected_gpus")

#: GPU Feature Discovery's label: the number of GPUs it enumerated on the node.
GPU_COUNT_LABEL = "nvidia.com/gpu.count"
PCI_DEVICES = Path("/sys/bus/pci/devices")
NVIDIA_VENDOR = "0x10de"
#: PCI classes of a GPU: a VGA controller (0x0300xx) or a 3D controller (0x0302xx); an NVSwitch is a bridge
#: (0x0680xx) and its audio function 0x0403xx: neither is a GPU.
GPU_CLASSES = ("0x0300", "0x0302")
#: The drivers a GPU of this node's NVML may be bound to: nvidia, or none (its probe failed). A GPU bound to
#: another driver (vfio-pci: passed through to a VM) is not this node's NVML's to enumerate.
NVML_DRIVERS = frozenset({"nvidia", ""})
NVSWITCH_CLASS = "0x0680"


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="ascii").strip().lower()
    except (OSError, UnicodeDecodeError):
        return ""


def pci_gpus(devices: Path = PCI_DEVICES) -> list[str]:
    """The normalised PCI addresses of the NVIDIA GPUs on the bus that NVML should enumerate (bound to nvidia,
    or to no driver); empty (one warning) where sysfs cannot be read."""
    try:
        entries = sorted(os.listdir(devices))
    except OSError as exc:
        log.warning("pci_devices_unreadable", path=str(devices), error=str(exc))
        return []
    found = []
    for name in entries:
        device = devices / name
        if _read(device / "vendor") != NVIDIA_VENDOR or not _read(device / "class").startswith(GPU_CLASSES):
            continue
        try:
            driver = os.path.basename(os.readlink(device / "driver"))
        except OSError:
            driver = ""
        if driver in NVML_DRIVERS:
            found.append(normalise_pci(name))
    return found


def nvswitches(devices: Path = PCI_DEVICES) -> int:
    """How many NVIDIA NVSwitches (bridge class 0x0680) the host's PCI bus holds: an HGX baseboard's, whose fabric
    the host's Fabric Manager configures (0 where sysfs cannot be read)."""
    try:
        entries = os.listdir(devices)
    except OSError:
        return 0
    return sum(1 for name in entries if _read(devices / name / "vendor") == NVIDIA_VENDOR
               and _read(devices / name / "class").startswith(NVSWITCH_CLASS))


def labelled_count(labels: Mapping[str, str]) -> int | None:
    """GFD's GPU count for the node, None where the label is absent or not a count."""
    value = str(labels.get(GPU_COUNT_LABEL) or "").strip()
    return int(value) if value.isdigit() else None


@dataclass(frozen=True, slots=True)
class Shortfall:
    """What a first boot lacks: GPUs on the PCI bus NVML does not enumerate (by address), and how many more the
    node's label expects than NVML, the bus and the remembered inventory account for."""

    on_bus: tuple[str, ...] = ()
    unnamed: int = 0
    expected: int | None = None


def shortfall(*, enumerated: Iterable[str], enumerated_count: int, on_bus: Iterable[str],
              remembered_missing: Sequence[str], expected: int | None) -> Shortfall:
    """The GPUs missing beside those NVML enumerates (`enumerated`: their PCI addresses, `enumerated_count`: how
    many it found, named or not) and those the remembered inventory knows missing (their PCI addresses)."""
    seen = {normalise_pci(pci) for pci in enumerated if pci}
    known = {normalise_pci(pci) for pci in remembered_missing if pci}
    absent = tuple(pci for pci in dict.fromkeys(on_bus) if pci not in seen and pci not in known)
    accounted = enumerated_count + len(absent) + len(remembered_missing)
    unnamed = max(0, expected - accounted) if expected is not None else 0
    return Shortfall(absent, unnamed, expected)
