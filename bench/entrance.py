#!/usr/bin/env python3
"""The fleet's entrance, measured side by side against issue 44's done-when, in one run.

    .venv/bin/python bench/entrance.py [--pods 4] [--concurrency 1,8,64] [--seconds 8] [--sessions 32 --turns 10]
                                       [--litellm] [--parts abc] [--results bench/results.md]
                                       [--wheels DIR --machine NAME --commit SHA]  (a machine with no network)

Loopback only; about 6 minutes on the 2-core control VM. Stand-in vLLM pods (rigup_testbed/openai_responder.py:
SSE one token per chunk with vLLM's `stream_options.include_usage` final chunk, vLLM's `/metrics`) behind:

- direct: stream i to pod i mod N;
- nginx+vllm-router cache_aware: the front below over a cache_aware router, what parts a and b measured before
  the first-token probe of issue 44 (cache_aware cost the first token ~3-4 ms at one stream, consistent_hash ~0.5);
- vllm-router: vllm-router 0.1.17 (the vLLM project's Rust router, PyPI `vllm-router`, hash-pinned in
  files/router/requirements.txt) with the entrance's policy, consistent_hash (rigup.desired.entrance.router_args;
  a fresh X-Session-ID per request, as the front sets one from $request_id) over the N pods, its Prometheus exporter on `--prometheus-port` (launcher
  flags read from vllm_router/router_args.py of that wheel);
- nginx+router: the same router behind nginx 1.22.1 (Debian 12's package, `apt-get download` and unpacked once
  per machine into the test bed's cache, not installed) as a TLS front: a throwaway openssl CA, a bearer key per
  client checked through a `map` in a 0600 include file (no key on a command line or in nginx.conf), a path
  allowlist (/v1/chat/completions, /v1/completions, /v1/models; else 404, a missing or wrong key 401, both
  checked before timing), `proxy_buffering off`;
- nginx+vllm-router via pod-key hop: the entrance as it is deployed since 9fd785a: another router and front
  like the row above, the router's HTTP_PROXY (rigup.desired.entrance.router_proxy_environment) naming a loopback
  server of the same nginx that sends each pod its own key (rigup.desired.entrance.pod_key_text, the site
  template's hop server) over the same pods; checked before timing: a router through the hop reaches a keyed
  stand-in it holds no key for, the keyed pod refuses a request without its key, and the hop answers 502 for a
  host:port it does not route to. The timed pods themselves check no key (every row uses the same pods);
- with --litellm also LiteLLM's proxy as rigup's old gateway configures it (rigup.desired.litellm_config), from the
  pinned files/gateway/requirements.txt through the test bed's wheel index.

The three parts, each on fresh pods, every process in its own process group, stopped (SIGTERM, then SIGKILL)
when its part ends, on failure too:

(a) At a real rig's pace: every pod decodes at 68.5 tokens/s per stream, the reference variant's single-stream
    figure (club-3090@4a29ab57 BENCHMARKS.md, `dual/autoround-int4/fp8-mtp.yml`, 2x RTX 3090 at 230 W, v0.25.1
    first-party re-run: decode 68.50 narrative); 1, 8 and 64 streams, each sending one streamed chat completion
    after another for --seconds and finishing the one it is in: total completion tokens/s (each stream's usage
    chunk), time to the first SSE event (median, p95) and what the path adds to direct's, the entrance's CPU%
    (user+system of its process groups; 100 % = one core) and RSS, its metrics endpoint's slowest answer.
(b) The ceiling: the same at --ceiling-streams (8) against unpaced pods.
(c) Agent trace (TraceShape): 32 sessions x 10 turns, each turn waiting for its answer, the context growing by
    a tool result and the answer per turn; every session opens with the same harness prompt and its own task.
    The pods model vLLM's prefix cache (the stand-in's --num-gpu-blocks-override, --prefill-tokens-per-s,
    --enable-prompt-tokens-details): a pool of the reference's KV budget (its compose's header at 4a29ab57:
    "KV pool 2.36x" of 262,144 tokens), prefill at 1,446 tokens/s (the same BENCHMARKS.md row, PP @10K), tokens
    and pool at 1/20 of a real agent's so a run takes minutes. Each routing policy on fresh pods with the same
    trace: vllm-router consistent_hash (the session's name in X-Session-ID, the header its docs name first),
    cache_aware, random, round_robin; twice, all sessions at once with no tool time and agents that run a tool
    between turns and start a little apart. Per turn the first content token's time and usage's
    prompt_tokens_details.cached_tokens; per pod the requests it served (vllm:request_success_total).
    Reported: the share of turns that found every full block of their session's previous prompt cached, mean
    TTFT and how many times lower it is than random's and round_robin's, requests per pod and the busiest over
    the mean.

cache_aware's rule, from vllm_router/router_args.py of the pinned wheel (vllm_router-0.1.17-cp38-abi3-
manylinux_2_28_x86_64.whl, sha256 85c96bea...42694d): "Load balancing is triggered when (max_load - min_load) >
abs_threshold AND max_load > min_load * rel_threshold. Otherwise, use cache aware". The figures go into the
"Entrance" section of bench/results.md as a "### Measured" block of this machine (bench_artifacts.write_results)
with issue 44's targets judged from them.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import fcntl
import hashlib
import http.client
import itertools
import json
import math
import os
import platform
import re
import secrets
import signal
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_artifacts import write_results  # noqa: E402 - path set above

from rigup_testbed.image import cache_dir  # noqa: E402 - path set above

SECTION = "## Entrance: direct vs LiteLLM vs vllm-router vs nginx+vllm-router (bench/entrance.py)"
RESPONDER = REPO_ROOT / "rigup_testbed" / "openai_responder.py"
GATEWAY_REQUIREMENTS = REPO_ROOT / "files" / "gateway" / "requirements.txt"
ROUTER_REQUIREMENTS = REPO_ROOT / "files" / "router" / "requirements.txt"
CACHE = REPO_ROOT / ".cache" / "entrance"
PYPI_CACHE = Path("/var/tmp/rigup-testbed/cache/pypi")  # the test bed's wheel indexes (rigup_testbed.pypi)
NGINX_CACHE = cache_dir() / "entrance-nginx"  # Debian's nginx, unpacked once per machine
NGINX_PACKAGES = ("nginx", "nginx-common")  # Debian 12's archive; unpacked, not installed
MODEL = "qwen3.6-27b-autoround"
ALLOWED_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/models")
KEY_PATTERN = re.compile(r"[A-Za-z0-9_-]{16,128}")  # what secrets.token_urlsafe makes; nothing nginx would parse
CLIENT_NAME = re.compile(r"[a-z][a-z0-9-]{0,31}")


# --- figures (pure) -----------------------------------------------------------------------------------

def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile (0-100) by linear interpolation between the closest ranks (numpy's default)."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass
class Window:
    """What the streams of one path at one concurrency did in the measured window."""

    seconds: float
    tokens: int
    ttfts: list[float]
    failures: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def ttft_median(self) -> float:
        return statistics.median(self.ttfts)

    @property
    def ttft_p95(self) -> float:
        return percentile(self.ttfts, 95)


def added(path: Window, direct: Window) -> tuple[float, float]:
    """Seconds the path adds to direct's first token: (median, p95)."""
    return path.ttft_median - direct.ttft_median, path.ttft_p95 - direct.ttft_p95


def cpu_percent(cpu_seconds: float, wall_seconds: float) -> float:
    """CPU seconds over a wall window as a percentage of one core."""
    return 100.0 * cpu_seconds / wall_seconds if wall_seconds > 0 else 0.0


