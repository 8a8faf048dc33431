"""What a rig runs: the release file pyinfra uploads, and the provenance file the rig writes.

Two JSON documents, both free of secrets:

* release.json ({install_root}/variants/<pod>/release.json; the pod is named after the variant
  unless the host lists pods) — built here on the control machine
  from the resolved recipe and the rendered files: variant, unit, health URL, served model, image
  (tag and digest), every source commit, every model revision, engine settings, the fields every chat
  request must carry (chat_request, only when the variant has some; the gate adds them), the gate's
  probes the model answers (gate_probes, only when the variant leaves some out), the rig directories
  holding vLLM's P2P access cache (p2p_cache_dirs, only when the compose file mounts it), the SHA-256
  of each rendered file and the names (no hash, no value) of the pod's secret files (secret_files). tasks/serving.py uploads it next to the compose file, so a new pin (a source
  commit, a model revision, an image digest) changes this file, which restarts the service exactly
  like a changed compose file would.
* provenance.json ({install_root}/state/provenance.json; a listed pod's in state/pods/<pod>/) — written on the rig by rigup-servingctl
  (rigup/rig/servingctl.py) when a release passes the health gate: the release, its generation number,
  host-layer versions, the rig's fingerprint (GPUs, PCI topology, driver, module, kernel, BIOS: a converge
  that finds another re-validates the pod), the gate's result and times, and the last rollback if there was one. It is
  written only when the gate runs, so a converged re-run leaves it untouched. `rigup status` reads it
  with `parse_provenance`.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from rigup.desired.recipe import Recipe
from rigup.layout import RigLayout
from rigup.rig.servingctl import PROBE_NAMES, PROVENANCE_NAME, RELEASE_NAME, SCHEMA

API_KEY_ENV = "VLLM_API_KEY"  # the secret vLLM reads its API key as (rigup.desired.render.API_KEY_KEY): the gate
# reads it from the file secret_files names for it


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def release_path(recipe: Recipe) -> str:
    return posixpath.join(recipe.paths.variant_dir, RELEASE_NAME)


def provenance_path(install_root: str) -> str:
    """Where the record of a host's one unlisted pod (the simple form, `variant:`) is."""
    return RigLayout(install_root).provenance


def recipe_provenance_path(recipe: Recipe) -> str:
    """Where rigup-servingctl records what passed the gate for this recipe's pod."""
    return posixpath.join(recipe.paths.record_dir, PROVENANCE_NAME)


class ModelFilesLock(Protocol):
    """What build_release needs from the lock beyond the recipe (rigup.desired.lock.LockFile has it)."""

    def model_files(self, name: str) -> tuple[Any, ...]:  # FilePin(path, size, sha256)
        ...


def manifest_sha256(file_pins: Sequence[Any]) -> str:
    """One hash over a model's locked file list (path, size, SHA-256 of every file)."""
    lines = sorted(f"{pin.path}\t{pin.size}\t{pin.sha256}\n" for pin in file_pins)
    return sha256_text("".join(lines))


# Where vLLM keeps its P2P access cache in the container: os.path.join(envs.VLLM_CACHE_ROOT,
# f"gpu_p2p_access_cache_for_{cuda_visible_devices}.json") (vllm/distributed/device_communicators/
# all_reduce_utils.py at vllm-project/vllm b250ac3dd5ef41c880d647ac1556ead89a7bff54), VLLM_CACHE_ROOT being
# ~/.cache/vllm unless set (club-3090 docs/PCIE_P2P.md@4a29ab57d42a1d587de1042fa5dfd9535f94a063: "caching the
# result to `~/.cache/vllm/gpu_p2p_access_cache_for_<devices>.json`"); upstream's containers run as root.
CONTAINER_VLLM_CACHE_ROOT = "/root/.cache/vllm"


