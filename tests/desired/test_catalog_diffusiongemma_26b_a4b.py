"""The diffusiongemma-26b-a4b family (rigup/desired/catalog.d/diffusiongemma-26b-a4b.yaml) against the values
typed in from club-3090 @ 4a29ab57 (models/diffusiongemma-26b-a4b/vllm/compose/dual/fp8/base.yml,
scripts/lib/profiles/models/diffusiongemma-26b-a4b.yml, engines/vllm-diffusion-gemma.yml, registry.yaml,
BENCHMARKS.md), never read back from the catalog."""

from __future__ import annotations

import pytest

from tests.support.recipes import arg, recipe_for

VARIANT = "diffusiongemma-dual-fp8-base"
SITE = "/usr/local/lib/python3.12/dist-packages/vllm/model_executor"
FIXES = "/opt/rigup/sources/club3090/models/diffusiongemma-26b-a4b/vllm/patches/gemma-image-fixes"


def test_variant_matches_upstream() -> None:
    r = recipe_for(VARIANT)
    assert r.upstream is not None and r.upstream_source is not None
    assert r.upstream.path == "models/diffusiongemma-26b-a4b/vllm/compose/dual/fp8/base.yml"
    assert r.upstream_source.name == "club3090" and r.upstream_status == "current"
    assert r.family == "diffusiongemma-26b-a4b"
    assert (r.host_port, r.tensor_parallel_size, r.gpu_count, r.valid_tensor_parallel_sizes) == (8042, 2, 2, (2,))
    assert r.image.ref == "docker.io/vllm/vllm-openai:v0.24.0"  # engine profile vllm-diffusion-gemma
    assert (r.model.repo_id, r.model.dir_name, r.model.approx_size_gb, r.model.gated) == (
        "RedHatAI/diffusiongemma-26B-A4B-it-FP8-dynamic", "diffusiongemma-26b-a4b-it-fp8-dynamic", 25.3, False)
    assert r.model.container_path == arg(r, "--model")
    assert arg(r, "--model") == "/root/.cache/huggingface/diffusiongemma-26b-a4b-it-fp8-dynamic"
    assert r.draft is None and [m.role for m in r.models] == ["main"]
    assert r.served_model_name == "diffusiongemma-26b-a4b"
    envelope = (r.max_model_len, r.gpu_memory_utilization, r.max_num_seqs, r.max_num_batched_tokens)
    assert envelope == (262144, 0.82, 1, 2048)
    assert r.envelope_is_documented
    assert r.kv_cache_dtype == "auto" and r.dtype == "auto" and arg(r, "--quantization") is None
    # a diffusion LM: no speculative decoding anywhere
    assert r.speculative_config is None and r.speculative_method is None
    assert "--enforce-eager" in r.vllm_args and "--trust-remote-code" in r.vllm_args
    assert arg(r, "--attention-backend") == "TRITON_ATTN"
    assert arg(r, "--hf-overrides") == '{"diffusion_sampler":"entropy_bound","diffusion_entropy_bound":0.1}'
    assert arg(r, "--generation-config") == "auto"
    assert arg(r, "--override-generation-config") == '{"max_new_tokens":16384}'
    assert arg(r, "--tool-call-parser") == "gemma4" and arg(r, "--reasoning-parser") == "gemma4"
    assert "--enable-auto-tool-choice" in r.vllm_args
    assert arg(r, "--chat-template") == "/etc/club3090/gemma-canonical-template.jinja"
    assert (arg(r, "--host"), arg(r, "--port")) == (None, None)  # this compose leaves vLLM's defaults (port 8000)
    assert arg(r, "--tensor-parallel-size") == "2" and arg(r, "--pipeline-parallel-size") == "1"
    assert not r.language_model_only
    assert r.min_compute_capability == (8, 6) and r.min_gpu_memory_gb == 24.0
    assert (r.vram_per_gpu_gb, r.measured_on_gpu_mib) == (23.0, 24576)
    assert not r.genesis and not r.needs_network_at_start
    assert r.shm_size == "16gb" and r.ipc == "host"


def test_v2_model_runner_eager_environment() -> None:
    env = {e.name: e.value for e in recipe_for(VARIANT).environment}
    assert env["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    assert env["TORCHDYNAMO_DISABLE"] == "1" and env["TORCH_COMPILE_DISABLE"] == "1"
    assert env["VLLM_ATTENTION_BACKEND"] == "TRITON_ATTN"
    assert env["DECODE_GRANULARITY"] == "canvas"
    assert env["NVLINK_MODE"] == "auto" and env["NCCL_P2P_DISABLE"] == "1"
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True,max_split_size_mb:512"
    assert "VLLM_USE_DEEP_GEMM" not in env  # a bare passthrough: absent unless the host sets it


def test_three_fix_files_mount_over_the_images_vllm() -> None:
    r = recipe_for(VARIANT)
    fixes = {m.target: m.source for m in r.mounts if m.source.startswith(FIXES)}
    assert fixes == {
        f"{SITE}/kernels/linear/scaled_mm/marlin.py": f"{FIXES}/marlin.py",
        f"{SITE}/layers/quantization/utils/marlin_utils_fp8.py": f"{FIXES}/marlin_utils_fp8.py",
        f"{SITE}/models/diffusion_gemma.py": f"{FIXES}/diffusion_gemma.py",
    }
    assert all(m.read_only and m.origin == "git:club3090" for m in r.mounts if m.source.startswith(FIXES))
    template = next(m for m in r.mounts if m.target == "/etc/club3090/gemma-canonical-template.jinja")
    assert template.source.endswith("/club3090/models/gemma-4-31b/vllm/patches/google-canonical-chat-template/"
                                    "chat_template.jinja")
    script = "\n".join(r.entrypoint)
    assert r.entrypoint[:2] == ("bash", "-c") and r.entrypoint[-1] == "--"
    assert "source /etc/club3090/detect_nvlink.sh" in script and "--disable-custom-all-reduce" in script


def test_the_header_lines_upstream_parses() -> None:
    r = recipe_for(VARIANT)
    assert r.upstream is not None
    for line in ("# Requires-min-vram-gb: 24", "# Engine-profile: vllm-diffusion-gemma", "# Requires-min-gpu-count: 2",
                 "# Tensor-parallel: 2", "# Requires-sm: 8.0+"):
        assert line in r.upstream.text


def test_model_tensor_parallel_sizes() -> None:
    # 8 sliding / 2 global KV heads: upstream's profile valid_tp [1, 2].
    with pytest.raises(ValueError, match="cannot be split 4 ways"):
        recipe_for(VARIANT, variant_overrides={"tensor_parallel_size": 4})