def max_over_mean(counts: Sequence[float]) -> float:
    """The busiest pod's load over the mean (1.00: even; a router that piles sessions on one pod shows it)."""
    mean = sum(counts) / len(counts)
    return max(counts) / mean if mean else 0.0


def counter_sum(metrics_text: str, name: str) -> float:
    """A Prometheus counter from a /metrics page, summed over its label sets (engines, finish reasons)."""
    total = 0.0
    for line in metrics_text.splitlines():
        if line.startswith((name + "{", name + " ")):
            total += float(line.rsplit(" ", 1)[1])
    return total


# --- the agent trace (pure) ---------------------------------------------------------------------------

CHARS_PER_TOKEN = 4  # the stand-in's tokens (rigup_testbed/openai_responder.py CHARS_PER_TOKEN)
BLOCK_TOKENS = 16  # vLLM's default KV block (CacheConfig.DEFAULT_BLOCK_SIZE), the prefix cache's unit


@dataclass(frozen=True)
class TraceShape:
    """A synthetic multi-turn agent workload: every session starts from the harness's shared prompt and its
    own task, then each turn adds a tool result and the model's answer, so the context grows turn by turn."""

    sessions: int = 32
    turns: int = 10
    shared_tokens: int = 500  # the harness's system prompt and tools, the same for every session
    task_tokens: int = 100  # the session's own task
    turn_tokens: int = 150  # a tool result per turn
    answer_tokens: int = 16  # max_tokens of each turn's answer
    tool_seconds: float = 0.0  # the agent runs its tool this long between an answer and its next turn
    stagger_seconds: float = 0.0  # session i starts i times this late (0: every session at once)

    @property
    def label(self) -> str:
        if not self.tool_seconds and not self.stagger_seconds:
            return "all at once, no tool time"
        return f"tools take {self.tool_seconds:g} s, sessions start {self.stagger_seconds:g} s apart"


def filler(tokens: int, seed: str) -> str:
    """`tokens` tokens of text at the stand-in's 4 characters a token, different for every seed."""
    words = []
    state = hashlib.sha256(seed.encode()).hexdigest()
    while len(words) * 8 < tokens * CHARS_PER_TOKEN:
        state = hashlib.sha256(state.encode()).hexdigest()
        words.append(state[:7] + " ")
    return "".join(words)[: tokens * CHARS_PER_TOKEN]


def agent_trace(shape: TraceShape) -> dict[str, tuple[list[dict[str, str]], list[str]]]:
    """Per session: its opening messages (the shared system prompt, the session's task) and the tool result
    each turn appends; the same trace for every routing policy compared."""
    shared = filler(shape.shared_tokens, "harness")
    return {f"session-{s:02d}": (
        [{"role": "system", "content": shared}, {"role": "user", "content": filler(shape.task_tokens, f"task {s}")}],
        [filler(shape.turn_tokens, f"tool {s} {t}") for t in range(shape.turns)])
        for s in range(shape.sessions)}


def prefix_hit(cached_tokens: int, previous_prompt_tokens: int) -> bool:
    """A turn hit its prefix when the pod had every full block of the session's previous prompt cached."""
    return cached_tokens >= previous_prompt_tokens // BLOCK_TOKENS * BLOCK_TOKENS


def pool_blocks(kv_tokens: int, scale: float) -> int:
    """vLLM's --num-gpu-blocks-override for a KV pool of `kv_tokens` scaled down by `scale` (the pool keeps
    one null block besides the usable ones)."""
    return math.ceil(kv_tokens / scale / BLOCK_TOKENS) + 1


@dataclass
class Turn:
    session: str
    index: int
    ttft: float
    prompt_tokens: int
    cached_tokens: int


@dataclass
class TraceResult:
    """What one routing policy made of the trace."""

    turns: list[Turn]
    loads: list[float]  # requests each pod served
    seconds: float
    failures: int = 0

    @property
    def hits(self) -> tuple[int, int]:
        """(turns after a session's first that hit their prefix, such turns)."""
        by_session: dict[str, list[Turn]] = {}
        for turn in sorted(self.turns, key=lambda t: (t.session, t.index)):
            by_session.setdefault(turn.session, []).append(turn)
        hit = total = 0
        for turns in by_session.values():
            for previous, current in zip(turns, turns[1:]):
                total += 1
                hit += prefix_hit(current.cached_tokens, previous.prompt_tokens)
        return hit, total

    @property
    def hit_share(self) -> float:
        hit, total = self.hits
        return hit / total if total else 0.0

    @property
    def ttft_mean(self) -> float:
        return statistics.fmean(t.ttft for t in self.turns)

    @property
    def cached_share(self) -> float:
        """Prompt tokens found cached over prompt tokens sent."""
        return sum(t.cached_tokens for t in self.turns) / max(1, sum(t.prompt_tokens for t in self.turns))


def ttft_ratio(baseline: TraceResult, routed: TraceResult) -> float:
    """How many times lower the routed policy's mean first-token time is than the baseline's."""
    return baseline.ttft_mean / routed.ttft_mean if routed.ttft_mean else 0.0


# --- nginx front (pure rendering) ---------------------------------------------------------------------

def key_map_text(clients: Mapping[str, str]) -> str:
    """nginx's map from the Authorization header to the client's name ("" for anything else). It holds the
    keys: written 0600 and included, never in nginx.conf or on a command line."""
    lines = ["map $http_authorization $entrance_client {", '    default "";']
    for name, key in sorted(clients.items()):
        if not CLIENT_NAME.fullmatch(name):
            raise ValueError(f"client name {name!r}: lowercase letters, digits and '-', starting with a letter")
        if not KEY_PATTERN.fullmatch(key):
            raise ValueError(f"client {name}: a key is 16-128 of A-Z a-z 0-9 _ - (secrets.token_urlsafe)")
        lines.append(f'    "Bearer {key}" {name};')
    lines.append("}")
    return "\n".join(lines) + "\n"


def hop_text(hop_port: int, pod_key: Path, pod_ports: Sequence[int]) -> str:
    """The entrance's pod-key hop as templates/rigup-entrance.nginx.conf.j2 renders it (since 9fd785a): a loopback
    server the routers reach their pods through (their HTTP_PROXY), which passes a request on to the pod its Host
    names with that pod's key from the 0600 map; 502 for a host:port it does not route to."""
    names = [(f"rigup_pod_{i}", f"127.0.0.1:{port}") for i, port in enumerate(pod_ports)]
    routes = "".join(f'        "{address}" {name};\n' for name, address in names)
    upstreams = "".join(f"    upstream {name} {{\n        server {address};\n        keepalive 16;\n    }}\n"
                        for name, address in names)
    return f"""    include {pod_key};
    map $http_host $entrance_pod_upstream {{
        default rigup_pod_none;
{routes}    }}
{upstreams}    upstream rigup_pod_none {{
        server 127.0.0.1:1;
    }}
    server {{
        listen 127.0.0.1:{hop_port};
        client_max_body_size 64m;
        location / {{
            proxy_pass http://$entrance_pod_upstream;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header Host $http_host;
            proxy_set_header Authorization $entrance_pod_authorization;
            proxy_buffering off;
            proxy_request_buffering off;
            proxy_read_timeout 1800s;
        }}
    }}
"""


