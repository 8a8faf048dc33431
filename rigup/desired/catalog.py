"""The serving-variant catalog (rigup/desired/catalog.yaml plus one file per model family in
rigup/desired/catalog.d/): loaded once, merged, inheritance resolved, validated.

A family file holds `images`, `models` and `variants` sections like the main file's; a name defined
twice (in two files) is an error naming both. Variants keep file order: the main file's, then each
family file's in name order.

Entries under `variants:` whose name starts with "_" are shared bases, not variants. A variant
(or base) may name another entry in `base:`; the loader merges it over that entry: mappings merge
key by key, while lists and the keys in REPLACED_KEYS (a variant states its whole `env`,
usually from YAML anchors; a null value drops a variable) replace the base's value.
"""

from __future__ import annotations

import copy
import difflib
import functools
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from rigup.rig.servingctl import GATE_REQUEST_KEYS, PROBE_NAMES

CATALOG_FILE = Path(__file__).with_name("catalog.yaml")
CATALOG_DIR = Path(__file__).with_name("catalog.d")
FRAGMENT_SECTIONS = ("images", "models", "variants")

# vLLM's --gpu-memory-utilization: what the catalog, variant_overrides and fit's suggestions accept.
# vLLM takes (0, 1]; 0.99 leaves the driver its share, and club-3090's small models run far below the
# 27B recipes (VibeThinker-3B: 0.40 of a 24 GB card).
GPU_MEMORY_UTILIZATION_RANGE = (0.1, 0.99)

# Keys whose value replaces the base's instead of merging into it.
REPLACED_KEYS = frozenset({"speculative", "alternative_envelopes"})

_NAME = re.compile(r"^[a-z0-9][a-z0-9-]*$")
_SHA = re.compile(r"^[0-9a-f]{40}$")
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_CONTAINER_DIR = re.compile(r"^/(?!.*(^|/)\.\.?(/|$))[A-Za-z0-9._/-]*[A-Za-z0-9._-]$")

# Variant keys: name -> (required, accepted types). None in the types tuple means null is allowed.
# Everything about how the engine runs comes from upstream's compose file; these say what it does not.
_VARIANT_SCHEMA: dict[str, tuple[bool, tuple[type | None, ...]]] = {
    "description": (True, (str,)),
    "upstream": (True, (dict,)),  # {source: <catalog source>, path: <compose file>, service: <optional>}
    "image": (True, (str,)),
    "model": (True, (str,)),
    "draft": (False, (str, None)),
    "port": (False, (int,)),  # rigup's host port when upstream's would collide; default: upstream's
    "source_paths": (False, (dict,)),  # repository path prefix or host path -> catalog source
    "mount_fixes": (False, (dict,)),  # container target -> {source, path, why}
    "model_root": (False, (str,)),  # where upstream mounts the model cache; default /root/.cache/huggingface
    "data_dirs": (False, (dict,)),  # container target of a writable in-checkout directory -> why
    "speculative": (False, (dict, None)),  # what upstream's entrypoint builds (not in its command)
    "tensor_parallel_size": (True, (int,)),
    "tensor_parallel_sizes": (True, (list,)),
    "min_compute_capability": (True, (str,)),
    "min_gpu_memory_gb": (True, (int, float)),
    "vram_per_gpu_gb": (True, (int, float, None)),
    "measured_on_gpu_mib": (True, (int,)),
    "alternative_envelopes": (False, (list,)),
    "max_model_len": (True, (int,)),
    "gpu_memory_utilization": (True, (float,)),
    "max_num_seqs": (True, (int,)),
    "max_num_batched_tokens": (True, (int, None)),
    "language_model_only": (True, (bool,)),
    "notes": (False, (str,)),
    # Fields every chat request to the variant's server must carry (upstream's request format), added by
    # the health gate and `rigup verify`: e.g. vLLM-Omni's {"modalities": ["text"]}.
    "chat_request": (False, (dict,)),
    # The health gate's probes whose answers the variant's model can give (rigup.rig.servingctl.PROBES;
    # absent: every one). A vision-only or embedding model leaves out what it cannot answer.
    "gate_probes": (False, (list,)),
    "base": (False, (str,)),
}


class CatalogError(ValueError):
    """catalog.yaml is malformed; the message names the entry and key."""


def _merge(base: Any, child: Any, key: str | None = None) -> Any:
    if key in REPLACED_KEYS or not (isinstance(base, dict) and isinstance(child, dict)):
        return copy.deepcopy(child)
    merged = copy.deepcopy(base)
    for k, value in child.items():
        merged[k] = _merge(merged[k], value, k) if k in merged else copy.deepcopy(value)
    return merged


