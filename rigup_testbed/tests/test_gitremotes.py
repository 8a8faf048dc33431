"""The test bed's git remotes: deterministic bare repos served over git:// and HTTP to a stock git client."""

from __future__ import annotations

import json
import os
import py_compile
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from rigup_testbed import gitremotes
from rigup_testbed.gitremotes import GitHttpServer, GitServer, Remotes, add_commit, git, make_remotes

REPO_ROOT = Path(__file__).resolve().parents[2]
MARLIN = f"{gitremotes.MARLIN_DIR}/marlin.py"
MPLINEAR = f"{gitremotes.MARLIN_DIR}/MPLinearKernel.py"
APPLY_ALL = "vllm/_genesis/patches/apply_all.py"


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("remotes")


@pytest.fixture(scope="module")
def remotes(root: Path) -> Remotes:
    return make_remotes(root)


@pytest.fixture(scope="module")
def server(root: Path, remotes: Remotes) -> Iterator[tuple[str, str]]:
    """(git:// base URL, http:// base URL) of one GitServer over `root`."""
    srv = GitServer(root, "127.0.0.1", 0, http_port=0)
    git_url = srv.start()
    if srv.http_url is None:
        raise RuntimeError("GitServer started without HTTP")
    yield git_url, srv.http_url
    srv.stop()


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **gitremotes.GIT_ENV}
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, env=env, check=False)


def has_commit(repo: Path, sha: str) -> bool:
    return run("cat-file", "-e", f"{sha}^{{commit}}", cwd=repo).returncode == 0


def test_layout_and_shas_are_deterministic(tmp_path: Path, remotes: Remotes, root: Path) -> None:
    assert Path(remotes.vllm.path) == root / "noonghunna" / "vllm.git"
    assert Path(remotes.genesis.path) == root / "Sandermage" / "genesis-vllm-patches.git"
    again = make_remotes(tmp_path / "elsewhere")
    assert again.vllm.commits == remotes.vllm.commits and again.genesis.commits == remotes.genesis.commits
    assert again.genesis.tags == remotes.genesis.tags
    # fixed dates: the first commit is at the fixed epoch whatever the clock says
    first = remotes.genesis.root_commit
    log = git("log", "-1", "--format=%at|%ct|%an <%ae>", first, cwd=Path(remotes.genesis.path)).strip()
    assert log == f"{gitremotes.EPOCH}|{gitremotes.EPOCH}|{gitremotes.AUTHOR}"


def test_make_remotes_is_idempotent_and_resets_moved_branches(tmp_path: Path) -> None:
    first = make_remotes(tmp_path)
    refs_before = git("for-each-ref", cwd=Path(first.vllm.path))
    assert make_remotes(tmp_path) == first
    assert git("for-each-ref", cwd=Path(first.vllm.path)) == refs_before
    moved = add_commit(first.vllm, first.vllm.branch, {MARLIN: "MOVED = True\n"}, "move the pin")
    assert git("rev-parse", f"refs/heads/{first.vllm.branch}", cwd=Path(first.vllm.path)).strip() == moved
    assert git("rev-parse", f"{moved}^", cwd=Path(first.vllm.path)).strip() == first.vllm.head
    assert make_remotes(tmp_path) == first
    assert git("rev-parse", f"refs/heads/{first.vllm.branch}", cwd=Path(first.vllm.path)).strip() == first.vllm.head


def test_vllm_fork_branch_over_git_protocol(server: tuple[str, str], remotes: Remotes, tmp_path: Path) -> None:
    v = remotes.vllm
    assert len(v.branch_commits) == 3 and v.branch_commits[-1] == v.head
    url = v.url(server[0])
    assert url.startswith("git://127.0.0.1:") and url.endswith("/noonghunna/vllm.git")
    work = tmp_path / "vllm-src"
    r = run("clone", "--quiet", "--depth", "1", "--branch", v.branch, url, str(work))
    assert r.returncode == 0, r.stderr
    assert git("rev-parse", "HEAD", cwd=work).strip() == v.head
    for rel in (MARLIN, MPLINEAR):
        py_compile.compile(str(work / rel), doraise=True)
    assert "MARLIN_PAD_SUB_TILE_N = True" in (work / MARLIN).read_text()
    # the pin can move between commits of the branch: an older one is fetchable by sha and differs
    r = run("fetch", "--quiet", "--depth", "1", "origin", v.branch_commits[0], cwd=work)
    assert r.returncode == 0, r.stderr
    assert git("show", f"{v.branch_commits[0]}:{MARLIN}", cwd=work) != (work / MARLIN).read_text()
    # main is the fork base: no padding
    main = run("show", f"{v.main_head}:{MARLIN}", cwd=Path(v.path))
    assert "MARLIN_PAD_SUB_TILE_N = False" in main.stdout


