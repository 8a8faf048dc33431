"""The lock file (rigs.lock.yaml): exact pins for everything rigup puts on a rig from outside.

`python -m rigup lock` runs on the control machine. It reads the fleet, resolves the recipe of every
variant in use and pins what each one needs:

  git:<source>       branch/tag/short sha -> full commit (git ls-remote; full shas are checked to exist)
  model:<repo id>    revision ("main") -> hub commit + every file's path, size and SHA-256 (the hub's
                     LFS sha256; small non-LFS files are downloaded and hashed, checked against their
                     git blob id)
  image:<repo>:<tag> the tag, and its registry digest when known (--image-digests asks the registry)

The deploy reads only the lock (`deploy_lock`, `require_locked`): a missing or stale entry stops the
run before anything changes, so every rig gets the same bytes. `lock` keeps existing pins and adds what
is missing or stale; `lock --upgrade [NAME ...]` moves pins on purpose and prints the difference.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import stat
import sys
import tempfile
import urllib.parse
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:  # only for hints: the functions below import rigup.recipe lazily
    from rigup.interconnect import Topology
    from rigup.recipe import Recipe

LOCK_VERSION = 1
SHA40 = re.compile(r"^[0-9a-f]{40}$")
SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
SHORT_HEX = re.compile(r"^[0-9a-f]{4,39}$")
# Non-LFS files bigger than this are refused instead of downloaded by the lock tool (the hub always
# publishes a sha256 for LFS files; a huge non-LFS file means something unusual is going on).
MAX_HASHED_DOWNLOAD = 64 * 1024 * 1024
HEADER = """\
# rigup lock file: exact pins for everything rigup puts on a rig from outside.
# Written by `python -m rigup lock` on the control machine; commit it next to the fleet file.
# Move one pin on purpose: `python -m rigup lock --upgrade NAME` (prints the difference).
# The deploy refuses to run when an entry a host's variant needs is missing or stale.
"""


class LockError(ValueError):
    """A lock file that cannot be used, or a pin that cannot be resolved; the message says what to do."""


# ------------------------------------------------------------------------------------------
# data


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
    """The parsed lock; implements rigup.recipe.Lock (git_commit, model_revision, image_digest)."""

    git: dict[str, GitPin] = field(default_factory=dict)
    models: dict[str, ModelPin] = field(default_factory=dict)
    images: dict[str, ImagePin] = field(default_factory=dict)
    path: Path | None = None

    # rigup.recipe.Lock
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
                if not _safe_relpath(path) or path in seen:
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
                f"{path}: lock file not found; run `python -m rigup lock` on the control machine and commit it"
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


def _safe_relpath(path: str) -> bool:
    parts = path.split("/")
    return bool(path) and not path.startswith("/") and "\\" not in path and all(p not in ("", ".", "..") for p in parts)


# ------------------------------------------------------------------------------------------
# what a recipe needs


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


Need = GitNeed | ModelNeed | ImageNeed


def model_revision_wanted(model_key: str) -> str:
    """The revision the catalog asks for (a `revision:` on the model entry, else "main")."""
    from rigup.catalog import load_catalog

    spec = load_catalog()["models"].get(model_key) or {}
    return str(spec.get("revision") or "main")


def needs_for(recipe: Any, host_data: Mapping[str, Any]) -> list[Need]:
    """Everything the recipe's variant pulls from outside, as lock entries to have."""
    out: list[Need] = [ImageNeed(recipe.image.lock_name, recipe.image.repository, recipe.image.tag, recipe.image.registry)]
    for source in recipe.sources:
        out.append(GitNeed(source.lock_name, source.git_url, source.ref, source.full_clone))
    endpoint = str(host_data.get("hf_endpoint") or "https://huggingface.co").rstrip("/")
    for model in recipe.models:
        out.append(ModelNeed(model.lock_name, model.repo_id, model_revision_wanted(model.name), endpoint, model.gated))
    return out


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


def lock_problems(recipe: Any, host_data: Mapping[str, Any], lock: LockFile) -> list[str]:
    return [p for p in (need_problem(n, lock) for n in needs_for(recipe, host_data)) if p is not None]


# ------------------------------------------------------------------------------------------
# the deploy's view


