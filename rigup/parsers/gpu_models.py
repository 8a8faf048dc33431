"""GPU models rigup knows by PCI id and by name: architecture, compute capability, memory."""

from __future__ import annotations

import re
from dataclasses import dataclass

from rigup.parsers.common import JsonDataclass


@dataclass(frozen=True)
class KnownGpu(JsonDataclass):
    name: str  # as nvidia-smi prints it
    architecture: str
    compute_capability: tuple[int, int]
    # nvidia-smi memory.total of every board with this device id; None when boards with the same id
    # come with different memory sizes (the driver alone can tell)
    memory_mib: int | None
    memory_note: str = ""  # why memory_mib is None


# Reference boards with more memory soldered on keep their device id: lspci cannot tell them apart.
_SHARED_ID = "boards with {sizes} share PCI device id {id}"


# PCI device id (lower-case hex, vendor 10de) -> card. memory_mib is what nvidia-smi reports as
# memory.total; used only while no driver is loaded.
KNOWN_GPUS: dict[str, KnownGpu] = {
    "1b06": KnownGpu("NVIDIA GeForce GTX 1080 Ti", "Pascal", (6, 1), 11264),
    "1e04": KnownGpu("NVIDIA GeForce RTX 2080 Ti", "Turing", (7, 5), None, _SHARED_ID.format(sizes="11 GB and 22 GB", id="1e04")),
    "1e07": KnownGpu("NVIDIA GeForce RTX 2080 Ti", "Turing", (7, 5), None, _SHARED_ID.format(sizes="11 GB and 22 GB", id="1e07")),
    "1eb8": KnownGpu("Tesla T4", "Turing", (7, 5), 15360),
    "20b0": KnownGpu("NVIDIA A100-SXM4-40GB", "Ampere", (8, 0), 40960),
    "20b2": KnownGpu("NVIDIA A100-SXM4-80GB", "Ampere", (8, 0), 81920),
    "20b5": KnownGpu("NVIDIA A100 80GB PCIe", "Ampere", (8, 0), 81920),
    "2204": KnownGpu("NVIDIA GeForce RTX 3090", "Ampere", (8, 6), 24576),
    "2203": KnownGpu("NVIDIA GeForce RTX 3090 Ti", "Ampere", (8, 6), 24564),
    "2206": KnownGpu("NVIDIA GeForce RTX 3080", "Ampere", (8, 6), None, _SHARED_ID.format(sizes="10 GB and 20 GB", id="2206")),
    "2230": KnownGpu("NVIDIA RTX A6000", "Ampere", (8, 6), 49140),
    "2231": KnownGpu("NVIDIA RTX A5000", "Ampere", (8, 6), 24564),
    "2684": KnownGpu("NVIDIA GeForce RTX 4090", "Ada Lovelace", (8, 9), 24564),
    "26b1": KnownGpu("NVIDIA RTX 6000 Ada Generation", "Ada Lovelace", (8, 9), 49140),
    "2330": KnownGpu("NVIDIA H100 80GB HBM3", "Hopper", (9, 0), 81559),
    "2335": KnownGpu("NVIDIA H200", "Hopper", (9, 0), 143771),
    "2b85": KnownGpu("NVIDIA GeForce RTX 5090", "Blackwell", (12, 0), 32607),
}


def gpu_name_key(name: str) -> str:
    """A card's name compared loosely: "NVIDIA GeForce RTX 3090" and "rtx-3090" both give "rtx 3090"."""
    key = name.lower().replace("nvidia", "").replace("geforce", "")
    return re.sub(r"[^a-z0-9]+", " ", key).strip()


_KNOWN_BY_NAME: dict[str, KnownGpu] = {gpu_name_key(g.name): g for g in KNOWN_GPUS.values()}


def known_gpu(name: str | None = None, device_id: str | None = None) -> KnownGpu | None:
    """Look a card up by PCI device id (preferred) or by name ("GeForce RTX 3090" matches)."""
    if device_id is not None and device_id.lower() in KNOWN_GPUS:
        return KNOWN_GPUS[device_id.lower()]
    if name is not None:
        return _KNOWN_BY_NAME.get(gpu_name_key(name))
    return None