def test_genesis_dev_pin_not_reachable_from_main(server: tuple[str, str], remotes: Remotes, tmp_path: Path) -> None:
    g = remotes.genesis
    url = g.url(server[0])
    pin = g.dev_commits[0]
    shallow = tmp_path / "shallow"
    assert run("clone", "--quiet", "--depth", "1", "--branch", "main", url, str(shallow)).returncode == 0
    assert git("rev-parse", "HEAD", cwd=shallow).strip() == g.main_head
    assert not has_commit(shallow, pin)
    assert run("checkout", "--quiet", pin, cwd=shallow).returncode != 0
    assert not (shallow / "vllm" / "_genesis").exists()
    # even the full history of main alone does not contain it
    main_only = tmp_path / "main-only"
    assert run("clone", "--quiet", "--single-branch", "--branch", "main", url, str(main_only)).returncode == 0
    assert not has_commit(main_only, pin)
    # a full clone has it (dev branch), and the pin is not an ancestor of main
    full = tmp_path / "full"
    assert run("clone", "--quiet", url, str(full)).returncode == 0
    assert run("checkout", "--quiet", pin, cwd=full).returncode == 0
    assert (full / APPLY_ALL).is_file() and (full / "external_probe" / "patch_tolist_cudagraph.py").is_file()
    assert run("merge-base", "--is-ancestor", pin, "origin/main", cwd=full).returncode == 1
    assert run("merge-base", "--is-ancestor", pin, "origin/dev", cwd=full).returncode == 0
    assert len(g.dev_commits) == 4 and g.dev_commits[-1] == g.dev_head


def test_genesis_apply_all_stand_in_runs(server: tuple[str, str], remotes: Remotes, tmp_path: Path) -> None:
    work = tmp_path / "genesis"
    assert run("clone", "--quiet", remotes.genesis.url(server[0]), str(work)).returncode == 0
    assert run("checkout", "--quiet", remotes.genesis.dev_commits[2], cwd=work).returncode == 0
    env = {**os.environ, "GENESIS_ENABLE_P64_QWEN3CODER_MTP_STREAMING": "1"}
    cmd = [sys.executable, "-m", "vllm._genesis.patches.apply_all"]
    out = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, check=True)
    assert "[Genesis] v7.72.2 applied: P64_QWEN3CODER_MTP_STREAMING" in out.stdout
    assert "apply_all elapsed" in out.stdout


def _ls_remote(url: str) -> dict[str, str]:
    r = run("ls-remote", url)
    assert r.returncode == 0, r.stderr
    return {ref: sha for sha, ref in (line.split("\t") for line in r.stdout.splitlines())}


def test_ls_remote_lists_branches_and_tags(server: tuple[str, str], remotes: Remotes) -> None:
    g, v = remotes.genesis, remotes.vllm
    for base in server:
        refs = _ls_remote(g.url(base))
        assert refs["refs/heads/main"] == g.main_head and refs["refs/heads/dev"] == g.dev_head
        assert refs["refs/tags/v7.72.2^{}"] == g.dev_commits[2] == g.tags["v7.72.2"]  # annotated tag, peeled
        assert refs["refs/tags/v7.69"] == g.dev_commits[0]  # lightweight tag
        assert refs["HEAD"] == g.main_head
        vrefs = _ls_remote(v.url(base))
        assert vrefs[f"refs/heads/{v.branch}"] == v.head and vrefs["refs/heads/main"] == v.main_head


def test_recipe_repos_are_shaped_like_upstream(server: tuple[str, str], remotes: Remotes) -> None:
    """club-3090 and qwen36-dual-3090 have master as HEAD and no main branch, as on GitHub (gitremotes'
    RECIPE_DEFAULT_BRANCH): a recipe source that followed `main` would not resolve against them."""
    for repo in (remotes.club3090, remotes.qwen_dual):
        for base in server:
            refs = _ls_remote(repo.url(base))
            assert refs["HEAD"] == refs["refs/heads/master"] == repo.head
            assert "refs/heads/main" not in refs
            assert sorted(r for r in refs if r.startswith("refs/heads/")) == ["refs/heads/master"]


