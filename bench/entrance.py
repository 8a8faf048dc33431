#!/usr/bin/env python3
"""The fleet's entrance, measured side by side (issue 44): what each candidate in front of the pods costs.

    .venv/bin/python bench/entrance.py [--pods 4] [--concurrency 1,8,32] [--seconds 6] [--results bench/results.md]

Loopback only. N stand-in vLLM pods (rigup_testbed/openai_responder.py, the test bed's OpenAI-compatible
responder: SSE streaming one token per chunk with vLLM's `stream_options.include_usage` final chunk, and
vLLM's `/metrics`), unpaced, so every figure is the entrance's own ceiling, not a GPU's. Then, in one run:

- direct: each client stream to one pod (stream i to pod i mod N; one stream is one pod);
- litellm: LiteLLM's proxy exactly as rigup configures it today (rigup.desired.gateway.config_text: one
  route per pod, simple-shuffle, background health checks, retries; the master key from the environment)
  from the pinned files/gateway/requirements.txt, installed as the test bed installs it (rigup_testbed.pypi's
  wheel index for that file, pip --require-hashes --no-deps) into .cache/entrance/venv-litellm-<hash>;
- vllm-router: vllm-router 0.1.17 (the vLLM project's Rust router, https://github.com/vllm-project/router,
  PyPI `vllm-router`, files/router/requirements.txt hash-pinned) with `--policy cache_aware` over the N pods,
  its Prometheus exporter on `--prometheus-port` (launcher flags read from vllm_router/router_args.py of
  that wheel);
- nginx+router: the same router behind nginx 1.22.1 (Debian 12's nginx 1.22.1-9+deb12u12, taken with
  `apt-get download` and unpacked under .cache, not installed: no service is started on this machine) as
  a TLS front: a certificate from a throwaway CA made by openssl, a bearer key per client checked through
  a `map` in a 0600 include file (no key on a command line or in nginx.conf), a path allowlist
  (/v1/chat/completions, /v1/completions, /v1/models; anything else 404, a missing or wrong key 401),
  `proxy_buffering off` so tokens stream as they come.

Figures per path and concurrency (1, 8, 32 streams; each stream sends one streamed chat completion after
another for --seconds, then finishes the one it is in): total completion tokens/s (from each stream's usage chunk), time to the first
SSE event (median, p95) and what the path adds to direct's, the entrance's CPU% (user+system of its
whole process group over the window; 100 % = one core) and RSS (the group's, at the end), and how long
its metrics endpoint took to answer under that load (the slowest of one scrape a second).

Cache affinity: S multi-turn sessions (each its own ~1,200-token system prompt, the conversation growing turn
by turn) sent one turn at a time, sessions interleaved; after each turn the pods' `vllm:prompt_tokens_total`
(vLLM's counter, which the stand-in keeps) says which pod answered: the one that took the turn's prompt
(LiteLLM's health checks' short prompts move the others). Reported: the share of turns (after
a session's first) that landed on the pod that served that session's previous turn, for LiteLLM's
simple-shuffle, vllm-router's cache_aware, consistent_hash (each session's name in an X-Session-ID header),
power_of_two and round_robin, with the turns each pod served (the
busiest over the mean: affinity bought by piling sessions on one pod would show there). With the stand-in (no prefix cache
model yet) that share is what the routing would reuse, not a time saved.

Facts relied on: vllm-router's flags (`--worker-urls`, `--policy`, `--prometheus-host/--prometheus-port`) and
cache_aware's rule ("Load balancing is triggered when (max_load - min_load) > abs_threshold AND max_load >
min_load * rel_threshold. Otherwise, use cache aware", `--cache-threshold` default 0.3, `--max-tree-size`)
are from vllm_router/router_args.py in the pinned wheel (vllm_router-0.1.17-cp38-abi3-manylinux_2_28_x86_64.whl,
sha256 85c96bea...42694d); that cache_aware "optimizes for prefix cache hits", from the wheel's README. LiteLLM's config, environment and flags are rigup's own
(rigup/desired/gateway.py, templates/rigup-gateway.service.j2). `--tokens-per-s 70` is the reference
variant's single-stream rate: 68-71 narrative tokens/s at 230 W in the README of noonghunna/qwen36-dual-3090
at bbb84da0 (bench/client_overhead.py's REFERENCE_TPS uses the same 70).

Everything started here runs in its own process group and is stopped (SIGTERM, then SIGKILL) when the
run ends, on failure too. The figures go into the "Entrance" section of bench/results.md as a
"### Measured" block of this machine (bench_artifacts.write_results).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import http.client
import json
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

SECTION = "## Entrance: direct vs LiteLLM vs vllm-router vs nginx+vllm-router (bench/entrance.py)"
RESPONDER = REPO_ROOT / "rigup_testbed" / "openai_responder.py"
GATEWAY_REQUIREMENTS = REPO_ROOT / "files" / "gateway" / "requirements.txt"
ROUTER_REQUIREMENTS = REPO_ROOT / "files" / "router" / "requirements.txt"
CACHE = REPO_ROOT / ".cache" / "entrance"
PYPI_CACHE = Path("/var/tmp/rigup-testbed/cache/pypi")  # the test bed's wheel indexes (rigup_testbed.pypi)
NGINX_PACKAGES = ("nginx", "nginx-common")  # Debian 12's archive; unpacked, not installed
MODEL = "qwen3.6-27b-autoround"
ALLOWED_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/models")
KEY_PATTERN = re.compile(r"[A-Za-z0-9_-]{16,128}")  # what secrets.token_urlsafe makes; nothing nginx would parse
CLIENT_NAME = re.compile(r"[a-z][a-z0-9-]{0,31}")
SYSTEM_PROMPT_TOKENS = 1000  # a session's prompt is longer; a health check's or a load request's far shorter


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


def affinity(landings: Mapping[str, Sequence[int]]) -> tuple[int, int]:
    """(turns that landed on the pod of the session's previous turn, turns that had a previous turn), over
    sessions -> the pod index of each turn in order."""
    same = total = 0
    for pods in landings.values():
        for previous, current in zip(pods, pods[1:]):
            total += 1
            same += previous == current
    return same, total


def pod_loads(landings: Mapping[str, Sequence[int]], pods: int) -> list[int]:
    """Turns each pod served, over every session."""
    counts = [0] * pods
    for served in landings.values():
        for pod in served:
            counts[pod] += 1
    return counts


def max_over_mean(counts: Sequence[int]) -> float:
    """The busiest pod's turns over the mean (1.00: even; a router that piles sessions on one pod shows it)."""
    mean = sum(counts) / len(counts)
    return max(counts) / mean if mean else 0.0


def serving_pod(before: Sequence[float], after: Sequence[float], at_least: float) -> int:
    """The one pod whose prompt-token counter grew by at least the turn's prompt between two reads (one turn
    in flight at a time). A smaller growth is someone else's short request: LiteLLM's background health
    checks send one to every pod."""
    moved = [i for i, (b, a) in enumerate(zip(before, after)) if a - b >= at_least]
    if len(moved) != 1:
        raise RuntimeError(f"expected one pod to take the turn's {at_least:g} prompt tokens, it grew on pods {moved}")
    return moved[0]


def prompt_tokens(metrics_text: str) -> float:
    """vLLM's vllm:prompt_tokens_total (prefill tokens processed), summed over engines, from a /metrics page."""
    total = 0.0
    for line in metrics_text.splitlines():
        if line.startswith(("vllm:prompt_tokens_total{", "vllm:prompt_tokens_total ")):
            total += float(line.rsplit(" ", 1)[1])
    return total


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


def nginx_conf(*, prefix: Path, listen_port: int, upstream_port: int, cert: Path, key: Path, key_map: Path) -> str:
    """The TLS front: keys checked through the map, the allowlist, streaming unbuffered to the router."""
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
            proxy_buffering off;
            proxy_read_timeout 600s;
        }}
        location / {{
            return 404;
        }}
    }}
}}
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


