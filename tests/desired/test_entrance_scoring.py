"""The entrance scores a sample of the pods' completions for degenerate text (issue 43's passive signal): Debian's
own nginx with its njs module (0.7.9) runs the rendered hop (the routers' way to their pods) before a stand-in pod;
a sampled completion, whole or streamed in pieces cut anywhere (mid-word, mid-event), is judged by club-3090's
verify-full rules as the gate judges a probe's answer (rigup.rig.servingctl.degenerate), nginx logs the verdict
alone (no text), the client gets the pod's bytes untouched, and rigup-entrance-usage counts the verdicts per pod."""

from __future__ import annotations

import json
import random
import re
import socket
import threading
import time
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest
import requests

from rigup.desired.entrance import USAGE_LOG, ModelRouter, score_percent
from rigup.rig.entrance_usage import Usage
from rigup.rig.servingctl import degenerate
from tests.support.json_http import JsonHandler
from tests.support.nginx_front import FOREGROUND, serving, write_front

MODEL = "qwen3.6-27b"
ESSAY = ("Attention lets each token weigh every other token of the context. The query of one position is compared "
         "with the keys of all positions, the scores are scaled by the square root of the key size and pass through "
         "a softmax, and the values are summed with those weights. Several heads do this in parallel over smaller "
         "projections, so that one head can follow syntax while another follows long-range references; their "
         "outputs are concatenated and projected again. Positional encodings, sinusoidal or rotary, tell the model "
         "where each token sits, since attention alone ignores order. Compared with a recurrent network, which "
         "carries one state from step to step, attention reaches any earlier token in one step and trains in "
         "parallel, at a cost that grows with the square of the length. ") * 3
# text -> what the gate's rules say of it (ok, variety, repeats; None: nothing to judge)
CORPUS = {
    "garbage": "!" * 60,  # club-3090 #922
    "essay": ESSAY,
    "number": "391",
    "loop": "I will check the logs.\n" * 6,
    "loop-with-blank-lines": "Retrying.\n\n" * 5 + "Done, the answer is below.",
    "low-variety": "the cat sat " * 80,
    "four-repeats": "Same line here.\n" * 4 + ESSAY[:300],
    "long-line-repeated": ("word " * 300 + "\n") * 5,  # the gate: repeats; its first 200 words: variety
    "unicode": "Ça marche très bien: l'équipe a livré, naïvement, le café crème. " * 2,
    "empty": "",
}
# a chat answer's reasoning (vLLM's reasoning parser splits it off: `reasoning`, or `reasoning_content`), read before
# its content; "reasoning-garbage" is a thinking model's answer that ran to its limit in '!!!!' before any content
THOUGHT = "Let me think about what is asked here."
REASONING = {"reasoning-garbage": ("!" * 60, "")}


def generated(case: str) -> str:
    """What the hop reads of a chat answer: its reasoning, then its content a line apart."""
    reasoning, content = REASONING.get(case, (THOUGHT, CORPUS.get(case, "")))
    return reasoning + ("\n" + content if content else "")


def expected(text: str) -> str | None:
    """The gate's verdict over the answer's first 200 words (what the hop reads), as the hop's counters name it; None
    for an answer with no text (not scored)."""
    if text == "":
        return None
    words = list(re.finditer(r"[A-Za-z']+", text))
    why = degenerate(text[:words[199].end()] if len(words) >= 200 else text)
    return "ok" if why is None else "repeats" if why.startswith("a line repeats") else "variety"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def event(delta: dict, finish: str | None = None, index: int = 0) -> bytes:
    chunk = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": MODEL,
             "choices": [{"index": index, "delta": delta, "finish_reason": finish}]}
    return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"


def pieces(text: str, rng: random.Random) -> list[str]:
    """`text` cut at random places, 1 to 7 characters each, as a stream's tokens can cut words and lines."""
    out, at = [], 0
    while at < len(text):
        step = rng.randint(1, 7)
        out.append(text[at:at + step])
        at += step
    return out


