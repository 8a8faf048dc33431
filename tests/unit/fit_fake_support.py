"""fake_responses for the rigup.fitfacts commands (GPU memory in use, driver CUDA, topology), from the
captures in tests/fixtures/fit, for pyinfra @fake hosts (tests/unit/test_hostlayer_tasks_fake.py,
tests/unit/test_doctor.py). Put these entries first: the fake connector answers with the first
matcher contained in the command, and "nvidia-smi --query-gpu" would match GpuMemoryUse too."""

from __future__ import annotations

from pathlib import Path
from typing import Any

FIT = Path(__file__).resolve().parents[1] / "fixtures" / "fit"
ABSENT = "@rigup-no-nvidia-smi"  # rigup.fitfacts' marker for "nvidia-smi is not installed"
SECTION = "@rigup-section"
ONE_GPU_TOPO = "\tGPU0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\nGPU0\t X \t0-23\t0\t\tN/A\n"


def fit_text(rel: str) -> str:
    return (FIT / rel).read_text()


def fit_responses(kind: str, memory: str | None = None, cuda: str | None = None) -> dict[str, Any]:
    """kind: "converged" (2x3090 on 580, PCIe without P2P), "one-gpu" (1x3090 on 550) or anything
    else (fresh: no nvidia-smi). memory: `--query-gpu=index,uuid,name,memory.total,memory.used,
    compute_cap` lines instead of the kind's; cuda: the driver's "CUDA Version" instead of the kind's."""
    if kind == "converged":
        mem = memory if memory is not None else fit_text("2x3090-pcie/memory.csv")
        topo = fit_text("2x3090-pcie/topo.txt") + f"\n{SECTION}\n" + fit_text("2x3090-pcie/p2p.txt")
        version = cuda or "13.0"
    elif kind == "one-gpu":
        mem = memory if memory is not None else fit_text("2x3090-pcie/memory.csv").splitlines()[0]
        topo = ONE_GPU_TOPO + f"{SECTION}\n"
        version = cuda or "12.4"
    else:
        return {"memory.total,memory.used": ABSENT, "nvidia-smi topo -m": ABSENT, "CUDA Version": ABSENT}
    return {
        # sections: memory query, compute apps, our container's pid, process ancestry
        "memory.total,memory.used": (mem.strip() + f"\n{SECTION}\n{SECTION}\n{SECTION}\n").splitlines(),
        "nvidia-smi topo -m": topo.splitlines(),
        "CUDA Version": [f"CUDA Version        : {version}"],
    }


def offline_lock(host_data: dict[str, Any], path: Path) -> Path:
    """Write a lock file that satisfies every need of the host's variant, with made-up commits and
    hashes (no network): enough for rigup.lock.locked_recipe, which only compares names and refs."""
    from rigup import lock as lk
    from rigup.recipe import resolve

    lock = lk.LockFile()
    for need in lk.needs_for(resolve(host_data, None), host_data):
        if isinstance(need, lk.GitNeed):
            commit = need.ref if lk.SHA40.match(need.ref) else "a" * 40
            lock.git[need.name] = lk.GitPin(need.name, need.url, need.ref, commit)
        elif isinstance(need, lk.ModelNeed):
            commit = need.revision if lk.SHA40.match(need.revision) else "b" * 40
            files = (lk.FilePin("config.json", 2, "c" * 64),)
            lock.models[need.name] = lk.ModelPin(need.name, need.repo_id, need.revision, commit, files)
        else:
            lock.images[need.name] = lk.ImagePin(need.name, need.repository, need.tag, "sha256:" + "d" * 64)
    lock.save(path)
    return path