def fleet_dir() -> Path:
    from rigup.fleet import fleet_path

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
    path = lock_path(str(host_data.get("lock_file") or "rigs.lock.yaml"), base_dir)
    try:
        mtime = path.stat().st_mtime_ns
    except FileNotFoundError:
        raise LockError(
            f"{path}: lock file not found (knob lock_file); run `python -m rigup lock` on the control "
            "machine and commit the file next to the fleet file"
        ) from None
    cached = _LOADED.get(path)
    if cached is not None and cached[0] == mtime:
        return cached[1]
    lock = LockFile.load(path)
    _LOADED[path] = (mtime, lock)
    return lock


def locked_recipe(
    host_data: Mapping[str, Any],
    host_name: str = "this host",
    base_dir: Path | None = None,
    topology: Topology | None = None,
) -> tuple[Recipe, LockFile]:
    """(recipe, lock) for a host: THE way every phase (preflight, serving, status, doctor) builds a
    host's recipe, so they all render and compare the same thing.

    + host_data: the host's knobs
    + host_name: for the error message
    + base_dir: directory a relative lock_file is read from (default: the fleet file's)
    + topology: rigup.interconnect.Topology read on the host (fact rigup.fitfacts.GpuTopology); None
      when nothing was detected (no driver yet): the gpu_interconnect knob alone decides the NCCL settings

    Raises LockError when the lock file is missing or an entry the variant needs is missing or stale.
    """
    from rigup.interconnect import resolve_for_host

    lock = deploy_lock(host_data, base_dir)
    recipe = resolve_for_host(host_data, topology, lock)
    problems = lock_problems(recipe, host_data, lock)
    if problems:
        raise LockError(
            f"{lock.path}: missing or stale entries for {host_name} (variant {recipe.variant}): "
            + "; ".join(problems)
            + ". Run `python -m rigup lock` (it adds missing entries and keeps the others) and commit the file."
        )
    return recipe, lock


# ------------------------------------------------------------------------------------------
# resolving pins (control machine)


def read_hf_token(token_file: str | None) -> str | None:
    """HF_TOKEN from the environment, else from a 0600 file (knob hf_token_file)."""
    token = os.environ.get("HF_TOKEN")
    if token:
        return token.strip()
    if not token_file:
        return None
    path = Path(token_file).expanduser()
    try:
        st = path.stat()
    except FileNotFoundError:
        raise LockError(f"hf_token_file {path} does not exist") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise LockError(f"hf_token_file {path} is readable by others (mode {st.st_mode & 0o777:o}); chmod 600 it")
    token = path.read_text().strip()
    return token or None


def _git_env() -> dict[str, str]:
    # Never hang on a credential prompt; a private remote must fail with a message instead.
    return {"GIT_TERMINAL_PROMPT": "0", "GIT_ASKPASS": "/bin/true"}


