"""The lock file (rigs.lock.yaml) as data: exact pins for everything rigup puts on a rig from outside,
what a recipe needs pinned, and which of those pins are missing or stale."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from rigup import command
from rigup.desired.fleet_file import fleet_path
from rigup.desired.knobs import knob

LOCK_VERSION = 1
SHA40 = re.compile(r"^[0-9a-f]{40}$")


SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")


SHORT_HEX = re.compile(r"^[0-9a-f]{4,39}$")


# Non-LFS files bigger than this are refused instead of downloaded by the lock tool (the hub always
# publishes a sha256 for LFS files; a huge non-LFS file means something unusual is going on).
MAX_HASHED_DOWNLOAD = 64 * 1024 * 1024
# The command that writes the lock, as it runs from a fresh shell here (.venv/bin/rigup lock in a checkout).
LOCK_COMMAND = f"{command()} lock"
HEADER = """\
# rigup lock file: exact pins for everything rigup puts on a rig from outside.
# Written by `rigup lock` (in a checkout: .venv/bin/rigup lock) on the control machine; commit it next to
# the fleet file. Move one pin on purpose: `rigup lock --upgrade NAME` (prints the difference).
# The deploy refuses to run when an entry a host's variant needs is missing or stale.
"""


class LockError(ValueError):
    """A lock file that cannot be used, or a pin that cannot be resolved; the message says what to do."""


@dataclass(frozen=True)
class GitPin:
    name: str  # "git:<source>"
    url: str
    ref: str  # what the catalog asked for: branch, tag or sha
    commit: str  # full 40-hex sha


@dataclass(frozen=True)
class FilePin:
    path: str
    size: int
    sha256: str


@dataclass(frozen=True)
class ModelPin:
    name: str  # "model:<repo id>"
    repo_id: str
    revision: str  # what the catalog asked for ("main" unless it names one)
    commit: str  # the hub commit the files come from
    files: tuple[FilePin, ...]

    @property
    def total_size(self) -> int:
        return sum(f.size for f in self.files)


@dataclass(frozen=True)
class ImagePin:
    name: str  # "image:<repository>:<tag>"
    repository: str
    tag: str
    digest: str | None  # "sha256:<64 hex>"; None: pinned by tag only


@dataclass
class LockFile:
    """The parsed lock; implements rigup.desired.recipe.Lock (git_commit, model_revision, image_digest)."""

    git: dict[str, GitPin] = field(default_factory=dict)
    models: dict[str, ModelPin] = field(default_factory=dict)
    images: dict[str, ImagePin] = field(default_factory=dict)
    path: Path | None = None

    # rigup.desired.recipe.Lock
    def git_commit(self, name: str) -> str | None:
        pin = self.git.get(name)
        return pin.commit if pin is not None else None

    def model_revision(self, name: str) -> str | None:
        pin = self.models.get(name)
        return pin.commit if pin is not None else None

    def image_digest(self, name: str) -> str | None:
        pin = self.images.get(name)
        return pin.digest if pin is not None else None

    # what the model task needs beyond the protocol
    def model_files(self, name: str) -> tuple[FilePin, ...]:
        pin = self.models.get(name)
        if pin is None:
            raise LockError(f"{self._where()}: no entry for {name}")
        return pin.files

    def entry(self, name: str) -> GitPin | ModelPin | ImagePin | None:
        return self.git.get(name) or self.models.get(name) or self.images.get(name)

    def names(self) -> list[str]:
        return [*sorted(self.git), *sorted(self.models), *sorted(self.images)]

    def _where(self) -> str:
        return str(self.path) if self.path is not None else "lock file"

    # -- serialisation -----------------------------------------------------------------------
    def to_document(self) -> dict[str, Any]:
        return {
            "version": LOCK_VERSION,
            "git": {
                pin.name.removeprefix("git:"): {"url": pin.url, "ref": pin.ref, "commit": pin.commit}
                for pin in sorted(self.git.values(), key=lambda p: p.name)
            },
            "models": {
                pin.repo_id: {
                    "revision": pin.revision,
                    "commit": pin.commit,
                    "files": [
                        {"path": f.path, "size": f.size, "sha256": f.sha256}
                        for f in sorted(pin.files, key=lambda f: f.path)
                    ],
                }
                for pin in sorted(self.models.values(), key=lambda p: p.name)
            },
            "images": {
                f"{pin.repository}:{pin.tag}": {"digest": pin.digest}
                for pin in sorted(self.images.values(), key=lambda p: p.name)
            },
        }

    def dump(self) -> str:
        body = yaml.safe_dump(self.to_document(), sort_keys=False, default_flow_style=False, width=200)
        return HEADER + body

    def save(self, path: Path) -> None:
        path = Path(path)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(self.dump())
        os.replace(tmp, path)
        self.path = path

    @classmethod
    def parse(cls, text: str, where: str = "lock file") -> LockFile:
        try:
            document = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise LockError(f"{where}: not valid YAML: {exc}") from None
        if not isinstance(document, dict) or document.get("version") != LOCK_VERSION:
            raise LockError(f"{where}: expected a mapping with version: {LOCK_VERSION}")
        unknown = set(document) - {"version", "git", "models", "images"}
        if unknown:
            raise LockError(f"{where}: unknown top-level keys {sorted(unknown)}")
        lock = cls()
        for source, entry in _mapping(document.get("git"), f"{where}: git").items():
            ctx = f"{where}: git.{source}"
            entry = _mapping(entry, ctx)
            commit = _text(entry.get("commit"), f"{ctx}.commit")
            if not SHA40.match(commit):
                raise LockError(f"{ctx}.commit must be a full 40-hex commit, got {commit!r}")
            name = f"git:{source}"
            lock.git[name] = GitPin(name, _text(entry.get("url"), f"{ctx}.url"), _text(entry.get("ref"), f"{ctx}.ref"), commit)
        for repo_id, entry in _mapping(document.get("models"), f"{where}: models").items():
            ctx = f"{where}: models.{repo_id}"
            entry = _mapping(entry, ctx)
            commit = _text(entry.get("commit"), f"{ctx}.commit")
            if not SHA40.match(commit):
                raise LockError(f"{ctx}.commit must be a full 40-hex commit, got {commit!r}")
            raw_files = entry.get("files")
            if not isinstance(raw_files, list) or not raw_files:
                raise LockError(f"{ctx}.files must be a non-empty list")
            files: list[FilePin] = []
            seen: set[str] = set()
            for item in raw_files:
                item = _mapping(item, f"{ctx}.files[]")
                path = _text(item.get("path"), f"{ctx}.files[].path")
                size = item.get("size")
                digest = _text(item.get("sha256"), f"{ctx}.files[{path}].sha256")
                if not is_safe_relpath(path) or path in seen:
                    raise LockError(f"{ctx}: bad or duplicate file path {path!r}")
                if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                    raise LockError(f"{ctx}.files[{path}].size must be a non-negative integer")
                if not SHA256_HEX.match(digest):
                    raise LockError(f"{ctx}.files[{path}].sha256 must be 64 lowercase hex digits")
                seen.add(path)
                files.append(FilePin(path, size, digest))
            name = f"model:{repo_id}"
            lock.models[name] = ModelPin(
                name, str(repo_id), _text(entry.get("revision"), f"{ctx}.revision"), commit, tuple(files)
            )
        for ref, entry in _mapping(document.get("images"), f"{where}: images").items():
            ctx = f"{where}: images.{ref}"
            entry = _mapping(entry, ctx)
            repository, sep, tag = str(ref).rpartition(":")
            if not sep or not repository or not tag:
                raise LockError(f"{ctx}: expected <repository>:<tag>")
            digest = entry.get("digest")
            if digest is not None and (not isinstance(digest, str) or not DIGEST.match(digest)):
                raise LockError(f"{ctx}.digest must be sha256:<64 hex> or null, got {digest!r}")
            name = f"image:{repository}:{tag}"
            lock.images[name] = ImagePin(name, repository, tag, digest)
        return lock

    @classmethod
    def load(cls, path: Path | str) -> LockFile:
        path = Path(path)
        try:
            text = path.read_text()
        except FileNotFoundError:
            raise LockError(
                f"{path}: lock file not found; run `{LOCK_COMMAND}` on the control machine and commit it"
            ) from None
        lock = cls.parse(text, str(path))
        lock.path = path
        return lock


def _mapping(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise LockError(f"{where}: expected a mapping")
    return value


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise LockError(f"{where}: expected a non-empty string")
    return value


def is_safe_relpath(path: str) -> bool:
    """Whether `path` is a non-empty relative POSIX path with no empty, `.` or `..` part and no backslash."""
    parts = path.split("/")
    return bool(path) and not path.startswith("/") and "\\" not in path and all(p not in ("", ".", "..") for p in parts)


@dataclass(frozen=True)
class GitNeed:
    name: str
    url: str
    ref: str
    full_clone: bool


@dataclass(frozen=True)
class ModelNeed:
    name: str
    repo_id: str
    revision: str
    endpoint: str
    gated: bool


@dataclass(frozen=True)
class ImageNeed:
    name: str
    repository: str
    tag: str
    registry: str
    # the registry speaks plain HTTP: it is in docker_insecure_registries, as Docker is told of such a mirror
    plain_http: bool = False


Need = GitNeed | ModelNeed | ImageNeed


def need_problem(need: Need, lock: LockFile) -> str | None:
    """Why the lock cannot serve this need (missing or stale entry), or None."""
    if isinstance(need, GitNeed):
        pin = lock.git.get(need.name)
        if pin is None:
            return f"{need.name}: no entry"
        if pin.url != need.url:
            return f"{need.name}: locked from {pin.url}, the host uses {need.url}"
        if pin.ref != need.ref:
            # need.ref is the catalog's, or the host's source_refs override of it.
            return f"{need.name}: locked for ref {pin.ref!r}, the host's recipe now asks for {need.ref!r}"
        if SHA40.match(need.ref) and pin.commit != need.ref:
            return f"{need.name}: locked commit {pin.commit} differs from the recipe's pin {need.ref}"
        return None
    if isinstance(need, ModelNeed):
        pin = lock.models.get(need.name)
        if pin is None:
            return f"{need.name}: no entry"
        if pin.revision != need.revision:
            return f"{need.name}: locked for revision {pin.revision!r}, the catalog now asks for {need.revision!r}"
        if SHA40.match(need.revision) and pin.commit != need.revision:
            return f"{need.name}: locked commit {pin.commit} differs from the catalog's pin {need.revision}"
        return None
    pin = lock.images.get(need.name)
    if pin is None:
        return f"{need.name}: no entry"
    return None


def fleet_dir() -> Path:
    return fleet_path().parent


def lock_path(lock_file: str, base_dir: Path | None = None) -> Path:
    """The lock file a knob value names: absolute, or relative to the fleet file's directory."""
    path = Path(lock_file).expanduser()
    if path.is_absolute():
        return path
    return (base_dir if base_dir is not None else fleet_dir()) / path


