"""The resolved recipe: one frozen object with everything a task needs to serve one variant on one rig.

`resolve(host_data, lock, interconnect)` combines the catalog entry (rigup/catalog.yaml), the host's
knobs (group_data/all.py keys, including `variant_overrides`), when given the lock's exact pins, and
the GPU interconnect detected on the host (rigup/desired/interconnect.py: NVLink changes the NCCL settings).
Tasks, `rigup render`, `rigup doctor` and `rigup status` read this object; nothing re-derives it.
"""

from __future__ import annotations

import copy
import ipaddress
import json
import math
import posixpath
import re
import urllib.parse
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from rigup.desired.catalog import GPU_MEMORY_UTILIZATION_RANGE, CatalogError, closest_variants, load_catalog
from rigup.desired.cluster import ClusterMember, ClusterNet, RayPorts, cluster_of, refusals
from rigup.desired.compose_doc import Change, ComposeEdit, ComposeError, UpstreamFile, dump
from rigup.desired.image_mirror import pull_registry
from rigup.desired.interconnect import Interconnect, effective, nccl_settings
from rigup.desired.knobs import REGISTRY, RIG_PATH, is_strict_int, knob
from rigup.desired.pods import Pod, PodError, host_pods, pod_data
from rigup.desired.roles import cluster_membership
from rigup.desired.transforms import (
    CACHE_TARGETS,
    MODEL_ROOT,
    OVERRIDE_FLAGS,
    SECRETS_TARGET,
    Context,
    SourceCheckout,
    apply_all,
    entry_stage,
    upstream_entrypoint,
)
from rigup.desired.upstream import UpstreamError, UpstreamReader, WorkingTrees, default_reader
from rigup.layout import RigLayout

# The port vLLM listens on inside the container; the host port is per variant.
CONTAINER_PORT = 8000
# systemd unit directory on the rig.
SYSTEMD_UNIT_DIR = "/etc/systemd/system"

_SAFE_PATH = RIG_PATH  # declared with the knobs that are rig paths

# `variant_overrides` keys a host may set, with the recipe field each one changes.
OVERRIDE_KEYS = (
    "max_model_len",
    "gpu_memory_utilization",
    "port",
    "max_num_seqs",
    "max_num_batched_tokens",
    "tensor_parallel_size",
)


class RecipeError(ValueError):
    """A host's data cannot be turned into a recipe (unknown variant, bad override, ...)."""


@runtime_checkable
class Lock(Protocol):
    """What `resolve` needs from a lock file (rigup/desired/lock.py implements it).

    Names are stable keys the catalog defines: "git:<source>" (e.g. "git:genesis", "git:vllm-fork"),
    "model:<repo id>" (e.g. "model:Lorbus/Qwen3.6-27B-int4-AutoRound") and
    "image:<repository>:<tag>" (e.g. "image:vllm/vllm-openai:nightly-7a1e..."). Each returns None when
    the lock has no entry for the name.
    """

    def git_commit(self, name: str) -> str | None:
        """Full 40-hex commit locked for a git source."""
        ...

    def model_revision(self, name: str) -> str | None:
        """Full 40-hex Hugging Face commit locked for a model repository."""
        ...

    def image_digest(self, name: str) -> str | None:
        """Registry digest ("sha256:<64 hex>") locked for an image tag."""
        ...


@dataclass(frozen=True)
class ImageSpec:
    """The container image, pinned by tag and (when locked) by digest."""

    key: str  # catalog image key, e.g. "vllm-nightly-7a1eb8ac"
    lock_name: str  # "image:vllm/vllm-openai:nightly-..."
    registry: str  # "docker.io" or a mirror
    repository: str  # "vllm/vllm-openai"
    tag: str
    digest: str | None  # the catalog's (an image upstream pins by digest), else the lock's; None: tag only
    ref: str  # what compose pulls: registry/repository:tag[@digest]
    cuda_runtime: str  # CUDA runtime inside the image, "13.0"; the driver must support at least this
    approx_size_gb: float  # on-disk size after pull (for the disk check)


@dataclass(frozen=True)
class SourceSpec:
    """A git checkout the variant mounts files from."""

    name: str  # "genesis", "vllm-fork", "club3090"
    lock_name: str  # "git:genesis"
    git_url: str  # from the host knob named by the catalog (e.g. genesis_git_url)
    ref: str  # branch or full commit the catalog documents
    commit: str | None  # full commit: the lock's, else the catalog's when `ref` is a full sha
    locked: bool  # True when `commit` came from the lock
    documented_commit: str | None  # short sha the seeds mention (for humans and drift checks)
    full_clone: bool  # True: a shallow clone cannot reach the pinned commit (Genesis dev-branch pins)
    path: str  # rig path: {install_root}/sources/<name>
    required_paths: tuple[str, ...]  # files/dirs under `path` that mounts use; a missing one must fail the deploy
    approx_size_gb: float


@dataclass(frozen=True)
class ModelSpec:
    """A Hugging Face repository downloaded into {model_dir}/<dir_name>."""

    name: str  # catalog model key
    lock_name: str  # "model:<repo_id>"
    repo_id: str
    revision: str | None  # the lock's full commit; None: not locked yet (the lock tool resolves main)
    dir_name: str
    path: str  # rig path {model_dir}/<dir_name>
    container_path: str  # /root/.cache/huggingface/<dir_name>
    role: Literal["main", "draft"]
    approx_size_gb: float
    verify_glob: str  # files whose SHA-256 must match the hub's published hash
    gated: bool  # True: the hub needs a token that accepted the model's licence


@dataclass(frozen=True)
class Mount:
    """One bind mount; compose renders it with create_host_path: false so a missing source fails."""

    source: str  # absolute rig path
    target: str  # absolute container path
    read_only: bool
    kind: Literal["model", "source", "cache"]  # "cache": a cache or data_dirs directory under the install root
    origin: str  # "model:<key>", "git:<source>" or "cache"


@dataclass(frozen=True)
class EnvVar:
    name: str
    value: str


@dataclass(frozen=True)
class Envelope:
    """A (context, memory utilisation) pair the seeds measured as fitting the GPUs."""

    max_model_len: int
    gpu_memory_utilization: float
    vision: bool  # False: only fits with --language-model-only
    note: str


