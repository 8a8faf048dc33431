"""Does the recipe fit this host? VRAM envelope, driver CUDA compatibility, GPU layout, interconnect.

Pure logic: `assess(recipe, gpus, driver_cuda, misfit_policy)` turns what the host's facts say into a
list of Findings for preflight and `rigup doctor`, before anything is installed or pulled. The
nvidia-smi outputs it needs (memory in use, compute processes, the driver's CUDA version) are parsed
in rigup/parsers/nvidia_smi.py and read on a rig by rigup/facts/gpu.py.

What "fits" means (per GPU of the tensor-parallel group; sizes in MiB as nvidia-smi prints them):

    T        the card's memory.total
    U        memory in use by processes other than this variant's own container
    F = T-U  free memory before vLLM starts
    B = u*T  vLLM's budget: gpu_memory_utilization u times the card's total. Weights, activations,
             CUDA graphs and the KV cache must all fit inside B.

  The catalog records measured points for each variant: (max_model_len L_p, utilisation u_p) that
  booted and served on the measuring card (measured_on_gpu_mib, T_ref = 24576 MiB: RTX 3090), with
  the peak nvidia-smi showed per card (vram_per_gpu_gb) where the seeds measured it. At such a point
  vLLM's budget was B_p = u_p*T_ref, and P - B_p of the peak lay outside the budget (CUDA context,
  NCCL buffers): O_p = max(0, P - B_p), 0 when no peak was measured.

  The host's (L, u) fits a GPU when some measured point p with L_p >= L (and vision only where p
  had it) satisfies all three:
    1. B <= F                vLLM's own start check ("free memory ... less than desired GPU memory
                             utilization")
    2. B >= B_p - 100 MiB    vLLM gets at least the budget the point was measured with, so weights,
                             activations and the KV cache of one L-token request fit again (only the
                             KV cache grows with the budget). 100 MiB is the precision of the seeds'
                             figures (0.1 GB); it also lets 24564 MiB cards (4090, 3090 Ti) count as 24 GB.
    3. B + O_p <= F          the peak, with what lay outside the budget, fits next to other processes.
  The smallest used card decides (tensor parallelism splits evenly). A misfit fails the host or
  warns, per preflight_vram_misfit; the fix names the largest documented (max_model_len,
  gpu_memory_utilization) of the same variant that fits, or another variant that does.

Overrides the catalog never measured (a larger max_model_len, more sequences or batched tokens, a
smaller TP) cannot be predicted: those warn, and only check 1 (certain) can fail them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from rigup.checks.driver_plan import BRANCH_CUDA
from rigup.desired.catalog import GPU_MEMORY_UTILIZATION_RANGE, load_catalog
from rigup.desired.interconnect import pcie_summary
from rigup.desired.knobs import VRAM_MISFIT_POLICIES
from rigup.desired.recipe import Recipe, nearest_layout
from rigup.parsers.nvidia_smi import GpuState, parse_compute_cap

Severity = Literal["fail", "warn", "info"]


# The seeds state VRAM to 0.1 GB (nvidia-smi MiB / 1000); budgets closer than this count as equal.
TOLERANCE_MIB = 100


# club-3090#149 (HEAD HARDWARE.md): on driver 595.71.05 / CUDA 13.2 vLLM reserves ~2.87 GiB for
# activations instead of ~1.5 GiB on the CUDA 13.0 drivers the envelopes were measured with.
NEWER_DRIVER_CUDA = (13, 2)
NEWER_DRIVER_EXTRA_RESERVE_MIB = round((2.87 - 1.5) * 1024)


# Utilisations rigup suggests stay inside what variant_overrides accepts.
UTIL_MIN, UTIL_MAX = GPU_MEMORY_UTILIZATION_RANGE


@dataclass(frozen=True)
class Finding:
    """One result of `assess`: `severity` says what a finding that is not ok means."""

    name: str  # "cuda-compat", "gpu-layout", "gpu-mix", "vram-fit", "vram-driver", "interconnect"
    ok: bool
    severity: Severity  # fail: the host must not be provisioned; warn: report only; info: plan notes
    message: str
    fix: str | None = None
    key: str | None = None  # the knob (group_data/all.py) the finding is about

    @property
    def failed(self) -> bool:
        return not self.ok and self.severity == "fail"


def _get(obj: Any, *names: str) -> Any:
    for name in names:
        if isinstance(obj, Mapping):
            if name in obj:
                return obj[name]
        elif hasattr(obj, name):
            return getattr(obj, name)
    return None


def gpu_state(obj: Any, position: int = 0) -> GpuState:
    """A GpuState from a GpuState, a mapping or any object with the attributes:

    memory_total_mib (or memory_mib: rigup.parsers.nvidia_smi.Gpu, or memory_total), memory_used_mib (or
    memory_used; absent: unknown), name, compute_cap ("8.6" or (8, 6); or compute_capability),
    index (absent: the position in the list), uuid (optional).
    """
    if isinstance(obj, GpuState):
        return obj
    total = _get(obj, "memory_total_mib", "memory_mib", "memory_total")
    used = _get(obj, "memory_used_mib", "memory_used")
    index = _get(obj, "index")
    return GpuState(
        index=position if index is None else int(index),
        name=str(_get(obj, "name") or f"GPU {position}"),
        memory_total_mib=None if total is None else int(total),
        memory_used_mib=None if used is None else int(used),
        compute_cap=parse_compute_cap(_get(obj, "compute_cap", "compute_capability")),
        uuid=_get(obj, "uuid"),
    )


def _version(text: str) -> tuple[int, int]:
    match = re.fullmatch(r"\s*(\d+)\.(\d+)(?:\.\d+)?\s*", str(text))
    if match is None:
        raise ValueError(f"not a CUDA version: {text!r}")
    return int(match.group(1)), int(match.group(2))


def branch_for_cuda(cuda: str) -> int | None:
    """The oldest driver branch whose driver supports CUDA `cuda`: 12.8 -> 570, 12.9 -> 575, 13.0 -> 580,
    13.1 -> 590, 13.2 -> 595. From rigup.checks.driver_plan.BRANCH_CUDA (NVIDIA's CUDA toolkit release notes,
    "CUDA Toolkit and Minimum Required Driver Version"), assuming each branch's first release supports
    the CUDA version listed for it. None for a CUDA newer than every branch rigup knows."""
    need = _version(cuda)
    branches = [b for b, supported in BRANCH_CUDA.items() if supported >= need]
    return min(branches) if branches else None


def cuda_compat(image_cuda: str, driver_cuda: str | None, image_ref: str = "the image") -> Finding:
    """The driver must support at least the image's CUDA runtime (no forward compatibility on GeForce)."""
    need = _version(image_cuda)
    branch = branch_for_cuda(image_cuda)
    wanted = f"driver branch {branch} or newer" if branch else f"a driver that supports CUDA {image_cuda}"
    if driver_cuda is None:
        return Finding(
            "cuda-compat",
            False,
            "info",
            f"driver CUDA version unknown (nvidia-smi does not answer yet); {image_ref} needs CUDA "
            f"{image_cuda}: {wanted}",
            None,
            "nvidia_driver_branch",
        )
    have = _version(driver_cuda)
    if have < need:
        return Finding(
            "cuda-compat",
            False,
            "fail",
            f"the driver supports CUDA {driver_cuda} but {image_ref} needs the CUDA {image_cuda} runtime: "
            "the container would fail with CUDA error 804 and crash-loop (club-3090#633)",
            f"install {wanted} (nvidia_driver_branch: {branch})" if branch else f"install {wanted}",
            "nvidia_driver_branch",
        )
    return Finding(
        "cuda-compat",
        True,
        "info",
        f"driver CUDA {driver_cuda} >= image CUDA runtime {image_cuda}",
        None,
        "nvidia_driver_branch",
    )