def nginx_conf(*, prefix: Path, listen_port: int, upstream_port: int, cert: Path, key: Path, key_map: Path,
               hop: str = "") -> str:
    """The TLS front: keys checked through the map, the allowlist, streaming unbuffered to the router; `hop`
    (hop_text) adds the pod-key hop to the same nginx, as the entrance runs it."""
    allow = "|".join(re.escape(p[len("/v1/"):]) for p in ALLOWED_PATHS)
    return f"""# Rendered by bench/entrance.py (issue 44): a TLS front for vllm-router.
worker_processes auto;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    # a map key (the scheme and a 43-character key) is longer than the default bucket (64) holds
    map_hash_bucket_size 128;
    client_body_temp_path {prefix}/tmp/body;
    proxy_temp_path {prefix}/tmp/proxy;
    fastcgi_temp_path {prefix}/tmp/fastcgi;
    uwsgi_temp_path {prefix}/tmp/uwsgi;
    scgi_temp_path {prefix}/tmp/scgi;
    include {key_map};
    map $http_x_session_id $entrance_session {{
        "" $request_id;
        default $http_x_session_id;
    }}
    upstream router {{
        server 127.0.0.1:{upstream_port};
        keepalive 64;
    }}
    server {{
        listen 127.0.0.1:{listen_port} ssl;
        ssl_certificate {cert};
        ssl_certificate_key {key};
        ssl_protocols TLSv1.2 TLSv1.3;
        location ~ ^/v1/({allow})$ {{
            if ($entrance_client = "") {{
                return 401;
            }}
            proxy_pass http://router;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            # the client's key stops here: the router and the pods never see it
            proxy_set_header Authorization "";
            proxy_set_header X-Entrance-Client $entrance_client;
            # as the entrance's template: consistent_hash reads the session header, a request without one its own id
            proxy_set_header X-Session-ID $entrance_session;
            proxy_buffering off;
            proxy_read_timeout 600s;
        }}
        location / {{
            return 404;
        }}
    }}
{hop}}}
"""


def write_private(path: Path, text: str) -> None:
    """A file only its owner reads, created so (never world-readable, not even for a moment)."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        handle.write(text)
    os.chmod(path, 0o600)


# --- processes ----------------------------------------------------------------------------------------

class Processes:
    """Everything the bench starts, each in its own process group, stopped on exit whatever happened."""

    def __init__(self, grace_s: float = 10.0) -> None:
        self.started: list[subprocess.Popen[bytes]] = []
        self.grace_s = grace_s  # SIGTERM, then SIGKILL after this long

    def start(self, argv: Sequence[str], *, log: Path, env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
        with open(log, "ab") as out:
            process = subprocess.Popen(list(argv), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       start_new_session=True, env=dict(env) if env is not None else None)
        self.started.append(process)
        return process

    def stop(self, process: subprocess.Popen[bytes]) -> None:
        """Stop one process group now (SIGTERM, then SIGKILL after the grace)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=self.grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        self.started.remove(process)

    def stop_all(self) -> None:
        for process in reversed(self.started):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        for process in reversed(self.started):
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        self.started.clear()

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()


def group_usage(pgid: int) -> tuple[float, int]:
    """(CPU seconds, RSS bytes) of every live process in a process group."""
    tick, page = os.sysconf("SC_CLK_TCK"), os.sysconf("SC_PAGE_SIZE")
    cpu, rss = 0.0, 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[2]) != pgid:  # fields after the name: state, ppid, pgrp, ...
            continue
        cpu += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        rss += int(fields[21]) * page
    return cpu, rss


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float, *, headers: Mapping[str, str] | None = None,
              context: ssl.SSLContext | None = None, process: subprocess.Popen[bytes] | None = None,
              log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"{url}: the process exited ({process.returncode}); its log: {log}")
        try:
            request = urllib.request.Request(url, headers=dict(headers or {}))
            with urllib.request.urlopen(request, timeout=2, context=context) as response:
                if response.status == 200:
                    return
        except Exception as error:  # noqa: BLE001 - not up yet, whatever the reason
            last = error
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer 200 within {timeout:.0f} s (last: {last}); log: {log}")


# --- venvs and nginx ----------------------------------------------------------------------------------

def sha12(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:12]


def venv(name: str, requirements: Path, pip_args: Sequence[str]) -> Path:
    """A venv named by its requirements' hash under .cache/entrance, built once (pip --require-hashes)."""
    target = CACHE / f"venv-{name}-{sha12(requirements)}"
    if (target / "bin" / "python").exists():
        return target
    building = target.with_name(target.name + ".build")
    subprocess.run(["rm", "-rf", str(building)], check=True)
    subprocess.run([sys.executable, "-m", "venv", str(building)], check=True)
    log = CACHE / f"pip-{name}.log"
    with open(log, "wb") as out:
        done = subprocess.run([str(building / "bin" / "python"), "-m", "pip", "install", "-q", "--require-hashes",
                               *pip_args], stdout=out, stderr=subprocess.STDOUT)
    if done.returncode:
        raise RuntimeError(f"{name} venv: pip failed; its output: {log}")
    building.rename(target)  # entry scripts keep the build path; the bench runs `python -m` only
    return target


def litellm_venv() -> Path:
    """LiteLLM from the test bed's wheel index for the pinned file (rigup_testbed.pypi), as the bed's gateway."""
    from rigup_testbed.pypi import build_index

    served = build_index(GATEWAY_REQUIREMENTS, PYPI_CACHE)
    return venv("litellm", GATEWAY_REQUIREMENTS,
                ["--no-deps", "--no-index", "--find-links", str(served / "packages"), "-r", str(served / "requirements.txt")])


WHEELS: Path | None = None  # --wheels: the router's pinned wheels in a folder (a machine with no network)


def router_venv() -> Path:
    """vllm-router's venv from the hash-pinned requirements: from the index pip's config names, or with --wheels
    from that folder alone (the hashes are checked either way)."""
    local = ["--no-index", "--find-links", str(WHEELS)] if WHEELS is not None else []
    return venv("router", ROUTER_REQUIREMENTS, [*local, "-r", str(ROUTER_REQUIREMENTS)])