@dataclass(frozen=True)
class RigPaths:
    install_root: str
    model_dir: str
    sources_dir: str  # {install_root}/sources
    variant_dir: str  # {install_root}/variants/<pod> (the pod is named after the variant without pods)
    compose_file: str  # {variant_dir}/compose.yaml
    env_file: str  # {variant_dir}/.env (0600; no secret in it: they are files of secrets_dir)
    secrets_dir: str  # {variant_dir}/secrets: 0700, one 0600 root file per secret, bound read-only in the container
    state_dir: str  # {install_root}/state (model stamps, fetch log; the record of an unlisted pod)
    record_dir: str  # where the pod's provenance.json is: state_dir, or {state_dir}/pods/<pod> for a listed pod
    cache_dir: str  # {install_root}/cache/<pod> (torch.compile and Triton caches)
    unit_name: str  # rigup-<pod>.service
    unit_file: str  # /etc/systemd/system/rigup-<pod>.service


@dataclass(frozen=True)
class Recipe:
    """Everything needed to serve one variant on one rig. Built only by `resolve`."""

    variant: str
    description: str
    family: str  # model family, e.g. "qwen3.6-27b"
    pod: str  # the pod's name (rigup.desired.pods); without pods, the variant's
    pod_listed: bool  # from the pods knob: its own state directory, and release fields naming it
    gpu_ids: tuple[int, ...] | None  # the GPUs the container gets; None: the first gpu_count
    image: ImageSpec
    # network
    bind_address: str
    host_port: int
    container_port: int
    # compose naming
    project_name: str  # compose project: rigup-<pod>
    service_name: str
    container_name: str
    served_model_name: str
    # GPUs
    tensor_parallel_size: int  # on this host
    gpu_count: int  # GPUs the container uses: the tensor-parallel size, or a deploy config's stage devices
    valid_tensor_parallel_sizes: tuple[int, ...]  # what variant_overrides may choose
    min_compute_capability: tuple[int, int]  # (8, 6): Ampere RTX 3090
    min_gpu_memory_gb: float  # smallest card the envelope was measured on (GB = 1000 MiB)
    vram_per_gpu_gb: float | None  # measured peak per card at the documented settings; None: not measured
    measured_on_gpu_mib: int  # memory.total (MiB) of the card the envelopes were measured on (RTX 3090)
    envelope_is_documented: bool  # False when overrides moved context/util/seqs/TP off the measured point
    alternative_envelopes: tuple[Envelope, ...]
    # engine settings (also present, in order, in vllm_args)
    max_model_len: int
    gpu_memory_utilization: float
    max_num_seqs: int
    max_num_batched_tokens: int | None
    kv_cache_dtype: str | None  # None: vLLM's default (model dtype)
    dtype: str
    speculative_config: str | None  # the JSON passed to --speculative-config
    speculative_method: str | None  # "mtp" or "dflash" (catalog `kind`); None: no speculative decoding
    language_model_only: bool
    genesis: bool  # Genesis patches applied at container start
    needs_network_at_start: bool  # upstream's entrypoint pip-installs at every start (needs PyPI)
    # container
    entrypoint: tuple[str, ...]  # upstream's, as transformed; the compose file runs it behind KEY_WRAPPER_WORDS
    vllm_args: tuple[str, ...]  # the compose `command` (arguments to `vllm serve`)
    environment: tuple[EnvVar, ...]
    mounts: tuple[Mount, ...]
    shm_size: str
    ipc: str
    # artifacts
    sources: tuple[SourceSpec, ...]
    models: tuple[ModelSpec, ...]
    disk_needed_gb: float  # image + models + sources (approximate, from the catalog)
    paths: RigPaths
    host_dirs: tuple[str, ...]  # directories the serving task creates before start (cache and data_dirs mounts)
    overrides: Mapping[str, Any] = field(default_factory=dict)  # variant_overrides as applied
    # GPU interconnect the NCCL settings were planned for (TP >= 2 only; None: the catalog's PCIe-safe
    # settings, i.e. nothing detected and nothing forced)
    interconnect: Interconnect | None = None
    interconnect_note: str | None = None  # set when the settings differ from upstream's (compose header)
    upstream: UpstreamFile | None = None  # the base: upstream's compose file at the commit it was read at
    upstream_source: SourceSpec | None = None  # the recipe repository it was read from (locked like a source)
    upstream_status: str = "current"  # "current" in upstream's newest lineup, else "archived"
    compose_text: str = ""  # the compose file the rig runs (upstream + transforms)
    changes: tuple[Change, ...] = ()  # every transform's recorded edit, in order
    # Fields every chat request to this server must carry (catalog `chat_request`, upstream's request
    # format): the health gate (through the release) and `rigup verify` add them to theirs.
    chat_request: Mapping[str, Any] = field(default_factory=dict)
    # The health gate's probes the model can answer (catalog `gate_probes`); None: every probe.
    gate_probes: tuple[str, ...] | None = None
    # a cluster member's share (rigup.desired.cluster): the head serves the API, a worker's is the head's
    cluster: ClusterMember | None = None
    pipeline_parallel_size: int = 1  # the cluster's hosts (1 on one host)

    @property
    def shards(self) -> int:
        """GPUs the model is spread over, across a cluster's hosts too: what a measured envelope's TP means."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def model(self) -> ModelSpec:
        """The main model (role "main")."""
        return next(m for m in self.models if m.role == "main")

    @property
    def draft(self) -> ModelSpec | None:
        return next((m for m in self.models if m.role == "draft"), None)

    @property
    def base_url(self) -> str:
        """The API's base URL as seen from the rig itself (wildcard binds are reached on loopback); a
        cluster worker's is its head's, which serves the cluster (its gate asks the head)."""
        if self.cluster is not None and self.cluster.role == "worker":
            head = self.cluster.net.head_address
            return f"http://{f'[{head}]' if ':' in head else head}:{self.host_port}"
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.bind_address, self.bind_address)
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.host_port}"

    @property
    def health_url(self) -> str:
        """What the health gate polls: /v1/models, which lists served_model_name once the engine is up.

        Needs `Authorization: Bearer <key>` when an API key is configured (see liveness_url).
        """
        return f"{self.base_url}/v1/models"

    @property
    def models_url(self) -> str:
        """Same as health_url, by its plain name."""
        return self.health_url

    @property
    def liveness_url(self) -> str:
        """vLLM's /health: 200 once the engine has loaded; never needs the API key."""
        return f"{self.base_url}/health"


# --------------------------------------------------------------------------------------------
# resolution


