"""rigup-quarantine-routes (issue 43): a pod its rig's sentinel quarantined leaves its model's router and comes back
when released; a model's last routes follow gateway_quarantine_removes_last_route; the sentinel's own textfile is
what it reads; a router restarted with every --worker-urls is corrected at the next pass."""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from rigup.desired.entrance import ModelRouter
from rigup.desired.gateway import Route
from rigup.desired.quarantine_routes import config_text, pod_of, sentinel_urls
from rigup.rig import quarantine_routes as qr
from rigup.rig import servingctl as ctl

A, B, C = "http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"


@pytest.mark.parametrize(
    ("states", "removes_last_route", "wanted", "kept"),
    [
        ([(A, False), (B, False)], False, [A, B], False),
        ([(A, False), (B, True)], False, [A], False),  # the quarantined pod leaves
        ([(A, True), (B, True), (C, False)], True, [C], False),
        ([(A, True), (B, True)], False, [A, B], True),  # every pod quarantined: the last routes are kept
        ([(A, True), (B, True)], True, [], False),  # ... or taken out, as the knob says
        ([], False, [], False),
    ],
)
def test_decide(states: list[tuple[str, bool]], removes_last_route: bool, wanted: list[str], kept: bool) -> None:
    assert qr.decide(states, removes_last_route) == (wanted, kept)


class Release:
    def __init__(self, name: str) -> None:
        self.name, self.variant, self.served_model_name = name, "dual", "qwen"


def sentinel_textfile(**held: bool) -> str:
    """The sentinel's own textfile (servingctl.sentinel_metrics) for pods quarantined or not, the evidence carrying
    quotes, braces and a backslash as a garbage answer may."""
    records = []
    for pod, quarantined in held.items():
        evidence = {"probe": "arithmetic", "answer": "'{\"!!\\\\ }!!'", "expected": "391 = {x}"} if quarantined else None
        records.append((Release(pod), {"quarantined": evidence, "identity": "id1"}))
    return ctl.sentinel_metrics(records, now=lambda: 1.0)  # type: ignore[arg-type]


def test_the_quarantine_is_read_from_the_sentinels_textfile() -> None:
    assert qr.quarantined_pods(sentinel_textfile(dual=True, solo=False)) == {"dual": True, "solo": False}
    assert qr.quarantined_pods("# HELP x\nnode_load1 0.5\n") == {}


class Router:
    """vllm-router 0.1.17's admin API as the pinned wheel answers it: GET /list_workers, POST /add_worker?url=
    (400 "already exists"), POST /remove_worker?url=."""

    def __init__(self, *workers: str) -> None:
        self.workers = list(workers)
        self.calls: list[str] = []

    def __call__(self, method: str, url: str) -> tuple[int, str]:
        parts = urlsplit(url)
        self.calls.append(f"{method} {parts.path}")
        worker = parse_qs(parts.query).get("url", [""])[0]
        if (method, parts.path) == ("GET", "/list_workers"):
            return 200, json.dumps({"urls": self.workers})
        if (method, parts.path) == ("POST", "/add_worker"):
            if worker in self.workers:
                return 400, f"Worker {worker} already exists"
            self.workers.append(worker)
            return 200, f"Successfully added worker: {worker}"
        if (method, parts.path) == ("POST", "/remove_worker"):
            self.workers = [w for w in self.workers if w != worker]
            return 200, f"Successfully removed worker: {worker}"
        return 404, ""


class Rigs:
    def __init__(self) -> None:
        self.held: dict[str, dict[str, bool]] = {"rig-1": {"dual": False}, "rig-2": {"dual": False}}
        self.down: set[str] = set()

    def __call__(self, url: str) -> str:
        rig = urlsplit(url).hostname or ""
        if rig in self.down:
            raise OSError("connection refused")
        return sentinel_textfile(**self.held[rig])


