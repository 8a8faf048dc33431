"""Parsers for nvidia-smi's CSV queries: GPUs (--query-gpu), memory in use and compute apps, and the
CUDA version in its banner."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from rigup.parsers.common import JsonDataclass, ParseError, split_lines

# The fields the NvidiaGpus fact asks for, in order (`--format=csv,noheader,nounits`).
GPU_QUERY_FIELDS: tuple[str, ...] = (
    "index",
    "name",
    "uuid",
    "driver_version",
    "memory.total",
    "compute_cap",
    "pci.bus_id",
    "power.limit",
    "power.max_limit",
    "persistence_mode",
    "power.min_limit",
    "power.default_limit",  # the board's own limit: what a cap is judged against
)


SmiStatus = Literal["ok", "no-driver", "mismatch", "no-devices", "error"]


@dataclass(frozen=True)
class Gpu(JsonDataclass):
    index: int
    name: str
    uuid: str | None
    driver_version: str | None
    memory_mib: int | None
    compute_capability: tuple[int, int] | None
    bus_id: str | None  # "0000:01:00.0" (4-digit domain, lower case), comparable with lspci's
    power_limit_w: float | None
    power_max_w: float | None
    persistence: bool | None
    power_min_w: float | None = None
    power_default_w: float | None = None  # the limit the board boots with when nothing caps it
    source: Literal["nvidia-smi", "lspci"] = "nvidia-smi"

    @property
    def cc_text(self) -> str:
        return "?" if self.compute_capability is None else "%d.%d" % self.compute_capability


@dataclass(frozen=True)
class SmiQuery(JsonDataclass):
    """What `nvidia-smi --query-gpu` said: GPUs when the driver answers, else why not."""

    status: SmiStatus
    gpus: tuple[Gpu, ...] = ()
    message: str | None = None  # nvidia-smi's own words when status is not "ok"
    library_version: str | None = None  # NVML library version a mismatch message names


def normalize_bus_id(bus_id: str) -> str:
    """"00000000:01:00.0" (nvidia-smi) and "0000:01:00.0" (lspci -D) -> "0000:01:00.0"."""
    text = bus_id.strip().lower()
    match = re.fullmatch(r"(?:([0-9a-f]{4,8}):)?([0-9a-f]{2}):([0-9a-f]{2})\.([0-7])", text)
    if match is None:
        raise ParseError(f"not a PCI bus id: {bus_id!r}")
    domain = int(match.group(1) or "0", 16)
    return f"{domain:04x}:{match.group(2)}:{match.group(3)}.{match.group(4)}"


_NA = {"[n/a]", "n/a", "[not supported]", "not supported", "[unknown error]", ""}


def _opt(value: str) -> str | None:
    return None if value.strip().lower() in _NA else value.strip()


def _opt_float(value: str, field_name: str) -> float | None:
    text = _opt(value)
    if text is None:
        return None
    text = re.sub(r"\s*(W|MiB)$", "", text)
    try:
        return float(text)
    except ValueError as exc:
        raise ParseError(f"{field_name}: not a number: {value!r}") from exc


def _parse_cc(value: str) -> tuple[int, int] | None:
    text = _opt(value)
    if text is None:
        return None
    match = re.fullmatch(r"(\d+)\.(\d+)", text)
    if match is None:
        raise ParseError(f"compute_cap: not MAJOR.MINOR: {value!r}")
    return int(match.group(1)), int(match.group(2))


def _parse_persistence(value: str) -> bool | None:
    text = (_opt(value) or "").lower()
    if text == "enabled":
        return True
    if text == "disabled":
        return False
    return None


# What nvidia-smi prints instead of an answer when it cannot ask the driver (no module loaded, a
# userspace newer than the module, no GPU, NVML not initialised): facts read these as "no answer".
_SMI_FAILURES = (
    "couldn't communicate with the NVIDIA driver",
    "could not communicate with the NVIDIA driver",
    "Driver/library version mismatch",
    "No devices were found",
    "Failed to initialize NVML",
    "Unable to determine the device handle",
    "NVIDIA-SMI has failed",
)


def smi_failure(output: str | Iterable[str]) -> str | None:
    """The first line of nvidia-smi's own failure text in `output`, or None when it is something else."""
    lines = [line.strip() for line in split_lines(output) if line.strip()]
    for line in lines:
        if any(marker in line for marker in _SMI_FAILURES):
            return line
    return None


