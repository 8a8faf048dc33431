"""The fit (rigup.checks.fit.assess) inside the preflight checks: table-tested on host situations built from
the captures (tests/fixtures, tests/fixtures/fit), plus the recipe every phase shares (host_recipe)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rigup.checks.preflight import Check, HostFacts, host_recipe, run_checks
from rigup.desired.recipe import resolve
from rigup.facts.gpu import GpuMemoryUse
from rigup.parsers.lspci import PciDevice, parse_lspci
from rigup.parsers.topology import Topology
from tests.support.fit_fake import SECTION, offline_lock
from tests.support.hostlayer import converged_2x3090, fresh_2x3090, host_data, one_3090_on_550

FIT = Path(__file__).resolve().parents[1] / "fixtures" / "fit"


def memory(name: str):
    """What the GpuMemoryUse fact gives for a capture directory (this variant's container excluded)."""
    d = FIT / name
    parts = [(d / f).read_text() if (d / f).exists() else "" for f in ("memory.csv", "apps.csv", "container-pid.txt", "chains.txt")]
    return GpuMemoryUse().process(f"\n{SECTION}\n".join(parts).splitlines())


def pci(device: str, chip: str, count: int = 2) -> tuple[PciDevice, ...]:
    return parse_lspci(
        "".join(
            f"0000:0{i + 1}:00.0 VGA compatible controller [0300]: NVIDIA Corporation {chip} [10de:{device}] (rev a1)\n"
            for i in range(count)
        )
    )


RTX_3080 = pci("2206", "GA102 [GeForce RTX 3080]")
RTX_4070_TI = pci("2782", "AD104 [GeForce RTX 4070 Ti]")
NVLINK = Topology((0, 1), {(0, 1): "NV4", (1, 0): "NV4"})


def checks(facts: HostFacts, lock_problem: str | None = None, **data) -> dict[str, Check]:
    hd = host_data(**data)
    return {c.name: c for c in run_checks(facts, resolve(hd), hd, None, lock_problem)}


def status(c: Check | None) -> str | None:
    if c is None:
        return None
    return "ok" if c.ok else ("FAIL" if c.failed else ("warn" if c.severity == "warning" else "note"))


CASES = [
    # (id, facts, knobs, {check: "ok" | "FAIL" | "warn" | "note" | None (absent)})
    ("converged-2x3090", converged_2x3090(), {},
     {"cuda-compat": "ok", "gpu-layout": "ok", "vram-fit": "ok", "interconnect": "ok", "gpu-mix": None, "driver-cuda": "ok"}),
    ("loaded-driver-reports-cuda-12.4", converged_2x3090(driver_cuda="12.4"), {},
     {"cuda-compat": "FAIL", "driver-cuda": "ok"}),
    ("driver-upgrade-planned", one_3090_on_550(gpu_memory=memory("2x3090-pcie"), driver_cuda="12.4"), {},
     {"cuda-compat": None, "driver-cuda": "ok", "vram-fit": "ok"}),
    ("2x3080-20gb-loaded", converged_2x3090(gpu_memory=memory("2x3080-20g")), {}, {"vram-fit": "FAIL"}),
    ("2x3080-20gb-warn-policy", converged_2x3090(gpu_memory=memory("2x3080-20g")), {"preflight_vram_misfit": "warn"},
     {"vram-fit": "warn"}),
    ("busy-gpu", converged_2x3090(gpu_memory=memory("busy-3090")), {}, {"vram-fit": "FAIL"}),
    ("running-own-container-is-free", converged_2x3090(gpu_memory=memory("reconverge-3090")), {}, {"vram-fit": "ok"}),
    ("mixed-3090-3080", converged_2x3090(gpu_memory=memory("mixed-3090-3080")), {}, {"gpu-mix": "warn", "vram-fit": "FAIL"}),
    ("single-variant-on-two-gpus", converged_2x3090(), {"variant": "single"},
     {"gpu-layout": "warn", "interconnect": None}),
    ("fresh-2x3090-from-pci", fresh_2x3090(), {}, {"vram-fit": "ok", "cuda-compat": None, "gpu-layout": "ok"}),
    ("fresh-2x3080-ambiguous-pci-id", fresh_2x3090(pci=RTX_3080), {}, {"vram-fit": "warn", "gpu-layout": "ok"}),
    ("fresh-unknown-card", fresh_2x3090(pci=RTX_4070_TI), {}, {"vram-fit": "warn", "compute-capability": "warn"}),
    ("bad-misfit-knob", converged_2x3090(), {"preflight_vram_misfit": "sometimes"}, {"vram-policy": "FAIL"}),
    ("no-gpus", fresh_2x3090(pci=()), {}, {"gpus": "FAIL", "gpu-layout": None, "vram-fit": None}),
]


@pytest.mark.parametrize("facts,data,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_fit_checks(facts: HostFacts, data: dict, expected: dict[str, str | None]):
    found = checks(facts, **data)
    assert {name: status(found.get(name)) for name in expected} == expected
    assert "tensor-parallel" not in found and "vram" not in found  # the fit's gpu-layout / vram-fit replace them


def test_ambiguous_pci_id_says_when_vram_is_checked():
    vram = checks(fresh_2x3090(pci=RTX_3080))["vram-fit"]
    assert vram.message == (
        "VRAM unknown until the driver loads: GPU 0 (NVIDIA GeForce RTX 3080): boards with 10 GB and 20 GB share "
        "PCI device id 2206; re-checked after the driver's reboot, before Docker and the model are set up"
    )
    assert vram.key == "preflight_vram_misfit" and vram.severity == "warning"
    never = checks(fresh_2x3090(pci=RTX_3080), driver_reboot="never")["vram-fit"]
    assert never.message.endswith("re-checked by the next deploy once the host has been rebooted onto the driver (driver_reboot: never)")
    unknown = checks(fresh_2x3090(pci=RTX_4070_TI))
    assert "GPU 0 (NVIDIA GeForce RTX 4070 Ti): PCI id 10de:2782 is not in rigup's table of cards" in unknown["vram-fit"].message
    assert "re-checked after the driver's reboot" in unknown["compute-capability"].message


def test_pre_driver_fit_says_where_the_memory_came_from():
    vram = checks(fresh_2x3090())["vram-fit"]
    assert vram.message.startswith("no driver yet, memory from the PCI ids: variant 'dual' fits")
    assert "24576 MiB, memory in use unknown, taken as 0" in vram.message


def test_loaded_driver_too_old_for_the_image():
    cuda = checks(converged_2x3090(driver_cuda="12.4"))["cuda-compat"]
    assert cuda.failed and cuda.key == "nvidia_driver_branch"
    assert cuda.message.startswith("the driver supports CUDA 12.4 but docker.io/vllm/vllm-openai:")
    assert cuda.fix == "install driver branch 580 or newer (nvidia_driver_branch: 580)"


def test_misfit_names_cards_and_fix():
    vram = checks(converged_2x3090(gpu_memory=memory("busy-3090")))["vram-fit"]
    assert "GPU 1 (NVIDIA GeForce RTX 3090): 24576 MiB, 2049 MiB in use by other processes" in vram.message
    assert vram.fix == "use variant 'dual-turbo' (max_model_len 262144 at gpu_memory_utilization 0.85)"
    assert vram.describe("rig-03").startswith("rig-03: vram-fit: variant 'dual'")


def test_lock_problem_is_a_warning():
    lock = checks(converged_2x3090(), lock_problem="rigs.lock.yaml: lock file not found")["lock"]
    assert (lock.ok, lock.failed, lock.key) == (False, False, "lock_file")
    assert lock.message == "checked against the catalog's refs: rigs.lock.yaml: lock file not found"
    assert "lock" not in checks(converged_2x3090())


def test_host_facts_with_fit_facts_are_json():
    doc = json.loads(json.dumps(converged_2x3090().to_json()))
    assert doc["driver_cuda"] == "13.0"
    assert doc["gpu_memory"][1]["memory_used_mib"] == 1 and doc["gpu_memory"][1]["compute_cap"] == [8, 6]
    assert doc["topology"]["links"] == {"0-1": "PHB", "1-0": "PHB"} and doc["topology"]["p2p"]["0-1"] == "NS"


# -- the recipe every phase builds -----------------------------------------------------------


def test_host_recipe_uses_the_lock_and_the_topology(tmp_path: Path):
    data = host_data(lock_file=str(tmp_path / "rigs.lock.yaml"))
    offline_lock(data, tmp_path / "rigs.lock.yaml")
    built = host_recipe(data, "rig-01", NVLINK)
    assert built.error is None and built.lock_problem is None
    assert built.recipe.image.digest == "sha256:" + "d" * 64  # pinned by the lock
    assert built.recipe.interconnect is not None and built.recipe.interconnect.nvlink
    assert "--disable-custom-all-reduce" not in built.recipe.vllm_args
    pcie = host_recipe(data, "rig-01", None).recipe
    assert "--disable-custom-all-reduce" in pcie.vllm_args  # nothing detected: the catalog's PCIe-safe settings


def test_host_recipe_without_a_lock_falls_back_to_the_catalog(tmp_path: Path):
    data = host_data(lock_file=str(tmp_path / "missing.lock.yaml"))
    built = host_recipe(data, "rig-01", None)
    assert built.recipe is not None and built.recipe.image.digest is None
    assert built.lock_problem and "lock file not found" in built.lock_problem
    bad = host_recipe(host_data(variant="nope", lock_file=str(tmp_path / "x")), "rig-01", None)
    assert bad.recipe is None and bad.error and "unknown variant 'nope'" in bad.error
