#!/usr/bin/env python3
"""A local OpenAI-compatible chat server that answers on the wire the way vLLM does, for testing
rigup's verify, bench and status without a GPU.

    python3 openai_responder.py --port 8010 --model qwen3.6-27b-autoround [--max-model-len 32768]
                                [--api-key K] [--tokens-per-s 80 --ttft-ms 150] [--log-file vllm.log]

Protocol (as vLLM's OpenAI server implements it):
- GET /v1/models lists the one served model with its max_model_len; GET /health answers 200.
- POST /v1/chat/completions, non-streaming and SSE streaming (`data: {...}` events, `data: [DONE]`),
  with `stream_options.include_usage` (every chunk carries "usage": null, a final chunk with empty
  choices carries the usage), tool calls (message.tool_calls; streamed as an id+name delta followed by
  argument fragments), reasoning deltas (`reasoning` and/or `reasoning_content`) when
  chat_template_kwargs.enable_thinking is on (the default, as for Qwen3), HTTP 400 when the prompt
  (about chars/4 tokens) plus max_tokens does not fit --max-model-len, 401 without the API key, 404 for
  another model name.
- Timing: the first token is sent --ttft-ms after the request arrived, then one chunk per
  --tokens-per-chunk tokens at --tokens-per-s, each scheduled on the absolute clock (no drift), so a
  client's measurements can be checked against known numbers. 0 tokens/s means as fast as possible.
- Prefix cache (issue 44; vLLM's automatic prefix caching as standins/vllm_metrics.py keeps it: chained
  hashes of the prompt's full 16-token blocks, LRU eviction from a pool of --num-gpu-blocks-override
  blocks, vllm:prefix_cache_queries/hits in tokens): with --prefill-tokens-per-s the first token also waits
  for the prompt's uncached tokens at that rate, one prefill after another per engine, so a prompt whose
  prefix is cached starts sooner; --enable-prompt-tokens-details reports usage.prompt_tokens_details.cached_tokens.
- Failing modes: --fail-status (every chat request answers that status), --oom-above-tokens (500
  "CUDA out of memory" for longer prompts), --crash-above-tokens (the connection drops without an
  answer, mid-stream for a stream, as when the engine dies), --cascade (long answers degenerate into one repeated line),
  --inline-tool-calls (a tool call comes back as <tool_call> text in content), --no-reasoning (the
  reasoning parser is off), --eos-after (long answers stop early), --garbage (every answer is "!" until
  max_tokens, finish_reason=length: club-3090 issue #922's broken custom all-reduce).
- Logs: one access line and one "SpecDecoding metrics: ... Mean acceptance length: 3.40" line per
  request (vLLM's format) to --log-file, or stderr; --startup-log adds lines at start (patch markers).
- GET /metrics: vLLM's engine metrics in the Prometheus text format, unauthenticated as vLLM's (its API
  key guards /v1 only), kept by standins/vllm_metrics.py (shipped next to this file in the images) from
  the requests served: queued, scheduled (--max-num-seqs slots), first token, each chunk, finished.

The "model" is a handful of rules: a few facts (capital of France, 2+2), "What is A * B?" (+, -, * of two
integers) answered "A * B = C.", recall of "The <thing> is <value>." stated anywhere in the conversation
when asked "What is the <thing>?", a JSON object when asked for one with 'the keys "k" (the string "v")
and "n" (the number 3)', counting, haiku, a tool call when tools are offered and no tool result is in the
conversation yet, and otherwise varied filler prose until max_tokens. These rules answer rigup's health
gate probes (rigup/rig/servingctl.py PROBES) as a working model does: a test double of a healthy model. Tokens are pieces of that text (a word with its leading space, a punctuation mark, a newline).
Standard library only, so it runs with any python3.
"""

from __future__ import annotations

import argparse
import hashlib
import http
import http.server
import json
import math
import os
import random
import re
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterator


def _load_vllm_metrics() -> Any:
    """standins/vllm_metrics.py: beside this file in the images, under standins/ in the repository."""
    try:
        import vllm_metrics  # type: ignore[import-not-found]

        return vllm_metrics
    except ImportError:
        import importlib.util

        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "standins", "vllm_metrics.py")
        spec = importlib.util.spec_from_file_location("vllm_metrics", path)
        if spec is None or spec.loader is None or not os.path.isfile(path):
            return None
        module = importlib.util.module_from_spec(spec)
        sys.modules.setdefault("vllm_metrics", module)
        spec.loader.exec_module(module)
        return module


vllm_metrics = _load_vllm_metrics()

CHARS_PER_TOKEN = 4
# Chat-template overhead per message (role markers, separators), in characters.
TEMPLATE_CHARS_PER_MESSAGE = 16

