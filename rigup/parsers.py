"""Pure parsers for what the rig's tools print: nvidia-smi, lspci, /proc/driver/nvidia/version,
dpkg-query, apt-cache policy, mokutil, df, docker info and apt source files.

Nothing here runs a command or touches pyinfra: facts (rigup/facts.py) call these on the output
lines, and the unit tests call them on captures. Every parser raises ParseError on output it does
not understand instead of guessing.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal


class ParseError(ValueError):
    """Output that does not have the expected shape."""


class _Jsonable:
    """Lets pyinfra's CLI (`pyinfra INVENTORY fact rigup.facts.X`) print our dataclasses."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)  # type: ignore[call-overload]


def _lines(output: str | Iterable[str]) -> list[str]:
    if isinstance(output, str):
        return output.splitlines()
    return [line.rstrip("\n") for line in output]


# --------------------------------------------------------------------------------------------
# Known GPUs: what lspci-only hosts (no driver yet) need to know about a card.


@dataclass(frozen=True)
class KnownGpu(_Jsonable):
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


def _name_key(name: str) -> str:
    key = name.lower().replace("nvidia", "").replace("geforce", "")
    return re.sub(r"[^a-z0-9]+", " ", key).strip()


_KNOWN_BY_NAME: dict[str, KnownGpu] = {_name_key(g.name): g for g in KNOWN_GPUS.values()}


def known_gpu(name: str | None = None, device_id: str | None = None) -> KnownGpu | None:
    """Look a card up by PCI device id (preferred) or by name ("GeForce RTX 3090" matches)."""
    if device_id is not None and device_id.lower() in KNOWN_GPUS:
        return KNOWN_GPUS[device_id.lower()]
    if name is not None:
        return _KNOWN_BY_NAME.get(_name_key(name))
    return None


# --------------------------------------------------------------------------------------------
# nvidia-smi --query-gpu


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
)

SmiStatus = Literal["ok", "no-driver", "mismatch", "no-devices", "error"]


@dataclass(frozen=True)
class Gpu(_Jsonable):
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
    source: Literal["nvidia-smi", "lspci"] = "nvidia-smi"

    @property
    def cc_text(self) -> str:
        return "?" if self.compute_capability is None else "%d.%d" % self.compute_capability


@dataclass(frozen=True)
class SmiQuery(_Jsonable):
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


def parse_gpu_query(output: str | Iterable[str], fields: tuple[str, ...] = GPU_QUERY_FIELDS) -> SmiQuery:
    """Parse `nvidia-smi --query-gpu=<fields> --format=csv,noheader[,nounits]` (stderr merged).

    + fields: the query's field list, in order; `index` and `name` are required

    nvidia-smi's failures come back as a status: "no-driver" (cannot talk to a loaded driver),
    "mismatch" (userspace newer than the loaded module, i.e. a reboot is pending), "no-devices".
    """
    lines = [line.strip() for line in _lines(output) if line.strip()]
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
            )
        )
    return SmiQuery(status="ok", gpus=tuple(sorted(gpus, key=lambda g: g.index)))


# --------------------------------------------------------------------------------------------
# lspci -Dnnk


@dataclass(frozen=True)
class PciDevice(_Jsonable):
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
    for line in _lines(output):
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


# --------------------------------------------------------------------------------------------
# /proc/driver/nvidia/version


Flavour = Literal["open", "proprietary"]


@dataclass(frozen=True)
class LoadedModule(_Jsonable):
    version: str  # "580.95.05"
    flavour: Flavour
    gcc: str | None

    @property
    def branch(self) -> int:
        return int(self.version.split(".")[0])


_NVRM = re.compile(
    r"^NVRM version:\s+NVIDIA UNIX\s+(?:(?P<open>Open Kernel Module for \S+)|\S+ Kernel Module)\s+"
    r"(?P<version>\d+\.\d+(?:\.\d+)?)\b"
)


