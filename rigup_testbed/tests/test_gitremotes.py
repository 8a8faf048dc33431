"""The test bed's git remotes: deterministic bare repos served over (smart and dumb) HTTP to a stock git client."""

from __future__ import annotations

import json
import os
import py_compile
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from rigup_testbed import gitremotes
from rigup_testbed.gitremotes import GitServer, Remotes, add_commit, git, make_remotes

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
def server(root: Path, remotes: Remotes) -> Iterator[str]:
    """The http:// base URL of one (smart HTTP) GitServer over `root`."""
    with GitServer(root, "127.0.0.1", 0) as srv:
        assert srv.url is not None
        yield srv.url


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


def test_vllm_fork_branch_over_smart_http(server: str, remotes: Remotes, tmp_path: Path) -> None:
    v = remotes.vllm
    assert len(v.branch_commits) == 3 and v.branch_commits[-1] == v.head
    url = v.url(server)
    assert url.startswith("http://127.0.0.1:") and url.endswith("/noonghunna/vllm.git")
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


def test_genesis_dev_pin_not_reachable_from_main(server: str, remotes: Remotes, tmp_path: Path) -> None:
    g = remotes.genesis
    url = g.url(server)
    pin = g.pin
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
    # dev: the three tagged releases, the pin, three later commits
    assert len(g.dev_commits) == 7 and g.dev_commits[3] == pin and g.dev_commits[-1] == g.dev_head


def test_genesis_apply_all_stand_in_runs(server: str, remotes: Remotes, tmp_path: Path) -> None:
    work = tmp_path / "genesis"
    assert run("clone", "--quiet", remotes.genesis.url(server), str(work)).returncode == 0
    assert run("checkout", "--quiet", remotes.genesis.commits["dev2"], cwd=work).returncode == 0
    env = {**os.environ, "GENESIS_ENABLE_P64_QWEN3CODER_MTP_STREAMING": "1"}
    cmd = [sys.executable, "-m", "vllm._genesis.patches.apply_all"]
    out = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, check=True)
    assert "[Genesis] v7.72.2 applied: P64_QWEN3CODER_MTP_STREAMING" in out.stdout
    assert "apply_all elapsed" in out.stdout


def _ls_remote(url: str) -> dict[str, str]:
    r = run("ls-remote", url)
    assert r.returncode == 0, r.stderr
    return {ref: sha for sha, ref in (line.split("\t") for line in r.stdout.splitlines())}


def test_ls_remote_lists_branches_and_tags(server: str, remotes: Remotes) -> None:
    g, v = remotes.genesis, remotes.vllm
    refs = _ls_remote(g.url(server))
    assert refs["refs/heads/main"] == g.main_head and refs["refs/heads/dev"] == g.dev_head
    # upstream's annotated tags on the three dev commits before the pin, peeled; its lightweight one on main
    for name, commit in zip(("v7.10.0", "v7.50-stable-2026-04-27", "v7.51-stable-2026-04-27"), g.dev_commits, strict=False):
        assert refs[f"refs/tags/{name}^{{}}"] == commit == g.tags[name] and refs[f"refs/tags/{name}"] != commit
    assert g.dev_commits[2] == g.tags[g.tag] and g.dev_commits[3] == g.pin
    assert refs[f"refs/tags/{g.main_tag}"] == g.main_commits[0] == g.tags[g.main_tag]  # lightweight: no ^{}
    assert f"refs/tags/{g.main_tag}^{{}}" not in refs
    assert refs["HEAD"] == g.main_head
    vrefs = _ls_remote(v.url(server))
    assert vrefs[f"refs/heads/{v.branch}"] == v.head and vrefs["refs/heads/main"] == v.main_head


def test_recipe_repos_are_shaped_like_upstream(server: str, remotes: Remotes) -> None:
    """club-3090 and qwen36-dual-3090 have master as HEAD and no main branch, as on GitHub (gitremotes'
    RECIPE_DEFAULT_BRANCH): a recipe source that followed `main` would not resolve against them."""
    for repo in (remotes.club3090, remotes.qwen_dual):
        refs = _ls_remote(repo.url(server))
        assert refs["HEAD"] == refs["refs/heads/master"] == repo.head
        assert "refs/heads/main" not in refs
        assert sorted(r for r in refs if r.startswith("refs/heads/")) == ["refs/heads/master"]


def test_smart_http_clone_shallow_and_fetch_by_sha(server: str, remotes: Remotes, tmp_path: Path) -> None:
    g = remotes.genesis
    work = tmp_path / "http"
    r = run("clone", "--quiet", "--depth", "1", "--branch", "main", g.url(server), str(work))
    assert r.returncode == 0, r.stderr
    assert not has_commit(work, g.pin)
    r = run("fetch", "--quiet", "--depth", "1", "origin", g.pin, cwd=work)
    assert r.returncode == 0, r.stderr
    assert has_commit(work, g.pin)


def test_smart_http_is_what_git_negotiates(server: str, remotes: Remotes) -> None:
    # git's smart-HTTP discovery: GET info/refs?service=git-upload-pack answers the service's own content type
    # (gitprotocol-http(5)); a dumb server would answer plain text.
    url = f"{remotes.vllm.url(server)}/info/refs?service=git-upload-pack"
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.headers["Content-Type"] == "application/x-git-upload-pack-advertisement"
    with pytest.raises(urllib.error.HTTPError) as err:  # no pushes, as to GitHub without credentials
        urllib.request.urlopen(f"{remotes.vllm.url(server)}/info/refs?service=git-receive-pack", timeout=10)
    assert err.value.code == 403


def test_dumb_http_clone(root: Path, remotes: Remotes, tmp_path: Path) -> None:
    srv = GitServer(root, "127.0.0.1", 0, smart=False)
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
        "genesis": list(remotes.genesis.dev_commits[3:]),  # the pin and after (the mounts follow the catalog's pin)
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


def test_club3090_clone_at_pin(server: str, remotes: Remotes, tmp_path: Path) -> None:
    c = remotes.club3090
    assert c.url(server).endswith("/noonghunna/club-3090.git")
    work = tmp_path / "club"
    r = run("clone", "--quiet", c.url(server), str(work))
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


def test_unknown_repo_is_refused(server: str) -> None:
    assert run("ls-remote", f"{server}/nobody/nothing.git").returncode != 0


def test_subprocess_mode(tmp_path: Path) -> None:
    ready = tmp_path / "ready.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "rigup_testbed.gitremotes", "--root", str(tmp_path / "root"), "--bind", "127.0.0.1",
         "--port", "0", "--ready-file", str(ready)],  # fmt: skip
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        info = json.loads(ready.read_text())
        assert info["url"] == url and url.startswith("http://127.0.0.1:")
        genesis = info["remotes"]["genesis"]
        refs = _ls_remote(f"{url}/{genesis['name']}.git")
        assert refs["refs/heads/dev"] == genesis["dev_commits"][-1]
        assert gitremotes.source_refs_of(info["remotes"])["genesis"] == genesis["pin"] == genesis["commits"]["pin"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        assert not ready.exists()
        assert run("ls-remote", f"{url}/{genesis['name']}.git").returncode != 0  # stopped serving
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
