"""rigfetch ships as one file: a zipapp of the rigup/rig/rigfetch package (rigup.rig.onefile), the same bytes
for the same sources wherever it is built, that the rig's python3 runs and whose modules' bytecode is kept
beside it, used while the archive is the same file and compiled again after an upload."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from rigup.rig.onefile import RIGFETCH_PACKAGE, rigfetch_sha256, rigfetch_zipapp, write_rigfetch, zipapp_bytes
from rigup.rig.rigfetch.manifest import encode_manifest


def _check(archive: Path, state: Path, **env: str) -> dict:
    """`rigfetch.py --check` of an empty manifest, run as a rig runs it."""
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    b64 = encode_manifest({"version": 1, "state_dir": str(state), "models": []})
    proc = subprocess.run([sys.executable, str(archive), "--check", "--manifest-b64", b64], capture_output=True,
                          text=True, env={**clean, **env}, timeout=60, check=True)
    return json.loads(proc.stdout)


def test_the_archive_holds_the_package_with_its_main_at_the_root() -> None:
    names = zipfile.ZipFile(io.BytesIO(rigfetch_zipapp())).namelist()
    modules = sorted(p.name for p in RIGFETCH_PACKAGE.glob("*.py") if p.name != "__main__.py")
    assert sorted(names) == sorted(["__main__.py", *(f"rigfetch/{name}" for name in modules)])
    assert {"rigfetch/fetcher.py", "rigfetch/fleet_server.py", "rigfetch/manifest.py", "rigfetch/registry_auth.py",
            "rigfetch/cli.py"} <= set(names)
    assert rigfetch_zipapp().startswith(b"#!/usr/bin/env python3\n")


def test_the_same_sources_give_the_same_bytes(tmp_path: Path) -> None:
    copy = shutil.copytree(RIGFETCH_PACKAGE, tmp_path / "rigfetch", ignore=shutil.ignore_patterns("__pycache__"))
    for i, path in enumerate(sorted(copy.glob("*.py"))):  # other times and modes, as another checkout has
        os.utime(path, (1_000_000 + i, 2_000_000 + i))
        path.chmod(0o600 if i % 2 else 0o755)
    assert zipapp_bytes(copy) == rigfetch_zipapp()
    (copy / "manifest.py").write_text((copy / "manifest.py").read_text() + "\n# changed\n")
    assert zipapp_bytes(copy) != rigfetch_zipapp()


def test_write_rigfetch_writes_the_archive_once(tmp_path: Path) -> None:
    path = write_rigfetch(tmp_path)
    assert path.read_bytes() == rigfetch_zipapp() and path.stat().st_mode & 0o777 == 0o755
    before = path.stat().st_mtime_ns
    os.utime(path, ns=(before - 10**9, before - 10**9))
    write_rigfetch(tmp_path)  # unchanged: left alone, its bytecode cache stays valid
    assert path.stat().st_mtime_ns == before - 10**9
    assert write_rigfetch().name == "rigfetch.py" and rigfetch_sha256()[:16] in str(write_rigfetch().parent)


def test_bytecode_is_kept_beside_the_archive_and_a_new_upload_is_compiled_again(tmp_path: Path) -> None:
    archive = write_rigfetch(tmp_path)
    assert _check(archive, tmp_path / "state")["script_version"] == 1
    cache = tmp_path / "__pycache__" / f"rigfetch.py.{sys.implementation.cache_tag}"
    cached = sorted(p.name for p in cache.iterdir())
    # --check loads the modules it needs, not the fetch's
    assert cached == ["rigfetch.cli.pyc", "rigfetch.disk.pyc", "rigfetch.log.pyc", "rigfetch.manifest.pyc", "rigfetch.pyc"]
    assert _check(archive, tmp_path / "state")["script_version"] == 1  # from the cache
    # A new version uploaded over it (another size and mtime) runs its own code, not the cached bytecode.
    package = shutil.copytree(RIGFETCH_PACKAGE, tmp_path / "src" / "rigfetch", ignore=shutil.ignore_patterns("__pycache__"))
    manifest = package / "manifest.py"
    manifest.write_text(manifest.read_text().replace("SCRIPT_VERSION = 1\n", "SCRIPT_VERSION = 2\n"))
    archive.write_bytes(zipapp_bytes(package))
    assert _check(archive, tmp_path / "state")["script_version"] == 2


def test_without_bytecode_writing_it_runs_and_writes_nothing(tmp_path: Path) -> None:
    archive = write_rigfetch(tmp_path)
    assert _check(archive, tmp_path / "state", PYTHONDONTWRITEBYTECODE="1")["files"] == 0
    assert not (tmp_path / "__pycache__").exists()