VOCABULARY = (
    "ability able about above accept account across action active actual adapt addition address advance "
    "advice affect after again against agent agree ahead allow almost alone along already also alter always "
    "amount analysis ancient angle animal answer appear apply approach area argue around arrive article "
    "aspect assume attach attempt attend attention author avoid balance basic beauty become before begin "
    "behind believe benefit better between beyond binary border borrow bottom bounded branch bridge brief "
    "bright bring broad budget build burden cache calm capture careful carry case catch cause center "
    "certain chain change channel chapter charge choice circle claim clear climb close cluster coarse "
    "collect column combine comfort common compare complex compute concept concern condition connect "
    "consider constant context control convert copy corner correct cost count couple course cover create "
    "credit critical current curve custom cycle damage data debate decade decide decode deep default "
    "define degree delay deliver demand dense depend depth derive design detail detect develop device "
    "differ digital direct discover display distance divide domain double draft dream drive during dynamic "
    "early effect effort element embed emerge enable encode energy engine enough ensure entire entry "
    "equal error escape estimate evening event exact example exchange exist expand expect explain export "
    "express extend factor fairly famous feature field figure filter final finger finish firm focus follow "
    "force forest formal forward frame fresh friend front future gather general gentle gesture global "
    "gradual graph great ground group growth guard guide habit handle happen harbor heavy height hidden "
    "history hollow honest horizon human idea ignore image impact improve include index inform input "
    "inside instance intent interval island itself journey judge kernel key kind label language large "
    "later layer lead learn level light limit linear listen little local logic long loop machine maintain "
    "major manage manner margin market matrix matter measure memory method middle minor mirror model "
    "moment motion narrow native nature nearby network neutral noble normal notice number object observe "
    "obvious offer office often open operate option order origin output owner packet parallel partial "
    "pattern pause people period person phase phrase picture piece place plain planet point policy "
    "portion position possible power practice precise prefer prepare present pressure prime prior "
    "process produce project proper protect provide public purpose quality quarter query question quiet "
    "random range rapid rather reach reason recall record reduce region regular relate release remain "
    "remote repeat report request require reserve resolve result return review river route sample scale "
    "scene scope search season second section select sense sequence series serve shadow shape share shift "
    "signal silent simple single sketch slight smooth social solid source space sparse special speed "
    "spread stable stage standard state steady step stone store story stream strong structure subject "
    "supply surface symbol system table target task teacher tensor theory thread through token topic "
    "toward trace track travel trend trust typical unique unit update useful valley value vector version "
    "vessel view visible voice volume wander weight whole wide window winter wonder worker yellow"
).split()

FACTS = {
    "capital of france": "The capital of France is Paris.",
    "capital of germany": "The capital of Germany is Berlin.",
    "capital of japan": "The capital of Japan is Tokyo.",
    "capital of italy": "The capital of Italy is Rome.",
    "2+2": "2 + 2 = 4.",
    "2 + 2": "2 + 2 = 4.",
}
CASCADE_LINE = "The attention layer repeats the attention layer."
CASCADE_AFTER_TOKENS = 40
OOM_MESSAGE = (
    "CUDA out of memory. Tried to allocate 138.00 MiB. GPU 0 has a total capacity of 23.56 GiB of which "
    "120.50 MiB is free."
)
ARITHMETIC = re.compile(r"\bwhat is (-?\d+)\s*([-+*])\s*(-?\d+)\s*\?", re.IGNORECASE)
JSON_ASKED = re.compile(r"\bJSON object with the keys\b", re.IGNORECASE)
JSON_FIELD = re.compile(r'"(\w+)" \(the (string|number) (?:"([^"]*)"|(-?\d+))\)')
GARBAGE_TOKEN = "!"  # club-3090 #922: "!!!!" for 60 of 60 tokens, finish_reason=length
PIECE = re.compile(r"\s*[A-Za-z0-9_'\-]+|\s*[^\sA-Za-z0-9_'\-]|\s+")


@dataclass
class Config:
    model: str
    max_model_len: int = 32768
    api_key: str | None = None
    tokens_per_s: float = 0.0
    ttft_ms: float = 0.0
    tokens_per_chunk: int = 1
    reasoning_field: str = "reasoning"
    reasoning_tokens: int = 120
    thinking_default: bool = True
    eos_after: int | None = None
    fail_status: int | None = None
    oom_above_tokens: int | None = None
    crash_above_tokens: int | None = None
    cascade: bool = False
    garbage: bool = False
    # a replica drifting from its replicas (issue 43's consensus fault): each text answer gains a closing
    # word, still right by every probe's judge, so only the replicas' answer hashes tell it apart
    diverge: bool = False
    inline_tool_calls: bool = False
    no_reasoning: bool = False
    log_file: str | None = None
    acceptance_length: float | None = 3.40
    num_speculative_tokens: int = 3
    startup_log: list[str] = field(default_factory=list)
    max_num_seqs: int | None = None  # the engine's batch slots (vLLM's --max-num-seqs); None: its default
    # the prefix cache's cost model (issue 44): uncached prompt tokens prefilled at this rate, one prefill
    # at a time per engine (prefill is compute-bound); 0: prefill costs no time
    prefill_tokens_per_s: float = 0.0
    num_gpu_blocks_override: int | None = None  # the KV pool, so the prefix cache's size, in 16-token blocks
    enable_prompt_tokens_details: bool = False  # vLLM's flag: usage.prompt_tokens_details.cached_tokens


