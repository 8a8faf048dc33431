"""The qwen3.6-27b vllm-lmcache variant (rigup/desired/catalog.d/qwen3.6-27b-lmcache.yaml) against the values
typed in from club-3090 @ 4a29ab57 (models/qwen3.6-27b/vllm-lmcache/compose/dual/fp8/lmcache.yml,
scripts/lib/profiles/engines/vllm-lmcache.yml, models/qwen3.6-27b.yml, registry.yaml), never read back from
the catalog."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from rigup.desired.catalog import CATALOG_DIR, CATALOG_FILE, CatalogError, load_catalog_file
from rigup.desired.knobs import load_defaults
from rigup.desired.recipe import Recipe, RecipeError, resolve
from tests.support.recipes import arg

VARIANT = "qwen-dual-fp8-lmcache"
DIGEST = "sha256:663f9b2f7528e34105c9b0428880b811616f9bc85133b6e2a577b2e7282be8de"
MTP3 = '{"method":"mtp","num_speculative_tokens":3}'


class ImageLock:
    """A lock with only an image digest (the other pins stay the catalog's)."""

    def __init__(self, digest: str) -> None:
        self.digest = digest

    def git_commit(self, name: str) -> str | None:
        return None

    def model_revision(self, name: str) -> str | None:
        return None

    def image_digest(self, name: str) -> str | None:
        return self.digest if name == "image:lmcache/vllm-openai:v0.4.7-cu129" else None


def recipe_for(lock: Any = None, **data: Any) -> Recipe:
    host = load_defaults()
    host.update(data, variant=VARIANT)
    return resolve(host, lock)


def test_variant_matches_upstream() -> None:
    r = recipe_for()
    assert r.upstream is not None and r.upstream.path == "models/qwen3.6-27b/vllm-lmcache/compose/dual/fp8/lmcache.yml"
    assert r.service_name == "vllm-qwen36-27b-lmcache"
    assert (r.host_port, r.container_port, r.tensor_parallel_size, r.gpu_count) == (8017, 8000, 2, 2)
    # LMCache's own image, pulled by upstream's digest (its tag is mutable); the tag is the one that digest had.
    assert r.image.ref == f"docker.io/lmcache/vllm-openai:v0.4.7-cu129@{DIGEST}" and r.image.digest == DIGEST
    assert (r.image.cuda_runtime, r.image.approx_size_gb) == ("12.9", 38.0)
    assert (r.model.repo_id, r.model.dir_name, r.model.approx_size_gb) == ("Qwen/Qwen3.6-27B-FP8", "qwen3.6-27b-fp8", 29.0)
    assert arg(r, "--model") == "/root/.cache/huggingface/qwen3.6-27b-fp8" and r.draft is None
    assert r.served_model_name == "qwen3.6-27b"
    i = r.vllm_args.index("--served-model-name")
    assert list(r.vllm_args[i + 1:i + 3]) == ["qwen3.6-27b", "qwen3.6-27b-autoround"]
    assert (r.max_model_len, r.gpu_memory_utilization, r.max_num_seqs, r.max_num_batched_tokens) == (262144, 0.92, 2, 1584)
    assert (r.kv_cache_dtype, r.dtype, arg(r, "--quantization")) == ("int8_per_token_head", "bfloat16", "fp8")
    assert r.speculative_config == MTP3 and r.speculative_method == "mtp"
    assert r.min_compute_capability == (8, 6) and r.min_gpu_memory_gb == 24 and r.vram_per_gpu_gb is None
    assert r.envelope_is_documented and not r.genesis and not r.needs_network_at_start
    # The LMCache connector and what it needs: the MP connector, GDN's align mode, a block-sized batch.
    assert arg(r, "--kv-transfer-config") == '{"kv_connector":"LMCacheMPConnector","kv_role":"kv_both"}'
    assert arg(r, "--mamba-cache-mode") == "align" and "--enable-prefix-caching" in r.vllm_args
    assert arg(r, "--chat-template") == "/etc/qwen-froggeric-chat-template.jinja"
    assert (arg(r, "--reasoning-parser"), arg(r, "--tool-call-parser")) == ("qwen3", "qwen3_coder")
    assert (arg(r, "--host"), arg(r, "--port")) == ("0.0.0.0", "8000")


def test_entrypoint_starts_the_lmcache_server_before_vllm() -> None:
    r = recipe_for()
    script = r.entrypoint[2]
    assert r.entrypoint[:2] == ("bash", "-c") and r.entrypoint[3] == "--"
    assert script.index("source /etc/club3090/detect_nvlink.sh") < script.index("lmcache server") < script.index(
        "exec vllm serve")
    assert "unset PYTORCH_CUDA_ALLOC_CONF" in script  # expandable segments break the MP connector
    for piece in ('--chunk-size "$${LMCACHE_CHUNK_SIZE:-1584}"', '--l1-size-gb "$${LMCACHE_L1_GB:-30}"',
                  "--eviction-policy LRU", '\'{"type":"fs","base_path":"/lmcache-kv"}\'', "$${SPEC_N:-3}"):
        assert piece in script, piece
    env = {e.name: e.value for e in r.environment}
    assert env["LMCACHE_DISABLE_BANNER"] == "1" and env["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    assert "PYTORCH_CUDA_ALLOC_CONF" not in env
    for name in ("LMCACHE_L1_GB", "LMCACHE_L2", "LMCACHE_L2_ADAPTER", "LMCACHE_CHUNK_SIZE", "SPEC_N"):
        assert env[name] == "", name  # empty: the entrypoint's own defaults apply
    # shm must hold the 30 GB L1; the container is capped so a big cache cannot choke the host.
    assert r.shm_size == "32gb"
    service = yaml.safe_load(r.compose_text)["services"][r.service_name]
    assert (service["mem_limit"], service["memswap_limit"]) == ("70g", "70g")


def test_the_l2_directory_is_a_per_variant_one_not_the_checkout() -> None:
    r = recipe_for()
    kv = next(m for m in r.mounts if m.target == "/lmcache-kv")
    assert (kv.source, kv.read_only, kv.kind) == ("/opt/rigup/cache/qwen-dual-fp8-lmcache/data/lmcache-kv", False, "cache")
    assert kv.source in r.host_dirs
    club = next(s for s in r.sources if s.name == "club3090")
    assert "lmcache-kv" not in club.required_paths
    assert set(club.required_paths) == {"models/qwen3.6-27b/vllm/patches/froggeric-chat-template/chat_template.jinja",
                                        "scripts/detect_nvlink.sh"}
    assert all(m.read_only for m in r.mounts if m.kind in ("model", "source"))


def test_a_lock_must_hold_upstreams_digest() -> None:
    assert recipe_for(ImageLock(DIGEST)).image.ref.endswith(f"@{DIGEST}")
    with pytest.raises(RecipeError, match=f"the lock has digest sha256:{'e' * 64}, but the catalog pins {DIGEST}"):
        recipe_for(ImageLock("sha256:" + "e" * 64))


def test_an_image_digest_is_checked(tmp_path: Path) -> None:
    family = CATALOG_DIR / "qwen3.6-27b-lmcache.yaml"
    raw = yaml.safe_load(family.read_text())
    raw["images"]["lmcache-vllm-openai-663f9b2f"]["digest"] = "663f9b2f"
    broken = tmp_path / family.name
    broken.write_text(yaml.safe_dump(raw, sort_keys=False))
    others = [p for p in CATALOG_DIR.glob("*.yaml") if p.name != family.name]
    with pytest.raises(CatalogError, match=r"images.lmcache-vllm-openai-663f9b2f.digest: sha256:<64 lowercase hex>"):
        load_catalog_file(CATALOG_FILE, [*others, broken])
    raw = yaml.safe_load(family.read_text())
    raw["variants"][VARIANT]["data_dirs"] = {"lmcache-kv": "no leading slash"}
    broken.write_text(yaml.safe_dump(raw, sort_keys=False))
    with pytest.raises(CatalogError, match=rf"variants.{VARIANT}.data_dirs.lmcache-kv: an absolute container directory"):
        load_catalog_file(CATALOG_FILE, [*others, broken])