def test_smart_http_clone_shallow_and_fetch_by_sha(server: tuple[str, str], remotes: Remotes, tmp_path: Path) -> None:
    g = remotes.genesis
    work = tmp_path / "http"
    r = run("clone", "--quiet", "--depth", "1", "--branch", "main", g.url(server[1]), str(work))
    assert r.returncode == 0, r.stderr
    assert not has_commit(work, g.dev_commits[1])
    r = run("fetch", "--quiet", "--depth", "1", "origin", g.dev_commits[1], cwd=work)
    assert r.returncode == 0, r.stderr
    assert has_commit(work, g.dev_commits[1])


def test_dumb_http_clone(root: Path, remotes: Remotes, tmp_path: Path) -> None:
    srv = GitHttpServer(root, "127.0.0.1", 0, smart=False)
    base = srv.start()
    try:
        work = tmp_path / "dumb"
        r = run("clone", "--quiet", "--branch", remotes.vllm.branch, remotes.vllm.url(base), str(work))
        assert r.returncode == 0, r.stderr
        assert git("rev-parse", "HEAD", cwd=work).strip() == remotes.vllm.head
        assert (work / MPLINEAR).is_file()
    finally:
        srv.stop()


def test_every_catalog_mount_exists_at_the_pins(remotes: Remotes) -> None:
    mounts = gitremotes.catalog_mount_paths()
    assert set(mounts) <= set(remotes.by_source()), "a catalog source has no stand-in remote"
    assert {"vllm-fork", "genesis", "club3090-spring", "club3090-may", "club3090"} <= set(mounts)
    snaps = remotes.club3090.snapshots
    pins = {
        "vllm-fork": [remotes.vllm.head, *remotes.vllm.branch_commits],
        "genesis": list(remotes.genesis.dev_commits),
        "club3090-spring": [snaps["club3090-spring"]],
        "club3090-may": [snaps["club3090-may"]],
        "club3090": [snaps["club3090"], remotes.club3090.head],
    }
    for source, paths in mounts.items():
        repo = Path(remotes.by_source()[source].path)
        for commit in pins[source]:
            for path in paths:
                assert run("cat-file", "-e", f"{commit}:{path}", cwd=repo).returncode == 0, f"{source}@{commit}: {path}"
    # Genesis main really lacks the tree the catalog mounts
    assert run("cat-file", "-e", f"{remotes.genesis.main_head}:vllm/_genesis", cwd=Path(remotes.genesis.path)).returncode != 0


def test_club3090_clone_at_pin(server: tuple[str, str], remotes: Remotes, tmp_path: Path) -> None:
    c = remotes.club3090
    assert c.url(server[0]).endswith("/noonghunna/club-3090.git")
    work = tmp_path / "club"
    r = run("clone", "--quiet", c.url(server[0]), str(work))
    assert r.returncode == 0, r.stderr
    assert git("rev-parse", "HEAD", cwd=work).strip() == c.head
    assert git("rev-parse", "HEAD~1", cwd=work).strip() == c.snapshots["club3090"]
    assert git("rev-parse", "HEAD~2", cwd=work).strip() == c.pin == c.snapshots["club3090-may"]
    # The spring snapshot has the sidecar the spring long-text recipe mounts; later snapshots dropped it.
    sidecar = "models/qwen3.6-27b/vllm/patches/patch_inputs_embeds_optional.py"
    run("checkout", "--quiet", c.snapshots["club3090-spring"], cwd=work)
    py_compile.compile(str(work / sidecar), doraise=True)
    run("checkout", "--quiet", c.snapshots["club3090"], cwd=work)
    assert not (work / sidecar).exists()


def test_unknown_repo_is_refused(server: tuple[str, str]) -> None:
    assert run("ls-remote", f"{server[0]}/nobody/nothing.git").returncode != 0
    assert run("ls-remote", f"{server[1]}/nobody/nothing.git").returncode != 0


def test_subprocess_mode(tmp_path: Path) -> None:
    ready = tmp_path / "ready.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "rigup_testbed.gitremotes", "--root", str(tmp_path / "root"), "--bind", "127.0.0.1",
         "--port", "0", "--http-port", "0", "--ready-file", str(ready)],  # fmt: skip
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        git_url = proc.stdout.readline().strip()
        http_url = proc.stdout.readline().strip()
        info = json.loads(ready.read_text())
        assert (info["git_url"], info["http_url"]) == (git_url, http_url)
        genesis = info["remotes"]["genesis"]
        refs = _ls_remote(f"{git_url}/{genesis['name']}.git")
        assert refs["refs/heads/dev"] == genesis["dev_commits"][-1]
        port = int(git_url.rsplit(":", 1)[1])
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        assert not ready.exists()
        with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            pass
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