def watcher(router: Router, rigs: Rigs, removes_last_route: bool = False) -> tuple[qr.Watcher, list[str]]:
    config: dict[str, Any] = {
        "removes_last_route": removes_last_route,
        "sentinels": {"rig-1": "https://rig-1:9100/metrics", "rig-2": "https://rig-2:9100/metrics"},
        "routers": [{"model": "qwen", "admin": "http://127.0.0.1:30100",
                     "workers": [{"url": A, "host": "rig-1", "pod": "dual"}, {"url": B, "host": "rig-2", "pod": "dual"}]}],
    }
    lines: list[str] = []
    return qr.Watcher(config, None, fetch=rigs, call=router, out=lines.append), lines


def test_a_quarantined_pod_leaves_its_router_and_comes_back_when_released() -> None:
    router, rigs = Router(A, B), Rigs()
    w, lines = watcher(router, rigs)
    assert w.once() == ["qwen: every pod routed"] and router.workers == [A, B]
    rigs.held["rig-2"]["dual"] = True
    assert w.once() == ["qwen: out of its routes (quarantined): rig-2/dual"] and router.workers == [A]
    assert w.once() == [] and router.calls[-1] == "GET /list_workers"  # nothing to change, nothing said again
    router.workers = [A, B]  # the router restarted: its --worker-urls are back whole
    w.once()
    assert router.workers == [A]
    rigs.down.add("rig-2")  # its exporter cannot be read: the pod stays out, said once
    w.once()
    w.once()
    assert router.workers == [A] and sum("rig-2: its sentinel's series cannot be read" in line for line in lines) == 1
    rigs.down.clear()
    rigs.held["rig-2"]["dual"] = False  # released
    assert w.once() == ["qwen: every pod routed"] and router.workers == [A, B]


def test_every_pod_quarantined_keeps_the_last_routes_unless_the_knob_says_otherwise() -> None:
    router, rigs = Router(A, B), Rigs()
    w, _ = watcher(router, rigs)
    rigs.held["rig-1"]["dual"] = True
    w.once()
    assert router.workers == [B]
    rigs.held["rig-2"]["dual"] = True
    assert w.once() == ["qwen: every pod is quarantined (rig-1/dual, rig-2/dual); the entrance keeps routing to them "
                        "(gateway_quarantine_removes_last_route is false)"]
    assert sorted(router.workers) == [A, B]
    router, rigs = Router(A, B), Rigs()
    w, _ = watcher(router, rigs, removes_last_route=True)
    rigs.held["rig-1"]["dual"] = rigs.held["rig-2"]["dual"] = True
    assert w.once() == ["qwen: every pod is quarantined; no route left (gateway_quarantine_removes_last_route)"]
    assert router.workers == []


def test_workers_rigup_did_not_list_are_left_alone_and_a_router_that_does_not_answer_is_asked_again() -> None:
    router, rigs = Router(A, B, C), Rigs()
    w, _ = watcher(router, rigs)
    rigs.held["rig-1"]["dual"] = True
    w.once()
    assert router.workers == [B, C]
    rigs.held["rig-1"]["dual"] = False
    w.call = lambda method, url: (503, "")  # the router is restarting: nothing said, nothing changed
    assert w.once() == [] and router.workers == [B, C]
    w.call = router
    assert w.once() == ["qwen: every pod routed"] and router.workers == [B, C, A]


def test_the_config_names_each_routers_workers_with_their_rig_and_pod() -> None:
    routes = [Route("rig-1", "rigup-dual.service", "dual", "qwen", f"{A}/v1", None),
              Route("rig-2", "rigup-big.service", "dual", "qwen", f"{B}/v1", None)]
    router = ModelRouter("qwen", "qwen", 30100, 30200, (A, B))
    sentinels = sentinel_urls({"rig-1": "10.0.0.1", "rig-2": "fd00::2", "rig-3": None},
                              {"rig-1": {"metrics_exporters": True, "node_exporter_port": 9100},
                               "rig-2": {"metrics_exporters": True, "node_exporter_port": 9101},
                               "rig-3": {"metrics_exporters": True, "node_exporter_port": 9100}})
    assert sentinels == {"rig-1": "https://10.0.0.1:9100/metrics?collect%5B%5D=textfile",
                         "rig-2": "https://[fd00::2]:9101/metrics?collect%5B%5D=textfile"}
    assert sentinel_urls({"rig-1": "10.0.0.1"}, {"rig-1": {"metrics_exporters": False}}) == {}
    document = json.loads(config_text([router], routes, sentinels, removes_last_route=False, root="/opt/rigup/gateway"))
    assert document["routers"] == [{"model": "qwen", "admin": "http://127.0.0.1:30100",
                                     "workers": [{"url": A, "host": "rig-1", "pod": "dual"},
                                                 {"url": B, "host": "rig-2", "pod": "big"}]}]
    assert document["removes_last_route"] is False and document["ca_file"] == "/opt/rigup/gateway/fleet-ca.crt"
    assert pod_of("rigup-dual.service") == "dual"