def pods_of(host_data: Mapping[str, Any]) -> list[Pod]:
    """The host's pods (rigup.desired.pods.host_pods) from its knobs; a bad entry is a RecipeError (what
    every caller of a recipe or plan handles)."""
    member = cluster_membership(host_data)
    if member:  # a cluster member serves its share of the cluster, on its first gpus_per_host GPUs
        return [Pod(str(member["name"]), str(member["variant"]), tuple(range(int(member["gpus_per_host"]))),
                    dict(member.get("variant_overrides") or {}), True, member)]
    try:
        return host_pods(knob(host_data, "pods"), knob(host_data, "variant"), knob(host_data, "variant_overrides"))
    except PodError as exc:
        raise RecipeError(str(exc)) from None


def _require(host_data: Mapping[str, Any], key: str) -> Any:
    if key not in host_data or host_data[key] is None:
        raise RecipeError(f"host data has no value for {key!r} (declared in group_data/all.py)")
    return host_data[key]


def check_overrides(variant: str, overrides: Any) -> dict[str, Any]:
    """Check a host's `variant_overrides` for catalog variant `variant` (the one rule: resolve uses it,
    and so does the fleet file check, before anything starts).

    Returns every override key's value for the variant (the catalog's, then the overrides'). Raises
    RecipeError naming the key, the value and what is allowed (an unknown variant too)."""
    catalog = load_catalog()
    entry = catalog_variant(catalog, variant)
    return _apply_overrides(overrides, entry, catalog["models"][entry["model"]])


def _apply_overrides(overrides: Any, variant: Mapping[str, Any], model: Mapping[str, Any]) -> dict[str, Any]:
    if overrides is None:
        overrides = {}
    if not isinstance(overrides, Mapping):
        raise RecipeError(
            f"variant_overrides must be a mapping of {', '.join(OVERRIDE_KEYS)} to values, got {overrides!r}"
        )
    knobs: dict[str, Any] = {k: variant.get(k) for k in OVERRIDE_KEYS}
    for key in sorted(overrides, key=str):
        if key not in OVERRIDE_KEYS:
            raise RecipeError(
                f"unknown variant_overrides key {key!r} (value {overrides[key]!r}); allowed: {', '.join(OVERRIDE_KEYS)}"
            )
        knobs[key] = _check_override(key, overrides[key], variant, model)
    if knobs["max_num_batched_tokens"] is not None and knobs["max_num_batched_tokens"] < knobs["max_num_seqs"]:
        raise RecipeError(
            f"variant_overrides['max_num_batched_tokens'] must be at least max_num_seqs ({knobs['max_num_seqs']}), "
            f"got {knobs['max_num_batched_tokens']!r}"
        )
    return knobs


def _check_override(key: str, value: Any, variant: Mapping[str, Any], model: Mapping[str, Any]) -> Any:
    """Validate one variant_overrides entry; return the value to use."""
    where = f"variant_overrides[{key!r}]"
    if key == "max_model_len":
        limit = int(model["max_context"])
        if not is_strict_int(value) or not 1024 <= value <= limit:
            raise RecipeError(f"{where} must be an integer from 1024 to {limit} (model limit), got {value!r}")
        return value
    if key == "gpu_memory_utilization":
        low, high = GPU_MEMORY_UTILIZATION_RANGE
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= float(value) <= high:
            raise RecipeError(f"{where} must be a number from {low} to {high}, got {value!r}")
        return float(value)
    if key == "port":
        if not is_strict_int(value) or not 1 <= value <= 65535:
            raise RecipeError(f"{where} must be an integer port from 1 to 65535, got {value!r}")
        return value
    if key == "max_num_seqs":
        if not is_strict_int(value) or not 1 <= value <= 256:
            raise RecipeError(f"{where} must be an integer from 1 to 256, got {value!r}")
        return value
    if key == "max_num_batched_tokens":
        if not is_strict_int(value) or not 512 <= value <= 262144:
            raise RecipeError(f"{where} must be an integer from 512 to 262144, got {value!r}")
        return value
    if key == "tensor_parallel_size":
        sizes = tuple(variant["tensor_parallel_sizes"])
        if not is_strict_int(value) or value not in sizes:
            hint = ""
            if is_strict_int(value) and value > 0:
                model_sizes = tuple(model["valid_tensor_parallel_sizes"])
                if value not in model_sizes:
                    hint = (
                        f"; model {model['repo_id']} cannot be split {value} ways "
                        f"(valid tensor parallel sizes: {', '.join(map(str, model_sizes))})"
                    )
                layout = nearest_layout(value, sizes)
                if layout is not None:
                    hint += f"; on {value} GPUs use tensor_parallel_size {layout[0]}" + (
                        f" and leave {layout[1]} idle" if layout[1] else ""
                    )
            raise RecipeError(
                f"{where} must be one of {list(sizes)} for variant {variant['name']!r}, got {value!r}{hint}"
            )
        return value
    raise RecipeError(  # pragma: no cover - callers check the key first
        f"unknown variant_overrides key {key!r}"
    )


def nearest_layout(gpus: int, sizes: Sequence[int]) -> tuple[int, int] | None:
    """(tensor parallel size, idle GPUs) of the largest size in `sizes` that fits on `gpus` GPUs.

    Qwen3.6-27B (24 attention / 4 KV heads) splits 1, 2, 4 or 8 ways: 3 GPUs -> (2, 1), 6 -> (4, 2).
    None when even the smallest size needs more GPUs.
    """
    fits = [s for s in sizes if s <= gpus]
    if not fits:
        return None
    return max(fits), gpus - max(fits)


def _registry_prefix(registry: Any) -> str:
    # host[:port][/path] as in "docker.io", "mirror.lan:5000" or "registry.example/dockerhub"
    if not isinstance(registry, str) or not REGISTRY.fullmatch(registry):
        raise RecipeError(f"container_registry must be a registry host (host[:port][/path]), got {registry!r}")
    return registry.rstrip("/")


def _image(cat: Mapping[str, Any], key: str, registry: str, lock: Lock | None) -> ImageSpec:
    spec = cat["images"][key]
    lock_name = f"image:{spec['repository']}:{spec['tag']}"
    digest = lock.image_digest(lock_name) if lock is not None else None
    pinned = spec.get("digest")
    if pinned is not None:
        # Upstream pins this image by digest because its tag moves: the tag's digest now is not the image.
        if digest is not None and digest != pinned:
            raise RecipeError(f"{lock_name}: the lock has digest {digest}, but the catalog pins {pinned} (upstream "
                              f"pins the image by digest; its tag is mutable): lock that digest")
        digest = pinned
    ref = f"{registry}/{spec['repository']}:{spec['tag']}"
    if digest is not None:
        ref += f"@{digest}"
    return ImageSpec(
        key=key,
        lock_name=lock_name,
        registry=registry,
        repository=spec["repository"],
        tag=spec["tag"],
        digest=digest,
        ref=ref,
        cuda_runtime=str(spec["cuda_runtime"]),
        approx_size_gb=float(spec["approx_size_gb"]),
    )