def nginx_binary() -> tuple[Path, str]:
    """Debian's nginx binary, unpacked from the archive's packages (apt checks their signatures) into the test
    bed's machine-wide cache, once per machine: a fresh clone (the CI's) finds it there; a lock keeps two
    unpacks (the bench, a test worker) apart."""
    root = NGINX_CACHE / "root"
    binary = root / "usr" / "sbin" / "nginx"
    NGINX_CACHE.mkdir(parents=True, exist_ok=True)
    with open(NGINX_CACHE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not binary.exists():
            debs = NGINX_CACHE / "debs"
            debs.mkdir(exist_ok=True)
            subprocess.run(["apt-get", "download", *NGINX_PACKAGES], cwd=debs, check=True, capture_output=True)
            unpacking = NGINX_CACHE / "root.partial"
            subprocess.run(["rm", "-rf", str(unpacking)], check=True)
            for deb in sorted(debs.glob("*.deb")):
                subprocess.run(["dpkg-deb", "-x", str(deb), str(unpacking)], check=True)
            unpacking.rename(root)  # whole or not at all: an interrupted unpack is redone
    versions = sorted(p.name for p in (NGINX_CACHE / "debs").glob("nginx_*.deb"))
    return binary, versions[-1].split("_")[1] if versions else "unknown"


def make_tls(directory: Path) -> tuple[Path, Path, Path]:
    """A throwaway CA and a server certificate for 127.0.0.1 signed by it (openssl); keys 0600."""
    ca_key, ca_cert = directory / "ca.key", directory / "ca.crt"
    key, csr, cert = directory / "front.key", directory / "front.csr", directory / "front.crt"
    old = os.umask(0o077)
    try:
        run = lambda *a: subprocess.run(["openssl", *a], check=True, capture_output=True)  # noqa: E731
        run("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "2",
            "-subj", "/CN=rigup bench entrance CA", "-keyout", str(ca_key), "-out", str(ca_cert))
        run("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-subj", "/CN=127.0.0.1", "-keyout", str(key), "-out", str(csr))
        ext = directory / "san.ext"
        ext.write_text("subjectAltName=IP:127.0.0.1\n")
        run("x509", "-req", "-in", str(csr), "-CA", str(ca_cert), "-CAkey", str(ca_key), "-CAcreateserial",
            "-days", "2", "-extfile", str(ext), "-out", str(cert))
    finally:
        os.umask(old)
    return ca_cert, cert, key


# --- client -------------------------------------------------------------------------------------------

@dataclass
class Target:
    name: str
    ports: list[int]  # stream i uses ports[i % len]
    key: str | None = None
    tls: ssl.SSLContext | None = None
    metrics: tuple[str, dict[str, str]] | None = None  # the entrance's metrics URL and headers
    pgids: list[int] = field(default_factory=list)  # the entrance's process groups (CPU, RSS)
    session_ids: bool = False  # a fresh X-Session-ID per request, as the entrance's front sets one (router alone)

    def connection(self, stream: int) -> http.client.HTTPConnection:
        port = self.ports[stream % len(self.ports)]
        if self.tls is not None:
            return http.client.HTTPSConnection("127.0.0.1", port, timeout=60, context=self.tls)
        return http.client.HTTPConnection("127.0.0.1", port, timeout=60)

    def headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.key:
            headers["Authorization"] = f"Bearer {self.key}"
        if self.session_ids:
            headers["X-Session-ID"] = secrets.token_hex(8)
        return headers


USAGE = re.compile(rb'"completion_tokens":\s*(\d+)')


def stream_once(conn: http.client.HTTPConnection, headers: Mapping[str, str], body: bytes) -> tuple[float, int]:
    """One streamed chat completion: (seconds to the first SSE event, completion tokens from the usage chunk)."""
    started = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body=body, headers=dict(headers))
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {response.read()[:200]!r}")
    first = None
    tail = b""
    while True:
        chunk = response.read1(65536)
        if not chunk:
            break
        if first is None and b"data:" in chunk:
            first = time.perf_counter() - started
        tail = (tail + chunk)[-4096:]
    found = USAGE.findall(tail)
    if first is None or not found:
        raise RuntimeError("stream ended without events or usage")
    return first, int(found[-1])


def chat_body(messages: list[dict[str, str]], max_tokens: int, stream: bool = True) -> bytes:
    return json.dumps({"model": MODEL, "messages": messages, "max_tokens": max_tokens, "stream": stream,
                       "stream_options": {"include_usage": True}, "temperature": 0,
                       "chat_template_kwargs": {"enable_thinking": False}}).encode()


def load(target: Target, streams: int, seconds: float, max_tokens: int) -> tuple[Window, float | None, float, int]:
    """`streams` clients streaming back to back for `seconds`, each finishing the request it is in when the
    time is up (the window ends when the last one does, so no stream is cut short): the window, the slowest
    metrics scrape, and the entrance's CPU seconds and RSS."""
    body = chat_body([{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}], max_tokens)
    stop = threading.Event()
    ttfts: list[float] = []
    tokens = [0]
    failures = [0]
    lock = threading.Lock()

    def client(index: int) -> None:
        conn = target.connection(index)
        while not stop.is_set():
            headers = target.headers()
            try:
                ttft, count = stream_once(conn, headers, body)
            except Exception:  # noqa: BLE001 - counted; a new connection for the next request
                with lock:
                    failures[0] += 1
                conn.close()
                conn = target.connection(index)
                continue
            with lock:  # a request running when the window closes is finished and counted: the window ends with it
                ttfts.append(ttft)
                tokens[0] += count
        conn.close()

    scrapes: list[float] = []

    def scraper() -> None:
        if target.metrics is None:
            return
        url, headers = target.metrics
        while not stop.wait(1.0):
            started = time.perf_counter()
            try:
                with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as r:
                    r.read()
                scrapes.append(time.perf_counter() - started)
            except Exception:  # noqa: BLE001 - a timed-out scrape counts as 10 s
                scrapes.append(10.0)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(streams)]
    watcher = threading.Thread(target=scraper, daemon=True)
    cpu_before = sum(group_usage(g)[0] for g in target.pgids)
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    watcher.start()
    time.sleep(seconds)
    stop.set()
    for thread in threads:
        thread.join(timeout=120)
    elapsed = time.perf_counter() - started
    usage = [group_usage(g) for g in target.pgids]
    watcher.join(timeout=15)
    cpu = sum(u[0] for u in usage) - cpu_before
    rss = sum(u[1] for u in usage)
    window = Window(seconds=elapsed, tokens=tokens[0], ttfts=ttfts, failures=failures[0])
    return window, (max(scrapes) if scrapes else None), cpu, rss


FIRST_TOKEN = re.compile(rb'"delta":\{"content":"[^"]')


def pod_requests(pod_ports: Sequence[int]) -> list[float]:
    """Requests each pod finished so far (vLLM's vllm:request_success_total over every finish reason)."""
    counts = []
    for port in pod_ports:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            counts.append(counter_sum(r.read().decode(), "vllm:request_success_total"))
    return counts


def run_trace(target: Target, pod_ports: Sequence[int], shape: TraceShape, session_header: bool) -> TraceResult:
    """Every session at once, each one turn after another (an agent waits for its answer before its next
    turn): first-token time, prompt and cached tokens (usage.prompt_tokens_details) of every turn, and the
    requests each pod served. With `session_header` the session's name goes in X-Session-ID, the header
    vllm-router's consistent_hash reads first."""
    trace = agent_trace(shape)
    turns: list[Turn] = []
    failures = [0]
    lock = threading.Lock()

    def session(name: str, number: int) -> None:
        messages, results = trace[name]
        messages = [dict(m) for m in messages]
        time.sleep(number * shape.stagger_seconds)  # the agent's own schedule, not a wait for a condition
        conn = target.connection(0)
        headers = {**target.headers(), "X-Session-ID": name} if session_header else target.headers()
        for index, result in enumerate(results):
            body = chat_body(messages, shape.answer_tokens)
            started = time.perf_counter()
            try:
                conn.request("POST", "/v1/chat/completions", body=body, headers=headers)
                response = conn.getresponse()
                raw = b""
                first = None
                while chunk := response.read1(65536):
                    raw += chunk
                    if first is None and FIRST_TOKEN.search(raw):  # the role event before it carries no token
                        first = time.perf_counter() - started
                if response.status != 200 or first is None:
                    raise RuntimeError(f"HTTP {response.status}: {raw[:200]!r}")
            except Exception:  # noqa: BLE001 - counted; the session goes on with a new connection
                with lock:
                    failures[0] += 1
                conn.close()
                conn = target.connection(0)
                continue
            events = [json.loads(line[len(b"data: "):]) for line in raw.split(b"\n") if line.startswith(b"data: {")]
            usage = events[-1]["usage"]
            answer = "".join((e["choices"][0]["delta"].get("content") or "") for e in events if e["choices"])
            with lock:
                turns.append(Turn(name, index, first, usage["prompt_tokens"],
                                  (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)))
            messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": result}]
            time.sleep(shape.tool_seconds)  # the tool runs before the agent's next turn
        conn.close()

    before = pod_requests(pod_ports)
    started = time.perf_counter()
    threads = [threading.Thread(target=session, args=(name, i), daemon=True) for i, name in enumerate(trace)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=900)
    seconds = time.perf_counter() - started
    loads = [after - b for after, b in zip(pod_requests(pod_ports), before)]
    return TraceResult(turns=turns, loads=loads, seconds=seconds, failures=failures[0])