class KeptAliveServer:
    """A node_exporter-like HTTP/1.1 server on loopback that counts the connections it accepted and can close a
    kept connection after answering (as a server's idle timeout does), or ask for a login."""

    def __init__(self, textfile: str) -> None:
        import http.server
        import threading

        owner = self
        self.connections, self.requests, self.close_after_next, self.want = 0, 0, False, ""

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self) -> None:
                owner.connections += 1
                super().setup()

            def do_GET(self) -> None:  # noqa: N802
                owner.requests += 1
                if owner.want and self.headers.get("Authorization") != owner.want:
                    self.send_response(401, "Unauthorized")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                body = textfile.encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                if owner.close_after_next:  # closed without saying so: the client finds out at its next request
                    owner.close_after_next = False
                    self.close_connection = True

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/metrics?collect%5B%5D=textfile"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_each_rig_is_read_over_one_kept_connection_and_one_its_server_closed_is_opened_again() -> None:
    server = KeptAliveServer(sentinel_textfile(dual=True))
    try:
        router = Router(A, B)
        config = {"sentinels": {"rig-1": server.url},
                  "routers": [{"model": "qwen", "admin": "http://127.0.0.1:30100",
                               "workers": [{"url": A, "host": "rig-1", "pod": "dual"}, {"url": B, "host": "rig-2", "pod": "dual"}]}]}
        lines: list[str] = []
        w = qr.Watcher(config, None, call=router, out=lines.append)  # the rigs read over HTTP for real
        for _ in range(5):
            w.once()
        assert router.workers == [B] and (server.requests, server.connections) == (5, 1)
        server.close_after_next = True
        w.once()  # answered, then closed by the server
        w.once()  # the kept connection is found closed: sent again on a new one, nothing said
        assert router.workers == [B] and (server.requests, server.connections) == (7, 2) and lines == [
            "rigup-quarantine-routes: qwen: out of its routes (quarantined): rig-1/dual"]
        server.want = "Basic nobody"  # a login the rig does not take: the rig cannot be read, its state kept
        w.once()
        assert router.workers == [B] and lines[-1] == ("rigup-quarantine-routes: rig-1: its sentinel's series cannot be "
                                                       "read (HTTP Error 401: Unauthorized); its pods keep the state last read")
    finally:
        server.close()


def test_a_rig_that_answers_something_other_than_http_is_unreadable_and_keeps_its_state() -> None:
    import socket
    import threading

    listener = socket.create_server(("127.0.0.1", 0))

    def answer_garbage() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.recv(4096)
                conn.sendall(b"SSH-2.0-OpenSSH_9.2\r\n")  # another service on the exporter's port

    threading.Thread(target=answer_garbage, daemon=True).start()
    try:
        router = Router(A)
        config = {"sentinels": {"rig-1": f"http://127.0.0.1:{listener.getsockname()[1]}/metrics"},
                  "routers": [{"model": "qwen", "admin": "http://127.0.0.1:30100",
                               "workers": [{"url": A, "host": "rig-1", "pod": "dual"}]}]}
        lines: list[str] = []
        w = qr.Watcher(config, None, call=router, out=lines.append)
        w.once()
        w.once()
        assert router.workers == [A] and len(lines) == 2, lines  # said once, then the account of the router
        assert lines[0].startswith("rigup-quarantine-routes: rig-1: its sentinel's series cannot be read (not HTTP "
                                   "(BadStatusLine: "), lines[0]
    finally:
        listener.close()
