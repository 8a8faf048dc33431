"""rigup's transforms of an upstream compose file: each one named, documented, and recorded.

`apply_all(edit, ctx)` runs them in order on a ComposeEdit (rigup/desired/compose_doc.py). Every
difference between the file a rig runs and upstream's file comes from one of these; `rigup render
VARIANT --explain` and `rigup catalog audit` list them, and a difference none of them made is reported
as unexplained. An upstream construct none of them understands stops the render (ComposeError naming
the file, the key and the commit): nothing is dropped silently.
"""

from __future__ import annotations

import json
import posixpath
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from rigup.desired.cluster import ClusterMember
from rigup.desired.cluster_token import RAY_TOKEN_KEY
from rigup.desired.compose_doc import ComposeEdit, ComposeError, interpolate, walk_strings
from rigup.desired.interconnect import NcclSettings

# name -> what it does (docs/variants.md's transform table and `--explain` use these words)
TRANSFORMS: dict[str, str] = {
    "image-pin": "the image is the catalog's, from the configured registry, pinned by the lock's digest "
                 "(or by the catalog's, for an image upstream pins by digest)",
    "command-list": "a one-string command is written as the list of words Compose splits it into",
    "defaults": "upstream's ${VAR:-default} take their default (a secret's reference is left to the secrets transform, "
                "which removes it)",
    "project": "the compose project is rigup-<pod> (a pod is named after its variant unless the host lists pods)",
    "container-name": "the container is rigup-<pod>: unique per pod, so a switch never meets a leftover",
    "restart": "systemd restarts the service; the container never restarts behind its back",
    "publish": "the port is published on the serving bind address and the variant's host port",
    "container-port": "a server upstream runs on another container port listens on rigup's 8000 (its --port "
                      "and the published container port move together)",
    "models-read-only": "only the verified model directories are mounted, read-only, where upstream's command expects them",
    "caches": "torch.compile and Triton caches live under the install root, per variant",
    "data-dirs": "a writable directory upstream keeps in its checkout (catalog data_dirs) is an empty one under "
                 "the install root, per variant: the checkouts stay read-only",
    "host-paths": "upstream's relative and host paths point at rigup's checkouts at the locked commits",
    "catalog-fix": "a mount the catalog redirects, with its reason",
    "strict-binds": "a missing mount source fails the start instead of becoming an empty directory",
    "secrets": "every secret (the pod's API key, the HF token, a cluster's Ray token) reaches the container as a "
               "file of the pod's 0700 secrets directory, bound read-only: never a value in the container's "
               "environment, the compose file or a command line",
    "offline": "rigup verified every model file: the container must not fetch from the hub",
    "overrides": "the host's variant_overrides",
    "gpus": "the container gets exactly its tensor-parallel count of GPUs (with a vLLM-Omni deploy config: its "
            "stages' devices); a listed pod gets its own GPUs by index",
    "interconnect": "NCCL and custom all-reduce follow the GPU interconnect rigup detected",
    "cluster": "beyond upstream (club-3090's docs/PODS.md keeps a pod on one host): a clusters entry's member "
               "runs its share of the variant, tensor parallelism over its own GPUs times pipeline parallelism "
               "across the members, on vLLM's Ray backend as vLLM's examples/online_serving/run_cluster.sh lays it "
               "out (host networking; the head starts Ray and serves, a worker joins the head's Ray); upstream's "
               "entrypoint runs unchanged up to its `exec vllm serve`, which rigup's member script takes over",
    "labels": "labels name the variant and image, for status and cleanup",
    "logging": "Docker's copy of the log is bounded (the journal has the full stream)",
}

