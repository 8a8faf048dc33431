"""Git remotes for the test bed: stand-ins of the vLLM fork and the Genesis patch tree, served like GitHub.

`make_remotes(root)` writes two bare repos with fixed content, authors and dates (so every SHA is the same
on every run) under root/<owner>/<name>.git, mirroring GitHub's URL layout:

  noonghunna/vllm.git                   main (fork base) + branch marlin-pad-sub-tile-n (3 commits on top)
  Sandermage/genesis-vllm-patches.git   dev (vllm/_genesis/...: 3 tagged releases, the pin, 3 more) and
                                        main (new layout, no vllm/_genesis; a lightweight tag); dev
                                        commits are not reachable from main
  noonghunna/club-3090.git              master (its only branch here; no main): root, the spring, May and
                                        August recipe snapshots, a later commit
  noonghunna/qwen36-dual-3090.git       master: root, the frozen snapshot

Every path rigup/catalog.yaml mounts from a source (`source_mounts`) exists in the matching stand-in, so
the stand-ins follow the catalog as it grows (their SHAs change with it; read them from `Remotes`).

Served over HTTP, as GitHub serves them (https; GitHub turned the unencrypted git:// protocol off on
2022-03-15): `GitServer` answers http://<bind>:<port>/<owner>/<name>.git with smart HTTP through
`git http-backend` (which also answers dumb clients); smart=False serves static dumb HTTP over
update-server-info instead.

Like GitHub, the repos let clients fetch any reachable commit by SHA and use partial-clone filters.

Standalone: `python -m rigup_testbed.gitremotes --root DIR --bind IP --port N` builds the repos, prints the
http:// URL, writes DIR/gitremotes.ready.json (the URL + every SHA), and stops on SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import http.server
import json
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.parse
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rigup.desired.catalog import CATALOG_FILE, load_catalog_file
from rigup.desired.knobs import load_defaults
from rigup.desired.recipe import resolve
from rigup_testbed.recipes import tree_files, working_trees
from rigup_testbed.service import BackgroundServer, add_tls_arguments, run_service, tls_of

# Existing repos are reused only if their stamp records the same content hash (of the fast-import stream).
STAMP = "rigup-testbed-remote.json"
AUTHOR = "rigup testbed <testbed@rigup.invalid>"
EPOCH = 1777593600  # 2026-05-01T00:00:00Z; commit i of a repo is dated EPOCH + i hours

VLLM_REPO = "noonghunna/vllm"
VLLM_BRANCH = "marlin-pad-sub-tile-n"
GENESIS_REPO = "Sandermage/genesis-vllm-patches"
CLUB_REPO = "noonghunna/club-3090"
QWEN_DUAL_REPO = "noonghunna/qwen36-dual-3090"
# Both recipe repositories' default (and only long-lived) branch is master; neither has a main branch
# (GitHub snapshots of 2026-12-03: club-3090 refs/heads/master = 4a29ab57, HEAD -> master, no
# refs/heads/main; qwen36-dual-3090 refs/heads/master = bbb84da0). Genesis' default is main (with dev).
RECIPE_DEFAULT_BRANCH = "master"
CATALOG = CATALOG_FILE
MARLIN_DIR = "vllm/model_executor/kernels/linear/mixed_precision"
APPLY_ALL = "vllm/_genesis/patches/apply_all.py"
USAGE = {"docs/USAGE.md": "pip install genesis-vllm-patches\n"}

# Git must not pick up the caller's global/system config (signing, hooks, autocrlf): SHAs depend on it.
GIT_ENV = {
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_TERMINAL_PROMPT": "0",
    "LC_ALL": "C",
}


def git(
    *args: str, cwd: Path | None = None, input: bytes | None = None, env: Mapping[str, str] | None = None  # noqa: A002
) -> str:
    """Run git hermetically; return stdout; raise with stderr on failure."""
    full_env = {**os.environ, **GIT_ENV, **(env or {})}
    proc = subprocess.run(["git", *args], cwd=cwd, input=input, capture_output=True, env=full_env, check=False)
    if proc.returncode != 0:
        err = proc.stderr.decode(errors="replace").strip()
        raise RuntimeError(f"git {' '.join(args)} failed ({proc.returncode}): {err}")
    return proc.stdout.decode()


# --------------------------------------------------------------------------------------------------
# Repo content
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CommitSpec:
    """One commit: `files` changes the parent's tree (None deletes), `parent` names an earlier commit key."""

    key: str
    branch: str
    message: str
    files: Mapping[str, str | None]
    parent: str | None


