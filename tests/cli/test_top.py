"""`rigup top`, used the way a person uses it: in a terminal (tmux at 80, 120 and 200 columns) against a
fleet whose pods, GPU exporters and gateway are HTTP servers on 127.0.0.1 printing what vLLM,
dcgm-exporter and the entrance's vllm-router 0.1.17 print (tests/support/exporters.py, tests/support/router_routes.py),
counters moving between scrapes; the screen is read table by table as a reader reads it, the terminal is
resized, and q or Ctrl-C ends it. Then the pieces: the direct reading's arithmetic over two scrapes, a
route's state from its latest answers, the columns that fit a width, the Prometheus reading against a
fake /api/v1/query answering in Prometheus' JSON (answers a real Prometheus 2.42 gave, in
tests/fixtures/prometheus/api-query-2.42.0.json, re-captured by tests/support/capture_prometheus_answers.py,
and hand-made ones), where the fleet's Prometheus is, and the exit codes."""

from __future__ import annotations

import base64
import contextlib
import http.server
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from rigup.cli import main
from rigup.cli.top import POD_COLUMNS, fit_columns, pod_cells, table_width
from rigup.client.fleet_metrics import (
    NO_ROUTES,
    SENTINEL_QUERIES,
    UP,
    DirectSource,
    Endpoint,
    FallbackSource,
    PodRow,
    PrometheusError,
    PrometheusSource,
    PrometheusUnreachable,
    Scrape,
    SentinelMarks,
    fleet_monitor,
    gpu_rows,
    pod_row,
    prometheus_queries,
    query_prometheus,
    route_rows,
    route_state,
    scrape,
)
from rigup.client.targets import fleet_targets
from rigup.client.top_sources import (
    direct_endpoints,
    fleet_route_names,
    fleet_source,
    metrics_login,
    named_prometheus_login,
    selection_filter,
)
from rigup.desired.fleet import load_fleet
from rigup.parsers.prometheus import parse_exposition
from tests.support.exporters import Gpu, MetricsServer, VllmPod, dcgm_text
from tests.support.json_http import JsonHandler
from tests.support.router_routes import RouterRoute, entrance_text
from tests.support.tls import ServerCert, fleet_certificate, serve_tls

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "prometheus"
MODEL = "qwen3.6-27b-autoround"  # dual's served model name
GATEWAY_KEY = "sk-gw-top-test"
DEAD_PORT = 9  # nothing listens on discard


# --------------------------------------------------------------------------------------------------
# a fleet of fake exporters


@dataclass
class FakeFleet:
    path: Path
    ports: dict[str, int]


def write_fleet(tmp_path: Path, ports: dict[str, int], **gateway_data: Any) -> Path:
    key = tmp_path / "gateway.key"
    key.write_text(GATEWAY_KEY + "\n")
    key.chmod(0o600)
    document = {
        "data": {"variant": "dual"},
        "groups": {
            "gateway": {
                "data": {"gateway_api_key_file": str(key), "gateway_port": ports["gateway"], "serves_variant": False,
                         **gateway_data},
                "hosts": {"gw-1": {"ssh_hostname": "127.0.0.1"}},
            },
            "rigs": {
                "hosts": {
                    "rig-1": {"ssh_hostname": "127.0.0.1", "variant_overrides": {"port": ports["rig-1"]},
                              "gpu_exporter_port": ports["rig-1 gpus"]},
                    "rig-2": {"ssh_hostname": "127.0.0.1", "gpu_count": 4, "gpu_exporter_port": ports["rig-2 gpus"],
                              "pods": [{"name": "left", "variant": "dual", "gpus": [0, 1], "port": ports["rig-2/left"]},
                                       {"name": "right", "variant": "dual", "gpus": [2, 3], "port": ports["rig-2/right"]}]},
                    # a rig whose pod and GPU exporter do not answer
                    "rig-3": {"ssh_hostname": "127.0.0.1", "variant_overrides": {"port": DEAD_PORT},
                              "gpu_exporter_port": DEAD_PORT},
                },
            },
        },
    }
    path = tmp_path / "rigs.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[FakeFleet]:
    started = time.time() - 120
    rig1 = VllmPod(MODEL, started=started)
    left = VllmPod(MODEL, started=started, running=1, waiting=0, kv_usage=0.105, generation_tps=400.0)
    right = VllmPod(MODEL, started=started, running=0, waiting=0, kv_usage=0.0, generation_tps=0.0, prompt_tps=0.0,
                    ttft_per_s=0.0)
    # each route as the entrance's routers report it (tests/support/router_routes.py), each with its own traffic
    routes = [
        RouterRoute(MODEL, "http://127.0.0.1:{rig-1}", success_per_s=20.0, earlier_successes=50),
        # healed: its earlier failures stay counted
        RouterRoute(MODEL, "http://127.0.0.1:{rig-2/left}", success_per_s=8.0, earlier_successes=20, earlier_failures=6),
        # failing one answer in three: its circuit half-open
        RouterRoute(MODEL, "http://127.0.0.1:{rig-2/right}", breaker=2, success_per_s=4.0, failure_per_s=2.0),
        # its pod is down: its health checks and its circuit keep it out of rotation, no answers since
        RouterRoute(MODEL, f"http://127.0.0.1:{DEAD_PORT}", healthy=False, breaker=1, earlier_successes=30,
                    earlier_failures=2),
    ]
    with contextlib.ExitStack() as stack:
        def serve(text: Callable[[], str], path: str = "/metrics", key: str | None = None,
                  tls: ServerCert | None = None, login: tuple[str, str] | None = None) -> int:
            server = MetricsServer(text, path, key, tls, login)
            stack.callback(server.close)
            return server.port

        # the GPU exporters ask for TLS and the metrics login, as the converge leaves them (fleet-ca beside the fleet)
        exporter_tls = fleet_certificate(tmp_path / "fleet-ca", "rig-1", "gpu-exporter")
        fleet_login(tmp_path)
        login = ("rigup-prometheus", "pw-of-the-fleet")
        ports = {
            "rig-1": serve(rig1.text),
            "rig-1 gpus": serve(lambda: dcgm_text("rig-1", [Gpu(0), Gpu(1, temp_c=71, power_w=288.02)]),
                                tls=exporter_tls, login=login),
            "rig-2/left": serve(left.text),
            "rig-2/right": serve(right.text),
            "rig-2 gpus": serve(lambda: dcgm_text("rig-2", [Gpu(i, temp_c=60 + i, util=40) for i in range(4)]),
                                tls=exporter_tls, login=login),
        }
        for route in routes:
            route.worker = route.worker.format_map(ports)
        # the entrance over TLS, its certificate from the fleet CA beside the fleet file (fleet_ca_dir's default)
        ports["gateway"] = serve(lambda: entrance_text(routes, started), "/metrics/", GATEWAY_KEY,
                                 fleet_certificate(tmp_path / "fleet-ca"))
        yield FakeFleet(write_fleet(tmp_path, ports), ports)


