"""fake_responses for the rigup.facts.gpu commands (GPU memory in use, driver CUDA, topology), from the
captures in tests/fixtures/fit, for pyinfra @fake hosts (tests/tasks/test_hostlayer_fake.py,
tests/cli/test_doctor.py). Put these entries first: the fake connector answers with the first
matcher contained in the command, and "nvidia-smi --query-gpu" would match GpuMemoryUse too."""

from __future__ import annotations

from pathlib import Path
from typing import Any

FIT = Path(__file__).resolve().parents[1] / "fixtures" / "fit"
ABSENT = "@rigup-absent"  # rigup.facts.util marker for "the tool is not installed"
SECTION = "@rigup-section"
ONE_GPU_TOPO = "\tGPU0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\nGPU0\t X \t0-23\t0\t\tN/A\n"


def fit_text(rel: str) -> str:
    return (FIT / rel).read_text()


def fit_responses(kind: str, memory: str | None = None, cuda: str | None = None) -> dict[str, Any]:
    """kind: "converged" (2x3090 on 580, PCIe without P2P), "one-gpu" (1x3090 on 550) or anything
    else (fresh: no nvidia-smi). memory: `--query-gpu=index,uuid,name,memory.total,memory.used,
    compute_cap` lines instead of the kind's; cuda: the driver's "CUDA Version" instead of the kind's."""
    capabilities = {"pid1=$(cat /proc/1/comm": fit_text("../capabilities/booted-sudo-user.txt").splitlines()}
    if kind == "converged":
        mem = memory if memory is not None else fit_text("2x3090-pcie/memory.csv")
        topo = fit_text("2x3090-pcie/topo.txt") + f"\n{SECTION}\n" + fit_text("2x3090-pcie/p2p.txt")
        version = cuda or "13.0"
    elif kind == "one-gpu":
        mem = memory if memory is not None else fit_text("2x3090-pcie/memory.csv").splitlines()[0]
        topo = ONE_GPU_TOPO + f"{SECTION}\n"
        version = cuda or "12.4"
    else:
        return {**capabilities, "memory.total,memory.used": ABSENT, "nvidia-smi topo -m": ABSENT, "CUDA Version": ABSENT}
    return {
        **capabilities,
        # sections: memory query, compute apps, our container's pid, process ancestry
        "memory.total,memory.used": (mem.strip() + f"\n{SECTION}\n{SECTION}\n{SECTION}\n").splitlines(),
        "nvidia-smi topo -m": topo.splitlines(),
        "CUDA Version": [f"CUDA Version        : {version}"],
    }


def offline_lock(host_data: dict[str, Any], path: Path) -> Path:
    """Write a lock file that satisfies every need of the host's variant (each pod's) and its GPU exporter, with made-up
    commits and hashes (no network): enough for rigup.desired.plan.host_plan, which only compares names and refs."""
    from rigup.desired.lock import (
        SHA40,
        FilePin,
        GitNeed,
        GitPin,
        ImagePin,
        LockFile,
        ModelNeed,
        ModelPin,
    )
    from rigup.desired.needs import exporter_needs, needs_for
    from rigup.desired.recipe import pods_of, resolve

    pods = [pod for pod in pods_of(host_data) if pod.listed]  # a host that lists pods (or a cluster member) resolves each
    recipes = [resolve(host_data, None, pod=pod) for pod in pods] or [resolve(host_data, None)]
    lock = LockFile()
    for need in [*(n for recipe in recipes for n in needs_for(recipe, host_data)), *exporter_needs(host_data)]:
        if isinstance(need, GitNeed):
            commit = need.ref if SHA40.match(need.ref) else "a" * 40
            lock.git[need.name] = GitPin(need.name, need.url, need.ref, commit)
        elif isinstance(need, ModelNeed):
            commit = need.revision if SHA40.match(need.revision) else "b" * 40
            files = (FilePin("config.json", 2, "c" * 64),)
            lock.models[need.name] = ModelPin(need.name, need.repo_id, need.revision, commit, files)
        else:
            lock.images[need.name] = ImagePin(need.name, need.repository, need.tag, "sha256:" + "d" * 64)
    lock.save(path)
    return path
