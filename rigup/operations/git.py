"""Git checkouts pinned to an exact commit (pyinfra's git.repo cannot pin a commit on first clone)."""

from __future__ import annotations

from typing import Any

from pyinfra import host
from pyinfra.api import OperationError, QuoteString, StringCommand, operation

from rigup.facts.git import GitCheckout

SHA40_CHARS = frozenset("0123456789abcdef")


# git must never stop to ask for credentials in an unattended run.
GIT_ENV = "GIT_TERMINAL_PROMPT=0"


def _is_sha(value: str) -> bool:
    return len(value) == 40 and set(value) <= SHA40_CHARS


def _git(dest: str, *args: Any) -> StringCommand:
    return StringCommand("env", GIT_ENV, "git", "-C", QuoteString(dest), *args)


def _fetch_commands(dest: str, commit: str, full_clone: bool, have_commit_check: bool) -> list[StringCommand]:
    """Commands that make `commit` present in the clone without touching the work tree."""
    dest_q = QuoteString(dest)
    fetch_all = StringCommand(
        "env", GIT_ENV, "git", "-C", dest_q, "fetch", "--quiet", "--tags", "origin",
        QuoteString("+refs/heads/*:refs/remotes/origin/*"),
    )
    if full_clone:
        # The pin sits on a branch a shallow fetch by sha may not reach (Genesis dev): fetch every branch.
        unshallow = StringCommand(
            "if", "[", "-f", QuoteString(f"{dest}/.git/shallow"), "];", "then",
            "env", GIT_ENV, "git", "-C", dest_q, "fetch", "--quiet", "--unshallow", "origin", ";", "fi",
        )
        fetch = StringCommand("(", unshallow, "&&", fetch_all, ")")
    else:
        # Smallest transfer first (one commit, no history), whole branches when the server refuses a sha.
        shallow = StringCommand("env", GIT_ENV, "git", "-C", dest_q, "fetch", "--quiet", "--depth", "1", "origin", commit)
        fetch = StringCommand("(", shallow, "||", fetch_all, ")")
    if not have_commit_check:
        return [fetch]
    has = StringCommand("git", "-C", dest_q, "cat-file", "-e", QuoteString(f"{commit}^{{commit}}"), "2>/dev/null")
    return [StringCommand(has, "||", fetch)]


@operation()
def git_checkout(
    src: str,
    dest: str,
    commit: str,
    full_clone: bool = False,
    required_paths: tuple[str, ...] | list[str] = (),
):
    """
    Make ``dest`` a git checkout of exactly ``commit`` from ``src`` (detached HEAD).

    + src: remote URL (becomes ``origin``; changed in place when it differs)
    + dest: checkout directory on the rig; created when absent (an existing non-git directory is an error)
    + commit: full 40-hex commit to check out (from the lock)
    + full_clone: fetch every branch instead of just the commit (pins a shallow fetch cannot reach)
    + required_paths: paths under ``dest`` that must exist at that commit (what the compose mounts)

    Local edits to tracked files are never discarded: the operation fails and lists them.
    Untracked files are left alone (git itself refuses to overwrite one on checkout).

    **Example:**

    .. code:: python

        git_checkout(
            name="Check out Genesis at the locked commit",
            src="https://github.com/Sandermage/genesis-vllm-patches.git",
            dest="/opt/rigup/sources/genesis",
            commit="2db18df4bc3abd4eb58a9b2e0342082fa7012c64",
            full_clone=True,
        )
    """
    if not _is_sha(commit):
        raise OperationError(f"git_checkout: commit must be a full 40-hex sha, got {commit!r}")
    files = tuple(required_paths)
    current = host.get_fact(GitCheckout, path=dest, files=files)
    state = current["state"]
    if state == "notrepo":
        raise OperationError(f"{dest} exists and is not a git checkout; move it away and re-run")
    if state == "repo" and current["dirty"]:
        changed = ", ".join(line.strip() for line in current["dirty"])
        raise OperationError(
            f"{dest} has local changes to tracked files ({changed}); rigup will not discard them. "
            f"Inspect with `git -C {dest} diff`, then commit elsewhere or `git -C {dest} checkout -- .` and re-run"
        )
    if state == "repo" and current["head"] == commit and current["origin"] == src:
        if current["missing"]:
            raise OperationError(
                f"{dest} is at {commit[:12]} but lacks {', '.join(current['missing'])}: "
                "the locked commit does not have the files the variant mounts"
            )
        host.noop(f"{dest} is a clean checkout of {commit[:12]}")
        return

    dest_q = QuoteString(dest)
    if state in ("absent", "empty"):
        yield StringCommand("mkdir", "-p", dest_q)
        yield StringCommand("git", "init", "--quiet", dest_q)
        yield _git(dest, "remote", "add", "origin", QuoteString(src))
        yield from _fetch_commands(dest, commit, full_clone, have_commit_check=False)
    else:
        if current["origin"] is None:
            yield _git(dest, "remote", "add", "origin", QuoteString(src))
        elif current["origin"] != src:
            yield _git(dest, "remote", "set-url", "origin", QuoteString(src))
        if current["head"] != commit:
            yield from _fetch_commands(dest, commit, full_clone, have_commit_check=True)
    if current["head"] != commit:
        yield _git(dest, "-c", "advice.detachedHead=false", "checkout", "--quiet", "--detach", commit)
    # Prove the result instead of trusting the commands: HEAD is the pin and the mounted files exist.
    checks: list[Any] = [
        "test", "\"$(git -C", dest_q, "rev-parse HEAD)\"", "=", commit,
        "||", "{", "echo", QuoteString(f"{dest}: HEAD is not {commit}"), ">&2;", "exit", "1;", "}",
    ]
    for rel in files:
        target = QuoteString(f"{dest.rstrip('/')}/{rel}")
        checks += [
            ";", "test", "-e", target, "||", "{", "echo",
            QuoteString(f"{dest}: {rel} is missing at {commit[:12]}"), ">&2;", "exit", "1;", "}",
        ]
    yield StringCommand(*checks)

