"""The fleet-command runner the CLI commands share: the common arguments, one parallel run over the targets
(rigup.client.targets: host, recipe, API URL, SSH, --limit's selection), a table or JSON, the exit code, and the
serving log of a target."""

from __future__ import annotations

import argparse
import json
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from rigup.client.fanout import parallel
from rigup.client.ssh import FileLog, JournalLog, RemoteError, Runner, ServiceLog
from rigup.client.targets import Target

R = TypeVar("R")


_PROGRESS_LOCK = threading.Lock()


def progress(line: str) -> None:
    """A progress line on stderr (stdout stays for the table or JSON). The hosts' threads each write
    theirs whole, line end included, one at a time: print() writes the text and its newline apart, and
    another host's line then began before this one ended ("... over SSH ...[rig-02] gathering ...")."""
    with _PROGRESS_LOCK:
        sys.stderr.write(line.rstrip("\n") + "\n")
        sys.stderr.flush()


def service_log(target: Target, runner: Runner, log_file: str | None) -> ServiceLog | None:
    """The serving log to read: a local file given on the command line, else the unit's journal over
    SSH; None for a bare URL (no recipe, no SSH)."""
    if log_file is not None:
        return FileLog(log_file)
    if target.recipe is not None and target.ssh is not None:
        return JournalLog(runner, target.recipe.paths.unit_name)
    return None


def add_target_arguments(parser: argparse.ArgumentParser, *, url_help: str | None = None, json_help: str | None = None) -> None:
    """--limit, --json and --quiet; with url_help also --url and --api-key-file (a bare API, no fleet)."""
    parser.add_argument("--limit", nargs="+", metavar="HOST", help="only these hosts or groups of the fleet")
    if url_help is not None:
        parser.add_argument("--url", help=url_help)
        parser.add_argument("--api-key-file", help="with --url: file holding the API key (else $RIGUP_API_KEY)")
        parser.add_argument("--ca-file", help="with an https --url: the CA certificate its certificate is checked "
                                              "against (default: the fleet's entrance's, the fleet CA's, else the "
                                              "system's trust store)")
    parser.add_argument("--json", action="store_true", help=json_help or "print JSON instead of the table")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def run_fleet_command(
    command: str,
    select: Callable[[], list[Target]],
    work: Callable[[Target], R],
    *,
    as_json: bool,
    document: Callable[[list[R]], Any],
    table: Callable[[list[R]], str],
    exit_code: Callable[[list[R]], int],
    bad_targets_exit: int = 2,
) -> tuple[int, list[R]]:
    """Select the targets, run `work` on all of them at once, print the table or the JSON document.

    Returns (exit code, results); an unusable selection (unknown host, bad fleet file) is one line on
    stderr and `bad_targets_exit`."""
    try:
        targets = select()
    except (RemoteError, ValueError) as exc:
        print(f"rigup {command}: {exc}", file=sys.stderr)
        return bad_targets_exit, []
    results = parallel(targets, work)
    print(json.dumps(document(results), indent=2) if as_json else table(results))
    return exit_code(results), results
