"""vLLM's engine metrics, kept and rendered as the stand-in vLLM servers serve them at /metrics.

The stand-ins (responder.py's built-in server, rigup_testbed/openai_responder.py) record every request
they serve here, at the moments the engine would: queued on arrival, scheduled when a slot and KV-cache
blocks are free, prefill done at the first token, one engine step per chunk of tokens, finished. What
/metrics answers is derived from that, at scrape time:

  * the metric families of vLLM 0.27.1's V1 engine (vllm/v1/metrics/loggers.py PrometheusStatLogger,
    vllm/v1/spec_decode/metrics.py SpecDecodingProm, vllm/v1/metrics/perf.py PerfMetricsProm; facts and
    commits in rigup_testbed/FACTS.md, section 11): names, types, label names, histogram buckets, in
    vLLM's registration order, with help texts of the same meaning in our own words;
  * rendered as prometheus_client renders its default registry in the text format 0.0.4 (what vLLM's
    /metrics answers a scraper that asks for nothing else): counters as NAME_total plus a NAME_created
    gauge, histograms as _bucket{le=...} (cumulative, +Inf last), _count, _sum and a _created gauge,
    label names sorted, Go-style floats;
  * values that move with what is served: running and waiting requests (a scheduler with max_num_seqs
    slots and a pool of KV-cache blocks, FCFS, preempting a request that cannot grow), KV-cache usage
    (blocks held by running requests over the pool), prefix-cache queries and hits (block hashes of the
    prompt text, least recently used first out), token counters, and histograms of each request's
    measured time to first token, inter-token gaps, queue/prefill/decode/inference/end-to-end times.

The KV pool is a simplification: real vLLM sizes it from the GPU memory left after the weights, which
the stand-in cannot know; here it is --num-gpu-blocks-override when given, else max_model_len x
max_num_seqs tokens (what the engine needs to hold every sequence at full length). Standard library only:
it runs on the images' Python and on the hosts'.
"""

from __future__ import annotations

import hashlib
import math
import threading
import time
from collections import OrderedDict, deque
from typing import Any, Iterable, Sequence

VLLM_METRICS_VERSION = "0.27.1"  # the vLLM release whose metrics these are (FACTS.md section 11)