class HttpError(Exception):
    def __init__(self, status: int, body: dict[str, Any]) -> None:
        super().__init__(status)
        self.status = status
        self.body = body


def openai_error(status: int, kind: str, message: str) -> HttpError:
    return HttpError(status, {"error": {"message": message, "type": kind, "param": None, "code": status}})


# --------------------------------------------------------------------------------------------
# the "model"


def pieces(text: str) -> list[str]:
    """Split text into tokens: words with their leading space, punctuation marks, newlines."""
    return PIECE.findall(text)


def message_text(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    text = content if isinstance(content, str) else ""
    for call in message.get("tool_calls") or ():
        function = call.get("function") or {}
        text += f"{function.get('name', '')}{function.get('arguments', '')}"
    return text


def prompt_tokens(request: dict[str, Any]) -> int:
    return math.ceil(len(prompt_text(request)) / CHARS_PER_TOKEN)


def prompt_text(request: dict[str, Any]) -> str:
    """The prompt as the chat template would lay it out (a marker per message, the tools after), whose
    length makes the prompt's tokens and whose prefixes the prefix cache keys on."""
    marker = "\0" * (TEMPLATE_CHARS_PER_MESSAGE - 1)  # and the role's initial: the template's share
    text = "".join(f"{marker}{str(m.get('role', ''))[:1] or '?'}{message_text(m)}" for m in request["messages"])
    if request.get("tools"):
        text += json.dumps(request["tools"])
    return text


class Prose:
    """Varied filler prose, deterministic for a given seed."""

    def __init__(self, seed: str) -> None:
        self.rng = random.Random(hashlib.sha256(seed.encode()).digest())

    def tokens(self) -> Iterator[str]:
        sentences = 0
        while True:
            length = self.rng.randint(8, 18)
            words = [self.rng.choice(VOCABULARY) for _ in range(length)]
            words[0] = words[0].capitalize()
            if sentences:
                yield " "
            for i, word in enumerate(words):
                yield word if i == 0 else f" {word}"
                if i == length // 2 and self.rng.random() < 0.3:
                    yield ","
            yield "."
            sentences += 1
            if sentences % self.rng.randint(4, 6) == 0:
                yield "\n\n"
                sentences = 0


def cascade(tokens: Iterator[str]) -> Iterator[str]:
    """What a broken kernel does to long outputs: fluent for a while, then one line over and over."""
    for _, token in zip(range(CASCADE_AFTER_TOKENS), tokens):
        yield token
    line = ["\n", *pieces(CASCADE_LINE)]
    while True:
        yield from line


@dataclass
class Plan:
    reasoning: list[str]
    content: list[str]
    tool_calls: list[dict[str, Any]]  # [{"id", "name", "arguments"}]
    finish_reason: str

    @property
    def completion_tokens(self) -> int:
        return len(self.reasoning) + len(self.content) + sum(tool_call_tokens(c) for c in self.tool_calls)


def tool_call_tokens(call: dict[str, Any]) -> int:
    return 1 + len(argument_fragments(call["arguments"]))


def argument_fragments(arguments: str) -> list[str]:
    return [arguments[i : i + CHARS_PER_TOKEN] for i in range(0, len(arguments), CHARS_PER_TOKEN)]


def thinking_enabled(request: dict[str, Any], config: Config) -> bool:
    if config.no_reasoning:
        return False
    kwargs = request.get("chat_template_kwargs") or {}
    return bool(kwargs.get("enable_thinking", config.thinking_default))


def chosen_tool(request: dict[str, Any]) -> dict[str, Any] | None:
    tools = [t for t in request.get("tools") or () if t.get("type") == "function" and t.get("function")]
    choice = request.get("tool_choice", "auto")
    if not tools or choice == "none":
        return None
    messages = request["messages"]
    if any(m.get("role") == "tool" for m in messages) or messages[-1].get("role") != "user":
        return None  # the model has its tool result and answers in prose
    if isinstance(choice, dict):
        wanted = (choice.get("function") or {}).get("name")
        return next((t for t in tools if t["function"]["name"] == wanted), None)
    # Pick the tool whose name and description share most words with the request.
    words = set(re.findall(r"[a-z]+", message_text(messages[-1]).lower()))

    def overlap(tool: dict[str, Any]) -> int:
        function = tool["function"]
        text = f"{function['name'].replace('_', ' ')} {function.get('description', '')}".lower()
        return len(words & set(re.findall(r"[a-z]+", text)))

    return max(tools, key=overlap)


def tool_arguments(tool: dict[str, Any], user_text: str) -> dict[str, Any]:
    """Arguments for a tool's required parameters, filled from the request where it names them."""
    schema = tool["function"].get("parameters") or {}
    properties = schema.get("properties") or {}
    capitalised = re.findall(r"\b(?:in|for|of|at)\s+([A-Z][a-z]+)", user_text) or re.findall(
        r"\b([A-Z][a-z]{2,})\b", user_text[1:]
    )
    arguments: dict[str, Any] = {}
    for name in schema.get("required") or list(properties)[:1]:
        spec = properties.get(name) or {}
        if "enum" in spec:
            mentioned = [v for v in spec["enum"] if str(v).lower() in user_text.lower()]
            arguments[name] = (mentioned or spec["enum"])[0]
        elif spec.get("type") in ("integer", "number"):
            arguments[name] = 1
        elif spec.get("type") == "boolean":
            arguments[name] = False
        elif spec.get("type") == "array":
            arguments[name] = []
        else:
            arguments[name] = capitalised[-1] if capitalised else "example"
    return arguments


def answer(request: dict[str, Any], config: Config, seed: str) -> Iterator[str]:
    """The content tokens the model would produce (possibly endless: the caller caps them)."""
    messages = request["messages"]
    question = message_text(messages[-1])
    lowered = question.lower()
    if messages[-1].get("role") == "user" and not any(m.get("role") == "tool" for m in messages):
        for key, fact in FACTS.items():
            if key in lowered:
                return iter(pieces(fact))
        asked = re.search(r"what is the ([\w\s-]{1,60}?)\?", question, re.IGNORECASE)
        if asked:
            thing = re.escape(asked.group(1).strip())
            everything = "\n".join(message_text(m) for m in messages)
            stated = re.search(rf"\bthe {thing} is[:\s]+[\"']?([^.\n\"']+)", everything, re.IGNORECASE)
            if stated:
                return iter(pieces(f"The {asked.group(1).strip()} is {stated.group(1).strip()}."))
        arithmetic = ARITHMETIC.search(question)
        if arithmetic:
            a, op, b = int(arithmetic.group(1)), arithmetic.group(2), int(arithmetic.group(3))
            result = a + b if op == "+" else a - b if op == "-" else a * b
            return iter(pieces(f"{a} {op} {b} = {result}."))
        if JSON_ASKED.search(question):
            fields = {key: (text if kind == "string" else int(number))
                      for key, kind, text, number in JSON_FIELD.findall(question)}
            return iter(pieces(json.dumps(fields)))
        counting = re.search(r"count from (\d+) to (\d+)", lowered)
        if counting:
            first, last = int(counting.group(1)), int(counting.group(2))
            numbers = [str(n) for n in range(first, last + 1)]
            return iter(pieces(", ".join(numbers) + "."))
        if "haiku" in lowered:
            prose = Prose(seed).rng
            lines = [" ".join(prose.choice(VOCABULARY) for _ in range(n)) for n in (3, 5, 3)]
            return iter(pieces("\n".join(line.capitalize() for line in lines)))
    tokens = Prose(seed).tokens()
    if config.eos_after is not None:
        tokens = (t for _, t in zip(range(config.eos_after), tokens))
    return cascade(tokens) if config.cascade else tokens


DRIFT_WORDS = " Indeed."  # what a drifting replica adds to every text answer (Config.diverge)


def diverged(tokens: Iterator[str]) -> Iterator[str]:
    """The answer as a drifting replica gives it: the same tokens, then DRIFT_WORDS."""
    yield from tokens
    yield from pieces(DRIFT_WORDS)


def plan(request: dict[str, Any], config: Config, budget: int) -> Plan:
    if config.garbage:
        # The engine still runs and decodes at its usual pace; the logits are wrong (a broken all-reduce),
        # so every position is the same punctuation token until the budget ends: no thinking, no tool call.
        return Plan([], [GARBAGE_TOKEN] * budget, [], "length")
    seed = json.dumps([request["messages"], request.get("seed")], sort_keys=True)
    reasoning: list[str] = []
    if thinking_enabled(request, config):
        thoughts = Prose("reasoning" + seed).tokens()
        opening = pieces("Okay, let me think about what is being asked here.")
        reasoning = (opening + [t for _, t in zip(range(config.reasoning_tokens), thoughts)])[:budget]
        if len(reasoning) >= budget:
            return Plan(reasoning, [], [], "length")
    budget -= len(reasoning)

    tool = chosen_tool(request)
    if tool is not None:
        arguments = json.dumps(tool_arguments(tool, message_text(request["messages"][-1])))
        name = tool["function"]["name"]
        if config.inline_tool_calls:
            # What a missing or wrong --tool-call-parser looks like: the template's text, unparsed.
            text = pieces(f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>')
            return Plan(reasoning, text[:budget], [], "length" if len(text) > budget else "stop")
        call = {"id": f"chatcmpl-tool-{uuid.uuid4().hex[:24]}", "name": name, "arguments": arguments}
        if tool_call_tokens(call) <= budget:
            return Plan(reasoning, [], [call], "tool_calls")

    content: list[str] = []
    tokens = diverged(answer(request, config, seed)) if config.diverge else answer(request, config, seed)
    for token in tokens:
        if len(content) == budget:
            return Plan(reasoning, content, [], "length")
        content.append(token)
    return Plan(reasoning, content, [], "stop")


# --------------------------------------------------------------------------------------------
# HTTP


def default_metrics(config: Config) -> Any:
    """The engine stats a standalone responder keeps (None when standins/vllm_metrics.py is missing)."""
    if vllm_metrics is None:
        return None
    return vllm_metrics.EngineStats(
        config.model, config.max_model_len, max_num_seqs=config.max_num_seqs or vllm_metrics.default_max_num_seqs(None),
        num_speculative_tokens=config.num_speculative_tokens if config.acceptance_length else None,
        num_gpu_blocks_override=config.num_gpu_blocks_override, chars_per_token=CHARS_PER_TOKEN)


class _NoRequest:
    """A request without engine stats (no vllm_metrics module): the same calls, nothing kept."""

    def __init__(self) -> None:
        self.arrival = time.monotonic()
        self.hit_tokens = 0  # no prefix cache without the engine's stats

    def __enter__(self) -> _NoRequest:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def wait_scheduled(self) -> float:
        return self.arrival

    def emit(self, n: int = 1) -> None:
        pass

    def finish(self, reason: str) -> None:
        pass


class Responder(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    # the listen backlog of uvicorn (--backlog, default 2048), which vLLM's API server runs on; socketserver's 5
    # drops the SYNs of clients that connect at once (64 streams), which then wait a second and retry
    request_queue_size = 2048

    def __init__(self, address: tuple[str, int], config: Config, metrics: Any = None) -> None:
        super().__init__(address, Handler)
        self.config = config
        self.created = int(time.time())
        self.log_lock = threading.Lock()
        self.prefill_lock = threading.Lock()
        self.prefill_free_at = 0.0  # time.perf_counter() when the engine's prefill lane is next free
        # vllm_metrics.EngineStats: what /metrics serves (None: no /metrics)
        self.metrics = metrics if metrics is not None else default_metrics(config)
        for line in config.startup_log:
            self.log(line)

    def prefill_done(self, ready: float, uncached_tokens: int) -> float:
        """When (time.perf_counter()) a scheduled request's prefill ends: its uncached prompt tokens at
        --prefill-tokens-per-s, after the prefills scheduled before it (one engine computes one prefill
        after another at its rate); `ready` when it was scheduled. No rate: at once."""
        rate = self.config.prefill_tokens_per_s
        if rate <= 0:
            return ready
        with self.prefill_lock:
            self.prefill_free_at = max(ready, self.prefill_free_at) + uncached_tokens / rate
            return self.prefill_free_at

    def log(self, line: str) -> None:
        with self.log_lock:
            if self.config.log_file:
                with open(self.config.log_file, "a", encoding="utf-8") as handle:
                    handle.write(line + "\n")
            else:
                sys.stderr.write(line + "\n")
                sys.stderr.flush()

    def vllm_log(self, source: str, message: str) -> None:
        """A line in vLLM's format: (APIServer pid=N) INFO MM-DD HH:MM:SS [source] message."""
        self.log(f"(APIServer pid={os.getpid()}) INFO {time.strftime('%m-%d %H:%M:%S')} [{source}] {message}")

    def spec_decoding(self, tokens: int) -> tuple[int, int, int] | None:
        """(drafts, drafted tokens, accepted tokens) of a request that generated `tokens` with the
        configured mean acceptance length; None without speculative decoding."""
        al = self.config.acceptance_length
        if al is None or tokens == 0:
            return None
        steps = max(1, round(tokens / al))
        drafted = steps * self.config.num_speculative_tokens
        return steps, drafted, min(drafted, max(0, tokens - steps))

    def log_spec_decoding(self, tokens: int, seconds: float) -> None:
        """vLLM's SpecDecoding log line for one request, and the same counts in the engine's metrics."""
        counts = self.spec_decoding(tokens)
        if counts is None:
            return
        steps, drafted, accepted = counts
        if self.metrics is not None:
            self.metrics.record_spec_decoding(steps, drafted, accepted)
        al = float(self.config.acceptance_length or 0)
        k = self.config.num_speculative_tokens
        seconds = max(seconds, 1e-3)
        per_position = ", ".join(f"{max(0.0, min(1.0, (al - 1) / k * (1.2 - 0.2 * i))):.3f}" for i in range(k))
        self.vllm_log(
            "metrics.py:96",
            f"SpecDecoding metrics: Mean acceptance length: {al:.2f}, "
            f"Accepted throughput: {accepted / seconds:.2f} tokens/s, Drafted throughput: {drafted / seconds:.2f} "
            f"tokens/s, Accepted: {accepted} tokens, Drafted: {drafted} tokens, Per-position acceptance rate: "
            f"{per_position}, Avg Draft acceptance rate: {100 * accepted / drafted:.1f}%"
        )


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Responder

    def setup(self) -> None:
        super().setup()
        # One small write per token: Nagle's algorithm would hold them back and distort the timings.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - BaseHTTPRequestHandler's name
        pass  # access lines go through Responder.log after each request

    # --- plumbing

    def send_json(self, status: int, body: Any) -> None:
        data = json.dumps(body, separators=(",", ":")).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def access(self, status: int) -> None:
        host, port = self.client_address[:2]
        phrase = http.HTTPStatus(status).phrase
        self.server.log(
            f'(APIServer pid={os.getpid()}) INFO:     {host}:{port} - "{self.command} {self.path} HTTP/1.1" '
            f"{status} {phrase}"
        )

    def authorised(self) -> bool:
        key = self.server.config.api_key
        return key is None or self.headers.get("Authorization") == f"Bearer {key}"

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if self.path == "/health":
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if self.path.split("?")[0] == "/metrics" and self.server.metrics is not None:
            # vLLM's API key guards /v1 only (its AuthenticationMiddleware): a scraper needs none
            body = self.server.metrics.render().encode()
            self.send_response(200)
            self.send_header("Content-Type", vllm_metrics.CONTENT_TYPE)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        if not self.authorised():
            self.send_json(401, {"error": "Unauthorized"})
            return
        if self.path == "/v1/models":
            config = self.server.config
            self.send_json(
                200,
                {
                    "object": "list",
                    "data": [
                        {
                            "id": config.model,
                            "object": "model",
                            "created": self.server.created,
                            "owned_by": "vllm",
                            "root": f"/root/.cache/huggingface/{config.model}",
                            "parent": None,
                            "max_model_len": config.max_model_len,
                        }
                    ],
                },
            )
            self.access(200)
            return
        self.send_json(404, {"detail": "Not Found"})

    def do_POST(self) -> None:  # noqa: N802
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length)
        arrived = time.perf_counter()
        arrived_monotonic = time.monotonic()
        if self.path != "/v1/chat/completions":
            self.send_json(404, {"detail": "Not Found"})
            return
        if not self.authorised():
            self.send_json(401, {"error": "Unauthorized"})
            return
        try:
            request = self.validated(raw)
            config = self.server.config
            if config.fail_status is not None:
                raise openai_error(config.fail_status, "InternalServerError", "EngineCore encountered an issue.")
            prompt = prompt_tokens(request)
            max_tokens = request.get("max_completion_tokens") or request.get("max_tokens")
            if prompt >= config.max_model_len:
                raise openai_error(
                    400,
                    "BadRequestError",
                    f"This model's maximum context length is {config.max_model_len} tokens. However, your "
                    f"request has {prompt} input tokens. Please reduce the length of the input messages.",
                )
            if max_tokens is not None and prompt + max_tokens > config.max_model_len:
                raise openai_error(
                    400,
                    "BadRequestError",
                    f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's maximum "
                    f"context length is {config.max_model_len} tokens and your request has {prompt} input "
                    f"tokens ({max_tokens} > {config.max_model_len} - {prompt}).",
                )
            if config.oom_above_tokens is not None and prompt > config.oom_above_tokens:
                raise openai_error(500, "InternalServerError", OOM_MESSAGE)
        except HttpError as error:
            self.send_json(error.status, error.body)
            self.access(error.status)
            return
        budget = max_tokens if max_tokens is not None else config.max_model_len - prompt
        result = plan(request, config, budget)
        crash = config.crash_above_tokens is not None and prompt > config.crash_above_tokens
        # the engine's view of the request: queued now, run when the scheduler has room; leaving the
        # block unfinished (a client gone, the engine dead) aborts it
        engine = self.server.metrics
        with (engine.add_request(prompt, prompt_text(request), max_tokens, arrived_monotonic) if engine is not None
              else _NoRequest()) as req:
            # the answer is paced from when the engine scheduled the request: a queue delays it
            start = arrived + (req.wait_scheduled() - req.arrival)
            start = self.server.prefill_done(start, prompt - req.hit_tokens)
            try:
                if crash:
                    self.crash(request)
                    return
                if request.get("stream"):
                    self.stream(request, result, prompt, start, req)
                else:
                    self.complete(request, result, prompt, start, req)
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True
                return
        self.access(200)
        self.server.log_spec_decoding(result.completion_tokens, time.perf_counter() - arrived)

    def crash(self, request: dict[str, Any]) -> None:
        """What a dying engine does to its clients: a stream stops after a few chunks, a plain
        request gets no answer at all; the connection is closed either way."""
        self.server.vllm_log("core.py:1", "EngineCore encountered a fatal error (simulated crash).")
        if request.get("stream"):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream; charset=utf-8")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            event = b'data: {"choices":[{"index":0,"delta":{"content":"The"},"finish_reason":null}]}\n\n'
            self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
        self.close_connection = True
        self.connection.shutdown(socket.SHUT_RDWR)

    def validated(self, raw: bytes) -> dict[str, Any]:
        try:
            request = json.loads(raw)
        except ValueError:
            raise openai_error(400, "BadRequestError", "request body is not valid JSON") from None
        if not isinstance(request, dict) or not isinstance(request.get("messages"), list) or not request["messages"]:
            raise openai_error(400, "BadRequestError", "'messages' must be a non-empty list")
        if request.get("model") not in (None, self.server.config.model):
            raise openai_error(404, "NotFoundError", f"The model `{request.get('model')}` does not exist.")
        for name in ("max_tokens", "max_completion_tokens"):
            value = request.get(name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise openai_error(400, "BadRequestError", f"{name} must be at least 1, got {value!r}.")
        return request

    def wait_until(self, moment: float) -> None:
        delay = moment - time.perf_counter()
        if delay > 0:
            time.sleep(delay)

    def schedule(self, arrived: float, index: int) -> float:
        """When the chunk that ends with token `index` (0-based) is due."""
        config = self.server.config
        start = arrived + config.ttft_ms / 1000
        if config.tokens_per_s <= 0:
            return start
        return start + (index // config.tokens_per_chunk) * config.tokens_per_chunk / config.tokens_per_s

    def usage(self, prompt: int, result: Plan, req: Any) -> dict[str, Any]:
        completion = result.completion_tokens
        details = None
        if self.server.config.enable_prompt_tokens_details:
            # vLLM with --enable-prompt-tokens-details: the prompt tokens its prefix cache supplied
            details = {"cached_tokens": req.hit_tokens}
        return {
            "prompt_tokens": prompt,
            "total_tokens": prompt + completion,
            "completion_tokens": completion,
            "prompt_tokens_details": details,
        }

    def reasoning_fields(self, text: str | None) -> dict[str, Any]:
        which = self.server.config.reasoning_field
        names = ("reasoning", "reasoning_content") if which == "both" else (which,)
        return {name: text for name in names}

    def generate(self, req: Any, arrived: float, first: int, count: int) -> None:
        """Wait until the chunk of `count` tokens from token `first` is due, then hand it to the engine's
        stats as one engine step."""
        self.wait_until(self.schedule(arrived, first + count - 1))
        req.emit(count)

    @staticmethod
    def finished(req: Any, result: Plan) -> None:
        """The engine's stats count the request finished before its last bytes leave, as vLLM's output
        processor records it before the API server sends the final chunk: a client that scrapes /metrics
        right after its answer sees it counted. A tool call ends on the model's stop token."""
        req.finish("length" if result.finish_reason == "length" else "stop")

    def complete(self, request: dict[str, Any], result: Plan, prompt: int, arrived: float, req: Any) -> None:
        per_chunk = self.server.config.tokens_per_chunk
        for first in range(0, result.completion_tokens, per_chunk):
            self.generate(req, arrived, first, min(per_chunk, result.completion_tokens - first))
        self.finished(req, result)
        message: dict[str, Any] = {
            "role": "assistant",
            "content": "".join(result.content) if result.content or not result.tool_calls else None,
            **self.reasoning_fields("".join(result.reasoning) if result.reasoning else None),
            "tool_calls": [
                {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                for c in result.tool_calls
            ],
        }
        self.send_json(
            200,
            {
                "id": f"chatcmpl-{uuid.uuid4().hex}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": self.server.config.model,
                "choices": [
                    {
                        "index": 0,
                        "message": message,
                        "logprobs": None,
                        "finish_reason": result.finish_reason,
                        "stop_reason": None,
                    }
                ],
                "usage": self.usage(prompt, result, req),
                "prompt_logprobs": None,
            },
        )

    def stream(self, request: dict[str, Any], result: Plan, prompt: int, arrived: float, req: Any) -> None:
        include_usage = bool((request.get("stream_options") or {}).get("include_usage"))
        ident = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        model = self.server.config.model
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        def send(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None, final: bool = False) -> None:
            chunk: dict[str, Any] = {
                "id": ident,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": choices,
            }
            if include_usage:
                chunk["usage"] = usage
            event = b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"
            self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))

        def delta(payload: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
            return {"index": 0, "delta": payload, "logprobs": None, "finish_reason": finish}

        send([delta({"role": "assistant", "content": ""})])
        # (kind, text or call, index-in-call) per token, sent in chunks of tokens_per_chunk.
        tokens: list[tuple[str, Any]] = [("reasoning", t) for t in result.reasoning]
        tokens += [("content", t) for t in result.content]
        for number, call in enumerate(result.tool_calls):
            tokens.append(("tool_name", (number, call)))
            tokens += [("tool_args", (number, fragment)) for fragment in argument_fragments(call["arguments"])]
        per_chunk = self.server.config.tokens_per_chunk
        for start in range(0, len(tokens), per_chunk):
            group = tokens[start : start + per_chunk]
            self.generate(req, arrived, start, len(group))
            payload: dict[str, Any] = {}
            for kind, value in group:
                if kind == "reasoning":
                    for name in self.reasoning_fields(None):
                        payload[name] = payload.get(name, "") + value
                elif kind == "content":
                    payload["content"] = payload.get("content", "") + value
                elif kind == "tool_name":
                    number, call = value
                    payload.setdefault("tool_calls", []).append(
                        {
                            "id": call["id"],
                            "type": "function",
                            "index": number,
                            "function": {"name": call["name"], "arguments": ""},
                        }
                    )
                else:
                    number, fragment = value
                    calls = payload.setdefault("tool_calls", [])
                    if calls and calls[-1]["index"] == number:
                        calls[-1]["function"]["arguments"] += fragment
                    else:
                        calls.append({"index": number, "function": {"arguments": fragment}})
            send([delta(payload)])
        self.finished(req, result)
        send([delta({"content": ""}, result.finish_reason)])
        if include_usage:
            send([], self.usage(prompt, result, req))
        done = b"data: [DONE]\n\n"
        self.wfile.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))


def parse_args(argv: list[str] | None = None) -> tuple[Config, str, int]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, required=True, help="port; 0 picks a free one (printed)")
    parser.add_argument("--model", required=True, help="served model name")
    parser.add_argument("--max-model-len", type=int, default=32768, help="context window in tokens")
    parser.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/*")
    parser.add_argument("--api-key-file", help="read the API key from this file (keeps it off the command line)")
    parser.add_argument("--tokens-per-s", type=float, default=0.0, help="decode rate per stream; 0: unlimited")
    parser.add_argument("--ttft-ms", type=float, default=0.0, help="delay before the first token (prefill)")
    parser.add_argument("--tokens-per-chunk", type=int, default=1, help="tokens per SSE chunk (spec decode)")
    parser.add_argument(
        "--reasoning-field", choices=("reasoning", "reasoning_content", "both"), default="reasoning",
        help="field reasoning text is returned in (newer vLLM: reasoning; older: reasoning_content)",
    )
    parser.add_argument("--reasoning-tokens", type=int, default=120, help="length of the thinking part")
    parser.add_argument("--thinking-default", choices=("on", "off"), default="on",
                        help="thinking when chat_template_kwargs.enable_thinking is absent")
    parser.add_argument("--eos-after", type=int, help="long answers stop after this many tokens")
    parser.add_argument("--fail-status", type=int, help="answer every chat request with this HTTP status")
    parser.add_argument("--oom-above-tokens", type=int, help="500 CUDA OOM for prompts longer than this")
    parser.add_argument("--crash-above-tokens", type=int,
                        help="drop the connection without an answer for prompts longer than this")
    parser.add_argument("--cascade", action="store_true", help="long answers degenerate into a repeated line")
    parser.add_argument("--garbage", action="store_true",
                        help='every answer is "!" until max_tokens (club-3090 #922: a broken custom all-reduce)')
    parser.add_argument("--inline-tool-calls", action="store_true", help="tool calls come back as text")
    parser.add_argument("--no-reasoning", action="store_true", help="never return reasoning")
    parser.add_argument("--log-file", help="append log lines here instead of stderr")
    parser.add_argument("--acceptance-length", type=float, default=3.40,
                        help="mean acceptance length in the per-request SpecDecoding line; 0: no line")
    parser.add_argument("--startup-log", action="append", default=[], help="log line written at start")
    parser.add_argument("--max-num-seqs", type=int, help="requests the engine runs at once (more wait); vLLM's default 256")
    parser.add_argument("--prefill-tokens-per-s", type=float, default=0.0,
                        help="prefill rate: the first token waits for the prompt's uncached tokens at this rate, "
                             "one prefill after another per engine; 0: prefill is free")
    parser.add_argument("--num-gpu-blocks-override", type=int,
                        help="KV-cache blocks of 16 tokens (vLLM's flag): the prefix cache's size, least recently "
                             "used blocks evicted; default max_model_len x max_num_seqs tokens")
    parser.add_argument("--enable-prompt-tokens-details", action="store_true",
                        help="usage carries prompt_tokens_details.cached_tokens (vLLM's flag)")
    args = parser.parse_args(argv)
    api_key = args.api_key
    if args.api_key_file:
        with open(args.api_key_file, encoding="utf-8") as handle:
            api_key = handle.read().strip()
    config = Config(
        model=args.model,
        max_model_len=args.max_model_len,
        api_key=api_key,
        tokens_per_s=args.tokens_per_s,
        ttft_ms=args.ttft_ms,
        tokens_per_chunk=max(1, args.tokens_per_chunk),
        reasoning_field=args.reasoning_field,
        reasoning_tokens=args.reasoning_tokens,
        thinking_default=args.thinking_default == "on",
        eos_after=args.eos_after,
        fail_status=args.fail_status,
        oom_above_tokens=args.oom_above_tokens,
        crash_above_tokens=args.crash_above_tokens,
        cascade=args.cascade,
        garbage=args.garbage,
        inline_tool_calls=args.inline_tool_calls,
        no_reasoning=args.no_reasoning,
        log_file=args.log_file,
        acceptance_length=args.acceptance_length or None,
        startup_log=args.startup_log,
        max_num_seqs=args.max_num_seqs,
        prefill_tokens_per_s=args.prefill_tokens_per_s,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
    )
    return config, args.host, args.port


def main(argv: list[str] | None = None) -> int:
    config, host, port = parse_args(argv)
    server = Responder((host, port), config)
    host, port = server.server_address[:2]
    server.vllm_log("launcher.py:37", f"Starting vLLM API server 0 on http://{host}:{port}")
    print(f"listening on http://{host}:{port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