def p2p_cache_dirs(recipe: Recipe) -> list[str]:
    """The rig directories holding the pod's vLLM P2P access cache: where a writable mount of the compose
    file covers the container's VLLM_CACHE_ROOT (its environment's VLLM_CACHE_ROOT, else XDG_CACHE_HOME/vllm,
    else /root/.cache/vllm). Empty when the cache stays in the container, which every start of rigup's unit
    removes (`docker compose down`); no variant of today's catalog mounts it (upstream mounts only
    /root/.cache/vllm/torch_compile_cache, beneath it)."""
    env = {e.name: e.value for e in recipe.environment}
    root = env.get("VLLM_CACHE_ROOT") or (posixpath.join(env["XDG_CACHE_HOME"], "vllm") if env.get("XDG_CACHE_HOME")
                                          else CONTAINER_VLLM_CACHE_ROOT)
    root = posixpath.normpath(root)
    covering = [m for m in recipe.mounts if not m.read_only
                and (root == m.target.rstrip("/") or root.startswith(m.target.rstrip("/") + "/"))]
    if not covering:
        return []
    mount = max(covering, key=lambda m: len(m.target))  # the innermost mount is the one the file lands in
    return [posixpath.normpath(posixpath.join(mount.source, posixpath.relpath(root, mount.target)))]


def _relative(path: str, variant_dir: str) -> str:
    rel = posixpath.relpath(path, variant_dir)
    if rel.startswith(".."):
        raise ValueError(f"{path} is outside {variant_dir}")
    return rel


def build_release(
    recipe: Recipe,
    rendered: Mapping[str, str],
    *,
    api_key_present: bool,
    secret_files: Mapping[str, str],
    lock: ModelFilesLock | None = None,
) -> dict[str, Any]:
    """The release document for `recipe`.

    + rendered: rig path -> file content as rendered (no file of these holds a secret)
    + api_key_present: the pod has its API key (the file secret_files names for VLLM_API_KEY); the gate sends
      it as a bearer token
    + secret_files: secret name -> its 0600 file on the rig (rigup.desired.render.secret_file). The release
      names them, relative to the variant directory, with no hash (a hash of a key in this world-readable file
      is not published): the rig keeps them with each generation, restarts the pod when one changes, and
      redacts their values from printed logs
    + lock: the deploy's lock; adds each model's file manifest hash (a re-published file at the same
      revision still changes the release)
    """
    paths = recipe.paths
    files: dict[str, str] = {}
    unit_sha: str | None = None
    for path, content in rendered.items():
        absolute = "/" + path.lstrip("/")
        if absolute == paths.unit_file:
            unit_sha = sha256_text(content)
            continue
        rel = posixpath.relpath(absolute, paths.variant_dir)
        if rel.startswith(".."):
            raise ValueError(f"rendered file {absolute} is outside {paths.variant_dir}")
        files[rel] = sha256_text(content)
    if unit_sha is None:
        raise ValueError(f"rendered files do not include the unit {paths.unit_file}")
    release: dict[str, Any] = {
        "schema": SCHEMA,
        "variant": recipe.variant,
        "description": recipe.description,
        "install_root": paths.install_root,
        "variant_dir": paths.variant_dir,
        "unit": paths.unit_name,
        "unit_file": paths.unit_file,
        "unit_sha256": unit_sha,
        "env_file": paths.env_file,
        "files": dict(sorted(files.items())),
        "health_url": recipe.health_url,
        **({"cluster": {"name": recipe.cluster.cluster.name, "role": recipe.cluster.role,
                        "rank": recipe.cluster.rank, "hosts": list(recipe.cluster.cluster.hosts)}}
           if recipe.cluster is not None else {}),
        "served_model_name": recipe.served_model_name,
        "bind_address": recipe.bind_address,
        "host_port": recipe.host_port,
        "api_key_env": API_KEY_ENV if api_key_present else None,
        "secret_files": {name: _relative(path, paths.variant_dir) for name, path in sorted(secret_files.items())},
        "image": {
            "ref": recipe.image.ref,
            "repository": recipe.image.repository,
            "tag": recipe.image.tag,
            "digest": recipe.image.digest,
        },
        "sources": [
            {"name": s.name, "url": s.git_url, "ref": s.ref, "commit": s.commit, "locked": s.locked}
            for s in recipe.sources
        ],
        "models": [
            {
                "repo_id": m.repo_id,
                "revision": m.revision,
                "dir": m.dir_name,
                "role": m.role,
                "path": m.path,
                "files_sha256": manifest_sha256(lock.model_files(m.lock_name)) if lock is not None else None,
            }
            for m in recipe.models
        ],
        "engine": {
            "tensor_parallel_size": recipe.tensor_parallel_size,
            "max_model_len": recipe.max_model_len,
            "gpu_memory_utilization": recipe.gpu_memory_utilization,
            "max_num_seqs": recipe.max_num_seqs,
            "kv_cache_dtype": recipe.kv_cache_dtype,
            "speculative_method": recipe.speculative_method,
            "genesis": recipe.genesis,
        },
    }
    if recipe.pod_listed:
        # A listed pod (rigup.desired.pods): its own directory and provenance record. Only then, so the
        # release of a host without pods stays byte-identical (no restart).
        release["pod"] = recipe.pod
        release["state_dir"] = paths.record_dir
        release["gpu_ids"] = list(recipe.gpu_ids or ())
    if recipe.chat_request:
        # Only when the variant has some: a release without them stays byte-identical (no restart).
        release["chat_request"] = json.loads(json.dumps(dict(recipe.chat_request)))
    cache_dirs = p2p_cache_dirs(recipe)
    if cache_dirs:
        # Only for a pod that keeps vLLM's P2P cache on the rig: `rigup-servingctl revalidate` removes it when
        # the rig's fingerprint changed. Other releases stay byte-identical (no restart).
        release["p2p_cache_dirs"] = cache_dirs
    if recipe.gate_probes is not None and tuple(recipe.gate_probes) != PROBE_NAMES:
        # Only when the variant leaves out some of the gate's probes: a release asking every one (the
        # rig's default) stays byte-identical (no restart).
        release["gate_probes"] = list(recipe.gate_probes)
    return release


