"""The README's knob and variant tables match group_data/all.py and the catalog."""

from __future__ import annotations

import importlib.machinery
import importlib.util

from rigup import REPO_ROOT
from rigup.desired.catalog import variant_names
from rigup.desired.knobs import load_defaults


def load_script():
    loader = importlib.machinery.SourceFileLoader("readme_tables", str(REPO_ROOT / "scripts" / "readme-tables"))
    spec = importlib.util.spec_from_loader("readme_tables", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def test_readme_tables_are_current():
    readme = (REPO_ROOT / "README.md").read_text()
    assert load_script().render(readme) == readme, "README tables are stale: run scripts/readme-tables"


def test_every_knob_and_variant_is_documented():
    readme = (REPO_ROOT / "README.md").read_text()
    for knob in load_defaults():
        assert f"| `{knob}` |" in readme, knob
    for variant in variant_names():
        assert f"| `{variant}` |" in readme, variant
