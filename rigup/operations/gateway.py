"""Operations of the gateway task: the pinned LiteLLM venv and the config from what the rigs serve
(read when the operation runs, after every rig's serving phase)."""

from __future__ import annotations

from collections.abc import Sequence
from io import StringIO
from typing import Any
from urllib.parse import urlsplit

from pyinfra import host
from pyinfra.api import OperationValueError, QuoteString, StringCommand, operation
from pyinfra.operations import files

from rigup.desired.gateway import RigEndpoint, Route, config_text, current_records, route_for, routes_in_config
from rigup.facts.gateway import GatewayVenvs, VenvComplete
from rigup.facts.units import TextFile
from rigup.operations.live_output import streamed
from rigup.operations.serving import served_now
from rigup.runstate import account

PIP_LOG = "pip-install.log"  # in the venv: pip's whole output of the build
PIP_TAIL_LINES = 40  # of that log, shown when the install fails


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
    pip = [QuoteString(f"{venv}/bin/pip"), "install --disable-pip-version-check --no-input --progress-bar off",
           "--require-hashes --no-deps", *index, "-r", QuoteString(requirements)]
    if host.state.print_noop_info:  # pyinfra -v: every line of pip's as it comes
        install = pip
    else:
        # Quiet: pip's ~240 Collecting/Downloading lines go to a 0600 log in the venv (an index URL from
        # the host's pip.conf may carry credentials), then one line: packages, pip's warnings, the log.
        # A failure shows the log's tail. Only the log is made under umask 077: pip itself keeps the
        # caller's, or the venv's files would be unreadable to the gateway's user.
        log = QuoteString(f"{venv}/{PIP_LOG}")
        install = [
            "( umask 077 && : >", log, ") && {", *pip, ">", log, "2>&1 || { tail -n", str(PIP_TAIL_LINES), log, ">&2;",
            "echo", QuoteString(f"rigup: the gateway's pip install failed; all of its output: {venv}/{PIP_LOG}"),
            ">&2; exit 1; }; } && echo \"rigup: gateway venv: $(grep -c '^Collecting' ", log, ") packages installed,",
            "$(grep -c '^WARNING' ", log, ") warnings from pip (its configuration on this host);",
            f"pip's output: {venv}/{PIP_LOG}\"",
        ]  # fmt: skip
    yield streamed(
        StringCommand(
            "rm -rf", QuoteString(venv), "&& python3 -m venv", QuoteString(venv), "&&", *install,
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
        served = served_now(host.inventory.get_host(rig.host), install_roots[rig.host])
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
