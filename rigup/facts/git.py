"""Fact: a git checkout's commit and local edits (for checkouts pinned to an exact commit)."""

from __future__ import annotations

from typing import Any

from pyinfra.api import FactBase, FactProcessError, QuoteString, StringCommand


class GitCheckout(FactBase[dict[str, Any]]):
    """
    State of a git checkout directory, and which of the given files it lacks.

    .. code:: python

        {
            "state": "repo",          # absent | empty | notrepo | repo
            "head": "67f8c2b...",     # commit checked out (None: no commit yet)
            "origin": "https://...",  # remote.origin.url (None: no origin)
            "dirty": [" M vllm/x.py"],  # git status --porcelain, tracked files only
            "missing": ["a/b.py"],    # files (relative) that do not exist
        }
    """

    def command(self, path: str, files: tuple[str, ...] | list[str] = ()) -> StringCommand:
        path_q = QuoteString(path)
        checks: list[Any] = []
        for rel in files:
            target = QuoteString(f"{path.rstrip('/')}/{rel}")
            checks += ["[", "-e", target, "]", "||", "echo", QuoteString(f"missing={rel}"), ";"]
        return StringCommand(
            StringCommand("d=", path_q, _separator=""),
            ";",
            "if [ ! -e \"$d\" ]; then echo state=absent;",
            "elif [ ! -e \"$d/.git\" ]; then",
            "if [ -d \"$d\" ] && [ -z \"$(ls -A \"$d\")\" ]; then echo state=empty; else echo state=notrepo; fi;",
            "else echo state=repo;",
            "echo head=$(git -C \"$d\" rev-parse -q --verify 'HEAD^{commit}' 2>/dev/null);",
            "echo origin=$(git -C \"$d\" config --get remote.origin.url);",
            "git -C \"$d\" status --porcelain=v1 --untracked-files=no | sed 's/^/dirty=/';",
            *checks,
            "fi",
            _separator=" ",
        )

    def process(self, output: list[str]) -> dict[str, Any]:
        result: dict[str, Any] = {"state": None, "head": None, "origin": None, "dirty": [], "missing": []}
        for line in output:
            key, sep, value = line.partition("=")
            if not sep:
                continue
            if key in ("dirty", "missing"):
                result[key].append(value)
            elif key in ("state", "head", "origin"):
                result[key] = value.strip() or None
        if result["state"] not in ("absent", "empty", "notrepo", "repo"):
            raise FactProcessError(f"unexpected git checkout state output: {output!r}")
        return result

