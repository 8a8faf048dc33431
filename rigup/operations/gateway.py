"""Operations of the entrance task: the pinned router venv, the routes and the front's files from what the rigs
serve (read when the operation runs, after every rig's serving phase), one router per served model."""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from io import StringIO
from typing import Any
from urllib.parse import urlsplit

from pyinfra import host
from pyinfra.api import OperationValueError, QuoteString, StringCommand, operation
from pyinfra.facts.files import File
from pyinfra.operations import files

from rigup.desired.entrance import (
    EntrancePaths,
    ModelRouter,
    dispatch_js,
    model_routers,
    models_document,
    nginx_site,
    router_env_text,
)
from rigup.desired.gateway import (
    FRONT_UNIT,
    UNIT_FILE,
    GatewayPaths,
    RigEndpoint,
    Route,
    current_records,
    route_for,
    routes_in_config,
    routes_text,
    scored_pods,
    workers_by_model,
)
from rigup.desired.trust import RIG_CA_BUNDLE
from rigup.facts.gateway import GatewayVenvs, RouterEnvFiles, RouterInstances, VenvComplete
from rigup.facts.units import TextFile, UnitAgainstFiles
from rigup.operations.live_output import streamed
from rigup.operations.serving import served_now
from rigup.operations.units import curl_probe, service_steps, wait_until_answered
from rigup.runstate import account, decided_routes, record_decided_routes

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

    pip runs with ``--require-hashes --no-deps``: nothing outside the pin installs; ``--cert`` the system's
    trust store (rigup.desired.trust.RIG_CA_BUNDLE). It is built in
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
    # HTTPS checked against the system's trust store, as apt and git on the host check it (a pip carrying
    # certifi's bundle would trust the public CAs only, never a mirror's or a TLS-intercepting proxy's own CA)
    pip = [QuoteString(f"{venv}/bin/pip"), "install --disable-pip-version-check --no-input --progress-bar off",
           "--require-hashes --no-deps", "--cert", QuoteString(RIG_CA_BUNDLE), *index, "-r", QuoteString(requirements)]
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


LEGACY_UNIT = "/etc/systemd/system/rigup-gateway.service"  # LiteLLM's proxy, the entrance before issue 44


@operation()
def legacy_gateway_removed(root: str):
    """
    Stop and remove LiteLLM's proxy (rigup-gateway.service), the entrance before nginx and vllm-router, with
    its environment file (its keys) and config, where an earlier rigup installed it; its venv goes with the
    venvs of earlier pins.

    + root: the entrance directory ({install_root}/gateway)
    """
    if host.get_fact(File, path=LEGACY_UNIT) is None:
        host.noop("no LiteLLM gateway from an earlier rigup")
        return
    yield StringCommand("systemctl disable --now rigup-gateway.service; rm -f", QuoteString(LEGACY_UNIT),
                        QuoteString(f"{root}/gateway.env"), QuoteString(f"{root}/config.yaml"),
                        "&& systemctl daemon-reload")


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


def _routes_now(rigs: Sequence[RigEndpoint], install_roots: dict[str, str], carried: list[Route]) -> tuple[list[Route], list[str]]:
    """Every rig's routes from what it serves now (its provenance record and running units); a rig that cannot
    be read keeps the routes it had (`carried`)."""
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
    return routes, notes