def _is_full_sha(ref: str) -> bool:
    return len(ref) == 40 and all(c in "0123456789abcdef" for c in ref)


def _source(
    cat: Mapping[str, Any],
    name: str,
    host_data: Mapping[str, Any],
    sources_dir: str,
    files: tuple[str, ...],
    lock: Lock | None,
) -> SourceSpec:
    spec = cat["sources"][name]
    lock_name = f"git:{name}"
    locked = lock.git_commit(lock_name) if lock is not None else None
    # A host (or a mirror's fleet file) may pin another branch, tag or commit than the catalog's.
    ref = str((knob(host_data, "source_refs") or {}).get(name, spec["ref"]))
    commit = locked if locked is not None else (ref if _is_full_sha(ref) else None)
    return SourceSpec(
        name=name,
        lock_name=lock_name,
        git_url=str(_require(host_data, spec["url_knob"])),
        ref=ref,
        commit=commit,
        locked=locked is not None,
        documented_commit=spec.get("documented_commit"),
        full_clone=bool(spec["full_clone"]),
        path=posixpath.join(sources_dir, name),
        required_paths=files,
        approx_size_gb=float(spec["approx_size_gb"]),
    )


def _model(
    cat: Mapping[str, Any], key: str, role: Literal["main", "draft"], model_dir: str, lock: Lock | None,
    model_root: str = MODEL_ROOT,
) -> ModelSpec:
    spec = cat["models"][key]
    lock_name = f"model:{spec['repo_id']}"
    return ModelSpec(
        name=key,
        lock_name=lock_name,
        repo_id=spec["repo_id"],
        revision=lock.model_revision(lock_name) if lock is not None else None,
        dir_name=spec["dir"],
        path=posixpath.join(model_dir, spec["dir"]),
        container_path=posixpath.join(model_root, spec["dir"]),
        role=role,
        approx_size_gb=float(spec["approx_size_gb"]),
        verify_glob=spec["verify_glob"],
        gated=bool(spec["gated"]),
    )


def _capability(text: str) -> tuple[int, int]:
    major, minor = str(text).split(".")
    return int(major), int(minor)


def _upstream_commit(source: SourceSpec, reader: UpstreamReader) -> str:
    """The commit a variant's upstream compose file is read at: the lock's, else the ref's full sha,
    else (a preview without a lock) where the branch or tag points now."""
    if source.commit is not None:
        return source.commit
    try:
        return reader.resolve_ref(source.name, source.git_url, source.ref)
    except UpstreamError as exc:
        raise RecipeError(f"{source.lock_name}: not locked, and {exc}") from None


def _int_flag(edit: ComposeEdit, flag: str, default: int | None) -> int | None:
    values = edit.flag_values(flag)
    if values is None:
        return default
    if len(values) != 1 or not values[0].isdigit():
        raise ComposeError(f"{edit.where('command ' + flag)}: {values!r} is not an integer after defaults")
    return int(values[0])


def _float_flag(edit: ComposeEdit, flag: str) -> float:
    values = edit.flag_values(flag)
    try:
        return float(values[0]) if values and len(values) == 1 else float("nan")
    except ValueError:
        raise ComposeError(f"{edit.where('command ' + flag)}: {values!r} is not a number after defaults") from None


def _model_argument(edit: ComposeEdit) -> list[str]:
    """What vLLM loads: `--model X`, or the positional X of a command that is a whole `vllm serve X ...`
    (an image without an entrypoint, such as vLLM-Omni's: the compose has no entrypoint either)."""
    values = edit.flag_values("--model")
    if values is not None:
        return values
    cmd = edit.command()
    if not upstream_entrypoint(edit.get("entrypoint")) and cmd[:2] == ["vllm", "serve"] and len(cmd) > 2 and not cmd[2].startswith("-"):
        return [cmd[2]]
    return []


def _engine_values(edit: ComposeEdit, stages: list[dict[str, Any]] | None) -> tuple[Any, ...]:
    """(TP, max-model-len, max-num-seqs, max-num-batched-tokens, gpu-memory-utilization): the command's
    flags, or with a deploy config its entry stage's values (which the command must not also set)."""
    if stages is None:
        return (_int_flag(edit, "--tensor-parallel-size", 1) or 1, _int_flag(edit, "--max-model-len", None),
                _int_flag(edit, "--max-num-seqs", None), _int_flag(edit, "--max-num-batched-tokens", None),
                _float_flag(edit, "--gpu-memory-utilization"))
    for flag in ("--tensor-parallel-size", "--max-model-len", "--max-num-seqs", "--max-num-batched-tokens",
                 "--gpu-memory-utilization"):
        if edit.flag_values(flag) is not None:
            raise ComposeError(f"{edit.where('command ' + flag)}: set on the command line and per stage by the deploy "
                               f"config: rigup cannot tell which one vLLM-Omni uses")
    stage = entry_stage(stages)
    util = stage.get("gpu_memory_utilization")
    return (int(stage.get("tensor_parallel_size", 1)), stage.get("max_model_len"), stage.get("max_num_seqs"),
            stage.get("max_num_batched_tokens"), float("nan") if util is None else float(util))


def _speculative(edit: ComposeEdit, v: Mapping[str, Any]) -> tuple[str | None, str | None]:
    """(--speculative-config JSON, method) from upstream's command, else the catalog's note of what
    upstream's entrypoint builds (newer composes assemble it from SPEC_N)."""
    values = edit.flag_values("--speculative-config")
    if values is not None:
        try:
            config = json.loads(values[0])
        except (IndexError, ValueError):
            raise ComposeError(f"{edit.where('command --speculative-config')}: not JSON: {values!r}") from None
        method = str(config.get("method") or "")
        kind = "dflash" if "dflash" in method else "mtp" if method in ("mtp", "") or "mtp" in method else method
        return json.dumps(config, separators=(",", ":")), kind
    spec = v.get("speculative")
    if spec is None:
        return None, None
    config = {"method": spec["kind"], "num_speculative_tokens": int(spec["num_speculative_tokens"])}
    return json.dumps(config, separators=(",", ":")), str(spec["kind"])


