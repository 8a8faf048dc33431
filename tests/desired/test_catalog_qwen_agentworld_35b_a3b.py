"""The qwen-agentworld-35b-a3b family (rigup/desired/catalog.d/qwen-agentworld-35b-a3b.yaml) against the
values typed in from club-3090 @ 4a29ab57 (its compose file, scripts/lib/profiles/models/
qwen-agentworld-35b-a3b.yml, engines/vllm-stable.yml, registry.yaml, BENCHMARKS.md), never read back from
the catalog."""

from __future__ import annotations

import pytest

from tests.support.recipes import arg, recipe_for

VARIANT = "agentworld-dual-cyankiwi-awq-int4-fp8"


def test_variant_matches_upstream() -> None:
    r = recipe_for(VARIANT)
    assert r.upstream is not None and r.upstream_source is not None
    assert r.upstream.path == "models/qwen-agentworld-35b-a3b/vllm/compose/dual/cyankiwi-awq-int4/fp8.yml"
    assert r.upstream_source.name == "club3090" and r.upstream_status == "current"
    assert r.service_name == "vllm-qwen-agentworld-35b-a3b-dual"
    assert (r.host_port, r.tensor_parallel_size, r.gpu_count, r.valid_tensor_parallel_sizes) == (8080, 2, 2, (2,))
    assert r.image.ref == "docker.io/vllm/vllm-openai:v0.27.1"
    assert (r.model.repo_id, r.model.dir_name) == ("cyankiwi/Qwen-AgentWorld-35B-A3B-AWQ-INT4",
                                                   "qwen-agentworld-35b-a3b-awq-int4")
    assert r.model.approx_size_gb == 23.52 and not r.model.gated and r.draft is None
    assert arg(r, "--model") == "/root/.cache/huggingface/qwen-agentworld-35b-a3b-awq-int4"
    assert r.served_model_name == "qwen-agentworld-35b-a3b"
    assert arg(r, "--quantization") == "compressed-tensors" and r.dtype == "bfloat16"
    assert (r.max_model_len, r.gpu_memory_utilization, r.max_num_seqs, r.max_num_batched_tokens) == (
        262144, 0.92, 4, 8192)
    assert arg(r, "--tensor-parallel-size") == "2" and arg(r, "--max-num-seqs") == "4"
    assert r.kv_cache_dtype == "fp8"
    # The checkpoint has no visual tower (vLLM needs --language-model-only) and no mtp.* tensors.
    assert r.language_model_only and "--language-model-only" in r.vllm_args
    assert r.speculative_config is None and "--speculative-config" not in r.vllm_args
    assert arg(r, "--default-chat-template-kwargs") == '{"enable_thinking": true}'
    assert arg(r, "--chat-template") is None  # the checkpoint's own template
    assert arg(r, "--reasoning-parser") == "qwen3" and arg(r, "--tool-call-parser") == "qwen3_coder"
    assert "--enable-prefix-caching" in r.vllm_args and "--enable-chunked-prefill" in r.vllm_args
    assert (arg(r, "--host"), arg(r, "--port")) == ("0.0.0.0", "8000")
    assert r.min_compute_capability == (8, 6) and r.min_gpu_memory_gb == 24
    assert (r.vram_per_gpu_gb, r.measured_on_gpu_mib) == (23.4, 24576)  # 23,414 MiB/card on 2x 3090
    assert r.envelope_is_documented
    assert not r.genesis and not r.needs_network_at_start


def test_entrypoint_and_environment() -> None:
    r = recipe_for(VARIANT)
    script = "\n".join(r.entrypoint)
    assert r.entrypoint[:2] == ("bash", "-c") and r.entrypoint[-1] == "--"
    assert "source /etc/club3090/detect_nvlink.sh" in script and "--disable-custom-all-reduce" in script
    env = {e.name: e.value for e in r.environment}
    assert env["NVLINK_MODE"] == "auto" and env["NCCL_P2P_DISABLE"] == "1"
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    sources = {m.target: m.source for m in r.mounts if m.kind == "source"}
    assert sources == {"/etc/club3090/detect_nvlink.sh": "/opt/rigup/sources/club3090/scripts/detect_nvlink.sh"}


def test_tensor_parallel_is_capped_at_two() -> None:
    with pytest.raises(ValueError, match="cannot be split 4 ways"):
        recipe_for(VARIANT, variant_overrides={"tensor_parallel_size": 4})
