"""The gemma-4-26b-a4b family (rigup/desired/catalog.d/gemma-4-26b-a4b.yaml): each variant against the values
typed in from club-3090 @ 4a29ab57 (the compose files, scripts/lib/profiles/models/gemma-4-26b-a4b.yml,
engines/vllm-stable.yml, engines/vllm-gemma-stable.yml, drafters/gemma-26b-it-assistant.yml, registry.yaml,
BENCHMARKS.md), never read back from the catalog."""

from __future__ import annotations

from typing import Any

import pytest

from rigup.desired.recipe import Recipe
from tests.support.recipes import arg, recipe_for

TEMPLATE = "/etc/club3090/gemma-canonical-template.jinja"
TEMPLATE_SOURCE = ("/opt/rigup/sources/club3090/models/gemma-4-31b/vllm/patches/google-canonical-chat-template/"
                   "chat_template.jinja")
AWQ = ("cyankiwi/gemma-4-26B-A4B-it-AWQ-4bit", "gemma-4-26b-a4b-awq-4bit", 17.0, False)
ASSISTANT = ("google/gemma-4-26B-A4B-it-assistant", "gemma-4-26b-a4b-it-assistant", 0.97, True)
GEN_CONFIG = '{"temperature":1.0,"top_p":0.95,"top_k":64,"min_p":0.0,"repetition_penalty":1.0}'

# variant: upstream path, port, TP, image, draft, max-model-len, util, max-num-seqs, batched tokens, kv dtype,
#          speculative config, VRAM per card (GB)
EXPECTED: dict[str, tuple[Any, ...]] = {
    "gemma26b-dual-awq-mtp": (
        "models/gemma-4-26b-a4b/vllm/compose/dual/awq/mtp.yml", 8041, 2, "docker.io/vllm/vllm-openai:v0.27.1", None,
        262144, 0.92, 256, 4096, "auto", None, None),
    "gemma26b-single-awq-int8": (
        "models/gemma-4-26b-a4b/vllm/compose/single/awq/int8.yml", 8040, 1, "docker.io/vllm/vllm-openai:v0.22.0",
        ASSISTANT, 176000, 0.94, 256, 4096, "int8_per_token_head", '{"method":"mtp","num_speculative_tokens":4}', 23.6),
}


def mount(recipe: Recipe, target: str) -> Any:
    return next(m for m in recipe.mounts if m.target == target)


