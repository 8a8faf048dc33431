"""rigup.checks.fit: VRAM fit, CUDA compatibility and GPU layout, table-tested against the catalog's numbers.

Expected values are typed in from the catalog's measurements (upstream-facts.md §1.2-§1.3, §6-§7):
dual = 262144 tokens at 0.92 with a 23.6 GB/card peak, dual-turbo = 0.85 / 19.8 GB, single's envelopes
48K/0.92 ... 192K/0.98, all measured on 24576 MiB RTX 3090s. Budgets below are u x memory.total.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from rigup.checks.fit import Finding, assess, branch_for_cuda, cuda_compat, gpu_state
from rigup.desired.knobs import load_defaults
from rigup.desired.recipe import Recipe, RecipeError, resolve
from rigup.facts.gpu import DriverCudaVersion, GpuMemoryUse, GpuTopology, exclude_own, own_pids
from rigup.parsers.nvidia_smi import (
    GPU_QUERY_FIELDS,
    ComputeApp,
    FitParseError,
    GpuState,
    parse_compute_apps,
    parse_driver_cuda,
    parse_gpu_query,
    parse_memory_query,
)
from rigup_testbed import STANDINS_DIR
from rigup_testbed import hardware as hw

FIT = Path(__file__).resolve().parents[1] / "fixtures" / "fit"
SHARED = Path("/work/shared/fixtures/nvidia-smi/ubuntu24.04-2xH200-580.159.04")
STANDINS = STANDINS_DIR


def text(rel: str) -> str:
    return (FIT / rel).read_text()


def recipe(variant: str = "dual", **overrides: Any) -> Recipe:
    data = load_defaults()
    data.update(variant=variant, variant_overrides=overrides)
    return resolve(data)


def card(total: int, used: int | None = 1, name: str = "NVIDIA GeForce RTX 3090", index: int = 0) -> dict[str, Any]:
    return {"index": index, "name": name, "memory_total_mib": total, "memory_used_mib": used, "compute_cap": "8.6"}


def rtx3090(used: int | None = 1, index: int = 0) -> dict[str, Any]:
    return card(24576, used, index=index)


def by_name(findings: list[Finding]) -> dict[str, Finding]:
    out: dict[str, Finding] = {}
    for f in findings:
        assert f.name not in out, f"duplicate finding {f.name}"
        out[f.name] = f
    return out


def vram(rec: Recipe, gpus: list[Any], cuda: str | None = "13.0", policy: str = "fail") -> Finding:
    return by_name(assess(rec, gpus, cuda, policy))["vram-fit"]


# --- parsers ------------------------------------------------------------------------------------


def test_memory_query_and_compute_apps() -> None:
    gpus = parse_memory_query(text("busy-3090/memory.csv"))
    assert [(g.index, g.memory_total_mib, g.memory_used_mib, g.compute_cap) for g in gpus] == [
        (0, 24576, 1, (8, 6)), (1, 24576, 2049, (8, 6))]
    assert gpus[1].uuid == "GPU-a91d4e07-2c58-4b6e-8f0d-73e2b5c1d846"
    assert parse_compute_apps(text("busy-3090/apps.csv")) == (
        ComputeApp("GPU-a91d4e07-2c58-4b6e-8f0d-73e2b5c1d846", 2177, 1630),)
    assert parse_compute_apps("") == ()
    assert parse_compute_apps("GPU-x, 12, [N/A]\n") == (ComputeApp("GPU-x", 12, None),)
    with pytest.raises(FitParseError):
        parse_memory_query("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.")
    with pytest.raises(FitParseError):
        parse_memory_query("0, GPU-x, NVIDIA GeForce RTX 3090, lots, 1, 8.6")


def test_own_container_memory_is_not_counted() -> None:
    gpus = parse_memory_query(text("reconverge-3090/memory.csv"))
    apps = parse_compute_apps(text("reconverge-3090/apps.csv"))
    chains = [[int(p) for p in line.split()] for line in text("reconverge-3090/chains.txt").splitlines()]
    own = own_pids(int(text("reconverge-3090/container-pid.txt")), chains)
    assert own == {4242, 4300}
    freed = exclude_own(gpus, apps, own)
    assert [g.memory_used_mib for g in freed] == [2, 420]  # the desktop's 418 MiB + 2 stay on GPU 1
    assert own_pids(None, chains) == frozenset()
    # Several rigup containers (a variant switch): each one's processes count as ours; pid 0 is a
    # stopped container and matches nothing.
    assert own_pids([0, int(text("reconverge-3090/container-pid.txt"))], chains) == {4242, 4300}
    assert own_pids([0], chains) == frozenset()
    # Someone else's process is never subtracted.
    busy = parse_memory_query(text("busy-3090/memory.csv"))
    others = parse_compute_apps(text("busy-3090/apps.csv"))
    assert exclude_own(busy, others, own_pids(4100, [[2177, 2150, 1990, 1]])) == busy


def test_real_h200_memory_query_and_empty_apps() -> None:
    gpus = parse_memory_query(text("h200-nvlink/memory.csv"))
    assert [(g.index, g.name, g.memory_total_mib, g.memory_used_mib, g.compute_cap) for g in gpus] == [
        (0, "NVIDIA H200", 143771, 0, (9, 0)), (1, "NVIDIA H200", 143771, 0, (9, 0))]
    assert gpus[0].uuid == "GPU-bcc1dfc1-2d22-b7fe-0cb8-970918da4ec7"
    assert parse_compute_apps(text("h200-nvlink/apps.csv")) == ()
    assert vram(recipe(), list(gpus)).ok


def test_driver_cuda_version() -> None:
    assert parse_driver_cuda(text("h200-nvlink/nvidia-smi.txt")) == "13.0"  # real 580.159.04 header
    assert parse_driver_cuda(text("h200-nvlink/version.txt")) == "13.0"  # real `nvidia-smi --version`
    assert parse_driver_cuda(text("busy-3090/nvidia-smi.txt")) == "13.0"
    assert parse_driver_cuda(text("driver-575/version.txt")) == "12.9"
    assert parse_driver_cuda("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.") is None


@pytest.mark.skipif(not SHARED.is_dir(), reason="shared captures not mounted")
def test_driver_cuda_version_from_real_q_output() -> None:
    assert parse_driver_cuda((SHARED / "nvidia-smi-q.txt").read_text()) == "13.0"


# --- CUDA compatibility -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("image", "driver", "ok", "severity", "branch"),
    [
        ("13.0", "13.0", True, "info", None),
        ("13.0", "13.2", True, "info", None),
        ("13.0", "12.9", False, "fail", 580),
        ("13.0", "12.4", False, "fail", 580),
        ("13.2", "13.0", False, "fail", 595),  # club-3090#633: 580.159 passes ">= 580" but reports 13.0
        ("13.1", "12.8", False, "fail", 590),
        ("12.9", "12.8", False, "fail", 575),
        ("12.8", "12.4", False, "fail", 570),
        ("13.0", None, False, "info", None),
    ],
)
def test_cuda_compat_table(image: str, driver: str | None, ok: bool, severity: str, branch: int | None) -> None:
    f = cuda_compat(image, driver, "img")
    assert (f.ok, f.severity) == (ok, severity)
    if branch is not None:
        assert f"driver branch {branch} or newer" in (f.fix or "") and f"nvidia_driver_branch: {branch}" in (f.fix or "")
        assert f"supports CUDA {driver}" in f.message and f"CUDA {image} runtime" in f.message


def test_cuda_newer_than_any_known_branch() -> None:
    assert branch_for_cuda("13.3") is None
    f = cuda_compat("13.3", "13.2")
    assert f.failed and f.fix == "install a driver that supports CUDA 13.3"


def test_assess_fails_an_old_driver_before_anything_else() -> None:
    r = recipe()
    found = by_name(assess(r, [rtx3090(), rtx3090(index=1)], parse_driver_cuda(text("driver-575/version.txt"))))
    assert found["cuda-compat"].failed
    assert r.image.ref in found["cuda-compat"].message
    newer = dataclasses.replace(r, image=dataclasses.replace(r.image, cuda_runtime="13.2"))
    f = by_name(assess(newer, [rtx3090(), rtx3090(index=1)], parse_driver_cuda(text("h200-nvlink/nvidia-smi.txt"))))
    assert f["cuda-compat"].failed and "nvidia_driver_branch: 595" in (f["cuda-compat"].fix or "")


# --- VRAM fit -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("variant", "overrides", "gpus", "ok", "phrase"),
    [
        # 2x 3090 idle: budget 22610 of 24575 free; peak 23600 fits.
        ("dual", {}, [rtx3090(), rtx3090(index=1)], True, "budget 22610 of 24575 MiB free"),
        # 2049 MiB in use: vLLM's start check (22610 > 22527) fails.
        ("dual", {}, [rtx3090(), rtx3090(2049, 1)], False, "reserves 0.92 x 24576 = 22610 MiB but only 22527 MiB are free"),
        # 1500 MiB in use: vLLM starts (22610 <= 23076) but the measured 23600 MiB peak does not fit.
        ("dual", {}, [rtx3090(1500), rtx3090(index=1)], False, "peak needs 23600 MiB (22610 budget + 990 outside it) but 23076"),
        # dual-turbo's 19.8 GB peak lies inside its 0.85 budget (20890): fits next to 2049 MiB.
        ("dual-turbo", {}, [rtx3090(2049), rtx3090(2049, 1)], True, "budget 20890 of 22527 MiB free"),
        # 4090 / 3090 Ti report 24564 MiB: 22599 is within 100 MiB of the measured 22610.
        ("dual", {}, [card(24564, name="NVIDIA GeForce RTX 4090"), card(24564, name="NVIDIA GeForce RTX 4090", index=1)], True, "fits"),
        # A 24000 MiB card: 22080 < 22610 - 100.
        ("dual", {}, [card(24000), card(24000, index=1)], False, "below the 22610 MiB the 262144-token envelope"),
        # 2x 3080 20 GB (club-3090#47): 18842 is far below 22610.
        ("dual", {}, [card(20480, name="NVIDIA GeForce RTX 3080"), card(20480, name="NVIDIA GeForce RTX 3080", index=1)], False,
         "a budget of 18842 MiB (0.92 x 20480) is below the 22610 MiB"),
        # single at the documented 48K / 0.92 next to 1500 MiB: 22610 <= 23076.
        ("single", {}, [rtx3090(1500)], True, "envelope 48000 tokens at 0.92"),
        # single at 128K needs the 0.95 envelope's budget (23347); the override keeps 0.92.
        ("single", {"max_model_len": 128000}, [rtx3090()], False, "below the 23347 MiB the 128000-token envelope"),
        ("single", {"max_model_len": 128000, "gpu_memory_utilization": 0.95}, [rtx3090()], True, "envelope 128000 tokens at 0.95"),
        # a lower max_model_len is covered by the documented point.
        ("dual", {"max_model_len": 131072}, [rtx3090(), rtx3090(index=1)], True, "envelope 262144 tokens at 0.92"),
        # the H200's budget is 132269 MiB.
        ("dual", {}, [card(143771, 0, "NVIDIA H200"), card(143771, 0, "NVIDIA H200", 1)], True, "budget 132269 of 143771 MiB free"),
    ],
)
def test_vram_fit_table(variant: str, overrides: dict[str, Any], gpus: list[Any], ok: bool, phrase: str) -> None:
    f = vram(recipe(variant, **overrides), gpus)
    assert f.ok is ok, f.message
    assert f.severity == ("info" if ok else "fail")
    assert phrase in f.message


@pytest.mark.parametrize(
    ("variant", "overrides", "gpus", "fix"),
    [
        # Nothing of dual fits next to 2049 MiB; dual-turbo (262144 at 0.85, 20890 MiB) does.
        ("dual", {}, [rtx3090(), rtx3090(2049, 1)], "use variant 'dual-turbo' (max_model_len 262144 at gpu_memory_utilization 0.85)"),
        # single's table: 96K / 0.93 (22856 MiB) is the largest envelope that fits 23076 MiB free.
        ("single", {"max_model_len": 128000}, [rtx3090(1500)],
         "set variant_overrides: {max_model_len: 96000, gpu_memory_utilization: 0.93}"),
        ("single", {"gpu_memory_utilization": 0.98, "max_model_len": 192000}, [rtx3090(600)],
         "set variant_overrides: {max_model_len: 128000, gpu_memory_utilization: 0.95}"),
        # long-vision (145K at 0.95 = 23347) does not fit 23076; it keeps vision, so text-only variants are not offered.
        ("single-long-vision", {}, [rtx3090(1500)],
         "use variant 'single' with variant_overrides: {max_model_len: 96000, gpu_memory_utilization: 0.93}"),
        # Two 48 GB cards, 20000 MiB each held by others: dual still fits at 0.57 (28010 + 990 <= 29140).
        ("dual", {}, [card(49140, 20000, "NVIDIA RTX A6000"), card(49140, 20000, "NVIDIA RTX A6000", 1)],
         "set variant_overrides.gpu_memory_utilization: 0.57"),
        # 20 GB cards: nothing measured fits.
        ("dual", {}, [card(20480, name="NVIDIA GeForce RTX 3080"), card(20480, name="NVIDIA GeForce RTX 3080", index=1)],
         "no documented envelope fits these cards (measured on 24576 MiB cards)"),
    ],
)
def test_misfit_names_what_would_fit(variant: str, overrides: dict[str, Any], gpus: list[Any], fix: str) -> None:
    f = vram(recipe(variant, **overrides), gpus)
    assert not f.ok and f.fix is not None
    assert f.fix.startswith(fix), f.fix


def test_suggested_settings_really_fit() -> None:
    """Applying a suggested override gives a recipe the fit accepts."""
    gpus = [rtx3090(1500)]
    f = vram(recipe("single", max_model_len=128000), gpus)
    assert f.fix == "set variant_overrides: {max_model_len: 96000, gpu_memory_utilization: 0.93}"
    assert vram(recipe("single", max_model_len=96000, gpu_memory_utilization=0.93), gpus).ok
    a6000 = [card(49140, 20000, "NVIDIA RTX A6000"), card(49140, 20000, "NVIDIA RTX A6000", 1)]
    assert vram(recipe("dual", gpu_memory_utilization=0.57), a6000).ok
    assert not vram(recipe("dual", gpu_memory_utilization=0.58), a6000).ok


def test_misfit_policy() -> None:
    gpus = [rtx3090(), rtx3090(2049, 1)]
    assert vram(recipe(), gpus, policy="fail").failed
    warn = vram(recipe(), gpus, policy="warn")
    assert (warn.ok, warn.severity, warn.failed) == (False, "warn", False)
    found = by_name(assess(recipe(), gpus, "13.0", "maybe"))
    assert found["vram-policy"].failed and found["vram-fit"].failed  # an unknown policy fails safe


def test_unmeasured_overrides_warn() -> None:
    f = vram(recipe("dual", max_num_seqs=4), [rtx3090(), rtx3090(index=1)])
    assert (f.ok, f.severity) == (False, "warn") and "max_num_seqs 4 > measured 2" in f.message
    # More sequences cannot make a misfit fit: that still fails.
    assert vram(recipe("dual", max_num_seqs=4), [rtx3090(), rtx3090(2049, 1)]).failed
    above = vram(recipe("single-long-text", max_model_len=200000), [rtx3090()])
    assert (above.ok, above.severity) == (False, "warn")
    assert "max_model_len 200000 is above every envelope measured for 'single-long-text' (largest: 180000)" in above.message
    assert above.fix == ("set variant_overrides: {max_model_len: 180000, gpu_memory_utilization: 0.93}; or use variant "
                         "'single-long-text-no-mtp' (max_model_len 200000 at gpu_memory_utilization 0.95)")
    # Unmeasured, but vLLM's own start check already fails: that is certain.
    start = vram(recipe("single-long-text", max_model_len=200000, gpu_memory_utilization=0.99), [rtx3090(1500)])
    assert start.failed and "cannot start" in start.message


def test_newer_driver_reserve_warning() -> None:
    two = [rtx3090(), rtx3090(index=1)]
    found = by_name(assess(recipe(), two, "13.2"))
    assert found["vram-fit"].ok and found["vram-driver"].severity == "warn"
    assert "club-3090#149" in found["vram-driver"].message
    assert "vram-driver" not in by_name(assess(recipe(), two, "13.0"))
    h200 = [card(143771, 0, "NVIDIA H200"), card(143771, 0, "NVIDIA H200", 1)]
    assert "vram-driver" not in by_name(assess(recipe(), h200, "13.2"))  # 109659 MiB of headroom


# --- mixed cards, layout ------------------------------------------------------------------------


def test_mixed_pair_is_sized_by_the_smaller_card() -> None:
    gpus = parse_memory_query(text("mixed-3090-3080/memory.csv"))
    found = by_name(assess(recipe(), gpus, "13.0"))
    mix = found["gpu-mix"]
    assert (mix.ok, mix.severity) == (False, "warn")
    assert "smallest used card (GPU 1 (NVIDIA GeForce RTX 3080), 20480 MiB)" in mix.message
    assert found["vram-fit"].failed and "GPU 1 (NVIDIA GeForce RTX 3080)" in found["vram-fit"].message
    # A single-card variant only uses GPU 0 (the 3090): the mix is noted, the fit is the 3090's.
    single = by_name(assess(recipe("single"), gpus, "13.0"))
    assert (single["gpu-mix"].ok, single["gpu-mix"].severity) == (True, "info") and single["vram-fit"].ok


def test_alike_cards_report_no_mix() -> None:
    assert "gpu-mix" not in by_name(assess(recipe(), parse_memory_query(text("2x3090-pcie/memory.csv")), "13.0"))


@pytest.mark.parametrize(
    ("variant", "n", "ok", "severity", "message", "fix"),
    [
        ("dual", 1, False, "fail", "runs tensor parallel 2; this host has 1 GPU(s)",
         "use tensor parallel 1: variant single, single-long-vision"),
        ("dual", 2, True, "info", "2 GPU(s): tensor parallel 2", None),
        ("dual", 3, True, "info", "tensor parallel 2, 1 idle (the nearest valid layout); "
         "Lorbus/Qwen3.6-27B-int4-AutoRound cannot be split 3 ways (valid tensor parallel sizes: 1, 2, 4, 8)", None),
        ("dual", 4, False, "warn", "nearest valid layout is tensor parallel 4",
         "set variant_overrides.tensor_parallel_size: 4 (or variant multi4, qwen-multi4-autoround-int4-mtp, qwen-multi4-fp8-mtp, measured at that size)"),
        ("dual", 6, False, "warn", "nearest valid layout is tensor parallel 4 with 2 idle; "
         "Lorbus/Qwen3.6-27B-int4-AutoRound cannot be split 6 ways", "set variant_overrides.tensor_parallel_size: 4"),
        ("dual", 8, False, "warn", "nearest valid layout is tensor parallel 4 with 4 idle", None),
        ("multi4", 3, False, "fail", "runs tensor parallel 4; this host has 3 GPU(s)", "use tensor parallel 2: variant dual, dual-turbo"),
        ("single", 2, False, "warn", "nearest valid layout is tensor parallel 2", "use variant dual, dual-turbo"),
        ("gemma-dual-int8", 4, False, "warn", "nearest valid layout is tensor parallel 4",
         "use variant gemma-multi4-google-qat-w4a16-base (tensor parallel 4)"),
    ],
)
def test_layout_table(variant: str, n: int, ok: bool, severity: str, message: str, fix: str | None) -> None:
    f = by_name(assess(recipe(variant), [rtx3090(index=i) for i in range(n)], "13.0"))["gpu-layout"]
    assert (f.ok, f.severity) == (ok, severity)
    assert message in f.message
    if fix is not None:
        assert f.fix is not None and f.fix.startswith(fix), f.fix
    elif ok:
        assert f.fix is None


@pytest.mark.parametrize(
    ("tp", "message"),
    [
        (3, "cannot be split 3 ways (valid tensor parallel sizes: 1, 2, 4, 8); on 3 GPUs use tensor_parallel_size 2 and leave 1 idle"),
        (6, "cannot be split 6 ways (valid tensor parallel sizes: 1, 2, 4, 8); on 6 GPUs use tensor_parallel_size 4 and leave 2 idle"),
        (8, "got 8; on 8 GPUs use tensor_parallel_size 4 and leave 4 idle"),
    ],
)
def test_invalid_tensor_parallel_override_names_the_nearest_layout(tp: int, message: str) -> None:
    with pytest.raises(RecipeError) as err:
        recipe("dual", tensor_parallel_size=tp)
    assert message in str(err.value)


# --- GPU shapes ---------------------------------------------------------------------------------


def test_accepts_hostlayer_gpus_from_the_real_h200_capture() -> None:
    query = parse_gpu_query(text("h200-nvlink/query-gpu.csv"), GPU_QUERY_FIELDS[:10])
    found = by_name(assess(recipe(), query.gpus, parse_driver_cuda(text("h200-nvlink/nvidia-smi.txt"))))
    assert found["cuda-compat"].ok
    fit = found["vram-fit"]
    assert fit.ok and "143771 MiB, memory in use unknown, taken as 0" in fit.message


def test_accepts_the_test_beds_hardware_and_plain_objects() -> None:
    mixed = hw.build("rig-x", [hw.RTX_3090, hw.RTX_3080_20GB], preset="mixed-3090-3080", topology="PHB")
    states = [gpu_state(g) for g in mixed.gpus]
    assert [(s.memory_total_mib, s.memory_used_mib, s.compute_cap) for s in states] == [(24576, 1, (8, 6)), (20480, 1, (8, 6))]
    assert by_name(assess(recipe(), mixed.gpus, mixed.driver_cuda))["gpu-mix"].severity == "warn"

    class Plain:
        name = "NVIDIA GeForce RTX 3090"
        memory_total_mib = 24576
        memory_used_mib = 1
        compute_cap = (8, 6)

    assert gpu_state(Plain(), 3) == GpuState(3, "NVIDIA GeForce RTX 3090", 24576, 1, (8, 6))
    unknown = [{"name": "NVIDIA Mystery", "memory_total_mib": None}, {"name": "NVIDIA Mystery", "index": 1}]
    f = vram(recipe(), unknown)
    assert (f.ok, f.severity) == (False, "warn") and "memory size unknown" in f.message


def test_no_gpus() -> None:
    found = by_name(assess(recipe(), [], None))
    assert found["gpu-layout"].failed and "vram-fit" not in found


def test_interconnect_is_in_the_plan() -> None:
    found = by_name(assess(recipe(), [rtx3090(), rtx3090(index=1)], "13.0"))
    assert found["interconnect"].message == "PCIe (no topology information): NCCL_P2P_DISABLE=1, --disable-custom-all-reduce"
    forced = recipe_with(gpu_interconnect="force_on")
    assert by_name(assess(forced, [rtx3090(), rtx3090(index=1)], "13.0"))["interconnect"].message.startswith("NVLink (forced")
    assert "interconnect" not in by_name(assess(recipe("single"), [rtx3090()], "13.0"))
    # a two-GPU variant on a one-GPU host (refused by the layout check) plans no interconnect either
    lone = by_name(assess(recipe_with(), [rtx3090()], "13.0"))
    assert lone["interconnect"].message == "none: the host has 1 GPU, no link between GPUs"


def recipe_with(**data: Any) -> Recipe:
    d = load_defaults()
    d.update(data)
    return resolve(d)


# --- facts against the test bed's nvidia-smi ------------------------------------------------------


@pytest.fixture
def standin(tmp_path: Path) -> dict[str, Any]:
    """The test bed's nvidia-smi stand-in in test mode, on a 2x3090 rig whose GPU 1 runs this test's
    process (2000 MiB); a `docker` shim says this process's parent is the variant container's init."""
    tool = tmp_path / "tool"
    tool.mkdir()
    for name in ("nvidia_smi.py", "common.py"):
        shutil.copy(STANDINS / name, tool / name)
    (tool / "userspace.json").write_text(json.dumps({"version": "580.95.05", "branch": "580", "cuda": "13.0"}))
    root = tmp_path / "root"
    rig = hw.build("rig-t", [hw.RTX_3090, hw.RTX_3090], preset="2x3090", topology="PIX")
    files = {
        "etc/rigup-testbed/hardware.json": rig.to_json(),
        "proc/driver/nvidia/version": "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95.05  Release Build\n",
        "proc/sys/kernel/random/boot_id": "0b8e7d1c-test\n",
        "run/nvidia-standin/procs/vllm.json": json.dumps(
            {"pid": os.getpid(), "gpus": [rig.gpus[1].uuid], "used_mib": 2000, "name": "python3"}),
    }
    for rel, content in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(content)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\nexec python3 {tool / 'nvidia_smi.py'} \"$@\"\n")
    # docker as rigup's command uses it: `ps` names the running containers (ours and another), `inspect`
    # gives the main pid of those it is asked about, and every call is logged.
    (bin_dir / "docker").write_text(
        f"#!/bin/sh\necho \"$*\" >>{tmp_path / 'docker.log'}\n"
        "case \"$1\" in ps) printf 'grafana\\nvllm-qwen36-27b-dual\\n' ;; "
        f"inspect) echo {os.getppid()} ;; *) exit 1 ;; esac\n")
    for shim in bin_dir.iterdir():
        shim.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "RIGUP_STANDIN_ROOT": str(root)}
    return {"env": env, "rig": rig, "docker_log": tmp_path / "docker.log"}


def run_fact(fact: Any, env: dict[str, str], *args: Any) -> Any:
    proc = subprocess.run(["sh", "-c", fact.command(*args)], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return fact.process(proc.stdout.splitlines())


def test_facts_read_the_test_beds_nvidia_smi(standin: dict[str, Any]) -> None:
    env, rig = standin["env"], standin["rig"]
    gpus = run_fact(GpuMemoryUse(), env, ("vllm-qwen36-27b-dual",))
    assert [(g.memory_total_mib, g.memory_used_mib, g.uuid) for g in gpus] == [
        (24576, 1, rig.gpus[0].uuid), (24576, 1, rig.gpus[1].uuid)]  # 2001 minus our own 2000
    # only the running container that is ours is inspected
    assert standin["docker_log"].read_text().splitlines() == [
        "ps --format {{.Names}}", "inspect --type container --format {{.State.Pid}} vllm-qwen36-27b-dual"]
    assert run_fact(DriverCudaVersion(), env) == "13.0"
    topo = run_fact(GpuTopology(), env)
    assert topo.links == {(0, 1): "PIX", (1, 0): "PIX"} and topo.p2p == {(0, 1): "NS", (1, 0): "NS"}


def test_facts_count_other_processes_and_survive_a_missing_driver(standin: dict[str, Any], tmp_path: Path) -> None:
    env = dict(standin["env"])
    (tmp_path / "bin" / "docker").write_text("#!/bin/sh\nexit 1\n")  # no variant container
    gpus = run_fact(GpuMemoryUse(), env, ("vllm-qwen36-27b-dual",))
    assert [g.memory_used_mib for g in gpus] == [1, 2001]
    (tmp_path / "root/proc/driver/nvidia/version").unlink()  # module not loaded
    assert run_fact(GpuMemoryUse(), env, ("x",)) is None
    assert run_fact(DriverCudaVersion(), env) is None
    assert run_fact(GpuTopology(), env) is None
    (tmp_path / "bin" / "nvidia-smi").unlink()
    assert run_fact(GpuMemoryUse(), env, ("x",)) is None and run_fact(GpuTopology(), env) is None


def test_envelope_caveats_are_passed_on() -> None:
    f = vram(recipe("single", max_model_len=192000, gpu_memory_utilization=0.98), [rtx3090()])
    assert f.ok and "the seeds note: OOMs on ~25K-token tool replies (single-3090#1)" in f.message
    # The suggestion names the caveat of the envelope it picks (192K/0.98 fits 24084 <= 24276).
    s = vram(recipe("single", max_model_len=192000, gpu_memory_utilization=0.99), [rtx3090(300)])
    assert s.fix == ("set variant_overrides.gpu_memory_utilization: 0.98 "
                     "(the seeds note: OOMs on ~25K-token tool replies (single-3090#1))")


@pytest.mark.parametrize(
    ("capture", "variant", "ok", "phrase"),
    [
        ("2x3090-pcie", "dual", True, "budget 22610 of 24575 MiB free"),
        ("2x3090-pcie", "dual-dflash-noviz", True, "envelope 200000 tokens at 0.95"),
        ("busy-3090", "dual", False, "GPU 1 (NVIDIA GeForce RTX 3090): 24576 MiB, 2049 MiB in use by other processes"),
        ("busy-3090", "dual-turbo", True, "fits"),
        ("busy-3090", "single", True, "fits"),  # one card: GPU 0, which is idle
        ("2x3080-20g", "dual-turbo", False, "a budget of 17408 MiB (0.85 x 20480) is below the 20890 MiB"),
        ("2x3080-20g", "gemma-dual", False, "below the 22610 MiB the 32768-token envelope"),
    ],
)
def test_captures_through_assess(capture: str, variant: str, ok: bool, phrase: str) -> None:
    f = vram(recipe(variant), list(parse_memory_query(text(f"{capture}/memory.csv"))))
    assert f.ok is ok and phrase in f.message, f.message


def test_second_converge_does_not_count_its_own_container() -> None:
    raw = parse_memory_query(text("reconverge-3090/memory.csv"))
    assert vram(recipe(), list(raw)).failed  # 23458 MiB "in use" on GPU 0 is rigup's own dual
    chains = [[int(p) for p in line.split()] for line in text("reconverge-3090/chains.txt").splitlines()]
    own = own_pids(int(text("reconverge-3090/container-pid.txt")), chains)
    freed = exclude_own(raw, parse_compute_apps(text("reconverge-3090/apps.csv")), own)
    f = vram(recipe(), list(freed))
    assert f.ok and "GPU 1 (NVIDIA GeForce RTX 3090): 24576 MiB, 420 MiB in use" in f.message


@pytest.mark.parametrize(
    ("n", "ok", "severity", "message"),
    [
        (1, False, "fail", "variant 'qwen-omni-dual-autoround-int4-omni' runs per-stage engines on 2 GPUs (the deploy "
         "config's stage devices; tensor parallel 1 per stage); this host has 1 GPU(s)"),
        (2, True, "info", "2 GPU(s): per-stage engines on 2 GPUs (the deploy config's stage devices; tensor parallel 1 "
         "per stage)"),
        (3, True, "info", "3 GPU(s): per-stage engines on 2 GPUs (the deploy config's stage devices; tensor parallel 1 "
         "per stage), 1 idle"),
    ],
)
def test_a_stage_parallel_variant_is_laid_out_by_its_stage_devices(n: int, ok: bool, severity: str, message: str) -> None:
    """vLLM-Omni's stages sit on the deploy config's devices (thinker GPU 0, talker + vocoder GPU 1): TP 1 does not
    mean one card, and two cards are not "1 idle"."""
    r = recipe("qwen-omni-dual-autoround-int4-omni")
    assert (r.tensor_parallel_size, r.gpu_count) == (1, 2)
    found = by_name(assess(r, [rtx3090(index=i) for i in range(n)], "13.0"))
    f = found["gpu-layout"]
    assert (f.ok, f.severity, f.message) == (ok, severity, message)
    assert f.fix == (None if ok else "add GPUs")
    assert "idle" not in f.message or n > 2
    # Both used cards are fitted (and not a third one); one card is too few to fit at all.
    assert ("vram-fit" in found) == (n >= 2)