# Where upstream's composes mount the model cache (and the model argument points); a variant whose
# compose mounts it elsewhere says so in the catalog (`model_root`).
MODEL_ROOT = "/root/.cache/huggingface"
CACHE_TARGETS = {"/root/.cache/vllm/torch_compile_cache": "torch_compile", "/root/.triton/cache": "triton"}
SECRET_VARIABLES = frozenset({"HF_TOKEN", "VLLM_API_KEY", RAY_TOKEN_KEY})
# Where a pod's secrets directory (RigPaths.secrets_dir: one 0600 root file per secret, named after it) is bound
# read-only in its container. Docker hands a container's environment to containerd, which keeps it in the runtime
# bundle's config.json and its metadata database, 0644 under root's 0711 directories (issue 42): so no secret is a
# value of the container's environment. Each consumer is pointed at its file instead:
# - huggingface_hub reads its token from the file HF_TOKEN_PATH names when HF_TOKEN and HUGGING_FACE_HUB_TOKEN are
#   unset (src/huggingface_hub/constants.py@03333b689b5a, `HF_TOKEN_PATH = ... os.getenv("HF_TOKEN_PATH", ...)`;
#   utils/_auth.py `_get_token_from_file`: `_clean_token(Path(constants.HF_TOKEN_PATH).read_text())`, a missing
#   file is no token);
# - Ray's AuthenticationTokenLoader reads RAY_AUTH_TOKEN, then the file RAY_AUTH_TOKEN_PATH names
#   (rigup.desired.cluster_token cites it);
# - vLLM reads its key only from VLLM_API_KEY or --api-key (rigup.desired.pod_keys cites it; argv is world-readable):
#   the entrypoint wrapper below exports VLLM_API_KEY from its file and execs upstream's entrypoint, so the value
#   lives only in the processes' own environment (/proc/<pid>/environ, 0400), never in the container's config.
SECRETS_TARGET = "/run/rigup/secrets"
SECRET_PATH_VARIABLES = {"HF_TOKEN": "HF_TOKEN_PATH", RAY_TOKEN_KEY: "RAY_AUTH_TOKEN_PATH"}
_SECRET_REFERENCE = re.compile(r"\$\{?(" + "|".join(sorted(SECRET_VARIABLES)) + r")\b")
# The wrapper: bash's own `read` (no command line carries the key), then upstream's entrypoint and command as they
# were ("$@"). `$$` is compose's escape of `$`. A pod without its key file stops here instead of serving open.
KEY_WRAPPER = (f'IFS= read -r VLLM_API_KEY < {SECRETS_TARGET}/VLLM_API_KEY && export VLLM_API_KEY && exec "$$@"; '
               f'echo "no API key at {SECRETS_TARGET}/VLLM_API_KEY: the pod does not start open" >&2; exit 1')
KEY_WRAPPER_WORDS = ("/bin/bash", "-c", KEY_WRAPPER, "rigup-pod-key")
# The ENTRYPOINT of the images whose composes have none (the wrapper must exec it): vllm/vllm-openai's
# ["vllm", "serve"] (vllm-project/vllm docker/Dockerfile, as the cluster transform and the test bed's
# rigup_testbed/standins/dockerd.image_config take it), vLLM-Omni's [] (vllm-project/vllm-omni
# docker/Dockerfile.cuda@11a683cf: ENTRYPOINT []), LMCache's ["/opt/venv/bin/vllm", "serve"]
# (LMCache/LMCache docker/Dockerfile@ab6cf272). Every image ships /bin/bash (vllm-openai's Ubuntu base; upstream's
# entrypoints run `/bin/bash -c` in it).
IMAGE_ENTRYPOINTS: dict[str, tuple[str, ...]] = {
    "vllm/vllm-openai": ("vllm", "serve"),
    "vllm/vllm-omni": (),
    "lmcache/vllm-openai": ("/opt/venv/bin/vllm", "serve"),
}
VLLM_DEFAULT_PORT = 8000  # what `vllm serve` listens on without --port
MEMBER_SCRIPT_TARGET = "/etc/rigup/cluster-member"  # where a cluster member's container sees rigup's member script

# vLLM-Omni deploy configs (`--deploy-config FILE`): one engine per stage. rigup reads the file from
# upstream's repository (it is bind-mounted unchanged) and takes the engine values from its entry stage
# (stage_id 0, the one that receives requests) and the GPU count from every stage's `devices`.
DEPLOY_CONFIG_FLAG = "--deploy-config"
STAGE_INT_KEYS = ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size")
STAGE_OVERRIDE_KEYS = ("max_model_len", "gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens",
                       "tensor_parallel_size")

# variant_overrides key -> vLLM flag
OVERRIDE_FLAGS = {
    "max_model_len": "--max-model-len",
    "gpu_memory_utilization": "--gpu-memory-utilization",
    "max_num_seqs": "--max-num-seqs",
    "max_num_batched_tokens": "--max-num-batched-tokens",
    "tensor_parallel_size": "--tensor-parallel-size",
}


@dataclass(frozen=True)
class SourceCheckout:
    """A git source as the rig has it: catalog key and rig path; `reader_check` for upstream's own."""

    name: str
    rig_path: str


