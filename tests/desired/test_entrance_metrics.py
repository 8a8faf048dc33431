"""The entrance's /metrics/ as Debian's nginx with njs serves it (issue 44): every router's exposition joined into
one, each sample labelled with its model, however long the routers' expositions grow. A router whose pod failed
exposes its retry histogram and circuit-breaker series beside the rest (vllm-router 0.1.17's families), which
took one router's text past nginx's default subrequest buffer (one page): the front then closed the scrape
without an answer and the gateway looked down exactly while a route failed."""

from __future__ import annotations

import http.server
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from rigup.desired.entrance import Client, ModelRouter
from tests.support.nginx_front import FOREGROUND, serving, write_front

CLIENT = Client("prometheus", "scrape-key-0123456789abcdef")
WORKERS = 48  # pods behind one router: a large fleet's model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def router_exposition(port: int) -> str:
    """A vllm-router exposition in its shape (TYPE lines, no HELP; labels as 0.1.17 writes them) after a pod failed."""
    workers = [f"http://10.0.{port % 250}.{i}:8000" for i in range(WORKERS)]
    lines = ["# TYPE vllm_router_worker_health gauge"]
    lines += [f'vllm_router_worker_health{{worker="{w}"}} {0 if i == 0 else 1}' for i, w in enumerate(workers)]
    lines += ["# TYPE vllm_router_cb_state gauge"]
    lines += [f'vllm_router_cb_state{{worker="{w}"}} {1 if i == 0 else 0}' for i, w in enumerate(workers)]
    lines += ["# TYPE vllm_router_processed_requests_total counter"]
    lines += [f'vllm_router_processed_requests_total{{worker="{w}"}} {100 + i}' for i, w in enumerate(workers)]
    lines += ["# TYPE vllm_router_retry_backoff_duration_seconds histogram"]
    for attempt in (1, 2, 3):
        for le in ("0.005", "0.01", "0.025", "0.05", "0.1", "0.25", "0.5", "1", "2.5", "5", "10", "+Inf"):
            lines.append(f'vllm_router_retry_backoff_duration_seconds_bucket{{attempt="{attempt}",le="{le}"}} 5')
        lines.append(f'vllm_router_retry_backoff_duration_seconds_sum{{attempt="{attempt}"}} 0.385')
        lines.append(f'vllm_router_retry_backoff_duration_seconds_count{{attempt="{attempt}"}} 5')
    lines += ["# TYPE vllm_router_active_workers gauge", f"vllm_router_active_workers {WORKERS}"]
    return "\n".join(lines) + "\n"


@pytest.fixture
def front(tmp_path: Path) -> Iterator[tuple[str, dict[str, str]]]:
    servers, expositions = [], {}
    routers = []
    for index, model in enumerate(("qwen3.6-27b", "gemma-4-31b")):
        metrics_port = free_port()
        text = router_exposition(metrics_port)
        expositions[model] = text

        class Exporter(http.server.BaseHTTPRequestHandler):
            body = text.encode()

            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(self.body)))
                self.end_headers()
                self.wfile.write(self.body)

            def log_message(self, *args: object) -> None:
                pass

        server = http.server.ThreadingHTTPServer(("127.0.0.1", metrics_port), Exporter)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        routers.append(ModelRouter(model, model.replace(".", "-"), free_port(), metrics_port, ("http://10.0.0.1:8000",)))
    port = free_port()
    nginx = write_front(tmp_path, routers, [CLIENT], port=port)
    try:
        with serving([*nginx, "-g", FOREGROUND], port):
            yield f"http://127.0.0.1:{port}", expositions
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()


def test_the_metrics_join_every_routers_exposition_by_model_however_long(front: tuple[str, dict[str, str]]) -> None:
    url, expositions = front
    assert all(len(text) > 8192 for text in expositions.values())  # past nginx's default subrequest buffer
    reply = requests.get(f"{url}/metrics/", headers={"Authorization": f"Bearer {CLIENT.key}"}, timeout=30)
    assert reply.status_code == 200, reply.text
    joined = reply.text.splitlines()
    for model, text in expositions.items():
        for line in text.splitlines():
            if line.startswith("#"):
                assert line in joined
                continue
            name, _, rest = line.partition("{")
            if rest:
                labelled = f'{name}{{model="{model}",{rest}'
            else:
                metric, _, value = line.partition(" ")
                labelled = f'{metric}{{model="{model}"}} {value}'
            assert labelled in joined, labelled
    # Prometheus' text format: a family's TYPE once, its samples together
    assert joined.count("# TYPE vllm_router_worker_health gauge") == 1
    health = [i for i, line in enumerate(joined) if line.startswith("vllm_router_worker_health{")]
    assert health == list(range(health[0], health[0] + 2 * WORKERS))


def test_the_metrics_want_a_clients_key(front: tuple[str, dict[str, str]]) -> None:
    url, _ = front
    assert requests.get(f"{url}/metrics/", timeout=30).status_code == 401
    assert requests.get(f"{url}/metrics/", headers={"Authorization": "Bearer wrong"}, timeout=30).status_code == 401
