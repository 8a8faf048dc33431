"""Operations of the monitoring tasks: the pod targets from what the rigs serve (read when the
operation runs, after every rig's serving phase), configuration files that are checked by the
tool that reads them (promtool, amtool) before they replace the ones in use, and the wait for a
(re)started Prometheus that asks who is calling."""

from __future__ import annotations

import posixpath
from collections.abc import Sequence
from io import StringIO

from pyinfra import host
from pyinfra.api import OperationValueError, QuoteString, StringCommand, operation
from pyinfra.operations import files

from rigup.desired.monitoring import ScrapedRig, pod_target_groups, pod_targets, pods_in_targets, targets_text
from rigup.facts.units import TextFile
from rigup.operations.serving import served_now
from rigup.operations.units import wait_until_answered
from rigup.runstate import account


@operation()
def pod_targets_file(path: str, rigs: Sequence[ScrapedRig]):
    """
    Write the pods' file_sd targets from what each rig's provenance records name when this runs.

    + path: the JSON file Prometheus' pod job reads (it re-reads it on change: no reload)
    + rigs: the fleet's rigs and how the monitor reaches each

    A pod stays a target while its rig's record names it, running or not (a stopped pod is "down", and
    alerts). A rig outside this run is connected to for that read alone; one that cannot be reached or
    read keeps the targets the current file gives it.
    """
    current = host.get_fact(TextFile, path=path)
    carried = pods_in_targets(current)
    targets, notes = [], []
    for rig in rigs:
        served = served_now(host.inventory.get_host(rig.host), rig.install_root)
        if served is None:
            kept = [t for t in carried if t.host == rig.host]
            targets.extend(kept)
            notes.append(f"{rig.host}: not reachable now, keeps {len(kept)} target(s)")
            continue
        found, why = pod_targets(rig, served["records"])
        targets.extend(found)
        notes.extend(why)
    text = targets_text(pod_target_groups(targets))
    if text == current:
        host.noop(f"pod targets unchanged ({len(targets)})" + (f": {'; '.join(notes)}" if notes else ""))
        return
    if host.state.is_executing:  # the prepare pass reads the rigs before they serve: no account of it
        account(host, f"monitor: {len(targets)} pod target(s) ({', '.join(f'{t.host}/{t.pod}' for t in targets) or 'none'})")
    yield from files.put._inner(src=StringIO(text), dest=path, mode="644")


@operation()
def checked_file(path: str, content: str, check: str, mode: str = "644", user: str = "root", group: str = "root"):
    """
    Write ``content`` to ``path`` only after ``check`` accepted it: the new text is uploaded beside the
    file, checked (``check`` with ``{}`` for that file, e.g. ``promtool check config {}``) and moved
    over the file; a rejected file is removed and the host fails with the tool's words, leaving the
    file in use as it was.

    + path, content: the file and its whole text
    + check: a shell command with ``{}`` where the new file's path goes
    + mode, user, group: the file's
    """
    if host.get_fact(TextFile, path=path) == content:
        host.noop(f"{path} is current")
        return
    staged = posixpath.join(posixpath.dirname(path), f".{posixpath.basename(path)}.rigup-new")
    yield from files.put._inner(src=StringIO(content), dest=staged, mode=mode, user=user, group=group)
    command, _, rest = check.partition("{}")
    yield StringCommand(
        command, QuoteString(staged), rest, "|| { rc=$?; rm -f", QuoteString(staged), "; exit $rc; } && mv -f",
        QuoteString(staged), QuoteString(path),
    )  # fmt: skip


@operation(is_idempotent=False)
def answers_with_login(url: str, ca_file: str, user: str, password_file: str, timeout_s: int, unit: str, what: str):
    """
    Wait until the (re)started ``what``, which asks for TLS and basic auth (its exporter-toolkit web config),
    answers ``url`` (a readiness endpoint) to ``user`` with the password in ``password_file``, up to
    ``timeout_s``; on a timeout, the host fails with the last lines of ``unit``'s journal.

    + url: https, its certificate checked against ``ca_file`` (a path on the host)
    + password_file: a 0600 file on the host: curl reads the login from its stdin (``-K -``), written there by
      the shell's printf (a builtin: no process has the password in its argv)

    Not idempotent: run it only after the service (re)started (``_if``).
    """
    if timeout_s < 1:
        raise OperationValueError("timeout_s must be at least 1")
    login = StringCommand("printf 'user = \"%s:%s\"\\n'", QuoteString(user), '"$(cat', QuoteString(password_file), ')"')
    yield wait_until_answered([login, "| curl -fs -o /dev/null --max-time 5 -K - --cacert", QuoteString(ca_file),
                               QuoteString(url)], url, timeout_s, unit, what)
