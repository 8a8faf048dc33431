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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rigup.desired.compose_doc import ComposeEdit, ComposeError, interpolate
from rigup.desired.interconnect import NcclSettings

# name -> what it does (the README's transform table and `--explain` use these words)
TRANSFORMS: dict[str, str] = {
    "image-pin": "the image is the catalog's, from the configured registry, pinned by the lock's digest",
    "defaults": "upstream's ${VAR:-default} take their default (rig-time secrets stay references to the .env)",
    "project": "the compose project is rigup-<variant>",
    "container-name": "the container is rigup-<variant>: unique per variant, so a switch never meets a leftover",
    "restart": "systemd restarts the service; the container never restarts behind its back",
    "publish": "the port is published on the serving bind address and the variant's host port",
    "models-read-only": "only the verified model directories are mounted, read-only, where upstream's command expects them",
    "caches": "torch.compile and Triton caches live under the install root, per variant",
    "host-paths": "upstream's relative and host paths point at rigup's checkouts at the locked commits",
    "catalog-fix": "a mount the catalog redirects, with its reason",
    "strict-binds": "a missing mount source fails the start instead of becoming an empty directory",
    "secrets": "the API key (like the HF token) comes from the 0600 .env, never the command line",
    "offline": "rigup verified every model file: the container must not fetch from the hub",
    "overrides": "the host's variant_overrides",
    "gpus": "the container gets exactly its tensor-parallel count of GPUs",
    "interconnect": "NCCL and custom all-reduce follow the GPU interconnect rigup detected",
    "labels": "labels name the variant and image, for status and cleanup",
    "logging": "Docker's copy of the log is bounded (the journal has the full stream)",
}

MODEL_ROOT = "/root/.cache/huggingface"  # where upstream's composes mount models (and --model points)
CACHE_TARGETS = {"/root/.cache/vllm/torch_compile_cache": "torch_compile", "/root/.triton/cache": "triton"}
SECRET_VARIABLES = frozenset({"HF_TOKEN", "VLLM_API_KEY"})

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
    image_ref: str
    image_why: str
    bind_address: str
    host_port: int | None  # None: upstream's published port
    container_port_default: int
    model_mounts: list[tuple[str, str]]  # (rig path, container path) of the main model and the draft
    cache_dir: str
    upstream_source: SourceCheckout
    path_sources: Mapping[str, SourceCheckout]  # repository-path prefix or absolute host path -> checkout
    mount_fixes: Mapping[str, Mapping[str, Any]]  # target -> {source checkout, path, why}
    exists: Callable[[str], str | None]  # repository path -> "file" | "dir" | None at the upstream commit
    overrides: Mapping[str, Any]
    gpu_count: Callable[[ComposeEdit], int]
    nccl: Callable[[int], NcclSettings | None]
    labels: Mapping[str, str]
    nvlink: bool | None = None  # what rigup decided for the host (detected or forced); None: not known
    used_sources: dict[str, set[str]] = field(default_factory=dict)  # source -> paths the mounts use
    host_dirs: list[str] = field(default_factory=list)
    interconnect_note: str | None = None


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        text = repr(value)
        return text[:-2] if text.endswith(".0") else text
    return str(value)


def apply_all(edit: ComposeEdit, ctx: Context) -> None:
    image_pin(edit, ctx)
    defaults(edit)
    edit.set_top("name", f"rigup-{ctx.variant}", "project", "one compose project per variant")
    edit.set("container_name", f"rigup-{ctx.variant}", "container-name", TRANSFORMS["container-name"])
    edit.set("restart", "no", "restart", TRANSFORMS["restart"])
    publish(edit, ctx)
    mounts(edit, ctx)
    secrets(edit)
    offline(edit)
    overrides(edit, ctx)
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
                                   f"command line; rigup passes secrets only through the environment")
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
    if int(container) != ctx.container_port_default:
        raise ComposeError(f"{edit.where('ports')}: container port {container}; the command listens on "
                           f"{ctx.container_port_default}")
    port = ctx.host_port if ctx.host_port is not None else int(published)
    host = f"[{ctx.bind_address}]" if ":" in ctx.bind_address else ctx.bind_address
    edit.set("ports", [f"{host}:{port}:{container}"], "publish",
             f"serving_bind_address {ctx.bind_address}, port {port}")


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
    for vol in edit.volumes():
        target = vol["target"]
        where = edit.where(f"volumes {target}")
        if target == MODEL_ROOT:
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
        reasons[target] = f"{src} -> the {checkout.name} checkout"
        rig = posixpath.join(checkout.rig_path, rel) if rel else checkout.rig_path
        entries.append((vol, [{**vol, "source": rig}], "host-paths"))
    applied: set[str] = set()
    # One recorded step per transform, so --explain names each.
    for name in ("models-read-only", "caches", "catalog-fix", "host-paths"):
        if not any(t == name for _, _, t in entries):
            continue
        applied.add(name)
        current = [v for orig, new, t in entries for v in (new if t in applied else [orig])]
        edit.set_volumes(current, name, lambda target, n=name: reasons.get(target, TRANSFORMS[n]))
    strict = [{**v, "create_host_path": False} for v in edit.volumes()]
    edit.set_volumes(strict, "strict-binds", lambda target: TRANSFORMS["strict-binds"])


def secrets(edit: ComposeEdit) -> None:
    env = edit.env()
    if "HUGGING_FACE_HUB_TOKEN" not in env:
        edit.set_env("HUGGING_FACE_HUB_TOKEN", "${HF_TOKEN:-}", "secrets", "the HF token from the 0600 .env")
    edit.set_env("VLLM_API_KEY", "${VLLM_API_KEY:-}", "secrets", TRANSFORMS["secrets"])


def offline(edit: ComposeEdit) -> None:
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        edit.set_env(name, "1", "offline", TRANSFORMS["offline"])


def overrides(edit: ComposeEdit, ctx: Context) -> None:
    for key, flag in OVERRIDE_FLAGS.items():
        if key in ctx.overrides:
            if key == "tensor_parallel_size" and edit.flag_values(flag) is None and ctx.overrides[key] == 1:
                continue
            edit.set_flag(flag, [_fmt(ctx.overrides[key])], "overrides", f"variant_overrides[{key!r}]")


def gpus(edit: ComposeEdit, ctx: Context) -> None:
    count = ctx.gpu_count(edit)
    deploy = json.loads(json.dumps(edit.get("deploy") or {}))
    devices = (((deploy.get("resources") or {}).get("reservations") or {}).get("devices")) or []
    if len(devices) != 1 or devices[0].get("driver") != "nvidia":
        raise ComposeError(f"{edit.where('deploy')}: rigup expects one nvidia device reservation")
    if "device_ids" in devices[0]:
        raise ComposeError(f"{edit.where('deploy')}: device_ids is not understood; rigup assigns GPUs by count")
    devices[0]["count"] = count
    edit.set("deploy", deploy, "gpus", f"{count} GPU(s): the tensor-parallel size")
    env = edit.env()
    visible = env.get("NVIDIA_VISIBLE_DEVICES")
    if visible is not None:
        # With the nvidia runtime, NVIDIA_VISIBLE_DEVICES=all would hand every GPU over the reservation.
        edit.set_env("NVIDIA_VISIBLE_DEVICES", None, "gpus",
                     f"upstream's {visible!r} would override the {count}-GPU reservation", remove=True)


def interconnect(edit: ComposeEdit, ctx: Context) -> None:
    tp_values = edit.flag_values("--tensor-parallel-size")
    tp = int(tp_values[0]) if tp_values else 1
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
