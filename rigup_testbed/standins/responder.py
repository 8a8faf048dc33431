#!/usr/bin/python3
"""What a vLLM (or llama.cpp server) container runs in the stand-in Docker engine.

An OpenAI-compatible HTTP server (stdlib http.server) that starts like vLLM does, so health gates and
`rigup verify` meet the same situations as on a rig:

  * startup checks, each failing the container with vLLM's own wording: a local model directory
    (a bind-mounted path) must exist with config.json; --tensor-parallel-size must not exceed the GPUs
    handed to the container; --gpu-memory-utilization x total must fit in each GPU's free memory.
    While it runs, its memory shows in nvidia-smi (memory.used, process list);
  * vLLM-Omni (`vllm serve MODEL --omni --deploy-config FILE`, only in the vllm/vllm-omni image: stock
    vLLM refuses both flags): FILE must be in the container and be a deploy config vLLM-Omni loads (YAML,
    a `stages` list with stage ids; the removed `stage_args` schema is refused), with a stage 0 and every
    stage's devices (what vLLM-Omni would take from the model's bundled configs is not simulated). Each
    stage is an engine on its devices, checked and shown in nvidia-smi like one vLLM engine; /v1/models
    reports stage 0's max_model_len. A chat request is answered by stage 0 (text) only: one whose
    output reaches a later stage (no "modalities", or anything but "text", with several stages) is not
    simulated and, as upstream reports of the talker stage, kills the engine (HTTP 500, then exit 1);
  * the port is published by the daemon from the start (docker-proxy accepts and closes while the
    engine loads), the API answers after `startup_delay_s`;
  * the API itself is rigup_testbed/openai_responder.py (shipped next to this file: /v1/models,
    /v1/chat/completions with streaming, tool calls, reasoning, vLLM's log lines incl. SpecDecoding
    metrics when --speculative-config is given), wrapped with the fault modes below and /version;
    without it, a minimal built-in server (Handler below) answers /health, /version, /metrics,
    /v1/models, /v1/chat/completions and /v1/completions with deterministic text.
    --api-key / VLLM_API_KEY: /v1/* answer 401 without "Authorization: Bearer <key>";
  * /metrics, on both servers and unauthenticated as vLLM's: the engine's metrics (vllm_metrics.py,
    shipped next to this file) of every request either server ran, the scheduler sized by the command
    line (--max-num-seqs, --block-size, --num-gpu-blocks-override, --speculative-config).

Faults come from /etc/rigup-testbed/responder.json, read at start and per request:
  {"mode": "ok" | "fail" | "slow" | "crash" | "garbage", "delay_s": 2, "startup_delay_s": 0, "check_model": true,
   "tokens_per_s": 0, "ttft_ms": 0, "p2p_corrupts_custom_all_reduce": false, "diverge_after_requests": null,
   "spec_decode_acceptance_zero": false}
  fail: /health 500 and completions 500; slow: every answer waits delay_s; crash: exits 1 after start;
  garbage: the engine serves and answers every chat request with "!" until max_tokens, finish_reason=length
  (club-3090 issue #922: "!!!!" for 60 of 60 tokens while topology, Xid and tokens/s looked healthy);
  p2p_corrupts_custom_all_reduce: the rig's peer path returns wrong data to vLLM's custom all-reduce, as in
  #922 (patched P2P module on Ampere), so an engine with --tensor-parallel-size >= 2 and without
  --disable-custom-all-reduce answers garbage, and one with the flag (or TP 1) answers right;
  diverge_after_requests N: after N chat requests the answers drift from the replicas' (drifts());
  spec_decode_acceptance_zero: every draft token is rejected from now on (spec_acceptance_length());
  tokens_per_s / ttft_ms: openai_responder's decode pacing for each request (0: as fast as it can), so
  that load keeps the engine, and through it the GPU stand-in, busy.

Usage: responder.py SPEC.json  (written by dockerd: args, GPUs, listening fds, container socket; or by
container.py's vllm shim when a container's own script runs `exec vllm serve "$@"`: then "args" are the
arguments bash passed and only the published socket of the container port in --port is served).
"""

from __future__ import annotations

import hashlib
import http.server
import io
import json
import os
import signal
import socket
import socketserver
import sys
import threading
import time
from pathlib import Path
from typing import Any

import common

try:  # rigup_testbed/openai_responder.py, shipped next to this file: vLLM's wire behaviour in detail
    import openai_responder as rich
except ImportError:  # pragma: no cover - the package build always ships it when it exists
    rich = None
try:  # standins/vllm_metrics.py: the engine's /metrics
    import vllm_metrics
except ImportError:  # pragma: no cover - an engine package built before the module existed
    vllm_metrics = None

PROCS_DIR = "/run/nvidia-standin/procs"
VLLM_VERSION = "0.11.0"
WORDS = ("The rigup test bed answers deterministically so that checks can compare replies across runs "
         "and hosts without a real model loaded on any GPU at all today").split()


