"""The facts preflight's checks judge (rigup.checks.preflight.HostFacts), read from one host through
pyinfra; the checks themselves stay pure functions of what is read here."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from rigup.checks.driver_plan import DriverWant
from rigup.checks.preflight import HostFacts, disk_paths, recipe_list
from rigup.desired.catalog import rigup_container_names
from rigup.desired.knobs import knob
from rigup.desired.trust import https_urls, origins
from rigup.facts.docker import DockerEngineInfo, DockerImage, DockerSnap
from rigup.facts.driver import NvidiaKernelModule, NvidiaPackages, PrebuiltNvidiaModules
from rigup.facts.gpu import DriverCudaVersion, GpuMemoryUse, GpuTopology, NvidiaGpus, PciGpus
from rigup.facts.network import HttpsTrust
from rigup.facts.serving import RigupVariantUnits
from rigup.facts.system import FreeDisk, OsReleaseInfo, PathSizes, RebootPending, SecureBoot
from rigup.parsers.topology import Topology

FactGetter = Callable[..., Any]
_UNREAD: Any = object()  # `topology` not passed: read it here (None is a reading: no driver)


def gather(
    get_fact: FactGetter, host_data: Mapping[str, Any], recipe: Any | None, topology: Topology | None = _UNREAD
) -> HostFacts:
    """Read every fact the checks need through `get_fact(FactClass, **kwargs)` (host.get_fact).
    `recipe`: the host's recipe, or the list of its pods' recipes. `topology`: GpuTopology when the
    caller read it already (to build the recipe)."""
    recipes = recipe_list(recipe)
    try:
        want = DriverWant.from_data(host_data)
    except ValueError:
        want = None
    docker = get_fact(DockerEngineInfo)
    paths = disk_paths(host_data, docker)
    present: dict[str, int] = {}
    if recipes:
        wanted = sorted({*(m.path for r in recipes for m in r.models), *(s.path for r in recipes for s in r.sources)})
        present.update(get_fact(PathSizes, paths=wanted))
        if docker is not None and docker.running:
            for ref in dict.fromkeys(r.image.ref for r in recipes):
                image = get_fact(DockerImage, ref=ref)
                present[ref] = image.size if image is not None else 0
    # Memory rigup's own containers hold counts as free: the converge replaces them, and stops those of
    # variant units it no longer runs (a pod renamed or dropped: rigup-<unit's name>).
    installed = get_fact(RigupVariantUnits, install_root=str(knob(host_data, "install_root"))) if recipes else {}
    leftover = tuple(unit[: -len(".service")] for unit in sorted(installed or {}))
    tls_origins = origins(https_urls(host_data))
    own = tuple(dict.fromkeys((*rigup_container_names(), *(r.container_name for r in recipes), *leftover)))
    return HostFacts(
        os=get_fact(OsReleaseInfo),
        smi=get_fact(NvidiaGpus),
        pci=get_fact(PciGpus),
        loaded=get_fact(NvidiaKernelModule),
        packages=get_fact(NvidiaPackages),
        secure_boot=get_fact(SecureBoot),
        prebuilt=(
            get_fact(PrebuiltNvidiaModules, branch_flavour=want.branch_flavour)
            if want is not None and want.source == "ubuntu"
            else None
        ),
        docker=docker,
        docker_snap=bool(get_fact(DockerSnap)),
        pending_reboot=get_fact(RebootPending),
        disk=get_fact(FreeDisk, paths=sorted(set(paths.values()))),
        present_bytes=present,
        gpu_memory=get_fact(GpuMemoryUse, container_names=own) if recipes else None,
        driver_cuda=get_fact(DriverCudaVersion),
        topology=get_fact(GpuTopology) if topology is _UNREAD else topology,
        tls=get_fact(HttpsTrust, origins=tls_origins) if tls_origins else None,
    )
