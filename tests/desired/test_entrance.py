"""The entrance's rendering (issue 44): the front's allowlist and key checks, the client key map, one router per
model, and the site, dispatch and key includes checked by Debian's own nginx with its njs module (nginx -t)."""

from __future__ import annotations

import http.server
import json
import re
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
import requests

from rigup.desired.entrance import (
    ALLOWED_PATHS,
    Client,
    EntrancePaths,
    ModelRouter,
    dispatch_js,
    key_map_text,
    model_routers,
    models_document,
    nginx_site,
    pod_key_text,
    router_args,
    router_env_text,
)
from tests.support.nginx_front import write_front


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


CLIENTS = [Client("bob", "bob-key-0123456789abcdef"), Client("alice", "alice-key-0123456789abcdef")]


def routers() -> list[ModelRouter]:
    return model_routers({"qwen3.6-27b": ["http://10.0.0.2:8000", "http://10.0.0.1:8000"],
                          "Gemma/4 31B": ["http://10.0.0.3:8010"]})


def test_one_router_per_model_with_stable_ports_and_names() -> None:
    gemma, qwen = routers()
    assert (gemma.model, gemma.slug, gemma.port, gemma.metrics_port) == ("Gemma/4 31B", "gemma-4-31b", 30100, 30200)
    assert (qwen.slug, qwen.port, qwen.workers) == ("qwen3-6-27b", 30101, ("http://10.0.0.1:8000", "http://10.0.0.2:8000"))
    twins = model_routers({"a.b": ["http://x:1"], "a-b": ["http://y:1"]})
    assert [r.slug for r in twins] == ["a-b", "a-b-2"]  # two names, one slug: told apart


def test_router_arguments_route_by_session_with_health_checks_and_retries_and_no_key() -> None:
    args = router_args(routers()[1], health_check_interval_s=3, num_retries=2).split()
    assert args[args.index("--policy") + 1] == "consistent_hash"
    assert args[args.index("--worker-urls") + 1: args.index("--worker-urls") + 3] == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
    assert args[args.index("--health-check-interval-secs") + 1] == "3"
    assert args[args.index("--retry-max-retries") + 1] == "3"
    assert args[args.index("--host") + 1] == "127.0.0.1" and args[args.index("--prometheus-host") + 1] == "127.0.0.1"
    assert "--api-key" not in args
    assert router_env_text(routers()[1], health_check_interval_s=3, num_retries=2).splitlines()[1].startswith("ROUTER_ARGS=")


def test_the_key_map_holds_every_client_by_name_and_nothing_else_does() -> None:
    text = key_map_text(CLIENTS)
    assert '"Bearer alice-key-0123456789abcdef" alice;' in text and '"Bearer bob-key-0123456789abcdef" bob;' in text
    assert text.index("alice") < text.index("bob") and 'default "";' in text
    site = nginx_site(routers(), EntrancePaths("/opt/rigup/gateway"), bind_address="0.0.0.0", port=4000, tls=None)
    for client in CLIENTS:
        assert client.key not in site and client.key not in repr(client)
    assert "include /opt/rigup/gateway/clients.map;" in site and "include /opt/rigup/gateway/pod-key.conf;" in site
    assert 'proxy_set_header Authorization "";' in site  # the client's key never passes to a router
    # the hop sends each pod its own key, by its host:port; any other gets none (the pod refuses)
    assert pod_key_text({"10.0.0.2:8000": "b" * 64, "10.0.0.1:8000": "a" * 64}).splitlines()[1:] == [
        "map $http_host $entrance_pod_authorization {", '    default "";',
        f'    "10.0.0.1:8000" "Bearer {"a" * 64}";', f'    "10.0.0.2:8000" "Bearer {"b" * 64}";', "}"]
    assert pod_key_text(None).splitlines()[2:] == ['    default "";', "}"]
    # each router reaches its pods through the hop: its HTTP proxy, for loopback pods too
    env = router_env_text(routers()[1], health_check_interval_s=3, num_retries=2)
    assert "HTTP_PROXY=http://127.0.0.1:30400" in env.splitlines() and "NO_PROXY=" in env.splitlines()
    hop = site[site.index("listen 127.0.0.1:30400;"):]
    assert "proxy_set_header Authorization $entrance_pod_authorization;" in hop and "proxy_pass http://$entrance_pod_upstream;" in hop
    assert '"10.0.0.1:8000" rigup_pod_0;' in site and "upstream rigup_pod_2 {\n    server 10.0.0.3:8010;" in site