def faults() -> dict[str, Any]:
    data = common.read_json(common.path(common.RESPONDER_FILE), {})
    return data if isinstance(data, dict) else {}


def answers_garbage(f: dict[str, Any], app: Any) -> bool:
    """Whether this engine's answers are club-3090 #922's "!!!!": the garbage mode, or a rig whose peer path
    corrupts custom all-reduce under an engine that runs it (TP >= 2 without --disable-custom-all-reduce)."""
    if f.get("mode") == "garbage":
        return True
    return bool(f.get("p2p_corrupts_custom_all_reduce")) and app is not None and app.custom_all_reduce


def drifts(f: dict[str, Any], server: Any, path: str) -> bool:
    """diverge_after_requests N: after N chat requests this engine's answers drift from its replicas'
    (openai_responder's Config.diverge: right by every judge, different bytes), as a replica whose state
    went bad mid-run would. Counts the chat requests the server has taken."""
    if path.split("?")[0] == "/v1/chat/completions":
        server.chat_requests = getattr(server, "chat_requests", 0) + 1
    after = f.get("diverge_after_requests")
    return isinstance(after, int) and getattr(server, "chat_requests", 0) > after


def spec_acceptance_length(f: dict[str, Any], server: Any) -> float | None:
    """spec_decode_acceptance_zero: the engine's draft tokens are all rejected from now on (mean acceptance
    length 1.0: one token per step, the target's own), as club-3090's "MTP acceptance fell to 0 %" (#922);
    vLLM's counters vllm:spec_decode_num_draft_tokens keep rising while vllm:spec_decode_num_accepted_tokens
    stops (vllm/v1/spec_decode/metrics.py, SpecDecodingProm). Without speculative decoding nothing changes."""
    configured = getattr(server, "configured_acceptance_length", server.config.acceptance_length)
    server.configured_acceptance_length = configured
    return 1.0 if f.get("spec_decode_acceptance_zero") and configured is not None else configured


def log(msg: str, level: str = "INFO") -> None:
    stamp = time.strftime("%m-%d %H:%M:%S")
    sys.stdout.write(f"{level} {stamp} [api_server.py] {msg}\n")
    sys.stdout.flush()


def die(msg: str) -> None:
    sys.stdout.write(f"ERROR {time.strftime('%m-%d %H:%M:%S')} [core.py] EngineCore failed to start.\n")
    sys.stdout.write(f"Traceback (most recent call last):\n  ...\n{msg}\n")
    sys.stdout.flush()
    raise SystemExit(1)


def usage_error(msg: str) -> None:
    """vLLM's argument parser refusing the command line (exit 2, before any engine starts)."""
    sys.stdout.write(f"usage: vllm serve [model_tag] [options]\nvllm serve: error: {msg}\n")
    sys.stdout.flush()
    raise SystemExit(2)


def not_simulated(what: str) -> None:
    die(f"rigup stand-in: {what} is not simulated")


def stage_devices(stage: dict[str, Any]) -> list[int]:
    """A deploy-config stage's `devices` ("0", "0,1", 1) as device indices of the container."""
    text = str(stage["devices"]).replace(" ", "")
    try:
        devices = [int(d) for d in text.split(",")]
    except ValueError:
        die(f"ValueError: stage {stage['stage_id']}: devices {stage['devices']!r} is not a comma-separated list of "
            "device indices")
    if not devices or any(d < 0 for d in devices) or len(set(devices)) != len(devices):
        die(f"ValueError: stage {stage['stage_id']}: devices {stage['devices']!r} must name distinct device indices")
    return devices


def deploy_stages(text: str, where: str) -> list[dict[str, Any]]:
    """The stages of a vLLM-Omni deploy config (`--deploy-config`), checked as vLLM-Omni loads it
    (vllm-project/vllm-omni vllm_omni/config/stage_config.py load_deploy_config: a `stages` list, each
    with a stage_id; the older `stage_args` schema is refused), plus what the stand-in needs to simulate
    the engines: a stage 0 (the one that takes requests) and every stage's devices."""
    try:
        doc = common.load_yaml(text)
    except common.YamlError as exc:
        die(f"rigup stand-in: cannot read the deploy config {where} as YAML: {exc}")
    if not isinstance(doc, dict):
        die(f"ValueError: Deploy config {where} must be a YAML mapping, got {type(doc).__name__}")
    if "stage_args" in doc:
        die(f"ValueError: Deploy config {where} uses the removed `stage_args` schema; define topology in "
            "PipelineConfig and deployment overrides under `stages`.")
    if "base_config" in doc:
        not_simulated(f"a deploy config with base_config ({where})")
    stages = doc.get("stages")
    if not isinstance(stages, list) or not stages or not all(isinstance(st, dict) for st in stages):
        not_simulated(f"a deploy config without a `stages` list of mappings ({where}: vLLM-Omni would take the "
                      "model's bundled stages)")
    for st in stages:
        if "stage_id" not in st:
            die(f"KeyError: 'stage_id' (a stage of the deploy config {where})")
    ids = [st["stage_id"] for st in stages]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids) or len(set(ids)) != len(ids):
        die(f"ValueError: Deploy config {where}: stage ids must be distinct integers, got {ids}")
    if 0 not in ids:
        not_simulated(f"a deploy config without stage 0 ({where}: the stand-in serves the entry stage)")
    for st in stages:
        if "devices" not in st:
            not_simulated(f"stage {st['stage_id']} without devices ({where}: the placement would come from the "
                          "model's bundled deploy config)")
    return sorted(stages, key=lambda st: st["stage_id"])