def parse_nvidia_version_file(output: str | Iterable[str]) -> LoadedModule | None:
    """Parse /proc/driver/nvidia/version; None when the file was empty (module not loaded)."""
    lines = [line for line in _lines(output) if line.strip()]
    if not lines:
        return None
    match = _NVRM.match(lines[0].strip())
    if match is None:
        raise ParseError(f"not an NVRM version line: {lines[0]!r}")
    gcc = None
    for line in lines[1:]:
        if line.startswith("GCC version:"):
            gcc = line.split(":", 1)[1].strip()
    return LoadedModule(
        version=match.group("version"),
        flavour="open" if match.group("open") else "proprietary",
        gcc=gcc,
    )


# --------------------------------------------------------------------------------------------
# dpkg-query: installed packages, holds, and which NVIDIA driver that adds up to


@dataclass(frozen=True)
class DebPackage(_Jsonable):
    name: str
    version: str
    want: str  # dpkg selection: install, hold, deinstall, purge, unknown
    status: str  # dpkg status letter meaning: installed, not-installed, config-files, half-...

    @property
    def installed(self) -> bool:
        return self.status == "installed"

    @property
    def held(self) -> bool:
        return self.want == "hold"


_WANT = {"u": "unknown", "i": "install", "h": "hold", "r": "deinstall", "p": "purge"}
_STATUS = {
    "n": "not-installed",
    "i": "installed",
    "c": "config-files",
    "u": "unpacked",
    "f": "half-configured",
    "h": "half-installed",
    "w": "triggers-awaited",
    "t": "triggers-pending",
}

# The format the facts pass to `dpkg-query -W -f=`.
DPKG_QUERY_FORMAT = r"${binary:Package}\t${Version}\t${db:Status-Abbrev}\n"


def parse_dpkg_query(output: str | Iterable[str]) -> tuple[DebPackage, ...]:
    """Parse `dpkg-query -W -f='${binary:Package}\\t${Version}\\t${db:Status-Abbrev}\\n'`."""
    out: list[DebPackage] = []
    for line in _lines(output):
        if not line.strip() or line.startswith("dpkg-query:"):
            continue  # "dpkg-query: no packages found matching X" on merged stderr
        parts = line.split("\t")
        if len(parts) != 3 or len(parts[2].strip()) < 2:
            raise ParseError(f"not a dpkg-query line: {line!r}")
        name = parts[0].split(":")[0]  # drop ":amd64"
        abbrev = parts[2].strip().lower()
        out.append(
            DebPackage(
                name=name,
                version=parts[1],
                want=_WANT.get(abbrev[0], "unknown"),
                status=_STATUS.get(abbrev[1], "unknown"),
            )
        )
    return tuple(out)


DriverSource = Literal["ubuntu", "cuda"]


@dataclass(frozen=True)
class DriverPackage(_Jsonable):
    """A driver metapackage that is installed: it says which branch and flavour the box runs."""

    name: str  # nvidia-driver-580-open, nvidia-open-580, cuda-drivers-580, ...
    branch: int
    flavour: Flavour
    source: DriverSource  # which apt path installs this name (ubuntu archive or NVIDIA's CUDA repo)
    version: str  # upstream driver version, "580.95.05" (epoch and Debian revision dropped)
    held: bool


_META_PATTERNS: tuple[tuple[re.Pattern[str], DriverSource, Flavour | None], ...] = (
    (re.compile(r"^nvidia-driver-(?P<b>\d{3})(?:-server)?-open$"), "ubuntu", "open"),
    (re.compile(r"^nvidia-driver-(?P<b>\d{3})(?:-server)?$"), "ubuntu", "proprietary"),
    (re.compile(r"^nvidia-open-(?P<b>\d{3})$"), "cuda", "open"),
    (re.compile(r"^cuda-drivers-(?P<b>\d{3})$"), "cuda", "proprietary"),
    # 590+ CUDA-repo names carry no branch; it comes from the version.
    (re.compile(r"^nvidia-open$"), "cuda", "open"),
    (re.compile(r"^cuda-drivers$"), "cuda", "proprietary"),
)