def resolve(
    host_data: Mapping[str, Any],
    lock: Lock | None = None,
    interconnect: Interconnect | None = None,
    upstream: UpstreamReader | None = None,
    pod: Pod | None = None,
) -> Recipe:
    """Turn (catalog, host data, lock, upstream's compose file) into the recipe for the host's `variant`.

    + host_data: the host's knobs (group_data/all.py names): variant, variant_overrides,
      install_root, model_dir, container_registry, serving_bind_address, gpu_interconnect, source_refs
      and the *_git_url knobs
    + lock: exact pins (git commits, model revisions, image digests); None keeps the catalog's refs
      (upstream files are then read at the catalog's documented commits)
    + interconnect: what rigup.desired.interconnect detected on the host; None keeps upstream's
      PCIe-safe NCCL settings unless the gpu_interconnect knob forces them
    + upstream: where upstream files are read (rigup.desired.upstream; default: the git cache)
    + pod: which of the host's pods (rigup.desired.pods.host_pods); None: the host's only one (an error
      when the host lists pods)

    The stages run in this order, which is also the order a host with several mistakes hears of them.
    """
    pod = pod if pod is not None else only_pod(host_data)
    host_data = pod_data(host_data, pod)
    catalog = load_catalog()
    variant = catalog_variant(catalog, _require(host_data, "variant"))
    reader = upstream if upstream is not None else default_reader()
    check_source_refs(knob(host_data, "source_refs"), catalog["sources"])
    overrides = knob(host_data, "variant_overrides") or {}
    override_values = _apply_overrides(overrides, variant, catalog["models"][variant["model"]])
    paths = rig_paths(host_data, pod)
    registry = _registry_prefix(pull_registry(host_data))  # the fleet's mirror when the host names one
    bind_address = serving_bind_address(host_data)
    models = variant_models(catalog, variant, paths.model_dir, lock)
    upstream_source, base = read_upstream(catalog, variant, host_data, paths.sources_dir, lock, reader)
    image = _image(catalog, variant["image"], registry, lock)
    planned = planned_interconnect(knob(host_data, "gpu_interconnect"), interconnect)
    ctx = transform_context(
        catalog=catalog, variant=variant, pod=pod, image=image, bind_address=bind_address, overrides=overrides,
        override_values=override_values, models=models, paths=paths, base=base, reader=reader, planned=planned,
    )
    if pod.cluster is not None:
        ctx.cluster = cluster_member(host_data, pod.cluster)
    edit = apply_transforms(base, variant, ctx)
    engine = engine_settings(edit, variant, ctx.stages, models[0], base)
    sources = used_sources(catalog, ctx.used_sources, host_data, paths.sources_dir, lock)
    mounts = mounts_of(edit.volumes(), models, sources, ctx.data_dirs)
    check_model_file_mounts(mounts, models, lock, f"variant {variant['name']!r}: {base.where}")
    recipe = assemble_recipe(
        catalog=catalog, variant=variant, pod=pod, image=image, bind_address=bind_address, overrides=overrides,
        paths=paths, models=models, sources=sources, mounts=mounts, upstream_source=upstream_source, base=base,
        edit=edit, engine=engine, ctx=ctx, planned=planned,
    )
    if ctx.cluster is not None:  # what upstream's compose says (a speculative method in its command) counts too
        refused = refusals(ctx.cluster.cluster, recipe)
        if refused:
            raise RecipeError(f"{ctx.cluster.cluster.where}: vLLM cannot serve variant {variant['name']!r} across "
                              f"hosts: " + "; ".join(refused))
    return recipe


# The stages of `resolve`, in the order it runs them.


def only_pod(host_data: Mapping[str, Any]) -> Pod:
    """The host's one pod, for a `resolve` not told which: takes the host's knobs, returns its pod in
    the simple form; RecipeError when the host lists pods (each is resolved on its own)."""
    pods = pods_of(host_data)
    if len(pods) != 1 or pods[0].listed:
        raise RecipeError(f"the host lists pods ({', '.join(p.name for p in pods)}): resolve one pod at a time")
    return pods[0]


def catalog_variant(catalog: Mapping[str, Any], name: Any) -> Mapping[str, Any]:
    """The catalog's entry for variant `name` (its `name` key is the variant's name); RecipeError naming
    the known variants when there is none."""
    if name not in catalog["variants"]:
        raise RecipeError(f"unknown variant {name!r} ({closest_variants(name)})")
    return catalog["variants"][name]


def check_source_refs(source_refs: Any, catalog_sources: Mapping[str, Any]) -> None:
    """Check the host's `source_refs` knob (None: none) against the catalog's sources: a mapping of
    catalog source -> non-empty branch, tag or commit. Returns nothing; RecipeError on the first bad entry."""
    source_refs = source_refs or {}
    if not isinstance(source_refs, Mapping):
        raise RecipeError(f"source_refs must be a mapping, got {type(source_refs).__name__}")
    for source, ref in source_refs.items():
        if source not in catalog_sources:
            raise RecipeError(f"unknown source_refs key {source!r}; known: {', '.join(sorted(catalog_sources))}")
        if not isinstance(ref, str) or not ref.strip():
            raise RecipeError(f"source_refs[{source!r}] must be a branch, tag or commit, got {ref!r}")


def rig_paths(host_data: Mapping[str, Any], pod: Pod) -> RigPaths:
    """Where `pod` lives on the rig, from the install_root and model_dir knobs; RecipeError when either
    is not a plain absolute path."""
    install_root = str(_require(host_data, "install_root")).rstrip("/") or "/"
    model_dir = str(knob(host_data, "model_dir")).rstrip("/") or "/"  # unset: <install_root>/models
    for key, value in (("install_root", install_root), ("model_dir", model_dir)):
        # Rendered unquoted into the systemd unit's command lines: keep to a plain character set.
        if not _SAFE_PATH.match(value) or ".." in value.split("/"):
            raise RecipeError(f"{key} must be an absolute path of letters, digits and ._+-/, got {value!r}")
    layout = RigLayout(install_root)
    variant_dir = layout.variant_dir(pod.name)
    return RigPaths(
        install_root=layout.install_root,
        model_dir=model_dir,
        sources_dir=layout.sources_dir,
        variant_dir=variant_dir,
        compose_file=posixpath.join(variant_dir, "compose.yaml"),
        env_file=posixpath.join(variant_dir, ".env"),
        secrets_dir=layout.pod_secrets_dir(pod.name),
        state_dir=layout.state_dir,
        record_dir=layout.record_dir(pod.name, pod.listed),
        cache_dir=layout.cache_dir(pod.name),
        unit_name=pod.unit,
        unit_file=posixpath.join(SYSTEMD_UNIT_DIR, pod.unit),
    )