@dataclass(frozen=True)
class Point:
    """A (max_model_len, gpu_memory_utilization) the seeds ran a variant at, on the measuring card."""

    variant: str
    max_model_len: int
    util: float
    peak_mib: float | None  # nvidia-smi peak per card; None: not measured
    vision: bool  # False: only with --language-model-only
    measured_on_mib: int
    note: str = ""  # the seeds' caveat for this envelope, if any

    @property
    def budget_mib(self) -> float:
        return self.util * self.measured_on_mib

    @property
    def overhead_mib(self) -> float:
        return 0.0 if self.peak_mib is None else max(0.0, self.peak_mib - self.budget_mib)


def points(variant: Mapping[str, Any]) -> list[Point]:
    """The documented setting of a catalog variant (with its measured peak) and its alternative envelopes."""
    ref = int(variant["measured_on_gpu_mib"])
    peak = None if variant.get("vram_per_gpu_gb") is None else float(variant["vram_per_gpu_gb"]) * 1000
    out = [
        Point(variant["name"], int(variant["max_model_len"]), float(variant["gpu_memory_utilization"]), peak,
              not variant["language_model_only"], ref)
    ]
    for env in variant.get("alternative_envelopes") or ():
        note = str(env.get("note") or "")
        p = Point(variant["name"], int(env["max_model_len"]), float(env["gpu_memory_utilization"]), None,
                  bool(env.get("vision", True)) and not variant["language_model_only"], ref,
                  "" if note == "default" else note)
        if (p.max_model_len, p.util, p.vision) != (out[0].max_model_len, out[0].util, out[0].vision):
            out.append(p)
    return out