class App:
    def __init__(self, spec: dict[str, Any]):
        self.spec = spec
        a = spec["args"]
        self.kind = spec["kind"]
        model = a.get("model") or ""
        if self.kind == "llama":
            names = [a["alias"]] if a.get("alias") else [Path(model).name or "model"]
        else:
            names = a.get("served_model_names") or ([model] if model else [])
        self.names: list[str] = names
        self.model = model
        self.api_key = a.get("api_key") or os.environ.get("VLLM_API_KEY") or os.environ.get("LLAMA_API_KEY") or None
        self.max_model_len = int(a.get("max_model_len") or 32768)
        self.tp = int(a.get("tp") or 1)
        self.gpu_util = float(a.get("gpu_util") or 0.9)
        self.spec_decode = bool(a.get("speculative_config"))
        # vLLM runs its custom all-reduce kernel for TP >= 2 unless --disable-custom-all-reduce is given
        self.custom_all_reduce = self.tp >= 2 and not a.get("disable_custom_all_reduce")
        self.image = str(spec.get("image") or "vllm")  # dockerd.image_kind
        self.omni = bool(a.get("omni"))
        self.deploy_config = a.get("deploy_config")
        self.stages: list[dict[str, Any]] | None = None  # vLLM-Omni's, from --deploy-config
        self.procs_files: list[Path] = []
        self.stop: threading.Event | None = None  # main's; set to end the server (a dead engine too)
        self.exit_code = 0
        self.ready = threading.Event()
        self.created = int(time.time())
        self.counters = {"prompt": 0, "generation": 0, "requests": 0}
        self.lock = threading.Lock()
        self.engine: Any = None  # vllm_metrics.EngineStats, once the engine started (startup_checks)
        self.num_speculative_tokens = 3  # vLLM's, from --speculative-config (the rich server's default)

    def host_path(self, container_path: str) -> Path | None:
        """Host path of a container path through the container's bind mounts (longest match)."""
        best = None
        for b in self.spec.get("binds", []):
            dst = b["Destination"].rstrip("/")
            if container_path == dst or container_path.startswith(dst + "/"):
                if best is None or len(dst) > len(best[0]):
                    best = (dst, b["Source"])
        if best is None:
            return None
        return Path(best[1] + container_path[len(best[0]):])

    def omni_checks(self) -> None:
        """vLLM-Omni's command line: --omni only in its image, an explicit model, a deploy config to read."""
        if self.image != "vllm-omni":
            extra = [t for t in ("--omni",) if self.omni] + ([f"--deploy-config {self.deploy_config}"]
                                                             if self.deploy_config else [])
            usage_error(f"unrecognized arguments: {' '.join(extra)}")  # stock vLLM has neither
        if not self.omni:
            not_simulated("--deploy-config without --omni")
        if not self.model:
            die("ValueError: `vllm serve --omni` requires an explicit model. Pass it positionally (`vllm serve "
                "<model> --omni`) or via `--model`.")
        if not self.deploy_config:
            not_simulated("vllm serve --omni without --deploy-config (vLLM-Omni's bundled deploy configs)")
        where = str(self.deploy_config)
        text = self.spec.get("deploy_config_text")  # container.py read it in the container's root
        if text is None:
            hp = self.host_path(where)
            if hp is None or not hp.is_file():
                die(f"FileNotFoundError: [Errno 2] No such file or directory: {where!r} (--deploy-config; nothing "
                    "mounted there)")
            text = hp.read_text()
        self.stages = deploy_stages(text, where)
        entry = self.stages[0]
        if entry.get("max_model_len") is not None:
            self.max_model_len = int(entry["max_model_len"])
        log(f"vLLM-Omni: {len(self.stages)} stage(s) from {where}: " + ", ".join(
            f"stage {st['stage_id']} on device(s) {st['devices']}" for st in self.stages))

    def placements(self, gpus: list[dict[str, Any]]) -> list[tuple[str, list[dict[str, Any]], float]]:
        """(engine, its GPUs, gpu_memory_utilization) of every engine this server starts, in start order:
        one tensor-parallel engine, or with a deploy config one per stage on the stage's devices."""
        if self.stages is None:
            if self.tp > len(gpus):
                die(f"ValueError: The number of required GPUs exceeds the total number of available GPUs in the "
                    f"placement group. (tensor_parallel_size={self.tp}, available={len(gpus)})")
            return [("VLLM::EngineCore" if self.kind == "vllm" else "llama-server", gpus[: self.tp], self.gpu_util)]
        out = []
        for st in self.stages:
            devices = stage_devices(st)
            if max(devices) >= len(gpus):
                die(f"RuntimeError: CUDA error: invalid device ordinal (stage {st['stage_id']} devices "
                    f"{st['devices']!r}; the container has {len(gpus)} GPU(s))")
            tp = int(st.get("tensor_parallel_size") or 1)
            if tp > len(devices):
                die(f"ValueError: stage {st['stage_id']}: tensor_parallel_size={tp} exceeds its devices "
                    f"{st['devices']!r}")
            # vLLM's default utilisation when a stage sets none
            out.append((f"VLLM::Stage{st['stage_id']}", [gpus[d] for d in devices],
                        float(st.get("gpu_memory_utilization") or 0.9)))
        return out

    def startup_checks(self, f: dict[str, Any]) -> None:
        if self.kind == "vllm" and (self.omni or self.deploy_config):
            self.omni_checks()
        if self.kind == "vllm" and not self.model:
            die("vllm serve: error: the following arguments are required: model_tag")
        if self.model.startswith("/") and f.get("check_model", True):
            hp = self.host_path(self.model)
            if hp is None or not (hp / "config.json").is_file():
                die(f"OSError: Incorrect path_or_model_id: '{self.model}'. Please provide either the path to a local "
                    "folder or the repo_id of a model on the Hub.")
        # The container's GPUs in its own order (device 0 is the first one it was given).
        by_uuid = {g["uuid"]: g for g in common.hardware().get("gpus", [])}
        gpus = [by_uuid[u] for u in self.spec.get("gpus", []) if u in by_uuid]
        if not gpus:
            die("RuntimeError: Failed to infer device type")
        ray_world = self.spec.get("ray_world")
        if ray_world is not None:
            # RayExecutorV2 (vllm_entry.py): the engine core holds no GPU (require_gpu_on_driver=False); each
            # rank took one on its own node and registered it there (ray_cluster.place_workers), so the
            # world's size is no bound on this container's GPUs and nothing is registered here
            if vllm_metrics is not None and self.kind == "vllm" and self.names:
                self.engine = vllm_metrics.engine_for(self.spec["args"], self.names[0], self.max_model_len, gpus,
                                                      self.gpu_util)
                self.num_speculative_tokens = self.engine.num_speculative_tokens or self.num_speculative_tokens
            return
        engines = self.placements(gpus)
        if vllm_metrics is not None and self.kind == "vllm" and self.names:
            # the engine that takes the requests (stage 0's, with a deploy config): its metrics
            _, entry_gpus, entry_util = engines[0]
            self.engine = vllm_metrics.engine_for(self.spec["args"], self.names[0], self.max_model_len, entry_gpus,
                                                  entry_util)
            self.num_speculative_tokens = self.engine.num_speculative_tokens or self.num_speculative_tokens
        used_by_others: dict[str, int] = {}
        d = common.path(PROCS_DIR)
        # In a container the pid is the container's own (often 1): the namespace tells whose it is.
        pidns = common.own_pidns()
        tag = "".join(ch for ch in pidns if ch.isdigit())
        for pf in d.glob("*.json") if d.is_dir() else []:
            e = common.read_json(pf, {}) or {}
            mine_too = int(e.get("pid") or 0) == os.getpid() and e.get("pidns", pidns) == pidns
            if e.get("pid") and not mine_too and common.registration_alive(e):
                for u in e.get("gpus", []):
                    used_by_others[u] = used_by_others.get(u, 0) + int(e.get("used_mib", 0))
        # Engines start in order, each checking its budget against what is free then (earlier stages included).
        taken: dict[str, int] = {}
        for _, mine, util in engines:
            for g in mine:
                total = int(g["memory_total_mib"])
                free = total - int(g.get("memory_used_mib", 0)) - used_by_others.get(g["uuid"], 0) - taken.get(g["uuid"], 0)
                want = int(util * total)
                if want > free:
                    die(f"ValueError: Free memory on device cuda:{g['index']} ({free / 1024:.2f}/{total / 1024:.2f} GiB) "
                        f"on startup is less than desired GPU memory utilization ({util}, {want / 1024:.2f} GiB). "
                        "Decrease GPU memory utilization or reduce GPU memory used by other processes.")
                taken[g["uuid"]] = taken.get(g["uuid"], 0) + want
        for n, (name, mine, util) in enumerate(engines):
            pf = d / (f"{tag}-{os.getpid()}.json" if n == 0 else f"{tag}-{os.getpid()}-{n}.json")
            common.write_json_atomic(pf, {"pid": os.getpid(), "pidns": pidns, "starttime": common.proc_starttime(), "name": name, "gpus": [g["uuid"] for g in mine],
                                          "used_mib": int(util * int(mine[0]["memory_total_mib"])),
                                          "activity": common.activity_record(None, False, time.time())})
            self.procs_files.append(pf)
        if self.engine is not None:
            self.engine.on_busy = self.record_activity

    def record_activity(self, busy: bool) -> None:
        """The engine started or stopped having a request running: its GPUs' registrations say so, and
        nvidia-smi and the DCGM exporter read utilisation, power and temperature from that (common.activity_at)."""
        now = time.time()
        for pf in self.procs_files:
            entry = common.read_json(pf, None)
            if isinstance(entry, dict):
                entry["activity"] = common.activity_record(entry.get("activity"), busy, now)
                common.write_json_atomic(pf, entry)

    def output_refusal(self, req: dict[str, Any]) -> str | None:
        """Why the stand-in cannot answer this chat request (None: it can). vLLM-Omni sends a request through
        the stages that produce its output modalities (the request's `modalities`, else every stage's
        final output): the stand-in simulates stage 0's text only, so a request that reaches a later stage
        (audio: the talker and vocoder) is not simulated."""
        if self.stages is None:
            return None
        wanted = req.get("modalities")
        if wanted is not None and (not isinstance(wanted, list) or not all(isinstance(m, str) for m in wanted)):
            return "invalid"
        if len(self.stages) == 1 or (wanted and set(wanted) <= {"text"}):
            return None
        later = ", ".join(str(st["stage_id"]) for st in self.stages[1:])
        asked = f"modalities {wanted}" if wanted is not None else "no modalities (every stage's output)"
        return (f"a chat request with {asked} goes through stage(s) {later} of the deploy config, whose output "
                f"(beyond stage 0's text) is not simulated; the stand-in serves stage 0's text (send "
                f"\"modalities\": [\"text\"])")

    def engine_dead(self, reason: str) -> None:
        """The engine died under a request (as vLLM-Omni's does when a request reaches a stage that crashes):
        the server exits 1 once the error answer is sent."""
        sys.stdout.write(f"ERROR {time.strftime('%m-%d %H:%M:%S')} [core.py] EngineCore encountered a fatal error.\n"
                         f"rigup stand-in: {reason}\n")
        sys.stdout.flush()
        self.exit_code = 1
        if self.stop is not None:
            self.stop.set()

    def status(self, state: str) -> None:
        common.write_json_atomic(Path(self.spec["status_file"]), {"state": state, "pid": os.getpid(), "ts": time.time()})


