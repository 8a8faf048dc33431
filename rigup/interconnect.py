"""GPU interconnect: NVLink or PCIe between the GPUs of a tensor-parallel group, and the NCCL /
custom all-reduce settings that follow from it.

The seeds ship the PCIe-safe settings for 2x RTX 3090 (NCCL_P2P_DISABLE=1, --disable-custom-all-reduce).
club-3090 S2's detect_nvlink.sh decides at container start from `nvidia-smi topo -m`
(NVLINK_MODE=auto|force_on|force_off); rigup decides at provisioning time instead, from the same
output, so the choice is in the rendered compose file and the plan:

  NVLink between every pair of used GPUs -> NCCL_P2P_LEVEL=NVL, no NCCL_P2P_DISABLE, custom all-reduce on,
                                           PYTORCH_CUDA_ALLOC_CONF without expandable_segments
  PCIe, `topo -p2p r` says OK           -> NCCL_P2P_LEVEL=PHB, no NCCL_P2P_DISABLE, custom all-reduce off
                                           (club-3090 HEAD)
  PCIe otherwise, or nothing known      -> the catalog's settings unchanged

Only pure logic and parsers live here; rigup/fitfacts.py reads the commands on a rig.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # rigup.recipe imports this module
    from rigup.recipe import Lock, Recipe

MODES: tuple[str, ...] = ("auto", "force_on", "force_off")  # knob gpu_interconnect
Source = Literal["detected", "forced"]

_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # topo -m underlines its header row
_LINK = re.compile(r"^(X|NV\d+|PIX|PXB|PHB|NODE|SYS|SOC|CPU)$")
_P2P = re.compile(r"^(X|OK|CNS|GNS|TNS|NS|U)$")


class TopologyError(ValueError):
    """`nvidia-smi topo` output that does not have the expected shape."""


@dataclass(frozen=True)
class Topology:
    """What `nvidia-smi topo -m` (and `topo -p2p r`, when it answered) say about GPU pairs."""

    gpus: tuple[int, ...]  # GPU indices in the matrix
    links: Mapping[tuple[int, int], str] = field(default_factory=dict)  # (a, b) -> "NV18", "PHB", ...
    p2p: Mapping[tuple[int, int], str] | None = None  # (a, b) -> "OK", "NS", ...; None: not asked

    def link(self, a: int, b: int) -> str:
        return self.links[(a, b)]

    def to_json(self) -> dict[str, Any]:
        """For `pyinfra ... fact rigup.fitfacts.GpuTopology`: pairs as "a-b" keys (JSON has no tuples)."""

        def pairs(mapping: Mapping[tuple[int, int], str]) -> dict[str, str]:
            return {f"{a}-{b}": value for (a, b), value in sorted(mapping.items())}

        return {"gpus": list(self.gpus), "links": pairs(self.links), "p2p": None if self.p2p is None else pairs(self.p2p)}

    def pairs(self, gpus: Sequence[int]) -> list[tuple[int, int]]:
        return list(itertools.combinations(gpus, 2))

    def nvlink_between(self, gpus: Sequence[int]) -> bool:
        """Every pair of `gpus` is joined by NVLink (custom all-reduce needs the full mesh above 2 GPUs)."""
        pairs = self.pairs(gpus)
        return bool(pairs) and all(_is_nvlink(self.links.get(p, "")) for p in pairs)

    def p2p_ok_between(self, gpus: Sequence[int]) -> bool:
        """`topo -p2p r` reports OK for every pair of `gpus` (False when it was not asked)."""
        pairs = self.pairs(gpus)
        if self.p2p is None or not pairs:
            return False
        return all(self.p2p.get(p) == "OK" and self.p2p.get((p[1], p[0])) == "OK" for p in pairs)


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


def _is_nvlink(link: str) -> bool:
    return re.fullmatch(r"NV\d+", link) is not None


def _clean_lines(text: str | Iterable[str]) -> list[str]:
    lines = text.splitlines() if isinstance(text, str) else [line.rstrip("\n") for line in text]
    return [_ANSI.sub("", line).rstrip() for line in lines]


def _gpu_index(name: str) -> int | None:
    match = re.fullmatch(r"GPU(\d+)", name.strip())
    return int(match.group(1)) if match else None


def parse_topo_matrix(text: str | Iterable[str]) -> dict[tuple[int, int], str]:
    """Parse `nvidia-smi topo -m`: (GPU a, GPU b) -> link for every ordered pair, a != b.

    The header row names the device columns (GPUs, then NICs on hosts that have them) before
    "CPU Affinity"; rows of NICs and the legend are skipped.
    """
    lines = _clean_lines(text)
    header_at = next((i for i, line in enumerate(lines) if re.search(r"(^|\t)\s*GPU0\s*(\t|$)", line)), None)
    if header_at is None:
        raise TopologyError("no GPU0 column header in nvidia-smi topo -m output")
    columns = [c.strip() for c in lines[header_at].split("\t")]
    if columns and columns[0] == "":
        columns = columns[1:]
    gpu_columns = {pos: idx for pos, name in enumerate(columns) if (idx := _gpu_index(name)) is not None}
    links: dict[tuple[int, int], str] = {}
    rows = 0
    for line in lines[header_at + 1 :]:
        if not line.strip():
            break  # the legend follows an empty line
        cells = [c.strip() for c in line.split("\t")]
        row = _gpu_index(cells[0])
        if row is None:
            continue  # NIC rows
        rows += 1
        for pos, col in gpu_columns.items():
            if pos + 1 >= len(cells):
                raise TopologyError(f"row GPU{row} has no cell for GPU{col}: {line!r}")
            value = cells[pos + 1]
            if not _LINK.match(value):
                raise TopologyError(f"unknown link {value!r} between GPU{row} and GPU{col}")
            if (value == "X") != (row == col):
                raise TopologyError(f"GPU{row}/GPU{col}: 'X' must be on the diagonal only")
            if row != col:
                links[(row, col)] = value
    if rows != len(gpu_columns):
        raise TopologyError(f"{len(gpu_columns)} GPU columns but {rows} GPU rows")
    return links


def parse_topo_p2p(text: str | Iterable[str]) -> dict[tuple[int, int], str]:
    """Parse `nvidia-smi topo -p2p r` (read capability): (GPU a, GPU b) -> "OK", "NS", "CNS", ..."""
    lines = _clean_lines(text)
    # The header row names GPU0 in a column; GPU rows name their GPU in the first cell.
    header_at = next(
        (i for i, line in enumerate(lines)
         if re.search(r"(^|\s)GPU0(\s|$)", line) and _gpu_index(line.split("\t")[0]) is None),
        None,
    )
    if header_at is None:
        raise TopologyError("no GPU0 column header in nvidia-smi topo -p2p output")
    columns = [c.strip() for c in lines[header_at].split("\t")][1:]
    gpu_columns = {pos: idx for pos, name in enumerate(columns) if (idx := _gpu_index(name)) is not None}
    status: dict[tuple[int, int], str] = {}
    for line in lines[header_at + 1 :]:
        if not line.strip():
            break
        cells = [c.strip() for c in line.split("\t")]
        row = _gpu_index(cells[0])
        if row is None:
            raise TopologyError(f"not a GPU row: {line!r}")
        for pos, col in gpu_columns.items():
            if pos + 1 >= len(cells) or not _P2P.match(cells[pos + 1]):
                raise TopologyError(f"row GPU{row}: no P2P status for GPU{col}: {line!r}")
            if row != col:
                status[(row, col)] = cells[pos + 1]
    if not status and len(gpu_columns) > 1:
        raise TopologyError("no GPU rows in nvidia-smi topo -p2p output")
    return status


def topology(matrix: str | Iterable[str], p2p: str | Iterable[str] | None = None) -> Topology:
    """A Topology from `topo -m` output and, when available, `topo -p2p r` output."""
    links = parse_topo_matrix(matrix)
    gpus = sorted({a for a, _ in links} | {b for _, b in links})
    if not gpus:  # a single GPU: the matrix has only its diagonal
        gpus = [0]
    return Topology(tuple(gpus), links, None if p2p is None else parse_topo_p2p(p2p))


def _describe_links(topo: Topology, gpus: Sequence[int]) -> str:
    return ", ".join(f"GPU{a}-GPU{b} {topo.links.get((a, b), '?')}" for a, b in topo.pairs(gpus))


def detect(topo: Topology, gpu_count: int) -> Interconnect:
    """The interconnect of the first `gpu_count` GPUs (Docker hands a `count: N` request GPUs 0..N-1)."""
    used = list(topo.gpus[:gpu_count])
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


def apply_env(env: Mapping[str, str], settings: NcclSettings) -> dict[str, str]:
    """`env` with the settings applied, in order: a set variable takes the place of a dropped one.

    With custom all-reduce on, expandable_segments leaves PYTORCH_CUDA_ALLOC_CONF: the all-reduce
    buffers are shared through CUDA IPC, which expandable segments do not support (detect_nvlink.sh
    sets "max_split_size_mb:512" on NVLink hosts for the same reason).
    """
    pending = dict(settings.set_env)
    out: dict[str, str] = {}
    for key, value in env.items():
        if key in settings.unset_env:
            if pending:
                first = next(iter(pending))
                out[first] = pending.pop(first)
            continue
        if key in pending:
            value = pending.pop(key)
        if key == "PYTORCH_CUDA_ALLOC_CONF" and settings.custom_all_reduce:
            parts = [p for p in value.split(",") if p.strip() and p.strip() != "expandable_segments:True"]
            if not parts:
                continue
            value = ",".join(parts)
        out[key] = value
    out.update(pending)
    return out


def resolve_for_host(host_data: Mapping[str, Any], topo: Topology | None, lock: Lock | None = None) -> Recipe:
    """rigup.recipe.resolve with the interconnect detected among the GPUs the variant uses.

    The one way to build a host's recipe wherever files are rendered or compared (serving task,
    status, doctor, `rigup render --topo`), so they agree. topo None: nothing detected (no driver
    yet), the gpu_interconnect knob alone decides.
    """
    from rigup.recipe import resolve

    recipe = resolve(host_data, lock)
    if topo is None or recipe.gpu_count < 2:
        return recipe
    return resolve(host_data, lock, detect(topo, recipe.gpu_count))