def catalog_mount_paths(catalog: Path = CATALOG) -> dict[str, list[str]]:
    """Catalog source key -> sorted paths some variant's rendered compose file mounts from it.

    Every variant is rendered from the fixture trees (rigup_testbed/recipes.py) with the default knobs."""
    found: dict[str, set[str]] = {}
    reader = working_trees()
    for name in load_catalog_file(catalog)["variants"] if catalog.exists() else ():
        host = load_defaults()
        host["variant"] = name
        for source in resolve(host, upstream=reader).sources:
            found.setdefault(source.name, set()).update(p.strip("/") for p in source.required_paths)
    return {k: sorted(v) for k, v in sorted(found.items())}


def _standin_file(path: str, origin: str) -> str:
    """Plausible, valid content for a vendored file the test bed only needs to exist and be mountable."""
    if path.endswith(".py"):
        return f'"""{path} (rigup test-bed stand-in from {origin})."""\n\nRIGUP_TESTBED_STANDIN = True\n'
    if path.endswith(".jinja"):
        return "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
    if path.endswith(".sh"):
        return f"#!/bin/sh\n# {path} (rigup test-bed stand-in from {origin})\nexit 0\n"
    return f"{path} (rigup test-bed stand-in from {origin})\n"


def _missing(tree: Mapping[str, str | None], paths: Iterable[str], origin: str) -> dict[str, str]:
    """Stand-in files for catalog paths not already in `tree` (a path with no suffix is a directory)."""
    out: dict[str, str] = {}
    for path in paths:
        is_dir = "." not in path.rsplit("/", 1)[-1]
        if path in tree or (is_dir and any(p.startswith(f"{path}/") for p in tree)):
            continue
        out[f"{path}/__init__.py" if is_dir else path] = _standin_file(path, origin)
    return out


def _marlin_py(revision: int) -> str:
    pad = revision >= 1
    guard = revision >= 3
    return f'''"""Marlin mixed-precision linear kernel (rigup test-bed stand-in of noonghunna/vllm)."""

MARLIN_TILE_N = 64
MARLIN_PAD_SUB_TILE_N = {pad}
ACT_ORDER_PAD_GUARD = {guard}
RIGUP_TESTBED_REVISION = {revision}


def padded_n(n: int) -> int:
    """Output features rounded up to the kernel tile when sub-tile padding is on."""
    if not MARLIN_PAD_SUB_TILE_N or n % MARLIN_TILE_N == 0:
        return n
    return n + (MARLIN_TILE_N - n % MARLIN_TILE_N)


def can_implement(n: int, act_order: bool = False) -> bool:
    if act_order and ACT_ORDER_PAD_GUARD:
        return n % MARLIN_TILE_N == 0
    return MARLIN_PAD_SUB_TILE_N or n % MARLIN_TILE_N == 0
'''


def _mplinear_py(revision: int) -> str:
    return f'''"""Mixed-precision linear kernel base class (rigup test-bed stand-in of noonghunna/vllm)."""

from dataclasses import dataclass

ALLOW_PADDED_PARTITIONS = {revision >= 2}
RIGUP_TESTBED_REVISION = {revision}


@dataclass
class MPLinearLayerConfig:
    full_weight_shape: tuple[int, int]
    partition_weight_shape: tuple[int, int]
    group_size: int = 128


class MPLinearKernel:
    def __init__(self, config: MPLinearLayerConfig) -> None:
        self.config = config

    def output_size(self) -> int:
        n = self.config.partition_weight_shape[1]
        return n
'''


def _vllm_commits() -> list[CommitSpec]:
    base = {
        "README.md": "# vLLM (rigup test-bed stand-in of the noonghunna/vllm fork)\n",
        "vllm/__init__.py": '__version__ = "0.20.1rc1.dev16+g7a1eb8ac2"\n',
        f"{MARLIN_DIR}/__init__.py": "",
        f"{MARLIN_DIR}/marlin.py": _marlin_py(0),
        f"{MARLIN_DIR}/MPLinearKernel.py": _mplinear_py(0),
    }
    base.update(_missing(base, catalog_mount_paths().get("vllm-fork", []), VLLM_REPO))
    return [
        CommitSpec("base", "main", "Fork base", base, None),
        CommitSpec("main2", "main", "Sync upstream docs", {"docs/README.md": "Upstream docs.\n"}, "base"),
        CommitSpec(
            "pad1", VLLM_BRANCH, "marlin: pad sub-tile N to the kernel tile", {f"{MARLIN_DIR}/marlin.py": _marlin_py(1)}, "main2"
        ),
        CommitSpec(
            "pad2",
            VLLM_BRANCH,
            "MPLinearKernel: allow padded output partitions",
            {f"{MARLIN_DIR}/MPLinearKernel.py": _mplinear_py(2)},
            "pad1",
        ),
        CommitSpec(
            "pad3", VLLM_BRANCH, "marlin: guard padding under act-order", {f"{MARLIN_DIR}/marlin.py": _marlin_py(3)}, "pad2"
        ),
    ]


