"""Parsers for nvidia-smi topo -m and topo -p2p: which GPU pairs are linked by NVLink or only PCIe."""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

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
        """For `pyinfra ... fact rigup.facts.gpu.GpuTopology`: pairs as "a-b" keys (JSON has no tuples)."""

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