@operation()
def entrance_routes(paths: GatewayPaths, rigs: Sequence[RigEndpoint], install_roots: dict[str, str],
                    health_check_interval_s: int, num_retries: int, bind_address: str, port: int,
                    tls: tuple[str, str] | None, score_sample_rate: float = 0.0):
    """
    Write the entrance's routes from what each rig serves when this operation runs: routes.json, one router
    environment file per served model, the front's site, its model dispatch and its /v1/models answer.

    + paths: the entrance's files on the host
    + rigs: the fleet's rigs and how the entrance reaches each
    + install_roots: rig name -> its install_root (where its provenance record is)
    + health_check_interval_s, num_retries: the routers' health checks and retries
    + bind_address, port, tls: where the front listens, and its certificate and key on the host (None: HTTP)
    + score_sample_rate: the share of the pods' completions the hop scores for degenerate text (0: none)

    Every rig is read when this runs (after the serving phase of the rigs in this run): its provenance
    record and running units decide its route. A rig outside this run (--limit, a rollout step) is
    connected to for that read alone; one that cannot be reached or read keeps the routes the current
    routes.json gives it, and says so. Environment files of models no longer served are removed (their
    routers are stopped by routers_run_current).
    """
    if health_check_interval_s < 1 or num_retries < 0:
        raise OperationValueError("health_check_interval_s must be >= 1 and num_retries >= 0")
    current = host.get_fact(TextFile, path=paths.config_file)
    routes, notes = _routes_now(rigs, install_roots, routes_in_config(current))
    routers = model_routers(workers_by_model(routes))
    record_decided_routes(host, routes, routers)  # routers_run_current, entrance_last_good, quarantine routes read them
    wanted = {
        paths.config_file: routes_text(routes),
        paths.models_json: models_document(routers),
        paths.dispatch_js: dispatch_js(routers),
        paths.site_file: nginx_site(routers, paths, bind_address=bind_address, port=port, tls=tls,
                                    scored=scored_pods(routes), score_sample_rate=score_sample_rate),
        **{paths.router_env(r.slug): router_env_text(r, health_check_interval_s=health_check_interval_s,
                                                     num_retries=num_retries) for r in routers},
    }
    stale = [f for f in host.get_fact(RouterEnvFiles, directory=paths.routers_dir) if f not in wanted]
    changed = [path for path, text in wanted.items() if host.get_fact(TextFile, path=path) != text]
    if not changed and not stale:
        host.noop(f"entrance routes unchanged: {'; '.join(notes)}")
        return
    if host.state.is_executing:  # the prepare pass reads the rigs before they serve: no account of it
        models = ", ".join(r.model for r in routers) or "none"
        account(host, f"entrance routes: {len(routes)} to {len(routers)} model(s) ({models})")
    yield StringCommand("mkdir -p", QuoteString(paths.routers_dir))
    for path in changed:
        yield from files.put._inner(src=StringIO(wanted[path]), dest=path, mode="644")
    if stale:
        yield StringCommand("rm -f", *[QuoteString(f) for f in stale])


@operation()
def routers_run_current(paths: GatewayPaths, timeout_s: int):
    """
    Run one vllm-router per served model (rigup-router@<slug>.service) on its current venv, environment
    file and unit, restarted only when one of them changed after it started, then wait for each (re)started
    one's /health; stop and disable the instances of models no longer served. Run after nginx: a starting router
    waits for its pods through nginx's hop. One that does not answer puts the last good files back, runs the
    routers and nginx (when it runs) on them, and fails the host with one line.

    + paths: the entrance's files on the host
    + timeout_s: how long a (re)started router has to answer
    """
    wanted = {f"rigup-router@{r.slug}.service": r for r in decided_routes(host).routers}
    stale = [u for u in host.get_fact(RouterInstances) if u not in wanted]
    commands: list[StringCommand] = [StringCommand("systemctl disable --now", *[QuoteString(u) for u in stale])] if stale else []
    started: list[ModelRouter] = []
    reload = False
    for unit, router in wanted.items():
        seen = host.get_fact(UnitAgainstFiles, unit=unit,
                             paths=[f"{paths.venv}/.rigup-installed", paths.router_env(router.slug), UNIT_FILE])
        steps = service_steps(seen)
        reload = reload or "daemon-reload" in steps
        for step in steps:
            if step == "start":
                commands.append(StringCommand("systemctl reset-failed", QuoteString(unit), "2>/dev/null; systemctl start", QuoteString(unit)))
            elif step != "daemon-reload":
                commands.append(StringCommand("systemctl", step, QuoteString(unit)))
        if {"start", "restart"} & set(steps):
            started.append(router)
    if not commands and not reload:
        host.noop(f"{len(wanted)} router(s) run on their current files")
        return
    if reload:
        yield StringCommand("systemctl daemon-reload")
    yield from commands
    for router in started:
        unit = f"rigup-router@{router.slug}.service"
        url = f"http://127.0.0.1:{router.port}/health"
        failed = f"rigup: the router of {router.model} did not answer {url} within {timeout_s} s"
        yield streamed(StringCommand(
            "deadline=$(( $(date +%s) +", str(timeout_s), ")); until curl -fs -o /dev/null --max-time 5", QuoteString(url),
            "; do if [ $(date +%s) -ge $deadline ]; then journalctl -u", QuoteString(unit), "-n 30 --no-pager;",
            # nginx (re)started on the new files before the routers (their hop to the pods): onto the last good ones
            restore_last_good(paths), "&& systemctl try-restart", QuoteString(FRONT_UNIT), "&& echo",
            QuoteString(f"{failed}; {BACK_IN_SERVICE}"), "|| echo", QuoteString(f"{failed}; {NOT_BACK}"),
            "; exit 1; fi; sleep 0.5; done",
        ), _account_failure)  # fmt: skip


