"""rigup/operations/git.py: git_checkout pins a clone to an exact commit, run for real through pyinfra's API on
@local against local git remotes (smart HTTP, like the test bed's hub and GitHub)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pyinfra.api import Config, Inventory, OperationError, State
from pyinfra.api.connect import connect_all, disconnect_all
from pyinfra.api.operation import add_op
from pyinfra.api.operations import run_ops

from rigup.facts.git import GitCheckout
from rigup.operations.git import git_checkout
from rigup_testbed.gitremotes import MARLIN_DIR, GitServer, Remotes, make_remotes

MARLIN = f"{MARLIN_DIR}/marlin.py"
MPLINEAR = f"{MARLIN_DIR}/MPLinearKernel.py"


@pytest.fixture(scope="module")
def remotes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Remotes, str]]:
    root = tmp_path_factory.mktemp("git")
    rem = make_remotes(root)
    with GitServer(root) as server:
        yield rem, server.url or ""


def converge(**kwargs: Any) -> tuple[bool, list[str]]:
    """Run git_checkout once on @local; returns (changed, commands it ran)."""
    inventory = Inventory((["@local"], {}))
    state = State(inventory=inventory, config=Config())
    connect_all(state)
    try:
        host = inventory.get_host("@local")
        meta = add_op(state, git_checkout, **kwargs)[host]
        run_ops(state)
        assert meta.did_succeed(), state.results[host]
        return meta.did_change(), [str(c) for c in meta._commands or []]
    finally:
        disconnect_all(state)


def head(path: Path) -> str:
    return subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()


def test_first_clone_lands_exactly_on_the_pin_and_rerun_is_a_noop(remotes: tuple[Remotes, str], tmp_path: Path) -> None:
    rem, base = remotes
    dest = tmp_path / "sources" / "vllm-fork"
    pin = rem.vllm.branch_commits[1]  # not the branch head: git.repo could not land here on first clone
    args = dict(src=rem.vllm.url(base), dest=str(dest), commit=pin, required_paths=(MARLIN, MPLINEAR))
    changed, _ = converge(**args)
    assert changed and head(dest) == pin
    assert "MARLIN_PAD_SUB_TILE_N = True" in (dest / MARLIN).read_text()
    assert converge(**args) == (False, [])


def test_dev_branch_pin_that_main_cannot_reach(remotes: tuple[Remotes, str], tmp_path: Path) -> None:
    rem, base = remotes
    pin = rem.genesis.pin  # like Genesis 2db18df: on dev, not an ancestor of main
    for full_clone in (True, False):  # full: every branch; shallow: the one commit by sha
        dest = tmp_path / f"genesis-{full_clone}"
        changed, _ = converge(src=rem.genesis.url(base), dest=str(dest), commit=pin, full_clone=full_clone)
        assert changed and head(dest) == pin
        assert (dest / "vllm" / "_genesis").is_dir()


def test_moving_to_a_new_pin_and_back(remotes: tuple[Remotes, str], tmp_path: Path) -> None:
    rem, base = remotes
    dest = tmp_path / "vllm-fork"
    first, last = rem.vllm.branch_commits[0], rem.vllm.branch_commits[-1]
    converge(src=rem.vllm.url(base), dest=str(dest), commit=first)
    changed, _ = converge(src=rem.vllm.url(base), dest=str(dest), commit=last)
    assert changed and head(dest) == last
    changed, _ = converge(src=rem.vllm.url(base), dest=str(dest), commit=first)
    assert changed and head(dest) == first
    assert converge(src=rem.vllm.url(base), dest=str(dest), commit=first)[0] is False


def test_local_edits_fail_with_the_file_list_and_are_kept(remotes: tuple[Remotes, str], tmp_path: Path) -> None:
    rem, base = remotes
    dest = tmp_path / "vllm-fork"
    converge(src=rem.vllm.url(base), dest=str(dest), commit=rem.vllm.head)
    (dest / MARLIN).write_text("# my local experiment\n")
    for commit in (rem.vllm.head, rem.vllm.branch_commits[0]):  # also when no move is needed
        with pytest.raises(OperationError, match=f"local changes to tracked files \\(M {MARLIN}\\)"):
            converge(src=rem.vllm.url(base), dest=str(dest), commit=commit)
    assert (dest / MARLIN).read_text() == "# my local experiment\n"
    assert head(dest) == rem.vllm.head


def test_untracked_files_are_left_alone(remotes: tuple[Remotes, str], tmp_path: Path) -> None:
    rem, base = remotes
    dest = tmp_path / "vllm-fork"
    converge(src=rem.vllm.url(base), dest=str(dest), commit=rem.vllm.head)
    (dest / "notes.txt").write_text("mine\n")
    assert converge(src=rem.vllm.url(base), dest=str(dest), commit=rem.vllm.head)[0] is False
    converge(src=rem.vllm.url(base), dest=str(dest), commit=rem.vllm.branch_commits[0])
    assert (dest / "notes.txt").read_text() == "mine\n"


def test_changed_remote_url_is_updated_in_place(remotes: tuple[Remotes, str], tmp_path: Path) -> None:
    rem, base = remotes
    dest = tmp_path / "vllm-fork"
    converge(src=rem.vllm.url(base), dest=str(dest), commit=rem.vllm.head)
    mirror = rem.vllm.url(base).replace("127.0.0.1", "localhost")
    changed, _ = converge(src=mirror, dest=str(dest), commit=rem.vllm.head)
    assert changed
    origin = subprocess.run(["git", "-C", str(dest), "config", "--get", "remote.origin.url"], capture_output=True, text=True)
    assert origin.stdout.strip() == mirror
    assert converge(src=mirror, dest=str(dest), commit=rem.vllm.head)[0] is False


def test_a_directory_that_is_not_a_checkout_is_refused(remotes: tuple[Remotes, str], tmp_path: Path) -> None:
    rem, base = remotes
    dest = tmp_path / "vllm-fork"
    dest.mkdir()
    (dest / "file").write_text("x")
    with pytest.raises(OperationError, match="is not a git checkout"):
        converge(src=rem.vllm.url(base), dest=str(dest), commit=rem.vllm.head)


def test_missing_mounted_file_at_the_pin_fails(remotes: tuple[Remotes, str], tmp_path: Path) -> None:
    rem, base = remotes
    dest = tmp_path / "vllm-fork"
    converge(src=rem.vllm.url(base), dest=str(dest), commit=rem.vllm.head)
    with pytest.raises(OperationError, match="lacks vllm/not/there.py"):
        converge(src=rem.vllm.url(base), dest=str(dest), commit=rem.vllm.head, required_paths=("vllm/not/there.py",))


def test_commit_must_be_a_full_sha(remotes: tuple[Remotes, str], tmp_path: Path) -> None:
    rem, base = remotes
    with pytest.raises(OperationError, match="full 40-hex"):
        converge(src=rem.vllm.url(base), dest=str(tmp_path / "x"), commit="marlin-pad-sub-tile-n")


def test_fact_parses_its_output() -> None:
    fact = GitCheckout()
    out = fact.process(["state=repo", "head=" + "a" * 40, "origin=https://x/y.git", "dirty= M a.py", "missing=b.py"])
    assert out == {"state": "repo", "head": "a" * 40, "origin": "https://x/y.git", "dirty": [" M a.py"], "missing": ["b.py"]}
    assert fact.process(["state=absent"])["head"] is None
    with pytest.raises(Exception, match="unexpected git checkout state"):
        fact.process(["garbage"])
