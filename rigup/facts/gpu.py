"""Facts about the GPUs: what nvidia-smi and lspci report, the memory other processes use, the CUDA
version the loaded driver supports, and the NVLink/PCIe topology. Parsing is in rigup/parsers/; which
GPU processes are rigup's own (their memory counts as free) is worked out here."""

from __future__ import annotations

import shlex
from collections.abc import Iterable, Sequence

from pyinfra.api import FactBase, FactProcessError

from rigup.facts.util import SECTION_MARKER, parse_fact_output, run_if_installed, split_sections, tool_absent
from rigup.parsers.lspci import DISPLAY_CLASSES, NVIDIA_VENDOR_ID, PciDevice, parse_lspci
from rigup.parsers.nvidia_smi import (
    APPS_QUERY_FIELDS,
    GPU_QUERY_FIELDS,
    MEMORY_QUERY_FIELDS,
    ComputeApp,
    FitParseError,
    GpuState,
    SmiQuery,
    parse_compute_apps,
    parse_driver_cuda,
    parse_gpu_query,
    parse_memory_query,
    smi_failure,
)
from rigup.parsers.topology import Topology, TopologyError, parse_topo_p2p, topology


class NvidiaGpus(FactBase[SmiQuery | None]):
    """
    GPUs as ``nvidia-smi --query-gpu`` reports them, or why it could not.

    .. code:: python

        SmiQuery(status="ok", gpus=(Gpu(index=0, name="NVIDIA GeForce RTX 3090",
                 compute_capability=(8, 6), memory_mib=24576, power_limit_w=230.0, ...), ...))
        SmiQuery(status="mismatch", message="Failed to initialize NVML: Driver/library version mismatch")
        None  # nvidia-smi is not installed
    """

    def command(self) -> str:
        query = ",".join(GPU_QUERY_FIELDS)
        # stderr is merged: the failure text (no driver, mismatch) is the information.
        return run_if_installed("nvidia-smi", f"nvidia-smi --query-gpu={query} --format=csv,noheader,nounits 2>&1 || true")

    def process(self, output: list[str]) -> SmiQuery | None:
        if tool_absent(output):
            return None
        return parse_fact_output(output, parse_gpu_query)


class PciGpus(FactBase[tuple[PciDevice, ...] | None]):
    """
    NVIDIA display devices from ``lspci -D -nn -k`` (works before any driver is loaded).

    .. code:: python

        (PciDevice(bus_id="0000:01:00.0", class_code="0300", vendor_id="10de", device_id="2204",
                   description="NVIDIA Corporation GA102 [GeForce RTX 3090]", driver_in_use="nouveau"),)
        None  # lspci (pciutils) is not installed
    """

    def command(self) -> str:
        return run_if_installed("lspci", "lspci -D -nn -k 2>/dev/null || true")

    def process(self, output: list[str]) -> tuple[PciDevice, ...] | None:
        if tool_absent(output):
            return None
        devices = parse_fact_output(output, parse_lspci)
        return tuple(d for d in devices if d.vendor_id == NVIDIA_VENDOR_ID and d.class_code in DISPLAY_CLASSES)


def own_pids(container_pids: int | Iterable[int] | None, chains: Iterable[Sequence[int]]) -> frozenset[int]:
    """GPU processes of rigup's own containers: those whose ancestry (pid, parent, ...) holds one of
    their init pids (a stopped container has pid 0 or none)."""
    if isinstance(container_pids, int):
        container_pids = (container_pids,)
    roots = {pid for pid in container_pids or () if pid}
    if not roots:
        return frozenset()
    return frozenset(chain[0] for chain in chains if chain and roots.intersection(chain))


def exclude_own(gpus: Sequence[GpuState], apps: Iterable[ComputeApp], own: Iterable[int]) -> tuple[GpuState, ...]:
    """memory_used_mib minus what this variant's own processes hold (a running rigup container is
    replaced by the deploy, so its memory counts as free)."""
    own_set = set(own)
    by_uuid: dict[str, int] = {}
    for app in apps:
        if app.pid in own_set and app.used_mib is not None:
            by_uuid[app.gpu_uuid] = by_uuid.get(app.gpu_uuid, 0) + app.used_mib
    out = []
    for g in gpus:
        used = g.memory_used_mib
        if used is not None and g.uuid in by_uuid:
            used = max(0, used - by_uuid[g.uuid])
        out.append(GpuState(g.index, g.name, g.memory_total_mib, used, g.compute_cap, g.uuid))
    return tuple(out)