@dataclass
class Context:
    """What the transforms need from the catalog, the host and the lock."""

    variant: str
    name: str  # the pod's name: compose project and container (the variant's without pods)
    gpu_ids: tuple[int, ...] | None  # the pod's GPUs; None: a count of the first GPUs
    image_ref: str
    image_why: str
    bind_address: str
    host_port: int | None  # None: upstream's published port
    container_port_default: int
    model_mounts: list[tuple[str, str]]  # (rig path, container path) of the main model and the draft
    cache_dir: str
    secrets_dir: str  # RigPaths.secrets_dir: the pod's secret files, bound read-only at SECRETS_TARGET
    image_repository: str  # ImageSpec.repository, e.g. "vllm/vllm-openai": whose ENTRYPOINT the key wrapper execs
    upstream_source: SourceCheckout
    path_sources: Mapping[str, SourceCheckout]  # repository-path prefix or absolute host path -> checkout
    mount_fixes: Mapping[str, Mapping[str, Any]]  # target -> {source checkout, path, why}
    exists: Callable[[str], str | None]  # repository path -> "file" | "dir" | None at the upstream commit
    overrides: Mapping[str, Any]
    gpu_count: Callable[[ComposeEdit], int]
    nccl: Callable[[int], NcclSettings | None]
    labels: Mapping[str, str]
    nvlink: bool | None = None  # what rigup decided for the host (detected or forced); None: not known
    model_root: str = MODEL_ROOT  # the container directory upstream mounts the model cache at
    data_dirs: Mapping[str, str] = field(default_factory=dict)  # container target -> why (catalog data_dirs)
    read: Callable[[str], str] | None = None  # repository path -> its text at the upstream commit
    # filled in by the transforms
    used_sources: dict[str, set[str]] = field(default_factory=dict)  # source -> paths the mounts use
    host_dirs: list[str] = field(default_factory=list)
    interconnect_note: str | None = None
    repo_mounts: dict[str, tuple[str, str]] = field(default_factory=dict)  # target -> (source, path in it)
    stages: list[dict[str, Any]] | None = None  # the deploy config's stages (read_deploy_config)
    cluster: ClusterMember | None = None  # this pod is a cluster member's share (rigup.desired.cluster)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        text = repr(value)
        return text[:-2] if text.endswith(".0") else text
    return str(value)


def apply_all(edit: ComposeEdit, ctx: Context) -> None:
    image_pin(edit, ctx)
    edit.command_as_list("command-list", TRANSFORMS["command-list"])
    defaults(edit)
    edit.set_top("name", f"rigup-{ctx.name}", "project", "one compose project per pod")
    edit.set("container_name", f"rigup-{ctx.name}", "container-name", TRANSFORMS["container-name"])
    edit.set("restart", "no", "restart", TRANSFORMS["restart"])
    publish(edit, ctx)
    mounts(edit, ctx)
    read_deploy_config(edit, ctx)
    offline(edit)
    overrides(edit, ctx)
    if ctx.cluster is not None:
        cluster(edit, ctx, ctx.cluster)
    secrets(edit, ctx)  # after the cluster transform: the wrapper runs first, around the member script
    gpus(edit, ctx)
    interconnect(edit, ctx)
    labels = dict(edit.get("labels") or {})
    labels.update(ctx.labels)
    edit.set("labels", labels, "labels", TRANSFORMS["labels"])
    edit.set("logging", {"driver": "json-file", "options": {"max-size": "50m", "max-file": "3"}}, "logging",
             TRANSFORMS["logging"])


def image_pin(edit: ComposeEdit, ctx: Context) -> None:
    # Runs before `defaults`: upstream's image often names a variable with no default
    # (${VLLM_NIGHTLY_SHA}, set by its engine profile), which the catalog's image replaces.
    if not isinstance(edit.get("image"), str):
        raise ComposeError(f"{edit.where('image')}: no image")
    edit.set("image", ctx.image_ref, "image-pin", ctx.image_why)


def defaults(edit: ComposeEdit) -> None:
    def fn(path: str, text: str) -> tuple[str, list[Any]]:
        def keep(name: str) -> bool:
            if name not in SECRET_VARIABLES:
                return False
            if not path.startswith("environment"):
                # A secret resolved into the command or entrypoint would be visible in ps and docker inspect.
                raise ComposeError(f"{edit.where(path)}: ${{{name}}} outside environment would put a secret on a "
                                   f"command line; rigup passes secrets only as files")
            return True
        return interpolate(text, lambda name: None, keep, edit.where(path))
    edit.interpolate(fn)


