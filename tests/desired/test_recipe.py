"""resolve(): host knobs, variant_overrides, the lock and rig paths shape the recipe."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from rigup.desired.knobs import load_defaults
from rigup.desired.recipe import Lock, Recipe, RecipeError, resolve


def host(variant: str = "dual", **data: Any) -> dict[str, Any]:
    data_ = load_defaults()
    data_.update(data, variant=variant)
    return data_


def arg(recipe: Recipe, flag: str) -> str:
    args = list(recipe.vllm_args)
    return args[args.index(flag) + 1]


def test_recipe_is_frozen() -> None:
    r = resolve(host())
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.host_port = 1  # type: ignore[misc]


def test_valid_overrides_change_args_and_mark_the_envelope() -> None:
    overrides = {"max_model_len": 131072, "gpu_memory_utilization": 0.9, "port": 9000,
                 "max_num_seqs": 1, "tensor_parallel_size": 4, "max_num_batched_tokens": 4096}
    r = resolve(host(variant_overrides=overrides))
    assert (r.max_model_len, r.gpu_memory_utilization, r.host_port, r.max_num_seqs) == (131072, 0.9, 9000, 1)
    assert (r.tensor_parallel_size, r.gpu_count, r.max_num_batched_tokens) == (4, 4, 4096)
    assert arg(r, "--max-model-len") == "131072"
    assert arg(r, "--gpu-memory-utilization") == "0.9"
    assert arg(r, "--tensor-parallel-size") == "4"
    assert arg(r, "--max-num-seqs") == "1"
    assert arg(r, "--port") == "8000"  # the container port never changes
    assert not r.envelope_is_documented
    assert r.overrides == overrides


def test_port_only_override_keeps_the_documented_envelope() -> None:
    r = resolve(host(variant_overrides={"port": 18010}))
    assert r.host_port == 18010 and r.envelope_is_documented


def test_utilisation_renders_as_given() -> None:
    r = resolve(host(variant_overrides={"gpu_memory_utilization": 0.95}))
    assert isinstance(r.gpu_memory_utilization, float) and arg(r, "--gpu-memory-utilization") == "0.95"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"max_model_length": 1000}, "unknown variant_overrides key 'max_model_length'"),
        ({"kv_cache_dtype": "fp8"}, "unknown variant_overrides key 'kv_cache_dtype'"),
        ({"tensor_parallel_size": 3}, r"variant_overrides\['tensor_parallel_size'\] must be one of \[2, 4\]"),
        ({"tensor_parallel_size": 8}, r"variant_overrides\['tensor_parallel_size'\]"),
        ({"tensor_parallel_size": True}, r"variant_overrides\['tensor_parallel_size'\]"),
        ({"max_model_len": 300000}, r"variant_overrides\['max_model_len'\] must be an integer from 1024 to 262144"),
        ({"max_model_len": "128000"}, r"variant_overrides\['max_model_len'\]"),
        ({"gpu_memory_utilization": 1.2}, r"variant_overrides\['gpu_memory_utilization'\]"),
        ({"gpu_memory_utilization": True}, r"variant_overrides\['gpu_memory_utilization'\]"),
        ({"port": 70000}, r"variant_overrides\['port'\]"),
        ({"max_num_seqs": 0}, r"variant_overrides\['max_num_seqs'\]"),
    ],
)
def test_invalid_overrides_name_the_key(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(RecipeError, match=message):
        resolve(host(variant_overrides=overrides))


def test_single_card_variant_rejects_tp2() -> None:
    with pytest.raises(RecipeError, match=r"must be one of \[1\] for variant 'single'"):
        resolve(host("single", variant_overrides={"tensor_parallel_size": 2}))


def test_overrides_must_be_a_mapping() -> None:
    with pytest.raises(RecipeError, match="variant_overrides must be a mapping"):
        resolve(host(variant_overrides=["port"]))


def test_unknown_variant() -> None:
    with pytest.raises(RecipeError, match="unknown variant 'dual-fast'"):
        resolve(host("dual-fast"))


def test_registry_mirror_and_rig_paths() -> None:
    r = resolve(host("dual-turbo", container_registry="mirror.lan:5000", install_root="/srv/rig",
                     model_dir="/data/models", serving_bind_address="127.0.0.1"))
    assert r.image.ref == "mirror.lan:5000/vllm/vllm-openai:nightly-7a1eb8ac2ec4ea69338c51dc7afd4b15010abfa8"
    assert r.paths.compose_file == "/srv/rig/variants/dual-turbo/compose.yaml"
    assert r.paths.env_file == "/srv/rig/variants/dual-turbo/.env"
    assert r.paths.unit_file == "/etc/systemd/system/rigup-dual-turbo.service"
    assert r.model.path == "/data/models/qwen3.6-27b-autoround-int4"
    sources = {m.target: m.source for m in r.mounts if m.kind == "source"}
    assert sources["/usr/local/lib/python3.12/dist-packages/vllm/_genesis"] == "/srv/rig/sources/genesis/vllm/_genesis"
    # dual-turbo's patch sidecars come from the club-3090 spring checkout the compose file is read from.
    assert {s.name: s.path for s in r.sources} == {"vllm-fork": "/srv/rig/sources/vllm-fork",
                                                   "genesis": "/srv/rig/sources/genesis",
                                                   "club3090-spring": "/srv/rig/sources/club3090-spring"}
    assert sources["/patches/patch_tolist_cudagraph.py"] == (
        "/srv/rig/sources/club3090-spring/models/qwen3.6-27b/vllm/patches/patch_tolist_cudagraph.py")
    assert r.host_dirs == ("/srv/rig/cache/dual-turbo/torch_compile", "/srv/rig/cache/dual-turbo/triton")
    assert r.health_url == r.models_url == "http://127.0.0.1:8011/v1/models"
    assert r.liveness_url == "http://127.0.0.1:8011/health"
    assert resolve(host()).health_url == "http://127.0.0.1:8010/v1/models"  # 0.0.0.0 -> loopback
    assert resolve(host(serving_bind_address="::")).models_url == "http://[::1]:8010/v1/models"


def test_git_urls_come_from_knobs() -> None:
    r = resolve(host("single-long-text", genesis_git_url="http://10.0.0.1/genesis.git",
                     club3090_git_url="http://10.0.0.1/club.git"))
    # club3090-spring is a snapshot of the club-3090 repository: same URL knob.
    assert {s.name: s.git_url for s in r.sources} == {"genesis": "http://10.0.0.1/genesis.git",
                                                      "club3090-spring": "http://10.0.0.1/club.git"}
    assert r.upstream is not None and r.upstream.url == "http://10.0.0.1/club.git"


@pytest.mark.parametrize(
    ("knob", "value", "message"),
    [
        ("container_registry", "https://docker.io", "container_registry"),
        ("install_root", "relative/path", "install_root must be an absolute path"),
        ("install_root", "/opt/my rig", "install_root must be an absolute path"),
        ("model_dir", "/opt/../etc", "model_dir"),
        ("serving_bind_address", "localhost", "serving_bind_address must be an IP address"),
        ("genesis_git_url", None, "genesis_git_url"),
    ],
)
def test_bad_knobs(knob: str, value: Any, message: str) -> None:
    with pytest.raises(RecipeError, match=message):
        resolve(host("dual-turbo", **{knob: value}))


class FakeLock:
    def __init__(self, entries: dict[str, str]) -> None:
        self.entries = entries

    def git_commit(self, name: str) -> str | None:
        return self.entries.get(name) if name.startswith("git:") else None

    def model_revision(self, name: str) -> str | None:
        return self.entries.get(name) if name.startswith("model:") else None

    def image_digest(self, name: str) -> str | None:
        return self.entries.get(name) if name.startswith("image:") else None


def test_lock_pins_commits_revisions_and_digest() -> None:
    fork, genesis, rev, draft = "a" * 40, "b" * 40, "c" * 40, "d" * 40
    digest = "sha256:" + "e" * 64
    lock = FakeLock({
        "git:vllm-fork": fork,
        "git:genesis": genesis,
        "model:Lorbus/Qwen3.6-27B-int4-AutoRound": rev,
        "model:z-lab/Qwen3.6-27B-DFlash": draft,
        "image:vllm/vllm-openai:nightly-7a1eb8ac2ec4ea69338c51dc7afd4b15010abfa8": digest,
    })
    assert isinstance(lock, Lock)
    r = resolve(host("dual-dflash"), lock)
    assert [(s.name, s.commit, s.locked) for s in r.sources] == [("vllm-fork", fork, True)]
    assert [(m.repo_id, m.revision) for m in r.models] == [
        ("Lorbus/Qwen3.6-27B-int4-AutoRound", rev), ("z-lab/Qwen3.6-27B-DFlash", draft)]
    assert r.image.digest == digest
    assert r.image.ref.endswith(f":nightly-7a1eb8ac2ec4ea69338c51dc7afd4b15010abfa8@{digest}")
    turbo = resolve(host("dual-turbo"), lock)
    # The spring snapshot is not in this lock: it stays at the catalog's full commit, unlocked.
    assert {s.name: (s.commit, s.locked) for s in turbo.sources} == {
        "vllm-fork": (fork, True), "genesis": (genesis, True), "club3090-spring": ("2e934ad18ad70d98e2e314ca3a96759935393949", False)}
    assert turbo.upstream is not None and turbo.upstream.commit == "2e934ad18ad70d98e2e314ca3a96759935393949"


def test_without_lock_refs_stay_as_documented() -> None:
    r = resolve(host("dual-turbo"))
    assert {s.name: (s.ref, s.commit, s.locked) for s in r.sources} == {
        "vllm-fork": ("marlin-pad-sub-tile-n", None, False),
        "genesis": ("2db18df4bc3abd4eb58a9b2e0342082fa7012c64", "2db18df4bc3abd4eb58a9b2e0342082fa7012c64", False),
        "club3090-spring": ("2e934ad18ad70d98e2e314ca3a96759935393949", "2e934ad18ad70d98e2e314ca3a96759935393949", False),
    }
    assert r.image.digest is None and r.model.revision is None
    partial = resolve(host("dual-turbo"), FakeLock({}))  # a lock without entries changes nothing
    assert partial.sources == r.sources and partial.image == r.image


def test_source_refs_replace_the_catalog_pin_and_are_validated():
    from rigup.desired.knobs import load_defaults
    from rigup.desired.recipe import RecipeError, resolve

    data = {**load_defaults(), "variant": "dual-turbo"}
    genesis = next(s for s in resolve(data).sources if s.name == "genesis")
    assert genesis.ref == "2db18df4bc3abd4eb58a9b2e0342082fa7012c64" and genesis.commit == genesis.ref
    moved = next(s for s in resolve({**data, "source_refs": {"genesis": "v7.51-stable-2026-04-27"}}).sources
                 if s.name == "genesis")
    assert (moved.ref, moved.commit) == ("v7.51-stable-2026-04-27", None)  # one of upstream's tags: the lock resolves it
    with pytest.raises(RecipeError, match="unknown source_refs key 'genesys'"):
        resolve({**data, "source_refs": {"genesys": "dev"}})
    with pytest.raises(RecipeError, match=r"source_refs\['genesis'\] must be"):
        resolve({**data, "source_refs": {"genesis": ""}})


def test_credentials_in_a_git_url_stay_out_of_the_rendered_file() -> None:
    r = resolve(host("dual", club3090_git_url="https://rigup:s3cret-token@git.example.lan:8443/mirror/club-3090.git"))
    assert "s3cret-token" not in r.compose_text and "rigup:" not in r.compose_text
    assert "https://git.example.lan:8443/mirror/club-3090.git" in r.compose_text