def router_venv() -> Path:
    return venv("router", ROUTER_REQUIREMENTS, ["-r", str(ROUTER_REQUIREMENTS)])


def nginx_binary() -> tuple[Path, str]:
    """Debian's nginx binary, unpacked from the archive's packages under .cache (apt checks their signatures)."""
    root = CACHE / "nginx-root"
    binary = root / "usr" / "sbin" / "nginx"
    if not binary.exists():
        debs = CACHE / "debs"
        debs.mkdir(parents=True, exist_ok=True)
        subprocess.run(["apt-get", "download", *NGINX_PACKAGES], cwd=debs, check=True, capture_output=True)
        for deb in sorted(debs.glob("*.deb")):
            subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    versions = sorted(p.name for p in (CACHE / "debs").glob("nginx_*.deb"))
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

    def connection(self, stream: int) -> http.client.HTTPConnection:
        port = self.ports[stream % len(self.ports)]
        if self.tls is not None:
            return http.client.HTTPSConnection("127.0.0.1", port, timeout=60, context=self.tls)
        return http.client.HTTPConnection("127.0.0.1", port, timeout=60)

    def headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.key:
            headers["Authorization"] = f"Bearer {self.key}"
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
        headers = target.headers()
        while not stop.is_set():
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


def pod_counters(pod_ports: Sequence[int]) -> list[float]:
    counters = []
    for port in pod_ports:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            counters.append(prompt_tokens(r.read().decode()))
    return counters


