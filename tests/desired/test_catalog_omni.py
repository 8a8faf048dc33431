"""The qwen3-omni-30b-a3b family (rigup/desired/catalog.d/qwen3-omni-30b-a3b.yaml) against the values typed
in from club-3090 @ 4a29ab57 (models/qwen3-omni-30b-a3b/vllm-omni/: compose/dual/autoround-int4/omni.yml, the
qwen3_omni_3090.yaml deploy config it mounts, README.md), never read back from the catalog."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from rigup.desired.catalog import CATALOG_DIR, CATALOG_FILE, CatalogError, load_catalog_file
from rigup.desired.knobs import load_defaults
from rigup.desired.recipe import Recipe, RecipeError, resolve
from rigup_testbed.recipes import tree as upstream_tree
from tests.support.recipes import arg

VARIANT = "qwen-omni-dual-autoround-int4-omni"
COMPOSE_DIR = "models/qwen3-omni-30b-a3b/vllm-omni/compose/dual/autoround-int4"
MODEL = "/models/qwen3-omni-30b-a3b-instruct-int4-autoround"
DEPLOY_CONFIG_SOURCE = f"/opt/rigup/sources/club3090/{COMPOSE_DIR}/qwen3_omni_3090.yaml"


def recipe_for(**data: Any) -> Recipe:
    host = load_defaults()
    host.update(data, variant=VARIANT)
    return resolve(host)


def test_variant_matches_upstream() -> None:
    r = recipe_for()
    assert r.upstream is not None and (r.upstream.source, r.upstream.path) == ("club3090", f"{COMPOSE_DIR}/omni.yml")
    assert r.service_name == "vllm-omni-qwen3-omni-30b"
    # Published on upstream's host port; the server inside listens on rigup's 8000 instead of 8091.
    assert (r.host_port, r.container_port, arg(r, "--port")) == (8042, 8000, "8000")
    assert r.image.ref == "docker.io/vllm/vllm-omni:v0.20.0" and r.image.digest is None
    assert (r.model.repo_id, r.model.dir_name, r.model.approx_size_gb) == (
        "Intel/Qwen3-Omni-30B-A3B-Instruct-int4-AutoRound", "qwen3-omni-30b-a3b-instruct-int4-autoround", 25.0)
    assert not r.model.gated and r.draft is None
    # The image has no entrypoint: the command is the whole `vllm serve MODEL ...`.
    assert r.entrypoint == ()
    assert list(r.vllm_args[:3]) == ["vllm", "serve", MODEL] and r.model.container_path == MODEL
    assert "--omni" in r.vllm_args and "--trust-remote-code" in r.vllm_args
    assert arg(r, "--deploy-config") == "/cfg/qwen3_omni_3090.yaml"
    assert r.kv_cache_dtype == "fp8" == arg(r, "--kv-cache-dtype")
    # No --served-model-name: vLLM serves the model under its path, which the health gate looks for.
    assert "--served-model-name" not in r.vllm_args and r.served_model_name == MODEL
    # Stage-parallel: no TP; the deploy config's stage 0 (the thinker) holds the envelope, its devices the GPUs.
    assert (r.tensor_parallel_size, r.gpu_count) == (1, 2)
    assert "--tensor-parallel-size" not in r.vllm_args and "--max-model-len" not in r.vllm_args
    assert (r.max_model_len, r.gpu_memory_utilization, r.max_num_seqs, r.max_num_batched_tokens) == (65536, 0.92, 8, 2048)
    assert r.envelope_is_documented and r.speculative_config is None and r.speculative_method is None
    assert r.min_compute_capability == (8, 6) and r.min_gpu_memory_gb == 24 and r.vram_per_gpu_gb == 23.0
    assert not r.genesis and not r.needs_network_at_start and r.interconnect_note is None
    env = {e.name: e.value for e in r.environment}
    assert (env["NCCL_P2P_DISABLE"], env["NCCL_CUMEM_ENABLE"]) == ("1", "0")
    assert env["HF_HUB_OFFLINE"] == "1" and "NVLINK_MODE" not in env
    assert r.shm_size == "16gb" and r.ipc == "host"


def test_models_and_the_deploy_config_are_mounted_read_only() -> None:
    r = recipe_for()
    targets = {m.target: m for m in r.mounts}
    assert sorted(targets) == ["/cfg/qwen3_omni_3090.yaml", MODEL]
    model = targets[MODEL]
    assert (model.source, model.read_only, model.kind) == (
        "/opt/rigup/models/qwen3-omni-30b-a3b-instruct-int4-autoround", True, "model")
    config = targets["/cfg/qwen3_omni_3090.yaml"]
    assert (config.source, config.read_only, config.origin) == (DEPLOY_CONFIG_SOURCE, True, "git:club3090")
    club = next(s for s in r.sources if s.name == "club3090")
    assert club.required_paths == (f"{COMPOSE_DIR}/qwen3_omni_3090.yaml",)


def test_the_fixture_deploy_config_carries_upstreams_stages() -> None:
    doc = yaml.safe_load((upstream_tree("club3090") / COMPOSE_DIR / "qwen3_omni_3090.yaml").read_text())
    stages = {s["stage_id"]: s for s in doc["stages"]}
    assert [stages[i]["devices"] for i in (0, 1, 2)] == ["0", "1", "1"]
    assert [stages[i]["gpu_memory_utilization"] for i in (0, 1, 2)] == [0.92, 0.55, 0.18]
    assert stages[0]["max_model_len"] == stages[1]["max_model_len"] == 65536
    assert [stages[i]["max_num_batched_tokens"] for i in (0, 1, 2)] == [2048, 2048, 8192]
    assert stages[2]["enforce_eager"] is True and doc["async_chunk"] is True
    assert doc["connectors"]["connector_of_shared_memory"]["name"] == "SharedMemoryConnector"


def test_envelope_overrides_are_refused_but_the_port_is_not() -> None:
    for key, value in (("max_model_len", 32768), ("gpu_memory_utilization", 0.9), ("max_num_seqs", 2)):
        with pytest.raises(RecipeError, match=rf"variant_overrides\['{key}'\]: upstream sets it per stage"):
            recipe_for(variant_overrides={key: value})
    r = recipe_for(variant_overrides={"port": 9042})
    assert r.host_port == 9042 and "0.0.0.0:9042:8000" in r.compose_text


def test_model_root_must_be_a_container_directory(tmp_path: Path) -> None:
    family = CATALOG_DIR / "qwen3-omni-30b-a3b.yaml"
    for root in ("models", "/models/", "/models/../etc"):
        raw = yaml.safe_load(family.read_text())
        raw["variants"][VARIANT]["model_root"] = root
        broken = tmp_path / family.name
        broken.write_text(yaml.safe_dump(raw, sort_keys=False))
        others = [p for p in CATALOG_DIR.glob("*.yaml") if p.name != family.name]
        with pytest.raises(CatalogError, match=rf"variants.{VARIANT}.model_root: an absolute container directory"):
            load_catalog_file(CATALOG_FILE, [*others, broken])