class Resolver:
    """Turns needs into pins. Network access happens only here."""

    def __init__(self, hf_token: str | None = None, image_digests: bool = False, log: Any = None) -> None:
        self.hf_token = hf_token
        self.image_digests = image_digests
        self.log = log or (lambda message: None)

    # -- git -----------------------------------------------------------------------------------
    def git(self, need: GitNeed) -> GitPin:
        import git as gitpython

        runner = gitpython.cmd.Git()
        env = _git_env()
        if SHA40.match(need.ref):
            self._git_verify_commit(need, need.ref)
            return GitPin(need.name, need.url, need.ref, need.ref)
        try:
            with runner.custom_environment(**env):
                output = runner.ls_remote(need.url, need.ref, f"refs/tags/{need.ref}^{{}}")
        except gitpython.GitCommandError as exc:
            raise LockError(f"{need.name}: git ls-remote {need.url} failed: {_git_stderr(exc)}") from None
        refs: dict[str, str] = {}
        for line in output.splitlines():
            sha, _, ref = line.partition("\t")
            refs[ref.strip()] = sha.strip()
        for candidate in (
            f"refs/tags/{need.ref}^{{}}",  # annotated tag: the commit it points at
            f"refs/tags/{need.ref}",
            f"refs/heads/{need.ref}",
            need.ref,
        ):
            if candidate in refs and SHA40.match(refs[candidate]):
                return GitPin(need.name, need.url, need.ref, refs[candidate])
        if SHORT_HEX.match(need.ref):
            commit = self._git_expand_short(need)
            return GitPin(need.name, need.url, need.ref, commit)
        raise LockError(f"{need.name}: {need.url} has no branch or tag named {need.ref!r}")

    def _git_fetch_all(self, need: GitNeed, workdir: str) -> Any:
        import git as gitpython

        repo = gitpython.Repo.init(workdir, bare=True)
        with repo.git.custom_environment(**_git_env()):
            repo.git.fetch("--quiet", "--filter=blob:none", need.url, "+refs/heads/*:refs/heads/*", "+refs/tags/*:refs/tags/*")
        return repo

    def _git_verify_commit(self, need: GitNeed, commit: str) -> None:
        import git as gitpython

        with tempfile.TemporaryDirectory(prefix="rigup-lock-") as workdir:
            repo = gitpython.Repo.init(workdir, bare=True)
            try:
                with repo.git.custom_environment(**_git_env()):
                    # Most servers (GitHub, git daemon with protocol v2) hand out a reachable commit by sha.
                    repo.git.fetch("--quiet", "--depth=1", need.url, commit)
                return
            except gitpython.GitCommandError:
                pass
            try:
                repo = self._git_fetch_all(need, workdir)
                repo.git.cat_file("-e", f"{commit}^{{commit}}")
            except gitpython.GitCommandError as exc:
                raise LockError(
                    f"{need.name}: commit {commit} is not reachable from any branch or tag of {need.url} "
                    f"(force-pushed or deleted?): {_git_stderr(exc)}"
                ) from None

    def _git_expand_short(self, need: GitNeed) -> str:
        import git as gitpython

        with tempfile.TemporaryDirectory(prefix="rigup-lock-") as workdir:
            try:
                repo = self._git_fetch_all(need, workdir)
                commit = repo.git.rev_parse("--verify", "--quiet", f"{need.ref}^{{commit}}").strip()
            except gitpython.GitCommandError as exc:
                raise LockError(f"{need.name}: {need.ref!r} is not a unique commit of {need.url}: {_git_stderr(exc)}") from None
        if not SHA40.match(commit):
            raise LockError(f"{need.name}: {need.ref!r} did not resolve to a commit of {need.url}")
        return commit

    # -- Hugging Face ----------------------------------------------------------------------
    def model(self, need: ModelNeed) -> ModelPin:
        from huggingface_hub import HfApi
        from huggingface_hub.errors import HfHubHTTPError

        api = HfApi(endpoint=need.endpoint, token=self.hf_token or False)
        try:
            info = api.model_info(need.repo_id, revision=need.revision, files_metadata=True)
        except HfHubHTTPError as exc:
            status = getattr(getattr(exc, "response", None), "status_code", None)
            hint = ""
            if status in (401, 403) or (need.gated and status == 404):
                hint = " (gated or private: set HF_TOKEN or hf_token_file to a token that accepted the licence)"
            raise LockError(f"{need.name}: {need.endpoint} answered {status or exc}{hint}") from None
        commit = str(info.sha or "")
        if not SHA40.match(commit):
            raise LockError(f"{need.name}: {need.endpoint} gave no commit for revision {need.revision!r}")
        files: list[FilePin] = []
        for sibling in info.siblings or ():
            files.append(self._file_pin(need, commit, sibling))
        if not files:
            raise LockError(f"{need.name}: {need.repo_id}@{commit} has no files")
        self.log(f"{need.name}: {need.revision} -> {commit} ({len(files)} files)")
        return ModelPin(need.name, need.repo_id, need.revision, commit, tuple(sorted(files, key=lambda f: f.path)))

    def _file_pin(self, need: ModelNeed, commit: str, sibling: Any) -> FilePin:
        path = sibling.rfilename
        if not _safe_relpath(path):
            raise LockError(f"{need.name}: the hub lists an unsafe file path {path!r}")
        lfs = sibling.lfs
        if lfs is not None:
            digest = lfs["sha256"] if isinstance(lfs, Mapping) else lfs.sha256
            size = lfs["size"] if isinstance(lfs, Mapping) else lfs.size
            if not SHA256_HEX.match(str(digest)):
                raise LockError(f"{need.name}: the hub's sha256 for {path} is malformed: {digest!r}")
            return FilePin(path, int(size), str(digest))
        if sibling.size is None or sibling.blob_id is None:
            raise LockError(f"{need.name}: the hub gave no size/blob id for {path}")
        if sibling.size > MAX_HASHED_DOWNLOAD:
            raise LockError(f"{need.name}: {path} is a {sibling.size}-byte non-LFS file; refusing to hash it here")
        # No published SHA-256: download it and hash it, checking the bytes against the git blob id.
        data = self._download(need, commit, path)
        blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        if len(data) != sibling.size or blob != sibling.blob_id:
            raise LockError(
                f"{need.name}: {path} downloaded from {need.endpoint} does not match the hub's git blob "
                f"{sibling.blob_id} ({len(data)} bytes, blob {blob})"
            )
        return FilePin(path, len(data), hashlib.sha256(data).hexdigest())

    def _download(self, need: ModelNeed, commit: str, path: str) -> bytes:
        import requests
        from huggingface_hub.utils import build_hf_headers

        url = f"{need.endpoint}/{need.repo_id}/resolve/{commit}/{urllib.parse.quote(path)}"
        headers = build_hf_headers(token=self.hf_token or False)
        try:
            response = requests.get(url, headers=headers, timeout=60)
        except requests.RequestException as exc:
            raise LockError(f"{need.name}: cannot download {path}: {exc}") from None
        if response.status_code in (401, 403):
            raise LockError(
                f"{need.name}: {url} answered HTTP {response.status_code} (gated or private: set HF_TOKEN "
                "or hf_token_file to a token that accepted the licence)"
            )
        if response.status_code != 200:
            raise LockError(f"{need.name}: {url} answered HTTP {response.status_code}")
        return response.content

    # -- images ----------------------------------------------------------------------------
    def image(self, need: ImageNeed, previous: ImagePin | None) -> ImagePin:
        if not self.image_digests:
            digest = previous.digest if previous is not None else None
            return ImagePin(need.name, need.repository, need.tag, digest)
        digest = registry_digest(need.registry, need.repository, need.tag)
        self.log(f"{need.name}: {digest}")
        return ImagePin(need.name, need.repository, need.tag, digest)