# The ancestry of each GPU process ("pid parent grandparent ..." per line), to find our own containers'.
# $apps holds the compute-apps query already printed; each parent comes from /proc/<pid>/status with
# shell builtins (an awk per step was a fork per ancestor).
_PID = f"${APPS_QUERY_FIELDS.index('pid') + 1}"  # awk's field of the pid in that query
_CHAINS = (
    f"""for p in $(printf '%s\\n' "$apps" | awk -F', *' '{_PID} != "" && !seen[{_PID}]++ {{print {_PID}}}'); do """
    'q=$p; chain=""; n=0; '
    'while [ -n "$q" ] && [ "$q" -gt 1 ] 2>/dev/null && [ $n -lt 64 ]; do '
    'chain="$chain $q"; n=$((n+1)); next=""; '
    'while read -r key value; do if [ "$key" = "PPid:" ]; then next=$value; break; fi; done 2>/dev/null </proc/$q/status; '
    'q=$next; done; '
    'echo "$chain"; done'
)


class GpuMemoryUse(FactBase[tuple[GpuState, ...] | None]):
    """
    Each GPU's memory total and the memory other processes hold, for ``rigup.checks.fit.assess``. Memory of
    the containers named (every rigup variant's) counts as free: a converge replaces this variant's
    container and stops the others before it starts (one variant owns the GPUs).

    .. code:: python

        (GpuState(index=0, name="NVIDIA GeForce RTX 3090", memory_total_mib=24576, memory_used_mib=512,
                  compute_cap=(8, 6), uuid="GPU-..."), ...)
        None  # nvidia-smi missing or the driver not answering
    """

    def command(self, container_names: tuple[str, ...]) -> str:
        gpu_query = ",".join(MEMORY_QUERY_FIELDS)
        apps_query = ",".join(APPS_QUERY_FIELDS)
        names = "|".join(shlex.quote(n) for n in container_names) or "''"
        # nvidia-smi runs twice (its slowest part is starting), docker only when a GPU process exists.
        # `docker ps` names the running containers, and only those of ours are inspected: naming every
        # variant's container to `docker inspect` costs the engine one lookup per name.
        own_container_pids = (
            'own=""; for n in $(docker ps --format \'{{.Names}}\' 2>/dev/null); do '
            f'case "$n" in {names}) own="$own $n";; esac; done; '
            '[ -z "$own" ] || docker inspect --type container --format \'{{.State.Pid}}\' $own 2>/dev/null'
        )
        return run_if_installed("nvidia-smi",
            f"nvidia-smi --query-gpu={gpu_query} --format=csv,noheader,nounits 2>&1; echo {SECTION_MARKER}; "
            f"apps=$(nvidia-smi --query-compute-apps={apps_query} --format=csv,noheader,nounits 2>/dev/null); "
            f'[ -z "$apps" ] || printf \'%s\\n\' "$apps"; echo {SECTION_MARKER}; '
            f'if [ -n "$apps" ]; then {own_container_pids}; fi; '
            f"echo {SECTION_MARKER}; {_CHAINS}; true"
        )

    def process(self, output: list[str]) -> tuple[GpuState, ...] | None:
        if tool_absent(output):
            return None
        parts = split_sections(output) + [[], [], []]
        try:
            gpus = parse_memory_query(parts[0])
            apps = parse_compute_apps(parts[1])
        except FitParseError as exc:
            if smi_failure(parts[0] + parts[1]) is not None:
                return None  # no driver, a version mismatch: the NvidiaGpus fact says why
            raise FactProcessError(str(exc)) from exc
        container_pids = [int(p) for p in " ".join(parts[2]).split() if p.isdigit() and int(p) > 0]
        chains = [[int(p) for p in line.split() if p.isdigit()] for line in parts[3]]
        return exclude_own(gpus, apps, own_pids(container_pids, chains))


class DriverCudaVersion(FactBase[str | None]):
    """The CUDA version the loaded driver supports ("13.0"), as nvidia-smi reports it; None without one."""

    def command(self) -> str:
        return run_if_installed("nvidia-smi", "nvidia-smi --version 2>/dev/null | grep -i 'CUDA Version' || nvidia-smi 2>&1 | head -n 6 || true")

    def process(self, output: list[str]) -> str | None:
        if tool_absent(output):
            return None
        version = parse_driver_cuda(output)
        if version is None and smi_failure(output) is None:
            raise FactProcessError(f"no CUDA version in nvidia-smi's output: {output[:3]!r}")
        return version


class GpuTopology(FactBase[Topology | None]):
    """``nvidia-smi topo -m`` and ``topo -p2p r`` as a rigup.parsers.topology.Topology; None without a driver."""

    def command(self) -> str:
        return run_if_installed("nvidia-smi", f"nvidia-smi topo -m 2>&1; echo {SECTION_MARKER}; nvidia-smi topo -p2p r 2>&1; true")

    def process(self, output: list[str]) -> Topology | None:
        if tool_absent(output):
            return None
        parts = split_sections(output) + [[]]
        try:
            topo = topology(parts[0])
        except TopologyError as exc:
            if smi_failure(parts[0]) is not None:
                return None  # no driver yet: the gpu_interconnect knob decides
            raise FactProcessError(str(exc)) from exc
        try:
            p2p = parse_topo_p2p(parts[1])
        except TopologyError:
            return topo  # older drivers without -p2p: the matrix alone decides
        return Topology(topo.gpus, topo.links, p2p)