@dataclass(frozen=True)
class CardFit:
    gpu: GpuState
    budget: float  # B = u * T
    free: float  # F = T - U
    starts: bool  # rule 1: B <= F
    kv_fits: bool  # rule 2: B >= B_p - tolerance
    peak_fits: bool  # rule 3: B + O_p <= F

    @property
    def ok(self) -> bool:
        return self.starts and self.kv_fits and self.peak_fits


def card_fit(util: float, point: Point, gpu: GpuState) -> CardFit:
    total = gpu.memory_total_mib
    if total is None:
        raise ValueError(f"GPU {gpu.index}: memory.total unknown")
    budget = util * total
    free = float(total - (gpu.memory_used_mib or 0))
    return CardFit(
        gpu=gpu,
        budget=budget,
        free=free,
        starts=budget <= free,
        kv_fits=budget >= point.budget_mib - TOLERANCE_MIB,
        peak_fits=budget + point.overhead_mib <= free,
    )


def fits(util: float, point: Point, gpus: Sequence[GpuState]) -> bool:
    return all(card_fit(util, point, g).ok for g in gpus)


def _lowest_util(point: Point, gpus: Sequence[GpuState]) -> float:
    """The smallest utilisation (0.01 steps) that gives every card at least the point's budget."""
    smallest = min(g.memory_total_mib or 0 for g in gpus)
    util = math.ceil((point.budget_mib - TOLERANCE_MIB) / smallest * 100 - 1e-9) / 100
    return max(UTIL_MIN, util)


def fitting_setting(point: Point, gpus: Sequence[GpuState]) -> float | None:
    """A utilisation at which `point` fits these GPUs: its own, else the largest below it that still
    keeps its budget (bigger cards shared with other processes); None when none does."""
    if fits(point.util, point, gpus):
        return point.util
    lowest = _lowest_util(point, gpus)
    steps = round(point.util * 100) - 1
    for hundredths in range(min(steps, round(UTIL_MAX * 100)), round(lowest * 100) - 1, -1):
        util = hundredths / 100
        if fits(util, point, gpus):
            return util
    return None


def _fmt_util(util: float) -> str:
    return f"{round(util, 4):g}"


def _gpu_label(g: GpuState) -> str:
    return f"GPU {g.index} ({g.name})"


def _stage_layout(recipe: Recipe, n: int) -> Finding:
    """The layout of a variant whose GPUs are its deploy config's stages (vLLM-Omni): recipe.gpu_count
    cards, one engine per stage, each tensor parallel at most recipe.tensor_parallel_size. Nothing to
    resize here: the stage devices live in upstream's deploy config, which rigup mounts unchanged."""
    need, tp = recipe.gpu_count, recipe.tensor_parallel_size
    per_stage = f"per-stage engines on {need} GPUs (the deploy config's stage devices; tensor parallel {tp} per stage)"
    if n < need:
        return Finding(
            "gpu-layout", False, "fail",
            f"variant {recipe.variant!r} runs {per_stage}; this host has {n} GPU(s)", "add GPUs", "variant",
        )
    idle = f", {n - need} idle" if n > need else ""
    return Finding("gpu-layout", True, "info", f"{n} GPU(s): {per_stage}{idle}", None, "variant")


