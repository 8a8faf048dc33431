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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from rigup.desired.catalog import GPU_MEMORY_UTILIZATION_RANGE, CatalogError, load_catalog
from rigup.desired.compose_doc import Change, ComposeEdit, ComposeError, UpstreamFile, dump
from rigup.desired.interconnect import Interconnect, effective, nccl_settings
from rigup.desired.knobs import REGISTRY, RIG_PATH, _is_int, knob
from rigup.desired.pods import Pod, PodError, host_pods, pod_data
from rigup.desired.transforms import (
    CACHE_TARGETS,
    MODEL_ROOT,
    OVERRIDE_FLAGS,
    Context,
    SourceCheckout,
    apply_all,
    entry_stage,
)
from rigup.desired.upstream import UpstreamError, UpstreamReader, WorkingTrees, default_reader

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
class EnvRef:
    """A container variable whose value compose takes from the variant's .env (secrets)."""

    name: str  # variable inside the container
    env_file_key: str  # key in .env; compose renders ${KEY:-} so an absent secret is empty


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
    env_file: str  # {variant_dir}/.env
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
    tensor_parallel_size: int
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
    entrypoint: tuple[str, ...]
    vllm_args: tuple[str, ...]  # the compose `command` (arguments to `vllm serve`)
    environment: tuple[EnvVar, ...]
    environment_refs: tuple[EnvRef, ...]
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

    @property
    def model(self) -> ModelSpec:
        """The main model (role "main")."""
        return next(m for m in self.models if m.role == "main")

    @property
    def draft(self) -> ModelSpec | None:
        return next((m for m in self.models if m.role == "draft"), None)

    @property
    def base_url(self) -> str:
        """The API's base URL as seen from the rig itself (wildcard binds are reached on loopback)."""
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
    if variant not in catalog["variants"]:
        raise RecipeError(f"unknown variant {variant!r}; known: {', '.join(sorted(catalog['variants']))}")
    v = catalog["variants"][variant]
    return _apply_overrides(overrides, v, catalog["models"][v["model"]])


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
        if not _is_int(value) or not 1024 <= value <= limit:
            raise RecipeError(f"{where} must be an integer from 1024 to {limit} (model limit), got {value!r}")
        return value
    if key == "gpu_memory_utilization":
        low, high = GPU_MEMORY_UTILIZATION_RANGE
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= float(value) <= high:
            raise RecipeError(f"{where} must be a number from {low} to {high}, got {value!r}")
        return float(value)
    if key == "port":
        if not _is_int(value) or not 1 <= value <= 65535:
            raise RecipeError(f"{where} must be an integer port from 1 to 65535, got {value!r}")
        return value
    if key == "max_num_seqs":
        if not _is_int(value) or not 1 <= value <= 256:
            raise RecipeError(f"{where} must be an integer from 1 to 256, got {value!r}")
        return value
    if key == "max_num_batched_tokens":
        if not _is_int(value) or not 512 <= value <= 262144:
            raise RecipeError(f"{where} must be an integer from 512 to 262144, got {value!r}")
        return value
    if key == "tensor_parallel_size":
        sizes = tuple(variant["tensor_parallel_sizes"])
        if not _is_int(value) or value not in sizes:
            hint = ""
            if _is_int(value) and value > 0:
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
    if not edit.get("entrypoint") and cmd[:2] == ["vllm", "serve"] and len(cmd) > 2 and not cmd[2].startswith("-"):
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
    """
    if pod is None:
        pods = pods_of(host_data)
        if len(pods) != 1 or pods[0].listed:
            raise RecipeError(f"the host lists pods ({', '.join(p.name for p in pods)}): resolve one pod at a time")
        pod = pods[0]
    host_data = pod_data(host_data, pod)
    catalog = load_catalog()
    name = _require(host_data, "variant")
    if name not in catalog["variants"]:
        raise RecipeError(f"unknown variant {name!r}; known: {', '.join(sorted(catalog['variants']))}")
    v = catalog["variants"][name]
    main_spec = catalog["models"][v["model"]]
    reader = upstream if upstream is not None else default_reader()

    source_refs = knob(host_data, "source_refs") or {}
    if not isinstance(source_refs, Mapping):
        raise RecipeError(f"source_refs must be a mapping, got {type(source_refs).__name__}")
    for source, ref in source_refs.items():
        if source not in catalog["sources"]:
            raise RecipeError(f"unknown source_refs key {source!r}; known: {', '.join(sorted(catalog['sources']))}")
        if not isinstance(ref, str) or not ref.strip():
            raise RecipeError(f"source_refs[{source!r}] must be a branch, tag or commit, got {ref!r}")

    overrides = knob(host_data, "variant_overrides") or {}
    knobs = _apply_overrides(overrides, v, main_spec)

    install_root = str(_require(host_data, "install_root")).rstrip("/") or "/"
    model_dir = str(_require(host_data, "model_dir")).rstrip("/") or "/"
    for key, value in (("install_root", install_root), ("model_dir", model_dir)):
        # Rendered unquoted into the systemd unit's command lines: keep to a plain character set.
        if not _SAFE_PATH.match(value) or ".." in value.split("/"):
            raise RecipeError(f"{key} must be an absolute path of letters, digits and ._+-/, got {value!r}")
    registry = _registry_prefix(knob(host_data, "container_registry"))
    bind_address = str(_require(host_data, "serving_bind_address"))
    try:
        ipaddress.ip_address(bind_address)
    except ValueError:
        raise RecipeError(f"serving_bind_address must be an IP address, got {bind_address!r}") from None

    variant_dir = posixpath.join(install_root, "variants", pod.name)
    unit_name = pod.unit
    paths = RigPaths(
        install_root=install_root,
        model_dir=model_dir,
        sources_dir=posixpath.join(install_root, "sources"),
        variant_dir=variant_dir,
        compose_file=posixpath.join(variant_dir, "compose.yaml"),
        env_file=posixpath.join(variant_dir, ".env"),
        state_dir=posixpath.join(install_root, "state"),
        record_dir=posixpath.join(install_root, "state", "pods", pod.name) if pod.listed else posixpath.join(install_root, "state"),
        cache_dir=posixpath.join(install_root, "cache", pod.name),
        unit_name=unit_name,
        unit_file=posixpath.join(SYSTEMD_UNIT_DIR, unit_name),
    )

    model_root = v.get("model_root", MODEL_ROOT)
    models = [_model(catalog, v["model"], "main", model_dir, lock, model_root)]
    if v.get("draft") is not None:
        models.append(_model(catalog, v["draft"], "draft", model_dir, lock, model_root))

    # The base: upstream's compose file at the locked commit.
    up = v["upstream"]
    up_source = _source(catalog, up["source"], host_data, paths.sources_dir, (), lock)
    commit = _upstream_commit(up_source, reader)
    try:
        text = reader.read(up_source.name, up_source.git_url, commit, up["path"])
    except UpstreamError as exc:
        raise RecipeError(f"variant {name!r}: {exc}") from None
    # From a local working tree ($RIGUP_UPSTREAM_TREES) the text is the tree's, not the commit's: say so.
    local = str(reader.trees[up_source.name]) if isinstance(reader, WorkingTrees) else None
    base = UpstreamFile(up_source.name, up_source.git_url, commit, up["path"], text, local)

    image = _image(catalog, v["image"], registry, lock)
    try:
        planned = effective(knob(host_data, "gpu_interconnect"), interconnect)
    except ValueError as exc:
        raise RecipeError(str(exc)) from None
    checkouts = {s: SourceCheckout(s, posixpath.join(paths.sources_dir, s)) for s in catalog["sources"]}
    ctx = Context(
        variant=name,
        name=pod.name,
        gpu_ids=pod.gpus,
        image_ref=image.ref,
        image_why=f"catalog image {image.key} ({image.repository}:{image.tag})"
        + (", digest from the catalog (upstream pins it by digest)" if catalog["images"][v["image"]].get("digest")
           else ", digest from the lock" if image.digest else ", tag only (no digest locked)"),
        bind_address=bind_address,
        host_port=overrides.get("port", v.get("port")) if isinstance(overrides, Mapping) else v.get("port"),
        container_port_default=CONTAINER_PORT,
        model_mounts=[(m.path, m.container_path) for m in models],
        cache_dir=paths.cache_dir,
        upstream_source=checkouts[up_source.name],
        path_sources={prefix: checkouts[s] for prefix, s in (v.get("source_paths") or {}).items()},
        mount_fixes={t: {**f, "checkout": checkouts[f["source"]]} for t, f in (v.get("mount_fixes") or {}).items()},
        exists=lambda path: reader.kind(up_source.name, up_source.git_url, commit, path),
        overrides={k: knobs[k] for k in OVERRIDE_FLAGS if k in (overrides or {})},
        gpu_count=lambda edit: _int_flag(edit, "--tensor-parallel-size", 1) or 1,
        nccl=lambda tp: nccl_settings(planned, tp),
        nvlink=None if planned is None else planned.nvlink,
        labels={"rigup.variant": name, "rigup.image": image.ref, **({"rigup.pod": pod.name} if pod.listed else {})},
        model_root=model_root,
        data_dirs=v.get("data_dirs") or {},
        read=lambda path: reader.read(up_source.name, up_source.git_url, commit, path),
    )
    try:
        edit = ComposeEdit(base, up.get("service"))
        apply_all(edit, ctx)
        model_arg = _model_argument(edit)
        # vLLM serves a model under its model argument when no --served-model-name is given.
        served = edit.flag_values("--served-model-name") or model_arg
        tp, max_model_len, max_num_seqs, batched, util = _engine_values(edit, ctx.stages)
        spec_json, spec_method = _speculative(edit, v)
    except (ComposeError, UpstreamError) as exc:
        raise RecipeError(f"variant {name!r}: {exc}") from None
    if model_arg != [models[0].container_path]:
        raise RecipeError(f"variant {name!r}: {base.where}: the model argument is {model_arg!r}; the catalog's model "
                          f"{models[0].name} is mounted at {models[0].container_path}")
    if not served:
        raise RecipeError(f"variant {name!r}: {base.where}: no --served-model-name")
    if max_model_len is None or max_num_seqs is None or util != util:
        raise RecipeError(f"variant {name!r}: {base.where}: --max-model-len, --max-num-seqs and "
                          f"--gpu-memory-utilization must be set (with a deploy config: in its stage 0)")
    reservation = edit.get("deploy")["resources"]["reservations"]["devices"][0]
    gpu_count = len(reservation["device_ids"]) if "device_ids" in reservation else int(reservation["count"])
    entrypoint = tuple(str(t) for t in (edit.get("entrypoint") or ()))
    script = "\n".join(entrypoint)
    env_map = edit.env()

    used = ctx.used_sources
    sources = tuple(
        _source(catalog, s, host_data, paths.sources_dir, tuple(sorted(used[s])), lock)
        for s in catalog["sources"] if s in used
    )
    mount_list: list[Mount] = []
    model_paths = {m.container_path: m for m in models}
    for vol in edit.volumes():
        if vol["target"] in model_paths:
            kind, origin = "model", f"model:{model_paths[vol['target']].name}"
        elif vol["target"] in CACHE_TARGETS or vol["target"] in ctx.data_dirs:
            kind, origin = "cache", "cache"
        else:
            owner = next((s for s in sources if vol["source"] == s.path or vol["source"].startswith(s.path + "/")), None)
            kind, origin = "source", f"git:{owner.name}" if owner else "host"
        mount_list.append(Mount(vol["source"], vol["target"], bool(vol["read_only"]), kind, origin))
        for m in models:
            if vol["target"].startswith(m.container_path + "/"):
                # A bind over a file inside the read-only model mount needs that file to exist there
                # (the mountpoint cannot be created on a read-only bind): the lock lists the model's files.
                rel = vol["target"][len(m.container_path) + 1:]
                pin = getattr(lock, "models", {}).get(m.lock_name) if lock is not None else None
                files = pin.files if pin is not None else ()
                if files and rel not in {f.path for f in files}:
                    raise RecipeError(
                        f"variant {name!r}: {base.where}: upstream mounts {vol['target']}, but {m.repo_id} at "
                        f"{m.revision} has no {rel}, and the verified model directory is mounted read-only"
                    )
    documented = (
        all(k == "port" for k in (overrides or {}))
        and (tp, max_model_len, util, max_num_seqs, batched, "--language-model-only" in edit.command())
        == (v["tensor_parallel_size"], v["max_model_len"], float(v["gpu_memory_utilization"]), v["max_num_seqs"],
            v["max_num_batched_tokens"], bool(v["language_model_only"]))
    )
    rendered_text = dump(edit.doc, _header(name, v, base, ctx.interconnect_note))
    host_port = int(str(edit.get("ports")[0]).rsplit(":", 2)[-2])
    disk = image.approx_size_gb + sum(m.approx_size_gb for m in models) + sum(s.approx_size_gb for s in sources)

    return Recipe(
        variant=name,
        description=v["description"],
        family=main_spec["family"],
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
        served_model_name=served[0],
        tensor_parallel_size=tp,
        gpu_count=gpu_count,
        valid_tensor_parallel_sizes=tuple(v["tensor_parallel_sizes"]),
        min_compute_capability=_capability(v["min_compute_capability"]),
        min_gpu_memory_gb=float(v["min_gpu_memory_gb"]),
        vram_per_gpu_gb=None if v.get("vram_per_gpu_gb") is None else float(v["vram_per_gpu_gb"]),
        measured_on_gpu_mib=int(v["measured_on_gpu_mib"]),
        envelope_is_documented=documented,
        alternative_envelopes=tuple(
            Envelope(
                max_model_len=int(e["max_model_len"]),
                gpu_memory_utilization=float(e["gpu_memory_utilization"]),
                vision=bool(e.get("vision", True)),
                note=str(e.get("note", "")),
            )
            for e in v.get("alternative_envelopes") or ()
        ),
        max_model_len=max_model_len,
        gpu_memory_utilization=util,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=batched,
        kv_cache_dtype=(edit.flag_values("--kv-cache-dtype") or [None])[0],
        dtype=(edit.flag_values("--dtype") or ["auto"])[0],
        speculative_config=spec_json,
        speculative_method=spec_method,
        language_model_only="--language-model-only" in edit.command(),
        genesis="vllm._genesis.patches.apply_all" in script,
        needs_network_at_start=bool(re.search(r"\bpip3? install\b|-m pip install", script)),
        entrypoint=entrypoint,
        vllm_args=tuple(edit.command()),
        environment=tuple(EnvVar(k, val) for k, val in env_map.items() if val is not None),
        environment_refs=(EnvRef("HUGGING_FACE_HUB_TOKEN", HF_TOKEN_VAR), EnvRef("VLLM_API_KEY", API_KEY_VAR)),
        mounts=tuple(mount_list),
        shm_size=str(edit.get("shm_size") or ""),
        ipc=str(edit.get("ipc") or ""),
        sources=sources,
        models=tuple(models),
        disk_needed_gb=math.ceil(disk * 10) / 10,
        paths=paths,
        host_dirs=tuple(ctx.host_dirs),
        overrides=dict(overrides or {}),
        interconnect=planned if tp > 1 else None,
        interconnect_note=ctx.interconnect_note,
        upstream=base,
        upstream_source=up_source,
        upstream_status="archived" if (up_source.name != "club3090" or "/_archive/" in up["path"]) else "current",
        compose_text=rendered_text,
        changes=tuple(edit.changes),
        chat_request=copy.deepcopy(dict(v.get("chat_request") or {})),  # the catalog is shared: a copy
    )


HF_TOKEN_VAR = "HF_TOKEN"
API_KEY_VAR = "VLLM_API_KEY"


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
    "EnvRef",
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