_LOADED: dict[Path, tuple[int, LockFile]] = {}


def deploy_lock(host_data: Mapping[str, Any], base_dir: Path | None = None) -> LockFile:
    """The lock for a deploy (loaded once per file version; tasks run once per host)."""
    path = lock_path(str(knob(host_data, "lock_file")), base_dir)
    try:
        mtime = path.stat().st_mtime_ns
    except FileNotFoundError:
        raise LockError(
            f"{path}: lock file not found (knob lock_file); run `{LOCK_COMMAND}` on the control "
            "machine and commit the file next to the fleet file"
        ) from None
    cached = _LOADED.get(path)
    if cached is not None and cached[0] == mtime:
        return cached[1]
    lock = LockFile.load(path)
    _LOADED[path] = (mtime, lock)
    return lock


# -- the deploy without a usable lock ------------------------------------------------------------

# The deploy phases that need pins, in order (preflight, driver, Docker and the toolkit need none).
PINNED_PHASES = ("sources", "model", "serving")


def phase_pins(phase: str, recipe: Any) -> str:
    """What the lock pins for one deploy phase of this recipe, in words."""
    if phase == "sources":
        names = ", ".join(f"{s.name} ({s.ref})" for s in recipe.sources) or "no source"
        return f"the git commits of {names} that variant {recipe.variant} checks out"
    if phase == "model":
        repos = ", ".join(m.repo_id for m in recipe.models)
        return f"the model revisions of {repos} and the SHA-256 of every file of them"
    if phase == "serving":
        return (
            f"the image digest of {recipe.image.repository}:{recipe.image.tag} and the release "
            "(release.json: image, commits, model files) built from those pins"
        )
    raise ValueError(f"phase {phase!r} needs no pins (known: {', '.join(PINNED_PHASES)})")


def phase_without_lock(phase: str, recipe: Any, problem: str | None, dry: bool) -> str:
    """What a phase that needs pins says on a host without a usable lock, in one line: that it is
    skipped (dry run) or cannot run, what the lock pins for it, why there is none, and the command
    that makes it. The task file adds the host (pyinfra's prefix, or the name in a DeployError)."""
    why = (problem or "no usable lock file").rstrip(". ")
    if LOCK_COMMAND not in why:
        why += f"; run `{LOCK_COMMAND}` on the control machine and commit the file"
    head = f"{phase.upper()} SKIPPED in this dry run (a real run stops here)" if dry else f"{phase} cannot run"
    return f"{head}: it needs the lock, which pins {phase_pins(phase, recipe)}. {why}"