def _apply_all_py(version: str) -> str:
    return f'''"""Genesis patch applier (rigup test-bed stand-in). Run: python3 -m vllm._genesis.patches.apply_all"""

import os
import sys
import time

GENESIS_VERSION = "{version}"
PATCHES = (
    "P64_QWEN3CODER_MTP_STREAMING",
    "P65_TURBOQUANT_SPEC_CG_DOWNGRADE",
    "P66_CUDAGRAPH_SIZE_FILTER",
    "P67_TQ_MULTI_QUERY_KERNEL",
    "P68_AUTO_FORCE_TOOL",
    "P69_LONG_CTX_TOOL_REMINDER",
    "P78_TOLIST_CAPTURE_GUARD",
)


def main() -> int:
    start = time.monotonic()
    applied = [p for p in PATCHES if os.environ.get(f"GENESIS_ENABLE_{{p}}") == "1"]
    print(f"[Genesis] {{GENESIS_VERSION}} applied: {{', '.join(applied) or 'none'}}")
    print(f"[Genesis] apply_all elapsed {{time.monotonic() - start:.3f}}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
'''


def _guards_py(pins: list[str]) -> str:
    return (
        '"""vLLM version guard (rigup test-bed stand-in)."""\n\n'
        f"KNOWN_GOOD_VLLM_PINS = {tuple(pins)!r}\n"
        'POLICY_ENV = "GENESIS_VLLM_PIN_POLICY"  # warn (default) | strict\n'
    )


TOLIST_PY = '''"""Probe: make .tolist() safe under CUDA-graph capture (rigup test-bed stand-in)."""

import sys

print("[Genesis] tolist cudagraph probe: ok")
sys.exit(0)
'''


def _genesis_tree(version: str) -> dict[str, str]:
    """The patch tree every dev commit carries from upstream's first (278b10e, tagged v7.10.0) on."""
    return {
        "vllm/_genesis/__init__.py": "",
        "vllm/_genesis/patches/__init__.py": "",
        APPLY_ALL: _apply_all_py(version),
        "vllm/_genesis/guards.py": _guards_py(["0.20.1rc1.dev16+g7a1eb8ac2"]),
    }


def _genesis_commits() -> list[CommitSpec]:
    """Genesis in upstream's shape: dev holds the patch tree under vllm/_genesis, from the three tagged
    releases (v7.10.0, v7.50- and v7.51-stable-2026-04-27) to the catalog's pin (2db18df, "fix(v7.69)") and
    three later commits (v7.72.1, release(v7.72.2), unreleased); main has the new layout (v12.0.0 on its
    commit before the head) and never reaches a dev commit."""
    root = {"README.md": "# Genesis vLLM patches (rigup test-bed stand-in)\n", "LICENSE": "Apache-2.0\n"}
    pin = {
        **_genesis_tree("v7.69"),
        "vllm/__init__.py": "",
        "external_probe/patch_tolist_cudagraph.py": TOLIST_PY,
    }
    pin.update(_missing(pin, catalog_mount_paths().get("genesis", []), GENESIS_REPO))
    return [
        CommitSpec("root", "main", "Initial commit", root, None),
        CommitSpec("v7.10", "dev", "Genesis vLLM Patches v7.10.0", _genesis_tree("v7.10"), "root"),
        CommitSpec(
            "v7.50", "dev", "docs(P67): record empirical rejections of num_stages=2 (Step E) + Q-hoist (Step F)",
            {APPLY_ALL: _apply_all_py("v7.50")}, "v7.10",
        ),
        CommitSpec("v7.51", "dev", "v7.51: P67 softmax tl.exp2 + -FLT_MAX", {APPLY_ALL: _apply_all_py("v7.51")}, "v7.50"),
        CommitSpec("pin", "dev", "fix(v7.69): close 3 cross-rig findings from club-3090#19", pin, "v7.51"),
        CommitSpec("dev1", "dev", "v7.72.1", {APPLY_ALL: _apply_all_py("v7.72.1")}, "pin"),
        CommitSpec(
            "dev2",
            "dev",
            "release(v7.72.2): allow-list 01d4d1ad nightly",
            {
                APPLY_ALL: _apply_all_py("v7.72.2"),
                "vllm/_genesis/guards.py": _guards_py(["0.20.1rc1.dev16+g7a1eb8ac2", "0.20.2rc1.dev9+g01d4d1ad3"]),
            },
            "dev1",
        ),
        CommitSpec("dev3", "dev", "v7.73 dev (unreleased)", {APPLY_ALL: _apply_all_py("v7.73-dev")}, "dev2"),
        CommitSpec(
            "main1",
            "main",
            "New layout: genesis package, vllm/_genesis removed",
            {
                "genesis/__init__.py": '__version__ = "8.0.0"\n',
                "pyproject.toml": '[project]\nname = "genesis-vllm-patches"\nversion = "8.0.0"\n',
            },
            "root",
        ),
        CommitSpec("main2", "main", "Docs for the new layout", USAGE, "main1"),
    ]  # fmt: skip


