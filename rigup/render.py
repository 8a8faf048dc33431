"""Render a recipe into the files a rig runs it from: compose file, .env and systemd unit.

`render_variant` is what tasks/serving.py uploads and what `rigup render` writes, so the CLI shows
exactly what a deploy puts on a rig (secret values aside: the deploy appends them to .env).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2

from rigup import REPO_ROOT
from rigup.catalog import load_catalog, variant_names
from rigup.interconnect import TopologyError, resolve_for_host, topology
from rigup.knobs import load_defaults, parse_data_value
from rigup.lock import LockError, LockFile, lock_problems
from rigup.recipe import Recipe, RecipeError

TEMPLATES_DIR = REPO_ROOT / "templates"

# .env keys of the secrets, and the compose file's references to them (recipe.environment_refs).
HF_TOKEN_KEY = "HF_TOKEN"
API_KEY_KEY = "VLLM_API_KEY"


@dataclass(frozen=True)
class RenderedFile:
    """One file for the rig: its text, octal mode, and the secret keys the deploy must append."""

    content: str
    mode: str  # octal string as pyinfra's files.put takes it, e.g. "0644"
    secret_keys: tuple[str, ...] = ()

    def with_secrets(self, values: Mapping[str, str]) -> str:
        """The content with `KEY='value'` lines appended for each of `secret_keys`.

        Values are single-quoted, which Compose's .env parser takes literally (no interpolation).
        """
        missing = [k for k in self.secret_keys if k not in values]
        extra = sorted(set(values) - set(self.secret_keys))
        if missing or extra:
            raise ValueError(f"secrets for this file: need {list(self.secret_keys)}, got {sorted(values)}")
        lines = [self.content]
        for key in self.secret_keys:
            value = values[key]
            if not value or any(c in value for c in "'\n\r\0"):
                raise ValueError(f"{key}: empty, or contains a quote, newline or NUL")
            lines.append(f"{key}='{value}'\n")
        return "".join(lines)


def _compose_quote(value: Any) -> str:
    """A YAML double-quoted scalar with `$` doubled so Compose does not interpolate it."""
    return json.dumps(str(value).replace("$", "$$"), ensure_ascii=False)


def _env_ref(key: str) -> str:
    """The Compose reference to a .env key; unset or empty means empty."""
    return json.dumps("${" + key + ":-}")



@functools.cache
def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES_DIR)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters["q"] = _compose_quote
    env.filters["env_ref"] = _env_ref
    return env


def _render(template: str, recipe: Recipe) -> str:
    return _environment().get_template(template).render(recipe=recipe)


def render_variant(recipe: Recipe, *, hf_token_present: bool, api_key_present: bool) -> dict[str, RenderedFile]:
    """Files for `recipe`, keyed by their rig path without the leading "/".

    + hf_token_present: an HF token is configured; the deploy appends HF_TOKEN to .env
    + api_key_present: an API key is configured; the deploy appends VLLM_API_KEY to .env
    """
    secrets = tuple(
        key for key, present in ((HF_TOKEN_KEY, hf_token_present), (API_KEY_KEY, api_key_present)) if present
    )
    paths = recipe.paths
    return {
        paths.compose_file.lstrip("/"): RenderedFile(_render("compose.yaml.j2", recipe), "0644"),
        # 0600 whether or not a secret is configured today, so adding one never widens exposure.
        paths.env_file.lstrip("/"): RenderedFile(_render("env.j2", recipe), "0600", secrets),
        paths.unit_file.lstrip("/"): RenderedFile(_render("rigup-variant.service.j2", recipe), "0644"),
    }


# --------------------------------------------------------------------------------------------
# CLI: rigup render


def _parse_data(pairs: list[str]) -> dict[str, Any]:
    data: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise RecipeError(f"--data expects key=value, got {pair!r}")
        data[key] = parse_data_value(value)
    return data


def host_data_for_cli(variant: str, data_pairs: list[str]) -> dict[str, Any]:
    """group_data/all.py defaults, then --data overrides, then the variant argument."""
    host_data = load_defaults()
    overrides = _parse_data(data_pairs)
    unknown = sorted(set(overrides) - set(host_data))
    if unknown:
        raise RecipeError(f"--data: unknown knob(s) {', '.join(unknown)} (declared in group_data/all.py)")
    host_data.update(overrides)
    host_data["variant"] = variant
    return host_data


def _cmd_render(args: argparse.Namespace) -> int:
    if args.list:
        catalog = load_catalog()
        for name in variant_names():
            v = catalog["variants"][name]
            print(f"{name:26} :{v['port']:<5} TP={v['tensor_parallel_size']}  {v['description']}")
        return 0
    if args.variant is None or args.out is None:
        print("rigup render: VARIANT and --out are required (or --list)", file=sys.stderr)
        return 2
    try:
        host_data = host_data_for_cli(args.variant, args.data)
        lock = LockFile.load(args.lock) if args.lock is not None else None
        topo = None
        if args.topo is not None:
            topo = topology(Path(args.topo).read_text(), None if args.p2p is None else Path(args.p2p).read_text())
        recipe = resolve_for_host(host_data, topo, lock)
    except (RecipeError, LockError, TopologyError, OSError) as exc:
        print(f"rigup render: {exc}", file=sys.stderr)
        return 2
    if lock is not None:
        for problem in lock_problems(recipe, host_data, lock):
            # Rendered anyway (it is a preview); a deploy refuses to run with this lock.
            print(f"rigup render: warning: {lock.path}: {problem}", file=sys.stderr)
    hf_present = bool(os.environ.get("HF_TOKEN")) or host_data.get("hf_token_file") is not None
    api_present = host_data.get("serving_api_key_file") is not None
    out = Path(args.out)
    for relpath, rendered in sorted(render_variant(recipe, hf_token_present=hf_present, api_key_present=api_present).items()):
        dest = out / relpath
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(rendered.content)
        dest.chmod(int(rendered.mode, 8))
        note = f"  (deploy appends: {', '.join(rendered.secret_keys)})" if rendered.secret_keys else ""
        print(f"{rendered.mode} {dest}{note}")
    if lock is not None:
        print(f"pins from {lock.path}:")
        print(f"  {recipe.image.lock_name}: {recipe.image.digest or 'tag only (no digest locked)'}")
        for source in recipe.sources:
            print(f"  {source.lock_name}: {source.commit if source.locked else 'not locked'}")
        for model in recipe.models:
            print(f"  {model.lock_name}: {model.revision or 'not locked'}")
    return 0


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `render VARIANT --out DIR [--data key=value ...] [--lock FILE] [--topo FILE [--p2p FILE]] [--list]`."""
    parser = subparsers.add_parser(
        "render",
        help="write the compose file, .env and systemd unit a deploy would put on a rig",
        description="Render a variant's rig files under DIR (paths as on the rig, without the leading /).",
    )
    parser.add_argument("variant", nargs="?", metavar="VARIANT", help="catalog variant (see --list)")
    parser.add_argument("--out", metavar="DIR", help="directory to write into")
    parser.add_argument(
        "--data",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a group_data/all.py knob (values parse like pyinfra --data: true/false, ints, JSON, text)",
    )
    parser.add_argument(
        "--lock", metavar="FILE", help="lock file (rigs.lock.yaml): render with its pinned commits, revisions and digests"
    )
    parser.add_argument(
        "--topo", metavar="FILE", help="a host's `nvidia-smi topo -m` output: plan NCCL settings for its interconnect"
    )
    parser.add_argument("--p2p", metavar="FILE", help="with --topo: the host's `nvidia-smi topo -p2p r` output")
    parser.add_argument("--list", action="store_true", help="list the catalog's variants and exit")
    parser.set_defaults(func=_cmd_render)
    return parser
