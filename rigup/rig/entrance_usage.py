#!/usr/bin/python3
"""rigup-entrance-usage: requests and tokens per client of the fleet's entrance, for Prometheus (issue 44).

Nothing in the entrance counts per client: nginx's stub_status has no split, njs 0.7.9 (Debian 12's
libnginx-mod-http-js) has no shared dictionary (js_shared_dict_zone came with njs 0.8.0), vllm-router 0.1.17
labels its request counters by route and method only, and vLLM counts tokens per pod. So nginx logs one JSON line
per request of a client to a model path (log_format rigup_usage: the client's name, the model, the status, and
the prompt and completion tokens njs read from the response's `usage`), and this counts that log:

    rigup_gateway_client_requests_total{client, model, code}
    rigup_gateway_client_prompt_tokens_total{client, model}
    rigup_gateway_client_completion_tokens_total{client, model}
    rigup_gateway_client_unmetered_requests_total{client, model}   (answered 2xx with no usage in the response)

and, from the lines of the completions the entrance's hop scored (a sample, gateway_score_sample_rate: the pod as
rig/pod, its model, the verdict of club-3090's verify-full rules, entrance.js's score; issue 43):

    rigup_entrance_completions_scored_total{rig, pod, model}
    rigup_entrance_completions_degenerate_total{rig, pod, model, rule}   (rule: variety or repeats)

served on 127.0.0.1:PORT/metrics (the entrance's /metrics/ joins it). It follows the log from its end when it
starts and across logrotate's rename or truncation, keeps nothing on disk (counters start at 0 when it starts:
Prometheus' rate() and increase() take the reset) and sees no key and no text. Run by rigup-entrance-usage.service
with the machine's python3, standard library only.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
from collections.abc import Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, BinaryIO

POLL_S = 0.25  # how often the log is read for new lines
COUNTERS = (
    ("rigup_gateway_client_requests_total", "Requests of each client to a model path of the entrance, by status code"),
    ("rigup_gateway_client_prompt_tokens_total", "Prompt tokens of each client's requests, from the responses' usage"),
    ("rigup_gateway_client_completion_tokens_total", "Completion tokens of each client's requests, from the responses' usage"),
    ("rigup_gateway_client_unmetered_requests_total",
     "Requests answered 2xx whose response carried no usage (a stream without stream_options.include_usage)"),
    ("rigup_entrance_completions_scored_total",
     "Sampled completions of each pod the entrance scored by club-3090's verify-full rules (no text kept)"),
    ("rigup_entrance_completions_degenerate_total",
     "Of those, the degenerate ones: lexical variety under 0.30 over the first 200 words, or a line 5 times in a row"),
)
VERDICTS = ("ok", "variety", "repeats")  # entrance.js's score: what nginx logs of a scored completion


class Usage:
    """The counters, by their labels; fed one log line at a time."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: dict[str, dict[tuple[tuple[str, str], ...], int]] = {name: {} for name, _ in COUNTERS}

    def _add(self, name: str, labels: tuple[tuple[str, str], ...], value: int) -> None:
        series = self.counts[name]
        series[labels] = series.get(labels, 0) + value

    def count(self, line: bytes | str) -> bool:
        """Count one line of the usage log; False for a line that is not one (skipped)."""
        try:
            entry = json.loads(line)
        except ValueError:
            return False
        if isinstance(entry, dict) and "scored" in entry:
            return self._scored(entry)
        if not isinstance(entry, dict) or not isinstance(entry.get("client"), str) or not entry["client"]:
            return False
        client, model, code = entry["client"], str(entry.get("model") or ""), str(entry.get("status") or "")
        prompt, completion = _tokens(entry.get("prompt_tokens")), _tokens(entry.get("completion_tokens"))
        who = (("client", client), ("model", model))
        with self.lock:
            self._add("rigup_gateway_client_requests_total", (*who, ("code", code)), 1)
            if prompt is None:
                if code.startswith("2"):
                    self._add("rigup_gateway_client_unmetered_requests_total", who, 1)
            else:
                self._add("rigup_gateway_client_prompt_tokens_total", who, prompt)
                self._add("rigup_gateway_client_completion_tokens_total", who, completion or 0)
        return True

    def _scored(self, entry: dict[str, Any]) -> bool:
        rig, _, pod = str(entry["scored"]).partition("/")
        verdict = entry.get("verdict")
        if not rig or not pod or verdict not in VERDICTS:
            return False  # a pod the hop had no name for (not a routed pod's host:port), or no verdict
        who = (("model", str(entry.get("model") or "")), ("pod", pod), ("rig", rig))
        with self.lock:
            self._add("rigup_entrance_completions_scored_total", who, 1)
            if verdict != "ok":
                self._add("rigup_entrance_completions_degenerate_total", (*who, ("rule", verdict)), 1)
        return True

    def exposition(self) -> str:
        """Prometheus' text format: every counter's HELP and TYPE, then its series (none before a request)."""
        out: list[str] = []
        with self.lock:
            for name, help_text in COUNTERS:
                out += [f"# HELP {name} {help_text}", f"# TYPE {name} counter"]
                for labels, value in sorted(self.counts[name].items()):
                    out.append(f"{name}{{{','.join(f'{k}={_quoted(v)}' for k, v in labels)}}} {value}")
        return "\n".join(out) + "\n"