def upstream_version(deb_version: str) -> str:
    """"580.95.05-0ubuntu1" -> "580.95.05"; "1:580.95.05-1" -> "580.95.05"."""
    version = deb_version.split(":", 1)[-1]
    return version.rsplit("-", 1)[0] if "-" in version else version


def driver_packages(packages: Iterable[DebPackage]) -> tuple[DriverPackage, ...]:
    """The installed driver metapackages among `packages`, newest branch first."""
    out: list[DriverPackage] = []
    for pkg in packages:
        if not pkg.installed:
            continue
        for pattern, source, flavour in _META_PATTERNS:
            match = pattern.match(pkg.name)
            if match is None:
                continue
            version = upstream_version(pkg.version)
            branch_text = match.groupdict().get("b") or version.split(".")[0]
            if not branch_text.isdigit():
                continue
            out.append(
                DriverPackage(
                    name=pkg.name,
                    branch=int(branch_text),
                    flavour=flavour or "proprietary",
                    source=source,
                    version=version,
                    held=pkg.held,
                )
            )
            break
    return tuple(sorted(out, key=lambda d: (-d.branch, d.name)))


# Package names that belong to one driver branch (userspace, kernel objects, prebuilt modules).
_BRANCH_PACKAGE = re.compile(
    r"^(?:nvidia-|libnvidia-|xserver-xorg-video-nvidia-|linux-modules-nvidia-|linux-objects-nvidia-|"
    r"linux-signatures-nvidia-|cuda-drivers-|nvidia-open-)"
    r".*?(?<![0-9])(?P<b>\d{3})(?![0-9])"
)


def package_branch(name: str) -> int | None:
    """Driver branch a package name belongs to ("libnvidia-compute-580" -> 580), or None."""
    match = _BRANCH_PACKAGE.match(name)
    return int(match.group("b")) if match else None


# --------------------------------------------------------------------------------------------
# apt-cache policy


@dataclass(frozen=True)
class AptPolicy(_Jsonable):
    installed: str | None
    candidate: str | None


def parse_apt_cache_policy(output: str | Iterable[str]) -> dict[str, AptPolicy]:
    """Parse `apt-cache policy PKG...`: package -> installed and candidate versions.

    Packages apt has never heard of are simply absent (apt-cache prints nothing for them).
    """
    out: dict[str, AptPolicy] = {}
    current: str | None = None
    installed: str | None = None
    candidate: str | None = None
    for line in _lines(output):
        if not line.strip():
            continue
        if not line[0].isspace() and line.rstrip().endswith(":"):
            if current is not None:
                out[current] = AptPolicy(installed, candidate)
            current, installed, candidate = line.strip()[:-1], None, None
            continue
        stripped = line.strip()
        if current is None:
            continue
        if stripped.startswith("Installed:"):
            value = stripped.split(":", 1)[1].strip()
            installed = None if value == "(none)" else value
        elif stripped.startswith("Candidate:"):
            value = stripped.split(":", 1)[1].strip()
            candidate = None if value == "(none)" else value
    if current is not None:
        out[current] = AptPolicy(installed, candidate)
    return out


# --------------------------------------------------------------------------------------------
# mokutil --sb-state


SecureBootState = Literal["enabled", "disabled", "unsupported"]


def parse_sb_state(output: str | Iterable[str]) -> SecureBootState | None:
    """Parse `mokutil --sb-state` (stderr merged); None when the output says nothing known."""
    text = "\n".join(_lines(output)).lower()
    if "secureboot enabled" in text:
        return "enabled"
    if "secureboot disabled" in text:
        return "disabled"
    if "doesn't support secure boot" in text or "efi variables are not supported" in text or "not supported" in text:
        return "unsupported"
    return None


# --------------------------------------------------------------------------------------------
# df -Pk


