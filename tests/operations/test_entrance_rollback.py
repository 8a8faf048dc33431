"""The entrance's gate and rollback (rigup/operations/gateway.py, issue 44): the commands front_runs_current and
routers_run_current send, made by pyinfra on a @fake host, then run here by sh against Debian's own nginx (with
njs) serving a working entrance, systemctl stood in by a recorder. A configuration nginx -t refuses never reaches
nginx, which keeps serving the previous one; it, a router that does not come up, and a configuration nginx starts on
but that does not answer the readiness wait put the last good files back; either way the host fails with one line
saying so."""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from pyinfra.api import Config, Inventory, State
from pyinfra.api.connect import connect_all, disconnect_all
from pyinfra.api.operation import add_op
from pyinfra.api.operations import run_ops

from rigup.desired.entrance import (
    Client,
    EntrancePaths,
    ModelRouter,
    dispatch_js,
    models_document,
)
from rigup.desired.gateway import GatewayPaths
from rigup.operations.gateway import BACK_IN_SERVICE, NOT_BACK, front_answers, front_runs_current, routers_run_current
from rigup.runstate import record_decided_routes
from tests.support.nginx_front import FOREGROUND, serving, site_text, write_front

KEY = "alice-key-0123456789abcdef"
HOST = "@fake/gw"
# UnitAgainstFiles' answer for a unit whose files changed after it started (restart) or that is not running (start)
RUNNING = ["ActiveState=active", "UnitFileState=enabled", "ExecMainStartTimestampMonotonic=1000000",
           "NeedDaemonReload=no", "clock 5000.0 100.0"]