def session_turns(target: Target, pod_ports: Sequence[int], sessions: int, turns: int,
                  session_header: bool = False) -> tuple[int, int, list[int]]:
    """Multi-turn sessions sharing a prefix, one turn in flight at a time, sessions interleaved; which pod
    answered each turn from the pods' prompt-token counters (a session's prompt is over SYSTEM_PROMPT_TOKENS)."""
    # each system prompt ~1,200 tokens at the stand-in's chars/4
    conversations = {f"s{s}": [{"role": "system", "content": f"You are agent {s} ({secrets.token_hex(8)}). "
                                + "Follow the house rules. " * 200}] for s in range(sessions)}
    landings: dict[str, list[int]] = {name: [] for name in conversations}
    conn = target.connection(0)
    headers = target.headers()
    for turn in range(turns):
        for name, messages in conversations.items():
            messages.append({"role": "user", "content": f"Turn {turn}: what is {turn + 2} * 7?"})
            before = pod_counters(pod_ports)
            # X-Session-ID: the header vllm-router's consistent_hash reads first (its docs/load_balancing)
            sent = {**headers, "X-Session-ID": name} if session_header else headers
            conn.request("POST", "/v1/chat/completions", body=chat_body(messages, 16, stream=False), headers=sent)
            response = conn.getresponse()
            answer = json.loads(response.read())
            if response.status != 200:
                raise RuntimeError(f"{target.name}: session turn answered {response.status}: {answer}")
            messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"] or ""})
            landings[name].append(serving_pod(before, pod_counters(pod_ports), SYSTEM_PROMPT_TOKENS))
    conn.close()
    return (*affinity(landings), pod_loads(landings, len(pod_ports)))


# --- the run ------------------------------------------------------------------------------------------

def start_pods(procs: Processes, count: int, logs: Path, tokens_per_s: float) -> list[int]:
    ports = [free_port() for _ in range(count)]
    for i, port in enumerate(ports):
        log = logs / f"pod-{i}.log"
        process = procs.start([sys.executable, str(RESPONDER), "--port", str(port), "--model", MODEL,
                               "--tokens-per-s", f"{tokens_per_s:g}", "--log-file", str(logs / f"pod-{i}.vllm.log")],
                              log=log)
        wait_http(f"http://127.0.0.1:{port}/health", 30, process=process, log=log)
    return ports


def start_litellm(procs: Processes, pod_ports: Sequence[int], work: Path) -> Target:
    from rigup.desired.gateway import MASTER_KEY_ENV, Route, config_text
    from rigup.desired.knobs import load_defaults

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


def start_router(procs: Processes, pod_ports: Sequence[int], work: Path, policy: str) -> Target:
    port, prometheus = free_port(), free_port()
    python = router_venv() / "bin" / "python"
    log = work / f"router-{policy}.log"
    process = procs.start([str(python), "-m", "vllm_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
                           "--worker-urls", *[f"http://127.0.0.1:{p}" for p in pod_ports], "--policy", policy,
                           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prometheus)], log=log)
    wait_http(f"http://127.0.0.1:{port}/v1/models", 120, process=process, log=log)
    return Target(f"vllm-router {policy}", [port], metrics=(f"http://127.0.0.1:{prometheus}/metrics", {}),
                  pgids=[process.pid])