@dataclass(frozen=True)
class DiskFree(_Jsonable):
    path: str  # the path asked about
    existing: str  # the closest existing ancestor df was run on
    filesystem: str
    mount: str
    size_bytes: int
    avail_bytes: int

    @property
    def avail_gb(self) -> float:
        return self.avail_bytes / 1e9


def parse_df_sections(output: str | Iterable[str]) -> dict[str, DiskFree]:
    """Parse sections of `==> PATH EXISTING` followed by `df -Pk EXISTING` output."""
    out: dict[str, DiskFree] = {}
    path: str | None = None
    existing: str | None = None
    for line in _lines(output):
        if line.startswith("==> "):
            parts = line[4:].split(" ", 1)
            if len(parts) != 2:
                raise ParseError(f"bad section header: {line!r}")
            path, existing = parts
            continue
        if not line.strip() or line.startswith("Filesystem"):
            continue
        if path is None or existing is None:
            raise ParseError(f"df output outside a section: {line!r}")
        cols = line.split()
        if len(cols) < 6:
            raise ParseError(f"not a df -P line: {line!r}")
        try:
            size_kib, avail_kib = int(cols[1]), int(cols[3])
        except ValueError as exc:
            raise ParseError(f"not a df -Pk line: {line!r}") from exc
        out[path] = DiskFree(
            path=path,
            existing=existing,
            filesystem=cols[0],
            mount=" ".join(cols[5:]),
            size_bytes=size_kib * 1024,
            avail_bytes=avail_kib * 1024,
        )
        path = existing = None
    return out


# --------------------------------------------------------------------------------------------
# docker info --format '{{json .}}'


@dataclass(frozen=True)
class DockerInfo(_Jsonable):
    server_version: str | None  # None when the daemon did not answer
    runtimes: tuple[str, ...]
    default_runtime: str | None
    root_dir: str | None
    cgroup_driver: str | None
    errors: tuple[str, ...] = ()

    @property
    def running(self) -> bool:
        return self.server_version is not None

    @property
    def has_nvidia_runtime(self) -> bool:
        return "nvidia" in self.runtimes


def parse_docker_info(output: str | Iterable[str]) -> DockerInfo:
    """Parse `docker info --format '{{json .}}'`; a stopped daemon gives server_version None."""
    lines = _lines(output)
    json_line = next((line for line in lines if line.strip().startswith("{")), None)
    if json_line is None:
        text = " ".join(line.strip() for line in lines if line.strip())
        return DockerInfo(None, (), None, None, None, errors=(text,) if text else ())
    try:
        data = json.loads(json_line)
    except ValueError as exc:
        raise ParseError(f"docker info did not print JSON: {json_line[:200]!r}") from exc
    if not isinstance(data, Mapping):
        raise ParseError("docker info JSON is not an object")
    other = [line.strip() for line in lines if line.strip() and line is not json_line]
    errors = tuple([*(str(e) for e in data.get("ServerErrors") or ()), *other])
    runtimes = data.get("Runtimes") or {}
    return DockerInfo(
        server_version=data.get("ServerVersion") or None,
        runtimes=tuple(sorted(runtimes)) if isinstance(runtimes, Mapping) else (),
        default_runtime=data.get("DefaultRuntime") or None,
        root_dir=data.get("DockerRootDir") or None,
        cgroup_driver=data.get("CgroupDriver") or None,
        errors=errors,
    )


