"""The nemotron-3-puzzle-75b family (rigup/desired/catalog.d/nemotron-3-puzzle-75b.yaml) against the values
typed in from club-3090 @ 4a29ab57 (its two compose files, scripts/lib/profiles/models/nemotron-3-puzzle-75b.yml,
engines/vllm-stable.yml, drafters/nemotron-mtp-builtin.yml, registry.yaml), never read back from the catalog."""

from __future__ import annotations

from typing import Any

import pytest

from rigup.desired.recipe import RecipeError
from tests.support.recipes import arg, recipe_for

NVLINK_SOURCE = "/opt/rigup/sources/club3090/scripts/detect_nvlink.sh"
MTP3 = '{"method":"mtp","num_speculative_tokens":3}'
STABLE = "docker.io/vllm/vllm-openai:v0.27.1"

# variant: upstream path, port, TP, repo id, dir, GB, max-model-len, util, max-num-seqs, max-num-batched-tokens,
#          kv dtype, speculative config, min compute capability
EXPECTED: dict[str, tuple[Any, ...]] = {
    "nemotron-dual-w4a16-turbo": (
        "models/nemotron-3-puzzle-75b/vllm/compose/dual/w4a16/turbo.yml", 8096, 2,
        "danielrmay/NVIDIA-Nemotron-Labs-3-Puzzle-75B-A9B-W4A16", "nemotron-3-puzzle-75b-w4a16", 41.48,
        262144, 0.96, 4, 1024, "int8_per_token_head", None, (8, 6)),
    "nemotron-multi4-nvfp4-mtp": (
        "models/nemotron-3-puzzle-75b/vllm/compose/multi4/nvfp4/mtp.yml", 8095, 4,
        "nvidia/NVIDIA-Nemotron-Labs-3-Puzzle-75B-A9B-NVFP4", "nemotron-3-puzzle-75b-nvfp4", 53.5,
        200000, 0.85, 1, 8192, "fp8", MTP3, (9, 0)),
}


@pytest.mark.parametrize("variant", list(EXPECTED))
def test_variant_matches_upstream(variant: str) -> None:
    path, port, tp, repo, model_dir, size, ctx, util, seqs, mbt, kv, spec, cc = EXPECTED[variant]
    r = recipe_for(variant)
    assert r.upstream is not None and (r.upstream.source, r.upstream.path) == ("club3090", path)
    assert r.upstream_status == "current"
    assert r.service_name == "vllm-nemotron-puzzle-75b"
    assert (r.host_port, r.container_port, r.tensor_parallel_size, r.gpu_count) == (port, 8000, tp, tp)
    assert r.image.ref == STABLE and r.image.cuda_runtime == "13.0"
    assert (r.model.repo_id, r.model.dir_name, r.model.approx_size_gb) == (repo, model_dir, size)
    assert r.model.container_path == f"/root/.cache/huggingface/{model_dir}" == arg(r, "--model")
    assert r.draft is None and not r.model.gated
    assert arg(r, "--served-model-name") == r.served_model_name == "nemotron-3-puzzle-75b"
    assert (r.max_model_len, r.gpu_memory_utilization, r.max_num_seqs, r.max_num_batched_tokens) == (ctx, util, seqs, mbt)
    assert (arg(r, "--max-model-len"), arg(r, "--gpu-memory-utilization")) == (str(ctx), str(util))
    assert (arg(r, "--max-num-seqs"), arg(r, "--max-num-batched-tokens")) == (str(seqs), str(mbt))
    assert arg(r, "--tensor-parallel-size") == str(tp) and arg(r, "--pipeline-parallel-size") == "1"
    assert r.kv_cache_dtype == kv == arg(r, "--kv-cache-dtype")
    assert r.speculative_config == spec
    assert r.speculative_method == ("mtp" if spec else None)
    assert "--speculative-config" not in r.vllm_args  # the entrypoint builds it from SPEC_N (none on the W4A16)
    assert r.min_compute_capability == cc and r.min_gpu_memory_gb == 24 and r.vram_per_gpu_gb is None
    assert r.envelope_is_documented and not r.language_model_only
    assert not r.genesis and not r.needs_network_at_start
    # Both: a 512-expert MoE split across the TP group, Nemotron's reasoning parser, Qwen3-coder tool calls,
    # thinking on, NVIDIA's sampling.
    for flag in ("--enable-expert-parallel", "--trust-remote-code", "--enable-auto-tool-choice"):
        assert flag in r.vllm_args, flag
    assert (arg(r, "--reasoning-parser"), arg(r, "--tool-call-parser")) == ("nemotron_v3", "qwen3_coder")
    assert arg(r, "--default-chat-template-kwargs") == '{"enable_thinking": true, "force_nonempty_content": true}'
    assert arg(r, "--override-generation-config") == '{"temperature":1.0,"top_p":0.95}'
    assert (arg(r, "--host"), arg(r, "--port")) == ("0.0.0.0", "8000")
    script = r.entrypoint[2]
    assert r.entrypoint[:2] == ("bash", "-c") and r.entrypoint[3] == "--"
    assert "source /etc/club3090/detect_nvlink.sh" in script and "--disable-custom-all-reduce" in script
    nvlink = next(m for m in r.mounts if m.target == "/etc/club3090/detect_nvlink.sh")
    assert nvlink.source == NVLINK_SOURCE and nvlink.read_only
    env = {e.name: e.value for e in r.environment}
    assert env["NVLINK_MODE"] == "auto" and env["NCCL_P2P_DISABLE"] == "1" and env["NCCL_CUMEM_ENABLE"] == "0"
    assert r.shm_size == "16gb" and r.ipc == "host"