def _git_stderr(exc: Any) -> str:
    text = str(getattr(exc, "stderr", "") or exc).strip()
    return " ".join(text.split())[:400]


MANIFEST_TYPES = ", ".join(
    (
        "application/vnd.oci.image.index.v1+json",
        "application/vnd.docker.distribution.manifest.list.v2+json",
        "application/vnd.oci.image.manifest.v1+json",
        "application/vnd.docker.distribution.manifest.v2+json",
    )
)


def registry_digest(registry: str, repository: str, tag: str) -> str:
    """The digest a registry serves for repository:tag (Registry HTTP API v2, anonymous token)."""
    import requests

    host = "registry-1.docker.io" if registry in ("docker.io", "index.docker.io") else registry
    if registry in ("docker.io", "index.docker.io") and "/" not in repository:
        repository = f"library/{repository}"
    local = host.split(":")[0] in ("localhost", "127.0.0.1", "[::1]")
    url = f"{'http' if local else 'https'}://{host}/v2/{repository}/manifests/{tag}"
    headers = {"Accept": MANIFEST_TYPES}
    try:
        response = requests.head(url, headers=headers, timeout=30)
        if response.status_code == 401:
            token = _registry_token(response.headers.get("WWW-Authenticate", ""))
            if token:
                headers["Authorization"] = f"Bearer {token}"
                response = requests.head(url, headers=headers, timeout=30)
    except requests.RequestException as exc:
        raise LockError(f"image {repository}:{tag}: cannot reach {host}: {exc}") from None
    if response.status_code == 404:
        raise LockError(f"image {repository}:{tag}: not found on {host} (tag purged or renamed?)")
    if response.status_code != 200:
        raise LockError(f"image {repository}:{tag}: {host} answered HTTP {response.status_code}")
    digest = response.headers.get("Docker-Content-Digest", "")
    if not DIGEST.match(digest):
        raise LockError(f"image {repository}:{tag}: {host} gave no usable digest ({digest!r})")
    return digest


def _registry_token(challenge: str) -> str | None:
    import requests

    if not challenge.lower().startswith("bearer "):
        return None
    params = dict(re.findall(r'(\w+)="([^"]*)"', challenge))
    realm = params.pop("realm", None)
    if realm is None:
        return None
    response = requests.get(realm, params=params, timeout=30)
    if response.status_code != 200:
        return None
    body = response.json()
    return body.get("token") or body.get("access_token")


# ------------------------------------------------------------------------------------------
# the lock command


@dataclass
class Change:
    name: str
    kind: str  # added | upgraded | fixed (stale) | removed | kept
    lines: list[str] = field(default_factory=list)


