"""The thinkingcap-27b family (rigup/desired/catalog.d/thinkingcap-27b.yaml) against the values typed in
from club-3090 @ 4a29ab57 (its compose file, scripts/lib/profiles/models/thinkingcap-27b.yml,
engines/vllm-stable.yml, registry.yaml, BENCHMARKS.md), never read back from the catalog."""

from __future__ import annotations

from tests.support.recipes import arg, recipe_for

VARIANT = "thinkingcap-dual-w4a16-w4a8"
PATCHES = "/opt/rigup/sources/club3090/models/qwen3.6-27b/vllm/patches"


def test_variant_matches_upstream() -> None:
    r = recipe_for(VARIANT)
    assert r.upstream is not None and r.upstream_source is not None
    assert r.upstream.path == "models/thinkingcap-27b/vllm/compose/dual/w4a16/w4a8.yml"
    assert r.upstream_source.name == "club3090" and r.upstream_status == "current"
    assert r.service_name == "vllm-thinkingcap-27b-dual-w4a8"
    assert (r.host_port, r.tensor_parallel_size, r.gpu_count, r.valid_tensor_parallel_sizes) == (8099, 2, 2, (2,))
    assert r.image.ref == "docker.io/vllm/vllm-openai:v0.27.1"
    assert (r.model.repo_id, r.model.dir_name) == ("LeaderboardModel1/ThinkingCap-Qwen3.6-27B-AutoRound-W4A16-Tuning",
                                                   "thinkingcap-qwen3.6-27b-w4a16")
    assert r.model.approx_size_gb == 18.0 and not r.model.gated and r.draft is None
    assert arg(r, "--model") == "/root/.cache/huggingface/thinkingcap-qwen3.6-27b-w4a16"
    assert r.served_model_name == "thinkingcap-27b"
    assert arg(r, "--quantization") == "auto_round" and r.dtype == "bfloat16"
    assert (r.max_model_len, r.gpu_memory_utilization, r.max_num_seqs, r.max_num_batched_tokens) == (
        262144, 0.9, 8, 8192)
    assert arg(r, "--tensor-parallel-size") == "2"  # a literal upstream, not ${TP:-2}
    assert arg(r, "--gpu-memory-utilization") == "0.90" and arg(r, "--max-num-seqs") == "8"
    assert r.kv_cache_dtype == "fp8_e4m3"
    assert r.speculative_config == '{"method":"mtp","num_speculative_tokens":3}' and r.speculative_method == "mtp"
    assert "--speculative-config" not in r.vllm_args  # the entrypoint adds it from SPEC_N
    assert "--enable-prefix-caching" in r.vllm_args and "--enable-chunked-prefill" in r.vllm_args
    assert arg(r, "--chat-template") is None  # deliberately the checkpoint's own template
    assert arg(r, "--default-chat-template-kwargs") == '{"enable_thinking": false}'
    assert arg(r, "--override-generation-config") == '{"temperature":0.6,"top_p":0.95,"top_k":20,"min_p":0.0}'
    assert arg(r, "--reasoning-parser") == "qwen3" and arg(r, "--tool-call-parser") == "qwen3_coder"
    assert not r.language_model_only
    assert (arg(r, "--host"), arg(r, "--port")) == ("0.0.0.0", "8000")
    assert r.min_compute_capability == (8, 6) and r.min_gpu_memory_gb == 24
    assert (r.vram_per_gpu_gb, r.measured_on_gpu_mib) == (23.9, 24576)
    assert r.envelope_is_documented
    assert not r.genesis and not r.needs_network_at_start


def test_w4a8_patches_nvlink_and_spec_n() -> None:
    r = recipe_for(VARIANT)
    script = "\n".join(r.entrypoint)
    assert r.entrypoint[:2] == ("bash", "-c") and r.entrypoint[-1] == "--"
    steps = ["source /etc/club3090/detect_nvlink.sh", "bash /etc/club3090/w4a8/install.sh",
             "bash /etc/club3090/pr48375/install.sh"]
    assert all(step in script for step in steps)
    assert [script.index(step) for step in steps] == sorted(script.index(step) for step in steps)
    assert "--disable-custom-all-reduce" in script and "SPEC_N:-3}" in script
    env = {e.name: e.value for e in r.environment}
    assert env["VLLM_MARLIN_INPUT_DTYPE"] == "int8"
    assert (env["HF_HUB_OFFLINE"], env["TRANSFORMERS_OFFLINE"]) == ("1", "1")
    assert env["NVLINK_MODE"] == "auto" and env["NCCL_P2P_DISABLE"] == "1"
    sources = {m.target: m.source for m in r.mounts if m.kind == "source"}
    assert sources == {
        "/etc/club3090/w4a8": f"{PATCHES}/w4a8-int8-act",
        "/etc/club3090/pr48375": f"{PATCHES}/vllm-pr48375-mamba-drop-eagle-block",
        "/etc/club3090/detect_nvlink.sh": "/opt/rigup/sources/club3090/scripts/detect_nvlink.sh",
    }
    assert all(m.read_only for m in r.mounts if m.kind == "source")
