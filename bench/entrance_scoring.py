"""What the entrance's scoring of completions costs per request (issue 43, docs/sentinel.md): Debian's nginx with its
njs module (the test bed's archive cache, as tests/support/nginx_front.py runs it) serves two rendered entrances side
by side, one whose hop scores every completion (gateway_score_sample_rate 1.0) and one that scores none (0), before
one stand-in pod on loopback. Requests go through each hop in turn (interleaved, so the shared machine's noise falls
on both), whole answers and streams; printed: each hop's nginx worker CPU per request (from /proc, the figure that
scales with traffic) and the client's median and 90th-percentile time per request.

    .venv/bin/python bench/entrance_scoring.py [--requests 300]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rigup.desired.entrance import ModelRouter  # noqa: E402
from tests.support.nginx_front import FOREGROUND, serving, write_front  # noqa: E402

MODEL = "bench-model"
# a healthy answer's shape: 300 words drawn from a vocabulary of 400 (variety over its first 200 about 0.6), one line
VOCABULARY = [f"w{chr(97 + i % 26)}{chr(97 + i // 26)}" for i in range(400)]
_DRAW = random.Random(0)
TEXT = " ".join(_DRAW.choice(VOCABULARY) + ("." if i % 13 == 12 else "") for i in range(300))
TOKENS = [w + " " for w in TEXT.split(" ")]  # a stream of 300 events, one word each


class Pod(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        return

    def do_POST(self) -> None:  # noqa: N802
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if request.get("stream"):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for token in TOKENS:
                event = b"data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": token}}]}).encode() + b"\n\n"
                self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
            done = b"data: [DONE]\n\n"
            self.wfile.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))
            return
        body = json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": TEXT},
                                        "finish_reason": "length"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def worker_cpu_s(master: int) -> float:
    """User + system CPU seconds of the nginx master's worker processes."""
    total = 0.0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == master:  # ppid
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=300, help="per hop and kind of answer")
    args = parser.parse_args()
    pod = ThreadingHTTPServer(("127.0.0.1", 0), Pod)
    threading.Thread(target=pod.serve_forever, daemon=True).start()
    address = f"127.0.0.1:{pod.server_address[1]}"
    with tempfile.TemporaryDirectory() as scored_dir, tempfile.TemporaryDirectory() as default_dir, \
            tempfile.TemporaryDirectory() as plain_dir:
        hops = {}
        for name, directory, rate in (("scored", scored_dir, 1.0), ("default", default_dir, 0.05),
                                      ("plain", plain_dir, 0.0)):
            router = ModelRouter(MODEL, "bench-model", free_port(), free_port(), (f"http://{address}",))
            port, hop = free_port(), free_port()
            argv = write_front(Path(directory), [router], [], port=port, hop_port=hop,
                               scored=[(address, "rig-1/dual", MODEL)], score_sample_rate=rate)
            hops[name] = (argv, port, hop, Path(directory))
        with serving([*hops["scored"][0], "-g", FOREGROUND], hops["scored"][1]) as scored_nginx, \
                serving([*hops["default"][0], "-g", FOREGROUND], hops["default"][1]) as default_nginx, \
                serving([*hops["plain"][0], "-g", FOREGROUND], hops["plain"][1]) as plain_nginx:
            masters = {"scored": scored_nginx.pid, "default": default_nginx.pid, "plain": plain_nginx.pid}
            sessions = {name: requests.Session() for name in hops}
            for name, session in sessions.items():
                session.proxies = {"http": f"http://127.0.0.1:{hops[name][2]}"}
            print(f"nginx with njs (Debian 12's), one worker per hop; answers of {len(TEXT.split())} words "
                  f"({len(TEXT)} characters), streams of {len(TOKENS)} events; {args.requests} requests per hop and kind")
            print("| answer | hop | nginx worker CPU per request | client median | client p90 |")
            print("|---|---|---|---|---|")
            for stream in (False, True):
                body = {"model": MODEL, "stream": stream}
                for session in sessions.values():  # warm: connections, njs' module
                    session.post(f"http://{address}/v1/chat/completions", json=body, timeout=30).content
                times: dict[str, list[float]] = {name: [] for name in hops}
                cpu_before = {name: worker_cpu_s(master) for name, master in masters.items()}
                for _ in range(args.requests):
                    for name, session in sessions.items():
                        start = time.perf_counter()
                        reply = session.post(f"http://{address}/v1/chat/completions", json=body, timeout=30)
                        assert reply.status_code == 200 and reply.content
                        times[name].append(time.perf_counter() - start)
                for name in hops:
                    cpu = (worker_cpu_s(masters[name]) - cpu_before[name]) / args.requests
                    ordered = sorted(times[name])
                    print(f"| {'stream' if stream else 'whole'} | {name} | {cpu * 1e3:.3f} ms | "
                          f"{statistics.median(ordered) * 1e3:.2f} ms | {ordered[int(0.9 * len(ordered))] * 1e3:.2f} ms |")
            time.sleep(0.5)
        for name in ("scored", "default"):
            log = hops[name][3] / "rigup-entrance-usage.log"
            verdicts = [json.loads(line)["verdict"] for line in log.read_text().splitlines()] if log.exists() else []
            print(f"{name} hop's verdicts: {len(verdicts)} lines, {sorted(set(verdicts))}")
    pod.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
