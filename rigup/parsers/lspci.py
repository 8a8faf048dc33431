"""Parser for lspci -Dnn: the NVIDIA display devices, known before any driver is loaded."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from rigup.parsers.common import JsonDataclass, ParseError, split_lines
from rigup.parsers.gpu_models import known_gpu
from rigup.parsers.nvidia_smi import Gpu, normalize_bus_id


@dataclass(frozen=True)
class PciDevice(JsonDataclass):
    bus_id: str  # "0000:01:00.0"
    class_code: str  # "0300" VGA, "0302" 3D controller
    vendor_id: str  # "10de"
    device_id: str  # "2204"
    description: str  # lspci's text, e.g. "NVIDIA Corporation GA102 [GeForce RTX 3090]"
    driver_in_use: str | None  # "nvidia", "nouveau", "vfio-pci" or None (-k lines)


_LSPCI_LINE = re.compile(
    r"^(?P<bus>(?:[0-9a-fA-F]{4}:)?[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7])\s+"
    r"(?P<cls_name>.+?)\s+\[(?P<cls>[0-9a-fA-F]{4})\]:\s+"
    r"(?P<desc>.*?)\s+\[(?P<vendor>[0-9a-fA-F]{4}):(?P<device>[0-9a-fA-F]{4})\]"
    r"(?:\s+\(rev [0-9a-fA-F]+\))?(?:\s+\(prog-if .*\))?\s*$"
)


def parse_lspci(output: str | Iterable[str]) -> tuple[PciDevice, ...]:
    """Parse `lspci -Dnnk` (or `lspci -Dnn`): every device line, with its kernel driver if shown."""
    devices: list[dict[str, Any]] = []
    for line in split_lines(output):
        if not line.strip():
            continue
        if line[0] in " \t":
            if devices and line.strip().startswith("Kernel driver in use:"):
                devices[-1]["driver_in_use"] = line.split(":", 1)[1].strip()
            continue
        match = _LSPCI_LINE.match(line.strip())
        if match is None:
            raise ParseError(f"not an lspci -nn device line: {line!r}")
        devices.append(
            {
                "bus_id": normalize_bus_id(match.group("bus")),
                "class_code": match.group("cls").lower(),
                "vendor_id": match.group("vendor").lower(),
                "device_id": match.group("device").lower(),
                "description": match.group("desc"),
                "driver_in_use": None,
            }
        )
    return tuple(PciDevice(**d) for d in devices)


NVIDIA_VENDOR_ID = "10de"
DISPLAY_CLASSES = ("0300", "0302")  # VGA compatible controller, 3D controller


def gpus_from_pci(devices: Iterable[PciDevice]) -> tuple[Gpu, ...]:
    """NVIDIA display devices as Gpu records; name, compute capability and VRAM from KNOWN_GPUS."""
    out: list[Gpu] = []
    nvidia = [d for d in devices if d.vendor_id == NVIDIA_VENDOR_ID and d.class_code in DISPLAY_CLASSES]
    for index, dev in enumerate(sorted(nvidia, key=lambda d: d.bus_id)):
        known = known_gpu(device_id=dev.device_id)
        bracket = re.findall(r"\[([^\]]+)\]", dev.description)
        name = known.name if known else (f"NVIDIA {bracket[-1]}" if bracket else dev.description)
        out.append(
            Gpu(
                index=index,
                name=name,
                uuid=None,
                driver_version=None,
                memory_mib=known.memory_mib if known else None,
                compute_capability=known.compute_capability if known else None,
                bus_id=dev.bus_id,
                power_limit_w=None,
                power_max_w=None,
                persistence=None,
                source="lspci",
            )
        )
    return tuple(out)


def visible_gpus(smi: Any, pci: Iterable[PciDevice] | None) -> tuple[Gpu, ...]:
    """GPUs from nvidia-smi when the driver answers (an ok SmiQuery), else from lspci (fresh box, mismatch)."""
    if smi is not None and smi.status == "ok":
        return smi.gpus
    return gpus_from_pci(pci or ())
