"""The gemma-4-12b family (rigup/desired/catalog.d/gemma-4-12b.yaml): each variant against the values typed in
from club-3090 @ 4a29ab57 (the compose files, scripts/lib/profiles/models/gemma-4-12b.yml, engines/vllm-stable.yml,
engines/vllm-gemma4-unified.yml, drafters/gemma-12b-it-assistant.yml, registry.yaml, BENCHMARKS.md), never read
back from the catalog."""

from __future__ import annotations

from typing import Any

import pytest

from rigup.desired.recipe import Recipe
from tests.support.recipes import arg, recipe_for

STABLE = "docker.io/vllm/vllm-openai:v0.27.1"  # engine profile vllm-stable
UNIFIED = "docker.io/vllm/vllm-openai:gemma4-unified"  # engine profile vllm-gemma4-unified
TEMPLATE = "/etc/club3090/gemma-canonical-template.jinja"
TEMPLATE_SOURCE = ("/opt/rigup/sources/club3090/models/gemma-4-31b/vllm/patches/google-canonical-chat-template/"
                   "chat_template.jinja")
BF16 = ("google/gemma-4-12B-it", "gemma-4-12b-it", 23.9, True)
INT8 = ("Intel/gemma-4-12B-it-int8-AutoRound", "gemma-4-12b-autoround-int8", 13.0, False)
QAT = ("unsloth/gemma-4-12B-it-qat-w4a16", "gemma-4-12b-qat-w4a16", 9.6, False)
ASSISTANT = ("google/gemma-4-12B-it-assistant", "gemma-4-12b-it-assistant", 0.85, True)
MTP4 = '{"method":"mtp","num_speculative_tokens":4}'
GEN_CONFIG = '{"temperature":1.0,"top_p":0.95,"top_k":64,"min_p":0.0,"repetition_penalty":1.0}'

# variant: upstream path, port, TP, image, model (repo, dir, GB, gated), draft, served name, --quantization,
#          --dtype, max-model-len, util, max-num-seqs, batched tokens, speculative config, VRAM per card (GB)
EXPECTED: dict[str, tuple[Any, ...]] = {
    "gemma12b-dual-bf16-mtp": (
        "models/gemma-4-12b/vllm/compose/dual/bf16/mtp.yml", 8036, 2, STABLE, BF16, None, "gemma-4-12b", None, None,
        262144, 0.90, 4, 4096, None, None),
    "gemma12b-single-autoround-int8-mtp": (
        "models/gemma-4-12b/vllm/compose/single/autoround-int8/mtp.yml", 8038, 1, UNIFIED, INT8, ASSISTANT,
        "gemma-4-12b-int8", "auto_round", "float16", 262144, 0.92, 4, None, MTP4, 20.7),
    "gemma12b-single-qat-w4a16-mtp": (
        "models/gemma-4-12b/vllm/compose/single/qat-w4a16/mtp.yml", 8038, 1, UNIFIED, QAT, ASSISTANT,
        "gemma-4-12b-qat-w4a16", "compressed-tensors", "float16", 262144, 0.92, 4, None, MTP4, None),
}


def mount(recipe: Recipe, target: str) -> Any:
    return next(m for m in recipe.mounts if m.target == target)