# --- the run ------------------------------------------------------------------------------------------

def start_pods(procs: Processes, count: int, logs: Path, tokens_per_s: float, extra: Sequence[str] = (),
               name: str = "pod") -> list[int]:
    """`count` stand-in pods on free loopback ports, each answering /health before this returns."""
    ports = [free_port() for _ in range(count)]
    for i, port in enumerate(ports):
        log = logs / f"{name}-{i}.log"
        process = procs.start([sys.executable, str(RESPONDER), "--port", str(port), "--model", MODEL,
                               "--tokens-per-s", f"{tokens_per_s:g}", "--log-file", str(logs / f"{name}-{i}.vllm.log"),
                               *extra], log=log)
        wait_http(f"http://127.0.0.1:{port}/health", 30, process=process, log=log)
    return ports


def start_litellm(procs: Processes, pod_ports: Sequence[int], work: Path) -> Target:
    from rigup.desired.gateway import Route
    from rigup.desired.knobs import load_defaults
    from rigup.desired.litellm_config import MASTER_KEY_ENV, config_text

    defaults = load_defaults()
    routes = [Route(host=f"pod-{i}", unit="rigup-dual.service", variant="dual", model=MODEL,
                    api_base=f"http://127.0.0.1:{port}/v1", key_env=None) for i, port in enumerate(pod_ports)]
    config = work / "litellm.yaml"
    config.write_text(config_text(routes, health_check_interval_s=defaults["gateway_health_check_interval_s"],
                                  num_retries=defaults["gateway_num_retries"]))
    key = "sk-" + secrets.token_urlsafe(24)
    port = free_port()
    python = litellm_venv() / "bin" / "python"
    env = {**os.environ, MASTER_KEY_ENV: key, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "DISABLE_ADMIN_UI": "True",
           "PYTHONUNBUFFERED": "1", "HOME": str(work)}  # as rigup-gateway.service sets them
    log = work / "litellm.log"
    process = procs.start([str(python), "-c", "from litellm import run_server; run_server()", "--config", str(config),
                           "--host", "127.0.0.1", "--port", str(port)], log=log, env=env)
    auth = {"Authorization": f"Bearer {key}"}
    wait_http(f"http://127.0.0.1:{port}/health/readiness", 180, process=process, log=log)
    wait_http(f"http://127.0.0.1:{port}/v1/models", 60, headers=auth, process=process, log=log)
    return Target("litellm", [port], key=key, metrics=(f"http://127.0.0.1:{port}/metrics/", auth), pgids=[process.pid])


def start_router(procs: Processes, pod_ports: Sequence[int], work: Path, policy: str,
                 session_ids: bool = False, proxy: Mapping[str, str] | None = None, wait: bool = True) -> Target:
    """vllm-router over the pods; `proxy`: environment variables sending its requests to the pods through the
    pod-key hop (then nginx starts first, as on the entrance, and `wait` False leaves the readiness wait to it)."""
    port, prometheus = free_port(), free_port()
    python = router_venv() / "bin" / "python"
    log = work / f"router-{policy}{'-hop' if proxy else ''}.log"
    process = procs.start([str(python), "-m", "vllm_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
                           "--worker-urls", *[f"http://127.0.0.1:{p}" for p in pod_ports], "--policy", policy,
                           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prometheus)], log=log,
                          env={**os.environ, **proxy} if proxy else None)
    if wait:
        wait_http(f"http://127.0.0.1:{port}/v1/models", 120, process=process, log=log)
    return Target(f"vllm-router {policy}", [port], metrics=(f"http://127.0.0.1:{prometheus}/metrics", {}),
                  pgids=[process.pid], session_ids=session_ids)


def start_front(procs: Processes, router: Target, work: Path, hop: str = "") -> tuple[Target, str]:
    """nginx as the TLS front of `router` (with `hop`, hop_text, the pod-key hop too), its boundary checked."""
    binary, version = nginx_binary()
    prefix = work / "nginx"
    (prefix / "tmp").mkdir(parents=True)
    prefix.chmod(0o700)
    ca, cert, key = make_tls(prefix)
    clients = {"bench": secrets.token_urlsafe(32), "teammate": secrets.token_urlsafe(32)}
    key_map = prefix / "clients.map"
    write_private(key_map, key_map_text(clients))
    port = free_port()
    conf = prefix / "nginx.conf"
    conf.write_text(nginx_conf(prefix=prefix, listen_port=port, upstream_port=router.ports[0], cert=cert, key=key,
                               key_map=key_map, hop=hop))
    log = work / "nginx.log"
    check = subprocess.run([str(binary), "-t", "-p", str(prefix), "-e", str(prefix / "error.log"), "-c", str(conf)],
                           capture_output=True, text=True)
    if check.returncode:
        raise RuntimeError(f"nginx -t refused {conf}: {check.stderr.strip()}")
    process = procs.start([str(binary), "-p", str(prefix), "-e", str(prefix / "error.log"), "-c", str(conf),
                           "-g", "daemon off;"], log=log)
    context = ssl.create_default_context(cafile=str(ca))
    auth = {"Authorization": f"Bearer {clients['bench']}"}
    if hop:  # the router started after nginx, as on the entrance: it reaches its pods through the hop
        wait_http(f"http://127.0.0.1:{router.ports[0]}/v1/models", 120, process=process, log=log)
    wait_http(f"https://127.0.0.1:{port}/v1/models", 30, headers=auth, context=context, process=process, log=log)
    boundary_check(port, context, clients["bench"])
    front = Target("nginx+vllm-router", [port], key=clients["bench"], tls=context, metrics=router.metrics,
                   pgids=[process.pid, *router.pgids])
    return front, version


HOP = "nginx+vllm-router via pod-key hop"


def start_hop_entrance(procs: Processes, pod_ports: Sequence[int], work: Path) -> Target:
    """The entrance as deployed: the front and the pod-key hop in one nginx, a consistent_hash router whose
    HTTP_PROXY is the hop (rigup.desired.entrance's own environment lines and key map), over `pod_ports`.
    Checked before timing with a keyed stand-in pod outside the timed ones (hop_check)."""
    from rigup.desired.entrance import POD_HOP_PORT, pod_key_text, router_proxy_environment

    work.mkdir()
    keyed_key = secrets.token_hex(32)  # what rigup.desired.pod_keys makes
    key_file = work / "keyed-pod.key"
    write_private(key_file, keyed_key + "\n")
    keyed_port = start_pods(procs, 1, work, 0, extra=["--api-key-file", str(key_file)], name="keyed")[0]
    keys = {f"127.0.0.1:{port}": secrets.token_hex(32) for port in pod_ports} | {f"127.0.0.1:{keyed_port}": keyed_key}
    pod_key = work / "pod-key.conf"
    write_private(pod_key, pod_key_text(keys))
    hop_port = free_port()
    proxy = dict(line.split("=", 1) for line in router_proxy_environment().splitlines())
    proxy = {name: value.replace(f":{POD_HOP_PORT}", f":{hop_port}") for name, value in proxy.items()}
    probe = start_router(procs, [keyed_port], work, "consistent_hash", proxy=proxy, wait=False)
    router = start_router(procs, pod_ports, work, "consistent_hash", session_ids=True, proxy=proxy, wait=False)
    front, _ = start_front(procs, router, work, hop=hop_text(hop_port, pod_key, [*pod_ports, keyed_port]))
    hop_check(probe, keyed_port, hop_port)
    procs.stop(next(p for p in procs.started if p.pid == probe.pgids[0]))
    front.name = HOP
    return front