def _layout(recipe: Recipe, gpus: Sequence[GpuState], catalog: Mapping[str, Any]) -> Finding:
    n, tp = len(gpus), recipe.tensor_parallel_size
    if recipe.gpu_count != tp:
        # The recipe's GPU count is its tensor-parallel size unless a deploy config's stages place the
        # engines (Recipe.gpu_count): then TP says nothing about how many cards are used.
        return _stage_layout(recipe, n)
    model = catalog["models"][recipe.model.name]
    model_sizes = tuple(model["valid_tensor_parallel_sizes"])
    same_family = [
        name for name, v in catalog["variants"].items()
        if catalog["models"][v["model"]]["family"] == recipe.family
    ]
    # Sizes some variant of the family can run (documented or through variant_overrides).
    runnable = sorted({s for v in same_family for s in catalog["variants"][v]["tensor_parallel_sizes"]} & set(model_sizes))
    layout = nearest_layout(n, runnable)
    sizes = ", ".join(map(str, model_sizes))
    if n < tp:
        fix = "add GPUs"
        if layout is not None:
            fitting = [v for v in same_family if catalog["variants"][v]["tensor_parallel_size"] == layout[0]]
            fix = f"use tensor parallel {layout[0]}" + (f": variant {', '.join(fitting)}" if fitting else "")
        return Finding(
            "gpu-layout", False, "fail",
            f"variant {recipe.variant!r} runs tensor parallel {tp}; this host has {n} GPU(s)", fix, "variant",
        )
    invalid = "" if n in model_sizes else (
        f"; {recipe.model.repo_id} cannot be split {n} ways (valid tensor parallel sizes: {sizes})"
    )
    if layout is None or layout[0] <= tp:
        idle = f", {n - tp} idle" if n > tp else ""
        nearest = " (the nearest valid layout)" if invalid else ""
        return Finding("gpu-layout", True, "info", f"{n} GPU(s): tensor parallel {tp}{idle}{nearest}{invalid}", None, "variant")
    # A larger valid layout would use more of the GPUs.
    bigger = layout[0]
    fitting = [v for v in same_family if catalog["variants"][v]["tensor_parallel_size"] == bigger]
    if bigger in recipe.valid_tensor_parallel_sizes:
        fix = f"set variant_overrides.tensor_parallel_size: {bigger}"
        if fitting:
            fix += f" (or variant {', '.join(fitting)}, measured at that size)"
    elif fitting:
        fix = f"use variant {', '.join(fitting)} (tensor parallel {bigger})"
    else:
        able = [v for v in same_family if bigger in catalog["variants"][v]["tensor_parallel_sizes"]]
        fix = f"use variant {', '.join(able)} with variant_overrides.tensor_parallel_size: {bigger}"
    return Finding(
        "gpu-layout", False, "warn",
        f"{n} GPUs but tensor parallel {tp}: {n - tp} stay idle; the nearest valid layout is tensor parallel "
        f"{bigger}" + (f" with {layout[1]} idle" if layout[1] else "") + invalid,
        fix, "variant",
    )


def _mix(all_gpus: Sequence[GpuState], used: Sequence[GpuState]) -> Finding | None:
    kinds = {(g.name, g.memory_total_mib) for g in all_gpus}
    if len(kinds) < 2:
        return None
    listing = ", ".join(f"GPU {g.index} {g.name} {g.memory_total_mib if g.memory_total_mib is not None else '?'} MiB" for g in all_gpus)
    used_kinds = {(g.name, g.memory_total_mib) for g in used}
    if len(used_kinds) < 2:
        return Finding("gpu-mix", True, "info", f"mixed GPUs ({listing}); the used ones are alike", None, "variant")
    known = [g for g in used if g.memory_total_mib is not None]
    smallest = min(known, key=lambda g: g.memory_total_mib or 0) if known else used[0]
    return Finding(
        "gpu-mix", False, "warn",
        f"mixed GPUs ({listing}): tensor parallelism splits evenly, so the smallest used card "
        f"({_gpu_label(smallest)}, {smallest.memory_total_mib} MiB) sizes the fit and the larger ones hold unused memory",
        "pair identical cards", "variant",
    )


