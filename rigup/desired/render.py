"""Render a recipe into the files a rig runs it from: compose file, .env and systemd unit."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from rigup.desired.cluster_token import RAY_TOKEN_KEY
from rigup.desired.recipe import Recipe
from rigup.desired.templating import render_template

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


def _render(template: str, recipe: Recipe) -> str:
    return render_template(template, recipe=recipe)


def render_variant(recipe: Recipe, *, hf_token_present: bool, api_key_present: bool) -> dict[str, RenderedFile]:
    """Files for `recipe`, keyed by their rig path without the leading "/".

    + hf_token_present: an HF token is configured; the deploy appends HF_TOKEN to .env
    + api_key_present: an API key is configured; the deploy appends VLLM_API_KEY to .env
    A cluster member's .env always carries its cluster's Ray token (RAY_AUTH_TOKEN: rigup.desired.cluster_token).
    """
    secrets = tuple(
        key for key, present in ((HF_TOKEN_KEY, hf_token_present), (API_KEY_KEY, api_key_present),
                                 (RAY_TOKEN_KEY, recipe.cluster is not None)) if present
    )
    paths = recipe.paths
    return {
        # upstream's compose file plus rigup's transforms (rigup/desired/transforms.py)
        paths.compose_file.lstrip("/"): RenderedFile(recipe.compose_text, "0644"),
        # 0600 whether or not a secret is configured today, so adding one never widens exposure.
        paths.env_file.lstrip("/"): RenderedFile(_render("env.j2", recipe), "0600", secrets),
        paths.unit_file.lstrip("/"): RenderedFile(_render("rigup-variant.service.j2", recipe), "0644"),
    }