def refuse_output(handler: Any, app: App, req: dict[str, Any]) -> bool:
    """Answer a chat request the stand-in cannot serve (App.output_refusal) the way the engine would; True
    when it did. One that reaches an unsimulated stage kills the engine, as upstream reports of vLLM-Omni's
    talker stage (club-3090 models/qwen3-omni-30b-a3b/vllm-omni/README.md@4a29ab57, Troubleshooting)."""
    why = app.output_refusal(req)
    if why is None:
        return False
    if why == "invalid":
        handler.send_json(400, {"object": "error", "message": "modalities: Input should be a valid list of strings",
                                "type": "BadRequestError", "param": "modalities", "code": 400})
        return True
    handler.send_json(500, {"object": "error", "message": f"EngineCore encountered an issue. rigup stand-in: {why}",
                            "type": "InternalServerError", "param": None, "code": 500})
    handler.wfile.flush()
    handler.close_connection = True
    app.engine_dead(why)
    return True


class NoRequest:
    """An engine request when no engine stats are kept (vllm_metrics.py missing, a llama.cpp server)."""

    def __enter__(self) -> NoRequest:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def wait_scheduled(self) -> float:
        return time.monotonic()

    def emit(self, n: int = 1) -> None:
        pass

    def finish(self, reason: str) -> None:
        pass


