"""pyinfra's per-path file facts, for many paths in one command (part of rigup.pyinfra_patches.fact_batching's batch).

A converged deploy asks pyinfra's File, Directory and Link facts (one `stat` each) and Sha1File or
Sha256File (one `sha1sum`/`sha256sum` each) of every file it owns: about forty reads of a rig, each a
subshell and a process of its own. `group_file_reads` puts the reads of one family into one command:
shell builtins say which paths exist, then one `stat` (or one hash tool) reads all those that do, in
order. Each read then gets exactly the line its own command would have printed (stat's line for its
path, the hash tool's line) and goes through the fact's own process().

Only reads whose recorded command is the very one pyinfra builds for a plain path are grouped (not a
`~/` path, which the shell expands, nor another pyinfra's command). A group whose answer does not add
up (a path that vanished between the test and the read, a file sha1sum cannot read, a stat without
GNU's -c) answers none of its reads: each is then read on its own, as pyinfra would.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pyinfra.api.command import StringCommand
from pyinfra.facts import files

STAT_FACTS = (files.File, files.Directory, files.Link)  # one command, File's; process() differs
HASH_TOOLS = {files.Sha1File: "sha1sum", files.Sha256File: "sha256sum"}
PRESENT, ABSENT = "+", "-"


def raw_command(command: Any) -> str:
    """A command's text as the connector runs it (what a fact read's record holds)."""
    return command.get_raw_value() if isinstance(command, StringCommand) else str(command)


@dataclass
class FileReadGroup:
    """Reads of one family (stat, or one hash tool) answered by one command."""

    tool: str  # "stat" or the hash tool's name
    requests: list[Any] = field(default_factory=list)  # rigup.pyinfra_patches.fact_batching._Request
    paths: list[str] = field(default_factory=list)  # each path once, in order of first request

    def command(self) -> str:
        quoted = " ".join(shlex.quote(p) for p in self.paths)
        # A directory hashes to nothing, as each read's own command gives (sha1sum refuses it): the
        # record holds the checksum read that pyinfra's files.put pairs with every File read.
        exists = 'test -e "$p" || test -L "$p"' if self.tool == "stat" else 'test -e "$p" && ! test -d "$p"'
        read = files.LINUX_STAT_COMMAND if self.tool == "stat" else self.tool
        return (f'set --; for p in {quoted}; do if {exists}; then set -- "$@" "$p"; echo {PRESENT}; '
                f'else echo {ABSENT}; fi; done; [ $# -eq 0 ] || {read} "$@" 2>/dev/null')

    def outputs(self, out: Sequence[str]) -> list[list[str]] | None:
        """Each request's stdout lines as its own command would print them; None if the answer does not
        add up (then no request is answered from it)."""
        marks, lines = list(out[: len(self.paths)]), list(out[len(self.paths):])
        if len(marks) != len(self.paths) or set(marks) - {PRESENT, ABSENT} or len(lines) != marks.count(PRESENT):
            return None
        present = iter(lines)
        by_path = {path: [next(present)] if mark == PRESENT else [] for path, mark in zip(self.paths, marks)}
        return [by_path[_path_of(r)] for r in self.requests]


def _path_of(request: Any) -> str:
    return request.kwargs.get("path", request.args[0] if request.args else None)


def _tool_for(request: Any) -> str | None:
    if request.cls in STAT_FACTS:
        tool, template = "stat", files.File
    elif request.cls in HASH_TOOLS:
        tool, template = HASH_TOOLS[request.cls], request.cls
    else:
        return None
    if set(request.kwargs) - {"path"} or len(request.args) + len(request.kwargs) != 1:
        return None
    path = _path_of(request)
    if not isinstance(path, str) or not path or path.startswith("~") or "\n" in path:
        return None
    return tool if request.command == raw_command(template().command(path)) else None


def group_file_reads(requests: Sequence[Any]) -> tuple[list[Any], list[FileReadGroup]]:
    """(requests left as they are, groups of two or more reads of one family)."""
    by_tool: dict[str, FileReadGroup] = {}
    for request in requests:
        tool = _tool_for(request)
        if tool is not None:
            group = by_tool.setdefault(tool, FileReadGroup(tool))
            group.requests.append(request)
            if _path_of(request) not in group.paths:
                group.paths.append(_path_of(request))
    groups = [g for g in by_tool.values() if len(g.requests) > 1]
    grouped = {id(r) for g in groups for r in g.requests}
    return [r for r in requests if id(r) not in grouped], groups
