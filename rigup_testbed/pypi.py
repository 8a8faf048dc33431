"""An offline PyPI mirror for the test bed: the wheels a hash-pinned requirements file needs on the
test-bed hosts, laid out as a PEP 503 simple index the hub serves (rigup_testbed/hub.py, service pypi).

The gateway installs LiteLLM's proxy with
`pip install --require-hashes --no-deps -r files/gateway/requirements.txt --index-url <index>`; the test
bed's hosts (Debian 12: CPython 3.11.2, glibc 2.36, x86_64) cannot reach PyPI, so the hub serves exactly
the files that command fetches there:

  <served dir>/                      build_index() returns it; serve it over HTTP, index URL <base>/simple
    simple/index.html                one link per project
    simple/<normalized-name>/index.html   links ../../packages/<file>#sha256=<hash>
    packages/*.whl                   one wheel per selected pin, as pip downloaded it
    requirements.txt                 the selected pins (markers evaluated away), what pip downloaded
    index.json                       what was built: key, target, files with their sha256 and size

Which lines apply is decided by their environment markers evaluated for the target (TARGET_ENVIRONMENT,
not the interpreter running this: the control machine may run another Python); which files, by the
target's wheel tags (cp311, abi3 or none, manylinux up to glibc 2.36, x86_64). A build is cached under
`out_dir/<key>/` (key: hash of the requirements text and the target), made in a temporary directory
and renamed into place under a lock, and reused without any network once there; wheels an earlier
build already holds (another key in `out_dir`) are hard-linked instead of downloaded again.

    python -m rigup_testbed.pypi [-v] REQUIREMENTS OUT_DIR      builds (or reuses) and prints the served dir

A build is quiet: one line when pip starts downloading and one summary line when it is done, each naming
the log (`out_dir/build-<key>.log`) that holds pip's whole output. pip's warnings (on this machine, one
per project from its own pip configuration: an extra index in /etc/pip.conf that is not there) are
counted, by kind, in the summary. With -v (or RIGUP_VERBOSE=1, as `rigup sandbox up -v` sets) every line
of pip's is relayed too.
"""

from __future__ import annotations

import fcntl
import hashlib
import html
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from packaging.markers import Marker
from packaging.requirements import InvalidRequirement, Requirement
from packaging.tags import Tag, compatible_tags, cpython_tags
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

from rigup_testbed.state import TestbedError

BUILD_FORMAT = 1  # bump when the layout changes in a way the key cannot see

# The test-bed hosts' interpreter as PEP 508 markers see it: Debian 12's python3 (3.11.2) on x86_64.
# Every key is given, so nothing of the control machine's interpreter leaks into the evaluation.
TARGET_ENVIRONMENT: dict[str, str] = {
    "implementation_name": "cpython",
    "implementation_version": "3.11.2",
    "os_name": "posix",
    "platform_machine": "x86_64",
    "platform_release": "",
    "platform_system": "Linux",
    "platform_version": "",
    "python_full_version": "3.11.2",
    "platform_python_implementation": "CPython",
    "python_version": "3.11",
    "sys_platform": "linux",
    "extra": "",
}
PYTHON_VERSION = (3, 11)
IMPLEMENTATION = "cp"
ABIS = ("cp311", "abi3", "none")
# Debian 12 has glibc 2.36: its pip takes manylinux_2_5 ... manylinux_2_36 (the legacy names are aliases
# of 2_5, 2_12 and 2_17), best first as pip ranks them there.
GLIBC_MINOR = 36
PLATFORMS: tuple[str, ...] = (
    *(f"manylinux_2_{minor}_x86_64" for minor in range(GLIBC_MINOR, 4, -1)),
    "manylinux2014_x86_64",
    "manylinux2010_x86_64",
    "manylinux1_x86_64",
    "linux_x86_64",
)
OUTPUT_TAIL_LINES = 60  # of pip's output, quoted when it fails
VERBOSE_ENV = "RIGUP_VERBOSE"  # "1": relay every line of pip's output (rigup sandbox up -v)
COMMENT = re.compile(r"(^|\s+)#.*$")  # as pip strips comments


class IndexBuildError(TestbedError):
    """The requirements cannot be turned into an index (bad line, pin not fetchable, wrong file)."""


@dataclass(frozen=True)
class Pin:
    """One requirement line: `name[extras]==version ; marker --hash=sha256:...`."""

    name: str  # canonical (PEP 503 normalized)
    version: str
    requirement: str  # the line without marker and hashes, as pip is given it
    marker: str | None
    hashes: tuple[str, ...]  # sha256 hex digests, any of which the file may have

    def applies(self, environment: Mapping[str, str]) -> bool:
        return self.marker is None or Marker(self.marker).evaluate(dict(environment))

    def line(self) -> str:
        return " ".join([self.requirement, *(f"--hash=sha256:{h}" for h in self.hashes)])


