"""The catalog holds the seeds' values: each variant is checked against numbers typed in from
shared/reference/upstream-facts.md (§1.2-§1.5, §2), never read back from catalog.yaml."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from rigup.desired.catalog import (
    CATALOG_DIR,
    CATALOG_FILE,
    CatalogError,
    load_catalog_file,
    rigup_container_names,
    variant_names,
)
from rigup.desired.knobs import load_defaults
from rigup_testbed.recipes import tree as upstream_tree
from tests.support.recipes import arg, recipe_for

NIGHTLY_7A1E = "nightly-7a1eb8ac2ec4ea69338c51dc7afd4b15010abfa8"
NIGHTLY_BF61 = "nightly-bf610c2f56764e1b30bc6065f4ceace3d6e59036"
NIGHTLY_E47C = "nightly-e47c98ef7a38792996e452ef53914e21e41928e9"
MTP3 = '{"method":"mtp","num_speculative_tokens":3}'
QWEN_DFLASH5 = '{"method":"dflash","model":"/root/.cache/huggingface/qwen3.6-27b-dflash","num_speculative_tokens":5}'
GEMMA_MTP4 = '{"model":"/root/.cache/huggingface/gemma-4-31b-it-assistant","num_speculative_tokens":4}'
GEMMA_DFLASH7 = '{"method":"dflash","model":"/root/.cache/huggingface/gemma-4-31b-it-dflash","num_speculative_tokens":7}'
LORBUS = "Lorbus/Qwen3.6-27B-int4-AutoRound"
GEMMA = "Intel/gemma-4-31B-it-int4-AutoRound"

# variant: port, TP, dtype, max-model-len, gpu-mem-util, max-num-seqs, max-num-batched-tokens,
#          kv-cache-dtype, speculative config, image tag, main model, draft model, --language-model-only
EXPECTED: dict[str, tuple[Any, ...]] = {
    "dual": (8010, 2, "float16", 262144, 0.92, 2, 8192, "fp8_e5m2", MTP3, NIGHTLY_7A1E, LORBUS, None, False),
    "dual-turbo": (8011, 2, "float16", 262144, 0.85, 4, 4128, "turboquant_3bit_nc", MTP3, NIGHTLY_7A1E, LORBUS, None, False),
    "dual-dflash": (8012, 2, "bfloat16", 185000, 0.95, 1, 8192, None, QWEN_DFLASH5, NIGHTLY_7A1E, LORBUS, "z-lab/Qwen3.6-27B-DFlash", False),
    "dual-dflash-noviz": (8013, 2, "bfloat16", 200000, 0.95, 1, 8192, None, QWEN_DFLASH5, NIGHTLY_7A1E, LORBUS, "z-lab/Qwen3.6-27B-DFlash", True),
    "carnice-bf16mtp": (8070, 2, "float16", 262144, 0.92, 2, 8192, "fp8_e5m2", MTP3, NIGHTLY_7A1E, "wasifb/Carnice_V2_27B_INT4_BF16MTP", None, False),
    "multi4": (8015, 4, "float16", 262144, 0.92, 4, 8192, "fp8_e5m2", MTP3, NIGHTLY_7A1E, LORBUS, None, False),
    "single": (8020, 1, "float16", 48000, 0.92, 1, 4128, "turboquant_3bit_nc", MTP3, NIGHTLY_7A1E, LORBUS, None, False),
    "single-long-vision": (8020, 1, "float16", 145000, 0.95, 1, 4128, "turboquant_3bit_nc", MTP3, NIGHTLY_7A1E, LORBUS, None, False),
    "single-long-text": (8020, 1, "float16", 180000, 0.93, 1, 4128, "turboquant_3bit_nc", MTP3, NIGHTLY_7A1E, LORBUS, None, True),
    "single-long-text-no-mtp": (8021, 1, "float16", 200000, 0.95, 1, 4128, "turboquant_3bit_nc", None, NIGHTLY_7A1E, LORBUS, None, True),
    "single-bounded-thinking": (8020, 1, "float16", 180000, 0.95, 1, 4128, "turboquant_3bit_nc", MTP3, NIGHTLY_7A1E, LORBUS, None, True),
    "single-tools-text": (8020, 1, "float16", 75000, 0.97, 1, 2048, "fp8_e5m2", MTP3, NIGHTLY_7A1E, LORBUS, None, True),
    "single-minimal": (8020, 1, "float16", 32768, 0.92, 1, None, "fp8_e5m2", None, NIGHTLY_7A1E, LORBUS, None, False),
    "gemma-dual": (8030, 2, "auto", 32768, 0.92, 4, 4096, None, GEMMA_MTP4, NIGHTLY_BF61, GEMMA, "google/gemma-4-31B-it-assistant", False),
    "gemma-dual-int8": (8032, 2, "auto", 98304, 0.95, 4, 4096, "int8_per_token_head", GEMMA_MTP4, NIGHTLY_E47C, GEMMA, "google/gemma-4-31B-it-assistant", False),
    "gemma-dual-dflash": (8032, 2, "bfloat16", 32768, 0.92, 4, 4096, None, GEMMA_DFLASH7, NIGHTLY_E47C, GEMMA, "z-lab/gemma-4-31b-it-dflash", False),
}

# Variants that apply Genesis (club-3090 S1: every single-card variant but minimal, and dual-turbo).
GENESIS = {"dual-turbo", "single", "single-long-vision", "single-long-text", "single-long-text-no-mtp",
           "single-bounded-thinking", "single-tools-text"}
# Variants that mount the Marlin pad-sub-tile-n files from the fork (the TP>=2 AutoRound ones).
MARLIN = {"dual", "dual-turbo", "dual-dflash", "dual-dflash-noviz", "carnice-bf16mtp", "multi4"}
# Measured VRAM per card in GB (DUAL_CARD.md table, carnice/multi4 compose headers).
VRAM = {"dual": 23.6, "dual-turbo": 19.8, "dual-dflash": 23.6, "dual-dflash-noviz": 23.8,
        "carnice-bf16mtp": 22.3, "multi4": 23.5, "gemma-dual": 22.0, "gemma-dual-int8": 22.1,
        "gemma-dual-dflash": 22.3}
# §1.1 base environment of the Qwen composes.
QWEN_BASE_ENV = {
    "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
    "NCCL_CUMEM_ENABLE": "0",
    "NCCL_P2P_DISABLE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_USE_FLASHINFER_SAMPLER": "1",
    "OMP_NUM_THREADS": "1",
}
QWEN_BASE_ARGS = ["--quantization", "auto_round", "--trust-remote-code", "--reasoning-parser", "qwen3",
                  "--enable-auto-tool-choice", "--enable-prefix-caching", "--enable-chunked-prefill"]
MARLIN_TARGET = "/usr/local/lib/python3.12/dist-packages/vllm/model_executor/kernels/linear/mixed_precision/"


def test_catalog_has_the_seed_variants_in_order() -> None:
    # The catalog also carries club-3090's current lineup (upstream source club3090); the seed
    # variants keep their names and order.
    assert set(EXPECTED) <= set(variant_names())


@pytest.mark.parametrize("variant", list(EXPECTED))
def test_variant_matches_seed_table(variant: str) -> None:
    port, tp, dtype, ctx, util, seqs, mbt, kv, spec, tag, model, draft, text_only = EXPECTED[variant]
    r = recipe_for(variant)
    assert (r.host_port, r.tensor_parallel_size, r.gpu_count) == (port, tp, tp)
    assert (r.dtype, r.max_model_len, r.gpu_memory_utilization, r.max_num_seqs) == (dtype, ctx, util, seqs)
    assert (r.max_num_batched_tokens, r.kv_cache_dtype, r.speculative_config) == (mbt, kv, spec)
    assert r.image.ref == f"docker.io/vllm/vllm-openai:{tag}"
    assert r.model.repo_id == model
    assert (r.draft.repo_id if r.draft else None) == draft
    assert r.language_model_only is text_only
    # The same values reach the vLLM command line.
    assert arg(r, "--tensor-parallel-size") == str(tp)
    assert arg(r, "--dtype") == (None if dtype == "auto" else dtype)  # Gemma's composes leave vLLM's default
    assert arg(r, "--max-model-len") == str(ctx)
    assert arg(r, "--gpu-memory-utilization") == str(util)
    assert arg(r, "--max-num-seqs") == str(seqs)
    assert arg(r, "--max-num-batched-tokens") == (None if mbt is None else str(mbt))
    assert arg(r, "--kv-cache-dtype") == kv
    assert arg(r, "--speculative-config") == spec
    assert ("--language-model-only" in r.vllm_args) is text_only
    # Spring composes pass it in the command; May's entrypoints add it unless NVLink was detected.
    disabled = "--disable-custom-all-reduce" in r.vllm_args or "--disable-custom-all-reduce" in "\n".join(r.entrypoint)
    assert disabled is (tp > 1)
    assert (arg(r, "--host"), arg(r, "--port")) == ("0.0.0.0", "8000")
    assert arg(r, "--model") == r.model.container_path


@pytest.mark.parametrize("variant", [v for v in EXPECTED if not v.startswith("gemma")])
def test_qwen_variants_keep_the_base_cli_and_env(variant: str) -> None:
    r = recipe_for(variant)
    env = {e.name: e.value for e in r.environment}
    # Upstream's minimal compose (TP=1, no sampler override) sets only part of the base set.
    base = {k: v for k, v in QWEN_BASE_ENV.items()
            if variant != "single-minimal" or k not in ("NCCL_P2P_DISABLE", "VLLM_USE_FLASHINFER_SAMPLER")}
    for key, value in base.items():
        assert env[key] == value, key
    expected_alloc = "expandable_segments:True" if variant == "single-minimal" else "expandable_segments:True,max_split_size_mb:512"
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == expected_alloc
    for flag in QWEN_BASE_ARGS:
        assert flag in r.vllm_args, flag
    served = "carnice-bf16mtp" if variant == "carnice-bf16mtp" else "qwen3.6-27b-autoround"
    assert arg(r, "--served-model-name") == served
    assert arg(r, "--tool-call-parser") == ("qwen3_xml" if variant == "carnice-bf16mtp" else "qwen3_coder")
    # no secret in the environment: the HF token is a file (the secrets transform), upstream's reference to it gone
    assert "HUGGING_FACE_HUB_TOKEN" not in env and env["HF_TOKEN_PATH"] == "/run/rigup/secrets/HF_TOKEN"


@pytest.mark.parametrize("variant", list(EXPECTED))
def test_genesis_marlin_and_sources(variant: str) -> None:
    r = recipe_for(variant)
    env = {e.name: e.value for e in r.environment}
    targets = {m.target: m for m in r.mounts}
    genesis_target = "/usr/local/lib/python3.12/dist-packages/vllm/_genesis"
    if variant in GENESIS:
        assert r.genesis and r.entrypoint[:2] == ("/bin/bash", "-c")
        script = r.entrypoint[2]
        assert "python3 -m vllm._genesis.patches.apply_all" in script
        assert script.rstrip().endswith('exec vllm serve "$@"')
        assert targets[genesis_target].source == "/opt/rigup/sources/genesis/vllm/_genesis"
        assert targets[genesis_target].read_only
        genesis = next(s for s in r.sources if s.name == "genesis")
        assert genesis.required_paths == ("vllm/_genesis",)
        assert genesis.commit == "2db18df4bc3abd4eb58a9b2e0342082fa7012c64" and genesis.full_clone
        assert env["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] == "1" and env["VLLM_MARLIN_USE_ATOMIC_ADD"] == "1"
        assert env["GENESIS_ENABLE_P64_QWEN3CODER_MTP_STREAMING"] == "1"
        # Upstream's tolist mount pointed at a path no Genesis revision has; it comes from external_probe/.
        # The tolist sidecar is upstream's own file, from the club-3090 spring checkout (it exists there).
        tolist = targets["/patches/patch_tolist_cudagraph.py"]
        assert tolist.read_only and tolist.source == (
            "/opt/rigup/sources/club3090-spring/models/qwen3.6-27b/vllm/patches/patch_tolist_cudagraph.py")
        assert (upstream_tree("club3090-spring") / "models/qwen3.6-27b/vllm/patches/patch_tolist_cudagraph.py").is_file()
        assert "python3 /patches/patch_tolist_cudagraph.py" in script
    else:
        assert not r.genesis
        assert genesis_target not in targets
        assert not any(k.startswith("GENESIS_") for k in env)
        assert "genesis" not in [s.name for s in r.sources]
    if variant in MARLIN and r.upstream.source == "club3090-may":  # type: ignore[union-attr]
        # The May composes mount club-3090's vendored copy of the fork's files.
        for name in ("marlin.py", "MPLinearKernel.py"):
            mount = targets[MARLIN_TARGET + name]
            assert mount.read_only and mount.origin == "git:club3090-may"
            assert mount.source == f"/opt/rigup/sources/club3090-may/models/qwen3.6-27b/vllm/patches/vllm-marlin-pad/{name}"
        assert "vllm-fork" not in [s.name for s in r.sources]
    elif variant in MARLIN:
        fork = next(s for s in r.sources if s.name == "vllm-fork")
        assert fork.ref == "marlin-pad-sub-tile-n" and fork.commit is None  # branch until locked
        for name in ("marlin.py", "MPLinearKernel.py"):
            mount = targets[MARLIN_TARGET + name]
            assert mount.read_only
            assert mount.source == f"/opt/rigup/sources/vllm-fork/vllm/model_executor/kernels/linear/mixed_precision/{name}"
            assert f"vllm/model_executor/kernels/linear/mixed_precision/{name}" in fork.required_paths
    else:
        assert "vllm-fork" not in [s.name for s in r.sources]


def test_genesis_sets_per_variant() -> None:
    """The spring recipes' Genesis switches and sidecars, as upstream had them at 2e934ad1."""
    turbo_recipe = recipe_for("dual-turbo")
    turbo = {e.name: e.value for e in turbo_recipe.environment}
    for flag in ("P66_CUDAGRAPH_SIZE_FILTER", "P64_QWEN3CODER_MTP_STREAMING", "P68_AUTO_FORCE_TOOL",
                 "P69_LONG_CTX_TOOL_REMINDER", "P67_TQ_MULTI_QUERY_KERNEL", "PN30_DS_LAYOUT_SPEC_DECODE"):
        assert turbo[f"GENESIS_ENABLE_{flag}"] == "1", flag
    assert turbo["GENESIS_ENABLE_P78_TOLIST_CAPTURE_GUARD"] == "0"
    # At 2e934ad1 the workspace lock is relaxed by a sidecar, not the later PN34 switch.
    assert "GENESIS_ENABLE_PN34_WORKSPACE_LOCK_RELAX" not in turbo
    assert "python3 /patches/patch_workspace_lock_disable.py" in turbo_recipe.entrypoint[2]
    sidecar = next(m for m in turbo_recipe.mounts if m.target == "/patches/patch_workspace_lock_disable.py")
    assert sidecar.source.startswith("/opt/rigup/sources/club3090-spring/") and sidecar.read_only
    single = recipe_for("single")
    assert "--no-scheduler-reserve-full-isl" in single.vllm_args
    assert {e.name: e.value for e in single.environment}["GENESIS_ENABLE_P65_TURBOQUANT_SPEC_CG_DOWNGRADE"] == "1"
    long_text = {e.name: e.value for e in recipe_for("single-long-text").environment}
    assert long_text["GENESIS_ENABLE_PN32_GDN_CHUNKED_PREFILL"] == "1"
    assert long_text["GENESIS_PN32_GDN_CHUNK_SIZE"] == "8192"
    bounded = recipe_for("single-bounded-thinking")
    assert arg(bounded, "--structured-outputs-config.enable_in_reasoning") == "true"
    assert "--language-model-only" in bounded.vllm_args