def parse_daemon_json(output: str | Iterable[str]) -> dict[str, Any] | None:
    """Parse /etc/docker/daemon.json; None when the file is empty or absent."""
    text = "\n".join(_lines(output)).strip()
    if not text:
        return None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ParseError(f"/etc/docker/daemon.json is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ParseError("/etc/docker/daemon.json is not a JSON object")
    return data


# --------------------------------------------------------------------------------------------
# apt source files (one-line .list and deb822 .sources)


@dataclass(frozen=True)
class AptSource(_Jsonable):
    file: str
    line: int  # 1-based line of the entry (one-line) or of the stanza's first field (deb822)
    format: Literal["one-line", "deb822"]
    types: tuple[str, ...]
    uris: tuple[str, ...]
    suites: tuple[str, ...]
    components: tuple[str, ...]
    options: dict[str, str] = field(default_factory=dict)  # keys lower-case: signed-by, arch, ...
    enabled: bool = True
    stanzas_in_file: int = 1  # deb822: how many stanzas the file holds (one-line: entries)
    text: str = ""  # the raw line (one-line entries)
    enabled_line: int | None = None  # deb822: line of an explicit Enabled field

    @property
    def signed_by(self) -> str | None:
        return self.options.get("signed-by")


_ONE_LINE = re.compile(r"^(?P<type>deb|deb-src)\s+(?:\[(?P<opts>[^\]]*)\]\s+)?(?P<rest>.+)$")


def _parse_one_line(path: str, number: int, raw: str) -> AptSource | None:
    text = raw.split("#", 1)[0].strip() if not raw.lstrip().startswith("#") else ""
    if not text:
        return None
    match = _ONE_LINE.match(text)
    if match is None:
        raise ParseError(f"{path}:{number}: not an apt source line: {raw!r}")
    options: dict[str, str] = {}
    for opt in (match.group("opts") or "").split():
        key, _, value = opt.partition("=")
        options[key.lower().rstrip("+-")] = value
    rest = match.group("rest").split()
    if len(rest) < 2:
        raise ParseError(f"{path}:{number}: apt source line needs a URI and a suite: {raw!r}")
    return AptSource(
        file=path,
        line=number,
        format="one-line",
        types=(match.group("type"),),
        uris=(rest[0],),
        suites=(rest[1],),
        components=tuple(rest[2:]),
        options=options,
        text=raw,
    )


_DEB822_LIST_KEYS = {"types", "uris", "suites", "components"}


def _parse_deb822(path: str, lines: list[str]) -> list[AptSource]:
    # (first field line, fields, line of the Enabled field)
    stanzas: list[tuple[int, dict[str, str], int | None]] = []
    current: dict[str, str] = {}
    start = 0
    enabled_at: int | None = None
    last_key: str | None = None
    for number, raw in enumerate(lines, start=1):
        if raw.startswith("#"):
            continue
        if not raw.strip():
            if current:
                stanzas.append((start, current, enabled_at))
            current, last_key, enabled_at = {}, None, None
            continue
        if raw[0] in " \t":
            if last_key is None:
                raise ParseError(f"{path}:{number}: continuation line outside a field")
            current[last_key] += "\n" + raw.strip()  # e.g. an inline Signed-By key block
            continue
        key, sep, value = raw.partition(":")
        if not sep:
            raise ParseError(f"{path}:{number}: not a deb822 field: {raw!r}")
        if not current:
            start = number
        last_key = key.strip().lower()
        if last_key == "enabled":
            enabled_at = number
        current[last_key] = value.strip()
    if current:
        stanzas.append((start, current, enabled_at))
    out: list[AptSource] = []
    for start, fields, enabled_line in stanzas:
        options = {k: v for k, v in fields.items() if k not in _DEB822_LIST_KEYS | {"enabled"}}
        if "architectures" in options:
            options["arch"] = options.pop("architectures")
        out.append(
            AptSource(
                file=path,
                line=start,
                format="deb822",
                types=tuple(fields.get("types", "").split()),
                uris=tuple(fields.get("uris", "").split()),
                suites=tuple(fields.get("suites", "").split()),
                components=tuple(fields.get("components", "").split()),
                options=options,
                enabled=fields.get("enabled", "yes").strip().lower() not in ("no", "false", "0"),
                stanzas_in_file=len(stanzas),
                enabled_line=enabled_line,
            )
        )
    return out


def parse_apt_source_files(output: str | Iterable[str]) -> tuple[AptSource, ...]:
    """Parse files printed as `==> PATH` headers followed by their content.

    Files ending in .sources are deb822; everything else is one-line format.
    """
    files: list[tuple[str, list[str]]] = []
    for line in _lines(output):
        if line.startswith("==> "):
            files.append((line[4:].strip(), []))
        elif files:
            files[-1][1].append(line)
        elif line.strip():
            raise ParseError(f"apt source content before any file header: {line!r}")
    out: list[AptSource] = []
    for path, lines in files:
        if path.endswith(".sources"):
            out.extend(_parse_deb822(path, lines))
            continue
        entries = [e for n, raw in enumerate(lines, start=1) if (e := _parse_one_line(path, n, raw)) is not None]
        out.extend(
            AptSource(**{**asdict(e), "stanzas_in_file": len(entries)})  # type: ignore[arg-type]
            for e in entries
        )
    return tuple(out)


# --------------------------------------------------------------------------------------------
# /dev/nvidia* character devices and /dev/char links


@dataclass(frozen=True)
class DevCharState(_Jsonable):
    devices: dict[str, str]  # "/dev/nvidia0" -> "195:0"
    links: dict[str, str]  # "195:0" -> link target

    @property
    def missing(self) -> tuple[str, ...]:
        """Devices with no /dev/char/MAJOR:MINOR link pointing at them."""
        return tuple(
            sorted(dev for dev, num in self.devices.items() if self.links.get(num) != dev)
        )


def parse_dev_char(output: str | Iterable[str]) -> DevCharState:
    """Parse lines `dev HEXMAJOR HEXMINOR /dev/nvidiaX` and `link MAJOR:MINOR TARGET`."""
    devices: dict[str, str] = {}
    links: dict[str, str] = {}
    for line in _lines(output):
        parts = line.split()
        if not parts:
            continue
        if parts[0] == "dev" and len(parts) == 4:
            devices[parts[3]] = f"{int(parts[1], 16)}:{int(parts[2], 16)}"
        elif parts[0] == "link" and len(parts) == 3:
            links[parts[1]] = parts[2]
        else:
            raise ParseError(f"unexpected line: {line!r}")
    return DevCharState(devices=devices, links=links)


# --------------------------------------------------------------------------------------------
# /etc/os-release


@dataclass(frozen=True)
class OsInfo(_Jsonable):
    id: str  # "ubuntu"
    version_id: str  # "24.04"
    codename: str | None  # "noble"
    pretty_name: str | None

    @property
    def key(self) -> str:
        """The form preflight_os_allowed lists: "ubuntu 24.04"."""
        return f"{self.id} {self.version_id}"

    @property
    def cuda_repo_distro(self) -> str:
        """NVIDIA's CUDA repository directory name: "ubuntu2404", "debian12"."""
        return f"{self.id}{self.version_id.replace('.', '')}"


def parse_os_release(output: str | Iterable[str]) -> OsInfo:
    values: dict[str, str] = {}
    for line in _lines(output):
        key, sep, value = line.partition("=")
        if sep:
            values[key.strip()] = value.strip().strip('"').strip("'")
    if "ID" not in values or "VERSION_ID" not in values:
        raise ParseError("os-release has no ID or VERSION_ID")
    codename = values.get("VERSION_CODENAME") or values.get("UBUNTU_CODENAME") or None
    return OsInfo(values["ID"].lower(), values["VERSION_ID"], codename, values.get("PRETTY_NAME"))


# --------------------------------------------------------------------------------------------
# /var/run/reboot-required(.pkgs)


@dataclass(frozen=True)
class PendingReboot(_Jsonable):
    required: bool
    packages: tuple[str, ...]


def parse_reboot_required(output: str | Iterable[str]) -> PendingReboot:
    """Parse `reboot-required` (the flag line) and `pkg <name>` lines from reboot-required.pkgs."""
    required = False
    packages: list[str] = []
    for line in _lines(output):
        if line.strip() == "reboot-required":
            required = True
        elif line.startswith("pkg "):
            name = line[4:].strip()
            if name and name not in packages:
                packages.append(name)
    return PendingReboot(required=required, packages=tuple(packages))