BACK_IN_SERVICE = "the entrance's previous configuration is back in service"
NOT_BACK = "the entrance's previous configuration could not be put back (see above)"


def restore_last_good(paths: EntrancePaths) -> str:
    """Shell: put the entrance's last good files back (paths.last_good: site, dispatch, keys, routes, the routers'
    environment files and unit) and run every router on them again (instances of models it did not route are
    stopped); nginx is left to the caller. Fails, saying so, when no configuration was recorded yet (a first
    converge) or a router does not start."""
    snapshot, routers = shlex.quote(paths.last_good), shlex.quote(paths.routers_dir)
    none = shlex.quote("rigup: no earlier configuration of the entrance was recorded (its first converge)")
    return (
        f"{{ if [ ! -f {snapshot} ]; then echo {none}; false; else rm -f {routers}/*.env && tar -xPf {snapshot} && "
        "systemctl daemon-reload && back=0 && for unit in $(systemctl list-units --all --plain --no-legend "
        "'rigup-router@*.service' | awk '{print $1}'); do slug=${unit#rigup-router@}; "
        f"[ -f {routers}/${{slug%.service}}.env ] || systemctl disable --now --quiet \"$unit\" || back=1; done; "
        f"for env in {routers}/*.env; do [ -f \"$env\" ] || continue; unit=\"rigup-router@$(basename \"$env\" .env).service\"; "
        "systemctl reset-failed \"$unit\" 2>/dev/null; systemctl enable --quiet \"$unit\" && systemctl restart \"$unit\" "
        "|| back=1; done; [ $back -eq 0 ]; fi; }"
    )


def _account_failure(h: Any, ok: bool, output: Any, seconds: float) -> None:
    if not ok:
        lines = [line for line in getattr(output, "output_lines", []) if str(line).startswith("rigup: ")]
        account(h, str(lines[-1]).removeprefix("rigup: ") if lines else "entrance configuration failed")


@operation()
def front_runs_current(unit: str, files: Sequence[str], paths: EntrancePaths):
    """
    Run nginx (enabled, active) on the entrance's current files, as unit_runs_current_files does, but gated: before
    it (re)starts, ``nginx -t`` checks the new configuration (the site, the njs dispatch, the key map, the pods'
    key, the certificate); a configuration it refuses, or one nginx does not start on, is replaced by the last good
    one (paths.last_good, routers included) and the host fails with one line. nginx that was running is never
    stopped for a configuration it refuses: it serves the previous one throughout.

    + unit: nginx's unit
    + files: the files it runs from
    + paths: the entrance's files on the host
    """
    steps = service_steps(host.get_fact(UnitAgainstFiles, unit=unit, paths=list(files)))
    if not steps:
        host.noop(f"{unit} runs on its current files")
        return
    if "daemon-reload" in steps:
        yield StringCommand("systemctl daemon-reload")
    if {"start", "restart"} & set(steps):
        refused = "rigup: nginx -t refused the entrance's new configuration"
        yield streamed(StringCommand(
            "checked=$(nginx -t -q 2>&1) || { printf '%s\\n' \"$checked\" >&2;",
            "why=$(printf '%s\\n' \"$checked\" | grep -m1 -e emerg -e error || printf '%s\\n' \"$checked\" | head -n1);",
            restore_last_good(paths), "&& echo", f"\"{refused} ($why); {BACK_IN_SERVICE}\"", "|| echo",
            f"\"{refused} ($why); {NOT_BACK}\"", "; exit 1; }",
        ), _account_failure)  # fmt: skip
        restart = "start" if "start" in steps else "restart"
        failed = f"rigup: nginx did not {restart} on the entrance's new configuration"
        yield streamed(StringCommand(
            "systemctl reset-failed", QuoteString(unit), "2>/dev/null; systemctl", restart, QuoteString(unit),
            "|| { journalctl -u", QuoteString(unit), "-n 20 --no-pager;", restore_last_good(paths), "&& systemctl restart",
            QuoteString(unit), "&& echo", QuoteString(f"{failed}; {BACK_IN_SERVICE}"), "|| echo",
            QuoteString(f"{failed}; {NOT_BACK}"), "; exit 1; }",
        ), _account_failure)  # fmt: skip
    if "enable" in steps:
        yield StringCommand("systemctl enable", QuoteString(unit))