def _logical_lines(text: str) -> Iterable[str]:
    """Requirement lines as pip reads them: `\\` continuations joined (not of comment lines), then
    comments (`#` at the start or after whitespace, to the end of the joined line) dropped."""
    joined: list[str] = []
    pending: list[str] = []
    for line in text.splitlines():
        if line.endswith("\\") and not COMMENT.match(line):
            pending.append(line[:-1])
            continue
        joined.append("".join([*pending, line]))
        pending = []
    if pending:
        joined.append("".join(pending))
    for line in joined:
        line = COMMENT.sub("", line).strip()
        if line:
            yield line


def parse_requirements(text: str) -> list[Pin]:
    """Every line of a hash-pinned requirements file (pip's format as `uv pip compile --generate-hashes`
    writes it). Anything that --require-hashes would refuse, or that this mirror cannot serve
    (options other than --hash, URLs, unpinned lines), is an error."""
    pins = []
    for line in _logical_lines(text):
        head, sep, options = line.partition(" --")
        tokens = (sep.strip() + options).split() if sep else []
        hashes = []
        i = 0
        while i < len(tokens):
            token = tokens[i]
            if token == "--hash" and i + 1 < len(tokens):
                token, i = f"--hash={tokens[i + 1]}", i + 1
            if not token.startswith("--hash=sha256:"):
                raise IndexBuildError(f"unsupported option {token!r} in requirement line: {line}")
            hashes.append(token.removeprefix("--hash=sha256:").lower())
            i += 1
        try:
            req = Requirement(head)
        except InvalidRequirement as exc:
            raise IndexBuildError(f"not a requirement: {line} ({exc})") from exc
        specs = list(req.specifier)
        if req.url or len(specs) != 1 or specs[0].operator != "==" or "*" in specs[0].version:
            raise IndexBuildError(f"not pinned with ==VERSION: {line}")
        if not hashes:
            raise IndexBuildError(f"no --hash for {head}: pip --require-hashes would refuse it")
        extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
        pins.append(Pin(
            name=canonicalize_name(req.name),
            version=specs[0].version,
            requirement=f"{req.name}{extras}=={specs[0].version}",
            marker=str(req.marker) if req.marker is not None else None,
            hashes=tuple(hashes),
        ))  # fmt: skip
    return pins


def select_pins(pins: Iterable[Pin], environment: Mapping[str, str] = TARGET_ENVIRONMENT) -> list[Pin]:
    """The pins whose markers hold in `environment`; two of one project holding is an error (pip on the
    host would refuse the double requirement)."""
    selected: dict[str, Pin] = {}
    for pin in pins:
        if not pin.applies(environment):
            continue
        if pin.name in selected:
            raise IndexBuildError(f"{pin.name} is pinned twice for the target: "
                                  f"{selected[pin.name].requirement} and {pin.requirement}")
        selected[pin.name] = pin
    return list(selected.values())


def target_tags() -> set[Tag]:
    """The wheel tags pip on a test-bed host accepts."""
    interpreter = f"{IMPLEMENTATION}{PYTHON_VERSION[0]}{PYTHON_VERSION[1]}"
    return {*cpython_tags(PYTHON_VERSION, abis=list(ABIS), platforms=list(PLATFORMS)),
            *compatible_tags(PYTHON_VERSION, interpreter=interpreter, platforms=list(PLATFORMS))}


def index_key(requirements_text: str) -> str:
    blob = json.dumps({"format": BUILD_FORMAT, "requirements": requirements_text, "environment": TARGET_ENVIRONMENT,
                       "python": list(PYTHON_VERSION), "implementation": IMPLEMENTATION, "abis": list(ABIS),
                       "platforms": list(PLATFORMS)}, sort_keys=True)  # fmt: skip
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _progress(message: str) -> None:
    print(f"pypi: {message}", file=sys.stderr, flush=True)


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0")


def warnings_summary(warnings: Iterable[str]) -> str:
    """pip's warnings counted by kind (quoted names, which differ per project, left out), most first:
    `70 x "Location '...' is ignored: it is neither a file nor a directory."`; "" for none."""
    kinds: dict[str, int] = {}
    for warning in warnings:
        kind = re.sub(r"'[^']*'", "'...'", warning.removeprefix("WARNING: ").strip())
        kinds[kind] = kinds.get(kind, 0) + 1
    ranked = sorted(kinds.items(), key=lambda item: -item[1])
    return "; ".join(f'{count} x "{kind}"' for kind, count in ranked)