class Pod(JsonHandler):
    """A stand-in vLLM pod: the request's `case` names the answer (CORPUS, or a tool call, an error, a long body)."""

    protocol_version = "HTTP/1.1"
    sent: list[bytes] = []

    def do_POST(self) -> None:  # noqa: N802
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        case = request["case"]
        if case == "error":
            self.whole({"error": {"message": "boom"}}, status=500)
        elif case == "tool-call":
            message = {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"x x x x"}'}}]}
            self.whole({"choices": [{"index": 0, "message": message, "finish_reason": "tool_calls"}]})
        elif case == "huge-garbage":  # a whole answer past the 64 KiB the filter holds: judged from its start
            self.whole({"choices": [{"index": 0, "message": {"role": "assistant", "content": "!\\u00e9" * 40000},
                                     "finish_reason": "length"}]})
        elif not self.path.endswith("/chat/completions"):
            if request.get("stream"):
                self.stream("", CORPUS[case], random.Random(case), chat=False)
            else:
                self.whole({"choices": [{"index": 0, "text": CORPUS[case], "finish_reason": "length"}]})
        else:
            reasoning, content = REASONING.get(case, (THOUGHT, CORPUS.get(case, "")))
            if request.get("stream"):
                self.stream(reasoning, content, random.Random(case), chat=True)
            else:
                message = {"role": "assistant", "reasoning": reasoning, "content": content}
                self.whole({"choices": [{"index": 0, "message": message, "finish_reason": "length"}]})

    def whole(self, document: dict, status: int = 200) -> None:
        self.reply(status, document)
        Pod.sent.append(json.dumps(document).encode())

    def stream(self, reasoning: str, text: str, rng: random.Random, chat: bool) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        events = [event({"role": "assistant", "content": ""})] if chat else []
        events += [event({"reasoning_content": piece}) for piece in pieces(reasoning, rng)]
        for piece in pieces(text, rng):
            events.append(event({"content": piece}) if chat else
                          b"data: " + json.dumps({"choices": [{"index": 0, "text": piece}]}).encode() + b"\n\n")
            if chat and rng.random() < 0.2:  # a second choice's pieces between: not the first choice's text
                events.append(event({"content": "zzz zzz zzz zzz\n"}, index=1))
        events += [event({}, finish="length"), b"data: [DONE]\n\n"]
        body = b"".join(events)
        at = 0
        while at < len(body):  # written in pieces that cut events anywhere, each its own chunk
            step = rng.randint(1, 200)
            part = body[at:at + step]
            self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
            self.wfile.flush()
            at += step
        Pod.sent.append(body)
        self.wfile.write(b"0\r\n\r\n")


@pytest.fixture
def pod() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Pod)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    Pod.sent = []
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def hop_front(tmp_path: Path, pod: str, rate: float) -> tuple[list[str], int, int]:
    """The rendered front whose hop scores `rate` of the pod's completions: (nginx's argv, front port, hop port)."""
    routers = [ModelRouter(MODEL, "qwen3-6-27b", free_port(), free_port(), (f"http://{pod}",))]
    port, hop = free_port(), free_port()
    argv = write_front(tmp_path, routers, [], port=port, hop_port=hop, scored=[(pod, "rig-02/dual", MODEL)],
                       score_sample_rate=rate)
    return argv, port, hop


def scored_lines(tmp_path: Path, count: int, wait_s: float = 10) -> list[dict]:
    """The usage log's lines once it holds `count`, or after `wait_s` (nginx writes each at the request's end)."""
    log = tmp_path / Path(USAGE_LOG).name
    deadline = time.monotonic() + wait_s
    while True:
        lines = log.read_text().splitlines() if log.exists() else []
        if len(lines) >= count or time.monotonic() > deadline:
            return [json.loads(line) for line in lines]
        time.sleep(0.05)


def ask(pod: str, hop: int, case: str, stream: bool, path: str = "/v1/chat/completions") -> bytes:
    reply = requests.post(f"http://{pod}{path}", json={"model": MODEL, "case": case, "stream": stream},
                          proxies={"http": f"http://127.0.0.1:{hop}"}, timeout=30)
    return reply.content


