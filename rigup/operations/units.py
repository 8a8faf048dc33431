"""Operations on systemd units rigup runs from files it writes (the gateway, Prometheus, node_exporter,
the GPU exporter): run a unit on its current files, restarting only what changed since it started, and
wait until a (re)started service answers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pyinfra import host
from pyinfra.api import OperationValueError, QuoteString, StringCommand, operation

from rigup.facts.units import UnitAgainstFiles
from rigup.operations.live_output import streamed
from rigup.runstate import account


def service_steps(seen: dict[str, Any]) -> list[str]:
    """What brings a unit seen as ``seen`` (fact UnitAgainstFiles) onto its current files: any of
    "daemon-reload", "start" (after clearing a failed state), "restart", "enable"; [] when it is there."""
    steps = ["daemon-reload"] if seen.get("reload") else []
    started = seen.get("started")
    newer = [f for f, mtime in (seen.get("mtimes") or {}).items() if started is None or mtime > started]
    if seen.get("active") != "active":
        steps.append("start")
    elif newer:
        steps.append("restart")
    if seen.get("enabled") != "enabled":
        steps.append("enable")
    return steps


@operation()
def unit_runs_current_files(unit: str, files: Sequence[str]):
    """
    Run ``unit`` (enabled, active) on its current files: started when it is not running, restarted when
    one of ``files`` changed after its main process started (systemd reloaded first when its unit file
    changed), judged on the host, so a run interrupted between writing them and restarting is finished
    by the next. A failed state is cleared first (a unit that hit its start limit while its files were
    broken starts again once they are fixed).

    + unit: the systemd unit, e.g. ``rigup-gateway.service``
    + files: the files (or directories' markers) it runs from
    """
    steps = service_steps(host.get_fact(UnitAgainstFiles, unit=unit, paths=list(files)))
    if not steps:
        host.noop(f"{unit} runs on its current files")
        return
    for step in steps:
        if step == "daemon-reload":
            yield StringCommand("systemctl daemon-reload")
        elif step == "start":
            yield StringCommand("systemctl reset-failed", QuoteString(unit), "2>/dev/null; systemctl start", QuoteString(unit))
        else:
            yield StringCommand("systemctl", step, QuoteString(unit))


@operation(is_idempotent=False)
def answers_http(url: str, timeout_s: int, unit: str, what: str, ca_file: str | None = None,
                 connect_to: str | None = None):
    """
    Wait until the (re)started ``what`` answers ``url`` (a readiness endpoint), up to ``timeout_s``;
    on a timeout, the host fails with the last lines of ``unit``'s journal.

    + ca_file: an https ``url``'s certificate is verified against this CA certificate on the host (None: the
      host's trust store); curl never skips the check
    + connect_to: curl's ``--connect-to`` (``name:port:address:port``): the URL's name, reached at that address

    Not idempotent: run it only after the service (re)started (``_if``).
    """
    if timeout_s < 1:
        raise OperationValueError("timeout_s must be at least 1")
    yield wait_until_answered(curl_probe(url, ca_file, connect_to), url, timeout_s, unit, what)


def curl_probe(url: str, ca_file: str | None = None, connect_to: str | None = None) -> list[Any]:
    """curl asking ``url`` once (5 s at most), an https one's certificate verified against ``ca_file`` (None: the
    host's trust store), reached at ``connect_to`` (curl's ``--connect-to``) when given."""
    tls = [*(["--cacert", QuoteString(ca_file)] if ca_file else []), *(["--connect-to", QuoteString(connect_to)] if connect_to else [])]
    return ["curl -fs -o /dev/null --max-time 5", *tls, QuoteString(url)]


def wait_until_answered(probe: list, url: str, timeout_s: int, unit: str, what: str, timed_out: list | None = None,
                        on_done: Any = None):
    """The readiness wait's command: `probe` (a shell command, its parts) run once a second until it succeeds or
    ``timeout_s`` pass (then the last lines of ``unit``'s journal and exit 1), a line every 10 s meanwhile; the
    host's account says how long it took.

    + timed_out: shell run on the timeout before the exit 1, in place of the journal's lines (ending in ';')
    + on_done: the account's callback (host, ok, output, seconds) in place of the ready/did-not-come-up line"""
    if timed_out is None:
        timed_out = ["echo", QuoteString(f"rigup: {what} did not answer {url} within {timeout_s} s; journalctl -u {unit}:"),
                     "; journalctl -u", QuoteString(unit), "-n 30 --no-pager;"]
    return streamed(
        StringCommand(
            "deadline=$(( $(date +%s) +", str(timeout_s), ")); waited=0; until", *probe,
            "; do if [ $(date +%s) -ge $deadline ]; then", *timed_out, "exit 1; fi; sleep 1; waited=$((waited + 1));",
            '[ $((waited % 10)) -eq 0 ] && echo', QuoteString(f"rigup: waiting for {what} to answer"), '"($waited s)"; done; echo',
            QuoteString(f"rigup: {what} answers {url}"),
        ),  # fmt: skip
        on_done or (lambda h, ok, output, s: account(h, f"{what} ready in {s:.0f} s" if ok else f"{what} did not come up")),
    )


@operation()
def every_rig_done():
    """
    A point every host of the run reaches together: an operation all of them share, so pyinfra orders
    every host's earlier operations before any host's later ones.

    pyinfra orders operations as a graph of each host's own sequence; a host that runs no rig tasks (a
    gateway-only box) would otherwise reach the fleet-wide tasks (gateway routes, monitor targets) while
    the rigs are still installing, and read what they served before this run. It changes nothing.
    """
    host.noop("every rig of this run has passed its serving and metrics phases")
    return
    yield  # an operation is a generator
