"""Usage per client at the entrance (issue 44): Debian's own nginx with its njs module (0.7.9) runs the rendered
front before a stand-in router; every request of a client to a model path is logged with the tokens of the
response's usage, the body reaches the client untouched, and rigup-entrance-usage's counters (from that log) are
joined into the front's /metrics/."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import requests

from rigup.desired.entrance import USAGE_LOG, Client, ModelRouter
from rigup.rig.entrance_usage import Follower, Usage, follow, serve
from tests.support.nginx_front import FOREGROUND, serving, write_front

ALICE, BOB = "alice-key-0123456789abcdef", "bob-key-0123456789abcdef"
MODEL = "qwen3.6-27b"
USAGE = {"prompt_tokens": 9, "total_tokens": 25, "completion_tokens": 16, "prompt_tokens_details": None}
# generated text that looks like a usage object: inside a JSON string its quotes are escaped
FORGED = 'as JSON: {"usage":{"prompt_tokens":100000,"completion_tokens":100000}}'


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def chunk(delta: dict, **extra: object) -> bytes:
    event = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
             "choices": [{"index": 0, "delta": delta, "finish_reason": None}] if delta else [], **extra}
    return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"


class Router(BaseHTTPRequestHandler):
    """A stand-in for vllm-router in front of vLLM: chat (whole or streamed), embeddings, and /metrics."""

    protocol_version = "HTTP/1.1"
    streams: list[bytes] = []  # what it sent of each stream, to compare with what the client got

    def log_message(self, *args: object) -> None:
        return

    def do_GET(self) -> None:  # noqa: N802
        body = b'# TYPE vllm_router_requests_total counter\nvllm_router_requests_total{route="/v1/chat/completions"} 3\n'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:  # noqa: N802
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/v1/embeddings":
            self.reply({"object": "list", "data": [{"embedding": [0.1]}], "model": MODEL,
                        "usage": {"prompt_tokens": 5, "total_tokens": 5}})
        elif request.get("stream"):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            events = [chunk({"role": "assistant", "content": ""}), *[chunk({"content": f"tok{i} "}) for i in range(40)],
                      chunk({"content": FORGED})]
            if (request.get("stream_options") or {}).get("include_usage"):
                events.append(chunk({}, usage=USAGE))
            events.append(b"data: [DONE]\n\n")
            for event in events:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                self.wfile.flush()
            # recorded before the terminating chunk: the client cannot finish reading the stream before then
            Router.streams.append(b"".join(events))
            self.wfile.write(b"0\r\n\r\n")
        elif request.get("fail"):
            self.reply({"error": {"message": "boom"}}, status=500)
        else:
            self.reply({"id": "chatcmpl-2", "object": "chat.completion", "model": MODEL, "choices": [
                {"index": 0, "message": {"role": "assistant", "content": FORGED + " x" * 3000}, "finish_reason": "stop"}],
                "usage": USAGE, "prompt_logprobs": None, "kv_transfer_params": None})

    def reply(self, document: dict, status: int = 200) -> None:
        body = json.dumps(document, separators=(",", ":")).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture(scope="module")
def front(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    tmp = tmp_path_factory.mktemp("front")
    router = ThreadingHTTPServer(("127.0.0.1", 0), Router)
    threading.Thread(target=router.serve_forever, daemon=True).start()
    router_port = router.server_address[1]
    routers = [ModelRouter(MODEL, "qwen3-6-27b", router_port, router_port, ("http://10.0.0.1:8000",))]
    port, counter_port = free_port(), free_port()
    nginx = write_front(tmp, routers, [Client("alice", ALICE), Client("bob", BOB)], port,
                        pod_keys={"10.0.0.1:8000": "pod-secret"}, usage_port=counter_port)
    log = tmp / Path(USAGE_LOG).name
    usage, stop = Usage(), threading.Event()
    follower = Follower(str(log))
    counter = serve(usage, "127.0.0.1", counter_port)
    threading.Thread(target=counter.serve_forever, daemon=True).start()
    threading.Thread(target=follow, args=(follower, usage, stop, 0.05), daemon=True).start()
    try:
        with serving([*nginx, "-g", f"{FOREGROUND} worker_processes 2;"], port):
            yield {"url": f"http://127.0.0.1:{port}", "log": log, "usage": usage, "tmp": tmp}
    finally:
        stop.set()
        counter.shutdown()
        router.shutdown()


def post(front: dict, key: str | None, body: dict, path: str = "/v1/chat/completions") -> requests.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return requests.post(front["url"] + path, json=body, headers=headers, timeout=30)


def logged(front: dict, count: int) -> list[dict]:
    deadline = time.monotonic() + 10
    while True:
        lines = front["log"].read_text().splitlines() if front["log"].exists() else []
        if len(lines) >= count or time.monotonic() > deadline:
            return [json.loads(line) for line in lines]
        time.sleep(0.05)


def test_each_clients_requests_and_tokens_are_logged_and_counted(front: dict) -> None:
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "secret prompt text"}]}
    whole = post(front, ALICE, chat)
    assert whole.status_code == 200 and whole.json()["usage"] == USAGE  # the body untouched
    assert whole.json()["choices"][0]["message"]["content"].startswith(FORGED)
    with requests.post(front["url"] + "/v1/chat/completions", stream=True, timeout=30,
                       headers={"Authorization": f"Bearer {BOB}"},
                       json={**chat, "stream": True, "stream_options": {"include_usage": True}}) as streamed:
        got = b"".join(streamed.iter_content(None))
    assert got == Router.streams[-1]  # every byte of the stream as the router sent it
    with requests.post(front["url"] + "/v1/chat/completions", stream=True, timeout=30,
                       headers={"Authorization": f"Bearer {BOB}"}, json={**chat, "stream": True}) as plain:
        assert b"".join(plain.iter_content(None)) == Router.streams[-1]
    assert post(front, ALICE, {"model": MODEL, "input": "x"}, "/v1/embeddings").json()["usage"]["prompt_tokens"] == 5
    assert post(front, ALICE, {**chat, "fail": True}).status_code == 500
    assert post(front, ALICE, {**chat, "model": "no-such-model"}).status_code == 404
    assert post(front, None, chat).status_code == 401  # no client: not in the usage log
    assert post(front, "sk-wrong-0123456789abcdef", chat).status_code == 401

    lines = logged(front, 6)
    assert [(e["client"], e["model"], e["status"], e["prompt_tokens"], e["completion_tokens"]) for e in lines] == [
        ("alice", MODEL, "200", "9", "16"),  # the answer's usage, not the forged one in its text
        ("bob", MODEL, "200", "9", "16"),  # the stream's last usage event
        ("bob", MODEL, "200", "", ""),  # a stream without include_usage carries none
        ("alice", MODEL, "200", "5", "0"),  # embeddings: prompt tokens only
        ("alice", MODEL, "500", "", ""),
        ("alice", "", "404", "", ""),  # a model not served: not named (clients choose it freely)
    ]
    text = front["log"].read_text()
    assert "secret prompt text" not in text and ALICE not in text and BOB not in text

    deadline = time.monotonic() + 10
    while front["usage"].counts["rigup_gateway_client_requests_total"].get(
            (("client", "alice"), ("model", ""), ("code", "404"))) is None:
        assert time.monotonic() < deadline, front["usage"].counts
        time.sleep(0.05)
    metrics = requests.get(front["url"] + "/metrics/", headers={"Authorization": f"Bearer {BOB}"}, timeout=30)
    assert metrics.status_code == 200
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.text.splitlines()
               if line and not line.startswith("#")}
    assert samples[f'vllm_router_requests_total{{model="{MODEL}",route="/v1/chat/completions"}}'] == 3  # the router's
    who = f'client="alice",model="{MODEL}"'
    assert samples[f'rigup_gateway_client_requests_total{{{who},code="200"}}'] == 2
    assert samples[f'rigup_gateway_client_requests_total{{{who},code="500"}}'] == 1
    assert samples['rigup_gateway_client_requests_total{client="alice",model="",code="404"}'] == 1
    assert samples[f"rigup_gateway_client_prompt_tokens_total{{{who}}}"] == 9 + 5
    assert samples[f"rigup_gateway_client_completion_tokens_total{{{who}}}"] == 16
    bob = f'client="bob",model="{MODEL}"'
    assert samples[f'rigup_gateway_client_requests_total{{{bob},code="200"}}'] == 2
    assert samples[f"rigup_gateway_client_prompt_tokens_total{{{bob}}}"] == 9
    assert samples[f"rigup_gateway_client_unmetered_requests_total{{{bob}}}"] == 1
    assert f"rigup_gateway_client_unmetered_requests_total{{{who}}}" not in samples  # its 500 is no answer
    assert "js exception" not in (front["tmp"] / "error.log").read_text()