def serving_bind_address(host_data: Mapping[str, Any]) -> str:
    """The serving_bind_address knob, checked to be an IP address (RecipeError otherwise)."""
    bind_address = str(_require(host_data, "serving_bind_address"))
    try:
        ipaddress.ip_address(bind_address)
    except ValueError:
        raise RecipeError(f"serving_bind_address must be an IP address, got {bind_address!r}") from None
    return bind_address


def variant_models(
    catalog: Mapping[str, Any], variant: Mapping[str, Any], model_dir: str, lock: Lock | None
) -> list[ModelSpec]:
    """The variant's models under `model_dir`: the main one first, then its draft when it has one."""
    model_root = variant.get("model_root", MODEL_ROOT)
    models = [_model(catalog, variant["model"], "main", model_dir, lock, model_root)]
    if variant.get("draft") is not None:
        models.append(_model(catalog, variant["draft"], "draft", model_dir, lock, model_root))
    return models


def read_upstream(
    catalog: Mapping[str, Any],
    variant: Mapping[str, Any],
    host_data: Mapping[str, Any],
    sources_dir: str,
    lock: Lock | None,
    reader: UpstreamReader,
) -> tuple[SourceSpec, UpstreamFile]:
    """The base of the recipe: returns the variant's upstream recipe repository (as a source, locked
    like one) and upstream's compose file read from it at the locked commit (else at the ref's)."""
    up = variant["upstream"]
    source = _source(catalog, up["source"], host_data, sources_dir, (), lock)
    commit = _upstream_commit(source, reader)
    try:
        text = reader.read(source.name, source.git_url, commit, up["path"])
    except UpstreamError as exc:
        raise RecipeError(f"variant {variant['name']!r}: {exc}") from None
    # From a local working tree ($RIGUP_UPSTREAM_TREES) the text is the tree's, not the commit's: say so.
    local = str(reader.trees[source.name]) if isinstance(reader, WorkingTrees) else None
    return source, UpstreamFile(source.name, source.git_url, commit, up["path"], text, local)


def planned_interconnect(mode: Any, detected: Interconnect | None) -> Interconnect | None:
    """What the NCCL settings are planned for: the gpu_interconnect knob `mode` applied to what was
    `detected` (rigup.desired.interconnect.effective); RecipeError on an unknown mode."""
    try:
        return effective(mode, detected)
    except ValueError as exc:
        raise RecipeError(str(exc)) from None


def cluster_member(host_data: Mapping[str, Any], member: Mapping[str, Any]) -> ClusterMember:
    """The member's share of its cluster for the `cluster` transform (rigup.desired.cluster.ClusterMember).
    The `cluster` knob's `net` (how the member reaches the others) is read on the host by the deploy;
    without it (a preview) the compose names it by variables."""
    script = RigLayout(str(knob(host_data, "install_root"))).cluster_member_script
    net = member.get("net")
    return ClusterMember(cluster_of(member), int(member["rank"]),
                         ClusterNet(**net) if net else ClusterNet.unread(), RayPorts.from_knobs(host_data), script)


def transform_context(
    *,
    catalog: Mapping[str, Any],
    variant: Mapping[str, Any],
    pod: Pod,
    image: ImageSpec,
    bind_address: str,
    overrides: Mapping[str, Any],
    override_values: Mapping[str, Any],
    models: Sequence[ModelSpec],
    paths: RigPaths,
    base: UpstreamFile,
    reader: UpstreamReader,
    planned: Interconnect | None,
) -> Context:
    """What the transforms are told (rigup.desired.transforms.Context): takes the stages' results so
    far and returns the context, whose used_sources, host_dirs, interconnect_note and stages the
    transforms fill in."""
    name = variant["name"]
    checkouts = {s: SourceCheckout(s, posixpath.join(paths.sources_dir, s)) for s in catalog["sources"]}
    mount_fixes = variant.get("mount_fixes") or {}
    return Context(
        variant=name,
        name=pod.name,
        gpu_ids=pod.gpus,
        image_ref=image.ref,
        image_why=_image_why(image, pinned_by_catalog=bool(catalog["images"][image.key].get("digest"))),
        bind_address=bind_address,
        host_port=override_values["port"],
        container_port_default=CONTAINER_PORT,
        model_mounts=[(m.path, m.container_path) for m in models],
        cache_dir=paths.cache_dir,
        secrets_dir=paths.secrets_dir,
        image_repository=image.repository,
        upstream_source=checkouts[base.source],
        path_sources={prefix: checkouts[s] for prefix, s in (variant.get("source_paths") or {}).items()},
        mount_fixes={target: {**fix, "checkout": checkouts[fix["source"]]} for target, fix in mount_fixes.items()},
        exists=lambda path: reader.kind(base.source, base.url, base.commit, path),
        overrides={k: override_values[k] for k in OVERRIDE_FLAGS if k in overrides},
        gpu_count=lambda edit: _int_flag(edit, "--tensor-parallel-size", 1) or 1,
        nccl=lambda tp: nccl_settings(planned, tp),
        nvlink=None if planned is None else planned.nvlink,
        labels={"rigup.variant": name, "rigup.image": image.ref, **({"rigup.pod": pod.name} if pod.listed else {})},
        model_root=variant.get("model_root", MODEL_ROOT),
        data_dirs=variant.get("data_dirs") or {},
        read=lambda path: reader.read(base.source, base.url, base.commit, path),
    )


def _image_why(image: ImageSpec, pinned_by_catalog: bool) -> str:
    """Where the image's pin comes from, for the image-pin transform's reason."""
    pin = (
        "digest from the catalog (upstream pins it by digest)" if pinned_by_catalog
        else "digest from the lock" if image.digest
        else "tag only (no digest locked)"
    )
    return f"catalog image {image.key} ({image.repository}:{image.tag}), {pin}"


@contextmanager
def _as_recipe_error(variant_name: str) -> Iterator[None]:
    """Re-raise what upstream's file or a transform objects to as a RecipeError naming the variant."""
    try:
        yield
    except (ComposeError, UpstreamError) as exc:
        raise RecipeError(f"variant {variant_name!r}: {exc}") from None


def apply_transforms(base: UpstreamFile, variant: Mapping[str, Any], ctx: Context) -> ComposeEdit:
    """Upstream's compose file `base` (its service the catalog names, else its only one) with every
    transform applied for `ctx`; the edit records each change."""
    with _as_recipe_error(variant["name"]):
        edit = ComposeEdit(base, variant["upstream"].get("service"))
        apply_all(edit, ctx)
    return edit


