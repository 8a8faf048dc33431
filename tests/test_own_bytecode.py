"""rigup caches its own modules' bytecode even under pyinfra's CLI, which turns writing it off for the
whole process (rigup._cache_own_bytecode); the user's own -B / PYTHONDONTWRITEBYTECODE still wins."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import rigup

# What pyinfra_cli.main does before it loads the inventory, then the first rigup import.
UNDER_PYINFRA = "import sys; sys.dont_write_bytecode = True; sys.path.insert(0, sys.argv[1]); import rigup"


def _copy_package(tmp_path: Path) -> Path:
    shutil.copytree(rigup.PACKAGE_DIR, tmp_path / "rigup", ignore=shutil.ignore_patterns("__pycache__", "_deploy"))
    return tmp_path


def _cached(root: Path) -> set[str]:
    """Modules with bytecode in their __pycache__, as paths under the package without .py."""
    return {(p.parent.parent / p.name.split(".")[0]).relative_to(root / "rigup").as_posix()
            for p in (root / "rigup").rglob("__pycache__/*.pyc")}


def _import(root: Path, *flags: str, **env: str) -> None:
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    subprocess.run([sys.executable, *flags, "-c", UNDER_PYINFRA, str(root)], env={**clean, **env}, check=True,
                   cwd=root)


def test_under_pyinfra_every_module_of_the_package_is_compiled(tmp_path: Path) -> None:
    root = _copy_package(tmp_path)
    _import(root)
    cached = _cached(root)
    # modules the import did not load are compiled too: the deploy's tasks import them later
    assert {"desired/plan", "operations/serving", "pyinfra_patches/fact_batching", "rig/rigfetch/fetcher"} <= cached
    sources = {p.relative_to(root / "rigup").with_suffix("").as_posix() for p in (root / "rigup").rglob("*.py")}
    assert cached == sources


def test_the_users_own_choice_is_left_alone(tmp_path: Path) -> None:
    root = _copy_package(tmp_path)
    _import(root, PYTHONDONTWRITEBYTECODE="1")
    _import(root, "-B")
    assert _cached(root) == set()