LABELS = ("model_name", "engine")
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")  # vllm/v1/engine FINISH_REASON_STRINGS
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")  # PromptTokenStats.ALL_SOURCES
WAITING_REASONS = ("capacity", "deferred")
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_PARAM_BUCKETS = (1, 2, 5, 10, 20)
DEFAULT_BLOCK_SIZE = 16
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def buckets_1_2_5(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's buckets for token counts up to max_model_len)."""
    out: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > limit:
                return out
            out.append(mantissa * scale)
        scale *= 10


def go_float(value: float) -> str:
    """A sample value or bucket bound as Prometheus's Go clients print it (and prometheus_client copies):
    Python's shortest repr, switched to an exponent once the integer part has more than six digits."""
    value = float(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    text = repr(value)
    point = text.find(".")
    if value > 0 and point > 6:
        digits = text[:point] + text[point + 1:]
        mantissa = (digits[0] + "." + digits[1:]).rstrip("0").rstrip(".")
        return f"{mantissa}e+0{point - 1}"
    return text


def _escape_value(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(pairs: Iterable[tuple[str, str]]) -> str:
    items = sorted(pairs)
    return "{" + ",".join(f'{k}="{_escape_value(v)}"' for k, v in items) + "}" if items else ""


# --- the exposition ------------------------------------------------------------------------------------


class Series:
    """One labelled child of a family: a value, or a histogram's bucket counts, sum and count."""

    def __init__(self, family: Family, values: tuple[str, ...]):
        self.family = family
        self.labels = tuple(zip(family.labelnames, values))
        self.created = time.time()
        self.value = 0.0
        self.counts = [0] * len(family.buckets)  # per bucket (not cumulative); the last is +Inf
        self.total = 0.0
        self.count = 0

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("counters only go up")
        self.value += amount

    def set(self, value: float) -> None:
        self.value = float(value)

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.family.buckets):
            if value <= bound:
                self.counts[i] += 1
                break
        self.total += value
        self.count += 1


class Family:
    """A metric family: name, type, help, label names, buckets (histograms), and its children."""

    def __init__(self, name: str, kind: str, doc: str, labelnames: Sequence[str] = LABELS,
                 buckets: Sequence[float] = ()):
        if kind == "counter" and name.endswith("_total"):
            name = name[: -len("_total")]  # prometheus_client keeps a counter's base name and adds _total back
        self.name, self.kind, self.doc = name, kind, doc
        self.labelnames = tuple(labelnames)
        self.buckets = tuple(float(b) for b in buckets) + ((math.inf,) if kind == "histogram" else ())
        self.children: dict[tuple[str, ...], Series] = {}

    def child(self, *values: object) -> Series:
        key = tuple(str(v) for v in values)
        if len(key) != len(self.labelnames):
            raise ValueError(f"{self.name}: {len(self.labelnames)} label values expected, got {len(key)}")
        if key not in self.children:
            self.children[key] = Series(self, key)
        return self.children[key]

    def render(self, out: list[str]) -> None:
        doc = self.doc.replace("\\", "\\\\").replace("\n", "\\n")
        exposed = self.name + "_total" if self.kind == "counter" else self.name
        out.append(f"# HELP {exposed} {doc}\n# TYPE {exposed} {self.kind}\n")
        for series in self.children.values():
            if self.kind == "histogram":
                cumulative = 0
                for bound, n in zip(self.buckets, series.counts):
                    cumulative += n
                    le = (("le", go_float(bound)),)
                    out.append(f"{self.name}_bucket{_labels(series.labels + le)} {go_float(cumulative)}\n")
                out.append(f"{self.name}_count{_labels(series.labels)} {go_float(series.count)}\n")
                out.append(f"{self.name}_sum{_labels(series.labels)} {go_float(series.total)}\n")
            else:
                out.append(f"{exposed}{_labels(series.labels)} {go_float(series.value)}\n")
        if self.kind in ("counter", "histogram") and self.children:
            out.append(f"# HELP {self.name}_created {doc}\n# TYPE {self.name}_created gauge\n")
            for series in self.children.values():
                out.append(f"{self.name}_created{_labels(series.labels)} {go_float(series.created)}\n")


class Registry:
    def __init__(self) -> None:
        self.families: list[Family] = []

    def add(self, name: str, kind: str, doc: str, labelnames: Sequence[str] = LABELS,
            buckets: Sequence[float] = ()) -> Family:
        family = Family(name, kind, doc, labelnames, buckets)
        self.families.append(family)
        return family

    def render(self) -> str:
        out: list[str] = []
        for family in self.families:
            family.render(out)
        return "".join(out)


# --- the engine ------------------------------------------------------------------------------------


def default_max_num_seqs(gpu_memory_mib: int | None, gpu_name: str = "") -> int:
    """vLLM's default --max-num-seqs for the OpenAI server: 1024 on a GPU of 70 GiB or more that is not an
    A100, else 256 (vllm/engine/arg_utils.py, 0.27.1)."""
    if gpu_memory_mib is not None and gpu_memory_mib * 2**20 >= 70 * 2**30 and "a100" not in gpu_name.lower():
        return 1024
    return 256


QUEUED, RUNNING, DONE = "queued", "running", "done"


class Request:
    """One request in the engine, from arrival to finish. The server calls wait_scheduled() before its
    first token, emit(n) for each engine step's n new tokens, and finish(reason) at the end (or leaves
    the `with` block, which aborts a request that did not finish)."""

    def __init__(self, engine: EngineStats, prompt_tokens: int, prompt_text: str, max_tokens: int | None,
                 arrival: float | None = None):
        self.engine = engine
        self.prompt_tokens = max(1, int(prompt_tokens))
        self.prompt_text = prompt_text
        self.max_tokens = max_tokens
        self.queued_ts = time.monotonic()
        self.arrival = self.queued_ts if arrival is None else min(arrival, self.queued_ts)
        self.scheduled_ts: float | None = None
        self.first_token_ts: float | None = None
        self.last_token_ts: float | None = None
        self.generated = 0
        self.blocks = 0
        self.hit_tokens = 0
        self.state = QUEUED
        self.preempted = False

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.generated

    def wait_scheduled(self, timeout: float | None = None) -> float:
        """Block until the scheduler runs this request; returns when (time.monotonic())."""
        with self.engine.cond:
            self.engine.cond.wait_for(lambda: self.state != QUEUED, timeout)
            return self.scheduled_ts if self.scheduled_ts is not None else time.monotonic()

    def emit(self, n: int = 1) -> None:
        """An engine step produced `n` new tokens of this request (the first call ends its prefill)."""
        self.engine._emit(self, n)

    def finish(self, reason: str) -> None:
        self.engine._finish(self, reason)

    def __enter__(self) -> Request:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.state != DONE:
            self.finish("abort")


class EngineStats:
    """One vLLM engine (engine index 0) of a served model: its scheduler state and metric families."""

    def __init__(self, model_name: str, max_model_len: int, *, max_num_seqs: int = 256,
                 block_size: int = DEFAULT_BLOCK_SIZE, num_gpu_blocks_override: int | None = None,
                 gpu_memory_utilization: float = 0.92, enable_prefix_caching: bool = True, cache_dtype: str = "auto",
                 num_speculative_tokens: int | None = None, engine: int = 0, chars_per_token: int | None = None):
        self.model_name = model_name
        # characters per token when the server counts tokens at a fixed rate (openai_responder: 4); None:
        # the prompt text is cut into blocks in proportion to its tokens
        self.chars_per_token = chars_per_token
        self.max_model_len = int(max_model_len)
        self.max_num_seqs = max(1, int(max_num_seqs))
        self.block_size = max(1, int(block_size))
        # +1: vLLM's pool keeps one null block, which usage does not count
        self.num_gpu_blocks = int(num_gpu_blocks_override) if num_gpu_blocks_override else (
            math.ceil(self.max_model_len * self.max_num_seqs / self.block_size) + 1)
        self.prefix_caching = enable_prefix_caching
        self.num_speculative_tokens = num_speculative_tokens
        self.cond = threading.Condition()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.used_blocks = 0
        self.cached: OrderedDict[bytes, None] = OrderedDict()  # prefix-cache block hashes, least recent first
        self.registry = Registry()
        self._families(engine, gpu_memory_utilization, cache_dtype, num_gpu_blocks_override)
        # called (under the engine's lock) when the engine starts or stops having a request running: how
        # the responder makes its GPUs' utilisation, power and temperature follow what it serves
        self.on_busy: Any = None
        self._busy = False

    # --- the families, in vLLM's registration order

    def _families(self, engine: int, gpu_util: float, cache_dtype: str, override: int | None) -> None:
        r, lv = self.registry, (self.model_name, str(engine))
        buckets_len = buckets_1_2_5(self.max_model_len)

        def per_engine(name: str, kind: str, doc: str, buckets: Sequence[float] = ()) -> Series:
            return r.add(name, kind, doc, LABELS, buckets).child(*lv)

        self.spec = None
        if self.num_speculative_tokens:
            self.spec = {
                "drafts": per_engine("vllm:spec_decode_num_drafts", "counter", "Speculative decoding drafts proposed."),
                "draft_tokens": per_engine("vllm:spec_decode_num_draft_tokens", "counter",
                                           "Draft tokens proposed by speculative decoding."),
                "accepted": per_engine("vllm:spec_decode_num_accepted_tokens", "counter",
                                       "Draft tokens the target model accepted."),
            }
            per_pos = r.add("vllm:spec_decode_num_accepted_tokens_per_pos", "counter",
                            "Accepted draft tokens, by position in the draft.", LABELS + ("position",))
            self.spec_per_pos = [per_pos.child(*lv, pos) for pos in range(int(self.num_speculative_tokens))]
        for name, what in (("flops", "floating point operations"), ("read_bytes", "bytes read from memory"),
                           ("write_bytes", "bytes written to memory")):
            per_engine(f"vllm:estimated_{name}_per_gpu_total", "counter",
                       f"Estimated {what} per GPU, for model-flops-utilisation figures.")
        self.running_gauge = per_engine("vllm:num_requests_running", "gauge",
                                        "Requests in the batches the model is executing.")
        self.waiting_gauge = per_engine("vllm:num_requests_waiting", "gauge", "Requests waiting to be scheduled.")
        by_reason = r.add("vllm:num_requests_waiting_by_reason", "gauge",
                          "Waiting requests by reason: 'capacity' waits for scheduling room, 'deferred' is held "
                          "back by a transient constraint; the reasons add up to vllm:num_requests_waiting.",
                          LABELS + ("reason",))
        self.waiting_by_reason = {reason: by_reason.child(*lv, reason) for reason in WAITING_REASONS}
        sleep = r.add("vllm:engine_sleep_state", "gauge",
                      "The engine's sleep state: awake=1 while awake; weights_offloaded=1 at sleep level 1; "
                      "discard_all=1 at sleep level 2.", LABELS + ("sleep_state",))
        for state in SLEEP_STATES:
            sleep.child(*lv, state).set(1 if state == "awake" else 0)
        self.kv_usage = per_engine("vllm:kv_cache_usage_perc", "gauge", "Share of the KV cache in use; 1 is all of it.")
        self.prefix_queries = per_engine("vllm:prefix_cache_queries", "counter",
                                         "Prefix-cache lookups, counted in prompt tokens looked up.")
        self.prefix_hits = per_engine("vllm:prefix_cache_hits", "counter",
                                      "Prefix-cache hits, counted in prompt tokens found cached.")
        per_engine("vllm:external_prefix_cache_queries", "counter",
                   "Prefix-cache lookups in a KV connector's cache shared across instances, in tokens.")
        per_engine("vllm:external_prefix_cache_hits", "counter",
                   "Prefix-cache hits in a KV connector's cache shared across instances, in tokens.")
        per_engine("vllm:mm_cache_queries", "counter", "Multi-modal cache lookups, in items.")
        per_engine("vllm:mm_cache_hits", "counter", "Multi-modal cache hits, in items.")
        self.preemptions = per_engine("vllm:num_preemptions", "counter", "Requests the engine preempted, in total.")
        self.prompt_counter = per_engine("vllm:prompt_tokens", "counter", "Prompt (prefill) tokens processed.")
        by_source = r.add("vllm:prompt_tokens_by_source", "counter", "Prompt tokens, by where they came from.",
                          LABELS + ("source",))
        self.prompt_by_source = {source: by_source.child(*lv, source) for source in PROMPT_SOURCES}
        self.prompt_cached = per_engine("vllm:prompt_tokens_cached", "counter",
                                        "Prompt tokens served from a cache (local or external).")
        self.generation_counter = per_engine("vllm:generation_tokens", "counter", "Tokens generated.")
        success = r.add("vllm:request_success", "counter", "Requests the engine finished, by finish reason.",
                        LABELS + ("finished_reason",))
        self.success = {reason: success.child(*lv, reason) for reason in FINISH_REASONS}
        self.h_prompt = per_engine("vllm:request_prompt_tokens", "histogram", "Prompt tokens of each finished request.",
                                   buckets_len)
        self.h_generation = per_engine("vllm:request_generation_tokens", "histogram",
                                       "Generated tokens of each finished request.", buckets_len)
        self.h_iteration = per_engine("vllm:iteration_tokens_total", "histogram", "Tokens per engine step.",
                                      ITERATION_TOKENS_BUCKETS)
        per_engine("vllm:request_max_num_generation_tokens", "histogram",
                   "The most tokens each request could generate.", buckets_len)
        per_engine("vllm:request_params_n", "histogram", "The n parameter of each request.", N_PARAM_BUCKETS)
        self.h_max_tokens = per_engine("vllm:request_params_max_tokens", "histogram",
                                       "The max_tokens parameter of each request.", buckets_len)
        self.h_ttft = per_engine("vllm:time_to_first_token_seconds", "histogram",
                                 "Seconds from a request's arrival to its first token.", TTFT_BUCKETS)
        self.h_itl = per_engine("vllm:inter_token_latency_seconds", "histogram",
                                "Seconds between successive engine outputs of a request.", ITL_BUCKETS)
        self.h_tpot = per_engine("vllm:request_time_per_output_token_seconds", "histogram",
                                 "Mean seconds per output token after the first, per request.", ITL_BUCKETS)
        self.h_e2e = per_engine("vllm:e2e_request_latency_seconds", "histogram",
                                "Seconds from a request's arrival to its end.", REQUEST_LATENCY_BUCKETS)
        self.h_queue = per_engine("vllm:request_queue_time_seconds", "histogram",
                                  "Seconds each request waited before it was first scheduled.", REQUEST_LATENCY_BUCKETS)
        self.h_inference = per_engine("vllm:request_inference_time_seconds", "histogram",
                                      "Seconds each request spent running (prefill and decode).",
                                      REQUEST_LATENCY_BUCKETS)
        self.h_prefill = per_engine("vllm:request_prefill_time_seconds", "histogram",
                                    "Seconds from scheduling to the first token, per request.", REQUEST_LATENCY_BUCKETS)
        self.h_decode = per_engine("vllm:request_decode_time_seconds", "histogram",
                                   "Seconds from the first to the last token, per request.", REQUEST_LATENCY_BUCKETS)
        self.h_prefill_kv = per_engine("vllm:request_prefill_kv_computed_tokens", "histogram",
                                       "Prompt tokens each request computed in prefill (cached ones left out).",
                                       buckets_len)
        # vllm:cache_config_info: vLLM labels it with every CacheConfig field; these are the ones the stand-in
        # knows from the command line (FACTS.md section 11)
        info = {"block_size": str(self.block_size), "cache_dtype": cache_dtype,
                "enable_prefix_caching": str(self.prefix_caching), "gpu_memory_utilization": str(gpu_util),
                "num_gpu_blocks": str(self.num_gpu_blocks), "num_gpu_blocks_override": str(override),
                "prefix_caching_hash_algo": "sha256", "engine": str(engine)}
        r.add("vllm:cache_config_info", "gauge", "The engine's KV-cache configuration (always 1).",
              tuple(info)).child(*info.values()).set(1)

    # --- requests

    def add_request(self, prompt_tokens: int, prompt_text: str = "", max_tokens: int | None = None,
                    arrival: float | None = None) -> Request:
        """A request the engine accepted (validation passed): queued now, scheduled when room allows.
        `arrival` (time.monotonic()): when the server received it, which TTFT and e2e latency count from."""
        req = Request(self, prompt_tokens, prompt_text, max_tokens, arrival)
        with self.cond:
            self.waiting.append(req)
            self._schedule()
        return req

    def _blocks_for(self, tokens: int) -> int:
        return min(math.ceil(tokens / self.block_size), self.pool)

    @property
    def pool(self) -> int:
        return max(1, self.num_gpu_blocks - 1)

    def _prefix_hashes(self, req: Request) -> list[bytes]:
        """Chained hashes of the prompt's full blocks, each hash covering its block and every block before it
        (vLLM's hash of the parent block's hash and the block's tokens). The text stands for the tokens: cut
        every chars_per_token x block_size characters when the server counts tokens at a fixed rate (then a
        conversation that grows keeps its earlier blocks' hashes), else in proportion to the prompt's tokens."""
        text, n = req.prompt_text, req.prompt_tokens
        if not text or not self.prefix_caching:
            return []
        h, out, start = hashlib.sha256(), [], 0
        if self.chars_per_token:
            width = self.chars_per_token * self.block_size
            for i in range(min(n // self.block_size, len(text) // width)):
                h.update(text[i * width:(i + 1) * width].encode())
                out.append(h.copy().digest())
            return out
        for i in range(n // self.block_size):
            end = round((i + 1) * self.block_size * len(text) / n)
            h.update(text[start:end].encode())
            start = end
            out.append(h.copy().digest())
        return out

    def _schedule(self) -> None:
        """FCFS: admit waiting requests from the head while a slot and their KV blocks are free."""
        changed = False
        while self.waiting and len(self.running) < self.max_num_seqs:
            head = self.waiting[0]
            need = self._blocks_for(head.tokens)
            if self.used_blocks + need > self.pool and self.running:
                break
            self.waiting.popleft()
            self.running.append(head)
            self.used_blocks += need
            head.blocks, head.state = need, RUNNING
            if head.scheduled_ts is None:
                head.scheduled_ts = time.monotonic()
                hashes = self._prefix_hashes(head)
                # a hit is a run of cached blocks from the start; the last prompt token is always computed
                usable = (head.prompt_tokens - 1) // self.block_size
                hit = 0
                for digest in hashes[:usable]:
                    if digest not in self.cached:
                        break
                    self.cached.move_to_end(digest)
                    hit += 1
                head.hit_tokens = hit * self.block_size
                if self.prefix_caching:
                    self.prefix_queries.inc(head.prompt_tokens)
                    self.prefix_hits.inc(head.hit_tokens)
            changed = True
        if changed:
            self.cond.notify_all()
        if bool(self.running) != self._busy:
            self._busy = bool(self.running)
            if self.on_busy is not None:
                self.on_busy(self._busy)

    def _emit(self, req: Request, n: int) -> None:
        with self.cond:
            if req.state == QUEUED:
                self.cond.wait_for(lambda: req.state != QUEUED)
            if req.state == DONE:
                return
            now = time.monotonic()
            if req.first_token_ts is None:
                req.first_token_ts = now
                self.h_ttft.observe(now - req.arrival)
                computed = req.prompt_tokens - req.hit_tokens
                self.prompt_counter.inc(req.prompt_tokens)
                self.prompt_by_source["local_compute"].inc(computed)
                self.prompt_by_source["local_cache_hit"].inc(req.hit_tokens)
                self.prompt_cached.inc(req.hit_tokens)
                self.h_iteration.observe(computed + n)
                for digest in self._prefix_hashes(req):  # the prompt's full blocks are cached once computed
                    self.cached[digest] = None
                    self.cached.move_to_end(digest)
                while len(self.cached) > self.pool:
                    self.cached.popitem(last=False)
            else:
                self.h_itl.observe(now - (req.last_token_ts or now))
                self.h_iteration.observe(n)
            req.last_token_ts = now
            req.generated += n
            self.generation_counter.inc(n)
            need = self._blocks_for(req.tokens)
            if need > req.blocks:
                if self.used_blocks + need - req.blocks <= self.pool:
                    self.used_blocks += need - req.blocks
                    req.blocks = need
                else:  # no block for the next token: preempted, back to the head of the queue, recomputed later
                    self.preemptions.inc()
                    self.running.remove(req)
                    self.used_blocks -= req.blocks
                    req.blocks, req.state, req.preempted = 0, QUEUED, True
                    self.waiting.appendleft(req)
                    self._schedule()
                    self.cond.wait_for(lambda: req.state != QUEUED)

    def _finish(self, req: Request, reason: str) -> None:
        with self.cond:
            if req.state == DONE:
                return
            if req.state == RUNNING:
                self.running.remove(req)
                self.used_blocks -= req.blocks
            elif req in self.waiting:
                self.waiting.remove(req)
            req.state, req.blocks = DONE, 0
            if req.scheduled_ts is not None:
                now = time.monotonic()
                first = req.first_token_ts if req.first_token_ts is not None else req.scheduled_ts
                last = req.last_token_ts if req.last_token_ts is not None else req.scheduled_ts
                self.success[reason if reason in self.success else "error"].inc()
                self.h_e2e.observe(now - req.arrival)
                self.h_queue.observe(req.scheduled_ts - req.queued_ts)
                self.h_prefill.observe(first - req.scheduled_ts)
                self.h_inference.observe(last - req.scheduled_ts)
                self.h_decode.observe(last - first)
                self.h_prefill_kv.observe(req.prompt_tokens - req.hit_tokens)
                self.h_prompt.observe(req.prompt_tokens)
                self.h_generation.observe(req.generated)
                self.h_tpot.observe((last - first) / (req.generated - 1) if req.generated > 1 else 0)
                if req.max_tokens:
                    self.h_max_tokens.observe(req.max_tokens)
            self._schedule()
            self.cond.notify_all()

    def record_spec_decoding(self, drafts: int, draft_tokens: int, accepted: int) -> None:
        """A request's speculative decoding: `drafts` steps proposed `draft_tokens` tokens, `accepted` of
        them kept. Per position: each step accepts a prefix of its draft, the `accepted` tokens spread as
        evenly over the steps as whole tokens allow."""
        if self.spec is None or drafts <= 0:
            return
        k = len(self.spec_per_pos)
        accepted = max(0, min(accepted, drafts * k))
        with self.cond:
            self.spec["drafts"].inc(drafts)
            self.spec["draft_tokens"].inc(draft_tokens)
            self.spec["accepted"].inc(accepted)
            each, extra = divmod(accepted, drafts)
            for pos, series in enumerate(self.spec_per_pos):
                series.inc(drafts if pos < each else extra if pos == each else 0)

    # --- the scrape

    def render(self) -> str:
        with self.cond:
            self.running_gauge.set(len(self.running))
            self.waiting_gauge.set(len(self.waiting))
            self.waiting_by_reason["capacity"].set(len(self.waiting))
            self.waiting_by_reason["deferred"].set(0)
            self.kv_usage.set(self.used_blocks / self.pool)
            return self.registry.render()


def engine_for(args: dict[str, Any], model_name: str, max_model_len: int, gpus: Sequence[dict[str, Any]] = (),
               gpu_memory_utilization: float = 0.92) -> EngineStats:
    """An EngineStats from a `vllm serve` command line as container.vllm_args parses it, on `gpus`
    (hardware.json entries: the default max_num_seqs depends on the first one's memory)."""
    first = gpus[0] if gpus else {}
    seqs = args.get("max_num_seqs")
    spec_tokens = None
    if args.get("speculative_config"):
        import json

        try:
            spec = json.loads(args["speculative_config"])
        except ValueError:
            spec = {}
        spec_tokens = int(spec.get("num_speculative_tokens") or 1) if isinstance(spec, dict) else 1
    return EngineStats(
        model_name, max_model_len,
        max_num_seqs=int(seqs) if seqs else default_max_num_seqs(first.get("memory_total_mib"), str(first.get("name", ""))),
        block_size=int(args.get("block_size") or DEFAULT_BLOCK_SIZE),
        num_gpu_blocks_override=int(args["num_gpu_blocks_override"]) if args.get("num_gpu_blocks_override") else None,
        gpu_memory_utilization=gpu_memory_utilization,
        enable_prefix_caching=str(args.get("enable_prefix_caching", True)).lower() not in ("false", "0"),
        cache_dtype=str(args.get("kv_cache_dtype") or "auto"),
        num_speculative_tokens=spec_tokens,
    )