def hop_check(probe: Target, keyed_port: int, hop_port: int) -> None:
    """The hop does what the entrance's does, before anything is timed: a router that holds no key reaches the
    keyed pod through it, the pod refuses a request without its key, the hop refuses a host:port it does not
    route to (502)."""
    body = chat_body([{"role": "user", "content": "ping"}], 4, stream=False)
    wait_http(f"http://127.0.0.1:{probe.ports[0]}/v1/models", 120)

    def status(port: int, path: str, host: str | None = None, payload: bytes | None = None) -> int:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        headers = {"Content-Type": "application/json"} | ({"Host": host} if host else {})
        conn.request("POST" if payload else "GET", path, body=payload, headers=headers)
        code = conn.getresponse().status
        conn.close()
        return code

    stranger = f"127.0.0.1:{free_port()}"  # as a router asks its proxy: the absolute URL, the pod's host:port as Host
    got = {"the router through the hop": status(probe.ports[0], "/v1/chat/completions", payload=body),
           "the keyed pod without its key": status(keyed_port, "/v1/chat/completions", payload=body),
           "the hop for a pod it does not route to": status(hop_port, f"http://{stranger}/v1/models", host=stranger)}
    wanted = dict(zip(got, (200, 401, 502)))
    if got != wanted:
        raise RuntimeError(f"the pod-key hop: got {got}, expected {wanted}")


def boundary_check(port: int, context: ssl.SSLContext, key: str) -> None:
    """The front refuses what it must before anything is timed: no key / a wrong key 401, other paths 404."""
    def status(path: str, bearer: str | None) -> int:
        conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=10, context=context)
        conn.request("GET", path, headers={"Authorization": f"Bearer {bearer}"} if bearer else {})
        code = conn.getresponse().status
        conn.close()
        return code

    wanted = {("/v1/models", None): 401, ("/v1/models", "x" * 43): 401, ("/v1/models", key): 200,
              ("/metrics", key): 404, ("/tokenize", key): 404, ("/invocations", key): 404, ("/pause", key): 404}
    got = {case: status(*case) for case in wanted}
    wrong = {case[0] + (" with the key" if case[1] == key else ""): code for case, code in got.items() if code != wanted[case]}
    if wrong:
        raise RuntimeError(f"the nginx front answered {wrong}, expected 401 without a valid key, 404 off the allowlist")


def versions(litellm: Path | None, router: Path) -> dict[str, str]:
    def show(python: Path, name: str) -> str:
        out = subprocess.run([str(python), "-m", "pip", "show", name], capture_output=True, text=True).stdout
        return next((line.split(": ", 1)[1] for line in out.splitlines() if line.startswith("Version: ")), "?")

    found = {"vllm-router": show(router / "bin" / "python", "vllm-router")}
    if litellm is not None:
        found["litellm"] = show(litellm / "bin" / "python", "litellm")
    return found


REFERENCE_DECODE_TPS = 68.5  # club-3090 BENCHMARKS.md@4a29ab57, dual/autoround-int4/fp8-mtp.yml, 2x3090: decode 68.50 narrative
REFERENCE_PREFILL_TPS = 1446.0  # the same row: prompt processing 1446 tokens/s at 10K context
REFERENCE_KV_TOKENS = round(2.36 * 262144)  # the compose's header: "KV pool 2.36x" of 262K context, at 4a29ab57
TRACE_SCALE = 20.0  # the trace's tokens and KV pool at 1/20 of a real agent's: first tokens 1/20 as long, ratios kept
TARGETS = {"paced_ratio": 0.97, "added_ttft_ms": 2.0, "ceiling_tps": 20_000.0, "scrape_s": 1.0, "hit_share": 0.80,
           "ttft_ratio": 3.0, "max_over_mean": 1.25}  # issue 44's done-when


def verdict(ok: bool) -> str:
    return "met" if ok else "**not met**"


def measured(paced: dict[str, dict[int, dict[str, object]]], ceiling: dict[str, dict[int, dict[str, object]]],
             by_variant: dict[str, dict[str, TraceResult]], info: dict[str, str], command: str, pods: int,
             shapes: dict[str, TraceShape], blocks: int) -> str:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"### Measured: {label()}", "",
             f"{now}, commit {info['commit']}, with `{command}` ({info['seconds']} s in all). {pods} stand-in pods "
             f"on loopback per part, one SSE chunk per token; the client's threads, the pods and the entrance share this "
             f"machine's {os.cpu_count()} CPUs. vllm-router {info['vllm-router']}; nginx {info['nginx']} (Debian 12) "
             "as the TLS front with per-client keys and the path allowlist (its 401/404 answers checked before timing).",
             "", f"**(a) At a real rig's pace**: every pod decodes at {REFERENCE_DECODE_TPS:g} tokens/s per stream "
             "(club-3090@4a29ab57 BENCHMARKS.md, `dual/autoround-int4/fp8-mtp.yml`, 2x3090 at 230 W: decode 68.50 "
             "tokens/s narrative).", ""]
    lines += table_rows(paced)
    lines += ["", "**(b) The ceiling**: unpaced pods.", ""]
    lines += table_rows(ceiling)
    first = next(iter(shapes.values()))
    lines += ["", f"**(c) Agent trace**: {first.sessions} sessions x {first.turns} turns (each turn waits for the "
              f"previous answer), every session opening with a shared {first.shared_tokens}-token harness prompt "
              f"and its own {first.task_tokens}-token task, each turn adding a {first.turn_tokens}-token tool result "
              f"and a {first.answer_tokens}-token answer; the same trace for every policy, fresh pods (cold caches) for "
              f"each. Pods with the stand-in's prefix cache: {blocks - 1:,} blocks of 16 tokens each (the reference's "
              f"KV pool, 2.36 x 262,144 = {REFERENCE_KV_TOKENS:,} tokens per the compose's header, at "
              f"1/{TRACE_SCALE:g} like the trace's tokens), prefill at {REFERENCE_PREFILL_TPS:g} tokens/s (the same "
              "club-3090 row: 1446 @10K), one prefill after another per pod; decode at "
              f"{REFERENCE_DECODE_TPS:g}. Tokens at 1/{TRACE_SCALE:g} of a real agent's (a 10K-token harness, up to "
              "~45K of context by the last turn), so prefill times are 1/20 of a real rig's. Through vllm-router "
              "alone (the front does not route). Two arrival patterns: every session at once with no tool time "
              "(the pods are prefill-bound: first tokens wait in each pod's prefill queue), and agents that run a "
              "tool between turns and start a little apart.", ""]
    for variant, traces in by_variant.items():
        lines += [f"*{variant}*:", "",
                  "| routing | turns hitting their prefix | prompt tokens cached | mean TTFT (ms) | median (ms) | "
                  "vs this (x lower) | requests per pod | busiest / mean | wall (s) | failed |",
                  "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|"]
        baselines = [traces[n] for n in traces if n.endswith(("random", "round_robin"))]
        for name, result in traces.items():
            hit, total = result.hits
            worst = min((ttft_ratio(b, result) for b in baselines), default=0.0)
            lines.append(f"| {name} | {hit} / {total} ({result.hit_share:.0%}) | {result.cached_share:.0%} | "
                         f"{result.ttft_mean * 1000:.0f} | {statistics.median(t.ttft for t in result.turns) * 1000:.0f}"
                         f" | {worst:.2f} | {', '.join(f'{x:g}' for x in result.loads)} | "
                         f"{max_over_mean(result.loads):.2f} | {result.seconds:.0f} | {result.failures} |")
        lines.append("")
    lines += ["Vs this: the lower of random's and round_robin's mean TTFT over this policy's.", "",
              "Issue 44's targets, from the figures above:", ""]
    front = "nginx+vllm-router"
    lines += paced_verdicts(paced)
    for streams, by in sorted(ceiling[front].items()):
        window, scrape = by["window"], by.get("scrape")
        assert isinstance(window, Window)
        slow = scrape if isinstance(scrape, float) else 10.0
        lines.append(f"- ceiling, {streams} streams: {window.tokens_per_s:,.0f} tokens/s through the front "
                     f"(>= {TARGETS['ceiling_tps']:,.0f}: {verdict(window.tokens_per_s >= TARGETS['ceiling_tps'])}); "
                     f"the router's metrics answered in {slow:.2f} s at the slowest (< {TARGETS['scrape_s']:g} s: "
                     f"{verdict(slow < TARGETS['scrape_s'])})")
    for variant, traces in by_variant.items():
        baselines = [traces[n] for n in traces if n.endswith(("random", "round_robin"))]
        for name, result in traces.items():
            if name.endswith(("random", "round_robin")):
                continue
            worst = min((ttft_ratio(b, result) for b in baselines), default=0.0)
            lines.append(f"- trace ({variant}), {name}: {result.hit_share:.0%} of turns hit their prefix (>= 80 %: "
                         f"{verdict(result.hit_share >= TARGETS['hit_share'])}); mean TTFT {worst:.2f}x lower than "
                         f"random and round_robin (>= 3x: {verdict(worst >= TARGETS['ttft_ratio'])}); busiest pod "
                         f"{max_over_mean(result.loads):.2f}x the mean (<= 1.25: "
                         f"{verdict(max_over_mean(result.loads) <= TARGETS['max_over_mean'])})")
    lines += ["", "Entrance CPU %: user+system of the entrance's process groups over the window (100 % = one core; "
              "nginx+vllm-router: both). RSS at the window's end. Tokens/s: completion tokens of every request in the "
              "window (every stream finishes the request it is in when the time is up; the window ends with the "
              "last). Added: the path's TTFT (first SSE event) minus direct's at the same concurrency."]
    return "\n".join(lines) + "\n"


