"""Interconnect decisions: NVLink or PCIe between the GPUs of a tensor-parallel group (from the parsed
topology), and the NCCL / custom all-reduce settings that follow from it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from rigup.parsers.topology import Topology

MODES: tuple[str, ...] = ("auto", "force_on", "force_off")  # knob gpu_interconnect


Source = Literal["detected", "forced"]


@dataclass(frozen=True)
class Interconnect:
    """The interconnect rigup plans for (resolve's `interconnect` argument)."""

    nvlink: bool  # NVLink joins every pair of the TP group's GPUs
    p2p_ok: bool  # GPU peer-to-peer works (over NVLink, or over PCIe per `topo -p2p r`)
    source: Source  # "detected" from nvidia-smi topo, or "forced" by the gpu_interconnect knob
    detail: str = ""  # what it was decided from, for humans ("GPU0-GPU1 NV18")


@dataclass(frozen=True)
class NcclSettings:
    """Changes to the catalog's PCIe-safe settings for one interconnect."""

    set_env: Mapping[str, str]  # variables to set
    unset_env: frozenset[str]  # variables to drop
    custom_all_reduce: bool  # False: --disable-custom-all-reduce
    summary: str  # one line for the compose header and the plan


def _describe_links(topo: Topology, gpus: Sequence[int]) -> str:
    return ", ".join(f"GPU{a}-GPU{b} {topo.links.get((a, b), '?')}" for a, b in topo.pairs(gpus))


def detect(topo: Topology, gpu_count: int, gpu_ids: Sequence[int] | None = None) -> Interconnect:
    """The interconnect of the GPUs a container gets: `gpu_ids` (a pod's), else the first `gpu_count`
    (Docker hands a `count: N` request GPUs 0..N-1)."""
    used = list(gpu_ids) if gpu_ids is not None else list(topo.gpus[:gpu_count])
    nvlink = topo.nvlink_between(used)
    p2p_ok = nvlink or topo.p2p_ok_between(used)
    detail = _describe_links(topo, used)
    if not nvlink and topo.p2p is not None and len(used) > 1:
        detail += "; P2P " + ("OK" if p2p_ok else "not supported")
    return Interconnect(nvlink=nvlink, p2p_ok=p2p_ok, source="detected", detail=detail)


def check_mode(mode: object) -> str:
    if mode not in MODES:
        raise ValueError(f"gpu_interconnect must be one of {', '.join(MODES)}, got {mode!r}")
    return str(mode)


def effective(mode: object, detected: Interconnect | None) -> Interconnect | None:
    """Apply the gpu_interconnect knob to what was detected (None: nothing known).

    auto keeps the detection; force_on plans NVLink whatever was seen; force_off plans the PCIe-safe
    settings (NVLink present and unused is then the operator's choice, and `detail` says so).
    """
    mode = check_mode(mode)
    if mode == "auto":
        return detected
    seen = f"; detected: {detected.detail}" if detected is not None and detected.detail else ""
    if mode == "force_on":
        return Interconnect(nvlink=True, p2p_ok=True, source="forced", detail="gpu_interconnect: force_on" + seen)
    return Interconnect(nvlink=False, p2p_ok=False, source="forced", detail="gpu_interconnect: force_off" + seen)


def choose(mode: object, topo: Topology | None, gpu_count: int) -> Interconnect | None:
    """detect() when a topology is known, then the knob: what resolve() should be given."""
    detected = detect(topo, gpu_count) if topo is not None and gpu_count > 1 else None
    return effective(mode, detected)


def nccl_settings(ic: Interconnect | None, tensor_parallel_size: int) -> NcclSettings | None:
    """Changes to the catalog's PCIe-safe settings; None when there are none to make.

    TP=1 uses no collectives, and an unknown interconnect keeps the settings the seeds ship.
    """
    if ic is None or tensor_parallel_size < 2:
        return None
    how = "detected" if ic.source == "detected" else "forced"
    if ic.nvlink:
        return NcclSettings(
            set_env={"NCCL_P2P_LEVEL": "NVL"},
            unset_env=frozenset({"NCCL_P2P_DISABLE"}),
            custom_all_reduce=True,
            summary=f"NVLink ({how}: {ic.detail}): NCCL_P2P_LEVEL=NVL, custom all-reduce on",
        )
    if ic.p2p_ok:
        return NcclSettings(
            set_env={"NCCL_P2P_LEVEL": "PHB"},
            unset_env=frozenset({"NCCL_P2P_DISABLE"}),
            custom_all_reduce=False,
            summary=f"PCIe with P2P ({how}: {ic.detail}): NCCL_P2P_LEVEL=PHB, custom all-reduce off",
        )
    return None  # PCIe without P2P: exactly the catalog's settings


def pcie_summary(ic: Interconnect | None) -> str:
    """The plan's line when the catalog's settings stay (PCIe without P2P, or nothing known)."""
    why = "no topology information" if ic is None else f"{ic.source}: {ic.detail}"
    return f"PCIe ({why}): NCCL_P2P_DISABLE=1, --disable-custom-all-reduce"