# Upstream's tags, where they are relative to the stand-in's commits: name -> (commit key, the annotated tag's
# message, None for a lightweight tag). Sandermage/genesis-vllm-patches (snapshot, git for-each-ref refs/tags):
# v7.10.0, v7.50-stable-2026-04-27 and v7.51-stable-2026-04-27 are annotated tags on dev commits before the
# pin 2db18df (278b10e, dev's first commit; 8fb2afb; a8c202d), each with vllm/_genesis; v12.0.0 is a
# lightweight tag on a main commit before main's head (7aa66f9). "v7.69" and "v7.72.2" are release names in
# commit messages, not tags.
GENESIS_TAGS: dict[str, tuple[str, str | None]] = {
    "v7.10.0": ("v7.10", "Genesis v7.10 — runtime dispatch detection + cross-model validation"),
    "v7.50-stable-2026-04-27": ("v7.50", "Snapshot: stable production state before dev/public split + docs cleanup"),
    "v7.51-stable-2026-04-27": ("v7.51", "v7.51 stable: P67 softmax exp2+FLT_MAX (+6.1% stability)"),
    "v12.0.0": ("main1", None),
}


def _snapshot_commit(key: str, message: str, parent_tree: Mapping[str, str], source: str, parent: str) -> tuple[CommitSpec, dict[str, str]]:
    """A commit whose tree is exactly the fixture snapshot of `source` (earlier files deleted)."""
    tree = tree_files(source)
    files: dict[str, str | None] = {p: None for p in parent_tree if p not in tree}
    files.update(tree)
    return CommitSpec(key, RECIPE_DEFAULT_BRANCH, message, files, parent), tree


def _club_commits() -> list[CommitSpec]:
    """club-3090's layouts in upstream's order: the spring one (docker-compose.<name>.yml, ../patches,
    /opt/ai/vllm-src), May's (<topology>/<name>.yml, ${ESTATE_*}, ${TP:-2}) and August's
    (<topology>/<quant>/<profile>.yml), then a later commit on master."""
    root = {"README.md": "# club-3090 (rigup test-bed stand-in)\n"}
    spring, t1 = _snapshot_commit("spring", "Spring layout: docker-compose.<name>.yml", root, "club3090-spring", "root")
    may, t2 = _snapshot_commit("may", "May layout: <topology>/<name>.yml", t1, "club3090-may", "spring")
    aug, t3 = _snapshot_commit("aug", "August layout: <topology>/<quant>/<profile>.yml", t2, "club3090", "may")
    return [
        CommitSpec("root", RECIPE_DEFAULT_BRANCH, "Initial layout", root, None),
        spring,
        may,
        aug,
        CommitSpec("head", RECIPE_DEFAULT_BRANCH, "Docs: newer notes", {"README.md": "# club-3090 (rigup test-bed stand-in), newer\n"}, "aug"),
    ]


def _qwen_dual_commits() -> list[CommitSpec]:
    root = {"README.md": "# qwen36-dual-3090 (rigup test-bed stand-in)\n"}
    frozen, _ = _snapshot_commit("frozen", "Frozen: moved to club-3090", root, "qwen36-dual-3090", "root")
    return [CommitSpec("root", RECIPE_DEFAULT_BRANCH, "Initial layout", root, None), frozen]


# --------------------------------------------------------------------------------------------------
# Building
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RemoteRepo:
    """A bare repo and its refs. `url(base)` gives the clone URL under a server base URL."""

    name: str  # owner/name, no .git
    path: str  # bare repo directory
    branches: dict[str, str]  # branch -> head commit
    tags: dict[str, str]  # tag -> commit it points at (peeled)
    commits: dict[str, str]  # commit key (see CommitSpec) -> sha

    def url(self, base: str) -> str:
        return f"{base.rstrip('/')}/{self.name}.git"


@dataclass(frozen=True)
class VllmRemote(RemoteRepo):
    branch: str = VLLM_BRANCH
    branch_commits: tuple[str, ...] = ()  # commits on the branch above main, oldest first; [-1] is the head
    main_head: str = ""

    @property
    def head(self) -> str:
        return self.branches[self.branch]