def start_front(procs: Processes, router: Target, work: Path) -> tuple[Target, str]:
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
                               key_map=key_map))
    log = work / "nginx.log"
    check = subprocess.run([str(binary), "-t", "-p", str(prefix), "-e", str(prefix / "error.log"), "-c", str(conf)],
                           capture_output=True, text=True)
    if check.returncode:
        raise RuntimeError(f"nginx -t refused {conf}: {check.stderr.strip()}")
    process = procs.start([str(binary), "-p", str(prefix), "-e", str(prefix / "error.log"), "-c", str(conf),
                           "-g", "daemon off;"], log=log)
    context = ssl.create_default_context(cafile=str(ca))
    auth = {"Authorization": f"Bearer {clients['bench']}"}
    wait_http(f"https://127.0.0.1:{port}/v1/models", 30, headers=auth, context=context, process=process, log=log)
    boundary_check(port, context, clients["bench"])
    front = Target("nginx+vllm-router", [port], key=clients["bench"], tls=context, metrics=router.metrics,
                   pgids=[process.pid, *router.pgids])
    return front, version


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


def versions(litellm: Path, router: Path) -> dict[str, str]:
    def show(python: Path, name: str) -> str:
        out = subprocess.run([str(python), "-m", "pip", "show", name], capture_output=True, text=True).stdout
        return next((line.split(": ", 1)[1] for line in out.splitlines() if line.startswith("Version: ")), "?")

    return {"litellm": show(litellm / "bin" / "python", "litellm"), "vllm-router": show(router / "bin" / "python", "vllm-router")}


def label(tokens_per_s: float) -> str:
    pace = f"pods paced at {tokens_per_s:g} tokens/s per stream" if tokens_per_s else "unpaced pods"
    return f"{platform.node()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, {pace}"