def parse_gpu_query(output: str | Iterable[str], fields: tuple[str, ...] = GPU_QUERY_FIELDS) -> SmiQuery:
    """Parse `nvidia-smi --query-gpu=<fields> --format=csv,noheader[,nounits]` (stderr merged).

    + fields: the query's field list, in order; `index` and `name` are required

    nvidia-smi's failures come back as a status: "no-driver" (cannot talk to a loaded driver),
    "mismatch" (userspace newer than the loaded module, i.e. a reboot is pending), "no-devices".
    """
    lines = [line.strip() for line in split_lines(output) if line.strip()]
    if not lines:
        return SmiQuery(status="no-devices", message="nvidia-smi printed nothing")
    text = "\n".join(lines)
    if "couldn't communicate with the NVIDIA driver" in text or "could not communicate with the NVIDIA driver" in text:
        return SmiQuery(status="no-driver", message=lines[0])
    if "Driver/library version mismatch" in text:
        lib = re.search(r"NVML library version:\s*([0-9.]+)", text)
        return SmiQuery(status="mismatch", message=lines[0], library_version=lib.group(1) if lib else None)
    if lines[0].startswith("No devices were found"):
        return SmiQuery(status="no-devices", message=lines[0])
    if "index" not in fields or "name" not in fields:
        raise ParseError("the query must include index and name")

    gpus: list[Gpu] = []
    for line in lines:
        parts = [p.strip() for p in line.split(", ")]
        if len(parts) != len(fields):
            if not gpus and not re.match(r"^\d+,", line):
                # Not CSV at all: some other nvidia-smi failure (e.g. "Unable to determine the device handle").
                return SmiQuery(status="error", message=line)
            raise ParseError(f"expected {len(fields)} fields, got {len(parts)}: {line!r}")
        row = dict(zip(fields, parts, strict=True))
        memory = _opt_float(row.get("memory.total", ""), "memory.total")
        bus = _opt(row.get("pci.bus_id", ""))
        try:
            index = int(row["index"])
        except ValueError as exc:
            raise ParseError(f"index: not an integer: {row['index']!r}") from exc
        gpus.append(
            Gpu(
                index=index,
                name=row["name"],
                uuid=_opt(row.get("uuid", "")),
                driver_version=_opt(row.get("driver_version", "")),
                memory_mib=None if memory is None else int(memory),
                compute_capability=_parse_cc(row.get("compute_cap", "")),
                bus_id=None if bus is None else normalize_bus_id(bus),
                power_limit_w=_opt_float(row.get("power.limit", ""), "power.limit"),
                power_max_w=_opt_float(row.get("power.max_limit", ""), "power.max_limit"),
                persistence=_parse_persistence(row.get("persistence_mode", "")),
                power_min_w=_opt_float(row.get("power.min_limit", ""), "power.min_limit"),
                power_default_w=_opt_float(row.get("power.default_limit", ""), "power.default_limit"),
            )
        )
    return SmiQuery(status="ok", gpus=tuple(sorted(gpus, key=lambda g: g.index)))


@dataclass(frozen=True)
class GpuState:
    """A GPU as the fit sees it."""

    index: int
    name: str
    memory_total_mib: int | None  # None: unknown card seen only by lspci
    memory_used_mib: int | None  # by processes other than this variant's container; None: not known
    compute_cap: tuple[int, int] | None = None
    uuid: str | None = None

    def to_json(self) -> dict[str, Any]:
        """For `pyinfra ... fact rigup.facts.gpu.GpuMemoryUse` (pyinfra's JSON output calls it)."""
        return dataclasses.asdict(self)


_NA_VALUES = {"[n/a]", "n/a", "[not supported]", "not supported", ""}


def _nonblank_lines(output: str | Iterable[str]) -> list[str]:
    lines = output.splitlines() if isinstance(output, str) else [line.rstrip("\n") for line in output]
    return [line.strip() for line in lines if line.strip()]


class FitParseError(ValueError):
    """nvidia-smi output that does not have the expected shape."""


# `nvidia-smi --query-gpu=<these> --format=csv,noheader,nounits`
MEMORY_QUERY_FIELDS: tuple[str, ...] = ("index", "uuid", "name", "memory.total", "memory.used", "compute_cap")


