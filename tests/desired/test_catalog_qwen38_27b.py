"""The Qwen3.8-27B variants (catalog.d/qwen3.8-27b.yaml) hold club-3090 4a29ab57's values: each one is
checked against numbers typed in from upstream's compose files, model profile, drafter profile and
registry (models/qwen3.8-27b/vllm/compose/**, scripts/lib/profiles/{models/qwen3.8-27b,
drafters/syvai-qwen38-dflash2,engines/vllm-stable,registry}.yml@4a29ab5), never read back from the catalog.

Seven of the twenty composes also bind-mount models/qwen3.6-27b/vllm/patches/vllm-gdn-mtp-async-spec-order
(the GDN+MTP async spec-order overlay).
"""

from __future__ import annotations

import json
from typing import NamedTuple

import pytest
import yaml

from rigup.desired.catalog import variant_names
from rigup_testbed.recipes import tree as upstream_tree
from tests.support.recipes import arg, recipe_for

FROZENLOCK = "Frozenlock/Qwen3.8-27B-int4-AutoRound"
QWEN_FP8 = "Qwen/Qwen3.8-27B-FP8"
RADIXARK = "RadixArk/Qwen3.8-27B-NVFP4"
DFLASH2 = "syvai/Qwen3.8-27B-DFlash2-W4A16"
DRAFTER_PATH = "/root/.cache/huggingface/qwen3.8-27b-dflash2-w4a16"
GDN = "models/qwen3.6-27b/vllm/patches/vllm-gdn-mtp-async-spec-order"
COMPOSE = "models/qwen3.8-27b/vllm/compose/"

PR48375 = "/etc/club3090/pr48375"
W4A8 = "/etc/club3090/w4a8"
GDN_ORDER = "/etc/club3090/gdn-async-order"
DFLASH2_PATCH = "/etc/club3090/dflash2"
NVLINK = "/etc/club3090/detect_nvlink.sh"


class Row(NamedTuple):
    path: str  # under models/qwen3.8-27b/vllm/compose/
    port: int
    tp: int
    model: str  # repo id
    max_model_len: int
    util: float
    seqs: int
    kv: str  # --kv-cache-dtype default
    spec: tuple[str, int]  # what the entrypoint builds by default: method, SPEC_N default
    w4a8: str | None  # the compose's W4A8 default (None: no W4A8 switch)
    min_gpu_memory_gb: int = 24
    vram: float | None = None  # measured peak per card in GB (MiB / 1000), None: not measured