def fleet_needs(fleet: Any) -> tuple[dict[str, Need], str]:
    """Every need of every host of the fleet, by lock name, plus the fleet's lock_file knob value."""
    from rigup.recipe import resolve

    needs: dict[str, Need] = {}
    owners: dict[str, str] = {}
    lock_files: set[str] = set()
    for host in fleet.hosts:
        data = fleet.resolved_data(host.name)
        lock_files.add(str(data.get("lock_file") or "rigs.lock.yaml"))
        recipe = resolve(data, None)
        for need in needs_for(recipe, data):
            known = needs.get(need.name)
            if known is not None and _need_key(known) != _need_key(need):
                raise LockError(
                    f"hosts {owners[need.name]} and {host.name} need different things under {need.name} "
                    f"({_need_key(known)} vs {_need_key(need)}); the lock holds one pin per name"
                )
            needs.setdefault(need.name, need)
            owners.setdefault(need.name, host.name)
    if len(lock_files) > 1:
        raise LockError(f"hosts disagree on lock_file ({sorted(lock_files)}); set it once for the fleet")
    return needs, (lock_files.pop() if lock_files else "rigs.lock.yaml")


def _need_key(need: Need) -> tuple[Any, ...]:
    if isinstance(need, GitNeed):
        return (need.url, need.ref)
    if isinstance(need, ModelNeed):
        return (need.repo_id, need.revision)
    return (need.repository, need.tag)


def _matches(name: str, wanted: Iterable[str]) -> bool:
    bare = name.split(":", 1)[1]
    return any(w in (name, bare) for w in wanted)


def update_lock(
    old: LockFile,
    needs: Mapping[str, Need],
    resolver: Resolver,
    upgrade: list[str] | None,
) -> tuple[LockFile, list[Change]]:
    """New lock for these needs: keep good pins, resolve missing/stale ones and those to upgrade.

    + upgrade: None = upgrade nothing; [] = upgrade everything; names = only those (with or
      without the "git:"/"model:"/"image:" prefix)
    """
    if upgrade:
        unknown = [w for w in upgrade if not any(_matches(n, [w]) for n in needs)]
        if unknown:
            raise LockError(f"--upgrade: the fleet needs nothing named {', '.join(unknown)} (known: {', '.join(sorted(needs))})")
    new = LockFile(path=old.path)
    changes: list[Change] = []
    for name in sorted(needs):
        need = needs[name]
        current = old.entry(name)
        problem = need_problem(need, old)
        wanted = upgrade is not None and (not upgrade or _matches(name, upgrade))
        if current is not None and problem is None and not wanted:
            _store(new, current)
            continue
        if isinstance(need, GitNeed):
            pin: GitPin | ModelPin | ImagePin = resolver.git(need)
        elif isinstance(need, ModelNeed):
            pin = resolver.model(need)
        else:
            pin = resolver.image(need, old.images.get(name))
        _store(new, pin)
        if current is None:
            changes.append(Change(name, "added", _describe(pin)))
        elif problem is not None:
            changes.append(Change(name, "fixed", [f"was stale: {problem}", *_diff(current, pin)]))
        elif _diff(current, pin):
            changes.append(Change(name, "upgraded", _diff(current, pin)))
        else:
            changes.append(Change(name, "kept", ["already at the newest pin"]))
    for name in old.names():
        if name not in needs:
            changes.append(Change(name, "removed", ["no host's variant needs it any more"]))
    return new, changes


def _store(lock: LockFile, pin: GitPin | ModelPin | ImagePin) -> None:
    if isinstance(pin, GitPin):
        lock.git[pin.name] = pin
    elif isinstance(pin, ModelPin):
        lock.models[pin.name] = pin
    else:
        lock.images[pin.name] = pin


def _describe(pin: GitPin | ModelPin | ImagePin) -> list[str]:
    if isinstance(pin, GitPin):
        return [f"{pin.ref} -> {pin.commit} ({pin.url})"]
    if isinstance(pin, ModelPin):
        return [f"{pin.revision} -> {pin.commit}: {len(pin.files)} files, {pin.total_size / 1e9:.2f} GB"]
    return [f"{pin.repository}:{pin.tag} digest {pin.digest or 'not pinned (tag only)'}"]