def tokens_of(text: str) -> int:
    return max(1, len(text.split()))


def reply_text(seed: str, n: int) -> str:
    h = hashlib.sha256(seed.encode()).hexdigest()
    start = int(h[:4], 16) % len(WORDS)
    return " ".join(WORDS[(start + i) % len(WORDS)] for i in range(n))


class Handler(http.server.BaseHTTPRequestHandler):
    server: Any
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        addr = self.client_address[0] if isinstance(self.client_address, tuple) else "container"
        log(f'{addr} - "{self.command} {self.path} {self.request_version}" {args[1] if len(args) > 1 else ""}')

    @property
    def app(self) -> App:
        return self.server.app

    def send_json(self, status: int, data: Any) -> None:
        body = json.dumps(data).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def authorized(self) -> bool:
        if not self.app.api_key or not self.path.startswith("/v1"):
            return True
        if self.headers.get("Authorization", "") == f"Bearer {self.app.api_key}":
            return True
        self.send_json(401, {"error": "Unauthorized"})
        return False

    def pre(self) -> dict[str, Any] | None:
        f = faults()
        if f.get("mode") == "slow":
            time.sleep(float(f.get("delay_s", 2)))
        return f

    def do_GET(self) -> None:  # noqa: N802
        f = self.pre() or {}
        path = self.path.split("?")[0]
        if path == "/health":
            if f.get("mode") == "fail":
                self.send_json(500, {"error": "EngineDeadError"})
                return
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif path == "/version":
            self.send_json(200, {"version": VLLM_VERSION})
        elif path == "/metrics":
            body = self.metrics().encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        elif path == "/v1/models":
            if not self.authorized():
                return
            self.send_json(200, {"object": "list", "data": [
                {"id": n, "object": "model", "created": self.app.created, "owned_by": "vllm",
                 "root": self.app.model or n, "parent": None, "max_model_len": self.app.max_model_len,
                 "permission": [{"id": "modelperm-" + hashlib.sha256(n.encode()).hexdigest()[:32],
                                 "object": "model_permission", "created": self.app.created,
                                 "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                                 "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                                 "organization": "*", "group": None, "is_blocking": False}]}
                for n in self.app.names]})
        else:
            self.send_json(404, {"detail": "Not Found"})

    def do_POST(self) -> None:  # noqa: N802
        f = self.pre() or {}
        path = self.path.split("?")[0]
        if path not in ("/v1/chat/completions", "/v1/completions"):
            self.send_json(404, {"detail": "Not Found"})
            return
        if not self.authorized():
            return
        try:
            length = int(self.headers.get("Content-Length") or 0)
            req = json.loads(self.rfile.read(length) or b"{}")
            if not isinstance(req, dict):
                raise ValueError("body must be a JSON object")
        except ValueError as exc:
            self.send_json(400, {"object": "error", "message": f"JSON decode error: {exc}", "type": "BadRequestError",
                                 "param": None, "code": 400})
            return
        model = req.get("model", self.app.names[0] if self.app.names else "")
        if model not in self.app.names:
            self.send_json(404, {"object": "error", "message": f"The model `{model}` does not exist.",
                                 "type": "NotFoundError", "param": "model", "code": 404})
            return
        chat = path == "/v1/chat/completions"
        if chat:
            messages = req.get("messages")
            if not isinstance(messages, list) or not messages:
                self.send_json(400, {"object": "error", "message": "messages: Field required", "type": "BadRequestError",
                                     "param": None, "code": 400})
                return
            if refuse_output(self, self.app, req):
                return
            prompt = " ".join(str(m.get("content", "")) for m in messages if isinstance(m, dict))
            prompt_tokens = tokens_of(prompt) + 4 * len(messages)
        else:
            prompt = str(req.get("prompt", ""))
            prompt_tokens = tokens_of(prompt)
        max_tokens = int(req.get("max_completion_tokens") or req.get("max_tokens") or 16)
        if prompt_tokens + max_tokens > self.app.max_model_len:
            self.send_json(400, {"object": "error", "type": "BadRequestError", "param": None, "code": 400, "message":
                                 f"This model's maximum context length is {self.app.max_model_len} tokens. However, you "
                                 f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, "
                                 f"{max_tokens} in the completion). Please reduce the length of the messages or completion."})
            return
        if f.get("mode") == "fail":
            self.send_json(500, {"object": "error", "message": "EngineCore encountered an issue. See stack trace (above) "
                                 "for the root cause.", "type": "InternalServerError", "param": None, "code": 500})
            return
        n = min(max_tokens, 16)  # a natural answer is 16 words; fewer tokens allowed cut it short
        text = reply_text(json.dumps(req.get("messages", prompt), sort_keys=True), n)
        garbage = answers_garbage(f, self.app)
        if garbage:  # "!" until max_tokens, as openai_responder's --garbage
            n, text = max_tokens, "!" * max_tokens
        with self.app.lock:
            self.app.counters["prompt"] += prompt_tokens
            self.app.counters["generation"] += n
            self.app.counters["requests"] += 1
        rid = ("chatcmpl-" if chat else "cmpl-") + hashlib.sha256(f"{time.time()}{text}".encode()).hexdigest()[:32]
        usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + n, "completion_tokens": n,
                 "prompt_tokens_details": None}
        finish = "length" if max_tokens < 16 or garbage else "stop"
        # the engine's view: queued, scheduled, one token a step, finished (aborted if the client goes)
        with self.app.engine.add_request(prompt_tokens, prompt, max_tokens) if self.app.engine else NoRequest() as run:
            run.wait_scheduled()
            if req.get("stream"):
                self.stream(rid, model, chat, text, usage, finish,
                            bool((req.get("stream_options") or {}).get("include_usage")), run)
            else:
                for _ in range(n):
                    run.emit(1)
                run.finish(finish)  # counted before the answer leaves, as vLLM's engine does
                self.answer(rid, model, chat, text, usage, finish)

    def answer(self, rid: str, model: str, chat: bool, text: str, usage: dict[str, Any], finish: str) -> None:
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "reasoning_content": None, "content": text,
                                              "tool_calls": []}, "logprobs": None, "finish_reason": finish,
                      "stop_reason": None}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None}
            obj = "text_completion"
        self.send_json(200, {"id": rid, "object": obj, "created": int(time.time()), "model": model,
                             "choices": [choice], "usage": usage, "prompt_logprobs": None})

    def stream(self, rid: str, model: str, chat: bool, text: str, usage: dict[str, Any], finish: str,
               include_usage: bool, run: Any) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        obj = "chat.completion.chunk" if chat else "text_completion"
        created = int(time.time())

        def chunk(choices: list[Any], extra: dict[str, Any] | None = None) -> None:
            data = {"id": rid, "object": obj, "created": created, "model": model, "choices": choices, **(extra or {})}
            self.wfile.write(f"data: {json.dumps(data)}\n\n".encode())
            self.wfile.flush()

        words = text.split(" ")
        if chat:
            chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}])
        for i, w in enumerate(words):
            piece = w if i == 0 else " " + w
            last = i == len(words) - 1
            run.emit(1)
            if last:
                run.finish(finish)  # counted before the last chunk leaves, as vLLM's engine does
            if chat:
                chunk([{"index": 0, "delta": {"content": piece}, "logprobs": None,
                        "finish_reason": finish if last else None}])
            else:
                chunk([{"index": 0, "text": piece, "logprobs": None, "finish_reason": finish if last else None}])
        if include_usage:
            chunk([], {"usage": usage})
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()

    def metrics(self) -> str:
        if self.app.engine is not None:
            return self.app.engine.render()
        c = self.app.counters
        name = self.app.names[0] if self.app.names else ""
        lab = f'{{engine="0",model_name="{name}"}}'
        lines = [
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge", f"vllm:num_requests_running{lab} 0.0",
            "# TYPE vllm:prompt_tokens_total counter", f"vllm:prompt_tokens_total{lab} {float(c['prompt'])}",
            "# TYPE vllm:generation_tokens_total counter", f"vllm:generation_tokens_total{lab} {float(c['generation'])}",
            "# TYPE vllm:request_success_total counter",
            f'vllm:request_success_total{{engine="0",finished_reason="stop",model_name="{name}"}} {float(c["requests"])}',
        ]
        if self.app.spec_decode:
            drafts = c["generation"] // 3
            lines += ["# TYPE vllm:spec_decode_num_drafts_total counter", f"vllm:spec_decode_num_drafts_total{lab} {float(drafts)}",
                      "# TYPE vllm:spec_decode_num_accepted_tokens_total counter",
                      f"vllm:spec_decode_num_accepted_tokens_total{lab} {float(drafts * 2)}"]
        return "\n".join(lines) + "\n"