# --------------------------------------------------------------------------------------------------
# in a terminal


def wait_for(read: Callable[[], str], done: Callable[[str], bool], seconds: float) -> str:
    deadline = time.monotonic() + seconds
    text = read()
    while not done(text) and time.monotonic() < deadline:
        time.sleep(0.25)
        text = read()
    return text


# every header a table may show, in full and short forms: a header cut short ("GEN TO…") is none of them
HEADERS = {"Pods": {"HOST", "POD", "MODEL", "STATE", "RUN", "WAIT", "GEN TOK/S", "GEN/S", "PROMPT TOK/S", "PROMPT/S",
                    "TTFT P50", "TTFT50", "TTFT P95", "TTFT95", "KV CACHE", "KV"},
           "GPUs": {"HOST", "GPU", "NAME", "STATE", "UTIL", "MEMORY", "TEMP", "POWER"},
           "Gateway routes": {"GATEWAY", "GW", "MODEL", "ROUTE", "API BASE", "STATE", "OK/S", "FAIL/S"}}


def read_table(screen: str, title: str) -> list[dict[str, str]]:
    """A table as a reader reads it: the line under its title names the columns, a rule, then a row a
    line until a blank line; cells are two or more spaces apart (one space is inside a cell: "100 ms")."""
    lines = screen.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(title)), None)
    assert start is not None, f"no {title!r} table on the screen:\n{screen}"
    headers = re.split(r" {2,}", lines[start + 1].strip())
    assert set(headers) <= HEADERS[title], f"{title}: headers {headers} cut or unknown:\n{screen}"
    assert set(lines[start + 2].strip()) == {"─"}, f"{title}: no rule under its headers (wrapped?):\n{screen}"
    rows = []
    for line in lines[start + 3:]:
        if not line.strip():
            break
        cells = re.split(r" {2,}", line.strip())
        assert len(cells) == len(headers), f"{title}: {line!r} is not one cell per column {headers}:\n{screen}"
        rows.append(dict(zip(headers, cells)))
    return rows


def column(row: dict[str, str], *names: str) -> str:
    """The cell of whichever of a column's forms (full, short) the table shows."""
    (value,) = [row[n] for n in names if n in row]
    return value


class Terminal:
    """A tmux server of its own with one pane `width` columns wide, running a command."""

    def __init__(self, width: int, command: str) -> None:
        self.tmux = shutil.which("tmux")
        assert self.tmux, "tmux is not installed: run scripts/setup"
        self.home = Path(tempfile.mkdtemp(prefix="rigup-top-"))  # short: a unix socket's path has ~100 characters
        self.socket, self.config = self.home / "tmux.sock", self.home / "tmux.conf"
        self.config.write_text("set -g remain-on-exit on\n")  # the pane outlives the command: what it printed last stays
        # the server inherits this environment; COLUMNS or LINES would override the pane's size for rich
        self.env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
        self.env["TERM"] = os.environ.get("TERM") or "xterm-256color"
        self.width = width
        self.do("new-session", "-d", "-s", "top", "-x", str(width), "-y", "50", "-c", str(ROOT), command)

    def do(self, *args: str) -> str:
        assert self.tmux
        done = subprocess.run([self.tmux, "-S", str(self.socket), "-f", str(self.config), *args], capture_output=True,
                              text=True, timeout=10, env=self.env)
        assert done.returncode == 0, f"tmux {' '.join(args)}: {done.stderr}"
        return done.stdout

    def screen(self) -> str:
        return self.do("capture-pane", "-p", "-t", "top")

    def exited(self, seconds: float) -> str:
        """The pane's whole history once its command ended ("" while it still runs after `seconds`)."""
        dead = wait_for(lambda: self.do("display-message", "-p", "-t", "top", "#{pane_dead}"), lambda s: s.strip() == "1",
                        seconds)
        return self.do("capture-pane", "-p", "-S", "-100", "-t", "top") if dead.strip() == "1" else ""

    def close(self) -> None:
        assert self.tmux
        subprocess.run([self.tmux, "-S", str(self.socket), "kill-server"], capture_output=True, timeout=10, env=self.env)
        shutil.rmtree(self.home, ignore_errors=True)


def rates_shown(screen: str) -> bool:
    return bool(re.search(r"^ *rig-1 +dual +.*up +3 +1 +[0-9]", screen, re.MULTILINE)) and "OK/S" in screen and \
        bool(re.search(r"rig-1/\S+ .* healthy +[1-9][0-9.]* ", screen))


