"""Upstream repositories on the control machine: a cache of bare clones read at exact commits.

The serving recipes are upstream's compose files at the locked commit (rigup/desired/transforms.py).
`rigup lock`, `rigup render` and the deploy read them through an `UpstreamReader`:

  GitCache       bare, blob-less clones under <work dir>/.cache/upstream/, one per repository URL,
                 fetched once per missing commit; files are read with `git show COMMIT:PATH`.
  WorkingTrees   files from local directories, one per source (a recipe author's checkout, or the
                 test bed's fixture trees): the commit is reported as given, nothing is fetched.

Rigs never fetch upstream's whole repository: they clone the sources the rendered mounts name.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Protocol

from rigup import WORK_DIR
from rigup.desired.trust import client_environment, fleet_bundle


class UpstreamError(ValueError):
    """An upstream file cannot be read (unreachable remote, unknown commit, missing path)."""


class UpstreamReader(Protocol):
    def read(self, source: str, url: str, commit: str, path: str) -> str:
        """The text of `path` at `commit`; UpstreamError when it does not exist there."""
        ...

    def kind(self, source: str, url: str, commit: str, path: str) -> str | None:
        """"file", "dir" or None (absent) for `path` at `commit`."""
        ...

    def resolve_ref(self, source: str, url: str, ref: str) -> str:
        """The commit a branch or tag points at now (previews without a lock)."""
        ...

    def names(self, source: str, url: str, commit: str, path: str) -> list[str]:
        """The entries of directory `path` at `commit`, sorted; [] when it does not exist there."""
        ...


def _git_env() -> dict[str, str]:
    # HTTPS checked against the fleet file's ca_bundle when it names one (rigup.desired.trust), else git's own
    env = dict(os.environ)
    env.update({"GIT_TERMINAL_PROMPT": "0", "GIT_ASKPASS": "/bin/true", "LC_ALL": "C", **client_environment(fleet_bundle())})
    return env


class GitCache:
    """Bare clones of upstream repositories, fetched on demand at the commits asked for."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = Path(root) if root is not None else Path(WORK_DIR) / ".cache" / "upstream"
        self._lock = threading.Lock()
        self._have: set[tuple[str, str]] = set()  # (url, commit) known to be in the cache
        # What a path is and holds at a commit never changes: each is asked of git once per process
        # (a deploy resolves every host's recipe in several task files).
        self._kinds: dict[tuple[str, str, str], str | None] = {}
        self._texts: dict[tuple[str, str, str], str] = {}

    def _repo(self, url: str) -> Path:
        name = url.rstrip("/").removesuffix(".git").rsplit("/", 1)[-1] or "repo"
        return self.root / f"{name}-{hashlib.sha256(url.encode()).hexdigest()[:12]}.git"

    @contextlib.contextmanager
    def _file_lock(self, repo: Path) -> Iterator[None]:
        # Two control-machine processes (a deploy and `rigup render`) may fetch into one cache.
        repo.parent.mkdir(parents=True, exist_ok=True)
        with open(repo.parent / f".{repo.name}.lock", "w") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            yield

    def _git(self, repo: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        try:
            proc = subprocess.run(["git", "--git-dir", str(repo), *args], capture_output=True, text=True,
                                  env=_git_env(), timeout=600)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise UpstreamError(f"git {' '.join(args[:2])} in {repo}: {exc}") from None
        if check and proc.returncode != 0:
            raise UpstreamError(f"git {' '.join(args[:2])} in {repo}: {proc.stderr.strip() or proc.returncode}")
        return proc

    def ensure(self, url: str, commit: str) -> Path:
        """The cache repository of `url`, holding `commit` (fetched when missing)."""
        repo = self._repo(url)
        with self._lock, self._file_lock(repo):
            if (url, commit) in self._have:
                return repo
            if not (repo / "HEAD").is_file():
                # Initialised beside it and renamed, so an interrupted init never leaves a broken cache.
                tmp = repo.with_name(repo.name + ".init")
                shutil.rmtree(tmp, ignore_errors=True)
                shutil.rmtree(repo, ignore_errors=True)
                try:
                    subprocess.run(["git", "init", "--quiet", "--bare", str(tmp)], check=True, capture_output=True,
                                   timeout=60)
                except (OSError, subprocess.SubprocessError) as exc:
                    raise UpstreamError(f"cannot create the upstream cache {repo}: {exc}") from None
                tmp.rename(repo)
            if self._git(repo, "cat-file", "-e", f"{commit}^{{commit}}", check=False).returncode != 0:
                # By sha first (GitHub and git daemon v2 serve reachable commits), that commit alone: files
                # are read at exact commits, and a large repository's history (vLLM's, for its dashboards)
                # is not fetched; else every branch and tag.
                fetched = self._git(repo, "fetch", "--quiet", "--depth=1", "--filter=blob:none", url, commit,
                                    check=False)
                if fetched.returncode != 0:
                    fetched = self._git(repo, "fetch", "--quiet", "--filter=blob:none", url,
                                        "+refs/heads/*:refs/remotes/origin/*", "+refs/tags/*:refs/tags/*",
                                        check=False)
                if self._git(repo, "cat-file", "-e", f"{commit}^{{commit}}", check=False).returncode != 0:
                    raise UpstreamError(
                        f"{url}: commit {commit} could not be fetched"
                        + (f": {fetched.stderr.strip()}" if fetched.stderr.strip() else "")
                    )
            self._have.add((url, commit))
        return repo

    def read(self, source: str, url: str, commit: str, path: str) -> str:
        key = (url, commit, path)
        if key in self._texts:
            return self._texts[key]
        repo = self.ensure(url, commit)
        if self.kind(source, url, commit, path) != "file":
            raise UpstreamError(f"{source}: {path} does not exist at {commit[:12]} ({url})")
        # The clone is blob-less: this fetches the one blob (a failure here is the network's, not a path's).
        with self._lock, self._file_lock(repo):
            proc = self._git(repo, "show", f"{commit}:{path}", check=False)
        if proc.returncode != 0:
            raise UpstreamError(f"{source}: reading {path} at {commit[:12]} from {url}: {proc.stderr.strip()}")
        self._texts[key] = proc.stdout
        return proc.stdout

    def resolve_ref(self, source: str, url: str, ref: str) -> str:
        """Asked afresh each time: a branch moves (previews only; deploys read the lock's commit)."""
        with self._lock:
            try:
                proc = subprocess.run(["git", "ls-remote", url, ref, f"refs/tags/{ref}^{{}}"], capture_output=True,
                                      text=True, env=_git_env(), timeout=120)
            except (OSError, subprocess.TimeoutExpired) as exc:
                raise UpstreamError(f"{source}: git ls-remote {url}: {exc}") from None
            if proc.returncode != 0:
                raise UpstreamError(f"{source}: git ls-remote {url} {ref}: {proc.stderr.strip() or proc.returncode}")
            refs = dict(reversed(line.split("\t", 1)) for line in proc.stdout.splitlines() if "\t" in line)
            for candidate in (f"refs/tags/{ref}^{{}}", f"refs/tags/{ref}", f"refs/heads/{ref}", ref):
                if candidate in refs:
                    return refs[candidate]
            raise UpstreamError(f"{source}: {url} has no branch or tag {ref!r}")

    def names(self, source: str, url: str, commit: str, path: str) -> list[str]:
        repo = self.ensure(url, commit)
        proc = self._git(repo, "ls-tree", "-z", "--name-only", f"{commit}:{path.rstrip('/')}", check=False)
        return sorted(name for name in proc.stdout.split("\0") if name) if proc.returncode == 0 else []

    def kind(self, source: str, url: str, commit: str, path: str) -> str | None:
        key = (url, commit, path.rstrip("/"))
        if key not in self._kinds:
            repo = self.ensure(url, commit)
            # ls-tree reads trees only, which a blob-less clone has: no network, no false "absent".
            proc = self._git(repo, "ls-tree", commit, "--", path.rstrip("/"))
            line = proc.stdout.strip().splitlines()
            self._kinds[key] = {"blob": "file", "tree": "dir"}.get(line[0].split()[1]) if line else None
        return self._kinds[key]


class WorkingTrees:
    """Upstream files from local directories (source key -> directory); commits are not checked."""

    def __init__(self, trees: Mapping[str, Path | str]) -> None:
        self.trees = {k: Path(v) for k, v in trees.items()}

    def _path(self, source: str, path: str) -> Path:
        if source not in self.trees:
            raise UpstreamError(f"{source}: no local tree configured (have {sorted(self.trees)})")
        return self.trees[source] / path

    def read(self, source: str, url: str, commit: str, path: str) -> str:
        p = self._path(source, path)
        if not p.is_file():
            raise UpstreamError(f"{source}: {path} does not exist in {self.trees[source]}")
        return p.read_text()

    def resolve_ref(self, source: str, url: str, ref: str) -> str:
        self._path(source, "")
        return "0" * 40  # a working tree has no commits: reported as the null commit

    def kind(self, source: str, url: str, commit: str, path: str) -> str | None:
        p = self._path(source, path)
        return "dir" if p.is_dir() else "file" if p.is_file() else None

    def names(self, source: str, url: str, commit: str, path: str) -> list[str]:
        p = self._path(source, path)
        return sorted(child.name for child in p.iterdir()) if p.is_dir() else []


_default: UpstreamReader | None = None


# JSON {source: directory}: read those sources' files from local working trees instead of the locked
# commits (a recipe author's checkout; the unit tests' fixture trees). Subprocesses inherit it.
TREES_ENV = "RIGUP_UPSTREAM_TREES"


def default_reader() -> UpstreamReader:
    """The process's reader: the git cache under the work dir, unless `use_reader` set another or
    $RIGUP_UPSTREAM_TREES names local trees."""
    global _default
    if _default is None:
        trees = os.environ.get(TREES_ENV)
        if trees:
            try:
                mapping = json.loads(trees)
            except ValueError:
                raise UpstreamError(f"${TREES_ENV} must be a JSON object of source -> directory") from None
            _default = WorkingTrees(mapping)
        else:
            _default = GitCache()
    return _default


def use_reader(reader: UpstreamReader | None) -> UpstreamReader | None:
    """Make `reader` the process default (None: back to the git cache); returns the previous one."""
    global _default
    previous, _default = _default, reader
    return previous