@operation(is_idempotent=False, idempotent_notice="Run it only after nginx (re)started (_if).")
def front_answers(url: str, timeout_s: int, unit: str, paths: EntrancePaths, ca_file: str | None = None,
                  connect_to: str | None = None):
    """
    Wait until nginx, (re)started on the entrance's new files (front_runs_current), answers ``url`` as a client
    would (its certificate verified), up to ``timeout_s``. A configuration nginx -t accepted and started on but that
    does not answer (its certificate not for the names asked, a listen address it cannot serve, ...) is replaced
    by the last good one (paths.last_good, routers included), nginx restarted on it, and the host fails with one
    line saying so.

    + url: the front's /health as the host's readiness wait asks it
    + timeout_s: how long it has to answer
    + unit: nginx's unit
    + paths: the entrance's files on the host
    + ca_file, connect_to: the readiness curl's --cacert (None: the host's trust store) and --connect-to

    Not idempotent: run it only after nginx (re)started (``_if``).
    """
    if timeout_s < 1:
        raise OperationValueError("timeout_s must be at least 1")
    failed = f"rigup: the entrance did not answer {url} within {timeout_s} s on its new configuration"
    yield wait_until_answered(
        curl_probe(url, ca_file, connect_to), url, timeout_s, unit, "entrance",
        timed_out=["journalctl -u", QuoteString(unit), "-n 30 --no-pager;", restore_last_good(paths), "&& systemctl restart",
                   QuoteString(unit), "&& echo", QuoteString(f"{failed}; {BACK_IN_SERVICE}"), "|| echo",
                   QuoteString(f"{failed}; {NOT_BACK}"), ";"],
        on_done=lambda h, ok, output, s: account(h, f"entrance ready in {s:.0f} s") if ok else _account_failure(h, ok, output, s),
    )  # fmt: skip


@operation()
def entrance_last_good(paths: EntrancePaths, files: Sequence[str]):
    """
    Record the entrance's files as the last good configuration (paths.last_good, 0600 root: it holds the keys)
    once it serves on them: when none is recorded or one of ``files`` (or a router's environment file) is newer
    than the record. What front_runs_current and routers_run_current put back when a later configuration fails.

    + paths: the entrance's files on the host
    + files: every file the entrance runs from (the routers' environment files are found in their directory)
    """
    routers = [paths.router_env(r.slug) for r in decided_routes(host).routers]
    wanted = [*files, *routers]
    recorded = host.get_fact(File, path=paths.last_good)
    present = {path: host.get_fact(File, path=path) for path in wanted}
    newest = max((f["mtime"] for f in present.values() if f), default=None)
    if recorded and newest is not None and recorded["mtime"] >= newest:
        host.noop("the entrance's last good configuration is recorded")
        return
    kept = [QuoteString(path) for path, f in present.items() if f]
    yield StringCommand("( umask 077 && tar -cPf", QuoteString(f"{paths.last_good}.new"), *kept, "&& mv",
                        QuoteString(f"{paths.last_good}.new"), QuoteString(paths.last_good), ")")