@dataclass(frozen=True)
class EngineSettings:
    """What vLLM runs with, read from the transformed compose file (and a deploy config's entry stage)."""

    served_model_name: str
    tensor_parallel_size: int
    gpu_count: int  # GPUs the compose reserves
    max_model_len: int
    gpu_memory_utilization: float
    max_num_seqs: int
    max_num_batched_tokens: int | None
    kv_cache_dtype: str | None
    dtype: str
    speculative_config: str | None
    speculative_method: str | None
    language_model_only: bool
    pipeline_parallel_size: int = 1  # > 1: a cluster member's share (the cluster transform)

    @property
    def shards(self) -> int:
        """How many GPUs the model is spread over, across hosts too: what its measured envelope's TP means."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


def engine_settings(
    edit: ComposeEdit,
    variant: Mapping[str, Any],
    stages: list[dict[str, Any]] | None,
    main_model: ModelSpec,
    base: UpstreamFile,
) -> EngineSettings:
    """Read the engine settings off the transformed compose `edit` (`stages`: a deploy config's, from
    the transforms). RecipeError when vLLM would not load `main_model` where the catalog mounts it, or
    the served name, context length, sequence count or memory utilisation is not set."""
    name = variant["name"]
    with _as_recipe_error(name):
        model_arg = _model_argument(edit)
        # vLLM serves a model under its model argument when no --served-model-name is given.
        served = edit.flag_values("--served-model-name") or model_arg
        tp, max_model_len, max_num_seqs, batched, util = _engine_values(edit, stages)
        spec_json, spec_method = _speculative(edit, variant)
    if model_arg != [main_model.container_path]:
        raise RecipeError(f"variant {name!r}: {base.where}: the model argument is {model_arg!r}; the catalog's model "
                          f"{main_model.name} is mounted at {main_model.container_path}")
    if not served:
        raise RecipeError(f"variant {name!r}: {base.where}: no --served-model-name")
    if max_model_len is None or max_num_seqs is None or util != util:
        raise RecipeError(f"variant {name!r}: {base.where}: --max-model-len, --max-num-seqs and "
                          f"--gpu-memory-utilization must be set (with a deploy config: in its stage 0)")
    reservation = edit.get("deploy")["resources"]["reservations"]["devices"][0]
    return EngineSettings(
        served_model_name=served[0],
        tensor_parallel_size=tp,
        gpu_count=len(reservation["device_ids"]) if "device_ids" in reservation else int(reservation["count"]),
        max_model_len=max_model_len,
        gpu_memory_utilization=util,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=batched,
        kv_cache_dtype=(edit.flag_values("--kv-cache-dtype") or [None])[0],
        dtype=(edit.flag_values("--dtype") or ["auto"])[0],
        speculative_config=spec_json,
        speculative_method=spec_method,
        language_model_only="--language-model-only" in edit.command(),
        pipeline_parallel_size=_int_flag(edit, "--pipeline-parallel-size", 1) or 1,
    )


def used_sources(
    catalog: Mapping[str, Any],
    used: Mapping[str, set[str]],
    host_data: Mapping[str, Any],
    sources_dir: str,
    lock: Lock | None,
) -> tuple[SourceSpec, ...]:
    """The git checkouts the rig needs: the catalog sources the transforms' mounts `used` (source ->
    paths in it), in catalog order, each requiring its used paths (sorted)."""
    return tuple(
        _source(catalog, s, host_data, sources_dir, tuple(sorted(used[s])), lock)
        for s in catalog["sources"] if s in used
    )


def mounts_of(
    volumes: Sequence[Mapping[str, Any]],
    models: Sequence[ModelSpec],
    sources: Sequence[SourceSpec],
    data_dirs: Mapping[str, str],
) -> tuple[Mount, ...]:
    """The transformed compose file's `volumes` as mounts, each with what it mounts: a model (by its
    container path), a cache or data directory (by target), a source checkout (by a rig path inside
    it), else a host path. The pod's secrets directory, bound at SECRETS_TARGET, is not one of them."""
    model_paths = {m.container_path: m for m in models}
    mounts: list[Mount] = []
    for vol in volumes:
        if vol["target"] == SECRETS_TARGET:  # rigup's own bind of the pod's secrets directory (paths.secrets_dir)
            continue
        if vol["target"] in model_paths:
            kind, origin = "model", f"model:{model_paths[vol['target']].name}"
        elif vol["target"] in CACHE_TARGETS or vol["target"] in data_dirs:
            kind, origin = "cache", "cache"
        else:
            source = vol["source"]
            owner = next((s for s in sources if source == s.path or source.startswith(s.path + "/")), None)
            kind, origin = "source", f"git:{owner.name}" if owner else "host"
        mounts.append(Mount(vol["source"], vol["target"], bool(vol["read_only"]), kind, origin))
    return tuple(mounts)


def check_model_file_mounts(
    mounts: Sequence[Mount], models: Sequence[ModelSpec], lock: Lock | None, where: str
) -> None:
    """A bind over a file inside the read-only model mount needs that file to exist there (the
    mountpoint cannot be created on a read-only bind): when the lock lists the model's files, each
    such target must be one of them. Returns nothing; RecipeError (prefixed by `where`) otherwise."""
    for mount in mounts:
        for m in models:
            if mount.target.startswith(m.container_path + "/"):
                rel = mount.target[len(m.container_path) + 1:]
                pin = getattr(lock, "models", {}).get(m.lock_name) if lock is not None else None
                files = pin.files if pin is not None else ()
                if files and rel not in {f.path for f in files}:
                    raise RecipeError(
                        f"{where}: upstream mounts {mount.target}, but {m.repo_id} at "
                        f"{m.revision} has no {rel}, and the verified model directory is mounted read-only"
                    )


def envelope_is_documented(overrides: Mapping[str, Any], engine: EngineSettings, variant: Mapping[str, Any]) -> bool:
    """Whether the engine runs at the envelope the catalog measured: no override but `port`, and the
    TP, context, utilisation, sequences, batched tokens and language-model-only of the catalog entry."""
    return (
        all(k == "port" for k in overrides)
        and (engine.shards, engine.max_model_len, engine.gpu_memory_utilization, engine.max_num_seqs,
             engine.max_num_batched_tokens, engine.language_model_only)
        == (variant["tensor_parallel_size"], variant["max_model_len"], float(variant["gpu_memory_utilization"]),
            variant["max_num_seqs"], variant["max_num_batched_tokens"], bool(variant["language_model_only"]))
    )