STOPPED = ["ActiveState=inactive", "UnitFileState=disabled", "ExecMainStartTimestampMonotonic=0",
           "NeedDaemonReload=no", "clock 5000.0 100.0"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def commands_of(op: Any, unit_state: list[str], changed: list[str], routers: tuple[ModelRouter, ...] = (),
                **kwargs: Any) -> list[str]:
    """The shell commands `op` sends a @fake host (fact reads left out), unwrapped from pyinfra's sh -c; `routers`:
    what entrance_routes decided on that host in this pass (rigup.runstate)."""
    answer = [*unit_state, *(f"mtime 4999.0 {path}" for path in changed)]
    inventory = Inventory(([HOST], {"fake_delay": 0, "fake_delay_jitter": 0,
                                    "fake_responses": {"systemctl show -p ActiveState": answer}}))
    state = State(inventory=inventory, config=Config())
    connect_all(state)
    host = inventory.get_host(HOST)
    record_decided_routes(host, [], routers)
    add_op(state, op, name="op under test", **kwargs)
    before = len(host.connector.executed_commands)
    run_ops(state)
    disconnect_all(state)
    out = []
    for command in host.connector.executed_commands[before:]:
        if "systemctl show -p ActiveState" in command:
            continue
        words = shlex.split(command)
        out.append(words[-1] if words[-2:-1] == ["-c"] else command)
    return out


@pytest.fixture
def entrance(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """A working entrance: its files, their last good record, nginx serving them; `nginx` and `systemctl` on PATH
    stand in for the host's (the real nginx on this configuration; a recorder)."""
    paths = GatewayPaths(str(tmp_path))
    Path(paths.routers_dir).mkdir(parents=True)
    port = free_port()
    old = [ModelRouter("old-model", "old-model", free_port(), free_port(), ("http://10.0.0.1:8000",))]
    nginx = write_front(tmp_path, old, [Client("alice", KEY)], port)
    site_file = tmp_path / "site.conf"
    Path(paths.router_env("old-model")).write_text("ROUTER_ARGS=--port 1\n")
    files = [str(site_file), paths.key_map, paths.pod_key, paths.dispatch_js, paths.models_json,
             paths.router_env("old-model")]
    subprocess.run(["tar", "-cPf", paths.last_good, *files], check=True)  # as entrance_last_good records it
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "nginx").write_text(f'#!/bin/sh\nexec {shlex.join(nginx)} -g {shlex.quote(FOREGROUND)} "$@"\n')
    (stubs / "systemctl").write_text(
        f'#!/bin/sh\necho "$*" >> {tmp_path}/systemctl.log\n'
        'case "$1" in list-units) echo "rigup-router@new-model.service loaded failed failed x";'
        ' echo "rigup-router@old-model.service loaded active running x";; esac\n')
    (stubs / "journalctl").write_text('#!/bin/sh\necho "(the unit\'s journal)"\n')
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    with serving([str(stubs / "nginx")], port):
        yield {"tmp": tmp_path, "paths": paths, "site": site_file, "files": files, "url": f"http://127.0.0.1:{port}",
               "port": port, "env": {**os.environ, "PATH": f"{stubs}:{os.environ['PATH']}"}}


def dispatched(entrance: dict[str, Any]) -> set[str]:
    """The models the running nginx dispatches (njs compiled its dispatch when it started): the others get 404."""
    out = set()
    for model in ("old-model", "new-model"):
        reply = requests.post(entrance["url"] + "/v1/chat/completions", json={"model": model, "messages": []},
                              headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
        if reply.status_code != 404:  # its router is not running here: 502
            out.add(model)
    return out


def new_configuration(entrance: dict[str, Any], broken_dispatch: bool) -> dict[str, str]:
    """Write the next converge's files over the working ones: a new model (and router), a new site; optionally a
    dispatch njs cannot compile. Returns the good files' contents."""
    paths: EntrancePaths = entrance["paths"]
    good = {name: Path(name).read_text() for name in entrance["files"]}
    new = [ModelRouter("new-model", "new-model", free_port(), free_port(), ("http://10.0.0.2:8000",))]
    text = dispatch_js(new)
    Path(paths.dispatch_js).write_text(text.replace("function dispatch(r) {", "function dispatch(r) {{") if broken_dispatch else text)
    Path(paths.models_json).write_text(models_document(new))
    Path(paths.router_env("old-model")).unlink()
    Path(paths.router_env("new-model")).write_text("ROUTER_ARGS=--port 2\n")
    entrance["site"].write_text(site_text(entrance["tmp"], new, entrance["port"]))
    return good


def run_sh(entrance: dict[str, Any], command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["sh", "-c", command], env=entrance["env"], capture_output=True, text=True, timeout=60)


def run_all(entrance: dict[str, Any], commands: list[str]) -> list[subprocess.CompletedProcess[str]]:
    """The operation's commands in order, as pyinfra runs them: up to the first that fails."""
    results = []
    for command in commands:
        results.append(run_sh(entrance, command))
        if results[-1].returncode != 0:
            break
    return results


def put_back(entrance: dict[str, Any], good: dict[str, str]) -> None:
    for name, text in good.items():
        assert Path(name).read_text() == text, name
    assert sorted(p.name for p in Path(entrance["paths"].routers_dir).iterdir()) == ["old-model.env"]


def test_a_configuration_nginx_refuses_never_reaches_it_and_the_last_good_one_is_put_back(entrance: dict[str, Any]) -> None:
    good = new_configuration(entrance, broken_dispatch=True)
    commands = commands_of(front_runs_current, RUNNING, [str(entrance["site"])], unit="nginx.service",
                           files=[str(entrance["site"])], paths=entrance["paths"])
    assert any("nginx -t" in c for c in commands) and any("systemctl restart" in c for c in commands)
    results = run_all(entrance, commands)
    gate = results[-1]
    assert len(results) == 1 and gate.returncode == 1, gate.stdout + gate.stderr
    said = [line for line in gate.stdout.splitlines() if line.startswith("rigup: ")]
    assert len(said) == 1 and said[0].startswith("rigup: nginx -t refused the entrance's new configuration (")
    assert "entrance.js" in said[0] and said[0].endswith(BACK_IN_SERVICE), said
    put_back(entrance, good)
    log = (entrance["tmp"] / "systemctl.log").read_text()
    assert "restart rigup-router@old-model.service" in log  # its routers on their last good files again
    assert "disable --now --quiet rigup-router@new-model.service" in log
    assert "nginx" not in log  # never restarted onto what it refused
    assert dispatched(entrance) == {"old-model"}  # serving the previous configuration throughout
    assert run_sh(entrance, "nginx -t -q").returncode == 0  # and a restart (a reboot) would find it on disk


def test_a_router_that_does_not_come_up_puts_the_last_good_configuration_back(entrance: dict[str, Any]) -> None:
    good = new_configuration(entrance, broken_dispatch=False)
    router = ModelRouter("new-model", "new-model", free_port(), free_port(), ("http://10.0.0.2:8000",))
    commands = commands_of(routers_run_current, STOPPED, [], routers=(router,), paths=entrance["paths"], timeout_s=1)
    results = run_all(entrance, commands)
    assert results[-1].returncode == 1, [r.stdout + r.stderr for r in results]
    said = [line for line in results[-1].stdout.splitlines() if line.startswith("rigup: ")]
    assert said == [f"rigup: the router of new-model did not answer http://127.0.0.1:{router.port}/health within 1 s; "
                    f"{BACK_IN_SERVICE}"]
    put_back(entrance, good)
    # nginx, restarted on the new files before the routers (their hop to the pods), runs on the last good ones again
    assert (entrance["tmp"] / "systemctl.log").read_text().splitlines()[-1] == "try-restart nginx.service"
    assert dispatched(entrance) == {"old-model"}


def test_without_a_recorded_configuration_it_says_so(entrance: dict[str, Any]) -> None:
    Path(entrance["paths"].last_good).unlink()  # a first converge: nothing recorded yet
    new_configuration(entrance, broken_dispatch=True)
    commands = commands_of(front_runs_current, RUNNING, [str(entrance["site"])], unit="nginx.service",
                           files=[str(entrance["site"])], paths=entrance["paths"])
    gate = run_sh(entrance, commands[0])
    assert gate.returncode == 1
    said = [line for line in gate.stdout.splitlines() if line.startswith("rigup: ")]
    assert said[-1].endswith(NOT_BACK) and "its first converge" in said[0]
    assert dispatched(entrance) == {"old-model"}  # nginx itself was never touched


def test_a_configuration_nginx_starts_on_but_that_does_not_answer_puts_the_last_good_one_back(
        entrance: dict[str, Any]) -> None:
    """nginx -t accepted it and nginx started on it, but the front does not answer its readiness wait (here: the
    URL it is asked at has nothing listening, as a listen address it cannot serve would leave it): the last good
    files come back, the routers and nginx run on them again, and the host fails with one line."""
    good = new_configuration(entrance, broken_dispatch=False)
    url = f"http://127.0.0.1:{free_port()}/health"
    commands = commands_of(front_answers, RUNNING, [], url=url, timeout_s=1, unit="nginx.service", paths=entrance["paths"])
    results = run_all(entrance, commands)
    assert len(results) == 1 and results[0].returncode == 1, results[0].stdout + results[0].stderr
    said = [line for line in results[0].stdout.splitlines() if line.startswith("rigup: ")]
    assert said == [f"rigup: the entrance did not answer {url} within 1 s on its new configuration; {BACK_IN_SERVICE}"]
    assert "(the unit's journal)" in results[0].stdout  # nginx's journal for the why
    put_back(entrance, good)
    log = (entrance["tmp"] / "systemctl.log").read_text().splitlines()
    assert "restart rigup-router@old-model.service" in log and "disable --now --quiet rigup-router@new-model.service" in log
    assert log[-1] == "restart nginx.service"  # onto the last good files, after they are back
    assert run_sh(entrance, "nginx -t -q").returncode == 0


def test_a_front_that_answers_is_left_as_it_is(entrance: dict[str, Any]) -> None:
    new_configuration(entrance, broken_dispatch=False)
    commands = commands_of(front_answers, RUNNING, [], url=entrance["url"] + "/health", timeout_s=5,
                           unit="nginx.service", paths=entrance["paths"])
    (result,) = run_all(entrance, commands)
    assert result.returncode == 0 and result.stdout.splitlines()[-1] == f"rigup: entrance answers {entrance['url']}/health"
    assert not (entrance["tmp"] / "systemctl.log").exists()  # nothing put back, nothing restarted
    assert sorted(p.name for p in Path(entrance["paths"].routers_dir).iterdir()) == ["new-model.env"]
