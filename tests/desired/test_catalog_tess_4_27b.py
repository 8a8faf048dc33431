"""The tess-4-27b family (rigup/desired/catalog.d/tess-4-27b.yaml) against the values typed in from
club-3090 @ 4a29ab57 (its compose files, scripts/lib/profiles/models/tess-4-27b.yml, engines/vllm-stable.yml,
registry.yaml, BENCHMARKS.md), never read back from the catalog."""

from __future__ import annotations

from typing import Any

import pytest

from rigup.desired.recipe import Recipe
from tests.support.recipes import arg, recipe_for

FROGGERIC = "/etc/qwen-froggeric-chat-template.jinja"
PATCHES = "/opt/rigup/sources/club3090/models/qwen3.6-27b/vllm/patches"
FROGGERIC_SOURCE = f"{PATCHES}/froggeric-chat-template/chat_template.jinja"
PR48375_SOURCE = f"{PATCHES}/vllm-pr48375-mamba-drop-eagle-block"
NVLINK_SOURCE = "/opt/rigup/sources/club3090/scripts/detect_nvlink.sh"
MTP3 = '{"method":"mtp","num_speculative_tokens":3}'

# variant: upstream path, service, port, repo id, dir, GB, served names, --quantization, max-model-len, util,
#          max-num-seqs, kv dtype, speculative config, prefix caching, min compute capability, VRAM per card
EXPECTED: dict[str, tuple[Any, ...]] = {
    "tess-dual-leaderboard-w4a16-fp8-mtp": (
        "models/tess-4-27b/vllm/compose/dual/leaderboard-w4a16/fp8-mtp.yml", "vllm-tess-4-27b-dual-w4a16", 8083,
        "LeaderboardModel1/Tess-4-27B-AutoRound-W4A16-Tuning", "tess-4-27b-autoround-w4a16", 18.0,
        ["tess-4-27b", "tess-4-27b-w4a16"], "auto_round", 262144, 0.9, 1, "fp8_e4m3", MTP3, True, (8, 6), 21.9),
    "tess-dual-nvfp4-fp8": (
        "models/tess-4-27b/vllm/compose/dual/nvfp4/fp8.yml", "vllm-tess-4-27b-dual-nvfp4", 8082,
        "migtissera/Tess-4-27B-NVFP4", "tess-4-27b-nvfp4", 19.0,
        ["tess-4-27b", "tess-4-27b-nvfp4"], None, 131072, 0.92, 2, "fp8", None, False, (9, 0), 23.0),
}


def served(recipe: Recipe) -> list[str]:
    args = list(recipe.vllm_args)
    out = []
    for token in args[args.index("--served-model-name") + 1:]:
        if token.startswith("--"):
            break
        out.append(token)
    return out


@pytest.mark.parametrize("variant", list(EXPECTED))
def test_variant_matches_upstream(variant: str) -> None:
    (path, service, port, repo, model_dir, size, names, quant, ctx, util, seqs, kv, spec, prefix, cc,
     vram) = EXPECTED[variant]
    r = recipe_for(variant)
    assert r.upstream is not None and r.upstream_source is not None
    assert r.upstream.path == path and r.upstream_source.name == "club3090" and r.upstream_status == "current"
    assert r.service_name == service
    assert (r.host_port, r.tensor_parallel_size, r.gpu_count, r.valid_tensor_parallel_sizes) == (port, 2, 2, (2,))
    assert r.image.ref == "docker.io/vllm/vllm-openai:v0.27.1"
    assert (r.model.repo_id, r.model.dir_name, r.model.approx_size_gb) == (repo, model_dir, size)
    assert arg(r, "--model") == f"/root/.cache/huggingface/{model_dir}" and r.draft is None
    assert served(r) == names and r.served_model_name == "tess-4-27b"
    assert arg(r, "--quantization") == quant and r.dtype == "bfloat16"
    envelope = (r.max_model_len, r.gpu_memory_utilization, r.max_num_seqs, r.max_num_batched_tokens)
    assert envelope == (ctx, util, seqs, 8192)
    assert arg(r, "--tensor-parallel-size") == "2" and arg(r, "--max-model-len") == str(ctx)
    assert arg(r, "--max-num-seqs") == str(seqs)
    assert r.kv_cache_dtype == kv
    assert r.speculative_config == spec and r.speculative_method == ("mtp" if spec else None)
    assert "--speculative-config" not in r.vllm_args  # the W4A16 entrypoint adds it from SPEC_N
    assert ("--enable-prefix-caching" in r.vllm_args) is prefix
    assert arg(r, "--chat-template") == FROGGERIC  # the model repository's own template is broken
    assert arg(r, "--default-chat-template-kwargs") == '{"enable_thinking": false}'
    assert arg(r, "--reasoning-parser") == "qwen3" and arg(r, "--tool-call-parser") == "qwen3_coder"
    assert "--trust-remote-code" in r.vllm_args and "--enable-chunked-prefill" in r.vllm_args
    assert not r.language_model_only
    assert (arg(r, "--host"), arg(r, "--port")) == ("0.0.0.0", "8000")
    assert r.min_compute_capability == cc and r.min_gpu_memory_gb == 24
    assert (r.vram_per_gpu_gb, r.measured_on_gpu_mib) == (vram, 24576)
    assert r.envelope_is_documented
    assert not r.genesis and not r.needs_network_at_start
    script = "\n".join(r.entrypoint)
    assert r.entrypoint[:2] == ("bash", "-c") and r.entrypoint[-1] == "--"
    assert "source /etc/club3090/detect_nvlink.sh" in script and "--disable-custom-all-reduce" in script
    env = {e.name: e.value for e in r.environment}
    assert env["NVLINK_MODE"] == "auto" and env["NCCL_P2P_DISABLE"] == "1"


def test_w4a16_runs_pr48375_and_builds_mtp_from_spec_n() -> None:
    r = recipe_for("tess-dual-leaderboard-w4a16-fp8-mtp")
    script = "\n".join(r.entrypoint)
    assert "bash /etc/club3090/pr48375/install.sh" in script
    assert "SPEC_N:-3}" in script and '\\"method\\":\\"mtp\\"' in script
    sources = {m.target: m.source for m in r.mounts if m.kind == "source"}
    assert sources == {FROGGERIC: FROGGERIC_SOURCE, "/etc/club3090/detect_nvlink.sh": NVLINK_SOURCE,
                       "/etc/club3090/pr48375": PR48375_SOURCE}
    env = {e.name: e.value for e in r.environment}
    assert (env["SPEC_N"], env["SPEC"]) == ("", "")


def test_nvfp4_mounts_and_has_no_drafter() -> None:
    r = recipe_for("tess-dual-nvfp4-fp8")
    assert "SPEC_N" not in "\n".join(r.entrypoint)
    sources = {m.target: m.source for m in r.mounts if m.kind == "source"}
    assert sources == {FROGGERIC: FROGGERIC_SOURCE, "/etc/club3090/detect_nvlink.sh": NVLINK_SOURCE}


def test_model_tensor_parallel_sizes() -> None:
    # 24 attention / 4 KV heads: "supports TP up to 4"; each variant ships and validated TP=2 only.
    with pytest.raises(ValueError, match="must be one of \\[2\\]"):
        recipe_for("tess-dual-nvfp4-fp8", variant_overrides={"tensor_parallel_size": 4})
    with pytest.raises(ValueError, match="cannot be split 8 ways"):
        recipe_for("tess-dual-nvfp4-fp8", variant_overrides={"tensor_parallel_size": 8})
