"""Render a recipe into the files a rig runs it from: compose file, .env and systemd unit."""

from __future__ import annotations

import posixpath
from dataclasses import dataclass

from rigup.desired.cluster_token import RAY_TOKEN_KEY
from rigup.desired.recipe import Recipe
from rigup.desired.templating import render_template

# The secrets a pod can carry: each is a file of its secrets directory named after it (rigup.desired.transforms
# SECRETS_TARGET says how the container reads each one), never a line of the .env or a value of the compose file.
HF_TOKEN_KEY = "HF_TOKEN"
API_KEY_KEY = "VLLM_API_KEY"
SECRET_NAMES = (HF_TOKEN_KEY, API_KEY_KEY, RAY_TOKEN_KEY)


@dataclass(frozen=True)
class RenderedFile:
    """One file for the rig: its text and octal mode."""

    content: str
    mode: str  # octal string as pyinfra's files.put takes it, e.g. "0644"


def secret_names(recipe: Recipe, *, hf_token_present: bool, api_key_present: bool) -> tuple[str, ...]:
    """The secrets pod `recipe` carries, in SECRET_NAMES' order: the HF token when one is configured, the API key
    when one is (every pod has one: rigup.desired.pod_keys), a cluster member's Ray token (rigup.desired.cluster_token)."""
    present = {HF_TOKEN_KEY: hf_token_present, API_KEY_KEY: api_key_present, RAY_TOKEN_KEY: recipe.cluster is not None}
    return tuple(name for name in SECRET_NAMES if present[name])


def secret_file(recipe: Recipe, name: str) -> str:
    """The rig path of secret `name`'s file: {secrets_dir}/NAME (0600 root)."""
    if name not in SECRET_NAMES:
        raise ValueError(f"no secret {name!r}; one of {', '.join(SECRET_NAMES)}")
    return posixpath.join(recipe.paths.secrets_dir, name)


def secret_text(name: str, value: str) -> str:
    """A secret file's text: the value and a newline. Refuses an empty value or one with a newline or NUL (one
    line is what each reader takes: bash's `read`, huggingface_hub and Ray strip the newline)."""
    if not value or any(c in value for c in "\n\r\0"):
        raise ValueError(f"{name}: empty, or contains a newline or NUL")
    return value + "\n"


def _render(template: str, recipe: Recipe) -> str:
    return render_template(template, recipe=recipe)


def render_variant(recipe: Recipe) -> dict[str, RenderedFile]:
    """Files for `recipe`, keyed by their rig path without the leading "/": none holds a secret (secret_file)."""
    paths = recipe.paths
    return {
        # upstream's compose file plus rigup's transforms (rigup/desired/transforms.py)
        paths.compose_file.lstrip("/"): RenderedFile(recipe.compose_text, "0644"),
        # 0600 as it was when it held the secrets: compose's --env-file (no secret in it now)
        paths.env_file.lstrip("/"): RenderedFile(_render("env.j2", recipe), "0600"),
        paths.unit_file.lstrip("/"): RenderedFile(_render("rigup-variant.service.j2", recipe), "0644"),
    }