@pytest.mark.parametrize(("width", "quit_key"), [(80, "q"), (120, "q"), (200, "C-c")])
def test_top_in_a_terminal(fleet: FakeFleet, width: int, quit_key: str) -> None:
    """What a reader sees at 80, 120 and 200 columns: every pod's host, pod and state whole, its running
    and waiting requests, each route's own name, state and rates, headers whole and on one line; q quits."""
    top = f"{shlex.quote(sys.executable)} -m rigup top --fleet {shlex.quote(str(fleet.path))} --direct --interval 1"
    terminal = Terminal(width, f'{top}; echo "rigup top exited with status $?"')
    try:
        shown = wait_for(terminal.screen, rates_shown, 30)  # the second frame has rates
        assert rates_shown(shown), f"no rates on the screen:\n{shown}"
        lines = shown.splitlines()
        assert all(len(line) <= width for line in lines)
        assert re.match(r"rigup top  direct: 8 targets  (\d{4}-\d\d-\d\d )?\d\d:\d\d:\d\d  .*q( or Ctrl-C)? quits$",
                        lines[0]), f"the header is not one whole line:\n{shown}"
        assert "…" not in shown, f"something is cut short:\n{shown}"

        pods = {(p["HOST"], p["POD"]): p for p in read_table(shown, "Pods")}
        assert set(pods) == {("rig-1", "dual"), ("rig-2", "left"), ("rig-2", "right"), ("rig-3", "dual")}, shown
        rig1, left, right, rig3 = pods["rig-1", "dual"], pods["rig-2", "left"], pods["rig-2", "right"], pods["rig-3", "dual"]
        assert [p["STATE"] for p in (rig1, left, right)] == ["up", "up", "up"]
        assert rig3["STATE"] == "down: connection refused"
        assert (rig1["RUN"], rig1["WAIT"], left["RUN"], left["WAIT"]) == ("3", "1", "1", "0")
        assert 600 < float(column(rig1, "GEN TOK/S", "GEN/S")) < 1100  # 850 tokens a second, over about a second
        assert float(column(left, "GEN TOK/S", "GEN/S")) > 0 and float(column(right, "GEN TOK/S", "GEN/S")) == 0

        gpus = read_table(shown, "GPUs")
        assert [(g["HOST"], g["STATE"]) for g in gpus] == [("rig-1", "up")] * 2 + [("rig-2", "up")] * 4 + [
            ("rig-3", "down: connection refused")]

        routes = {column(r, "ROUTE"): r for r in read_table(shown, "Gateway routes")}
        names = {"rig-1/rigup-dual.service", "rig-2/rigup-left.service", "rig-2/rigup-right.service",
                 "rig-3/rigup-dual.service"}
        assert set(routes) in (names, {n.replace("rigup-", "").removesuffix(".service") for n in names}), shown
        states = {name.split("/")[0] + "/" + name.split("/")[1].removeprefix("rigup-").removesuffix(".service"): r["STATE"]
                  for name, r in routes.items()}
        assert states == {"rig-1/dual": "healthy", "rig-2/left": "healthy", "rig-2/right": "circuit half-open",
                          "rig-3/dual": "out of rotation, circuit open"}, shown
        rates = {name.split("/")[0] + "/" + name.split("/")[1].removeprefix("rigup-").removesuffix(".service"):
                 (float(r["OK/S"]), float(r["FAIL/S"])) for name, r in routes.items()}
        # each route's own answers (20, 8, 4 + 2 and none a second, counted in whole answers over about a second)
        assert 15 < rates["rig-1/dual"][0] < 25 and rates["rig-1/dual"][1] == 0, rates
        assert 5 < rates["rig-2/left"][0] < 11 and rates["rig-2/left"][1] == 0, rates
        assert 2 < rates["rig-2/right"][0] < 6 and 1 <= rates["rig-2/right"][1] < 4, rates
        assert rates["rig-3/dual"] == (0, 0), rates

        if width >= 120:  # room for every pod column (short headers: rig-3's state takes 24 columns)
            assert len(rig1) == 11 and rig1["MODEL"] == MODEL
        if width >= 200:  # for every column of every table, under its whole header
            assert set(rig1) == {"HOST", "POD", "MODEL", "STATE", "RUN", "WAIT", "GEN TOK/S", "PROMPT TOK/S", "TTFT P50",
                                 "TTFT P95", "KV CACHE"}
            assert set(gpus[0]) == HEADERS["GPUs"] and gpus[0]["NAME"] == "NVIDIA GeForce RTX 3090"
            assert set(next(iter(routes.values()))) == HEADERS["Gateway routes"] - {"GW"}
            assert routes["rig-1/rigup-dual.service"]["API BASE"] == f"http://127.0.0.1:{fleet.ports['rig-1']}/v1"
        if width == 80:  # what did not fit is said
            assert re.search(r"^Pods \(\d+ more columns? in a wider terminal\)$", shown, re.MULTILINE), shown

        terminal.do("send-keys", "-t", "top", quit_key)
        after = terminal.exited(15)
        assert after, f"still running after {quit_key}:\n{terminal.screen()}"
        assert "rigup top exited with status 0" in after, after
        assert "Traceback" not in after and "Pods" not in after  # its alternate screen is gone, the shell's is back
    finally:
        terminal.close()


# --------------------------------------------------------------------------------------------------
# the command's output and exit codes