# `nvidia-smi --query-compute-apps=<these> --format=csv,noheader,nounits`
APPS_QUERY_FIELDS: tuple[str, ...] = ("gpu_uuid", "pid", "used_memory")


def _mib(value: str, what: str) -> int | None:
    text = value.strip()
    if text.lower() in _NA_VALUES:
        return None
    text = re.sub(r"\s*MiB$", "", text)
    try:
        return int(float(text))
    except ValueError:
        raise FitParseError(f"{what}: not a number of MiB: {value!r}") from None


def parse_compute_cap(value: Any) -> tuple[int, int] | None:
    """A compute capability ("8.6", or (8, 6)) as (major, minor); None when absent or not of that shape."""
    if value is None:
        return None
    if isinstance(value, (tuple, list)) and len(value) == 2:
        return int(value[0]), int(value[1])
    match = re.fullmatch(r"\s*(\d+)\.(\d+)\s*", str(value))
    return (int(match.group(1)), int(match.group(2))) if match else None


def parse_memory_query(output: str | Iterable[str]) -> tuple[GpuState, ...]:
    """Parse `nvidia-smi --query-gpu=index,uuid,name,memory.total,memory.used,compute_cap
    --format=csv,noheader,nounits`. memory.used counts every process, this variant's included."""
    gpus: list[GpuState] = []
    for line in _nonblank_lines(output):
        parts = [p.strip() for p in line.split(", ")]
        if len(parts) != len(MEMORY_QUERY_FIELDS) or not parts[0].isdigit():
            raise FitParseError(f"not a memory query line: {line!r}")
        row = dict(zip(MEMORY_QUERY_FIELDS, parts, strict=True))
        gpus.append(
            GpuState(
                index=int(row["index"]),
                name=row["name"],
                memory_total_mib=_mib(row["memory.total"], "memory.total"),
                memory_used_mib=_mib(row["memory.used"], "memory.used"),
                compute_cap=parse_compute_cap(row["compute_cap"]),
                uuid=None if row["uuid"].lower() in _NA_VALUES else row["uuid"],
            )
        )
    if not gpus:
        raise FitParseError("nvidia-smi listed no GPUs")
    return tuple(sorted(gpus, key=lambda g: g.index))


@dataclass(frozen=True)
class ComputeApp:
    gpu_uuid: str
    pid: int
    used_mib: int | None  # None: nvidia-smi cannot tell (e.g. [N/A])


def parse_compute_apps(output: str | Iterable[str]) -> tuple[ComputeApp, ...]:
    """Parse `nvidia-smi --query-compute-apps=gpu_uuid,pid,used_memory --format=csv,noheader,nounits`."""
    apps: list[ComputeApp] = []
    for line in _nonblank_lines(output):
        if line.lower().startswith("no running"):
            continue
        parts = [p.strip() for p in line.split(", ")]
        if len(parts) != len(APPS_QUERY_FIELDS) or not parts[1].isdigit():
            raise FitParseError(f"not a compute-apps line: {line!r}")
        apps.append(ComputeApp(parts[0], int(parts[1]), _mib(parts[2], "used_memory")))
    return tuple(apps)


_CUDA_VERSION = re.compile(r"CUDA Version\s*:\s*(\d+\.\d+)")


def parse_driver_cuda(output: str | Iterable[str]) -> str | None:
    """The CUDA version the driver supports, from `nvidia-smi` (header "CUDA Version: 13.0"),
    `nvidia-smi -q` or `nvidia-smi --version` ("CUDA Version : 13.0"); None when it says none."""
    text = output if isinstance(output, str) else "\n".join(output)
    match = _CUDA_VERSION.search(text)
    return match.group(1) if match else None


# What verify and status ask a rig over SSH for the VRAM margin: one row per GPU.
GPU_MEMORY_QUERY = "nvidia-smi --query-gpu=index,memory.used,memory.total --format=csv,noheader,nounits"


def parse_memory_used(output: str | Iterable[str]) -> list[tuple[int, int]]:
    """(used MiB, total MiB) per GPU from GPU_MEMORY_QUERY's output; lines that are not rows are skipped."""
    rows = []
    for line in split_lines(output):
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3 and all(p.isdigit() for p in parts):
            rows.append((int(parts[1]), int(parts[2])))
    return rows
