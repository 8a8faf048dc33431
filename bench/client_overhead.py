#!/usr/bin/env python3
"""How much of a measured TPS is rigup's own OpenAI client (rigup/client/openai_client.py)?

Runs rigup_testbed/openai_responder.py as a separate process and streams chat completions from it
through ApiClient.stream_chat, the path `rigup bench` measures with:

1. unlimited rate: the fastest stream the client can take in at all;
2. a high fixed rate (default 2000 tokens/s, ~15x the fastest upstream reference of 128 TPS): the
   decode TPS the client reports against the exact value the responder's schedule implies (the
   client's effect on a measured TPS), and the client thread's CPU per token (getrusage);
3. the client's own per-event code (SSE parsing + folding the JSON event into the result) timed on
   its own, without the socket.

Busy share at a TPS = CPU per token x TPS (the fraction of each inter-token gap the client works).
Exits 1 when the reported decode TPS is off by 1 % or more, or when the client's own per-event code
takes 1 % or more of the gap at the fastest reference TPS.

    .venv/bin/python bench/client_overhead.py [--rate 2000] [--tokens 2000] [--runs 5]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from rigup.client.openai_client import ApiClient, SSEParser, StreamResult, apply_stream_event  # noqa: E402

RESPONDER = REPO / "rigup_testbed" / "openai_responder.py"
MODEL = "overhead"
REFERENCE_TPS = (70.0, 128.0)  # upstream dual-3090 narrative / DFlash code single-stream figures
# One content event as vLLM sends it (pydantic's compact JSON).
EVENT = (
    b'data: {"id":"chatcmpl-0123456789abcdef0123456789abcdef","object":"chat.completion.chunk",'
    b'"created":1796014383,"model":"qwen3.6-27b-autoround","choices":[{"index":0,"delta":{"content":" word"},'
    b'"logprobs":null,"finish_reason":null}],"usage":null}\n\n'
)


def idle_wakeup_cost(rate: float, seconds: float = 1.0) -> float:
    """CPU seconds a Python thread that only sleeps 1/rate and wakes up pays per wake-up (the floor
    any client reading one chunk per token pays on this machine)."""
    user, system = thread_cpu()
    count = int(rate * seconds)
    for _ in range(count):
        time.sleep(1 / rate)
    user_after, system_after = thread_cpu()
    return (user_after - user + system_after - system) / count


def parse_cost(tokens: int, repeats: int = 20) -> float:
    """Seconds of the client's own code per event: SSE parsing and folding, streams of `tokens` events."""
    best = float("inf")
    for _ in range(repeats):
        parser, result, calls = SSEParser(), StreamResult(200, 0.0), {}
        started = time.perf_counter()
        for _ in range(tokens):
            for data in parser.feed(EVENT):
                apply_stream_event(result, calls, data, time.perf_counter())
        best = min(best, (time.perf_counter() - started) / tokens)
    return best


def start(*flags: str) -> tuple[subprocess.Popen[str], str]:
    process = subprocess.Popen(
        [sys.executable, str(RESPONDER), "--port", "0", "--model", MODEL, "--acceptance-length", "0", *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert process.stdout is not None
    line = process.stdout.readline()
    if not line.startswith("listening on "):
        process.kill()
        raise SystemExit(f"responder did not start: {line!r}")
    return process, line.split()[-1]


def thread_cpu() -> tuple[float, float]:
    """(user, system) CPU seconds of the calling thread."""
    usage = resource.getrusage(resource.RUSAGE_THREAD)
    return usage.ru_utime, usage.ru_stime


def runs(url: str, tokens: int, count: int) -> list[tuple[float, float, float, float, int]]:
    """(user CPU s, system CPU s, wall, TTFT, completion tokens) per streamed request, this thread only."""
    client = ApiClient(url)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Write a detailed essay about transformer attention."}],
        "max_tokens": tokens,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    client.stream_chat(body, 120)  # warm-up: connection, imports, caches
    out = []
    for _ in range(count):
        user, system = thread_cpu()
        result = client.stream_chat(body, 120)
        user_after, system_after = thread_cpu()
        if not result.ok or result.ttft is None or result.completion_tokens != tokens:
            raise SystemExit(f"bad run: {result.describe_failure()} tokens={result.completion_tokens}")
        out.append((user_after - user, system_after - system, result.elapsed, result.ttft, tokens))
    client.close()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=2000.0, help="high fixed token rate (tokens/s)")
    parser.add_argument("--tokens", type=int, default=2000, help="tokens per request")
    parser.add_argument("--runs", type=int, default=5, help="measured requests per phase")
    args = parser.parse_args()

    process, url = start()
    try:
        free = runs(url, args.tokens, args.runs)
    finally:
        process.terminate()
        process.wait()
    max_tps = statistics.median(tokens / wall for _, _, wall, _, tokens in free)

    process, url = start("--tokens-per-s", str(args.rate))
    try:
        fixed = runs(url, args.tokens, args.runs)
    finally:
        process.terminate()
        process.wait()
    user = statistics.median(u / n for u, _, _, _, n in fixed)
    system = statistics.median(s / n for _, s, _, _, n in fixed)
    expected = args.tokens / ((args.tokens - 1) / args.rate)  # first token at TTFT, then one per 1/rate
    decode = statistics.fmean(n / (wall - ttft) for _, _, wall, ttft, n in fixed)
    decode_error = abs(decode / expected - 1)

    own = parse_cost(args.tokens)
    print(f"fastest stream the client takes in  : {max_tps:,.0f} tokens/s (responder unthrottled, same machine)")
    print(f"decode TPS at {args.rate:.0f} tok/s           : measured {decode:.1f}, exact {expected:.1f}, "
          f"error {decode_error * 100:.3f} %")
    print(f"client's own code per event          : {own * 1e6:.1f} us (SSE parse + JSON event fold)")
    print(f"client thread CPU per token at {args.rate:.0f}: {user * 1e6:.1f} us user + {system * 1e6:.1f} us system "
          "(includes http.client/urllib3 reads and the wake-up per chunk)")
    print(f"idle thread's CPU per wake-up at {args.rate:.0f}: {idle_wakeup_cost(args.rate) * 1e6:.1f} us (the floor on this machine)")
    for tps in (*REFERENCE_TPS, args.rate):
        print(f"busy share of the gap at {tps:5.0f} TPS  : own code {own * tps * 100:.3f} %, "
              f"whole thread {(user + system) * tps * 100:.3f} %")
    # TTFT and the end are stamped when the bytes are read, so the client's work reaches a measured
    # TPS only as the error above (it would grow only if the thread were busy near 100 %).
    if decode_error >= 0.01 or own * max(REFERENCE_TPS) >= 0.01:
        print("FAIL: the client costs 1 % or more of the measured TPS")
        return 1
    print("OK: under 1 %")
    return 0


if __name__ == "__main__":
    sys.exit(main())