def _diff(old: GitPin | ModelPin | ImagePin, new: GitPin | ModelPin | ImagePin) -> list[str]:
    lines: list[str] = []
    if isinstance(old, GitPin) and isinstance(new, GitPin):
        for attr in ("url", "ref", "commit"):
            if getattr(old, attr) != getattr(new, attr):
                lines.append(f"{attr}: {getattr(old, attr)} -> {getattr(new, attr)}")
    elif isinstance(old, ModelPin) and isinstance(new, ModelPin):
        for attr in ("revision", "commit"):
            if getattr(old, attr) != getattr(new, attr):
                lines.append(f"{attr}: {getattr(old, attr)} -> {getattr(new, attr)}")
        before = {f.path: f for f in old.files}
        after = {f.path: f for f in new.files}
        for path in sorted(set(before) | set(after)):
            a, b = before.get(path), after.get(path)
            if a is None:
                lines.append(f"+ {path} ({b.size} bytes, sha256 {b.sha256[:16]}...)")  # type: ignore[union-attr]
            elif b is None:
                lines.append(f"- {path}")
            elif a != b:
                lines.append(f"~ {path}: sha256 {a.sha256[:16]}... -> {b.sha256[:16]}... ({a.size} -> {b.size} bytes)")
    elif isinstance(old, ImagePin) and isinstance(new, ImagePin):
        if old.digest != new.digest:
            lines.append(f"digest: {old.digest or 'none'} -> {new.digest or 'none'}")
    return lines


def run_lock(args: argparse.Namespace, out: Any = None) -> int:
    from rigup.fleet import FleetError, load_fleet
    from rigup.recipe import RecipeError

    out = out or sys.stdout

    def say(text: str) -> None:
        print(text, file=out)

    try:
        fleet = load_fleet(args.fleet)
        needs, lock_file = fleet_needs(fleet)
        path = lock_path(lock_file, fleet.path.parent)
        try:
            old = LockFile.load(path)
        except LockError:
            if path.exists():
                raise
            old = LockFile(path=path)
        if args.check:
            problems = [p for p in (need_problem(n, old) for n in needs.values()) if p is not None]
            extra = [n for n in old.names() if n not in needs]
            if not path.exists():
                say(f"{path}: missing")
                return 1
            for problem in problems:
                say(f"stale: {problem}")
            for name in extra:
                say(f"unused: {name}")
            if problems:
                say(f"{path}: {len(problems)} entries missing or stale; run `python -m rigup lock`")
                return 1
            say(f"{path}: covers all {len(needs)} pins the fleet needs")
            return 0
        token = read_hf_token(_fleet_token_file(fleet))
        resolver = Resolver(hf_token=token, image_digests=args.image_digests, log=(say if args.verbose else None))
        upgrade = None if args.upgrade is None else list(args.upgrade)
        new, changes = update_lock(old, needs, resolver, upgrade)
    except (LockError, FleetError, RecipeError) as exc:
        print(f"rigup lock: {exc}", file=sys.stderr)
        return 2
    for change in changes:
        say(f"{change.kind:9} {change.name}")
        for line in change.lines:
            say(f"          {line}")
    changed = new.dump() != (old.dump() if path.exists() else "")
    if args.dry_run:
        say(f"{path}: {'would change' if changed else 'unchanged'} (dry run)")
        return 0
    if changed:
        new.save(path)
        say(f"{path}: written ({len(needs)} pins); commit it")
    else:
        say(f"{path}: unchanged ({len(needs)} pins)")
    return 0


def _fleet_token_file(fleet: Any) -> str | None:
    files = {fleet.resolved_data(h.name).get("hf_token_file") for h in fleet.hosts} - {None}
    if len(files) > 1:
        raise LockError(f"hosts name different hf_token_file values ({sorted(files)}); the lock tool reads one")
    return files.pop() if files else None


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "lock",
        help="pin git commits, model files (SHA-256) and images in rigs.lock.yaml",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("--fleet", help="fleet file (default: $RIGUP_RIGS or rigs.yaml)")
    parser.add_argument(
        "--upgrade",
        nargs="*",
        metavar="NAME",
        help="move pins to what the refs point at now: all, or the NAMEs given "
        "(git:genesis, model:<repo id>, image:<repo>:<tag>; the prefix is optional)",
    )
    parser.add_argument("--check", action="store_true", help="only report missing/stale entries; exit 1 if any")
    parser.add_argument("--image-digests", action="store_true", help="ask the registry for each image tag's digest")
    parser.add_argument("--dry-run", action="store_true", help="show what would change; write nothing")
    parser.add_argument("-v", "--verbose", action="store_true", help="print each resolution")
    parser.set_defaults(func=run_lock)
    return parser


__all__ = [
    "FilePin",
    "GitNeed",
    "GitPin",
    "ImageNeed",
    "ImagePin",
    "LockError",
    "LockFile",
    "ModelNeed",
    "ModelPin",
    "Resolver",
    "add_parser",
    "deploy_lock",
    "lock_path",
    "lock_problems",
    "locked_recipe",
    "needs_for",
    "read_hf_token",
    "registry_digest",
    "run_lock",
    "update_lock",
]