def _describe_card(c: CardFit, point: Point, util: float) -> str:
    g = c.gpu
    used = "memory in use unknown, taken as 0" if g.memory_used_mib is None else f"{g.memory_used_mib} MiB in use by other processes"
    head = f"{_gpu_label(g)}: {g.memory_total_mib} MiB, {used}"
    if not c.starts:
        return (f"{head}: vLLM reserves {_fmt_util(util)} x {g.memory_total_mib} = {c.budget:.0f} MiB but only "
                f"{c.free:.0f} MiB are free (vLLM refuses to start)")
    if not c.kv_fits:
        return (f"{head}: a budget of {c.budget:.0f} MiB ({_fmt_util(util)} x {g.memory_total_mib}) is below the "
                f"{point.budget_mib:.0f} MiB the {point.max_model_len}-token envelope was measured with "
                f"({_fmt_util(point.util)} x {point.measured_on_mib} MiB): the KV cache for max_model_len "
                f"{point.max_model_len} will not fit")
    if not c.peak_fits:
        return (f"{head}: the measured peak needs {c.budget + point.overhead_mib:.0f} MiB ({c.budget:.0f} budget + "
                f"{point.overhead_mib:.0f} outside it) but {c.free:.0f} MiB are free")
    return f"{head}: budget {c.budget:.0f} of {c.free:.0f} MiB free"


def _setting(max_model_len: int, util: float, current: Recipe) -> str:
    if max_model_len == current.max_model_len:
        return f"set variant_overrides.gpu_memory_utilization: {_fmt_util(util)}"
    return f"set variant_overrides: {{max_model_len: {max_model_len}, gpu_memory_utilization: {_fmt_util(util)}}}"


def _suggest(recipe: Recipe, used: Sequence[GpuState], catalog: Mapping[str, Any]) -> str | None:
    """The largest documented setting of this variant that fits, else the catalog variant that fits."""
    parts: list[str] = []
    own_best: int = 0
    v = catalog["variants"][recipe.variant]
    for p in sorted(points(v), key=lambda p: (-p.max_model_len, p.util)):
        if not p.vision and not recipe.language_model_only:
            continue  # needs --language-model-only, which overrides cannot set
        util = fitting_setting(p, used)
        if util is not None:
            parts.append(_setting(p.max_model_len, util, recipe) + (f" (the seeds note: {p.note})" if p.note else ""))
            own_best = p.max_model_len
            break
    best: tuple[int, str, float] | None = None
    for name, other in catalog["variants"].items():
        if name == recipe.variant or other["tensor_parallel_size"] != recipe.shards:
            continue
        if catalog["models"][other["model"]]["family"] != recipe.family:
            continue
        if other["language_model_only"] and not recipe.language_model_only:
            continue  # never trade the host's vision away silently
        for p in points(other):
            if not p.vision and not other["language_model_only"]:
                continue
            util = fitting_setting(p, used)
            if util is not None and p.max_model_len > own_best and (best is None or p.max_model_len > best[0]):
                best = (p.max_model_len, name, util)
    if best is not None:
        length, name, util = best
        documented = catalog["variants"][name]
        if length == documented["max_model_len"] and util == float(documented["gpu_memory_utilization"]):
            parts.append(f"use variant {name!r} (max_model_len {length} at gpu_memory_utilization {_fmt_util(util)})")
        else:
            parts.append(
                f"use variant {name!r} with variant_overrides: {{max_model_len: {length}, "
                f"gpu_memory_utilization: {_fmt_util(util)}}}"
            )
    return "; or ".join(parts) if parts else None


