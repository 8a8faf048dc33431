"""The vibethinker-3b family (rigup/desired/catalog.d/vibethinker-3b.yaml) against the values typed in from
club-3090 @ 4a29ab57 (models/vibethinker-3b/vllm/compose/single/bf16/fp8.yml, scripts/lib/profiles/models/
vibethinker-3b.yml, engines/vllm-stable.yml, registry.yaml), never read back from the catalog.

Upstream's only vLLM compose runs at --gpu-memory-utilization 0.40 (one 131K stream, the rest of the card left
free): the catalog, variant_overrides and fit accept it (catalog.GPU_MEMORY_UTILIZATION_RANGE).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rigup.desired.catalog import CATALOG_DIR, CATALOG_FILE, CatalogError, load_catalog_file, variant_names
from rigup.desired.knobs import load_defaults
from rigup.desired.recipe import Recipe, RecipeError, resolve
from tests.support.recipes import arg

NAME = "vibethinker-single-bf16-fp8"
FAMILY_FILE = CATALOG_DIR / "vibethinker-3b.yaml"


def test_upstreams_utilisation_is_accepted_and_a_lower_one_is_not(tmp_path: Path) -> None:
    assert NAME in variant_names()
    raw = yaml.safe_load(FAMILY_FILE.read_text())
    assert raw["variants"][NAME]["gpu_memory_utilization"] == 0.40  # upstream's default
    raw["variants"][NAME]["gpu_memory_utilization"] = 0.05
    path = tmp_path / FAMILY_FILE.name
    path.write_text(yaml.safe_dump(raw, sort_keys=False, allow_unicode=True))
    others = [p for p in CATALOG_DIR.glob("*.yaml") if p.name != FAMILY_FILE.name]
    with pytest.raises(CatalogError, match=rf"variants\.{NAME}\.gpu_memory_utilization: out of range"):
        load_catalog_file(CATALOG_FILE, [*others, path])
    host = {**load_defaults(), "variant": NAME, "variant_overrides": {"gpu_memory_utilization": 0.05}}
    with pytest.raises(RecipeError, match=r"must be a number from 0.1 to 0.99, got 0.05"):
        resolve(host)


@pytest.fixture
def vibethinker() -> Recipe:
    host = load_defaults()
    host.update(variant=NAME)
    return resolve(host)


def test_the_entry_renders_upstreams_compose(vibethinker: Recipe) -> None:
    r = vibethinker
    assert r.upstream is not None and r.upstream_source is not None
    assert r.upstream.path == "models/vibethinker-3b/vllm/compose/single/bf16/fp8.yml"
    assert r.upstream_source.name == "club3090" and r.upstream_status == "current"
    assert r.family == "vibethinker-3b"
    assert (r.host_port, r.tensor_parallel_size, r.gpu_count, r.valid_tensor_parallel_sizes) == (8074, 1, 1, (1,))
    assert r.image.ref == "docker.io/vllm/vllm-openai:v0.27.1"  # Engine-profile vllm-stable
    assert (r.model.repo_id, r.model.dir_name, r.model.approx_size_gb, r.model.gated) == (
        "WeiboAI/VibeThinker-3B", "vibethinker-3b", 6.2, False)
    assert r.model.container_path == arg(r, "--model") == "/root/.cache/huggingface/vibethinker-3b"
    assert r.draft is None and r.speculative_config is None and r.speculative_method is None
    assert r.served_model_name == "vibethinker-3b"
    # upstream's command: 131K, 0.40, one sequence, vLLM's default batched tokens
    envelope = (r.max_model_len, r.gpu_memory_utilization, r.max_num_seqs, r.max_num_batched_tokens)
    assert envelope == (131072, 0.40, 1, None)
    assert arg(r, "--gpu-memory-utilization") == "0.40"
    assert r.dtype == "bfloat16" and r.kv_cache_dtype == "fp8_e4m3"
    assert arg(r, "--reasoning-parser") == "qwen3"
    for flag in ("--trust-remote-code", "--enable-prefix-caching", "--enable-chunked-prefill"):
        assert flag in r.vllm_args
    assert "--enable-auto-tool-choice" not in r.vllm_args and "--tool-call-parser" not in r.vllm_args
    assert "--chat-template" not in r.vllm_args  # the model's own template
    assert arg(r, "--override-generation-config") == (
        '{"temperature":1.0,"top_p":0.95,"top_k":-1,"min_p":0.0,"repetition_penalty":1.0}')
    assert (arg(r, "--host"), arg(r, "--port")) == ("0.0.0.0", "8000")
    assert r.min_compute_capability == (8, 6) and r.min_gpu_memory_gb == 10.0
    assert (r.vram_per_gpu_gb, r.measured_on_gpu_mib) == (9.8, 24576)
    assert not r.genesis and not r.needs_network_at_start
    assert r.entrypoint[:2] == ("/bin/bash", "-c") and r.entrypoint[-1] == "--"
    assert r.entrypoint[2].strip() == 'exec vllm serve  "$@"'  # ${VLLM_ENFORCE_EAGER:+--enforce-eager} is empty
    assert [m.kind for m in r.mounts] == ["model", "cache", "cache"]  # no in-repo files mounted
    assert r.shm_size == "16gb" and r.ipc == "host"
