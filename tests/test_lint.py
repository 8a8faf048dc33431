"""The repository passes ruff with the rules pyproject.toml sets ([tool.ruff])."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_reports_nothing() -> None:
    # A test dependency (pyproject.toml's test extra, installed by scripts/setup): missing is a broken
    # setup, not a reason to skip.
    assert importlib.util.find_spec("ruff") is not None, (
        f"ruff is not installed for {sys.executable}: run scripts/setup (or pip install -e '.[test]')"
    )
    # --no-cache: a test run leaves no .ruff_cache behind
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, f"ruff check (exit {result.returncode}):\n{result.stdout}{result.stderr}"