@pytest.mark.parametrize("variant", list(EXPECTED))
def test_variant_matches_upstream(variant: str) -> None:
    (path, port, tp, image, (repo, model_dir, size, gated), draft, served, quant, dtype, ctx, util, seqs, mbt, spec,
     vram) = EXPECTED[variant]
    r = recipe_for(variant)
    assert r.upstream is not None and r.upstream.path == path and r.upstream_source.name == "club3090"
    assert r.upstream_status == "current" and r.family == "gemma-4-12b"
    assert (r.host_port, r.tensor_parallel_size, r.gpu_count) == (port, tp, tp)
    assert r.valid_tensor_parallel_sizes == (tp,)
    assert r.image.ref == image
    assert (r.model.repo_id, r.model.dir_name, r.model.approx_size_gb, r.model.gated) == (repo, model_dir, size, gated)
    assert r.model.container_path == f"/root/.cache/huggingface/{model_dir}" == arg(r, "--model")
    if draft is None:
        assert r.draft is None
    else:
        d = r.draft
        assert d is not None and (d.repo_id, d.dir_name, d.approx_size_gb, d.gated) == draft
        assert mount(r, f"/root/.cache/huggingface/{draft[1]}").read_only
    assert r.served_model_name == served == arg(r, "--served-model-name")
    assert arg(r, "--quantization") == quant
    assert arg(r, "--dtype") == dtype and r.dtype == (dtype or "auto")
    assert r.kv_cache_dtype is None  # bf16 KV: the model's dtype (no fp8/int8 KV path on these images)
    envelope = (r.max_model_len, r.gpu_memory_utilization, r.max_num_seqs, r.max_num_batched_tokens)
    assert envelope == (ctx, util, seqs, mbt)
    assert arg(r, "--tensor-parallel-size") == str(tp) and arg(r, "--pipeline-parallel-size") == "1"
    assert r.envelope_is_documented
    assert r.speculative_config == spec
    assert r.speculative_method == (None if spec is None else "mtp")
    assert "--speculative-config" not in r.vllm_args  # the entrypoint adds it (or nothing)
    assert arg(r, "--chat-template") == TEMPLATE
    assert mount(r, TEMPLATE).source == TEMPLATE_SOURCE and mount(r, TEMPLATE).read_only
    assert arg(r, "--tool-call-parser") == "gemma4" and arg(r, "--reasoning-parser") == "gemma4"
    assert "--trust-remote-code" in r.vllm_args and "--enable-auto-tool-choice" in r.vllm_args
    assert arg(r, "--override-generation-config") == GEN_CONFIG
    assert (arg(r, "--host"), arg(r, "--port")) == ("0.0.0.0", "8000")
    assert not r.language_model_only
    assert r.min_compute_capability == (8, 6) and r.min_gpu_memory_gb == 24.0
    assert (r.vram_per_gpu_gb, r.measured_on_gpu_mib) == (vram, 24576)
    assert not r.genesis and not r.needs_network_at_start
    assert r.shm_size == "16gb" and r.ipc == "host"
    env = {e.name: e.value for e in r.environment}
    assert env["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn" and env["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] == "1"
    assert env["NCCL_P2P_DISABLE"] == "1" and env["NCCL_CUMEM_ENABLE"] == "0"


def test_dual_has_mtp_switched_off_and_detects_nvlink() -> None:
    r = recipe_for("gemma12b-dual-bf16-mtp")
    script = "\n".join(r.entrypoint)
    assert r.entrypoint[:2] == ("/bin/bash", "-c") and r.entrypoint[-1] == "--"
    assert "source /etc/club3090/detect_nvlink.sh" in script and "--disable-custom-all-reduce" in script
    assert "speculative" not in script and "SPEC_N" not in script  # upstream's --speculative-config is commented out
    assert [m.repo_id for m in r.models] == ["google/gemma-4-12B-it"]
    env = {e.name: e.value for e in r.environment}
    assert env["NVLINK_MODE"] == "auto"
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True,max_split_size_mb:512"
    nvlink = mount(r, "/etc/club3090/detect_nvlink.sh")
    assert nvlink.source == "/opt/rigup/sources/club3090/scripts/detect_nvlink.sh" and nvlink.read_only


@pytest.mark.parametrize("variant", ["gemma12b-single-autoround-int8-mtp", "gemma12b-single-qat-w4a16-mtp"])
def test_single_cards_build_the_assistant_drafter_in_the_entrypoint(variant: str) -> None:
    r = recipe_for(variant)
    script = "\n".join(r.entrypoint)
    assert r.entrypoint[:2] == ("/bin/bash", "-c") and r.entrypoint[-1] == "--"
    assert '"$${SPEC_N:-4}"' in script  # the drafter's depth defaults to 4
    # ${SPEC_MODEL_SUBDIR:-gemma-4-12b-it-assistant} resolved by compose's interpolation to the drafter's directory
    assert '/root/.cache/huggingface/gemma-4-12b-it-assistant\\",\\"num_speculative_tokens\\":$$n' in script
    assert "${" not in script.replace("$${", "")  # every compose-time variable took its default
    assert "--enforce-eager" not in script  # ${VLLM_ENFORCE_EAGER:+--enforce-eager} is empty by default
    assert "detect_nvlink" not in script
    env = {e.name: e.value for e in r.environment}
    assert env["SPEC_N"] == "" and env["SPEC"] == ""
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"


def test_qat_loads_the_vision_embedder_workaround() -> None:
    r = recipe_for("gemma12b-single-qat-w4a16-mtp")
    patch = mount(r, "/etc/club3090/g4patch")
    assert patch.source == "/opt/rigup/sources/club3090/models/gemma-4-12b/vllm/patches/gemma4-unified-vision-unquant"
    assert patch.read_only and patch.origin == "git:club3090"
    env = {e.name: e.value for e in r.environment}
    assert env["PYTHONPATH"] == "/etc/club3090/g4patch:"
    assert not any(m.target == "/etc/club3090/g4patch" for m in recipe_for("gemma12b-single-autoround-int8-mtp").mounts)


def test_model_tensor_parallel_sizes() -> None:
    # 16 attention / 8 KV heads: upstream's profile valid_tp [1, 2, 4, 8]; each compose runs one TP.
    with pytest.raises(ValueError, match="valid tensor parallel sizes: 1, 2, 4, 8"):
        recipe_for("gemma12b-dual-bf16-mtp", variant_overrides={"tensor_parallel_size": 3})
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        recipe_for("gemma12b-single-autoround-int8-mtp", variant_overrides={"tensor_parallel_size": 2})
