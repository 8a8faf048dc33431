"""rigfetch as the one file the tasks upload: a zipapp (PEP 441, what `python3 -m zipapp` makes) of the
rigup/rig/rigfetch package, its __main__.py at the archive's root and the package beside it as rigfetch/.
The same sources give the same bytes on any machine (entries sorted, fixed times and modes, stored
uncompressed), so a converged re-run uploads nothing and the rig's copy is checked by its SHA-256."""

from __future__ import annotations

import functools
import hashlib
import io
import tempfile
import zipfile
from pathlib import Path

RIGFETCH_PACKAGE = Path(__file__).with_name("rigfetch")
SHEBANG = b"#!/usr/bin/env python3\n"
EPOCH = (1980, 1, 1, 0, 0, 0)  # the earliest time a zip entry can hold


def zipapp_bytes(package: Path) -> bytes:
    """The archive of `package`: its __main__.py at the root, its other modules under <package name>/."""
    sources = sorted(p for p in package.glob("*.py"))
    out = io.BytesIO()
    out.write(SHEBANG)
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED) as archive:
        for path in sources:
            name = "__main__.py" if path.name == "__main__.py" else f"{package.name}/{path.name}"
            entry = zipfile.ZipInfo(name, date_time=EPOCH)
            entry.external_attr = 0o644 << 16
            entry.create_system = 3  # unix, whatever machine builds it
            archive.writestr(entry, path.read_bytes())
    return out.getvalue()


@functools.cache
def rigfetch_zipapp() -> bytes:
    return zipapp_bytes(RIGFETCH_PACKAGE)


@functools.cache
def rigfetch_sha256() -> str:
    """What the rig's copy must hash to (rigup.facts.model.ModelFiles reads it there)."""
    return hashlib.sha256(rigfetch_zipapp()).hexdigest()


def write_rigfetch(directory: Path | None = None) -> Path:
    """rigfetch.py, the archive, written into `directory` (tests and benchmarks run it as a rig would); by
    default into one named by its hash under the system's temp dir, shared by the processes of a run."""
    if directory is None:
        directory = Path(tempfile.gettempdir()) / f"rigup-rigfetch-{rigfetch_sha256()[:16]}"
        directory.mkdir(exist_ok=True)
    path = directory / "rigfetch.py"
    if not path.is_file() or path.read_bytes() != rigfetch_zipapp():
        partial = path.with_name(f".rigfetch.py.{hashlib.sha256(str(path).encode()).hexdigest()[:8]}")
        partial.write_bytes(rigfetch_zipapp())
        partial.chmod(0o755)
        partial.replace(path)
    return path
