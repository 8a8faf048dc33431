"""A variant's chat_request (catalog key): fields every chat request to its server must carry, carried from
the catalog through the recipe into the release the rig's health gate reads (rigup/rig/servingctl.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from rigup.desired.catalog import CATALOG_DIR, CATALOG_FILE, CatalogError, load_catalog_file
from rigup.desired.knobs import load_defaults
from rigup.desired.recipe import Recipe, resolve
from rigup.desired.release import build_release, release_json
from rigup.desired.render import render_variant
from rigup.rig.servingctl import GATE_REQUEST_KEYS, Release

OMNI = "qwen-omni-dual-autoround-int4-omni"
FAMILY = CATALOG_DIR / "qwen3-omni-30b-a3b.yaml"


def recipe_for(variant: str) -> Recipe:
    return resolve({**load_defaults(), "variant": variant})


def release_of(recipe: Recipe) -> dict[str, Any]:
    rendered = render_variant(recipe)
    return build_release(recipe, {p: f.content for p, f in rendered.items()}, api_key_present=False, secret_files={})


def load_with(tmp_path: Path, value: Any, key: str = "chat_request") -> dict[str, Any]:
    """The catalog with the omni variant's `key` set to `value` (its family file copied to tmp_path)."""
    raw = yaml.safe_load(FAMILY.read_text())
    raw["variants"][OMNI][key] = value
    changed = tmp_path / FAMILY.name
    changed.write_text(yaml.safe_dump(raw, sort_keys=False))
    others = [p for p in CATALOG_DIR.glob("*.yaml") if p.name != FAMILY.name]
    return load_catalog_file(CATALOG_FILE, [*others, changed])


def test_the_omni_variant_asks_for_text_output() -> None:
    # club-3090 models/qwen3-omni-30b-a3b/vllm-omni/README.md@4a29ab57, step 4: "modalities": ["text"] is not optional.
    r = recipe_for(OMNI)
    assert dict(r.chat_request) == {"modalities": ["text"]}
    release = release_of(r)
    assert release["chat_request"] == {"modalities": ["text"]}


def test_a_variant_without_chat_request_has_a_release_without_the_key() -> None:
    """No new key in other variants' releases: their release.json stays byte-identical (no restart)."""
    r = recipe_for("dual")
    assert dict(r.chat_request) == {}
    assert "chat_request" not in release_of(r)
    assert "chat_request" not in release_json(release_of(r))


def test_the_recipe_holds_a_copy_not_the_catalogs_value() -> None:
    r = recipe_for(OMNI)
    r.chat_request["modalities"].append("audio")  # type: ignore[index]
    assert dict(recipe_for(OMNI).chat_request) == {"modalities": ["text"]}


def test_the_rig_reads_it_from_the_release(tmp_path: Path) -> None:
    path = tmp_path / "release.json"
    path.write_text(release_json(release_of(recipe_for(OMNI))))
    assert Release.load(str(path)).chat_request == {"modalities": ["text"]}
    path.write_text(release_json(release_of(recipe_for("dual"))))
    assert Release.load(str(path)).chat_request == {}


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"temperature": 0.7}, "none of the health gate's own"),
        ({"messages": []}, "none of the health gate's own"),
        ({}, "request fields by name"),
        ({"when": "2026-01-01"}, None),  # a string: fine
        ({"modalities": {"text"}}, "a JSON value"),
        ({"extra": {1: "x"}}, "a JSON value"),
        ({"n_inf": float("inf")}, "a JSON value"),
        (["modalities", "text"], "wrong type list"),
    ],
)
def test_the_catalog_checks_chat_request(tmp_path: Path, value: Any, message: str | None) -> None:
    if message is None:
        assert load_with(tmp_path, value)["variants"][OMNI]["chat_request"] == value
        return
    with pytest.raises(CatalogError, match=rf"variants\.{OMNI}\.chat_request"):
        try:
            load_with(tmp_path, value)
        except CatalogError as exc:
            assert message in str(exc), exc
            raise


def test_gate_keys_are_the_ones_the_gate_sends() -> None:
    """The catalog refuses exactly the fields the gate sets itself (servingctl's request body)."""
    import inspect

    from rigup.rig import servingctl

    source = inspect.getsource(servingctl.chat_completion)
    sent = {key for key in GATE_REQUEST_KEYS if f'"{key}":' in source}
    assert sent == {"model", "messages", "max_tokens", "temperature", "seed", "chat_template_kwargs"}