def test_long_text_runs_inputs_embeds_sidecar_from_club3090_spring() -> None:
    rel = "models/qwen3.6-27b/vllm/patches/patch_inputs_embeds_optional.py"
    assert (upstream_tree("club3090-spring") / rel).is_file()
    for variant in ("single-long-text", "single-long-text-no-mtp"):
        r = recipe_for(variant)
        assert "python3 /patches/patch_inputs_embeds_optional.py" in r.entrypoint[2]
        club = next(s for s in r.sources if s.name == "club3090-spring")
        assert rel in club.required_paths
        mount = next(m for m in r.mounts if m.target == "/patches/patch_inputs_embeds_optional.py")
        assert mount.read_only and mount.source == f"/opt/rigup/sources/club3090-spring/{rel}"


@pytest.mark.parametrize("variant", list(EXPECTED))
def test_vram_compute_capability_and_cuda(variant: str) -> None:
    r = recipe_for(variant)
    assert r.vram_per_gpu_gb == VRAM.get(variant)
    assert r.measured_on_gpu_mib == 24576  # every envelope was measured on RTX 3090s
    assert r.min_compute_capability == (8, 6)
    assert r.image.cuda_runtime == "13.0"
    assert r.envelope_is_documented


def test_single_card_alternative_envelopes() -> None:
    envs = recipe_for("single").alternative_envelopes
    assert [(e.max_model_len, e.gpu_memory_utilization, e.vision) for e in envs] == [
        (48000, 0.92, True), (64000, 0.92, True), (96000, 0.93, True), (128000, 0.95, True),
        (192000, 0.98, True), (205000, 0.98, False)]


