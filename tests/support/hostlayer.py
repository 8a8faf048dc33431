"""Host situations built from the captures in tests/fixtures, for the preflight and operation tests."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from rigup.checks.preflight import HostFacts
from rigup.desired.knobs import load_defaults
from rigup.facts.driver import PrebuiltModules
from rigup.parsers.apt import AptPolicy
from rigup.parsers.docker import parse_docker_info
from rigup.parsers.dpkg import parse_dpkg_query
from rigup.parsers.lspci import parse_lspci
from rigup.parsers.nvidia_smi import parse_gpu_query, parse_memory_query
from rigup.parsers.system import DiskFree, PendingReboot, parse_nvidia_version_file, parse_os_release
from rigup.parsers.topology import topology

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
GB = 10**9


def fx(rel: str) -> str:
    return (FIXTURES / rel).read_text()


def disk(avail_gb: float, mount: str = "/", filesystem: str = "/dev/nvme0n1p2", paths: tuple[str, ...] = ()) -> dict:
    paths = paths or ("/opt/rigup", "/opt/rigup/models", "/var/lib/docker")
    return {
        p: DiskFree(p, p, filesystem, mount, int(2000 * GB), int(avail_gb * GB))
        for p in paths
    }


def prebuilt(available: bool, branch_flavour: str = "580-open", kernel: str = "6.8.0-45-generic") -> PrebuiltModules:
    abi = f"linux-modules-nvidia-{branch_flavour}-{kernel}"
    meta = f"linux-modules-nvidia-{branch_flavour}-generic"
    policy = {abi: AptPolicy(None, "6.8.0-45.45+1"), meta: AptPolicy(None, "6.8.0-45.45+1")} if available else {}
    return PrebuiltModules(kernel, abi, (meta,), policy)


def fresh_2x3090(**changes: Any) -> HostFacts:
    """Ubuntu 24.04, two RTX 3090 on nouveau, nothing installed."""
    facts = HostFacts(
        os=parse_os_release(fx("os-release/ubuntu-24.04.txt")),
        smi=None,
        pci=tuple(
            d for d in parse_lspci(fx("lspci/2x3090-nouveau.txt")) if d.vendor_id == "10de" and d.class_code == "0300"
        ),
        loaded=None,
        packages=parse_dpkg_query(fx("dpkg/fresh.txt")),
        secure_boot="disabled",
        prebuilt=prebuilt(True),
        docker=None,
        docker_snap=False,
        pending_reboot=PendingReboot(False, ()),
        disk=disk(300),
        present_bytes={},
    )
    return dataclasses.replace(facts, **changes)


def converged_2x3090(**changes: Any) -> HostFacts:
    """Driver 580 open installed, held, loaded (CUDA 13.0); Docker with the nvidia runtime; the two
    cards idle under the CPU's host bridge (fit facts from tests/fixtures/fit/2x3090-pcie)."""
    fit = FIXTURES / "fit" / "2x3090-pcie"
    facts = fresh_2x3090(
        smi=parse_gpu_query(fx("nvidia-smi/2x3090-580-capped.csv")),
        loaded=parse_nvidia_version_file(fx("proc-nvidia-version/open-580.txt")),
        packages=parse_dpkg_query(fx("dpkg/580-open-held.txt")),
        docker=parse_docker_info(fx("docker-info/with-nvidia.json")),
        gpu_memory=parse_memory_query((fit / "memory.csv").read_text()),
        driver_cuda="13.0",
        topology=topology((fit / "topo.txt").read_text(), (fit / "p2p.txt").read_text()),
    )
    return dataclasses.replace(facts, **changes)


def one_3090_on_550(**changes: Any) -> HostFacts:
    facts = fresh_2x3090(
        smi=parse_gpu_query(fx("nvidia-smi/1x3090-550.csv")),
        pci=tuple(d for d in parse_lspci(fx("lspci/1x3090-nvidia.txt")) if d.class_code == "0300"),
        loaded=parse_nvidia_version_file(fx("proc-nvidia-version/proprietary-550.txt")),
        packages=parse_dpkg_query(fx("dpkg/550-proprietary-held.txt")),
    )
    return dataclasses.replace(facts, **changes)


def host_data(**changes: Any) -> dict[str, Any]:
    data = load_defaults()
    data.update(changes)
    return data