def publish(edit: ComposeEdit, ctx: Context) -> None:
    ports = edit.get("ports") or []
    if len(ports) != 1 or not isinstance(ports[0], str):
        raise ComposeError(f"{edit.where('ports')}: rigup publishes exactly one port; upstream has {ports!r}")
    parts = ports[0].rsplit(":", 2)
    container = parts[-1].split("/")[0]
    published = parts[-2] if len(parts) >= 2 else container
    if not container.isdigit() or not published.isdigit():
        raise ComposeError(f"{edit.where('ports')}: {ports[0]!r} is not HOST:CONTAINER after defaults")
    listen = edit.flag_values("--port")
    if listen is not None and (len(listen) != 1 or not listen[0].isdigit()):
        raise ComposeError(f"{edit.where('command --port')}: {listen!r} is not a port number after defaults")
    listens = int(listen[0]) if listen else VLLM_DEFAULT_PORT
    if int(container) != listens:
        raise ComposeError(f"{edit.where('ports')}: container port {container}; the command listens on {listens}")
    moved = ""
    if listens != ctx.container_port_default:
        container_port(edit, ctx, listens)
        moved = f"; container port {listens} -> {ctx.container_port_default} (container-port)"
        container = str(ctx.container_port_default)
    port = ctx.host_port if ctx.host_port is not None else int(published)
    host = f"[{ctx.bind_address}]" if ":" in ctx.bind_address else ctx.bind_address
    edit.set("ports", [f"{host}:{port}:{container}"], "publish",
             f"serving_bind_address {ctx.bind_address}, port {port}{moved}")


def container_port(edit: ComposeEdit, ctx: Context, listens: int) -> None:
    """Move a server upstream runs on another container port to rigup's (the container has its own
    network namespace: only the published mapping sees the number). Only the command's `--port` may
    name it: a number anywhere else in the service (a healthcheck, the entrypoint) could not move with it."""
    number = re.compile(rf"(?<![0-9]){listens}(?![0-9])")
    for key in sorted(edit.svc):
        if key in ("command", "ports"):
            continue
        for path, text in walk_strings(edit.svc[key], key):
            if number.search(text):
                raise ComposeError(f"{edit.where(path)}: names the container port {listens}, which rigup moves to "
                                   f"{ctx.container_port_default}; it cannot move it there too")
    edit.set_flag("--port", [str(ctx.container_port_default)], "container-port",
                  f"upstream's server listened on {listens} inside the container; rigup's listen on "
                  f"{ctx.container_port_default}, published the same way")


def _repo_path(compose_path: str, source: str, where: str) -> str:
    joined = posixpath.normpath(posixpath.join(posixpath.dirname(compose_path), source))
    if joined.startswith("../") or joined == "..":
        raise ComposeError(f"{where}: {source!r} points outside the repository")
    return joined


def mounts(edit: ComposeEdit, ctx: Context) -> None:
    compose_path = edit.origin.path
    # (upstream entry, what it becomes, transform) in upstream's order
    entries: list[tuple[dict[str, Any], list[dict[str, Any]], str]] = []
    reasons: dict[str, str] = {}
    targets = [vol["target"] for vol in edit.volumes()]
    if ctx.model_root not in targets:
        raise ComposeError(f"{edit.where('volumes')}: upstream mounts no model cache at {ctx.model_root} "
                           f"(the catalog's model_root says where it does)")
    for target in ctx.data_dirs:
        if target not in targets:
            raise ComposeError(f"{edit.where('volumes')}: the catalog's data_dirs names {target}, which upstream "
                               f"does not mount")
    for vol in edit.volumes():
        target = vol["target"]
        where = edit.where(f"volumes {target}")
        if target == ctx.model_root:
            models = [{**vol, "source": rig, "target": cpath, "read_only": True} for rig, cpath in ctx.model_mounts]
            for rig, cpath in ctx.model_mounts:
                reasons[cpath] = f"verified model directory {rig}, read-only"
            reasons[target] = f"upstream mounts the whole model cache {vol['source']!r}"
            entries.append((vol, models, "models-read-only"))
            continue
        if target in CACHE_TARGETS:
            host = posixpath.join(ctx.cache_dir, CACHE_TARGETS[target])
            ctx.host_dirs.append(host)
            reasons[target] = f"cache {host}"
            entries.append((vol, [{**vol, "source": host}], "caches"))
            continue
        if target in ctx.data_dirs:
            host = data_dir(ctx.cache_dir, target)
            ctx.host_dirs.append(host)
            reasons[target] = f"{ctx.data_dirs[target]}: {host} (upstream: {vol['source']!r})"
            entries.append((vol, [{**vol, "source": host}], "data-dirs"))
            continue
        fix = ctx.mount_fixes.get(target)
        if fix is not None:
            checkout: SourceCheckout = fix["checkout"]
            ctx.used_sources.setdefault(checkout.name, set()).add(fix["path"])
            reasons[target] = fix["why"]
            entries.append((vol, [{**vol, "source": posixpath.join(checkout.rig_path, fix["path"])}], "catalog-fix"))
            continue
        src = vol["source"]
        if src.startswith("/"):
            prefix = next((p for p in ctx.path_sources if src == p or src.startswith(p.rstrip("/") + "/")), None)
            if prefix is None:
                raise ComposeError(f"{where}: host path {src!r} is not one rigup provides (catalog source_paths)")
            checkout = ctx.path_sources[prefix]
            rel = src[len(prefix):].lstrip("/")
        else:
            repo_path = _repo_path(compose_path, src, where)
            prefix = next((p for p in ctx.path_sources if not p.startswith("/")
                           and (repo_path == p or repo_path.startswith(p + "/"))), None)
            if prefix is not None:
                checkout = ctx.path_sources[prefix]
                rel = repo_path[len(prefix):].lstrip("/")
            else:
                checkout = ctx.upstream_source
                rel = repo_path
                if ctx.exists(rel) is None:
                    raise ComposeError(
                        f"{where}: mount source {src!r} ({rel}) does not exist at this commit; pin the variant's "
                        f"upstream at a commit that has it, or redirect it with mount_fixes"
                    )
        ctx.used_sources.setdefault(checkout.name, set()).add(rel or ".")
        ctx.repo_mounts[target] = (checkout.name, rel)
        reasons[target] = f"{src} -> the {checkout.name} checkout"
        rig = posixpath.join(checkout.rig_path, rel) if rel else checkout.rig_path
        entries.append((vol, [{**vol, "source": rig}], "host-paths"))
    applied: set[str] = set()
    # One recorded step per transform, so --explain names each.
    for name in ("models-read-only", "caches", "data-dirs", "catalog-fix", "host-paths"):
        if not any(t == name for _, _, t in entries):
            continue
        applied.add(name)
        current = [v for orig, new, t in entries for v in (new if t in applied else [orig])]
        edit.set_volumes(current, name, lambda target, n=name: reasons.get(target, TRANSFORMS[n]))
    strict = [{**v, "create_host_path": False} for v in edit.volumes()]
    edit.set_volumes(strict, "strict-binds", lambda target: TRANSFORMS["strict-binds"])


