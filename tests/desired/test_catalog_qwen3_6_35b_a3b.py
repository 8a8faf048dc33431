"""The qwen3.6-35b-a3b family (rigup/desired/catalog.d/qwen3.6-35b-a3b.yaml): each variant against the
values typed in from club-3090 @ 4a29ab57 (compose files, scripts/lib/profiles/models/qwen3.6-35b-a3b.yml,
engines/vllm-stable.yml, registry.yaml), never read back from the catalog."""

from __future__ import annotations

from typing import Any

import pytest

from rigup.desired.recipe import Recipe
from tests.support.recipes import arg, recipe_for

IMAGE = "docker.io/vllm/vllm-openai:v0.27.1"  # engine profile vllm-stable
FROGGERIC = "/etc/qwen-froggeric-chat-template.jinja"
AUTOROUND = ("Intel/Qwen3.6-35B-A3B-int4-mixed-AutoRound", "qwen3.6-35b-a3b-autoround-int4", 20.0)
NVFP4 = ("nvidia/Qwen3.6-35B-A3B-NVFP4", "qwen3.6-35b-a3b-nvfp4", 24.0)
NVFP4_FAST = ("unsloth/Qwen3.6-35B-A3B-NVFP4-Fast", "qwen3.6-35b-a3b-nvfp4-fast", 24.0)
SERVED_NVFP4 = ["qwen3.6-35b-a3b", "qwen3.6-35b-a3b-autoround"]

