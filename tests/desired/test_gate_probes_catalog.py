"""A variant's gate_probes (catalog key, issue 43): which of the health gate's probes its model can answer,
carried from the catalog through the recipe into the release the rig's gate reads (rigup/rig/servingctl.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rigup.desired import catalog
from rigup.desired.catalog import CATALOG_FILE, CatalogError
from rigup.desired.release import release_json
from rigup.rig.servingctl import PROBE_NAMES, Release
from tests.desired.test_chat_request import FAMILY, OMNI, recipe_for, release_of
from tests.desired.test_chat_request import load_with as load_variant_with


def load_with(tmp_path: Path, gate_probes: Any) -> dict[str, Any]:
    return load_variant_with(tmp_path, gate_probes, key="gate_probes")


def test_by_default_every_probe_is_asked_and_the_release_has_no_key() -> None:
    """No new key in the releases of variants that answer every probe: byte-identical, no restart."""
    r = recipe_for("dual")
    assert r.gate_probes is None
    release = release_of(r)
    assert "gate_probes" not in release and "gate_probes" not in release_json(release)
    assert Release(release, "/nonexistent/release.json").gate_probes == list(PROBE_NAMES)


def test_a_subset_travels_from_the_catalog_to_the_rig(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    changed = load_with(tmp_path, ["arithmetic", "recall"])
    monkeypatch.setattr(catalog, "_cached", lambda: changed)
    r = recipe_for(OMNI)
    assert r.gate_probes == ("arithmetic", "recall")
    release = release_of(r)
    assert release["gate_probes"] == ["arithmetic", "recall"]
    assert Release(release, "/nonexistent/release.json").gate_probes == ["arithmetic", "recall"]


def test_naming_every_probe_is_the_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    changed = load_with(tmp_path, list(PROBE_NAMES))
    monkeypatch.setattr(catalog, "_cached", lambda: changed)
    assert "gate_probes" not in release_of(recipe_for(OMNI))


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (["arithmatic"], "{file}: variants.{variant}.gate_probes: unknown probe 'arithmatic' "
                         "(allowed: arithmetic, recall, tool-call, json-shape); did you mean 'arithmetic'?"),
        (["tool_call"], "{file}: variants.{variant}.gate_probes: unknown probe 'tool_call' "
                        "(allowed: arithmetic, recall, tool-call, json-shape); did you mean 'tool-call'?"),
        (["vision"], "{file}: variants.{variant}.gate_probes: unknown probe 'vision' "
                     "(allowed: arithmetic, recall, tool-call, json-shape)"),
        (["recall", "recall"], "{file}: variants.{variant}.gate_probes: 'recall' named "
                               "twice (allowed: arithmetic, recall, tool-call, json-shape, each once)"),
        ("recall", "variants.{variant}.gate_probes: wrong type str"),
    ],
)
def test_the_catalog_checks_gate_probes(tmp_path: Path, value: Any, message: str) -> None:
    with pytest.raises(CatalogError) as caught:
        load_with(tmp_path, value)
    assert str(caught.value) == message.format(file=tmp_path / FAMILY.name, variant=OMNI)
    assert "\n" not in str(caught.value)


def test_the_real_catalog_names_only_known_probes() -> None:
    for name, variant in catalog.load_catalog()["variants"].items():
        assert set(variant.get("gate_probes") or ()) <= set(PROBE_NAMES), name


def test_messages_name_the_catalog_file_as_the_repository_lays_it_out() -> None:
    assert catalog._shown(CATALOG_FILE) == "catalog.yaml"
    assert catalog._shown(FAMILY) == "catalog.d/qwen3-omni-30b-a3b.yaml"