def data_dir(cache_dir: str, target: str) -> str:
    """The rig directory a data_dirs target gets: {cache_dir}/data/<target, '/' as '-'>."""
    return posixpath.join(cache_dir, "data", target.strip("/").replace("/", "-"))


def read_deploy_config(edit: ComposeEdit, ctx: Context) -> None:
    """Read (never edit) the vLLM-Omni deploy config the command names, into ctx.stages.

    The file must be one rigup mounts from upstream's own repository (read at the upstream commit);
    a config baked into the image cannot be read, and rigup does not guess its values."""
    values = edit.flag_values(DEPLOY_CONFIG_FLAG)
    if values is None:
        return
    where = edit.where(f"command {DEPLOY_CONFIG_FLAG}")
    if len(values) != 1:
        raise ComposeError(f"{where}: {values!r} is not one path after defaults")
    path = values[0]
    found = next(((t, src, rel) for t, (src, rel) in ctx.repo_mounts.items()
                  if path == t or path.startswith(t.rstrip("/") + "/")), None)
    if found is None or found[1] != ctx.upstream_source.name or ctx.read is None:
        raise ComposeError(f"{where}: {path} is not a file rigup mounts from upstream's repository; rigup takes the "
                           f"stages' engine values and GPUs from it, so it must be able to read it")
    target, _, rel = found
    repo_path = posixpath.join(rel, path[len(target):].lstrip("/")) if path != target else rel
    ctx.stages = parse_stages(ctx.read(repo_path), f"{repo_path} (the {DEPLOY_CONFIG_FLAG} of {edit.where('command')})")


def parse_stages(text: str, where: str) -> list[dict[str, Any]]:
    """The `stages` of a vLLM-Omni deploy config, checked: a stage_id each (one of them 0) and
    `devices` ("0", "1", "0,1": the container's GPU indices). The other keys are vLLM-Omni's."""
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ComposeError(f"{where}: not valid YAML: {exc}") from None
    stages = doc.get("stages") if isinstance(doc, dict) else None
    if not isinstance(stages, list) or not stages or not all(isinstance(st, dict) for st in stages):
        raise ComposeError(f"{where}: rigup reads deploy configs with a `stages` list of mappings")
    ids = [st.get("stage_id") for st in stages]
    integers = all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
    if not integers or len(set(ids)) != len(ids) or 0 not in ids:
        raise ComposeError(f"{where}: stages need distinct integer stage_id values, one of them 0 (got {ids})")
    for st in stages:
        at = f"{where}: stage {st['stage_id']}"
        devices = str(st.get("devices", ""))
        if not re.fullmatch(r"\d+(,\d+)*", devices.replace(" ", "")):
            raise ComposeError(f"{at}: devices {st.get('devices')!r} is not a list of GPU indices like '0' or '0,1'")
        for key in STAGE_INT_KEYS:
            if key in st and (isinstance(st[key], bool) or not isinstance(st[key], int)):
                raise ComposeError(f"{at}: {key} {st[key]!r} is not an integer")
        util = st.get("gpu_memory_utilization")
        if util is not None and (isinstance(util, bool) or not isinstance(util, (int, float))):
            raise ComposeError(f"{at}: gpu_memory_utilization {util!r} is not a number")
    return stages


