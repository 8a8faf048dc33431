"""Operations of the gateway task: the pinned LiteLLM venv, the config from what the rigs serve (read
when the operation runs, after every rig's serving phase), and the wait for a (re)started proxy."""

from __future__ import annotations

from collections.abc import Sequence
from io import StringIO
from typing import Any
from urllib.parse import urlsplit

from pyinfra import host
from pyinfra.api import OperationValueError, QuoteString, StringCommand, operation
from pyinfra.api.exceptions import PyinfraError
from pyinfra.operations import files

from rigup.desired.gateway import RigEndpoint, Route, config_text, current_records, route_for, routes_in_config
from rigup.facts.gateway import GatewayVenvs, ServedRecord, TextFile, UnitAgainstFiles, VenvComplete
from rigup.operations.live_output import streamed
from rigup.runstate import account


@operation()
def gateway_venv(venv: str, requirements: str, requirements_sha256: str, index_url: str | None):
    """
    Build the gateway's venv from hash-pinned requirements, unless that venv is complete.

    + venv: directory of the venv (named by the requirements' hash)
    + requirements: the requirements file on the host (every line ``--hash`` pinned)
    + requirements_sha256: its hash, recorded in the venv once the install finished
    + index_url: PEP 503 index pip installs from; None: no ``--index-url``, pip's own config on the host
      (pip.conf, PIP_INDEX_URL) decides, else PyPI

    pip runs with ``--require-hashes --no-deps``: nothing outside the pin installs. It is built in
    place (a venv's scripts name their interpreter by path, so it cannot be moved); the marker is
    written last, so an interrupted build is wiped and redone, never used half-done.
    """
    if host.get_fact(VenvComplete, venv=venv) == requirements_sha256:
        host.noop(f"gateway venv {venv} is complete")
        return
    # None: pip's configured index (a company mirror set once in pip.conf, with its credentials there, not
    # on this command line). pip ignores a plain-HTTP index (a LAN mirror) unless told to trust its host;
    # the hashes pin every byte anyway.
    index: list[Any] = []
    if index_url is not None:
        url = urlsplit(index_url)
        index = ["--index-url", QuoteString(index_url)]
        if url.scheme == "http" and url.hostname:
            index += ["--trusted-host", QuoteString(url.hostname)]
    yield streamed(
        StringCommand(
            "rm -rf", QuoteString(venv), "&& python3 -m venv", QuoteString(venv),
            "&&", QuoteString(f"{venv}/bin/pip"), "install --disable-pip-version-check --no-input --progress-bar off",
            "--require-hashes --no-deps", *index, "-r", QuoteString(requirements),
            "&& echo", QuoteString(requirements_sha256), ">", QuoteString(f"{venv}/.rigup-installed"),
        ),  # fmt: skip
        lambda h, ok, output, s: account(h, f"gateway venv built in {s:.0f} s" if ok else "gateway venv build failed"),
    )


@operation()
def other_venvs_removed(root: str, keep: str):
    """
    Remove the gateway venvs under ``root`` other than ``keep`` (earlier pins), once the gateway runs
    from ``keep``.
    """
    others = [v for v in host.get_fact(GatewayVenvs, root=root) if v != keep]
    if not others:
        host.noop("no other gateway venv")
        return
    yield StringCommand("rm -rf", *[QuoteString(v) for v in others])


@operation()
def gateway_config(path: str, rigs: Sequence[RigEndpoint], install_roots: dict[str, str],
                   health_check_interval_s: int, num_retries: int):
    """
    Write the gateway's LiteLLM config from what each rig serves when this operation runs.

    + path: the config file on the gateway host
    + rigs: the fleet's rigs and how the gateway reaches each
    + install_roots: rig name -> its install_root (where its provenance record is)
    + health_check_interval_s, num_retries: LiteLLM router settings

    Every rig is read when this runs (after the serving phase of the rigs in this run): its provenance
    record and running units decide its route. A rig outside this run (--limit, a rollout step) is
    connected to for that read alone; one that cannot be reached or read keeps the routes the current
    config gives it, and says so.
    """
    if health_check_interval_s < 1 or num_retries < 0:
        raise OperationValueError("health_check_interval_s must be >= 1 and num_retries >= 0")
    current = host.get_fact(TextFile, path=path)
    carried = routes_in_config(current)
    routes: list[Route] = []
    notes: list[str] = []
    for rig in rigs:
        served = _served(host.inventory.get_host(rig.host), install_roots[rig.host])
        if served is None:
            kept = [r for r in carried if r.host == rig.host]
            routes.extend(kept)
            notes.append(f"{rig.host}: not reachable now, keeps {len(kept)} route(s)")
            continue
        found = [route_for(rig, record, served["active_units"]) for record in current_records(served["records"]) or [None]]
        routes.extend(route for route, _ in found if route is not None)
        notes.extend(f"{rig.host}: {why}" for _, why in found)
    text = config_text(routes, health_check_interval_s=health_check_interval_s, num_retries=num_retries)
    if text == current:
        host.noop(f"gateway routes unchanged: {'; '.join(notes)}")
        return
    if host.state.is_executing:  # the prepare pass reads the rigs before they serve: no account of it
        models = ", ".join(sorted({r.model for r in routes})) or "none"
        account(host, f"gateway routes: {len(routes)} ({models})")
    yield from files.put._inner(src=StringIO(text), dest=path, mode="644")


def _served(rig_host: Any, install_root: str) -> dict[str, Any] | None:
    """The rig's ServedRecord, connecting to it first when it is not in this run; None when it cannot
    be reached or read (its routes are then kept as they are)."""
    if rig_host is None:
        return None
    if not rig_host.connected:
        rig_host.connect(reason="to read what it serves, for the gateway", show_errors=False)
        if not rig_host.connected:
            return None
    try:
        served = rig_host.get_fact(ServedRecord, install_root=install_root)
    except PyinfraError:
        return None
    return served if "records" in served else None  # {}: the read failed


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
def gateway_ready(url: str, timeout_s: int):
    """
    Wait until the (re)started gateway answers ``url`` (its readiness endpoint), up to ``timeout_s``.

    Not idempotent: run it only after the gateway (re)started (``_if``).
    """
    if timeout_s < 1:
        raise OperationValueError("timeout_s must be at least 1")
    yield streamed(
        StringCommand(
            "deadline=$(( $(date +%s) +", str(timeout_s), ")); waited=0; until curl -fs -o /dev/null --max-time 5",
            QuoteString(url), "; do if [ $(date +%s) -ge $deadline ]; then echo", QuoteString(
                f"rigup: the gateway did not answer {url} within {timeout_s} s; journalctl -u rigup-gateway:"),
            "; journalctl -u rigup-gateway.service -n 30 --no-pager; exit 1; fi; sleep 1; waited=$((waited + 1));",
            '[ $((waited % 10)) -eq 0 ] && echo "rigup: waiting for the gateway to answer ($waited s)"; done; echo',
            QuoteString(f"rigup: the gateway answers {url}"),
        ),  # fmt: skip
        lambda h, ok, output, s: account(h, f"gateway ready in {s:.0f} s" if ok else "gateway did not come up"),
    )