# variant: upstream path, port, TP, model (repo, dir, GB), served names, --quantization, --dtype,
#          max-model-len, util, max-num-seqs, batched tokens, kv dtype, chat template, image limit,
#          min compute capability, min GPU memory GB, VRAM per card (GB), measured-on card MiB
EXPECTED: dict[str, tuple[Any, ...]] = {
    "qwen35b-dual-autoround-int4-fp8": (
        "models/qwen3.6-35b-a3b/vllm/compose/dual/autoround-int4/fp8.yml", 8051, 2, AUTOROUND,
        ["qwen3.6-35b-a3b-autoround"], "auto_round", "float16", 262144, 0.92, 1, 8192, "fp8_e4m3", FROGGERIC,
        '{"image":2,"audio":0}', (8, 6), 24.0, 22.1, 24576),
    "qwen35b-dual-nvfp4-fast-fp8": (
        "models/qwen3.6-35b-a3b/vllm/compose/dual/nvfp4-fast/fp8.yml", 8081, 2, NVFP4_FAST,
        [*SERVED_NVFP4, "qwen3.6-35b-a3b-nvfp4-fast"], None, "bfloat16", 262144, 0.92, 1, 8192, "fp8", None,
        '{"image":2,"audio":0}', (9, 0), 24.0, 22.46, 24576),
    "qwen35b-dual-nvfp4-fp8": (
        "models/qwen3.6-35b-a3b/vllm/compose/dual/nvfp4/fp8.yml", 8079, 2, NVFP4,
        [*SERVED_NVFP4, "qwen3.6-35b-a3b-nvfp4"], "modelopt", "bfloat16", 262144, 0.92, 1, 8192, "fp8", FROGGERIC,
        '{"image":2,"audio":0}', (9, 0), 24.0, 31.0, 32607),
    "qwen35b-single-autoround-int4-preview": (
        "models/qwen3.6-35b-a3b/vllm/compose/single/autoround-int4/preview.yml", 8050, 1, AUTOROUND,
        ["qwen3.6-35b-a3b-autoround"], "auto_round", "float16", 8192, 0.95, 1, 4096, "fp8_e4m3", FROGGERIC,
        '{"image":0,"audio":0}', (8, 6), 24.0, None, 24576),
    "qwen35b-single-nvfp4-fp8": (
        "models/qwen3.6-35b-a3b/vllm/compose/single/nvfp4/fp8.yml", 8078, 1, NVFP4,
        [*SERVED_NVFP4, "qwen3.6-35b-a3b-nvfp4"], "modelopt", "bfloat16", 131072, 0.92, 1, 8192, "fp8", FROGGERIC,
        '{"image":2,"audio":0}', (9, 0), 32.0, 31.2, 32607),
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
    (path, port, tp, (repo, model_dir, size), names, quant, dtype, ctx, util, seqs, mbt, kv, template, mm, cc,
     min_gb, vram, measured_on) = EXPECTED[variant]
    r = recipe_for(variant)
    assert r.upstream is not None and r.upstream.path == path and r.upstream_source.name == "club3090"
    assert r.upstream_status == "current"
    assert (r.host_port, r.tensor_parallel_size, r.gpu_count) == (port, tp, tp)
    assert r.valid_tensor_parallel_sizes == (tp,)
    assert r.image.ref == IMAGE
    assert (r.model.repo_id, r.model.dir_name, r.model.approx_size_gb) == (repo, model_dir, size)
    assert r.model.container_path == f"/root/.cache/huggingface/{model_dir}" == arg(r, "--model")
    assert r.draft is None and not r.model.gated
    assert served(r) == names and r.served_model_name == names[0]
    assert arg(r, "--quantization") == quant
    assert (r.dtype, arg(r, "--dtype")) == (dtype, dtype)
    envelope = (r.max_model_len, r.gpu_memory_utilization, r.max_num_seqs, r.max_num_batched_tokens)
    assert envelope == (ctx, util, seqs, mbt)
    assert arg(r, "--tensor-parallel-size") == str(tp)
    assert arg(r, "--max-model-len") == str(ctx)
    assert float(arg(r, "--gpu-memory-utilization") or "nan") == util
    assert arg(r, "--max-num-seqs") == str(seqs)
    assert arg(r, "--max-num-batched-tokens") == str(mbt)
    assert r.kv_cache_dtype == kv == arg(r, "--kv-cache-dtype")
    assert arg(r, "--chat-template") == template
    assert arg(r, "--limit-mm-per-prompt") == mm
    # No drafter on this MoE: the built-in MTP head is net-negative at TP=2, and no compose adds it.
    assert r.speculative_config is None and r.speculative_method is None
    assert "--speculative-config" not in r.vllm_args and "SPEC_N" not in "\n".join(r.entrypoint)
    assert not r.language_model_only
    assert arg(r, "--reasoning-parser") == "qwen3" and arg(r, "--tool-call-parser") == "qwen3_coder"
    assert arg(r, "--default-chat-template-kwargs") == '{"enable_thinking": false}'
    assert "--trust-remote-code" in r.vllm_args and "--enable-chunked-prefill" in r.vllm_args
    assert "--enable-prefix-caching" in r.vllm_args
    assert (arg(r, "--host"), arg(r, "--port")) == ("0.0.0.0", "8000")
    assert r.min_compute_capability == cc
    assert r.min_gpu_memory_gb == min_gb
    assert (r.vram_per_gpu_gb, r.measured_on_gpu_mib) == (vram, measured_on)
    assert r.envelope_is_documented
    assert not r.genesis and not r.needs_network_at_start
    assert r.shm_size == "16gb" and r.ipc == "host"


@pytest.mark.parametrize("variant", [v for v in EXPECTED if EXPECTED[v][2] == 2])
def test_dual_variants_detect_nvlink(variant: str) -> None:
    r = recipe_for(variant)
    script = "\n".join(r.entrypoint)
    assert r.entrypoint[:2] == ("bash", "-c") and r.entrypoint[-1] == "--"
    assert "source /etc/club3090/detect_nvlink.sh" in script
    assert "--disable-custom-all-reduce" in script
    env = {e.name: e.value for e in r.environment}
    assert env["NVLINK_MODE"] == "auto" and env["NCCL_P2P_DISABLE"] == "1" and env["NCCL_CUMEM_ENABLE"] == "0"
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    mount = next(m for m in r.mounts if m.target == "/etc/club3090/detect_nvlink.sh")
    assert mount.source == "/opt/rigup/sources/club3090/scripts/detect_nvlink.sh" and mount.read_only


@pytest.mark.parametrize("variant", [v for v in EXPECTED if EXPECTED[v][2] == 1])
def test_single_variants_use_the_images_own_entrypoint(variant: str) -> None:
    r = recipe_for(variant)
    # upstream's single composes set none: the image's `vllm serve` runs the command, which rigup's key wrapper names
    # (transforms.IMAGE_ENTRYPOINTS) since the compose file's entrypoint is the wrapper
    assert r.entrypoint == ("vllm", "serve")
    assert not any(m.target == "/etc/club3090/detect_nvlink.sh" for m in r.mounts)


@pytest.mark.parametrize("variant", [v for v in EXPECTED if EXPECTED[v][12] == FROGGERIC])
def test_froggeric_template_comes_from_the_qwen3_6_27b_tree(variant: str) -> None:
    r = recipe_for(variant)
    mount = next(m for m in r.mounts if m.target == FROGGERIC)
    assert mount.source == ("/opt/rigup/sources/club3090/models/qwen3.6-27b/vllm/patches/"
                            "froggeric-chat-template/chat_template.jinja")
    assert mount.read_only and mount.origin == "git:club3090"


def test_model_tensor_parallel_sizes() -> None:
    # 16 attention / 2 KV heads: upstream's model profile caps TP at 2 (valid_tp [1, 2]).
    with pytest.raises(ValueError, match="cannot be split 4 ways"):
        recipe_for("qwen35b-dual-nvfp4-fp8", variant_overrides={"tensor_parallel_size": 4})


def test_nvfp4_specifics() -> None:
    fast = recipe_for("qwen35b-dual-nvfp4-fast-fp8")
    env = {e.name: e.value for e in fast.environment}
    assert "VLLM_USE_DEEP_GEMM" not in env  # a bare passthrough: absent unless the host sets it
    assert arg(fast, "--chat-template") is None  # the checkpoint's own template
    dual = recipe_for("qwen35b-dual-nvfp4-fp8")
    assert dual.upstream is not None and "# Requires-homogeneous-arch: true" in dual.upstream.text
    single = recipe_for("qwen35b-single-nvfp4-fp8")
    assert "--pipeline-parallel-size" not in single.vllm_args and "--compilation-config" not in single.vllm_args