def table_rows(results: dict[str, dict[int, dict[str, object]]]) -> list[str]:
    lines = ["| path | streams | tokens/s | vs direct | TTFT median (ms) | p95 (ms) | added median / p95 (ms) | "
             "entrance CPU % | entrance RSS (MB) | slowest metrics scrape (s) | failed requests |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for streams in sorted(results["direct"]):
        direct = results["direct"][streams]["window"]
        assert isinstance(direct, Window)
        for name, by_streams in results.items():
            row = by_streams[streams]
            window = row["window"]
            assert isinstance(window, Window)
            add = added(window, direct)
            scrape = row.get("scrape")
            lines.append(
                f"| {name} | {streams} | {window.tokens_per_s:,.0f} | {window.tokens_per_s / direct.tokens_per_s:.3f}x | "
                f"{window.ttft_median * 1000:.1f} | {window.ttft_p95 * 1000:.1f} | "
                + ("" if name == "direct" else f"{add[0] * 1000:+.1f} / {add[1] * 1000:+.1f}") + " | "
                + (f"{row['cpu_pct']:.0f}" if name != "direct" else "") + " | "
                + (f"{row['rss'] / 1e6:.0f}" if name != "direct" else "") + " | "
                + (f"{scrape:.2f}" if isinstance(scrape, float) else "") + f" | {window.failures} |")
    return lines


MACHINE: str | None = None  # --machine: the name the results block gives this machine (default: its host name)


def label() -> str:
    return f"{MACHINE or platform.node()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, issue 44's done-when"


def paced_verdicts(paced: dict[str, dict[int, dict[str, object]]]) -> list[str]:
    """Issue 44's paced targets for the front and for the entrance as deployed (the pod-key hop), and what the
    hop adds to the same front and router without it, in the same run."""
    lines = []
    for streams in sorted(paced.get("direct", {})):
        direct = paced["direct"][streams]["window"]
        assert isinstance(direct, Window)
        for front in ("nginx+vllm-router", HOP):
            if front not in paced:
                continue
            row = paced[front][streams]["window"]
            assert isinstance(row, Window)
            ratio = row.tokens_per_s / direct.tokens_per_s
            add = added(row, direct)[0] * 1000
            lines.append(f"- paced, {streams} streams, {front}: {ratio:.3f}x direct (>= {TARGETS['paced_ratio']}: "
                         f"{verdict(ratio >= TARGETS['paced_ratio'])}); median first token {add:+.1f} ms "
                         f"(<= {TARGETS['added_ttft_ms']:g} ms: {verdict(add <= TARGETS['added_ttft_ms'])})")
        if HOP in paced and "nginx+vllm-router" in paced:
            hop, plain = paced[HOP][streams]["window"], paced["nginx+vllm-router"][streams]["window"]
            assert isinstance(hop, Window) and isinstance(plain, Window)
            median, p95 = added(hop, plain)
            lines.append(f"- paced, {streams} streams, the hop alone ({HOP} minus nginx+vllm-router): median first "
                         f"token {median * 1000:+.1f} ms, p95 {p95 * 1000:+.1f} ms, tokens/s "
                         f"{hop.tokens_per_s / plain.tokens_per_s:.3f}x")
    return lines


def measure(targets: Sequence[Target], concurrency: Sequence[int], seconds: float, max_tokens: int,
            results: dict[str, dict[int, dict[str, object]]]) -> None:
    for target in targets:  # warm every path (connections, the router's first requests)
        load(target, 1, 1.0, max_tokens)
    for streams in concurrency:
        for target in targets:
            window, scrape, cpu, rss = load(target, streams, seconds, max_tokens)
            results.setdefault(target.name, {})[streams] = {
                "window": window, "scrape": scrape, "cpu_pct": cpu_percent(cpu, window.seconds), "rss": rss}
            print(f"{target.name:18} x{streams:<3} {window.tokens_per_s:9,.0f} tok/s  TTFT median "
                  f"{window.ttft_median * 1000:6.1f} ms p95 {window.ttft_p95 * 1000:6.1f} ms  CPU "
                  f"{cpu_percent(cpu, window.seconds):4.0f} %  RSS {rss / 1e6:5.0f} MB  scrape {scrape}  "
                  f"failed {window.failures}", flush=True)


def entrance(procs: Processes, pod_ports: Sequence[int], work: Path, with_litellm: bool) -> tuple[list[Target], str]:
    """direct, (LiteLLM,) nginx in front of vllm-router cache_aware (what this bench measured before issue 44's
    first-token probe), vllm-router alone and nginx in front of it with the entrance's policy, consistent_hash
    (rigup.desired.entrance.router_args), and the entrance as deployed (that front and router with the pod-key
    hop between the router and its pods), over the same pods."""
    work.mkdir()
    (work / "cache_aware").mkdir()
    cache_aware, _ = start_front(procs, start_router(procs, pod_ports, work / "cache_aware", "cache_aware"),
                                 work / "cache_aware")
    cache_aware.name = "nginx+vllm-router cache_aware"
    router = start_router(procs, pod_ports, work, "consistent_hash", session_ids=True)
    front, nginx = start_front(procs, router, work)
    hop = start_hop_entrance(procs, pod_ports, work / "hop")
    litellm = [start_litellm(procs, pod_ports, work)] if with_litellm else []
    return [Target("direct", list(pod_ports)), *litellm, cache_aware, router, front, hop], nginx


TRACE_POLICIES = ("consistent_hash", "cache_aware", "random", "round_robin")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pods", type=int, default=4, help="stand-in vLLM pods")
    parser.add_argument("--concurrency", default="1,8,64", help="client streams at the real pace (comma separated)")
    parser.add_argument("--ceiling-streams", type=int, default=8, help="client streams against unpaced pods")
    parser.add_argument("--seconds", type=float, default=8.0, help="measured window per path and concurrency")
    parser.add_argument("--max-tokens", type=int, default=128, help="completion tokens per request")
    parser.add_argument("--sessions", type=int, default=32, help="agent sessions in the trace")
    parser.add_argument("--turns", type=int, default=10, help="turns per session")
    parser.add_argument("--tool-seconds", type=float, default=1.0, help="the second trace: tool time between turns")
    parser.add_argument("--stagger-seconds", type=float, default=0.25, help="the second trace: session i starts i x this late")
    parser.add_argument("--parts", default="abc", help="which parts to run: a (paced), b (ceiling), c (trace); "
                        "fewer than all three write their own block, leaving the done-when block as it is")
    parser.add_argument("--litellm", action="store_true", help="LiteLLM as rigup's old gateway too (slow to build)")
    parser.add_argument("--results", default=str(REPO_ROOT / "bench" / "results.md"), help="markdown file to update")
    parser.add_argument("--wheels", help="a folder holding files/router/requirements.txt's wheels: the router's venv "
                        "is built from it alone, hashes checked (a machine with no network)")
    parser.add_argument("--machine", help="the machine's name in the results block (default: its host name)")
    parser.add_argument("--commit", help="the commit measured (default: git rev-parse; for a copy without .git)")
    args = parser.parse_args()
    global WHEELS, MACHINE
    WHEELS = Path(args.wheels).resolve() if args.wheels else None
    MACHINE = args.machine
    if args.parts != "abc" and not (args.parts and set(args.parts) <= {"a", "b"}):
        parser.error("--parts: abc (all, the done-when block), or a and/or b alone (their own block)")
    started = time.perf_counter()
    concurrency = [int(c) for c in args.concurrency.split(",")]
    shapes = {s.label: s for s in (TraceShape(sessions=args.sessions, turns=args.turns),
                                   TraceShape(sessions=args.sessions, turns=args.turns, tool_seconds=args.tool_seconds,
                                              stagger_seconds=args.stagger_seconds))}
    CACHE.mkdir(parents=True, exist_ok=True)
    router_path = router_venv()
    info = versions(litellm_venv() if args.litellm else None, router_path)
    info["commit"] = args.commit or subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"],
                                                   capture_output=True, text=True).stdout.strip()
    paced: dict[str, dict[int, dict[str, object]]] = {}
    ceiling: dict[str, dict[int, dict[str, object]]] = {}
    by_variant: dict[str, dict[str, TraceResult]] = {}
    blocks = pool_blocks(REFERENCE_KV_TOKENS, TRACE_SCALE)
    with tempfile.TemporaryDirectory(prefix="rigup-entrance-") as tmp:
        work = Path(tmp)
        os.chmod(work, 0o700)
        if "a" in args.parts:
            with Processes() as procs:  # (a) paced
                pod_ports = start_pods(procs, args.pods, work, REFERENCE_DECODE_TPS, name="paced")
                targets, info["nginx"] = entrance(procs, pod_ports, work / "paced", args.litellm)
                measure(targets, concurrency, args.seconds, args.max_tokens, paced)
        if "b" in args.parts:
            with Processes() as procs:  # (b) the ceiling
                pod_ports = start_pods(procs, args.pods, work, 0, name="unpaced")
                targets, info["nginx"] = entrance(procs, pod_ports, work / "unpaced", args.litellm)
                measure(targets, [args.ceiling_streams], args.seconds, args.max_tokens, ceiling)
        trace_runs = itertools.product(shapes.items(), TRACE_POLICIES) if "c" in args.parts else ()
        for (variant, shape), policy in trace_runs:  # (c) the agent trace
            with Processes() as procs:  # fresh pods (cold caches) for each policy
                pod_ports = start_pods(procs, args.pods, work, REFERENCE_DECODE_TPS, name=f"trace-{policy}", extra=[
                    "--prefill-tokens-per-s", f"{REFERENCE_PREFILL_TPS:g}", "--num-gpu-blocks-override", str(blocks),
                    "--enable-prompt-tokens-details"])
                logs = work / f"{policy}-{len(by_variant.get(variant, {}))}-{shape.tool_seconds:g}"
                logs.mkdir()
                router = start_router(procs, pod_ports, logs, policy)
                name = f"vllm-router {policy}" + (" (X-Session-ID)" if policy == "consistent_hash" else "")
                result = run_trace(router, pod_ports, shape, session_header=policy == "consistent_hash")
                by_variant.setdefault(variant, {})[name] = result
                print(f"trace ({variant}) {name}: hits {result.hits}, mean TTFT {result.ttft_mean * 1000:.0f} ms, loads "
                      f"{result.loads}, {result.seconds:.0f} s, failed {result.failures}", flush=True)
    info["seconds"] = f"{time.perf_counter() - started:.0f}"
    command = (f"python bench/entrance.py --pods {args.pods} --concurrency {args.concurrency} --ceiling-streams "
               f"{args.ceiling_streams} --seconds {args.seconds:g} --max-tokens {args.max_tokens} --sessions "
               f"{args.sessions} --turns {args.turns} --tool-seconds {args.tool_seconds:g} --stagger-seconds "
               f"{args.stagger_seconds:g}" + (" --litellm" if args.litellm else "")
               + (f" --wheels {args.wheels}" if args.wheels else ""))
    if args.parts != "abc":
        command += f" --parts {args.parts}"
        now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        load1, load5, _ = os.getloadavg()
        lines = [f"### Measured: {label()}, parts {args.parts}", "",
                 f"{now}, commit {info['commit']}, with `{command}` ({info['seconds']} s in all), load average "
                 f"{load1:.1f} (1 min) / {load5:.1f} (5 min) at its end; vllm-router {info['vllm-router']}, nginx "
                 f"{info.get('nginx', '?')}.", ""]
        for title, results in (("(a) paced", paced), ("(b) ceiling", ceiling)):
            if results:
                lines += [f"**{title}**:", "", *table_rows(results), ""]
        if paced:
            lines += ["Issue 44's paced targets, from the figures above:", "", *paced_verdicts(paced), ""]
        text = "\n".join(lines)
        print(text)
        write_results(Path(args.results), f"{label()}, parts {args.parts}", text, section=SECTION)
        print(f"written: {args.results}")
        return 0
    write_results(Path(args.results), label(), measured(paced, ceiling, by_variant, info, command, args.pods, shapes, blocks),
                  section=SECTION)
    print(f"written: {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