# Values typed in from each compose file's command defaults, ports and entrypoint at 4a29ab57.
EXPECTED: dict[str, Row] = {
    "qwen38-dual-fp8-mtp": Row("dual/fp8/mtp.yml", 8091, 2, QWEN_FP8, 262144, 0.92, 2, "fp8", ("mtp", 3), None, vram=22.9),
    "qwen38-dual-fp8-dflash2": Row("dual/fp8/dflash2.yml", 8110, 2, QWEN_FP8, 65536, 0.92, 1, "bfloat16", ("dflash", 7), None),
    "qwen38-dual-fp8-dflash2-fp8": Row("dual/fp8/dflash2-fp8.yml", 8107, 2, QWEN_FP8, 147456, 0.92, 1, "fp8_e4m3", ("dflash", 7), None),
    "qwen38-multi4-fp8-mtp": Row("multi4/fp8/mtp.yml", 8092, 4, QWEN_FP8, 262144, 0.92, 2, "auto", ("mtp", 3), None),
    "qwen38-multi4-fp8-dflash2": Row("multi4/fp8/dflash2.yml", 8111, 4, QWEN_FP8, 262144, 0.92, 2, "bfloat16", ("dflash", 7), None),
    "qwen38-multi4-fp8-dflash2-fp8": Row("multi4/fp8/dflash2-fp8.yml", 8108, 4, QWEN_FP8, 262144, 0.92, 2, "fp8_e4m3", ("dflash", 7), None),
    "qwen38-multi8-fp8-mtp": Row("multi8/fp8/mtp.yml", 8093, 8, QWEN_FP8, 262144, 0.92, 2, "auto", ("mtp", 3), None),
    "qwen38-multi8-fp8-dflash2": Row("multi8/fp8/dflash2.yml", 8112, 8, QWEN_FP8, 262144, 0.92, 2, "bfloat16", ("dflash", 7), None),
    "qwen38-multi8-fp8-dflash2-fp8": Row("multi8/fp8/dflash2-fp8.yml", 8109, 8, QWEN_FP8, 262144, 0.92, 2, "fp8_e4m3", ("dflash", 7), None),
    "qwen38-multi4-autoround-int4-mtp": Row("multi4/autoround-int4/mtp.yml", 8114, 4, FROZENLOCK, 262144, 0.95, 2, "fp8_e4m3", ("mtp", 4), "1"),
    "qwen38-multi8-autoround-int4-mtp": Row("multi8/autoround-int4/mtp.yml", 8097, 8, FROZENLOCK, 262144, 0.95, 2, "fp8_e4m3", ("mtp", 4), "1"),
    "qwen38-dual-nvfp4-mtp": Row("dual/nvfp4/mtp.yml", 8100, 2, RADIXARK, 262144, 0.90, 2, "fp8_e4m3", ("mtp", 3), None, vram=21.23),
    "qwen38-single-nvfp4-mtp": Row("single/nvfp4/mtp.yml", 8098, 1, RADIXARK, 65536, 0.85, 1, "fp8_e4m3", ("mtp", 3), None, min_gpu_memory_gb=32),
}
# The seven that also mount the GDN+MTP async spec-order overlay.
GDN_ORDERED: dict[str, Row] = {
    "qwen38-dual-autoround-int4-mtp": Row("dual/autoround-int4/mtp.yml", 8113, 2, FROZENLOCK, 262144, 0.90, 1, "fp8_e4m3", ("mtp", 4), "1"),
    "qwen38-dual-autoround-int4-dflash2": Row("dual/autoround-int4/dflash2.yml", 8101, 2, FROZENLOCK, 204800, 0.90, 1, "bfloat16", ("dflash", 7), "0", vram=20.9),
    "qwen38-dual-autoround-int4-dflash2-fp8": Row("dual/autoround-int4/dflash2-fp8.yml", 8104, 2, FROZENLOCK, 262144, 0.90, 1, "fp8_e4m3", ("dflash", 7), "1"),
    "qwen38-multi4-autoround-int4-dflash2": Row("multi4/autoround-int4/dflash2.yml", 8102, 4, FROZENLOCK, 262144, 0.95, 2, "bfloat16", ("dflash", 7), "0"),
    "qwen38-multi4-autoround-int4-dflash2-fp8": Row("multi4/autoround-int4/dflash2-fp8.yml", 8105, 4, FROZENLOCK, 262144, 0.95, 2, "fp8_e4m3", ("dflash", 7), "1"),
    "qwen38-multi8-autoround-int4-dflash2": Row("multi8/autoround-int4/dflash2.yml", 8103, 8, FROZENLOCK, 262144, 0.95, 2, "bfloat16", ("dflash", 7), "0"),
    "qwen38-multi8-autoround-int4-dflash2-fp8": Row("multi8/autoround-int4/dflash2-fp8.yml", 8106, 8, FROZENLOCK, 262144, 0.95, 2, "fp8_e4m3", ("dflash", 7), "1"),
}
ALL = {**EXPECTED, **GDN_ORDERED}

# Per weight format: model dir, approx size (GB, model profile size_gb), --quantization, served names.
WEIGHTS = {
    FROZENLOCK: ("qwen3.8-27b-autoround-int4", 19.0, "auto_round", ["qwen3.8-27b"]),
    QWEN_FP8: ("qwen3.8-27b-fp8", 30.9, "fp8", ["qwen3.8-27b", "qwen3.8-27b-fp8"]),
    RADIXARK: ("qwen3.8-27b-nvfp4", 21.9, "modelopt", ["qwen3.8-27b"]),
}


