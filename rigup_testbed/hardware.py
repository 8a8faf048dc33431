"""Simulated GPU hardware of a test-bed host: the schema of /etc/rigup-testbed/hardware.json.

The test bed writes this file into every host's root; the stand-in packages (nvidia-smi, mokutil, ...)
read it to answer like the real tools would on that machine. rigup itself never reads it.

Schema (version 1), all keys always present:

.. code:: json

    {
      "schema": 1,
      "preset": "2x3090",
      "driver_cuda": null,            # "CUDA Version" override; null: what the installed branch reports (550: 12.4, 580: 13.0)
      "secure_boot": false,           # what mokutil --sb-state says
      "topology": "PIX",              # link between GPU0 and GPU1 (nvidia-smi topo -m); null for 1 GPU
      "gpus": [
        {
          "index": 0,
          "name": "NVIDIA GeForce RTX 3090",
          "architecture": "Ampere",
          "uuid": "GPU-1b6f0d3e-...",   # stable per host name and index
          "pci_bus_id": "00000000:01:00.0",
          "memory_total_mib": 24576,
          "memory_used_mib": 1,
          "compute_cap": "8.6",
          "power_limit_w": 350,       # current limit (stand-in nvidia-smi -pl changes its own state)
          "power_default_w": 350,
          "power_min_w": 100,
          "power_max_w": 400
        }
      ]
    }
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

SCHEMA_VERSION = 1
PATH_IN_HOST = "/etc/rigup-testbed/hardware.json"
TOPOLOGIES = ("PIX", "PXB", "PHB", "NODE", "SYS", "NV1", "NV2", "NV3", "NV4")

# uuid5 namespace for stable, host-specific GPU UUIDs.
_UUID_NS = uuid.UUID("5a0d7c1e-3b0e-4d6a-9a55-7e1f0c2b9d41")


@dataclass(frozen=True)
class Gpu:
    """One simulated GPU, with the values nvidia-smi reports for it."""

    index: int
    name: str
    uuid: str
    pci_bus_id: str
    memory_total_mib: int
    compute_cap: str
    power_limit_w: int
    power_default_w: int
    power_min_w: int
    power_max_w: int
    memory_used_mib: int = 1
    architecture: str = "Ampere"


@dataclass(frozen=True)
class Hardware:
    """What one host looks like to the stand-in tools."""

    preset: str
    gpus: tuple[Gpu, ...]
    driver_cuda: str | None = None
    secure_boot: bool = False
    topology: str | None = "PIX"
    schema: int = field(default=SCHEMA_VERSION)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["gpus"] = [asdict(g) for g in self.gpus]
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    def with_secure_boot(self, enabled: bool) -> Hardware:
        return replace(self, secure_boot=enabled)


@dataclass(frozen=True)
class GpuModel:
    """A retail card: the fixed values every unit of it reports."""

    name: str
    memory_total_mib: int
    compute_cap: str
    power_default_w: int
    power_min_w: int
    power_max_w: int
    architecture: str = "Ampere"


RTX_3090 = GpuModel("NVIDIA GeForce RTX 3090", 24576, "8.6", 350, 100, 400)
RTX_3080_20GB = GpuModel("NVIDIA GeForce RTX 3080", 20480, "8.6", 320, 100, 370)
RTX_2080_TI = GpuModel("NVIDIA GeForce RTX 2080 Ti", 11264, "7.5", 250, 100, 280, architecture="Turing")
# memory.total of the real H200 capture (tests/fixtures/nvidia-smi/1xH200-580.159.04-device.csv)
H200 = GpuModel("NVIDIA H200", 143771, "9.0", 700, 200, 700, architecture="Hopper")


def gpu_uuid(host: str, index: int) -> str:
    return f"GPU-{uuid.uuid5(_UUID_NS, f'{host}/{index}')}"


def build(
    host: str,
    models: list[GpuModel],
    *,
    preset: str,
    topology: str | None = "PIX",
    driver_cuda: str | None = None,
    secure_boot: bool = False,
) -> Hardware:
    """Hardware for `host` with one GPU per entry of `models`, on PCI buses 01, 02, ..."""
    if len(models) > 1 and topology not in TOPOLOGIES:
        raise ValueError(f"topology {topology!r} is not one of {', '.join(TOPOLOGIES)}")
    gpus = tuple(
        Gpu(
            index=i,
            name=m.name,
            uuid=gpu_uuid(host, i),
            pci_bus_id=f"00000000:{i + 1:02X}:00.0",
            memory_total_mib=m.memory_total_mib,
            compute_cap=m.compute_cap,
            power_limit_w=m.power_default_w,
            power_default_w=m.power_default_w,
            power_min_w=m.power_min_w,
            power_max_w=m.power_max_w,
            architecture=m.architecture,
        )
        for i, m in enumerate(models)
    )
    return Hardware(
        preset=preset,
        gpus=gpus,
        driver_cuda=driver_cuda,
        secure_boot=secure_boot,
        topology=topology if len(models) > 1 else None,
    )


# Preset name -> (GPU models, topology). "2x3090" is the reference rig of the project brief.
PRESETS: Mapping[str, tuple[tuple[GpuModel, ...], str | None]] = {
    "2x3090": ((RTX_3090, RTX_3090), "PIX"),
    "2x3090-nvlink": ((RTX_3090, RTX_3090), "NV4"),
    "3x3090": ((RTX_3090,) * 3, "PIX"),  # three cards: the 27B cannot split 3 ways, so a dual pod and a single pod
    "4x3090": ((RTX_3090,) * 4, "PIX"),  # four cards behind PCIe switches, no NVLink (club-3090's quad rig)
    "8x3090": ((RTX_3090,) * 8, "PIX"),  # eight PCIe cards, no NVLink: club-3090's multi8 (TP=8) recipes
    "1x3090": ((RTX_3090,), None),
    "2x3080-20gb": ((RTX_3080_20GB, RTX_3080_20GB), "PIX"),
    "mixed-3090-3080": ((RTX_3090, RTX_3080_20GB), "PHB"),
    "1x2080ti": ((RTX_2080_TI,), None),
    "1xh200": ((H200,), None),  # sm 9.0: the recipes that need Hopper or newer (NVFP4, Gemma fp8 KV)
    "2xh200": ((H200, H200), "PIX"),
    "4xh200": ((H200,) * 4, "PIX"),  # four H200 NVL PCIe cards, no bridge: the four-card sm 9.0 recipes
    "none": ((), None),
}


def preset(name: str, host: str, *, secure_boot: bool = False, driver_cuda: str | None = None) -> Hardware:
    """The preset `name` as seen on `host` (GPU UUIDs depend on the host name)."""
    try:
        models, topology = PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown hardware preset {name!r}; known: {', '.join(PRESETS)}") from None
    return build(host, list(models), preset=name, topology=topology, secure_boot=secure_boot, driver_cuda=driver_cuda)


def from_dict(data: Mapping[str, Any]) -> Hardware:
    """Parse and check a hardware.json document (raises ValueError naming the bad key)."""
    if data.get("schema") != SCHEMA_VERSION:
        raise ValueError(f"hardware.json schema {data.get('schema')!r}, expected {SCHEMA_VERSION}")
    gpus = []
    for i, g in enumerate(data.get("gpus", [])):
        try:
            gpus.append(Gpu(**g))
        except TypeError as exc:
            raise ValueError(f"gpus[{i}]: {exc}") from None
        if gpus[-1].index != i:
            raise ValueError(f"gpus[{i}].index is {gpus[-1].index}")
    topology = data.get("topology")
    if topology is not None and topology not in TOPOLOGIES:
        raise ValueError(f"topology {topology!r} is not one of {', '.join(TOPOLOGIES)}")
    return Hardware(
        preset=str(data["preset"]),
        gpus=tuple(gpus),
        driver_cuda=None if data["driver_cuda"] is None else str(data["driver_cuda"]),
        secure_boot=bool(data["secure_boot"]),
        topology=topology,
    )