def test_dual_w4a16_is_the_ampere_fit_without_a_drafter() -> None:
    r = recipe_for("nemotron-dual-w4a16-turbo")
    assert (arg(r, "--mamba-backend"), arg(r, "--kv-cache-memory-bytes")) == ("triton", "820000000")
    assert "--no-enable-prefix-caching" in r.vllm_args and "--enable-prefix-caching" not in r.vllm_args
    assert arg(r, "--compilation-config") == '{"cudagraph_mode":"PIECEWISE","cudagraph_capture_sizes":[1,2,4]}'
    assert "SPEC_N" not in r.entrypoint[2]  # the checkpoint ships no MTP weights
    env = {e.name: e.value for e in r.environment}
    assert env["VLLM_ATTENTION_BACKEND"] == "TRITON_ATTN" and env["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "garbage_collection_threshold:0.6,max_split_size_mb:128"
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    with pytest.raises(RecipeError, match=r"must be one of \[2\]"):
        recipe_for("nemotron-dual-w4a16-turbo", variant_overrides={"tensor_parallel_size": 4})


def test_multi4_nvfp4_runs_nvidias_mamba_and_mtp_path() -> None:
    r = recipe_for("nemotron-multi4-nvfp4-mtp")
    assert (arg(r, "--mamba-backend"), arg(r, "--mamba-ssm-cache-dtype")) == ("flashinfer", "float16")
    assert "--enable-mamba-cache-stochastic-rounding" in r.vllm_args and arg(r, "--mamba-cache-philox-rounds") == "5"
    for flag in ("--async-scheduling", "--enable-chunked-prefill", "--enable-prefix-caching"):
        assert flag in r.vllm_args, flag
    script = r.entrypoint[2]
    # SPEC_N wins, then NUM_SPEC_TOKENS, then 3; SPEC=off or SPEC_N=0 turns the drafter off.
    assert "$${SPEC_N:-$${NUM_SPEC_TOKENS:-3}}" in script and "off|OFF|Off|false|no|0" in script
    assert '\\"method\\":\\"mtp\\"' in script
    env = {e.name: e.value for e in r.environment}
    assert env["VLLM_USE_FLASHINFER_SAMPLER"] == "1"
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True,max_split_size_mb:512"
    assert env["NUM_SPEC_TOKENS"] == "" and env["SPEC_N"] == ""
    assert r.model.approx_size_gb + r.image.approx_size_gb <= r.disk_needed_gb