def test_sizes_and_disk() -> None:
    dual = recipe_for("dual")
    assert dual.model.approx_size_gb == 17.5
    assert dual.disk_needed_gb == pytest.approx(30 + 17.5 + 2)  # image + model + fork checkout
    assert recipe_for("dual-dflash").draft.approx_size_gb == 1.75  # type: ignore[union-attr]
    assert 9 <= dual.image.approx_size_gb <= 30


def test_draft_and_model_dirs() -> None:
    r = recipe_for("dual-dflash")
    assert [(m.role, m.dir_name, m.path) for m in r.models] == [
        ("main", "qwen3.6-27b-autoround-int4", "/opt/rigup/models/qwen3.6-27b-autoround-int4"),
        ("draft", "qwen3.6-27b-dflash", "/opt/rigup/models/qwen3.6-27b-dflash"),
    ]
    assert [m.lock_name for m in r.models] == ["model:Lorbus/Qwen3.6-27B-int4-AutoRound", "model:z-lab/Qwen3.6-27B-DFlash"]
    model_mounts = [m for m in r.mounts if m.kind == "model"]
    assert all(m.read_only for m in model_mounts) and len(model_mounts) == 2


def test_container_names_are_unique() -> None:
    names = [recipe_for(v).container_name for v in variant_names()]
    assert names == [f"rigup-{v}" for v in variant_names()]
    assert len(names) == len(set(names))
    assert tuple(sorted(names)) == rigup_container_names()