def run_top(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(["top", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_once_as_json_reads_twice_and_exits_1_for_a_target_that_did_not_answer(
    fleet: FakeFleet, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_top(["--fleet", str(fleet.path), "--direct", "--json", "--interval", "0.5"], capsys)
    assert code == 1 and err == ""
    frame = json.loads(out)
    assert frame["source"] == "direct: 8 targets" and frame["unanswered"] == 2 and not frame["first_scrape"]
    pods = {(p["host"], p["pod"]): p for p in frame["pods"]}
    assert set(pods) == {("rig-1", "dual"), ("rig-2", "left"), ("rig-2", "right"), ("rig-3", "dual")}
    assert pods[("rig-1", "dual")]["generation_tps"] == pytest.approx(850, rel=0.15)
    assert pods[("rig-1", "dual")]["kv_usage"] == 0.42 and pods[("rig-1", "dual")]["model"] == MODEL
    assert pods[("rig-3", "dual")]["state"] == "down: connection refused" and pods[("rig-3", "dual")]["running"] is None
    assert len(frame["gpus"]) == 2 + 4 + 1
    routes = {r["route"]: (r["state"], r["success_rps"] > 0, r["failure_rps"] > 0) for r in frame["routes"]}
    assert routes == {"rig-1/rigup-dual.service": ("healthy", True, False),
                      "rig-2/rigup-left.service": ("healthy", True, False),
                      "rig-2/rigup-right.service": ("circuit half-open", True, True),
                      "rig-3/rigup-dual.service": ("out of rotation, circuit open", False, False)}


def test_once_prints_the_tables(fleet: FakeFleet, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_top(["--fleet", str(fleet.path), "--direct", "--once", "--interval", "0.3", "--limit", "rig-1", "gw-1"],
                             capsys)
    assert code == 0, out
    assert "scraping again in 0.3 s" in err
    assert out.startswith("rigup top  direct: 3 targets  ")
    (pod,) = read_table(out, "Pods")
    assert (pod["HOST"], pod["POD"], pod["MODEL"], pod["STATE"], pod["RUN"]) == ("rig-1", "dual", MODEL, "up", "3")
    assert float(pod["GEN TOK/S"]) > 0
    assert [g["HOST"] for g in read_table(out, "GPUs")] == ["rig-1", "rig-1"]
    assert len(read_table(out, "Gateway routes")) == 4  # the gateway's routes, to every rig


def test_a_bad_limit_or_fleet_file_is_one_line_and_exit_2(fleet: FakeFleet, capsys: pytest.CaptureFixture[str],
                                                          tmp_path: Path) -> None:
    code, out, err = run_top(["--fleet", str(fleet.path), "--once", "--limit", "rig-9"], capsys)
    assert (code, out) == (2, "") and err.count("\n") == 1
    assert err.startswith("rigup top: ") and "--limit 'rig-9' is neither a host nor a group" in err
    code, out, err = run_top(["--fleet", str(tmp_path / "missing.yaml"), "--once"], capsys)
    assert (code, out) == (2, "") and err.count("\n") == 1 and "fleet file not found" in err
    bad = tmp_path / "bad.yaml"
    bad.write_text("groups: {rigs: {hosts: {r: {gpu_exporter_port: 0}}}}\n")
    code, out, err = run_top(["--fleet", str(bad), "--once"], capsys)
    assert (code, out) == (2, "") and err.count("\n") == 1 and "gpu_exporter_port" in err


def test_an_unreachable_fleet_prometheus_falls_back_to_direct(tmp_path: Path, fleet: FakeFleet,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    path = write_fleet(tmp_path, fleet.ports, prometheus_listen_address=f"0.0.0.0:{DEAD_PORT}")
    fleet_login(path.parent)
    code, out, _ = run_top(["--fleet", str(path), "--json", "--interval", "0.3"], capsys)
    frame = json.loads(out)
    assert frame["source"] == f"direct: 8 targets (Prometheus https://127.0.0.1:{DEAD_PORT}: connection refused)"
    assert code == 1 and any(p["generation_tps"] for p in frame["pods"])


# --------------------------------------------------------------------------------------------------
# direct: what is scraped, and the arithmetic over two scrapes


def test_direct_endpoints_of_the_fleet(fleet: FakeFleet) -> None:
    loaded = load_fleet(fleet.path)
    endpoints = direct_endpoints(fleet_targets(fleet=loaded), metrics_login(loaded))
    got = [(e.kind, e.host, e.pod, e.url) for e in endpoints]
    p = fleet.ports
    assert got == [
        ("gateway", "gw-1", None, f"https://127.0.0.1:{p['gateway']}/metrics/"),
        ("pod", "rig-1", "dual", f"http://127.0.0.1:{p['rig-1']}/metrics"),
        ("gpu", "rig-1", None, f"https://127.0.0.1:{p['rig-1 gpus']}/metrics"),
        ("pod", "rig-2", "left", f"http://127.0.0.1:{p['rig-2/left']}/metrics"),
        ("gpu", "rig-2", None, f"https://127.0.0.1:{p['rig-2 gpus']}/metrics"),
        ("pod", "rig-2", "right", f"http://127.0.0.1:{p['rig-2/right']}/metrics"),
        ("pod", "rig-3", "dual", f"http://127.0.0.1:{DEAD_PORT}/metrics"),
        ("gpu", "rig-3", None, f"https://127.0.0.1:{DEAD_PORT}/metrics"),
    ]
    assert endpoints[0].key == GATEWAY_KEY and all(e.key is None for e in endpoints[1:])
    assert all(e.model == MODEL for e in endpoints if e.kind == "pod")
    # the GPU exporters ask who is calling: the metrics login and the fleet CA, as the converge left them here
    gpus = [e for e in endpoints if e.kind == "gpu"]
    assert all(e.login is not None and e.login.auth == ("rigup-prometheus", "pw-of-the-fleet") for e in gpus)
    assert [g.temp_c for g in gpu_rows(scrape(gpus[0], 2.0))] == [66.0, 71.0]
    wrong = replace(gpus[0], login=replace(gpus[0].login, password="wrong"))
    assert scrape(wrong, 2.0).error == "answered HTTP 401 (the metrics login refused)"
    (fleet.path.parent / "fleet-ca" / "metrics.password").unlink()  # no login here: not asked, and why
    (gpu, *_) = [e for e in direct_endpoints(fleet_targets(fleet=loaded), metrics_login(loaded)) if e.kind == "gpu"]
    assert gpu.problem is not None and gpu.problem.startswith("it asks who is calling: no ") and "metrics.password" in gpu.problem


def test_no_gpu_exporter_without_metrics_exporters(tmp_path: Path) -> None:
    path = tmp_path / "rigs.yaml"
    path.write_text("data: {variant: dual, metrics_exporters: false}\ngroups: {rigs: {hosts: {r: {ssh_hostname: 10.0.0.7}}}}\n")
    endpoints = direct_endpoints(fleet_targets(fleet=load_fleet(path)))
    assert [(e.kind, e.url) for e in endpoints] == [("pod", "http://10.0.0.7:8010/metrics")]  # dual's port


def test_a_gateway_that_refuses_the_key_or_whose_key_cannot_be_read(fleet: FakeFleet) -> None:
    url, ca = f"https://127.0.0.1:{fleet.ports['gateway']}/metrics/", str(fleet.path.parent / "fleet-ca" / "ca.crt")
    wrong = Endpoint("gateway", "gw-1", url, key="sk-wrong", ca_file=ca)
    (row,) = route_rows(scrape(wrong, 2.0), None)
    assert (row.gateway, row.state, row.answered) == ("gw-1", "answered HTTP 401 (the key refused)", False)
    # a front whose certificate another CA issued: one line, never read unchecked
    other = str(fleet_certificate(fleet.path.parent / "other-ca").ca_cert)
    (row,) = route_rows(scrape(Endpoint("gateway", "gw-1", url, key=GATEWAY_KEY, ca_file=other), 2.0), None)
    assert row.state == f"down: TLS refused: its certificate is not signed by the CA in {other}" and not row.answered
    (row,) = route_rows(scrape(Endpoint("gateway", "gw-1", url, key=GATEWAY_KEY), 2.0), None)  # the system's roots
    assert row.state == "down: TLS refused: its certificate is not signed by a CA this machine trusts (no CA file given)" and not row.answered
    (fleet.path.parent / "gateway.key").chmod(0o644)  # rigup reads no secret others can read
    (gateway,) = [e for e in direct_endpoints(fleet_targets(fleet=load_fleet(fleet.path))) if e.kind == "gateway"]
    (row,) = route_rows(scrape(gateway, 2.0), None)
    assert row.state.startswith("not asked: gateway: ") and "readable by group or others" in row.state
    assert not row.answered


def scraped(kind: str, text: str | None, at: float, error: str | None = None, **endpoint: Any) -> Scrape:
    target = Endpoint(kind, endpoint.pop("host", "rig-1"), "http://127.0.0.1:1/metrics", **endpoint)
    return Scrape(target, at, parse_exposition(text) if text is not None else None, error)


def test_pod_rates_and_quantiles_from_two_scrapes() -> None:
    pod = VllmPod(MODEL, started=1000.0)
    before = scraped("pod", pod.text(1100.0), 50.0, pod="dual", model=MODEL)
    now = scraped("pod", pod.text(1102.0), 52.0, pod="dual", model=MODEL)
    first = pod_row(before, None)
    assert (first.running, first.waiting, first.kv_usage, first.model) == (3.0, 1.0, 0.42, MODEL)
    assert first.generation_tps is None and first.ttft_p50_s is None  # one scrape: no rates yet
    row = pod_row(now, before)
    assert row.generation_tps == pytest.approx(850.0) and row.prompt_tps == pytest.approx(2400.0)
    assert row.ttft_p50_s == pytest.approx(0.1) and row.ttft_p95_s == pytest.approx(0.45)
    assert row.state == UP and row.answered


def test_a_restarted_pod_counts_from_zero() -> None:
    old = VllmPod(MODEL, started=0.0)
    new = VllmPod(MODEL, started=99.0)  # restarted one second before the second scrape
    row = pod_row(scraped("pod", new.text(100.0), 12.0, pod="dual"), scraped("pod", old.text(98.0), 10.0, pod="dual"))
    assert row.generation_tps == pytest.approx(850.0 / 2)  # 850 tokens since the restart, over the 2 s between scrapes
    # the 4 first tokens since the restart (70, 90, 120, 300 ms), not the 392 before it
    assert row.ttft_p50_s == pytest.approx(0.1) and row.ttft_p95_s == pytest.approx(0.45)


def test_no_first_tokens_between_scrapes_is_no_quantile() -> None:
    idle = VllmPod(MODEL, started=0.0, ttft_per_s=0.0)
    row = pod_row(scraped("pod", idle.text(12.0), 12.0, pod="dual"), scraped("pod", idle.text(10.0), 10.0, pod="dual"))
    assert row.ttft_p50_s is None and row.ttft_p95_s is None and row.generation_tps == pytest.approx(850.0)


def test_a_pod_that_did_not_answer() -> None:
    row = pod_row(scraped("pod", None, 1.0, "down: connection refused", pod="dual", model=MODEL), None)
    assert (row.state, row.answered, row.model, row.running) == ("down: connection refused", False, MODEL, None)


def test_gpu_rows() -> None:
    rows = gpu_rows(scraped("gpu", dcgm_text("rig-1", [Gpu(1, temp_c=71), Gpu(0, util=3, used_mib=512, free_mib=23602)]), 1.0))
    assert [(r.gpu, r.name, r.util_pct, r.mem_used_mib, r.mem_free_mib, r.temp_c, r.power_w) for r in rows] == [
        ("1", "NVIDIA GeForce RTX 3090", 97.0, 22850.0, 1264.0, 71.0, 301.456),
        ("0", "NVIDIA GeForce RTX 3090", 3.0, 512.0, 23602.0, 66.0, 301.456),
    ]
    (silent,) = gpu_rows(scraped("gpu", "# HELP other x\nother 1\n", 1.0))
    assert silent.gpu is None and "no DCGM_FI_DEV fields" in silent.state and silent.answered
    (down,) = gpu_rows(scraped("gpu", None, 1.0, "answered HTTP 503"))
    assert (down.state, down.answered) == ("answered HTTP 503", False)


def test_route_rows_with_rates() -> None:
    routes = [RouterRoute(MODEL, "http://10.0.0.1:8000", success_per_s=4.0),
              RouterRoute(MODEL, "http://10.0.0.2:8000", healthy=False, breaker=1, success_per_s=1.0, failure_per_s=2.0),
              RouterRoute("other-model", "http://10.0.0.1:8010", earlier_successes=3)]
    before = scraped("gateway", entrance_text(routes, 0.0, 100.0), 5.0, host="gw-1")
    now = scraped("gateway", entrance_text(routes, 0.0, 105.0), 10.0, host="gw-1")
    names = {"http://10.0.0.1:8000/v1": "rig-1/rigup-dual.service"}
    rows = {r.route: r for r in route_rows(now, before, lambda gateway, api_base: names.get(api_base))}
    one, two, other = rows["rig-1/rigup-dual.service"], rows["10.0.0.2:8000"], rows["10.0.0.1:8010"]
    assert (one.gateway, one.model, one.api_base, one.state) == ("gw-1", MODEL, "http://10.0.0.1:8000/v1", "healthy")
    assert (one.success_rps, one.failure_rps) == (pytest.approx(4.0), 0.0)  # no failure series: none failed
    assert (two.state, two.success_rps, two.failure_rps) == ("out of rotation, circuit open", pytest.approx(1.0),
                                                             pytest.approx(2.0))
    assert (other.model, other.state, other.success_rps, other.failure_rps) == ("other-model", "healthy", 0.0, 0.0)
    (first,) = [r for r in route_rows(now, None) if r.model == "other-model"]
    assert (first.success_rps, first.failure_rps) == (None, None)  # one scrape: no rates yet
    (quiet,) = route_rows(scraped("gateway", "# HELP vllm_router_requests_total x\n", 1.0, host="gw-1"), None)
    assert (quiet.state, quiet.answered) == (NO_ROUTES, True)


def test_a_routes_state_is_its_routers_verdict() -> None:
    """vllm_router_worker_health (its health checks) and vllm_router_cb_state (its circuit breaker)."""
    assert route_state(1.0, 0.0) == "healthy" and route_state(1.0, None) == "healthy"
    assert route_state(0.0, 0.0) == "out of rotation"
    assert route_state(0.0, 1.0) == "out of rotation, circuit open"
    assert route_state(1.0, 1.0) == "circuit open"  # the circuit opened at a failed request, before a health check
    assert route_state(1.0, 2.0) == "circuit half-open"


def test_direct_source_first_frame_then_rates(fleet: FakeFleet) -> None:
    loaded = load_fleet(fleet.path)
    source = DirectSource(direct_endpoints(fleet_targets(["rig-1"], fleet=loaded), metrics_login(loaded)), timeout=2.0)
    first = source.frame()
    assert first.first_scrape and first.pods[0].generation_tps is None
    time.sleep(0.3)
    second = source.frame()
    assert not second.first_scrape and second.pods[0].generation_tps == pytest.approx(850.0, rel=0.2)
    assert [g.temp_c for g in second.gpus] == [66.0, 71.0]


# --------------------------------------------------------------------------------------------------
# Prometheus: /api/v1/query


class FakePrometheus:
    """/api/v1/query answered from `answers` (query -> (HTTP status, JSON body)); any other query is
    answered as Prometheus answers a query it cannot parse."""

    def __init__(self, answers: dict[str, tuple[int, Any]], tls: ServerCert | None = None,
                 login: tuple[str, str] | None = None) -> None:
        """With `tls` and `login`: as the monitor's web config asks (rigup.desired.metrics_auth), over TLS with the
        fleet CA's certificate, 401 to a request without the login's basic auth."""
        self.answers = answers
        self.asked: list[dict[str, list[str]]] = []
        self.refused = 0
        outer = self
        basic = "Basic " + base64.b64encode(f"{login[0]}:{login[1]}".encode()).decode() if login else None

        class Handler(JsonHandler):
            def do_GET(self) -> None:  # noqa: N802
                if basic is not None and self.headers.get("Authorization") != basic:
                    outer.refused += 1
                    self.send_response(401)
                    self.send_header("WWW-Authenticate", "Basic")
                    self.send_header("Content-Length", "13")
                    self.end_headers()
                    self.wfile.write(b"Unauthorized\n")
                    return
                url = urllib.parse.urlsplit(self.path)
                params = urllib.parse.parse_qs(url.query)
                outer.asked.append(params)
                if url.path != "/api/v1/query":
                    self.reply(404, {"status": "error", "errorType": "not_found", "error": "404 page not found"})
                    return
                query = params.get("query", [""])[0]
                status, body = outer.answers.get(query, (400, {
                    "status": "error", "errorType": "bad_data",
                    "error": f'invalid parameter "query": 1:1: parse error: unexpected {query[:10]!r}'}))
                self.reply(status, body)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        if tls is not None:
            serve_tls(self.server, tls)
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def prometheus() -> Iterator[Callable[[dict[str, tuple[int, Any]]], FakePrometheus]]:
    started: list[FakePrometheus] = []

    def start(answers: dict[str, tuple[int, Any]], tls: ServerCert | None = None,
              login: tuple[str, str] | None = None) -> FakePrometheus:
        started.append(FakePrometheus(answers, tls, login))
        return started[-1]

    yield start
    for server in started:
        server.close()


def vector(*series: tuple[dict[str, str], str], at: float = 1796314233.402) -> tuple[int, Any]:
    """A 200 answer to an instant query, as Prometheus' HTTP API documents it."""
    return 200, {"status": "success", "data": {"resultType": "vector",
                                               "result": [{"metric": m, "value": [at, v]} for m, v in series]}}


def test_a_frame_from_what_a_real_prometheus_answered(prometheus: Callable[..., FakePrometheus]) -> None:
    """The answers Prometheus 2.42 gave to these very queries (scraping the fakes above, rig-3 down)."""
    captured = json.loads((FIXTURES / "api-query-2.42.0.json").read_text())["responses"]
    queries = prometheus_queries()
    missing = sorted(set(queries.values()) - set(captured))
    assert not missing, f"queries changed since the capture (re-capture it against a real Prometheus): {missing}"
    server = prometheus({q: (a["status_code"], a["body"]) for q, a in captured.items()})
    pod_ports = {m["metric"]["instance"].rsplit(":", 1)[1]: m["metric"]["host"]
                 for m in captured['up{job="vllm"}']["body"]["data"]["result"]}

    def names(gateway: str, api_base: str) -> str | None:  # as the fleet file names the pods (fleet_route_names)
        host = pod_ports.get(urllib.parse.urlsplit(api_base).netloc.rsplit(":", 1)[1])
        return f"{host}/rigup-dual.service" if gateway == "gw-1" and host else None

    frame = PrometheusSource(server.url, timeout=2.0, route_names=names).frame()
    assert frame.source == f"Prometheus {server.url}" and frame.notes == [] and not frame.first_scrape
    assert {tuple(p["query"]) for p in server.asked} == {(q,) for q in queries.values()}
    assert len({p["time"][0] for p in server.asked}) == 1  # one evaluation time for the whole frame
    rig1, rig2, rig3 = frame.pods
    assert (rig1.host, rig1.pod, rig1.model, rig1.state) == ("rig-1", "dual", MODEL, UP)
    assert (rig1.running, rig1.waiting, rig1.kv_usage) == (3.0, 1.0, 0.42)
    assert rig1.generation_tps == pytest.approx(850, rel=0.01) and rig1.prompt_tps == pytest.approx(2400, rel=0.01)
    assert rig1.ttft_p50_s == pytest.approx(0.1) and rig1.ttft_p95_s == pytest.approx(0.45)
    assert rig2.generation_tps == pytest.approx(400, rel=0.01) and rig2.kv_usage == 0.1
    assert (rig3.host, rig3.answered, rig3.running) == ("rig-3", False, None) and rig3.state.startswith("down")
    assert [(g.host, g.gpu, g.temp_c) for g in frame.gpus] == [
        ("rig-1", "0", 66.0), ("rig-1", "1", 71.0), ("rig-2", "0", 58.0), ("rig-3", None, None)]
    assert frame.gpus[0].mem_used_mib == 22850.0 and frame.gpus[0].power_w == 301.456 and not frame.gpus[3].answered
    # rig-2's route healed (its earlier failures stay counted), rig-3's pod is down: out of rotation, its circuit
    # open; each with its own rates, named by the fleet from its worker's address
    assert [(r.gateway, r.route, r.state) for r in frame.routes] == [
        ("gw-1", "rig-1/rigup-dual.service", "healthy"), ("gw-1", "rig-2/rigup-dual.service", "healthy"),
        ("gw-1", "rig-3/rigup-dual.service", "out of rotation, circuit open")]
    assert [(r.success_rps, r.failure_rps) for r in frame.routes] == [
        (pytest.approx(2.0, rel=0.05), None), (pytest.approx(1.0, rel=0.05), 0.0), (0.0, pytest.approx(0.5, rel=0.05))]
    # (no series of a route's failures before its first: none counted, "-")
    assert all(r.api_base and r.api_base.endswith("/v1") for r in frame.routes)
    assert frame.unanswered == 2


def test_prometheus_errors_nan_and_the_selection(prometheus: Callable[..., FakePrometheus], fleet: FakeFleet) -> None:
    q = prometheus_queries()
    pod = {"__name__": "up", "job": "vllm", "instance": "127.0.0.1:8000", "host": "rig-1", "pod": "dual",
           "variant": "dual", "model": MODEL}
    other = {**pod, "host": "rig-2", "pod": "left", "instance": "127.0.0.1:8001"}
    server = prometheus({
        q["pod_up"]: vector((pod, "1"), (other, "1")),
        q["running"]: vector(({"host": "rig-1", "pod": "dual"}, "2"), ({"host": "rig-2", "pod": "left"}, "7")),
        q["ttft_p50_s"]: vector(({"host": "rig-1", "pod": "dual"}, "NaN")),  # no first token in the window
        q["gateway_up"]: vector(({"__name__": "up", "job": "gateway-gw_1", "host": "gw-1", "instance": "x:4000"}, "1")),
        q["gpu_up"]: vector(({"__name__": "up", "job": "gpu", "host": "rig-2", "instance": "x:9400"}, "0")),
        # the rest: Prometheus refuses them (400 bad_data), e.g. an older Prometheus without a function
    })
    keep = selection_filter(load_fleet(fleet.path), ["rig-1", "gw-1"])
    frame = PrometheusSource(server.url, timeout=2.0, keep=keep).frame()
    assert [(p.host, p.pod, p.running, p.ttft_p50_s) for p in frame.pods] == [("rig-1", "dual", 2.0, None)]
    assert frame.gpus == []  # rig-2 is not selected
    assert [(r.gateway, r.state) for r in frame.routes] == [("gw-1", NO_ROUTES)]
    assert frame.notes and all("bad_data" in note for note in frame.notes)
    assert any(note.startswith("waiting: ") for note in frame.notes)


def test_a_named_prometheus_that_asks_who_is_calling_gets_the_fleets_login(
    prometheus: Callable[..., FakePrometheus], fleet: FakeFleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--prometheus URL is read as the fleet's own Prometheus is: over https with the metrics login and the fleet
    CA's certificate the converge left beside the fleet file, with or without --limit; never the password to an
    http URL; without a fleet file here, no login."""
    q = prometheus_queries()
    pod = {"__name__": "up", "job": "vllm", "instance": "127.0.0.1:8000", "host": "rig-1", "pod": "dual",
           "variant": "dual", "model": MODEL}
    answers = {q["pod_up"]: vector((pod, "1")), q["running"]: vector(({"host": "rig-1", "pod": "dual"}, "2"))}
    # the monitor's certificate from the fleet CA beside the fleet file (the fixture's), its login the fleet's
    server = prometheus(answers, fleet_certificate(fleet.path.parent / "fleet-ca", "gw-1", "prometheus"),
                        ("rigup-prometheus", "pw-of-the-fleet"))
    for limit in (None, ["rig-1"]):
        frame = fleet_source(str(fleet.path), limit, prometheus=server.url, timeout=2.0).frame()
        assert [(p.host, p.pod, p.running) for p in frame.pods] == [("rig-1", "dual", 2.0)], frame.notes
        assert frame.source == f"Prometheus {server.url}"
    assert server.refused == 0 and server.asked
    # no fleet file here: no login and no fleet CA to check the certificate by (the system store's refusal, one line)
    monkeypatch.setenv("RIGUP_RIGS", str(fleet.path.parent / "elsewhere.yaml"))
    bare = fleet_source(None, None, prometheus=server.url, timeout=2.0)
    with pytest.raises(PrometheusError, match="TLS refused: its certificate is not signed by a CA this machine trusts"):
        bare.frame()
    # an http URL never gets the password: the fleet's login goes over https only
    plain = prometheus(answers, None, ("rigup-prometheus", "pw-of-the-fleet"))
    assert named_prometheus_login(plain.url, load_fleet(fleet.path)) is None
    assert named_prometheus_login(server.url, load_fleet(fleet.path)).auth == ("rigup-prometheus", "pw-of-the-fleet")


def test_query_prometheus_reads_the_documented_shapes(prometheus: Callable[..., FakePrometheus]) -> None:
    server = prometheus({
        "up": vector(({"__name__": "up", "job": "vllm"}, "1"), ({"__name__": "up", "job": "gpu"}, "+Inf")),
        "matrix": (200, {"status": "success", "data": {"resultType": "matrix", "result": []}}),
        "overloaded": (503, {"status": "error", "errorType": "unavailable", "error": "too many queries"}),
    })
    assert query_prometheus(server.url, "up", 1.0, 2.0) == [({"__name__": "up", "job": "vllm"}, 1.0),
                                                            ({"__name__": "up", "job": "gpu"}, math.inf)]
    with pytest.raises(Exception, match="a 'matrix' result, not a vector"):
        query_prometheus(server.url, "matrix", 1.0, 2.0)
    with pytest.raises(Exception, match="HTTP 503: unavailable: too many queries"):
        query_prometheus(server.url, "overloaded", 1.0, 2.0)
    with pytest.raises(PrometheusUnreachable, match="connection refused"):
        query_prometheus(f"http://127.0.0.1:{DEAD_PORT}", "up", 1.0, 2.0)


def test_fallback_source_says_why_it_reads_directly(fleet: FakeFleet) -> None:
    direct = DirectSource(direct_endpoints(fleet_targets(["rig-1"], fleet=load_fleet(fleet.path))), timeout=2.0)
    source = FallbackSource(PrometheusSource(f"http://127.0.0.1:{DEAD_PORT}", timeout=1.0), direct)
    frame = source.frame()
    assert frame.source == f"direct: 2 targets (Prometheus http://127.0.0.1:{DEAD_PORT}: connection refused)"
    assert frame.pods[0].running == 3.0


# --------------------------------------------------------------------------------------------------
# where the fleet's Prometheus is


def monitor_of(tmp_path: Path, text: str) -> Any:
    path = tmp_path / "rigs.yaml"
    path.write_text(text)
    return fleet_monitor(load_fleet(path))


def fleet_login(directory: Path) -> Path:
    """What a converge that set the monitor up leaves beside the fleet file: the fleet CA's certificate and the
    metrics password (0600), the login the fleet's Prometheus asks for."""
    ca_dir = directory / "fleet-ca"
    ca_dir.mkdir(exist_ok=True)
    if not (ca_dir / "ca.crt").exists():  # a test's real fleet CA stays
        (ca_dir / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\n")
    password = ca_dir / "metrics.password"
    password.write_text("pw-of-the-fleet\n")
    password.chmod(0o600)
    return ca_dir


def test_the_fleet_prometheus(tmp_path: Path) -> None:
    key = tmp_path / "gw.key"
    key.write_text("k\n")
    key.chmod(0o600)
    gateway = f"  gateway:\n    data: {{gateway_api_key_file: {key}, serves_variant: false}}\n    hosts: {{gw: {{ssh_hostname: 10.0.0.5}}}}\n"
    rigs = "  rigs:\n    hosts: {r1: {ssh_hostname: 10.0.0.7}}\n"
    assert monitor_of(tmp_path, "groups:\n" + rigs) is None  # no gateway, no monitor: read directly
    # Prometheus asks who is calling: without the login a converge leaves here, top reads the targets directly
    unknown = monitor_of(tmp_path, "groups:\n" + gateway + rigs)
    assert unknown.url is None and "Prometheus on gw asks who is calling: no " in (unknown.problem or "")
    ca_dir = fleet_login(tmp_path)
    monitor = monitor_of(tmp_path, "groups:\n" + gateway + rigs)
    assert (monitor.host, monitor.url, monitor.scrape_interval_s) == ("gw", "https://10.0.0.5:9090", 15)
    assert (monitor.login.auth, monitor.login.ca_file) == (("rigup-prometheus", "pw-of-the-fleet"), str(ca_dir / "ca.crt"))
    monitor = monitor_of(tmp_path, "data: {monitor_group: rigs, prometheus_listen_address: '10.0.0.7:9999'}\ngroups:\n"
                         + gateway + rigs)
    assert (monitor.host, monitor.url) == ("r1", "https://10.0.0.7:9999")
    loopback = monitor_of(tmp_path, "data: {prometheus_listen_address: '127.0.0.1:9090'}\ngroups:\n" + gateway + rigs)
    assert loopback.url is None and "listens on 127.0.0.1:9090, its own loopback" in (loopback.problem or "")
    local = monitor_of(tmp_path, "data: {prometheus_listen_address: '127.0.0.1:9090'}\ngroups:\n"
                       f"  gateway:\n    data: {{gateway_api_key_file: {key}, serves_variant: false}}\n    hosts: {{'@local': {{}}}}\n")
    assert local.url == "https://127.0.0.1:9090"


def test_fleet_route_names(fleet: FakeFleet) -> None:
    """A route's name from the fleet file: the pod at its API base (127.0.0.1 is the gateway's own host)."""
    names = fleet_route_names(fleet_targets(fleet=load_fleet(fleet.path)))
    p = fleet.ports
    assert names("gw-1", f"http://127.0.0.1:{p['rig-2/left']}/v1") == "rig-2/rigup-left.service"
    assert names("gw-1", f"http://127.0.0.1:{p['rig-1']}/v1") == "rig-1/rigup-dual.service"
    assert names("gw-1", "http://127.0.0.1:1/v1") is None  # no pod listens there
    assert names("gw-1", f"http://10.9.9.9:{p['rig-1']}/v1") is None  # another address


def test_a_narrow_terminal_drops_the_least_useful_columns_first() -> None:
    rows = [pod_cells(PodRow("rig-01", "dual", MODEL, "down: connection refused", answered=False)),
            pod_cells(PodRow("rig-02", "left", MODEL, running=3, waiting=1, generation_tps=712.6, prompt_tps=2400.0,
                             ttft_p50_s=0.1, ttft_p95_s=0.45, kv_usage=0.42))]
    headers = [c.header for c in POD_COLUMNS]
    for width, shown, short in [
        (200, headers, False),
        (120, headers, True),  # every column, under short headers
        (80, ["HOST", "POD", "STATE", "RUN", "WAIT", "GEN TOK/S", "TTFT P50", "TTFT P95", "KV CACHE"], True),
        (60, ["HOST", "POD", "STATE", "RUN", "WAIT", "GEN TOK/S"], True),
        (30, ["HOST", "POD", "STATE"], True),  # host, pod and state stay whatever the width
    ]:
        keep, narrow = fit_columns(POD_COLUMNS, rows, width)
        assert ([headers[i] for i in keep], narrow) == (shown, short), width
        assert table_width(POD_COLUMNS, rows, keep, narrow) <= width or len(keep) == 3


def test_a_resized_terminal_is_laid_out_again_and_q_quits_between_frames(fleet: FakeFleet) -> None:
    """Frames 30 s apart: a terminal narrowed from 200 to 80 columns gets the 80-column layout of the same
    frame within a second or two, and q ends it without waiting for the next frame."""
    top = f"{shlex.quote(sys.executable)} -m rigup top --fleet {shlex.quote(str(fleet.path))} --direct --interval 30"
    terminal = Terminal(200, f'{top}; echo "rigup top exited with status $?"')
    try:
        wide = wait_for(terminal.screen, lambda s: "Gateway routes" in s, 20)
        assert "GEN TOK/S" in wide and "API BASE" in wide, wide
        terminal.do("resize-window", "-t", "top", "-x", "80", "-y", "50")
        narrow = wait_for(terminal.screen, lambda s: "GEN/S" in s, 3)
        assert "GEN/S" in narrow and "API BASE" not in narrow, narrow
        assert all(p["STATE"] for p in read_table(narrow, "Pods")) and read_table(narrow, "Gateway routes")
        started = time.monotonic()
        terminal.do("send-keys", "-t", "top", "q")
        after = terminal.exited(5)
        assert after and "rigup top exited with status 0" in after, terminal.screen()
        assert time.monotonic() - started < 5  # not the 30 s to the next frame
    finally:
        terminal.close()


def test_a_quarantined_or_outvoted_pod_shows_quarantined_with_the_evidence(
        prometheus: Callable[..., FakePrometheus]) -> None:
    q = prometheus_queries()
    pods = [{"__name__": "up", "job": "vllm", "instance": f"10.0.0.1{n}:8000", "host": f"rig-{n}", "pod": "dual",
             "variant": "dual", "model": MODEL} for n in (1, 2, 3)]
    evidence = {"probe": "arithmetic", "answer": "'!!!!!!!!...'", "expected": "lexical variety 0.00 over the first 200 words"}
    server = prometheus({
        q["pod_up"]: vector(*[(p, "1") for p in pods]),
        SENTINEL_QUERIES["quarantined"]: vector(({"__name__": "rigup_sentinel_quarantined", "job": "node",
                                                  "host": "rig-1", "pod": "dual", "variant": "dual", **evidence}, "1")),
        SENTINEL_QUERIES["outvoted"]: vector(({"__name__": "ALERTS", "alertname": "RigupPodOutvoted",
                                               "alertstate": "firing", "host": "rig-2", "pod": "dual",
                                               "probe": "recall", "answer": "5d1c2b3a4e5f6a7b"}, "1")),
    })
    frame = SentinelMarks(PrometheusSource(server.url, timeout=2.0), server.url, 2.0).frame()
    assert [(p.host, p.state) for p in frame.pods] == [
        ("rig-1", "QUARANTINED: probe arithmetic answered '!!!!!!!!...' (lexical variety 0.00 over the first 200 words)"),
        ("rig-2", "QUARANTINED: outvoted on probe recall (answer 5d1c2b3a4e5f6a7b)"),
        ("rig-3", UP)]
    assert not [n for n in frame.notes if n.startswith("sentinel")]
    assert pod_cells(frame.pods[0])[3].style == "bold red"
    # a Prometheus that cannot answer the sentinel's queries: the frame says so, the pods keep their state
    bare = prometheus({q["pod_up"]: vector(*[(p, "1") for p in pods])})
    frame = SentinelMarks(PrometheusSource(bare.url, timeout=2.0), bare.url, 2.0).frame()
    assert {p.state for p in frame.pods} == {UP}
    assert any(n.startswith("sentinel quarantined: ") for n in frame.notes)