@dataclass(frozen=True)
class GenesisRemote(RemoteRepo):
    dev_commits: tuple[str, ...] = ()  # dev-only commits, oldest first; none is reachable from main
    main_head: str = ""
    main_commits: tuple[str, ...] = ()  # main-only commits (after the shared root), oldest first
    root_commit: str = ""  # shared by main and dev
    pin: str = ""  # the stand-in of the catalog's pin 2db18df: on dev after the tagged releases, not reachable from main
    tag: str = "v7.51-stable-2026-04-27"  # annotated, on the dev commit before the pin
    main_tag: str = "v12.0.0"  # lightweight, on main_commits[0] (main's commit before its head)

    @property
    def dev_head(self) -> str:
        return self.branches["dev"]


@dataclass(frozen=True)
class ClubRemote(RemoteRepo):
    pin: str = ""  # the May snapshot commit
    head: str = ""  # the default branch's head: one commit after the August snapshot
    snapshots: dict[str, str] = field(default_factory=dict)  # catalog source -> commit of its fixture tree


@dataclass(frozen=True)
class Remotes:
    root: str
    vllm: VllmRemote
    genesis: GenesisRemote
    club3090: ClubRemote
    qwen_dual: ClubRemote

    def to_json(self) -> dict[str, Any]:
        return {"root": self.root, "vllm": asdict(self.vllm), "genesis": asdict(self.genesis),
                "club3090": asdict(self.club3090), "qwen36_dual": asdict(self.qwen_dual)}

    def source_refs(self) -> dict[str, str]:
        """The `source_refs` knob for these remotes: they cannot hold upstream's commits, so the sources
        the catalog pins to an upstream SHA point at the stand-ins' equivalent SHAs (Genesis: the pin, a
        dev-only commit like 2db18df; each frozen recipe snapshot), fetched by SHA as production fetches
        upstream's. `club3090` follows the catalog's ref (master, upstream's default branch)."""
        return source_refs_of(self.to_json())

    def git_knobs(self, base: str) -> dict[str, str]:
        """The *_git_url knobs pointing at these remotes under a server base URL."""
        return {"vllm_fork_git_url": self.vllm.url(base), "genesis_git_url": self.genesis.url(base),
                "club3090_git_url": self.club3090.url(base), "qwen36_dual_3090_git_url": self.qwen_dual.url(base)}

    def by_source(self) -> dict[str, RemoteRepo]:
        """Catalog source key -> remote."""
        return {"vllm-fork": self.vllm, "genesis": self.genesis, "club3090": self.club3090,
                "club3090-may": self.club3090, "club3090-spring": self.club3090, "qwen36-dual-3090": self.qwen_dual}


def _fast_import_stream(commits: list[CommitSpec], tags: Mapping[str, tuple[str, str | None]]) -> bytes:
    """A fast-import stream writing full trees (deleteall + every file), so SHAs depend only on the specs."""
    out: list[bytes] = []

    def data(payload: bytes) -> None:
        out.append(b"data %d\n" % len(payload) + payload + b"\n")

    trees: dict[str, dict[str, str]] = {}
    marks: dict[str, int] = {}
    for i, c in enumerate(commits):
        tree = dict(trees[c.parent]) if c.parent is not None else {}
        for path, content in c.files.items():
            if content is None:
                tree.pop(path, None)
            else:
                tree[path] = content
        trees[c.key] = tree
        marks[c.key] = i + 1
        when = f"{EPOCH + i * 3600} +0000"
        out.append(f"commit refs/heads/{c.branch}\nmark :{i + 1}\n".encode())
        out.append(f"author {AUTHOR} {when}\ncommitter {AUTHOR} {when}\n".encode())
        data(c.message.encode() + b"\n")
        if c.parent is not None:
            out.append(f"from :{marks[c.parent]}\n".encode())
        # (A commit without `from` continues its branch's tip, so each spec list puts a root first on its branch.)
        out.append(b"deleteall\n")
        for path in sorted(tree):
            out.append(f"M 100644 inline {path}\n".encode())
            data(tree[path].encode())
        out.append(b"\n")
    for j, (name, (key, message)) in enumerate(sorted(tags.items())):
        if message is not None:  # annotated
            when = f"{EPOCH + (len(commits) + j) * 3600} +0000"
            out.append(f"tag {name}\nfrom :{marks[key]}\ntagger {AUTHOR} {when}\n".encode())
            data(f"{message}\n".encode())
        else:
            out.append(f"reset refs/tags/{name}\nfrom :{marks[key]}\n\n".encode())
    return b"".join(out)


