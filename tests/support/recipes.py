"""Recipes as a host with the defaults resolves them, and their vLLM arguments: what the catalog tests
compare with the values typed in from upstream."""

from __future__ import annotations

from typing import Any

from rigup.desired.knobs import load_defaults
from rigup.desired.recipe import Recipe, resolve


def recipe_for(variant: str, **data: Any) -> Recipe:
    """The recipe of `variant` on a host with group_data/all.py's defaults and `data`."""
    host = load_defaults()
    host.update(data, variant=variant)
    return resolve(host)


def arg(recipe: Recipe, flag: str) -> str | None:
    """The value after `flag` in the vLLM argument list (None when the flag is absent)."""
    args = list(recipe.vllm_args)
    return args[args.index(flag) + 1] if flag in args else None