def entry_stage(stages: list[dict[str, Any]]) -> dict[str, Any]:
    """The stage that receives requests (stage_id 0): the engine values rigup reports and checks."""
    return next(st for st in stages if st["stage_id"] == 0)


def stage_gpu_count(stages: list[dict[str, Any]]) -> int:
    """GPUs the stages use: the highest device index + 1 (a stage on device 1 needs GPU 0 visible too)."""
    return 1 + max(int(d) for st in stages for d in str(st["devices"]).replace(" ", "").split(","))


def image_entrypoint(repository: str, where: str) -> tuple[str, ...]:
    """The ENTRYPOINT of the image repository `repository` (IMAGE_ENTRYPOINTS)."""
    if repository in IMAGE_ENTRYPOINTS:
        return IMAGE_ENTRYPOINTS[repository]
    raise ComposeError(f"{where}: no entrypoint, and rigup does not know image {repository}'s: it wraps the "
                       f"entrypoint to hand the pod its API key from a file ({', '.join(IMAGE_ENTRYPOINTS)} known)")


def upstream_entrypoint(entrypoint: Any) -> list[str] | None:
    """The entrypoint without rigup's key wrapper (None: none)."""
    if entrypoint is None:
        return None
    words = [str(w) for w in (entrypoint if isinstance(entrypoint, list) else [entrypoint])]
    return words[len(KEY_WRAPPER_WORDS):] if tuple(words[:len(KEY_WRAPPER_WORDS)]) == KEY_WRAPPER_WORDS else words


def secrets(edit: ComposeEdit, ctx: Context) -> None:
    """The `secrets` transform (see SECRETS_TARGET): no secret in the environment, its files bound read-only,
    the consumers pointed at them, and the entrypoint wrapped to export VLLM_API_KEY from its file."""
    for name, value in edit.env().items():
        if name in SECRET_VARIABLES or name == "HUGGING_FACE_HUB_TOKEN" or (value and _SECRET_REFERENCE.search(value)):
            edit.set_env(name, None, "secrets", f"upstream's {name}={value}: a secret in the container's environment "
                         f"is kept by containerd in world-readable files; rigup hands it as a file", remove=True)
    paths = {"HF_TOKEN": "the HF token"} | ({RAY_TOKEN_KEY: f"cluster {ctx.cluster.cluster.name}'s Ray token"}
                                           if ctx.cluster is not None else {})
    for name, what in paths.items():
        edit.set_env(SECRET_PATH_VARIABLES[name], posixpath.join(SECRETS_TARGET, name), "secrets",
                     f"{what} from its file (absent: none)")
    volumes = edit.volumes()
    volumes.append({"type": "bind", "source": ctx.secrets_dir, "target": SECRETS_TARGET, "read_only": True,
                    "create_host_path": False})
    edit.set_volumes(volumes, "secrets", lambda key: f"the pod's 0700 secrets directory {ctx.secrets_dir}, read-only")
    entrypoint = edit.get("entrypoint")
    if entrypoint is None:
        words = list(image_entrypoint(ctx.image_repository, edit.where("entrypoint")))
    elif isinstance(entrypoint, list):
        words = [str(w) for w in entrypoint]
    else:
        raise ComposeError(f"{edit.where('entrypoint')}: a one-string entrypoint is not understood; rigup wraps a list")
    edit.set("entrypoint", [*KEY_WRAPPER_WORDS, *words], "secrets",
             f"VLLM_API_KEY exported from {SECRETS_TARGET}/VLLM_API_KEY, then upstream's entrypoint "
             f"{words or '(none: the command)'}")


def offline(edit: ComposeEdit) -> None:
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        edit.set_env(name, "1", "offline", TRANSFORMS["offline"])