def measured(results: dict[str, dict[int, dict[str, object]]], affinities: dict[str, tuple[int, int, list[int]]],
             info: dict[str, str], command: str, pods: int, tokens_per_s: float) -> str:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    pace = (f"paced at {tokens_per_s:g} tokens/s per stream (the dual-3090 README's single-stream figure for the "
            "reference variant: 68-71 tokens/s narrative)" if tokens_per_s else "unpaced (the entrance's ceiling)")
    lines = [f"### Measured: {label(tokens_per_s)}", "",
             f"{now}, with `{command}`. {pods} stand-in pods on loopback, {pace}, one SSE chunk per token; the "
             f"client's threads, the pods and the entrance sharing this machine's {os.cpu_count()} CPUs (other helpers' "
             f"tests ran at the same time). LiteLLM {info['litellm']} as rigup configures it; vllm-router "
             f"{info['vllm-router']} (cache_aware); nginx {info['nginx']} (Debian 12) as a TLS front with per-client "
             "keys and the path allowlist (its 401/404 answers checked before timing).", "",
             "| path | streams | tokens/s | vs direct | TTFT median (ms) | p95 (ms) | added median / p95 (ms) | "
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
                f"| {name} | {streams} | {window.tokens_per_s:,.0f} | {window.tokens_per_s / direct.tokens_per_s:.2f}x | "
                f"{window.ttft_median * 1000:.1f} | {window.ttft_p95 * 1000:.1f} | "
                + ("" if name == "direct" else f"{add[0] * 1000:+.1f} / {add[1] * 1000:+.1f}") + " | "
                + (f"{row['cpu_pct']:.0f}" if name != "direct" else "") + " | "
                + (f"{row['rss'] / 1e6:.0f}" if name != "direct" else "") + " | "
                + (f"{scrape:.2f}" if isinstance(scrape, float) else "") + f" | {window.failures} |")
    lines += ["", "Cache affinity (multi-turn sessions sharing a prefix, one turn at a time; the pod from vLLM's "
              "`vllm:prompt_tokens_total` on each pod):", "",
              "| routing | turns on the previous turn's pod | share | turns per pod | busiest pod / mean |",
              "|---|---:|---:|---|---:|"]
    for name, (same, total, loads) in affinities.items():
        lines.append(f"| {name} | {same} / {total} | {same / total:.0%} | {', '.join(map(str, loads))} | "
                     f"{max_over_mean(loads):.2f} |")
    lines += ["", "Entrance CPU %: user+system of the entrance's process groups over the window (100 % = one core; "
              "nginx+vllm-router: both). RSS at the window's end. Tokens/s: completion tokens of every request "
              "in the window (every stream finishes the request it is in when the time is up; the window ends with the last). Added: the path's TTFT minus direct's at the same concurrency."]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pods", type=int, default=4, help="stand-in vLLM pods")
    parser.add_argument("--concurrency", default="1,8,32", help="client streams per measurement (comma separated)")
    parser.add_argument("--seconds", type=float, default=6.0, help="measured window per path and concurrency")
    parser.add_argument("--max-tokens", type=int, default=256, help="completion tokens per request")
    parser.add_argument("--sessions", type=int, default=10, help="multi-turn sessions for the affinity figure")
    parser.add_argument("--turns", type=int, default=6, help="turns per session")
    parser.add_argument("--tokens-per-s", type=float, default=0.0,
                        help="each pod's decode rate per stream (0: unpaced, the entrance's ceiling; 70: a dual 3090)")
    parser.add_argument("--results", default=str(REPO_ROOT / "bench" / "results.md"), help="markdown file to update")
    args = parser.parse_args()
    concurrency = [int(c) for c in args.concurrency.split(",")]
    CACHE.mkdir(parents=True, exist_ok=True)
    litellm_path, router_path = litellm_venv(), router_venv()
    info = versions(litellm_path, router_path)
    info["nginx"] = nginx_binary()[1]
    results: dict[str, dict[int, dict[str, object]]] = {}
    affinities: dict[str, tuple[int, int, list[int]]] = {}
    with tempfile.TemporaryDirectory(prefix="rigup-entrance-") as tmp, Processes() as procs:
        work = Path(tmp)
        os.chmod(work, 0o700)
        pod_ports = start_pods(procs, args.pods, work, args.tokens_per_s)
        litellm = start_litellm(procs, pod_ports, work)
        router = start_router(procs, pod_ports, work, "cache_aware")
        front, info["nginx"] = start_front(procs, router, work)
        targets = [Target("direct", pod_ports), litellm, router, front]
        for target in targets:  # warm every path (connections, LiteLLM's first-request imports)
            load(target, 1, 1.0, args.max_tokens)
        for streams in concurrency:
            for target in targets:
                window, scrape, cpu, rss = load(target, streams, args.seconds, args.max_tokens)
                results.setdefault(target.name, {})[streams] = {
                    "window": window, "scrape": scrape, "cpu_pct": cpu_percent(cpu, window.seconds), "rss": rss}
                print(f"{target.name:18} x{streams:<3} {window.tokens_per_s:9,.0f} tok/s  TTFT median "
                      f"{window.ttft_median * 1000:6.1f} ms p95 {window.ttft_p95 * 1000:6.1f} ms  CPU "
                      f"{cpu_percent(cpu, window.seconds):4.0f} %  RSS {rss / 1e6:5.0f} MB  scrape {scrape}  "
                      f"failed {window.failures}", flush=True)
        affinities["LiteLLM simple-shuffle"] = session_turns(litellm, pod_ports, args.sessions, args.turns)
        affinities["vllm-router cache_aware"] = session_turns(router, pod_ports, args.sessions, args.turns)
        for policy in ("consistent_hash", "power_of_two", "round_robin"):
            other = start_router(procs, pod_ports, work, policy)
            name = f"vllm-router {policy}" + (" (X-Session-ID)" if policy == "consistent_hash" else "")
            affinities[name] = session_turns(other, pod_ports, args.sessions, args.turns,
                                             session_header=policy == "consistent_hash")
        for name, (same, total, loads) in affinities.items():
            print(f"affinity {name}: {same}/{total}, turns per pod {loads}", flush=True)
    command = (f"python bench/entrance.py --pods {args.pods} --concurrency {args.concurrency} --seconds {args.seconds:g} "
               f"--max-tokens {args.max_tokens} --sessions {args.sessions} --turns {args.turns} "
               f"--tokens-per-s {args.tokens_per_s:g}")
    write_results(Path(args.results), label(args.tokens_per_s),
                  measured(results, affinities, info, command, args.pods, args.tokens_per_s), section=SECTION)
    print(f"written: {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