def overlays(row: Row) -> set[str]:
    """The in-repository mounts a compose has, by its quant and stem."""
    quant, stem = row.path.split("/")[1], row.path.split("/")[2][:-4]
    out = {PR48375, NVLINK}
    if quant == "autoround-int4":
        out.add(W4A8)
        if row.path.startswith("dual/") or stem.startswith("dflash2"):
            out.add(GDN_ORDER)
    if stem.startswith("dflash2"):
        out.add(DFLASH2_PATCH)
    return out


def test_all_twenty_composes_are_covered() -> None:
    fixtures = sorted(str(p.relative_to(upstream_tree("club3090") / COMPOSE))
                      for p in (upstream_tree("club3090") / COMPOSE).rglob("*.yml"))
    assert fixtures == sorted(row.path for row in ALL.values())
    assert len(fixtures) == 20
    assert set(ALL) <= set(variant_names())


@pytest.mark.parametrize("variant", list(ALL))
def test_variant_matches_upstream(variant: str) -> None:
    row = ALL[variant]
    r = recipe_for(variant)
    model_dir, size, quantization, served = WEIGHTS[row.model]
    assert r.upstream is not None and r.upstream.path == COMPOSE + row.path
    assert r.upstream_status == "current" and r.upstream_source is not None and r.upstream_source.name == "club3090"
    assert r.family == "qwen3.8-27b"
    assert (r.host_port, r.tensor_parallel_size, r.gpu_count) == (row.port, row.tp, row.tp)
    assert r.valid_tensor_parallel_sizes == (row.tp,)
    assert r.image.tag == "v0.27.1" and r.image.repository == "vllm/vllm-openai" and r.image.cuda_runtime == "13.0"
    assert (r.model.repo_id, r.model.dir_name, r.model.approx_size_gb) == (row.model, model_dir, size)
    assert r.model.container_path == f"/root/.cache/huggingface/{model_dir}" == arg(r, "--model")
    args = list(r.vllm_args)
    assert args[args.index("--served-model-name") + 1: args.index("--served-model-name") + 1 + len(served)] == served
    assert r.served_model_name == "qwen3.8-27b"
    assert arg(r, "--quantization") == quantization and r.dtype == "bfloat16"
    assert (r.max_model_len, r.gpu_memory_utilization, r.max_num_seqs, r.max_num_batched_tokens) == (
        row.max_model_len, row.util, row.seqs, 8192)
    assert r.kv_cache_dtype == row.kv
    assert arg(r, "--attention-backend") == ("FLASH_ATTN" if row.kv == "bfloat16" and "dflash2" in row.path else None)
    assert arg(r, "--long-prefill-token-threshold") == "4096"
    assert arg(r, "--pipeline-parallel-size") == ("1" if quantization == "fp8" else None)
    for flag in ("--trust-remote-code", "--enable-prefix-caching", "--enable-chunked-prefill", "--enable-auto-tool-choice"):
        assert flag in args, flag
    assert (arg(r, "--reasoning-parser"), arg(r, "--tool-call-parser")) == ("qwen3", "qwen3_coder")
    assert json.loads(arg(r, "--default-chat-template-kwargs") or "") == {"enable_thinking": False, "reasoning_effort": "low"}
    assert "--chat-template" not in args  # the checkpoint's own template (not froggeric)
    assert r.min_compute_capability == (8, 6) and r.min_gpu_memory_gb == row.min_gpu_memory_gb
    assert r.measured_on_gpu_mib == 24576 and r.vram_per_gpu_gb == row.vram
    assert r.envelope_is_documented and not r.language_model_only
    assert not r.genesis and not r.needs_network_at_start

    # Speculative decoding: what the entrypoint builds from SPEC_N by default.
    method, n = row.spec
    script = r.entrypoint[2]
    assert r.entrypoint[:2] == ("bash", "-c") and r.entrypoint[3] == "--"
    assert r.speculative_method == method
    assert json.loads(r.speculative_config or "") == {"method": method, "num_speculative_tokens": n}
    assert f"$${{SPEC_N:-{n}}}" in script and "SPEC:-" in script
    if method == "dflash":
        assert r.draft is not None and r.draft.repo_id == DFLASH2 and r.draft.dir_name == "qwen3.8-27b-dflash2-w4a16"
        assert r.draft.container_path == DRAFTER_PATH and DRAFTER_PATH in script and r.draft.approx_size_gb == 1.2
        assert '\\"method\\":\\"dflash\\"' in script
    else:
        assert r.draft is None and '\\"method\\":\\"mtp\\"' in script

    # Overlays from the club3090 checkout, read-only; the model mounts are the verified directories.
    targets = {m.target for m in r.mounts if m.kind == "source"}
    assert targets == overlays(row)
    assert all(m.read_only and m.origin == "git:club3090" for m in r.mounts if m.kind == "source")
    assert [m.target for m in r.mounts if m.kind == "model"] == [m.container_path for m in r.models]
    env = {e.name: e.value for e in r.environment}
    assert env.get("W4A8") == row.w4a8
    (service,) = yaml.safe_load(r.compose_text)["services"].values()
    passthrough = {e for e in service["environment"] if "=" not in e}  # the host's value, when it has one
    assert ("VLLM_MARLIN_INPUT_DTYPE" in passthrough) == (row.w4a8 is not None)
    assert (env["NVLINK_MODE"], env["NCCL_P2P_DISABLE"], env["NCCL_CUMEM_ENABLE"]) == ("auto", "1", "0")
    assert (env["ENABLE_THINKING"], env["VLLM_USE_FLASHINFER_SAMPLER"], env["VLLM_WORKER_MULTIPROC_METHOD"]) == (
        "false", "0", "spawn")
    alloc = "expandable_segments:True,max_split_size_mb:512" if quantization == "fp8" else "expandable_segments:True"
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == alloc
    assert "--disable-custom-all-reduce" in script  # unless detect_nvlink.sh finds NVLink