def overrides(edit: ComposeEdit, ctx: Context) -> None:
    for key, flag in OVERRIDE_FLAGS.items():
        if key in ctx.overrides and ctx.stages is not None and key in STAGE_OVERRIDE_KEYS:
            raise ComposeError(f"{edit.where('command ' + DEPLOY_CONFIG_FLAG)}: variant_overrides[{key!r}]: upstream "
                               f"sets it per stage in its deploy config, which rigup mounts unchanged")
        if key in ctx.overrides:
            if key == "tensor_parallel_size" and edit.flag_values(flag) is None and ctx.overrides[key] == 1:
                continue
            edit.set_flag(flag, [_fmt(ctx.overrides[key])], "overrides", f"variant_overrides[{key!r}]")


def gpus(edit: ComposeEdit, ctx: Context) -> None:
    count = stage_gpu_count(ctx.stages) if ctx.stages is not None else ctx.gpu_count(edit)
    deploy = json.loads(json.dumps(edit.get("deploy") or {}))
    devices = (((deploy.get("resources") or {}).get("reservations") or {}).get("devices")) or []
    if len(devices) != 1 or devices[0].get("driver") != "nvidia":
        raise ComposeError(f"{edit.where('deploy')}: rigup expects one nvidia device reservation")
    if "device_ids" in devices[0]:
        raise ComposeError(f"{edit.where('deploy')}: device_ids is not understood; rigup assigns GPUs by count")
    why = "the deploy config's stage devices" if ctx.stages is not None else "the tensor-parallel size"
    if ctx.gpu_ids is None:
        devices[0]["count"] = count
        edit.set("deploy", deploy, "gpus", f"{count} GPU(s): {why}")
    else:
        if len(ctx.gpu_ids) != count:
            raise ComposeError(f"pod {ctx.name} owns {len(ctx.gpu_ids)} GPU(s) ({', '.join(map(str, ctx.gpu_ids))}) "
                               f"but variant {ctx.variant} uses {count} ({why}): give the pod {count} GPU(s)")
        devices[0].pop("count", None)
        devices[0]["device_ids"] = [str(i) for i in ctx.gpu_ids]
        edit.set("deploy", deploy, "gpus", f"GPU(s) {', '.join(map(str, ctx.gpu_ids))} of the host: pod {ctx.name}'s, "
                 f"{count} for {why}")
    env = edit.env()
    visible = env.get("NVIDIA_VISIBLE_DEVICES")
    if visible is not None:
        # With the nvidia runtime, NVIDIA_VISIBLE_DEVICES=all would hand every GPU over the reservation.
        edit.set_env("NVIDIA_VISIBLE_DEVICES", None, "gpus",
                     f"upstream's {visible!r} would override the {count}-GPU reservation", remove=True)


def interconnect(edit: ComposeEdit, ctx: Context) -> None:
    tp_values = edit.flag_values("--tensor-parallel-size")
    tp = int(tp_values[0]) if tp_values else 1
    if ctx.stages is not None:  # a deploy config's stages are engines of their own: the widest one's TP
        tp = max(int(st.get("tensor_parallel_size", 1)) for st in ctx.stages)
    settings = ctx.nccl(tp)
    env = edit.env()
    script = "\n".join(str(t) for t in edit.get("entrypoint") or ())
    if "NVLINK_MODE" in env:
        # Upstream's newer entrypoints source detect_nvlink.sh, which sets the NCCL variables and custom
        # all-reduce from NVLINK_MODE: rigup sets only that, from what it detected on the host.
        if tp < 2 or ctx.nvlink is None:
            return
        mode = "force_on" if ctx.nvlink else "force_off"
        ctx.interconnect_note = (f"NVLINK_MODE={mode}: upstream's detect_nvlink.sh sets NCCL and custom all-reduce "
                                 f"({'NVLink' if ctx.nvlink else 'no NVLink'} per rigup)")
        if ctx.nvlink and '"0" = "1"' in script:
            # May's entrypoints test "${_NVLINK_ENABLED:-0}" with one `$`: compose resolves it to 0 first.
            ctx.interconnect_note += ("; custom all-reduce stays off: upstream's entrypoint tests _NVLINK_ENABLED "
                                      "after compose resolved it to 0")
        edit.set_env("NVLINK_MODE", mode, "interconnect", ctx.interconnect_note)
        return
    if settings is None:
        return
    note = settings.summary
    if settings.custom_all_reduce and "--disable-custom-all-reduce" in script:
        note += "; custom all-reduce stays off: upstream's entrypoint passes --disable-custom-all-reduce"
    ctx.interconnect_note = note
    for name in sorted(settings.unset_env):
        if name in env:
            edit.set_env(name, None, "interconnect", note, remove=True)
    for name, value in settings.set_env.items():
        edit.set_env(name, value, "interconnect", note)
    if settings.custom_all_reduce:
        alloc = env.get("PYTORCH_CUDA_ALLOC_CONF")
        if alloc is not None and "expandable_segments:True" in alloc:
            # Custom all-reduce shares buffers over CUDA IPC, which expandable segments do not support.
            rest = ",".join(p for p in alloc.split(",") if p and p != "expandable_segments:True")
            edit.set_env("PYTORCH_CUDA_ALLOC_CONF", rest or None, "interconnect",
                         "custom all-reduce (CUDA IPC) cannot use expandable segments", remove=not rest)
        if edit.flag_values("--disable-custom-all-reduce") is not None:
            edit.set_flag("--disable-custom-all-reduce", None, "interconnect", note)