class TCPServer(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True


if rich is not None:

    class FaultHandler(rich.Handler):  # type: ignore[name-defined,misc]
        """openai_responder's vLLM behaviour, plus the test bed's fault modes and vLLM's /version."""

        def do_GET(self) -> None:  # noqa: N802
            f = faults()
            if f.get("mode") == "slow":
                time.sleep(float(f.get("delay_s", 2)))
            path = self.path.split("?")[0]
            names = getattr(self.server, "names", [])
            if path == "/health" and f.get("mode") == "fail":
                self.send_json(500, {"error": "EngineDeadError"})
            elif path == "/version":
                self.send_json(200, {"version": VLLM_VERSION})
            elif path == "/v1/models" and len(names) > 1 and self.authorised():  # several --served-model-name
                config = self.server.config
                self.send_json(200, {"object": "list", "data": [
                    {"id": n, "object": "model", "created": self.server.created, "owned_by": "vllm",
                     "root": self.server.model_path or n, "parent": None, "max_model_len": config.max_model_len}
                    for n in names]})
                self.access(200)
            else:
                super().do_GET()

        def do_POST(self) -> None:  # noqa: N802
            f = faults()
            if f.get("mode") == "slow":
                time.sleep(float(f.get("delay_s", 2)))
            # a decode rate makes requests take the time a GPU takes, so load keeps the engine busy
            self.server.config.tokens_per_s = float(f.get("tokens_per_s") or 0)
            self.server.config.ttft_ms = float(f.get("ttft_ms") or 0)
            self.server.config.garbage = answers_garbage(f, getattr(self.server, "app", None))
            self.server.config.diverge = drifts(f, self.server, self.path)
            self.server.config.acceptance_length = spec_acceptance_length(f, self.server)
            if f.get("mode") == "fail" and self.path.startswith("/v1/"):
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(length)
                self.send_json(500, {"object": "error", "message": "EngineCore encountered an issue. See stack trace "
                                     "(above) for the root cause.", "type": "InternalServerError", "param": None,
                                     "code": 500})
                return
            names = getattr(self.server, "names", [])
            app = getattr(self.server, "app", None)
            # vLLM-Omni: what the request asks for decides which stages it reaches (App.output_refusal)
            staged = app is not None and app.stages is not None and self.path.split("?")[0] == "/v1/chat/completions"
            if len(names) > 1 or staged:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length)
                try:
                    req = json.loads(raw)
                except ValueError:
                    req = None
                if isinstance(req, dict):
                    if staged and self.authorised() and req.get("model", names[0]) in names \
                            and refuse_output(self, app, req):
                        return
                    if req.get("model") in names[1:]:  # any served name reaches the one model openai_responder serves
                        req["model"] = names[0]
                        raw = json.dumps(req).encode()
                self.headers.replace_header("Content-Length", str(len(raw)))
                # the (possibly rewritten) body for this request only: the connection stays open for the
                # client's next request, as vLLM's server keeps it (closing it unannounced drops a client
                # that reuses it)
                connection_reader, self.rfile = self.rfile, io.BytesIO(raw)
                try:
                    super().do_POST()
                finally:
                    self.rfile = connection_reader
                return
            super().do_POST()

    class BoundResponder(rich.Responder):  # type: ignore[name-defined,misc]
        """openai_responder.Responder on a socket the daemon already bound (the published port)."""

        def __init__(self, sock: socket.socket, config: Any, metrics: Any = None):
            self._bound = sock
            super().__init__(sock.getsockname()[:2], config, metrics)
            self.RequestHandlerClass = FaultHandler

        def server_bind(self) -> None:
            self.socket.close()
            self.socket = self._bound
            self.server_address = self.socket.getsockname()
            self.server_name, self.server_port = str(self.server_address[0]), int(self.server_address[1])

        def server_activate(self) -> None:
            self.socket.listen(64)