def test_nvfp4_stays_on_ampere_and_the_single_card_needs_32_gb() -> None:
    """The registry gives the qwen3.8 NVFP4 slugs no required_sm (the qwen3.6 ones have 9.0): the dual booted
    on 2x RTX 3090 through the Marlin W4A16 fallback; the single card needs 32 GB whatever the SM."""
    dual, single = recipe_for("qwen38-dual-nvfp4-mtp"), recipe_for("qwen38-single-nvfp4-mtp")
    assert dual.min_compute_capability == single.min_compute_capability == (8, 6)
    assert (dual.min_gpu_memory_gb, single.min_gpu_memory_gb) == (24, 32)
    assert single.gpu_count == 1 and dual.gpu_count == 2


def test_the_fp8_multis_run_bf16_kv_where_the_dual_runs_fp8() -> None:
    """Upstream's deliberate 2026-08-15 divergence: --kv-cache-dtype auto over --dtype bfloat16 on TP>=4."""
    assert recipe_for("qwen38-dual-fp8-mtp").kv_cache_dtype == "fp8"
    assert recipe_for("qwen38-multi4-fp8-mtp").kv_cache_dtype == recipe_for("qwen38-multi8-fp8-mtp").kv_cache_dtype == "auto"


def test_multi8_variants_take_all_eight_cards() -> None:
    for variant in ("qwen38-multi8-fp8-mtp", "qwen38-multi8-fp8-dflash2", "qwen38-multi8-fp8-dflash2-fp8",
                    "qwen38-multi8-autoround-int4-mtp"):
        r = recipe_for(variant)
        assert r.gpu_count == 8 and arg(r, "--tensor-parallel-size") == "8"
        assert "count: 8" in r.compose_text


def test_dflash2_variants_share_one_drafter() -> None:
    drafts = {recipe_for(v).draft for v in EXPECTED if "dflash2" in v}
    assert len(drafts) == 1 and next(iter(drafts)) is not None