def _flatten(entries: Mapping[str, Any], name: str, seen: tuple[str, ...] = ()) -> dict[str, Any]:
    if name in seen:
        raise CatalogError(f"variants: base cycle {' -> '.join((*seen, name))}")
    if name not in entries:
        raise CatalogError(f"variants.{seen[-1]}: base {name!r} is not an entry of variants")
    entry = entries[name]
    if not isinstance(entry, dict):
        raise CatalogError(f"variants.{name}: must be a mapping")
    parent = entry.get("base")
    if parent is None:
        return copy.deepcopy(entry)
    return _merge(_flatten(entries, parent, (*seen, name)), entry)


def _type_ok(value: Any, types: tuple[type | None, ...]) -> bool:
    if value is None:
        return None in types
    if isinstance(value, bool):
        return bool in types
    if isinstance(value, int) and int not in types and float in types:
        return False  # utilisation must be written as a float (0.92), not an int
    return any(t is not None and isinstance(value, t) for t in types)


def _json_value(value: Any) -> bool:
    """What json.dumps writes as it is (YAML can also hold dates, sets and non-string keys)."""
    if value is None or isinstance(value, (str, bool, int)):
        return True
    if isinstance(value, float):
        return value == value and value not in (float("inf"), float("-inf"))
    if isinstance(value, list):
        return all(_json_value(item) for item in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _json_value(item) for k, item in value.items())
    return False


def _validate_variant(name: str, v: dict[str, Any], cat: Mapping[str, Any], file: str = "catalog.yaml") -> None:
    where = f"variants.{name}"
    for key in v:
        if key not in _VARIANT_SCHEMA:
            raise CatalogError(f"{where}: unknown key {key!r}")
    for key, (required, types) in _VARIANT_SCHEMA.items():
        if key not in v:
            if required:
                raise CatalogError(f"{where}: missing key {key!r}")
            continue
        if not _type_ok(v[key], types):
            raise CatalogError(f"{where}.{key}: wrong type {type(v[key]).__name__}")

    if v["image"] not in cat["images"]:
        raise CatalogError(f"{where}.image: unknown image {v['image']!r}")
    for role in ("model", "draft"):
        if v.get(role) is not None and v[role] not in cat["models"]:
            raise CatalogError(f"{where}.{role}: unknown model {v[role]!r}")
    model = cat["models"][v["model"]]
    for field in ("max_context", "valid_tensor_parallel_sizes"):
        if field not in model:
            raise CatalogError(f"models.{v['model']}: a main model needs {field!r}")

    sizes = v["tensor_parallel_sizes"]
    if v["tensor_parallel_size"] not in sizes:
        raise CatalogError(f"{where}: tensor_parallel_size {v['tensor_parallel_size']} not in tensor_parallel_sizes")
    bad = [s for s in sizes if s not in model["valid_tensor_parallel_sizes"]]
    if bad:
        raise CatalogError(f"{where}.tensor_parallel_sizes: {bad} invalid for model {v['model']!r}")
    if "port" in v and not 1 <= v["port"] <= 65535:
        raise CatalogError(f"{where}.port: out of range")
    low, high = GPU_MEMORY_UTILIZATION_RANGE
    if not low <= v["gpu_memory_utilization"] <= high:
        raise CatalogError(f"{where}.gpu_memory_utilization: out of range")
    if not 1024 <= v["max_model_len"] <= model["max_context"]:
        raise CatalogError(f"{where}.max_model_len: above the model's {model['max_context']}")
    if not 1024 <= v["measured_on_gpu_mib"] <= 1_048_576:
        raise CatalogError(f"{where}.measured_on_gpu_mib: the measuring card's memory.total in MiB")
    if v["vram_per_gpu_gb"] is not None and v["vram_per_gpu_gb"] * 1000 > v["measured_on_gpu_mib"]:
        raise CatalogError(f"{where}.vram_per_gpu_gb: more than the measuring card holds")
    if not re.fullmatch(r"\d+\.\d+", v["min_compute_capability"]):
        raise CatalogError(f"{where}.min_compute_capability: write it as MAJOR.MINOR")

    up = v["upstream"]
    if set(up) - {"source", "path", "service"} or not {"source", "path"} <= set(up):
        raise CatalogError(f"{where}.upstream: needs source and path (and optionally service)")
    if up["source"] not in cat["sources"]:
        raise CatalogError(f"{where}.upstream.source: unknown source {up['source']!r}")
    if up["path"].startswith("/") or ".." in up["path"].split("/"):
        raise CatalogError(f"{where}.upstream.path: a path inside the repository")
    for prefix, source in (v.get("source_paths") or {}).items():
        if source not in cat["sources"]:
            raise CatalogError(f"{where}.source_paths.{prefix}: unknown source {source!r}")
    for target, fix in (v.get("mount_fixes") or {}).items():
        if not isinstance(fix, dict) or set(fix) != {"source", "path", "why"} or fix["source"] not in cat["sources"]:
            raise CatalogError(f"{where}.mount_fixes.{target}: needs source (a catalog source), path and why")
    root = v.get("model_root")
    if root is not None and not _CONTAINER_DIR.match(root):
        raise CatalogError(f"{where}.model_root: an absolute container directory")
    for target, why in (v.get("data_dirs") or {}).items():
        if not isinstance(target, str) or not _CONTAINER_DIR.match(target) or not isinstance(why, str) or not why:
            raise CatalogError(f"{where}.data_dirs.{target}: an absolute container directory -> why it is writable")
    spec = v.get("speculative")
    if spec is not None:
        extra = set(spec) - {"kind", "num_speculative_tokens"}
        if extra or not isinstance(spec.get("num_speculative_tokens"), int) or spec.get("kind") not in ("mtp", "dflash"):
            raise CatalogError(f"{where}.speculative: needs kind (mtp|dflash) and num_speculative_tokens; unknown keys {sorted(extra)}")
    request = v.get("chat_request")
    if request is not None:
        clash = sorted(set(request) & GATE_REQUEST_KEYS)
        if not request or clash or not all(isinstance(k, str) and k for k in request):
            raise CatalogError(f"{where}.chat_request: request fields by name, none of the health gate's own "
                               f"({', '.join(sorted(GATE_REQUEST_KEYS))}); got {sorted(map(str, request))}")
        for key, value in request.items():
            if not _json_value(value):
                raise CatalogError(f"{where}.chat_request.{key}: a JSON value (string, number, boolean, null, list, "
                                   f"mapping with string keys)")
    _check_gate_probes(v.get("gate_probes"), f"{file}: {where}.gate_probes")
    for i, env in enumerate(v.get("alternative_envelopes") or []):
        if not isinstance(env, dict) or not {"max_model_len", "gpu_memory_utilization"} <= set(env):
            raise CatalogError(f"{where}.alternative_envelopes[{i}]: needs max_model_len and gpu_memory_utilization")