def _tokens(value: Any) -> int | None:
    """A token count nginx logged ("" when njs found no usage in the response)."""
    if isinstance(value, int) and value >= 0:
        return value
    if isinstance(value, str) and value.isdigit():
        return int(value)
    return None


def _quoted(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"') + '"'


class Follower:
    """The lines appended to a file, across its rotation (renamed and made anew) or truncation."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.handle: BinaryIO | None = None
        self.inode: int | None = None
        self.partial = b""
        self._open(at_end=True)  # what was logged before it started is not counted again

    def _open(self, at_end: bool) -> None:
        try:
            handle = open(self.path, "rb")  # noqa: SIM115 - held open to follow the file
        except FileNotFoundError:
            return
        if at_end:
            handle.seek(0, os.SEEK_END)
        self.handle, self.inode, self.partial = handle, os.fstat(handle.fileno()).st_ino, b""

    def _drain(self) -> list[bytes]:
        assert self.handle is not None
        data = self.handle.read()
        if not data:
            return []
        *lines, self.partial = (self.partial + data).split(b"\n")
        return lines

    def lines(self) -> list[bytes]:
        """The complete lines written since the last call."""
        if self.handle is None:
            self._open(at_end=False)  # made after this started: every line of it is new
            if self.handle is None:
                return []
        out = self._drain()
        try:
            now = os.stat(self.path)
        except FileNotFoundError:
            return out  # renamed away, the new one not made yet: nginx still writes the old one until it reopens
        if now.st_ino != self.inode:
            out += self._drain()  # the old file's last lines, then the new file from its start
            self.handle.close()
            self.handle = None
            self._open(at_end=False)
            if self.handle is not None:
                out += self._drain()
        elif now.st_size < self.handle.tell():  # truncated (copytruncate)
            self.handle.seek(0)
            self.partial = b""
            out += self._drain()
        return out


def follow(follower: Follower, usage: Usage, stop: threading.Event, poll_s: float = POLL_S) -> None:
    while not stop.is_set():
        for line in follower.lines():
            usage.count(line)
        stop.wait(poll_s)


def serve(usage: Usage, host: str, port: int) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path.split("?", 1)[0] != "/metrics":
                self.send_error(404)
                return
            body = usage.exposition().encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Iterable[Any]) -> None:  # noqa: A002 - quiet: one scrape each 15 s
            return

    return ThreadingHTTPServer((host, port), Handler)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rigup-entrance-usage", description=__doc__.split("\n\n")[0])
    parser.add_argument("--log", required=True, help="nginx's usage log (log_format rigup_usage)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    usage, stop = Usage(), threading.Event()
    server = serve(usage, args.host, args.port)
    threading.Thread(target=follow, args=(Follower(args.log), usage, stop), daemon=True).start()
    try:
        server.serve_forever(poll_interval=1.0)
    finally:
        stop.set()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