def upstream_status(source: Mapping[str, Any], path: str) -> str:
    """"current" when upstream's newest lineup still carries the compose file at `path`, else "archived".

    `source` is the catalog entry of the recipe repository it is read from. The newest lineup is the
    one whose catalog ref follows a branch (`rigup lock --upgrade` moves it); a source the catalog pins
    to a full commit is a snapshot kept for recipes upstream later moved or froze, and upstream files
    a recipe it retired under `_archive/`."""
    if _is_full_sha(str(source["ref"])) or "/_archive/" in path:
        return "archived"
    return "current"


def assemble_recipe(
    *,
    catalog: Mapping[str, Any],
    variant: Mapping[str, Any],
    pod: Pod,
    image: ImageSpec,
    bind_address: str,
    overrides: Mapping[str, Any],
    paths: RigPaths,
    models: Sequence[ModelSpec],
    sources: tuple[SourceSpec, ...],
    mounts: tuple[Mount, ...],
    upstream_source: SourceSpec,
    base: UpstreamFile,
    edit: ComposeEdit,
    engine: EngineSettings,
    ctx: Context,
    planned: Interconnect | None,
) -> Recipe:
    """The Recipe from every stage's result; what is left to read off the transformed compose `edit`
    (entrypoint, environment, published port, the rendered text) is read here."""
    name = variant["name"]
    entrypoint = tuple(upstream_entrypoint(edit.get("entrypoint")) or ())
    script = "\n".join(entrypoint)
    rendered_text = dump(edit.doc, _header(name, variant, base, ctx.interconnect_note))
    ports = edit.get("ports")
    # published, or (a cluster member on the host's network) the port vLLM listens on itself
    host_port = int(str(ports[0]).rsplit(":", 2)[-2]) if ports else int((edit.flag_values("--port") or ["0"])[0])
    disk = image.approx_size_gb + sum(m.approx_size_gb for m in models) + sum(s.approx_size_gb for s in sources)
    return Recipe(
        variant=name,
        description=variant["description"],
        family=catalog["models"][variant["model"]]["family"],
        pod=pod.name,
        pod_listed=pod.listed,
        gpu_ids=pod.gpus,
        image=image,
        bind_address=bind_address,
        host_port=host_port,
        container_port=CONTAINER_PORT,
        project_name=f"rigup-{pod.name}",
        service_name=edit.service,
        container_name=str(edit.get("container_name")),
        served_model_name=engine.served_model_name,
        tensor_parallel_size=engine.tensor_parallel_size,
        gpu_count=engine.gpu_count,
        valid_tensor_parallel_sizes=tuple(variant["tensor_parallel_sizes"]),
        min_compute_capability=_capability(variant["min_compute_capability"]),
        min_gpu_memory_gb=float(variant["min_gpu_memory_gb"]),
        vram_per_gpu_gb=None if variant.get("vram_per_gpu_gb") is None else float(variant["vram_per_gpu_gb"]),
        measured_on_gpu_mib=int(variant["measured_on_gpu_mib"]),
        envelope_is_documented=envelope_is_documented(overrides, engine, variant),
        alternative_envelopes=tuple(
            Envelope(
                max_model_len=int(e["max_model_len"]),
                gpu_memory_utilization=float(e["gpu_memory_utilization"]),
                vision=bool(e.get("vision", True)),
                note=str(e.get("note", "")),
            )
            for e in variant.get("alternative_envelopes") or ()
        ),
        max_model_len=engine.max_model_len,
        gpu_memory_utilization=engine.gpu_memory_utilization,
        max_num_seqs=engine.max_num_seqs,
        max_num_batched_tokens=engine.max_num_batched_tokens,
        kv_cache_dtype=engine.kv_cache_dtype,
        dtype=engine.dtype,
        speculative_config=engine.speculative_config,
        speculative_method=engine.speculative_method,
        language_model_only=engine.language_model_only,
        genesis="vllm._genesis.patches.apply_all" in script,
        needs_network_at_start=bool(re.search(r"\bpip3? install\b|-m pip install", script)),
        entrypoint=entrypoint,
        vllm_args=tuple(edit.command()),
        environment=tuple(EnvVar(k, val) for k, val in edit.env().items() if val is not None),
        mounts=mounts,
        shm_size=str(edit.get("shm_size") or ""),
        ipc=str(edit.get("ipc") or ""),
        sources=sources,
        models=tuple(models),
        disk_needed_gb=math.ceil(disk * 10) / 10,
        paths=paths,
        host_dirs=tuple(ctx.host_dirs),
        overrides=dict(overrides),
        interconnect=planned if engine.tensor_parallel_size > 1 else None,
        interconnect_note=ctx.interconnect_note,
        upstream=base,
        upstream_source=upstream_source,
        upstream_status=upstream_status(catalog["sources"][upstream_source.name], base.path),
        compose_text=rendered_text,
        changes=tuple(edit.changes),
        chat_request=copy.deepcopy(dict(variant.get("chat_request") or {})),  # the catalog is shared: a copy
        gate_probes=tuple(variant["gate_probes"]) if variant.get("gate_probes") is not None else None,
        cluster=ctx.cluster,
        pipeline_parallel_size=engine.pipeline_parallel_size,
    )


def _public_url(url: str) -> str:
    """The URL without user:password (a private mirror's credentials must not land in a 0644 file)."""
    parts = urllib.parse.urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    return urllib.parse.urlunsplit(parts._replace(netloc=parts.hostname + (f":{parts.port}" if parts.port else "")))


def _header(name: str, v: Mapping[str, Any], base: UpstreamFile, note: str | None) -> str:
    lines = [
        f"Rendered by rigup for variant {name}: {v['description']}",
        f"Base: {base.path} at {_public_url(base.url)} {base.commit}"
        + (f" (read from the local tree {base.local_tree}, not from that commit)" if base.local_tree else ""),
        "plus rigup's transforms (`rigup render " + name + " --explain` lists every difference).",
        f"Do not edit: the next converge overwrites it. Run through rigup-{name}.service.",
    ]
    if note:
        lines.append(f"GPU interconnect: {note}")
    return "\n".join(lines)


__all__ = [
    "CatalogError",
    "EnvVar",
    "Envelope",
    "ImageSpec",
    "Lock",
    "ModelSpec",
    "Mount",
    "OVERRIDE_KEYS",
    "Recipe",
    "RecipeError",
    "RigPaths",
    "SourceSpec",
    "check_overrides",
    "nearest_layout",
    "resolve",
]