def _check_gate_probes(probes: Any, where: str) -> None:
    """A variant's gate_probes: names of the gate's probes, each once (one line: where, the allowed names,
    the closest one)."""
    if probes is None:
        return
    allowed = f"allowed: {', '.join(PROBE_NAMES)}"
    for probe in probes:
        if probe not in PROBE_NAMES:
            close = difflib.get_close_matches(str(probe), PROBE_NAMES, n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise CatalogError(f"{where}: unknown probe {probe!r} ({allowed}){hint}")
    twice = sorted({p for p in probes if probes.count(p) > 1})
    if twice:
        raise CatalogError(f"{where}: {', '.join(map(repr, twice))} named twice ({allowed}, each once)")


def _shown(path: Path) -> str:
    """A catalog file as messages name it: catalog.yaml, catalog.d/<family>.yaml, or another file's path."""
    if path == CATALOG_FILE:
        return CATALOG_FILE.name
    return f"{CATALOG_DIR.name}/{path.name}" if path.parent == CATALOG_DIR else str(path)


def _validate(cat: Any, origin: Mapping[tuple[str, str], Path] | None = None) -> dict[str, Any]:
    if not isinstance(cat, dict):
        raise CatalogError("catalog: top level must be a mapping")
    sections = ("images", "sources", "models", "variants")
    for section in sections:
        if not isinstance(cat.get(section), dict) or not cat[section]:
            raise CatalogError(f"catalog: missing section {section!r}")
    for key in cat:
        if key not in sections and not str(key).startswith("x-"):  # x-*: anchor holders
            raise CatalogError(f"catalog: unknown top-level key {key!r}")
    for key, image in cat["images"].items():
        for field in ("repository", "tag", "cuda_runtime", "approx_size_gb"):
            if field not in image:
                raise CatalogError(f"images.{key}: missing {field!r}")
        if not isinstance(image["cuda_runtime"], str) or not re.fullmatch(r"\d+\.\d+", image["cuda_runtime"]):
            raise CatalogError(f"images.{key}.cuda_runtime: a quoted MAJOR.MINOR string")
        # ray_version: the Ray the image carries, where it was read (a cluster refuses one older than token auth)
        if "ray_version" in image and not (isinstance(image["ray_version"], str)
                                           and re.fullmatch(r"\d+\.\d+(\.\d+)?", image["ray_version"])):
            raise CatalogError(f"images.{key}.ray_version: a quoted MAJOR.MINOR[.PATCH] string (the Ray the image carries)")
        # digest: upstream pins the image by digest (its tag is mutable); rigup pulls that digest.
        if "digest" in image and not (isinstance(image["digest"], str) and _DIGEST.match(image["digest"])):
            raise CatalogError(f"images.{key}.digest: sha256:<64 lowercase hex>")
    for key, source in cat["sources"].items():
        if not _NAME.match(key):
            raise CatalogError(f"sources.{key}: names are lower-case words joined by '-'")
        for field in ("url_knob", "ref", "full_clone", "approx_size_gb"):
            if field not in source:
                raise CatalogError(f"sources.{key}: missing {field!r}")
    for key, model in cat["models"].items():
        for field in ("family", "repo_id", "dir", "approx_size_gb", "verify_glob", "gated"):
            if field not in model:
                raise CatalogError(f"models.{key}: missing {field!r}")
        if "/" in model["dir"] or model["dir"] in ("", ".", ".."):
            raise CatalogError(f"models.{key}.dir: a single directory name")

    entries = cat["variants"]
    variants: dict[str, dict[str, Any]] = {}
    for name in entries:
        if name.startswith("_"):
            continue
        if not _NAME.match(name):
            raise CatalogError(f"variants.{name}: names are lower-case words joined by '-'")
        flat = _flatten(entries, name)
        flat.pop("base", None)
        file = origin.get(("variants", name)) if origin else None
        _validate_variant(name, flat, cat, _shown(file) if file is not None else CATALOG_FILE.name)
        flat["name"] = name
        variants[name] = flat

    return {
        "images": cat["images"],
        "sources": cat["sources"],
        "models": cat["models"],
        "variants": variants,
    }


def _load_yaml(path: Path) -> Any:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml when present: 10x faster
    with path.open() as fh:
        return yaml.load(fh, Loader=loader)  # noqa: S506 - a safe loader


def _merge_fragment(cat: dict[str, Any], fragment: Any, path: Path, origin: dict[tuple[str, str], Path]) -> None:
    if not isinstance(fragment, dict):
        raise CatalogError(f"{path.name}: top level must be a mapping")
    for key, entries in fragment.items():
        if str(key).startswith("x-"):
            continue  # anchor holders
        if key not in FRAGMENT_SECTIONS:
            raise CatalogError(f"{path.name}: unknown top-level key {key!r} (a family file holds {', '.join(FRAGMENT_SECTIONS)})")
        if not isinstance(entries, dict):
            raise CatalogError(f"{path.name}: {key} must be a mapping")
        section = cat.setdefault(key, {})
        for name, entry in entries.items():
            if name in section:
                first = origin.get((key, name), CATALOG_FILE)
                raise CatalogError(f"{path.name}: {key}.{name} is already defined in {first.name}")
            section[name] = entry
            origin[(key, name)] = path


def load_catalog_file(path: Path, fragments: Any = ()) -> dict[str, Any]:
    """Load, merge and validate a catalog file and its family files (tests use it on broken copies)."""
    raw = _load_yaml(path)
    origin: dict[tuple[str, str], Path] = {}
    if isinstance(raw, dict):
        for section in FRAGMENT_SECTIONS:
            for name in raw.get(section) or {}:
                origin[(section, name)] = path
        for fragment in sorted(fragments):
            _merge_fragment(raw, _load_yaml(fragment), fragment, origin)
    return _validate(raw, origin)


@functools.cache
def _cached() -> dict[str, Any]:
    return load_catalog_file(CATALOG_FILE, CATALOG_DIR.glob("*.yaml"))


def load_catalog() -> dict[str, Any]:
    """The validated catalog with inheritance resolved: images, sources, models, variants.

    Cached for the process; callers must not mutate it.
    """
    return _cached()


def variant_names() -> list[str]:
    """Every serving variant, in catalog order."""
    return list(load_catalog()["variants"])


def closest_variants(name: Any) -> str:
    """What a message about an unknown variant `name` says is allowed: the catalog's closest names (a
    "did you mean") and how to list them all, never the whole catalog (73 names make a 3,000-character line)."""
    names = variant_names()
    close = difflib.get_close_matches(str(name), names, n=3, cutoff=0.6)
    hint = f"did you mean {' or '.join(map(repr, close))}? " if close else ""
    return f"{hint}`rigup render --list` lists all {len(names)} variants"


def rigup_container_names() -> tuple[str, ...]:
    """Every container name a rigup variant runs under, sorted (the container-name transform: rigup-<variant>)."""
    return tuple(sorted(f"rigup-{name}" for name in load_catalog()["variants"]))