def release_json(release: Mapping[str, Any]) -> str:
    """Canonical text of a release (sorted keys) so equal releases are byte-identical files."""
    return json.dumps(release, indent=2, sort_keys=True) + "\n"


@dataclass(frozen=True)
class Provenance:
    """provenance.json as `rigup status` shows it."""

    variant: str
    generation: int
    unit: str
    release_sha256: str
    image: str | None
    sources: dict[str, str | None]  # source name -> commit
    models: dict[str, str | None]  # repo id -> revision
    files: dict[str, str]  # relpath -> sha256, plus "unit" -> the unit file's sha256
    host: dict[str, str | None]  # kernel, nvidia_driver, docker, docker_compose, nvidia_ctk
    gate_result: str
    gate_at: str | None
    gate_ready_seconds: float | None
    written_at: str | None
    last_rollback: dict[str, Any] | None
    raw: dict[str, Any]


def release_sha256(release: Mapping[str, Any]) -> str:
    """What rigup-servingctl records as release_sha256: the hash of release.json's text."""
    return sha256_text(release_json(release))

class ProvenanceError(ValueError):
    """provenance.json is not a rigup provenance record."""


def parse_provenance(document: str | Mapping[str, Any]) -> Provenance:
    data: Any = json.loads(document) if isinstance(document, str) else dict(document)
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise ProvenanceError(f"not a schema-{SCHEMA} rigup provenance record")
    try:
        release = data["release"]
        gate = data.get("gate") or {}
        files = dict(release.get("files") or {})
        if release.get("unit_sha256"):
            files["unit"] = release["unit_sha256"]
        return Provenance(
            variant=str(data["variant"]),
            generation=int(data["generation"]),
            unit=str(data["unit"]),
            release_sha256=str(data["release_sha256"]),
            image=(release.get("image") or {}).get("ref"),
            sources={s["name"]: s.get("commit") for s in release.get("sources") or ()},
            models={m["repo_id"]: m.get("revision") for m in release.get("models") or ()},
            files=files,
            host=dict(data.get("host") or {}),
            gate_result=str(gate.get("result", "unknown")),
            gate_at=gate.get("at"),
            gate_ready_seconds=gate.get("ready_seconds"),
            written_at=data.get("written_at"),
            last_rollback=data.get("last_rollback"),
            raw=data,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ProvenanceError(f"malformed provenance record: {exc}") from None