def tcp_server(sock: socket.socket, app: App) -> Any:
    """The HTTP server on one published socket: openai_responder's when shipped, else the minimal one."""
    if rich is not None and app.names:
        config = rich.Config(model=app.names[0], max_model_len=app.max_model_len, api_key=app.api_key,
                             acceptance_length=3.40 if app.spec_decode else None,
                             num_speculative_tokens=app.num_speculative_tokens)
        srv = BoundResponder(sock, config, app.engine)
        srv.names, srv.model_path = list(app.names), app.model
        return srv
    srv = TCPServer(sock.getsockname()[:2], Handler, bind_and_activate=False)
    srv.socket.close()
    srv.socket = sock
    return srv


class UnixServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


def serve(server: Any, app: App) -> None:
    server.app = app
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True).start()


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    app = App(spec)
    f = faults()
    stop = threading.Event()
    app.stop = stop
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    app.status("starting")
    log(f"vLLM API server version {VLLM_VERSION}" if app.kind == "vllm" else "llama server starting")
    log(f"args: model={app.model!r} served_model_name={app.names} tensor_parallel_size={app.tp} "
        f"max_model_len={app.max_model_len}")
    if spec.get("argv"):
        log(f"non-default args: {spec['argv'][1:]!r}")

    # The daemon's published sockets accept from the first moment (docker-proxy); until the engine is up
    # a connection is closed at once, which clients see as "Empty reply from server".
    # Started from a container's own command line (container.py), only the container port the server
    # listens on (--port) reaches it; other published ports keep closing connections.
    serve_port = spec.get("serve_port")
    listen = spec.get("listen", [])
    published = [socket.socket(fileno=entry["fd"]) for entry in listen
                 if serve_port is None or int(entry["container_port"]) == int(serve_port)]
    unserved = [socket.socket(fileno=entry["fd"]) for entry in listen
                if serve_port is not None and int(entry["container_port"]) != int(serve_port)]
    early_stop = threading.Event()
    never = threading.Event()

    def reject(sock: socket.socket, until: threading.Event) -> None:
        sock.settimeout(0.2)
        while not until.is_set():
            try:
                conn, _ = sock.accept()
                conn.close()
            except (TimeoutError, OSError):
                continue

    rejecters = [threading.Thread(target=reject, args=(s, early_stop), daemon=True) for s in published]
    for t in rejecters + [threading.Thread(target=reject, args=(s, never), daemon=True) for s in unserved]:
        t.start()
    app.startup_checks(f)
    delay = float(f.get("startup_delay_s", 0) or 0)
    if stop.wait(delay):
        return 0
    if f.get("mode") == "crash":
        die("RuntimeError: CUDA error: an illegal memory access was encountered (rigup fault mode 'crash')")
    early_stop.set()
    for t in rejecters:
        t.join()
    for s in published:
        s.settimeout(None)
        serve(tcp_server(s, app), app)
    if spec.get("network_mode") == "host":
        host = spec["args"].get("host") or "0.0.0.0"
        port = int(spec["args"].get("port") or (8080 if app.kind == "llama" else 8000))
        try:
            s = socket.create_server((host, port), reuse_port=False)
        except OSError as exc:
            die(f"OSError: [Errno {exc.errno}] error while attempting to bind on address ('{host}', {port}): {exc.strerror}")
        serve(tcp_server(s, app), app)
    ctr = Path(spec["ctr_socket"])
    if ctr.exists():
        ctr.unlink()
    serve(UnixServer(str(ctr), Handler), app)
    app.status("serving")
    log("Application startup complete.")
    stop.wait()
    log("Shutting down" if not app.exit_code else "EngineDeadError: the engine died; the API server exits")
    for pf in app.procs_files:
        try:
            pf.unlink()
        except OSError:
            pass
    app.status("stopped")
    return app.exit_code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