def _wheel_of(filename: str) -> tuple[str, Version, frozenset[Tag]]:
    name, version, _build, tags = parse_wheel_filename(filename)
    return str(name), version, frozenset(tags)


def _fits(pin: Pin, filename: str, tags: set[Tag]) -> bool:
    try:
        name, version, file_tags = _wheel_of(filename)
    except ValueError:
        return False
    return name == pin.name and version == Version(pin.version) and bool(file_tags & tags)


def _link_from_earlier_builds(out_dir: Path, pins: list[Pin], packages: Path, tags: set[Tag]) -> set[str]:
    """Hard-link into `packages` the wheels that complete builds of other keys hold for these pins (same
    project, version, a pinned hash, a target tag); returns the names of the pins so provided."""
    known: dict[str, Path] = {}  # sha256 -> a file with it
    for index in sorted(out_dir.glob("*/index.json")):
        if index.parent.name.startswith("."):
            continue  # another key's build, renamed away any moment
        try:
            files = json.loads(index.read_text())["files"]
        except (OSError, ValueError, KeyError):
            continue
        for entry in files:
            path = index.parent / "packages" / entry["filename"]
            if path.is_file():
                known.setdefault(entry["sha256"], path)
    provided = set()
    for pin in pins:
        for digest in pin.hashes:
            path = known.get(digest)
            if path is not None and _fits(pin, path.name, tags):
                try:
                    os.link(path, packages / path.name)
                except OSError:
                    shutil.copy2(path, packages / path.name)
                provided.add(pin.name)
                break
    return provided


def _pip_download(pins: list[Pin], packages: Path, work: Path, log: Path) -> list[str]:
    """pip download the pins' wheels for the target into `packages`; pip's output goes to `log` (and, with
    verbose(), to stderr line by line). Returns pip's warnings."""
    wanted = work / "download.txt"
    wanted.write_text("".join(f"{pin.line()}\n" for pin in pins))
    cmd = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--no-input",
           "--progress-bar", "off", "--only-binary=:all:", "--no-deps", "--require-hashes",
           "--python-version", ".".join(map(str, PYTHON_VERSION)), "--implementation", IMPLEMENTATION,
           *(arg for abi in ABIS for arg in ("--abi", abi)),
           *(arg for platform in PLATFORMS for arg in ("--platform", platform)),
           "--dest", str(packages), "-r", str(wanted)]  # fmt: skip
    tail: deque[str] = deque(maxlen=OUTPUT_TAIL_LINES)
    warnings: list[str] = []
    collected = 0
    relay = verbose()
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=work)
    except OSError as exc:
        raise IndexBuildError(f"cannot run pip ({sys.executable} -m pip): {exc}") from exc
    assert proc.stdout is not None
    with proc, log.open("w") as record:
        record.write(f"$ {' '.join(cmd)}\n")
        for raw in proc.stdout:
            line = raw.rstrip()
            record.write(line + "\n")
            tail.append(line)
            if line.startswith("WARNING: "):
                warnings.append(line)
            if not relay:
                continue
            if line.startswith("Collecting "):
                collected += 1
                _progress(f"[{collected}/{len(pins)}] {line.removeprefix('Collecting ')}")
            elif line.strip().startswith(("Downloading ", "Saved ", "File was already downloaded")):
                _progress(f"    {line.strip()}")
            elif line.strip():
                _progress(f"  pip: {line.strip()}")
    if proc.returncode != 0:
        raise IndexBuildError(
            f"pip download failed (exit {proc.returncode}) for the wheels of {len(pins)} pins (all of pip's "
            f"output: {log}):\n  {' '.join(cmd)}\n" + "\n".join(tail)
        )
    return warnings


def _write_simple_index(dest: Path, files: list[dict[str, str | int]]) -> None:
    simple = dest / "simple"
    simple.mkdir()
    by_project: dict[str, list[dict[str, str | int]]] = {}
    for entry in files:
        by_project.setdefault(str(entry["name"]), []).append(entry)

    def page(title: str, links: list[tuple[str, str]]) -> str:
        body = "".join(f'    <a href="{html.escape(href)}">{html.escape(text)}</a><br>\n' for href, text in links)
        return ("<!DOCTYPE html>\n<html>\n  <head>\n    <meta name=\"pypi:repository-version\" content=\"1.0\">\n"
                f"    <title>{html.escape(title)}</title>\n  </head>\n  <body>\n    <h1>{html.escape(title)}</h1>\n"
                f"{body}  </body>\n</html>\n")  # fmt: skip

    projects = sorted(by_project)
    (simple / "index.html").write_text(page("Simple index", [(f"{p}/", p) for p in projects]))
    for project in projects:
        links = [(f"../../packages/{urllib.parse.quote(str(e['filename']))}#sha256={e['sha256']}", str(e["filename"]))
                 for e in sorted(by_project[project], key=lambda e: str(e["filename"]))]
        (simple / project).mkdir()
        (simple / project / "index.html").write_text(page(f"Links for {project}", links))