# A shell script's hand-over to the server (upstream's entrypoints end in it).
_EXEC_VLLM_SERVE = re.compile(r"\bexec\s+vllm\s+serve\b")
_VLLM_SERVE = re.compile(r"\bvllm\s+serve\b")


def cluster(edit: ComposeEdit, ctx: Context, member: ClusterMember) -> None:
    """The `cluster` transform: this member's share of a cluster (see TRANSFORMS["cluster"])."""
    c = member.cluster
    split = f"cluster {c.name}: TP {c.tensor_parallel} on each of {c.pipeline_parallel} hosts x PP {c.pipeline_parallel}"
    if ctx.stages is not None:
        raise ComposeError(f"{edit.where('command ' + DEPLOY_CONFIG_FLAG)}: a deploy config's stages run on one host; "
                           f"cluster {c.name} cannot split them")
    edit.set_flag("--tensor-parallel-size", [str(c.tensor_parallel)], "cluster", split)
    edit.set_flag("--pipeline-parallel-size", [str(c.pipeline_parallel)], "cluster", split)
    edit.set_flag("--distributed-executor-backend", ["ray"], "cluster",
                  "vLLM's Ray backend over the members' Ray cluster (run_cluster.sh)")
    # Host networking (run_cluster.sh: --network host): Ray and NCCL open ports on the member's own address.
    # vLLM listens on the address and port the publish transform chose.
    published = str((edit.get("ports") or [""])[0])
    port = published.rsplit(":", 2)[-2] if published.count(":") >= 2 else str(VLLM_DEFAULT_PORT)
    edit.set("ports", None, "cluster", "host networking: vLLM listens on the host's port itself")
    edit.set("network_mode", "host", "cluster", "host networking, as vLLM's run_cluster.sh runs every node")
    if edit.get("ipc") != "host":  # Ray's object store and NCCL's shared memory live in /dev/shm
        edit.set("ipc", "host", "cluster", "the host's IPC namespace and /dev/shm, as vLLM's docs ask for "
                 "multi-process and multi-node serving (run_cluster.sh sizes --shm-size instead)")
    edit.set_flag("--port", [port], "cluster", f"the pod's port {port}, on the host's network")
    edit.set_flag("--host", [ctx.bind_address], "cluster", f"serving_bind_address {ctx.bind_address}")
    for name, value in member.environment().items():
        edit.set_env(name, value, "cluster", f"{member.role} of cluster {c.name} on interface {member.net.ifname}")
    volumes = edit.volumes()
    volumes.append({"type": "bind", "source": member.script, "target": MEMBER_SCRIPT_TARGET, "read_only": True,
                    "create_host_path": False})
    edit.set_volumes(volumes, "cluster", lambda key: "rigup's member script (Ray head or worker)")
    entrypoint = edit.get("entrypoint")
    why = f"the {member.role}'s part runs where upstream's entrypoint starts the server"
    if entrypoint is None:  # the image's own: vllm/vllm-openai's ENTRYPOINT ["vllm", "serve"]
        edit.set("entrypoint", [MEMBER_SCRIPT_TARGET, "vllm", "serve"], "cluster", why)
        return
    words = [str(w) for w in (entrypoint if isinstance(entrypoint, list) else [entrypoint])]
    if words[:2] == ["vllm", "serve"]:
        edit.set("entrypoint", [MEMBER_SCRIPT_TARGET, *words], "cluster", why)
        return
    scripts = [i for i, w in enumerate(words) if _VLLM_SERVE.search(w)]
    if not scripts or any(len(_VLLM_SERVE.findall(words[i])) != len(_EXEC_VLLM_SERVE.findall(words[i])) for i in scripts):
        raise ComposeError(f"{edit.where('entrypoint')}: rigup makes a cluster member where the entrypoint hands over "
                           f"with `exec vllm serve`; this one does not")
    for i in scripts:
        words[i] = _EXEC_VLLM_SERVE.sub(f"exec {MEMBER_SCRIPT_TARGET} vllm serve", words[i])
    edit.set("entrypoint", words, "cluster", why)