def _unmeasured(recipe: Recipe, catalog: Mapping[str, Any]) -> list[str]:
    """Overrides that move the recipe off anything measured (beyond max_model_len / utilisation)."""
    v = catalog["variants"][recipe.variant]
    out = []
    if recipe.shards < v["tensor_parallel_size"]:  # a cluster's TP x PP spreads the model as far as its TP alone
        out.append(f"tensor parallel {recipe.shards} < measured {v['tensor_parallel_size']}")
    if recipe.max_num_seqs > v["max_num_seqs"]:
        out.append(f"max_num_seqs {recipe.max_num_seqs} > measured {v['max_num_seqs']}")
    if (recipe.max_num_batched_tokens or 0) > (v["max_num_batched_tokens"] or 0) and v["max_num_batched_tokens"] is not None:
        out.append(f"max_num_batched_tokens {recipe.max_num_batched_tokens} > measured {v['max_num_batched_tokens']}")
    return out


def _vram(recipe: Recipe, used: Sequence[GpuState], severity: Severity, driver_cuda: str | None,
          catalog: Mapping[str, Any]) -> list[Finding]:
    unknown = [g for g in used if g.memory_total_mib is None]
    if unknown:
        return [Finding("vram-fit", False, "warn", f"{_gpu_label(unknown[0])}: memory size unknown; VRAM fit not checked",
                        "check again once the driver is loaded", "preflight_vram_misfit")]
    util, length = recipe.gpu_memory_utilization, recipe.max_model_len
    vision = not recipe.language_model_only
    pts = points(catalog["variants"][recipe.variant])
    covering = [p for p in pts if p.max_model_len >= length and (p.vision or not vision)]
    off_point = _unmeasured(recipe, catalog)
    if not covering:
        why = (
            f"max_model_len {length} is above every envelope measured for {recipe.variant!r} "
            f"(largest: {max(p.max_model_len for p in pts if p.vision or not vision)})"
        )
        # Only vLLM's start check is certain here.
        here = Point(recipe.variant, length, util, None, vision, recipe.measured_on_gpu_mib)
        bad = [c for c in (card_fit(util, here, g) for g in used) if not c.starts]
        if bad:
            return [Finding(
                "vram-fit", False, severity,
                f"variant {recipe.variant!r} (gpu_memory_utilization {_fmt_util(util)}) cannot start: "
                f"{_describe_card(bad[0], here, util)}",
                _suggest(recipe, used, catalog), "preflight_vram_misfit",
            )]
        return [Finding("vram-fit", False, "warn", f"not measured: {why}; whether the KV cache fits cannot be predicted",
                        _suggest(recipe, used, catalog), "variant_overrides")]

    # The most lenient covering point first: the smallest budget to reach, then the smallest peak.
    covering.sort(key=lambda p: (p.budget_mib, p.overhead_mib))
    chosen = next((p for p in covering if fits(util, p, used)), None)
    out: list[Finding] = []
    if chosen is None:
        p = covering[0]
        checks = [card_fit(util, p, g) for g in used]
        worst = next(c for c in checks if not c.ok)
        fix = _suggest(recipe, used, catalog) or (
            f"no documented envelope fits these cards (measured on {p.measured_on_mib} MiB cards): free GPU "
            "memory or use larger cards; preflight_vram_misfit: warn lets a lower max_model_len be tried"
        )
        out.append(Finding(
            "vram-fit", False, severity,
            f"variant {recipe.variant!r} (max_model_len {length}, gpu_memory_utilization {_fmt_util(util)}) does "
            f"not fit: {_describe_card(worst, p, util)}",
            fix, "preflight_vram_misfit",
        ))
        return out
    checks = [card_fit(util, chosen, g) for g in used]
    tight = min(checks, key=lambda c: (c.free - c.budget - chosen.overhead_mib))
    fit_text = (
        f"envelope {chosen.max_model_len} tokens at {_fmt_util(chosen.util)} (measured on "
        f"{chosen.measured_on_mib} MiB cards{'; the seeds note: ' + chosen.note if chosen.note else ''}); "
        f"tightest {_describe_card(tight, chosen, util)}"
    )
    if off_point:
        # Settings beyond the measured ones need more memory, never less: only a misfit is certain.
        out.append(Finding(
            "vram-fit", False, "warn",
            f"variant {recipe.variant!r} fits the measured {fit_text}, but not measured: {'; '.join(off_point)}",
            None, "variant_overrides",
        ))
    else:
        out.append(Finding("vram-fit", True, "info", f"variant {recipe.variant!r} fits: {fit_text}", None, "preflight_vram_misfit"))
    if driver_cuda is not None and _version(driver_cuda) >= NEWER_DRIVER_CUDA:
        headroom = min(c.budget for c in checks) - chosen.budget_mib
        if headroom < NEWER_DRIVER_EXTRA_RESERVE_MIB:
            out.append(Finding(
                "vram-driver", False, "warn",
                f"the driver supports CUDA {driver_cuda}: vLLM reserves about {NEWER_DRIVER_EXTRA_RESERVE_MIB} MiB more "
                f"for activations than on the CUDA 13.0 drivers the envelope was measured with, and the budget "
                f"exceeds the measured one by only {max(0.0, headroom):.0f} MiB: boot may fail with "
                f"'KV cache needed ... larger than available' (club-3090#149)",
                "lower variant_overrides.max_model_len (e.g. 180000 -> 105000 in #149), or use a 580-branch driver",
                "variant_overrides",
            ))
    return out