def test_the_site_allows_the_openai_paths_only_and_streams_unbuffered() -> None:
    site = nginx_site(routers(), EntrancePaths("/opt/rigup/gateway"), bind_address="0.0.0.0", port=4000,
                      tls=("/opt/rigup/gateway/tls.crt", "/opt/rigup/gateway/tls.key"))
    exact = {path for path, first in re.findall(r"location = (\S+) \{\n\s*(\S+)", site) if first != "internal;"}
    routed = re.search(r"location ~ \^\((.*)\)\$ \{", site)
    assert routed is not None
    allowed = exact | {p.replace("\\/", "/") for p in routed.group(1).split("|")}
    assert allowed - {"/metrics/"} == set(ALLOWED_PATHS)
    assert "location / {\n        return 404" in site  # everything else: /invocations, /tokenize, /pause...
    assert "proxy_buffering off;" in site and "listen 0.0.0.0:4000 ssl;" in site
    assert "ssl_certificate_key /opt/rigup/gateway/tls.key;" in site
    assert "upstream rigup_router_gemma_4_31b {\n    server 127.0.0.1:30100;" in site
    plain = nginx_site(routers(), EntrancePaths("/x"), bind_address="::", port=8080, tls=None)
    assert "listen [::]:8080;" in plain and "ssl" not in plain


def test_models_lists_every_routed_model() -> None:
    assert [m["id"] for m in json.loads(models_document(routers()))["data"]] == ["Gemma/4 31B", "qwen3.6-27b"]
    assert '"Gemma/4 31B": "gemma-4-31b"' in dispatch_js(routers())


def test_debians_nginx_with_njs_accepts_the_rendered_front(tmp_path: Path) -> None:
    nginx = write_front(tmp_path, routers(), CLIENTS, port=4000)
    paths = EntrancePaths(str(tmp_path))
    checked = subprocess.run([*nginx, "-t"], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stderr
    # njs compiles entrance.js when nginx loads it: a broken dispatch fails here
    Path(paths.dispatch_js).write_text(dispatch_js(routers()).replace("function dispatch(r) {", "function dispatch(r) {{"))
    broken = subprocess.run([*nginx, "-t"], capture_output=True, text=True, timeout=60)
    assert broken.returncode != 0 and "entrance.js" in broken.stderr


@pytest.mark.parametrize("name", ["alice", "ci-agent-2"])
def test_client_names_are_what_nginx_logs_as_is(name: str) -> None:
    assert f" {name};" in key_map_text([Client(name, "k" * 20)])


class KeyRecorder(http.server.BaseHTTPRequestHandler):
    """A stand-in pod or router: answers every request and records the Authorization header it came with."""

    seen: list[str | None]

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers["Content-Length"]))
        self.seen.append(self.headers.get("Authorization"))
        body = json.dumps({"choices": [{"message": {"content": "ok"}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def recorder() -> tuple[http.server.ThreadingHTTPServer, list[str | None]]:
    seen: list[str | None] = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), type("Recorder", (KeyRecorder,), {"seen": seen}))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, seen


def test_debians_nginx_sends_the_routers_no_key_and_each_pod_its_own_through_the_hop(tmp_path: Path) -> None:
    """The front drops the client's key before the router; the hop (the routers' HTTP proxy: vllm-router's client
    sends `POST http://<pod>/...` with the pod's host:port as Host, as the pinned wheel did) sends each pod its own
    key, so pod A's key is never sent to pod B, and a host:port the entrance does not route to gets none."""
    (router, at_router), (pod_a, at_a), (pod_b, at_b) = recorder(), recorder(), recorder()
    a, b = (f"127.0.0.1:{server.server_address[1]}" for server in (pod_a, pod_b))
    model = "qwen3.6-27b"
    routers_ = [ModelRouter(model, "qwen3-6-27b", router.server_address[1], router.server_address[1],
                            (f"http://{a}", f"http://{b}"))]
    port, hop = free_port(), free_port()
    nginx = write_front(tmp_path, routers_, CLIENTS, port=port, pod_keys={a: "a" * 64, b: "b" * 64}, hop_port=hop)
    proc = subprocess.Popen([*nginx, "-g", "daemon off; user root;"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    client = {"Authorization": f"Bearer {CLIENTS[1].key}"}
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", hop), timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.stderr else ""
                time.sleep(0.1)
        reply = requests.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, headers=client, timeout=30)
        assert reply.status_code == 200, reply.text
        via_hop = {"http": f"http://127.0.0.1:{hop}"}
        for pod in (a, b, a):
            reply = requests.post(f"http://{pod}/v1/chat/completions", json=body, headers=client, proxies=via_hop,
                                  timeout=30)
            assert reply.status_code == 200, reply.text
        stranger = requests.post(f"http://127.0.0.1:{free_port()}/v1/chat/completions", json=body, proxies=via_hop,
                                 timeout=30)
        assert stranger.status_code == 502
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        for server in (router, pod_a, pod_b):
            server.shutdown()
            server.server_close()
    assert at_router == [None]  # no key at all to the router: the client's stopped at the front
    assert at_a == [f"Bearer {'a' * 64}"] * 2 and at_b == [f"Bearer {'b' * 64}"]