def _refs(repo: Path) -> dict[str, str]:
    out = git("for-each-ref", "--format=%(refname) %(objectname)", cwd=repo)
    refs: dict[str, str] = {}
    for line in out.splitlines():
        name, _, sha = line.partition(" ")
        refs[name] = sha
    return refs


def _build_repo(path: Path, commits: list[CommitSpec], stream: bytes, head: str) -> dict[str, str]:
    """(Re)create a bare repo at `path` from a fast-import stream; return commit key -> sha."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        git("init", "--quiet", "--bare", f"--initial-branch={head}", str(tmp))
        marks_file = tmp / "rigup-marks"
        git("fast-import", "--quiet", "--force", f"--export-marks={marks_file}", cwd=tmp, input=stream)
        by_mark = dict(line.split(" ", 1) for line in marks_file.read_text().splitlines())
        marks_file.unlink()
        shas = {c.key: by_mark[f":{i + 1}"] for i, c in enumerate(commits)}
        for key, value in (
            ("uploadpack.allowReachableSHA1InWant", "true"),
            ("uploadpack.allowTipSHA1InWant", "true"),
            ("uploadpack.allowFilter", "true"),
            ("http.receivepack", "false"),
            ("gc.auto", "0"),
        ):
            git("config", key, value, cwd=tmp)
        git("symbolic-ref", "HEAD", f"refs/heads/{head}", cwd=tmp)
        (tmp / "git-daemon-export-ok").touch()
        git("update-server-info", cwd=tmp)  # info/refs + objects/info/packs for dumb HTTP clients
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
        return shas
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _branch_heads(commits: list[CommitSpec], shas: Mapping[str, str]) -> dict[str, str]:
    heads: dict[str, str] = {}
    for c in commits:  # later commits of a branch win
        heads[c.branch] = shas[c.key]
    return heads


@contextmanager
def _locked(root: Path) -> Iterator[None]:
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".gitremotes.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _ensure(
    root: Path, name: str, commits: list[CommitSpec], tags: Mapping[str, tuple[str, str | None]], head: str
) -> tuple[Path, dict[str, str]]:
    """Build the repo unless its stamp matches this content and its refs are untouched; return path, shas."""
    path = root / f"{name}.git"
    stamp = path / STAMP
    stream = _fast_import_stream(commits, tags)
    digest = hashlib.sha256(stream + head.encode()).hexdigest()
    if stamp.exists():
        try:
            saved = json.loads(stamp.read_text())
            if saved.get("content") == digest and _refs(path) == saved["refs"]:
                return path, saved["shas"]
        except (OSError, ValueError, KeyError, RuntimeError):
            pass
    path.parent.mkdir(parents=True, exist_ok=True)
    shas = _build_repo(path, commits, stream, head)
    heads = _branch_heads(commits, shas)
    # The stream leaves every branch at its last commit; make sure they are exactly the spec's heads.
    for branch, sha in heads.items():
        git("update-ref", f"refs/heads/{branch}", sha, cwd=path)
    stamp.write_text(json.dumps({"content": digest, "shas": shas, "refs": _refs(path)}, indent=2, sort_keys=True))
    return path, shas


def _peeled_tags(path: Path) -> dict[str, str]:
    out = git("for-each-ref", "refs/tags", "--format=%(refname:short) %(objectname) %(*objectname)", cwd=path)
    tags = {}
    for line in out.splitlines():
        parts = line.split()
        tags[parts[0]] = parts[2] if len(parts) > 2 else parts[1]
    return tags


def source_refs_of(remotes: Mapping[str, Any]) -> dict[str, str]:
    """Remotes.source_refs from the JSON form (what the hub's ready file holds)."""
    refs: dict[str, str] = {}
    pin = remotes.get("genesis", {}).get("pin")
    if pin:
        refs["genesis"] = str(pin)  # a SHA, as the catalog's ref (2db18df4…) is
    for repo in ("club3090", "qwen36_dual"):
        for source, sha in (remotes.get(repo, {}).get("snapshots") or {}).items():
            if source != "club3090":
                refs[source] = sha
    return refs


def make_remotes(root: Path | str) -> Remotes:
    """Create (or verify) the bare repos under `root`; idempotent and deterministic."""
    root = Path(root)
    with _locked(root):
        vllm_commits = _vllm_commits()
        vpath, vshas = _ensure(root, VLLM_REPO, vllm_commits, {}, "main")
        gen_commits = _genesis_commits()
        gpath, gshas = _ensure(root, GENESIS_REPO, gen_commits, GENESIS_TAGS, "main")
        club_commits = _club_commits()
        cpath, cshas = _ensure(root, CLUB_REPO, club_commits, {}, RECIPE_DEFAULT_BRANCH)
        qd_commits = _qwen_dual_commits()
        qpath, qshas = _ensure(root, QWEN_DUAL_REPO, qd_commits, {}, RECIPE_DEFAULT_BRANCH)
    vllm = VllmRemote(
        name=VLLM_REPO,
        path=str(vpath),
        branches=_branch_heads(vllm_commits, vshas),
        tags={},
        commits=dict(vshas),
        branch=VLLM_BRANCH,
        branch_commits=tuple(vshas[c.key] for c in vllm_commits if c.branch == VLLM_BRANCH),
        main_head=vshas["main2"],
    )
    genesis = GenesisRemote(
        name=GENESIS_REPO,
        path=str(gpath),
        branches=_branch_heads(gen_commits, gshas),
        tags=_peeled_tags(gpath),
        commits=dict(gshas),
        dev_commits=tuple(gshas[c.key] for c in gen_commits if c.branch == "dev"),
        main_head=gshas["main2"],
        main_commits=(gshas["main1"], gshas["main2"]),
        root_commit=gshas["root"],
        pin=gshas["pin"],
    )
    club = ClubRemote(
        name=CLUB_REPO,
        path=str(cpath),
        branches=_branch_heads(club_commits, cshas),
        tags={},
        commits=dict(cshas),
        pin=cshas["may"],
        head=cshas["head"],
        snapshots={"club3090-spring": cshas["spring"], "club3090-may": cshas["may"], "club3090": cshas["aug"]},
    )
    qwen_dual = ClubRemote(
        name=QWEN_DUAL_REPO,
        path=str(qpath),
        branches=_branch_heads(qd_commits, qshas),
        tags={},
        commits=dict(qshas),
        pin=qshas["frozen"],
        head=qshas["frozen"],
        snapshots={"qwen36-dual-3090": qshas["frozen"]},
    )
    return Remotes(str(root), vllm, genesis, club, qwen_dual)


def add_commit(repo: RemoteRepo, branch: str, files: Mapping[str, str | None], message: str) -> str:
    """Append a commit to `branch` (changing `files`; None deletes) and return its sha.

    For tests that need a branch to move after the lock was taken. Dated one day after the branch tip so it
    is deterministic too. The repo's stamp no longer matches afterwards, so the next make_remotes() resets it.
    """
    path = Path(repo.path)
    tip = git("rev-parse", f"refs/heads/{branch}", cwd=path).strip()
    tip_time = int(git("log", "-1", "--format=%ct", tip, cwd=path).strip())
    when = f"{tip_time + 86400} +0000"
    env = {"GIT_INDEX_FILE": str(path / "rigup-add-commit.index")}
    try:
        git("read-tree", tip, cwd=path, env=env)
        for name, content in files.items():
            if content is None:  # --index-info with mode 0 removes it (a bare repo has no work tree)
                git("update-index", "--index-info", cwd=path, env=env, input=f"0 {'0' * 40}\t{name}\n".encode())
            else:
                blob = git("hash-object", "-w", "--stdin", cwd=path, input=content.encode()).strip()
                git("update-index", "--add", "--cacheinfo", f"100644,{blob},{name}", cwd=path, env=env)
        tree = git("write-tree", cwd=path, env=env).strip()
    finally:
        (path / "rigup-add-commit.index").unlink(missing_ok=True)
    name, _, email = AUTHOR.partition(" <")
    ident = {
        "GIT_AUTHOR_NAME": name,
        "GIT_AUTHOR_EMAIL": email.rstrip(">"),
        "GIT_AUTHOR_DATE": when,
        "GIT_COMMITTER_NAME": name,
        "GIT_COMMITTER_EMAIL": email.rstrip(">"),
        "GIT_COMMITTER_DATE": when,
    }
    sha = git("commit-tree", tree, "-p", tip, "-m", message, cwd=path, env=ident).strip()
    git("update-ref", f"refs/heads/{branch}", sha, tip, cwd=path)
    git("update-server-info", cwd=path)
    return sha


# --------------------------------------------------------------------------------------------------
# Serving
# --------------------------------------------------------------------------------------------------


def _url_host(bind: str) -> str:
    if bind in ("0.0.0.0", ""):
        return "127.0.0.1"
    return f"[{bind}]" if ":" in bind else bind


class _GitHttpHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "rigup-testbed-git/1"
    timeout = 120  # drop idle keep-alive connections
    root: Path
    smart: bool

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        if os.environ.get("RIGUP_GITHTTP_VERBOSE"):
            super().log_message(format, *args)

    def _body(self) -> bytes:
        if (self.headers.get("Transfer-Encoding") or "").lower() == "chunked":
            out = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return bytes(out)
                out += self.rfile.read(size)
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _reply(self, status: int, body: bytes, headers: Mapping[str, str]) -> None:
        self.send_response(status)
        for k, v in headers.items():
            if k.lower() not in ("content-length", "status"):
                self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _handle(self) -> None:
        raw_path, _, query = self.path.partition("?")
        path = urllib.parse.unquote(raw_path)
        body = self._body() if self.command == "POST" else b""
        if ".." in path.split("/"):
            self._reply(403, b"forbidden\n", {"Content-Type": "text/plain"})
            return
        if self.smart:
            self._cgi(path, query, body)
        else:
            self._static(path)

    def _cgi(self, path: str, query: str, body: bytes) -> None:
        env = {
            **os.environ,
            **GIT_ENV,
            "GIT_PROJECT_ROOT": str(self.root),
            "GIT_HTTP_EXPORT_ALL": "1",
            "PATH_INFO": path,
            "QUERY_STRING": query,
            "REQUEST_METHOD": self.command,
            "REMOTE_ADDR": str(self.client_address[0]),
            "CONTENT_TYPE": self.headers.get("Content-Type") or "",
            "CONTENT_LENGTH": str(len(body)),
            "SERVER_PROTOCOL": "HTTP/1.1",
            "GATEWAY_INTERFACE": "CGI/1.1",
        }
        if self.headers.get("Git-Protocol"):
            env["GIT_PROTOCOL"] = self.headers["Git-Protocol"]
        if self.headers.get("Content-Encoding"):
            env["HTTP_CONTENT_ENCODING"] = self.headers["Content-Encoding"]
        proc = subprocess.run(["git", "http-backend"], input=body, capture_output=True, env=env, check=False)
        head, sep, payload = proc.stdout.partition(b"\r\n\r\n")
        if not sep:
            head, sep, payload = proc.stdout.partition(b"\n\n")
        if not sep:
            self._reply(500, proc.stderr or b"http-backend failed\n", {"Content-Type": "text/plain"})
            return
        status = 200
        headers: dict[str, str] = {}
        for line in head.decode(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.lower() == "status":
                status = int(value.strip().split()[0])
            elif key:
                headers[key.strip()] = value.strip()
        self._reply(status, payload, headers)

    def _static(self, path: str) -> None:
        target = (self.root / path.lstrip("/")).resolve()
        if not target.is_relative_to(self.root) or not target.is_file():
            self._reply(404, b"not found\n", {"Content-Type": "text/plain"})
            return
        ctype = "text/plain" if target.name == "refs" else "application/octet-stream"
        self._reply(200, target.read_bytes(), {"Content-Type": ctype})

    do_GET = _handle
    do_HEAD = _handle
    do_POST = _handle


class GitServer:
    """Git over HTTP, as GitHub serves it (https; GitHub turned the git:// protocol off in 2022):
    start() -> 'http://host:port' (https:// with `tls`, a (certificate, key) pair), stop(); also a context manager. smart=False serves dumb HTTP only."""

    def __init__(self, root: Path | str, bind: str = "127.0.0.1", port: int = 0, smart: bool = True,
                 tls: tuple[Path, Path] | None = None) -> None:
        self.root = Path(root).resolve()
        self.tls = tls
        self.bind = bind
        self.port = port
        self.smart = smart
        self.url: str | None = None
        self._server: BackgroundServer | None = None

    def start(self) -> str:
        handler = type("BoundGitHttpHandler", (_GitHttpHandler,), {"root": self.root, "smart": self.smart})
        server = BackgroundServer(self.bind, self.port, handler, "githttp", tls=self.tls)
        self._server = server
        self.port = server.port
        self.url = f"{server.scheme}://{_url_host(self.bind)}:{self.port}"
        server.start()
        return self.url

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    def __enter__(self) -> GitServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rigup_testbed.gitremotes", description=__doc__.splitlines()[0])
    parser.add_argument("--root", required=True, help="directory holding <owner>/<name>.git")
    parser.add_argument("--bind", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="HTTP port; 0 = pick a free port")
    parser.add_argument("--dumb-http", action="store_true", help="serve static dumb HTTP instead of smart HTTP")
    parser.add_argument("--ready-file", help="JSON written once serving (default: ROOT/gitremotes.ready.json)")
    add_tls_arguments(parser)
    args = parser.parse_args(argv)

    root = Path(args.root)
    remotes = make_remotes(root)
    server = GitServer(root, args.bind, args.port, not args.dumb_http, tls=tls_of(args))

    def start() -> tuple[dict[str, Any], list[str]]:
        url = server.start()
        return {"url": url, "remotes": remotes.to_json()}, [url]

    ready = Path(args.ready_file) if args.ready_file else root / "gitremotes.ready.json"
    return run_service(ready, start, server.stop)


if __name__ == "__main__":
    sys.exit(main())