def _build(dest: Path, out_dir: Path, requirements_text: str, key: str) -> None:
    started = time.monotonic()
    log = out_dir / f"build-{key}.log"
    pins = select_pins(parse_requirements(requirements_text))
    tags = target_tags()
    packages = dest / "packages"
    packages.mkdir()
    reused = _link_from_earlier_builds(out_dir, pins, packages, tags)
    missing = [pin for pin in pins if pin.name not in reused]
    warnings: list[str] = []
    if missing:
        _progress(f"the gateway's wheels for the hub's PyPI mirror: {len(pins)} pins apply to CPython "
                  f"{TARGET_ENVIRONMENT['python_full_version']} linux x86_64, {len(reused)} linked from earlier "
                  f"builds, downloading {len(missing)} (pip's output: {log})")
        warnings = _pip_download(missing, packages, dest, log)
        (dest / "download.txt").unlink()
    # One file per pin, with a pinned hash and a target tag: what pip on the host will take, and nothing else.
    by_name: dict[str, list[Path]] = {}
    for path in packages.iterdir():
        try:
            by_name.setdefault(_wheel_of(path.name)[0], []).append(path)
        except ValueError as exc:
            raise IndexBuildError(f"not a wheel in the download: {path.name}") from exc
    files: list[dict[str, str | int]] = []
    for pin in pins:
        found = by_name.pop(pin.name, [])
        if len(found) != 1 or not _fits(pin, found[0].name, tags):
            raise IndexBuildError(f"expected one target wheel of {pin.requirement}, got {[p.name for p in found]}")
        digest = _sha256(found[0])
        if digest not in pin.hashes:
            raise IndexBuildError(f"{found[0].name} has sha256 {digest}, not one pinned for {pin.requirement}")
        files.append({"name": pin.name, "version": pin.version, "filename": found[0].name, "sha256": digest,
                      "size": found[0].stat().st_size})
    if by_name:
        raise IndexBuildError(f"files for no selected pin in the download: {sorted(by_name)}")
    _write_simple_index(dest, files)
    (dest / "requirements.txt").write_text("".join(f"{pin.line()}\n" for pin in pins))
    index = {"key": key, "format": BUILD_FORMAT, "environment": TARGET_ENVIRONMENT, "abis": list(ABIS),
             "platforms": list(PLATFORMS), "files": files, "bytes": sum(int(f["size"]) for f in files),
             "build_seconds": round(time.monotonic() - started, 2)}  # fmt: skip
    (dest / "index.json").write_text(json.dumps(index, indent=1) + "\n")
    warned = (f"; pip's warnings (this machine's pip configuration: pip config list): {warnings_summary(warnings)}"
              if warnings else "")
    _progress(f"mirror built: {len(files)} wheels, {index['bytes'] / 1e6:.1f} MB, in {index['build_seconds']:.1f}s"
              f"{warned}" + (f" (log: {log})" if missing else ""))


def build_index(requirements: Path, out_dir: Path) -> Path:
    """Build (or reuse) the simple index of the wheels `requirements` needs on a test-bed host; returns
    the directory to serve (the index URL is <base>/simple). See the module docstring for the layout."""
    text = Path(requirements).read_text()
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    key = index_key(text)
    served = out_dir / key
    with open(out_dir / f".{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (served / "index.json").is_file():
            return served
        # Holding the lock, any building directory of this key is a dead builder's leftover.
        for stale in out_dir.glob(f".{key}.building-*"):
            shutil.rmtree(stale, ignore_errors=True)
        building = Path(tempfile.mkdtemp(prefix=f".{key}.building-", dir=out_dir))
        try:
            _build(building, out_dir, text, key)
            building.chmod(0o755)  # mkdtemp makes it 0700; the hub's server may run as another user
            if served.exists():  # incomplete (no index.json): not from this code, which renames whole builds
                shutil.rmtree(served)
            building.rename(served)
        finally:
            shutil.rmtree(building, ignore_errors=True)
    return served


def main(argv: list[str]) -> int:
    if argv[:1] == ["-v"]:
        os.environ[VERBOSE_ENV] = "1"
        argv = argv[1:]
    if len(argv) != 2:
        print("usage: python -m rigup_testbed.pypi [-v] REQUIREMENTS OUT_DIR", file=sys.stderr)
        return 2
    try:
        print(build_index(Path(argv[0]), Path(argv[1])))
    except IndexBuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
