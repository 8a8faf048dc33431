"""release.json (built on the control machine) and provenance.json (written on the rig): their
content, that pins reach them, that secrets never do, and that `rigup status` can read them back."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from rigup.desired.knobs import load_defaults
from rigup.desired.lock import FilePin
from rigup.desired.recipe import resolve
from rigup.desired.release import (
    ProvenanceError,
    build_release,
    manifest_sha256,
    p2p_cache_dirs,
    parse_provenance,
    release_json,
    release_path,
)
from rigup.desired.render import render_variant, secret_file, secret_text
from rigup.rig import servingctl

SECRET = "sk-never-in-a-release-0123"


class FakeLock:
    """The three pins rigup.desired.recipe.Lock asks for, plus model file lists."""

    def __init__(self, commit: str = "c" * 40, revision: str = "d" * 40, digest: str | None = "sha256:" + "e" * 64,
                 file_sha: str = "f" * 64) -> None:
        self.commit, self.revision, self.digest, self.file_sha = commit, revision, digest, file_sha

    def git_commit(self, name: str) -> str | None:
        return self.commit

    def model_revision(self, name: str) -> str | None:
        return self.revision

    def image_digest(self, name: str) -> str | None:
        return self.digest

    def model_files(self, name: str) -> tuple[FilePin, ...]:
        return (FilePin("config.json", 10, "1" * 64), FilePin("model.safetensors", 99, self.file_sha))


def release_for(lock: FakeLock, api_key: bool = True, variant: str = "dual") -> dict[str, Any]:
    data = load_defaults()
    data["variant"] = variant
    recipe = resolve(data, lock)
    rendered = render_variant(recipe)
    return build_release(
        recipe, {p: f.content for p, f in rendered.items()}, api_key_present=api_key,
        secret_files={"HF_TOKEN": secret_file(recipe, "HF_TOKEN"), "VLLM_API_KEY": secret_file(recipe, "VLLM_API_KEY")}, lock=lock,
    )


def test_release_names_everything_the_gate_and_status_need():
    release = release_for(FakeLock())
    assert release["variant"] == "dual"
    assert release["unit"] == "rigup-dual.service"
    assert release["unit_file"] == "/etc/systemd/system/rigup-dual.service"
    assert release["variant_dir"] == "/opt/rigup/variants/dual"
    assert release["env_file"] == "/opt/rigup/variants/dual/.env"
    assert release["health_url"].startswith("http://127.0.0.1:") and release["health_url"].endswith("/v1/models")
    assert release["served_model_name"]
    assert release["api_key_env"] == "VLLM_API_KEY"
    # the secret files by name, relative to the variant directory, with no hash: the gate reads the key from its own
    assert release["secret_files"] == {"HF_TOKEN": "secrets/HF_TOKEN", "VLLM_API_KEY": "secrets/VLLM_API_KEY"}
    assert "secret_env_keys" not in release
    assert set(release["files"]) == {"compose.yaml", ".env"}
    assert release["image"]["digest"] == "sha256:" + "e" * 64
    assert release["image"]["ref"].endswith("@sha256:" + "e" * 64)
    assert release["sources"] and all(s["commit"] for s in release["sources"])
    assert [m["revision"] for m in release["models"]] == ["d" * 40] * len(release["models"])
    assert release["models"][0]["files_sha256"] == manifest_sha256(FakeLock().model_files("x"))


def test_open_api_has_no_key_env():
    assert release_for(FakeLock(), api_key=False)["api_key_env"] is None


@pytest.mark.parametrize(
    "changed",
    [
        FakeLock(commit="9" * 40),  # a source moved
        FakeLock(revision="8" * 40),  # a model revision moved
        FakeLock(digest="sha256:" + "7" * 64),  # the image digest moved
        FakeLock(file_sha="6" * 64),  # a model file re-published at the same revision
    ],
)
def test_every_pin_changes_the_release_text(changed):
    # The serving task restarts when release.json changes: each pin must reach it.
    assert release_json(release_for(changed)) != release_json(release_for(FakeLock()))


def test_release_text_is_canonical():
    assert release_json(release_for(FakeLock())) == release_json(release_for(FakeLock()))
    text = release_json(release_for(FakeLock()))
    assert text.endswith("}\n") and json.loads(text)["schema"] == servingctl.SCHEMA


def test_release_carries_no_secret():
    data = load_defaults()
    data["variant"] = "dual"
    recipe = resolve(data, FakeLock())
    rendered = render_variant(recipe)
    assert not any(SECRET in f.content for f in rendered.values())
    release = build_release(recipe, {p: f.content for p, f in rendered.items()}, api_key_present=True,
                            secret_files={"HF_TOKEN": secret_file(recipe, "HF_TOKEN"), "VLLM_API_KEY": secret_file(recipe, "VLLM_API_KEY")}, lock=FakeLock())
    text = release_json(release)
    assert SECRET not in text
    for text_of_file in (secret_text("VLLM_API_KEY", SECRET), SECRET):  # no hash of a secret file either
        assert hashlib.sha256(text_of_file.encode()).hexdigest() not in text
    assert release_path(recipe) == "/opt/rigup/variants/dual/release.json"


def test_release_rejects_files_outside_the_variant_dir():
    data = load_defaults()
    data["variant"] = "dual"
    recipe = resolve(data, FakeLock())
    with pytest.raises(ValueError, match="outside"):
        build_release(recipe, {"etc/passwd": "x", recipe.paths.unit_file.lstrip("/"): "u"}, api_key_present=False, secret_files={})
    with pytest.raises(ValueError, match="do not include the unit"):
        build_release(recipe, {recipe.paths.compose_file.lstrip("/"): "c"}, api_key_present=False, secret_files={})


def test_provenance_written_on_the_rig_reads_back(tmp_path: Path):
    release = release_for(FakeLock())
    # Point the release at a temporary rig root.
    root = tmp_path / "opt/rigup"
    release["install_root"] = str(root)
    release["variant_dir"] = str(root / "variants/dual")
    path = root / "variants/dual/release.json"
    path.parent.mkdir(parents=True)
    path.write_text(release_json(release))
    rel = servingctl.Release.load(str(path))
    gate = {"result": "passed", "ready_seconds": 41.5, "seconds": 42.0, "at": "2026-01-01T00:00:00+00:00", "models": ["m"]}
    versions = {"kernel": "6.8.0-45-generic", "nvidia_driver": "580.95.05", "docker": "28.5.1", "docker_compose": "2.40.3", "nvidia_ctk": "1.18.0"}
    servingctl.write_provenance(rel, 3, gate, None, versions)
    prov = parse_provenance((root / "state/provenance.json").read_text())
    assert prov.variant == "dual" and prov.generation == 3 and prov.unit == "rigup-dual.service"
    assert prov.release_sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert prov.image == release["image"]["ref"]
    assert set(prov.sources.values()) == {"c" * 40}
    assert set(prov.models.values()) == {"d" * 40}
    assert prov.files["compose.yaml"] == release["files"]["compose.yaml"]
    assert prov.files["unit"] == release["unit_sha256"]
    assert prov.host == versions
    assert prov.gate_result == "passed" and prov.gate_ready_seconds == 41.5
    assert prov.last_rollback is None and prov.written_at


def test_parse_provenance_rejects_other_documents():
    with pytest.raises(ProvenanceError):
        parse_provenance('{"schema": 99}')
    with pytest.raises(ProvenanceError):
        parse_provenance({"schema": 1, "variant": "x"})


def test_a_pod_that_keeps_the_p2p_cache_in_its_container_has_no_p2p_cache_dirs():
    """Upstream mounts /root/.cache/vllm/torch_compile_cache only: vLLM's P2P verdict, beside it in
    /root/.cache/vllm, stays in the container (its release is unchanged: no key, no restart)."""
    recipe = resolve({**load_defaults(), "variant": "dual"}, FakeLock())
    assert "/root/.cache/vllm/torch_compile_cache" in [m.target for m in recipe.mounts]
    assert p2p_cache_dirs(recipe) == []
    assert "p2p_cache_dirs" not in release_for(FakeLock())


def test_a_mount_over_vllms_cache_root_names_the_rig_directory_to_clear():
    from dataclasses import replace

    from rigup.desired.recipe import EnvVar, Mount

    recipe = resolve({**load_defaults(), "variant": "dual"}, FakeLock())
    home = Mount("/opt/rigup/cache/dual/root-cache", "/root/.cache", False, "cache", "cache")
    assert p2p_cache_dirs(replace(recipe, mounts=(*recipe.mounts, home))) == ["/opt/rigup/cache/dual/root-cache/vllm"]
    # the innermost writable mount holds it; a read-only one cannot
    vllm = Mount("/opt/rigup/cache/dual/vllm", "/root/.cache/vllm", False, "cache", "cache")
    assert p2p_cache_dirs(replace(recipe, mounts=(*recipe.mounts, home, vllm))) == ["/opt/rigup/cache/dual/vllm"]
    assert p2p_cache_dirs(replace(recipe, mounts=(*recipe.mounts, replace(vllm, read_only=True)))) == []
    # the container's own VLLM_CACHE_ROOT decides where the file goes
    moved = replace(recipe, mounts=(*recipe.mounts, Mount("/srv/vc", "/data", False, "cache", "cache")),
                    environment=(*recipe.environment, EnvVar("VLLM_CACHE_ROOT", "/data/vllm-cache")))
    assert p2p_cache_dirs(moved) == ["/srv/vc/vllm-cache"]