def assess(recipe: Recipe, gpus: Iterable[Any], driver_cuda: str | None, misfit_policy: str = "fail") -> list[Finding]:
    """Everything the fit says about `recipe` on a host, before anything changes on it.

    + gpus: every GPU of the host, in index order: GpuState, rigup.parsers.nvidia_smi.Gpu, the test bed's
      hardware entries, mappings or any object with memory_total_mib / memory_used_mib / name /
      compute_cap (see `gpu_state`). memory_used_mib must not count this variant's own container
      (rigup.facts.gpu.exclude_own); None means unknown and counts as 0.
    + driver_cuda: "13.0" as nvidia-smi reports it (`parse_driver_cuda`, fact DriverCudaVersion) for the
      driver that will run the container; None when there is none yet, or when this run installs
      another branch (then the planned branch decides: rigup.checks.preflight's driver-cuda check)
    + misfit_policy: preflight_vram_misfit, "fail" or "warn": the severity of a VRAM misfit

    Findings, in order: cuda-compat, gpu-layout, gpu-mix (mixed cards only), vram-fit, vram-driver
    (newer drivers near the envelope only), interconnect (tensor parallel >= 2 only).
    """
    catalog = load_catalog()
    findings: list[Finding] = []
    severity: Severity = "fail"
    if misfit_policy in VRAM_MISFIT_POLICIES:
        severity = "fail" if misfit_policy == "fail" else "warn"
    else:
        findings.append(Finding("vram-policy", False, "fail", f"preflight_vram_misfit must be fail or warn, got {misfit_policy!r}",
                                "set preflight_vram_misfit: fail (or warn)", "preflight_vram_misfit"))
    findings.append(cuda_compat(recipe.image.cuda_runtime, driver_cuda, recipe.image.ref))
    states = [gpu_state(g, i) for i, g in enumerate(gpus)]
    if not states:
        findings.append(Finding("gpu-layout", False, "fail", "no GPU reported: nothing to fit", "check the driver and the cards", "variant"))
        return findings
    findings.append(_layout(recipe, states, catalog))
    used = states[: recipe.gpu_count]
    mix = _mix(states, used)
    if mix is not None:
        findings.append(mix)
    if len(states) >= recipe.gpu_count:
        findings.extend(_vram(recipe, used, severity, driver_cuda, catalog))
    if recipe.tensor_parallel_size > 1:
        plan = recipe.interconnect_note or pcie_summary(recipe.interconnect)
        if len(states) < 2:  # a one-GPU host has no link to plan NCCL for
            plan = f"none: the host has {len(states)} GPU, no link between GPUs"
        findings.append(Finding("interconnect", True, "info", plan, None, "gpu_interconnect"))
    return findings