# --- the loader rejects broken catalogs ----------------------------------------------------------


def broken(tmp_path: Path, edit: Any) -> Path:
    raw = yaml.safe_load(CATALOG_FILE.read_text())
    raw = copy.deepcopy(raw)
    edit(raw)
    path = tmp_path / "catalog.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def test_unmodified_copy_loads(tmp_path: Path) -> None:
    fragments = sorted(CATALOG_DIR.glob("*.yaml"))
    assert list(load_catalog_file(broken(tmp_path, lambda raw: None), fragments)["variants"]) == variant_names()


FAMILY_FILE = """
models:
  tiny-standin:
    family: tiny
    repo_id: example/tiny
    dir: tiny
    approx_size_gb: 1
    verify_glob: "*.safetensors"
    gated: false
    max_context: 8192
    valid_tensor_parallel_sizes: [1]
variants:
  tiny-single:
    base: _common
    description: a family file's variant may inherit from the main file's bases
    upstream: {source: club3090, path: models/tiny/vllm/compose/single/base.yml}
    image: vllm-v0.27.1
    model: tiny-standin
    tensor_parallel_size: 1
    tensor_parallel_sizes: [1]
    max_model_len: 4096
    gpu_memory_utilization: 0.9
    max_num_seqs: 1
    max_num_batched_tokens: null
    vram_per_gpu_gb: null
"""


