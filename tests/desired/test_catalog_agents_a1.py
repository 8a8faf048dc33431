"""The agents-a1 family (rigup/desired/catalog.d/agents-a1.yaml) against the values typed in from
club-3090 @ 4a29ab57 (its compose file, scripts/lib/profiles/models/agents-a1.yml, engines/vllm-stable.yml,
registry.yaml, BENCHMARKS.md), never read back from the catalog."""

from __future__ import annotations

from tests.support.recipes import arg, recipe_for

VARIANT = "agents-a1-dual-fp8-dynamic-fp8"


def test_variant_matches_upstream() -> None:
    r = recipe_for(VARIANT)
    assert r.upstream is not None and r.upstream_source is not None
    assert r.upstream.path == "models/agents-a1/vllm/compose/dual/fp8-dynamic/fp8.yml"
    assert r.upstream_source.name == "club3090" and r.upstream_status == "current"
    assert r.service_name == "vllm-agents-a1-dual"
    assert (r.host_port, r.tensor_parallel_size, r.gpu_count, r.valid_tensor_parallel_sizes) == (8072, 2, 2, (2,))
    assert r.image.ref == "docker.io/vllm/vllm-openai:v0.27.1"
    assert (r.model.repo_id, r.model.dir_name) == ("InternScience/Agents-A1-FP8-dynamic", "Agents-A1-FP8-dynamic")
    assert r.model.approx_size_gb == 36.0 and not r.model.gated and r.draft is None
    assert arg(r, "--model") == "/root/.cache/huggingface/Agents-A1-FP8-dynamic" == r.model.container_path
    assert r.served_model_name == "agents-a1"
    assert arg(r, "--quantization") == "compressed-tensors" and r.dtype == "float16"
    assert (r.max_model_len, r.gpu_memory_utilization, r.max_num_seqs, r.max_num_batched_tokens) == (
        262144, 0.92, 1, 8192)
    assert arg(r, "--tensor-parallel-size") == "2" and arg(r, "--max-model-len") == "262144"
    assert r.kv_cache_dtype == "fp8_e4m3"
    assert arg(r, "--limit-mm-per-prompt") == '{"image":2,"audio":0}' and not r.language_model_only
    assert r.speculative_config is None and "--speculative-config" not in r.vllm_args  # no MTP head
    assert "--trust-remote-code" not in r.vllm_args  # upstream's generated compose leaves it out
    assert arg(r, "--chat-template") is None
    assert arg(r, "--default-chat-template-kwargs") == '{"enable_thinking": false}'
    assert arg(r, "--reasoning-parser") == "qwen3" and arg(r, "--tool-call-parser") == "qwen3_coder"
    assert "--enable-prefix-caching" in r.vllm_args and "--enable-chunked-prefill" in r.vllm_args
    assert (arg(r, "--host"), arg(r, "--port")) == ("0.0.0.0", "8000")
    assert r.min_compute_capability == (8, 6) and r.min_gpu_memory_gb == 24
    assert (r.vram_per_gpu_gb, r.measured_on_gpu_mib) == (22.0, 24576)
    assert r.envelope_is_documented
    assert not r.genesis and not r.needs_network_at_start


def test_entrypoint_and_environment() -> None:
    r = recipe_for(VARIANT)
    script = "\n".join(r.entrypoint)
    assert r.entrypoint[:2] == ("bash", "-c") and r.entrypoint[-1] == "--"
    assert "source /etc/club3090/detect_nvlink.sh" in script and "--disable-custom-all-reduce" in script
    env = {e.name: e.value for e in r.environment}
    assert env["NVLINK_MODE"] == "auto" and env["NCCL_P2P_DISABLE"] == "1"
    assert "VLLM_TEST_FORCE_FP8_MARLIN" not in env  # commented out upstream (the sm_120 workaround)
    assert "VLLM_USE_DEEP_GEMM" not in env  # a bare passthrough
    sources = {m.target: m.source for m in r.mounts if m.kind == "source"}
    assert sources == {"/etc/club3090/detect_nvlink.sh": "/opt/rigup/sources/club3090/scripts/detect_nvlink.sh"}