def test_the_rules_as_the_gate_reads_them() -> None:
    """The corpus covers each of the hop's verdicts, by the gate's own rules (what the hop must agree with)."""
    verdicts = {case: expected(text) for case, text in CORPUS.items()}
    assert verdicts == {"garbage": "variety", "essay": "ok", "number": "ok", "loop": "repeats",
                        "loop-with-blank-lines": "repeats", "low-variety": "variety", "four-repeats": "ok",
                        "long-line-repeated": "variety", "unicode": "ok", "empty": None}
    assert degenerate(CORPUS["long-line-repeated"]).startswith("a line repeats")  # beyond the first 200 words


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_debians_njs_scores_each_completion_as_the_gate_does_and_keeps_no_text(tmp_path: Path, pod: str,
                                                                              stream: bool) -> None:
    argv, port, hop = hop_front(tmp_path, pod, rate=1.0)
    cases = [*CORPUS, "reasoning-garbage", "tool-call", "error", *([] if stream else ["huge-garbage"])]
    want = [{"scored": "rig-02/dual", "model": MODEL, "verdict": expected(generated(c))}
            for c in [*CORPUS, "reasoning-garbage"]]
    if not stream:
        want.append({"scored": "rig-02/dual", "model": MODEL, "verdict": "variety"})  # huge-garbage, from its start
    want.append({"scored": "rig-02/dual", "model": MODEL, "verdict": "variety"})  # /v1/completions
    with serving([*argv, "-g", FOREGROUND], port):
        got = [ask(pod, hop, case, stream) for case in cases]
        text = ask(pod, hop, "garbage", stream, path="/v1/completions")  # a text completion's `text`
        lines = scored_lines(tmp_path, len(want))  # nginx logs a request as it ends, which may be after its reply
    assert got == Pod.sent[:len(cases)]  # the client gets the pod's bytes as they were
    assert lines == want, text  # a tool call (no text) and an error are not scored
    log = (tmp_path / Path(USAGE_LOG).name).read_text()
    assert "attention" not in log.lower() and "!!" not in log and "logs" not in log  # verdicts only
    usage = Usage()
    assert all(usage.count(line) for line in log.splitlines())
    exposition = usage.exposition()
    labels = f'model="{MODEL}",pod="dual",rig="rig-02"'
    assert f"rigup_entrance_completions_scored_total{{{labels}}} {len(want)}" in exposition
    variety = sum(1 for w in want if w["verdict"] == "variety")
    assert f'rigup_entrance_completions_degenerate_total{{{labels},rule="variety"}} {variety}' in exposition
    assert f'rigup_entrance_completions_degenerate_total{{{labels},rule="repeats"}} 2' in exposition


def test_the_sample_rate_scores_about_its_share_and_zero_scores_none(tmp_path: Path, pod: str) -> None:
    """gateway_score_sample_rate 0.25: about a quarter of the completions are scored, drawn per request (the others
    pass without njs); 0: the hop has no scoring location at all."""
    argv, port, hop = hop_front(tmp_path, pod, rate=0.25)
    with serving([*argv, "-g", FOREGROUND], port):
        for _ in range(200):
            assert ask(pod, hop, "reasoning-garbage", False)
        lines = scored_lines(tmp_path, 200, wait_s=2)  # fewer come
    assert 25 <= len(lines) <= 75, len(lines)  # binomial(200, 0.25): mean 50, sd 6.1
    assert {line["verdict"] for line in lines} == {"variety"}
    off = tmp_path / "off"
    off.mkdir()
    argv, port, hop = hop_front(off, pod, rate=0.0)
    site = (off / "site.conf").read_text()
    assert "js_body_filter entrance.score" not in site and "split_clients" not in site
    with serving([*argv, "-g", FOREGROUND], port):
        assert ask(pod, hop, "reasoning-garbage", False)
    assert scored_lines(off, 1, wait_s=1) == []


def test_the_rate_as_split_clients_writes_it() -> None:
    assert [score_percent(r) for r in (0.0, 0.00001, 0.005, 0.05, 0.125, 1.0)] == [None, None, "0.5", "5", "12.5", "100"]