def test_a_family_file_adds_models_and_variants_after_the_main_files(tmp_path: Path) -> None:
    (tmp_path / "tiny.yaml").write_text(FAMILY_FILE)
    cat = load_catalog_file(broken(tmp_path, lambda raw: None), [tmp_path / "tiny.yaml"])
    assert list(cat["variants"])[-1] == "tiny-single" and cat["variants"]["tiny-single"]["model"] == "tiny-standin"
    assert cat["variants"]["tiny-single"]["measured_on_gpu_mib"] == cat["variants"]["dual"]["measured_on_gpu_mib"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (FAMILY_FILE.replace("tiny-single:", "dual:"), "tiny.yaml: variants.dual is already defined in catalog.yaml"),
        ("sources:\n  x: {}\n", "tiny.yaml: unknown top-level key 'sources'"),
        ("- a list\n", "tiny.yaml: top level must be a mapping"),
    ],
)
def test_a_broken_family_file_is_named(tmp_path: Path, text: str, message: str) -> None:
    (tmp_path / "tiny.yaml").write_text(text)
    with pytest.raises(CatalogError, match=message):
        load_catalog_file(broken(tmp_path, lambda raw: None), [tmp_path / "tiny.yaml"])


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda raw: raw["variants"]["dual"].update(prot=8010), "variants.dual: unknown key 'prot'"),
        (lambda raw: raw["variants"]["dual"].update(tensor_parallel_sizes=[2, 3]), "invalid for model"),
        (lambda raw: raw["variants"]["dual"].update(image="nope"), "unknown image 'nope'"),
        (lambda raw: raw["variants"]["dual"].update(base="missing"), "base 'missing'"),
        (lambda raw: raw["variants"]["dual-turbo"].update(sidecars=["/patches/other.py"]), "variants.dual-turbo: unknown key 'sidecars'"),
        (lambda raw: raw["variants"]["dual"].update(upstream={"source": "nope", "path": "x.yml"}), "unknown source 'nope'"),
        (lambda raw: raw["variants"]["dual"].update(upstream={"source": "club3090"}), "needs source and path"),
        (lambda raw: raw["variants"]["dual"].update(upstream={"source": "club3090", "path": "../x.yml"}), "a path inside the repository"),
        (lambda raw: raw["variants"]["dual"].update(source_paths={"/opt/x": "nope"}), "source_paths./opt/x: unknown source"),
        (lambda raw: raw["variants"]["dual"].update(mount_fixes={"/patches/x.py": {"source": "genesis", "path": "x.py"}}), "needs source (a catalog source), path and why"),
        (lambda raw: raw["variants"]["dual"].update(speculative={"kind": "eagle", "num_speculative_tokens": 3}), "needs kind (mtp|dflash)"),
        (lambda raw: raw["variants"]["dual"].update(gpu_memory_utilization=1), "wrong type"),
        (lambda raw: raw["images"]["vllm-nightly-7a1eb8ac"].update(cuda_runtime=13.0), "cuda_runtime"),
        (lambda raw: raw["variants"]["dual"].update(vram_per_gpu_gb=25.0), "more than the measuring card holds"),
        (lambda raw: raw["variants"]["_common"].pop("measured_on_gpu_mib"), "missing key 'measured_on_gpu_mib'"),
    ],
)
def test_broken_catalog_is_rejected(tmp_path: Path, edit: Any, message: str) -> None:
    with pytest.raises(CatalogError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_catalog_file(broken(tmp_path, edit))


def test_gemma_variants() -> None:
    for variant in ("gemma-dual", "gemma-dual-int8", "gemma-dual-dflash"):
        r = recipe_for(variant)
        env = {e.name: e.value for e in r.environment}
        assert "VLLM_USE_FLASHINFER_SAMPLER" not in env  # the Gemma composes do not set it
        assert env["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] == "1" and env["NCCL_P2P_DISABLE"] == "1"
        assert arg(r, "--tool-call-parser") == "gemma4"
        assert arg(r, "--chat-template") == "/vllm-workspace/examples/tool_chat_template_gemma4.jinja"
        assert arg(r, "--served-model-name") == "gemma-4-31b-autoround"
        assert "--quantization" not in r.vllm_args and "--reasoning-parser" not in r.vllm_args
        assert r.entrypoint[:2] == ("/bin/bash", "-c") and r.draft is not None
    # vLLM PR #40391 (rebased) and the tool-parser fix, vendored in club-3090 at b3010249
    int8 = recipe_for("gemma-dual-int8")
    overlay = [m.target for m in int8.mounts if m.origin == "git:club3090-may"]
    assert "/usr/local/lib/python3.12/dist-packages/vllm/model_executor/models/gemma4.py" in overlay
    assert all(m.read_only for m in int8.mounts if m.origin == "git:club3090-may")
    dflash = recipe_for("gemma-dual-dflash")
    assert sum(m.origin == "git:club3090-may" for m in dflash.mounts) > len(overlay)
    assert "pip install --quiet --upgrade transformers==5.8.0" in dflash.entrypoint[2]
    assert dflash.needs_network_at_start and not int8.needs_network_at_start
    assert recipe_for("gemma-dual").draft.gated  # type: ignore[union-attr]


def test_carnice_mounts_its_chat_template_over_the_models_own() -> None:
    """Upstream (b3010249) binds its template over the model's chat_template.jinja; the model mount is
    read-only, so the file must exist in the verified model (rigup checks the lock's file list)."""
    r = recipe_for("carnice-bf16mtp")
    inside = [m for m in r.mounts if m.target.startswith(r.model.container_path + "/")]
    assert [m.target for m in inside] == [f"{r.model.container_path}/chat_template.jinja"]
    assert inside[0].source == ("/opt/rigup/sources/club3090-may/models/qwen3.6-27b/vllm/patches/"
                                "carnice-chat-template.jinja") and inside[0].read_only
    assert arg(r, "--tool-call-parser") == "qwen3_xml"


def test_a_file_bound_into_the_read_only_model_must_ship_with_the_model() -> None:
    from rigup.desired.lock import FilePin, LockFile, ModelPin
    from rigup.desired.recipe import RecipeError, resolve

    name = recipe_for("carnice-bf16mtp").model.lock_name
    repo_id = name.removeprefix("model:")

    def lock_with(*files: str) -> LockFile:
        lock = LockFile()
        lock.models[name] = ModelPin(name, repo_id, "main", "2" * 40, tuple(FilePin(f, 1, "3" * 64) for f in files))
        return lock

    data = {**load_defaults(), "variant": "carnice-bf16mtp"}
    assert resolve(data, lock_with("config.json", "chat_template.jinja")).model.revision == "2" * 40
    with pytest.raises(RecipeError, match="has no chat_template.jinja, and the verified model directory is mounted read-only"):
        resolve(data, lock_with("config.json", "model.safetensors"))