@pytest.mark.parametrize("variant", list(EXPECTED))
def test_variant_matches_upstream(variant: str) -> None:
    path, port, tp, image, draft, ctx, util, seqs, mbt, kv, spec, vram = EXPECTED[variant]
    r = recipe_for(variant)
    assert r.upstream is not None and r.upstream.path == path and r.upstream_source.name == "club3090"
    assert r.upstream_status == "current" and r.family == "gemma-4-26b-a4b"
    assert (r.host_port, r.tensor_parallel_size, r.gpu_count) == (port, tp, tp)
    assert r.valid_tensor_parallel_sizes == (tp,)
    assert r.image.ref == image
    assert (r.model.repo_id, r.model.dir_name, r.model.approx_size_gb, r.model.gated) == AWQ
    assert r.model.container_path == "/root/.cache/huggingface/gemma-4-26b-a4b-awq-4bit" == arg(r, "--model")
    if draft is None:
        assert r.draft is None
    else:
        d = r.draft
        assert d is not None and (d.repo_id, d.dir_name, d.approx_size_gb, d.gated) == draft
        assert mount(r, f"/root/.cache/huggingface/{draft[1]}").read_only
    assert r.served_model_name == "gemma-4-26b-a4b-awq" == arg(r, "--served-model-name")
    assert arg(r, "--quantization") is None and r.dtype == "auto"  # compressed-tensors is read from the checkpoint
    envelope = (r.max_model_len, r.gpu_memory_utilization, r.max_num_seqs, r.max_num_batched_tokens)
    assert envelope == (ctx, util, seqs, mbt)
    assert arg(r, "--tensor-parallel-size") == str(tp) and arg(r, "--pipeline-parallel-size") == "1"
    assert r.envelope_is_documented
    assert r.kv_cache_dtype == kv == arg(r, "--kv-cache-dtype")
    assert r.speculative_config == spec and r.speculative_method == (None if spec is None else "mtp")
    assert "--speculative-config" not in r.vllm_args
    assert arg(r, "--limit-mm-per-prompt") == '{"image":0,"audio":0}'
    assert arg(r, "--chat-template") == TEMPLATE
    assert mount(r, TEMPLATE).source == TEMPLATE_SOURCE and mount(r, TEMPLATE).read_only
    assert arg(r, "--tool-call-parser") == "gemma4" and arg(r, "--reasoning-parser") == "gemma4"
    for flag in ("--trust-remote-code", "--enable-auto-tool-choice", "--enable-prefix-caching",
                 "--enable-chunked-prefill"):
        assert flag in r.vllm_args
    assert arg(r, "--long-prefill-token-threshold") == "2048"
    assert arg(r, "--override-generation-config") == GEN_CONFIG
    assert (arg(r, "--host"), arg(r, "--port")) == ("0.0.0.0", "8000")
    assert not r.language_model_only
    assert r.min_compute_capability == (8, 6) and r.min_gpu_memory_gb == 24.0
    assert (r.vram_per_gpu_gb, r.measured_on_gpu_mib) == (vram, 24576)
    assert not r.genesis and not r.needs_network_at_start
    assert r.shm_size == "16gb" and r.ipc == "host"
    env = {e.name: e.value for e in r.environment}
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True,max_split_size_mb:512"
    assert env["TRITON_CACHE_DIR"] == "/root/.triton/cache" and env["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] == "1"


def test_dual_has_mtp_switched_off_and_detects_nvlink() -> None:
    r = recipe_for("gemma26b-dual-awq-mtp")
    script = "\n".join(r.entrypoint)
    assert r.entrypoint[:2] == ("bash", "-c") and r.entrypoint[-1] == "--"
    assert "source /etc/club3090/detect_nvlink.sh" in script and "--disable-custom-all-reduce" in script
    assert "speculative" not in script and "SPEC_N" not in script  # upstream's --speculative-config is commented out
    assert [m.repo_id for m in r.models] == ["cyankiwi/gemma-4-26B-A4B-it-AWQ-4bit"]
    env = {e.name: e.value for e in r.environment}
    assert env["NVLINK_MODE"] == "auto"
    nvlink = mount(r, "/etc/club3090/detect_nvlink.sh")
    assert nvlink.source == "/opt/rigup/sources/club3090/scripts/detect_nvlink.sh" and nvlink.read_only


def test_single_applies_its_own_pr40391_overlay_then_builds_the_drafter() -> None:
    r = recipe_for("gemma26b-single-awq-int8")
    script = "\n".join(r.entrypoint)
    assert r.entrypoint[:2] == ("/bin/bash", "-c") and r.entrypoint[-1] == "--"
    assert script.index("bash /etc/club3090/pr40391/install.sh") < script.index("SPEC_N")
    assert '"$${SPEC_N:-4}"' in script
    assert '/root/.cache/huggingface/gemma-4-26b-a4b-it-assistant\\",\\"num_speculative_tokens\\":$$n' in script
    assert "detect_nvlink" not in script
    overlay = mount(r, "/etc/club3090/pr40391")
    # the 26B-A4B tree's own copy of the overlay, not the 31B's
    assert overlay.source == "/opt/rigup/sources/club3090/models/gemma-4-26b-a4b/vllm/patches/vllm-pr40391-v0.22.0"
    assert overlay.read_only and overlay.origin == "git:club3090"
    env = {e.name: e.value for e in r.environment}
    assert env["SPEC_N"] == "" and env["SPEC"] == ""
    # the compose's separate int8 caches become rigup's per-variant caches
    caches = {m.target: m.source for m in r.mounts if m.kind == "cache"}
    assert caches == {
        "/root/.cache/vllm/torch_compile_cache": "/opt/rigup/cache/gemma26b-single-awq-int8/torch_compile",
        "/root/.triton/cache": "/opt/rigup/cache/gemma26b-single-awq-int8/triton",
    }


def test_the_header_lines_upstream_parses() -> None:
    r = recipe_for("gemma26b-single-awq-int8")
    assert r.upstream is not None
    for line in ("# Requires-min-vram-gb: 24", "# Engine-profile: vllm-gemma-stable", "# Requires-min-gpu-count: 1",
                 "# Tensor-parallel: 1", "# Requires-sm: 7.5+"):
        assert line in r.upstream.text
    dual = recipe_for("gemma26b-dual-awq-mtp")
    assert dual.upstream is not None and "# Engine-profile: vllm-stable" in dual.upstream.text
    assert "# Requires-min-gpu-count: 2" in dual.upstream.text


def test_model_tensor_parallel_sizes() -> None:
    # 8 sliding / 2 global KV heads: upstream's profile caps TP at 2 (valid_tp [1, 2]).
    with pytest.raises(ValueError, match="cannot be split 4 ways"):
        recipe_for("gemma26b-dual-awq-mtp", variant_overrides={"tensor_parallel_size": 4})
