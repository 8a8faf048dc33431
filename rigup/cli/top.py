"""`rigup top`: a live view of the fleet in the terminal, redrawn every few seconds.

Per pod: requests running and waiting, generated and prompt tokens per second, time to first token
(p50, p95) and KV-cache use. Per GPU: utilisation, memory, temperature and power. Per gateway route:
its name, its answers per second and its state now (healthy, partial or complete outage) as its latest
answers say: LiteLLM keeps a failure's state beside the healthy state of later successes ("unknown
(idle)": they disagree and no answer was seen since). The columns fit the terminal: short headers
first, then the least useful columns go; host, pod and state always show.

Where it reads: the fleet's Prometheus (the first host of monitor_group, by default gateway_group's,
at prometheus_listen_address) through its HTTP API, or the one --prometheus names. With --direct, or
when the fleet has no monitor host, the targets themselves: each pod's /metrics, each rig's GPU exporter
(gpu_exporter_port, when metrics_exporters is on) and each gateway's /metrics/ with the gateway key.
Read directly, rates and quantiles are the difference between two scrapes, so the first frame shows
"-" for them. When the fleet's Prometheus does not answer, the frame is read directly and the header
says why. A target that does not answer is a row saying so.

q or Ctrl-C quits (exit 0). --once prints one frame (direct: after two scrapes --interval apart) and exits
0 when every target answered, 1 when one did not; 2: the fleet file or --limit could not be used (one
line says why).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import select
import sys
import termios
import time
import tty
import urllib.parse
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import requests

from rigup.cli.runner import Target, add_target_arguments, api_host, fleet_targets, limit_selection, parallel, progress
from rigup.client.ssh import RemoteError, SshSettings
from rigup.desired.fleet import Fleet, load_fleet
from rigup.desired.knobs import knob
from rigup.desired.monitoring import JOB_GATEWAY, JOB_GPU, JOB_PODS, is_monitor
from rigup.parsers.common import ParseError
from rigup.parsers.prometheus import (
    Exposition,
    Histogram,
    Sample,
    counter_increase,
    histogram_increase,
    merge_histograms,
    parse_exposition,
    series_increase,
)

EXIT_UNANSWERED = 1  # --once: a target (or the Prometheus the frame came from) did not answer
EXIT_BAD_FLEET = 2  # the fleet file or --limit could not be used
EXIT_INTERRUPTED = 130  # --once stopped by Ctrl-C before its frame (a live view's Ctrl-C is its way out: 0)
DEFAULT_INTERVAL_S = 2.0
BATCH_WIDTH = 160  # columns of a frame written to a file or pipe
WIDE_COLUMN = 40  # characters of a state, model, route or URL column (a longer one ends in ...)
MAX_TIMEOUT_S = 5.0  # a scrape or query waits at most this long (and never longer than the interval)

# vLLM (V1) metric names; labels model_name and engine
RUNNING, WAITING, KV_USAGE = "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"
PROMPT_TOKENS, GENERATION_TOKENS = "vllm:prompt_tokens_total", "vllm:generation_tokens_total"
TTFT = "vllm:time_to_first_token_seconds"
# dcgm-exporter's fields (labels gpu, UUID, modelName, Hostname, ...)
GPU_FIELDS = {
    "DCGM_FI_DEV_GPU_UTIL": "util_pct",
    "DCGM_FI_DEV_FB_USED": "mem_used_mib",
    "DCGM_FI_DEV_FB_FREE": "mem_free_mib",
    "DCGM_FI_DEV_GPU_TEMP": "temp_c",
    "DCGM_FI_DEV_POWER_USAGE": "power_w",
}
# LiteLLM's proxy (its prometheus callback): prometheus_client writes a counter x as x_total
ROUTE_STATE = "litellm_deployment_state"  # labels litellm_model_name, model_id, api_base, api_provider
ROUTE_SUCCESS = "litellm_deployment_success_responses_total"
ROUTE_FAILURE = "litellm_deployment_failure_responses_total"
ROUTE_STATES = {0: "healthy", 1: "partial outage", 2: "complete outage"}

UP = "up"
NO_ROUTES = "no routes yet"  # LiteLLM reports a deployment's state once a request went to it
ANSWER_LOOKBACK = "1h"  # how far back Prometheus looks for a route's latest success and failure
UNKNOWN_IDLE = "unknown (idle)"  # its series disagree and no answer was seen since: nothing says which is now


# --------------------------------------------------------------------------------------------------
# what a frame shows


@dataclass
class PodRow:
    host: str
    pod: str
    model: str | None
    state: str = UP  # up, or why it has no numbers ("down: connection refused", "not asked: ...")
    answered: bool = True
    running: float | None = None
    waiting: float | None = None
    generation_tps: float | None = None
    prompt_tps: float | None = None
    ttft_p50_s: float | None = None
    ttft_p95_s: float | None = None
    kv_usage: float | None = None  # 0..1


@dataclass
class GpuRow:
    host: str
    gpu: str | None  # DCGM's index
    name: str | None  # modelName
    state: str = UP
    answered: bool = True
    util_pct: float | None = None
    mem_used_mib: float | None = None
    mem_free_mib: float | None = None
    temp_c: float | None = None
    power_w: float | None = None


@dataclass
class RouteRow:
    gateway: str  # the gateway's host
    model: str | None
    route: str | None  # LiteLLM's model_id (rigup writes <host>/<unit>)
    api_base: str | None
    state: str  # healthy | partial outage | complete outage | no routes yet | why the gateway did not answer
    answered: bool = True
    success_rps: float | None = None
    failure_rps: float | None = None


@dataclass
class Frame:
    source: str  # "Prometheus http://...", "direct: N targets"
    taken_at: float  # seconds since the epoch
    pods: list[PodRow] = field(default_factory=list)
    gpus: list[GpuRow] = field(default_factory=list)
    routes: list[RouteRow] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    first_scrape: bool = False  # read directly without an earlier scrape: no rates or quantiles yet

    @property
    def unanswered(self) -> int:
        return sum(1 for row in [*self.pods, *self.gpus, *self.routes] if not row.answered)


class Source:
    description: str

    def frame(self) -> Frame:  # pragma: no cover - the two sources below
        raise NotImplementedError


# --------------------------------------------------------------------------------------------------
# direct: the targets' own /metrics


@dataclass(frozen=True)
class Endpoint:
    kind: str  # pod | gpu | gateway
    host: str
    url: str | None  # None: it cannot be asked (problem says why)
    pod: str | None = None
    model: str | None = None  # the served model the recipe names
    key: str | None = field(default=None, repr=False, compare=False)  # the gateway's bearer key
    problem: str | None = None


@dataclass(frozen=True)
class Scrape:
    endpoint: Endpoint
    at: float  # time.monotonic() when the answer came
    metrics: Exposition | None
    error: str | None = None


def metrics_url(api_url: str) -> str:
    """vLLM's /metrics beside its OpenAI API (http://host:port or .../v1)."""
    return api_url.rstrip("/").removesuffix("/v1") + "/metrics"


def direct_endpoints(targets: Sequence[Target]) -> list[Endpoint]:
    """What to scrape for the fleet targets: each pod's /metrics, one GPU exporter per rig that runs
    the exporters, each gateway's /metrics/ (LiteLLM mounts it there; the bare path redirects)."""
    out: list[Endpoint] = []
    rigs_seen: set[str] = set()
    for target in targets:
        host = target.host or target.name
        if knob(target.data, "serves_variant"):
            pod = target.pod.name if target.pod is not None else target.variant or host
            if target.api_url is not None:
                out.append(Endpoint("pod", host, metrics_url(target.api_url), pod, target.served_model))
            else:
                out.append(Endpoint("pod", host, None, pod, None, problem=target.error or "no API URL"))
            if host not in rigs_seen and knob(target.data, "metrics_exporters") and target.ssh is not None:
                rigs_seen.add(host)
                address = "127.0.0.1" if target.ssh.local else api_host(target.ssh.hostname)
                out.append(Endpoint("gpu", host, f"http://{address}:{knob(target.data, 'gpu_exporter_port')}/metrics"))
        if target.gateway_url is None and target.gateway_error is None:
            continue  # runs no gateway (or another of its pods reports it)
        url = f"{target.gateway_url}/metrics/" if target.gateway_url is not None else None
        if url is None or target.gateway_key is None:
            out.append(Endpoint("gateway", host, url, problem=target.gateway_error or "no gateway key"))
        else:
            out.append(Endpoint("gateway", host, url, key=target.gateway_key))
    return out


def why_not(exc: requests.RequestException, timeout: float) -> str:
    """A failed request in a few words."""
    if isinstance(exc, requests.Timeout):
        return f"no answer in {timeout:g} s"
    if isinstance(exc, requests.ConnectionError):
        text = str(exc)
        if "refused" in text:
            return "connection refused"
        if "resolve" in text or "Name or service not known" in text:
            return "unknown host"
        return "no connection"
    return type(exc).__name__


def scrape(endpoint: Endpoint, timeout: float) -> Scrape:
    if endpoint.url is None or endpoint.problem is not None:
        return Scrape(endpoint, time.monotonic(), None, f"not asked: {endpoint.problem}")
    headers = {"Authorization": f"Bearer {endpoint.key}"} if endpoint.key else {}
    try:
        reply = requests.get(endpoint.url, headers=headers, timeout=timeout)
    except requests.RequestException as exc:
        return Scrape(endpoint, time.monotonic(), None, f"down: {why_not(exc, timeout)}")
    at = time.monotonic()
    if reply.status_code != 200:
        refused = " (the key refused)" if reply.status_code in (401, 403) and endpoint.key else ""
        return Scrape(endpoint, at, None, f"answered HTTP {reply.status_code}{refused}")
    try:
        # the text format is UTF-8 whatever the Content-Type says (requests would guess ISO-8859-1 without a charset)
        return Scrape(endpoint, at, parse_exposition(reply.content.decode("utf-8", errors="replace")))
    except ParseError as exc:
        return Scrape(endpoint, at, None, f"unreadable /metrics: {exc}")


def _total(samples: Iterable[Sample]) -> float | None:
    values = [s.value for s in samples]
    return sum(values) if values else None


def _mean(samples: Iterable[Sample]) -> float | None:
    values = [s.value for s in samples]
    return sum(values) / len(values) if values else None


def _rate(before: Exposition, now: Exposition, name: str, seconds: float, **match: str) -> float | None:
    if seconds <= 0:
        return None
    increase = series_increase(before.samples(name, **match), now.samples(name, **match))
    return None if increase is None else increase / seconds


def _window(before: Exposition, now: Exposition, name: str) -> Histogram | None:
    """The observations of histogram `name` between two scrapes, every series added up."""
    earlier = before.histograms(name)
    return merge_histograms(histogram_increase(earlier[labels], h) for labels, h in now.histograms(name).items()
                            if labels in earlier)


def _finite(value: float | None) -> float | None:
    return None if value is None or math.isnan(value) or math.isinf(value) else value


def pod_row(now: Scrape, before: Scrape | None) -> PodRow:
    endpoint = now.endpoint
    row = PodRow(endpoint.host, endpoint.pod or "-", endpoint.model)
    if now.metrics is None:
        row.state, row.answered = now.error or "down", False
        return row
    metrics = now.metrics
    served = sorted({s.label("model_name") for s in metrics.samples(RUNNING)} - {None})
    row.model = ", ".join(m for m in served if m) or endpoint.model
    row.running, row.waiting = _total(metrics.samples(RUNNING)), _total(metrics.samples(WAITING))
    row.kv_usage = _mean(metrics.samples(KV_USAGE))
    if before is not None and before.metrics is not None:
        seconds = now.at - before.at
        row.generation_tps = _rate(before.metrics, metrics, GENERATION_TOKENS, seconds)
        row.prompt_tps = _rate(before.metrics, metrics, PROMPT_TOKENS, seconds)
        window = _window(before.metrics, metrics, TTFT)
        if window is not None:
            row.ttft_p50_s, row.ttft_p95_s = _finite(window.quantile(0.5)), _finite(window.quantile(0.95))
    return row


def gpu_rows_from(host: str, fields: Mapping[str, Mapping[str, Any]]) -> list[GpuRow]:
    """GpuRows of one host from {gpu index: {"name": modelName, <GpuRow field>: value}}."""
    rows = []
    for gpu, values in fields.items():
        row = GpuRow(host, gpu, values.get("name"))
        for attr in GPU_FIELDS.values():
            setattr(row, attr, _finite(values.get(attr)))
        rows.append(row)
    return rows


def gpu_rows(now: Scrape) -> list[GpuRow]:
    endpoint = now.endpoint
    if now.metrics is None:
        return [GpuRow(endpoint.host, None, None, state=now.error or "down", answered=False)]
    fields: dict[str, dict[str, Any]] = {}
    for name, attr in GPU_FIELDS.items():
        for sample in now.metrics.samples(name):
            gpu = sample.label("gpu") or sample.label("UUID") or "?"
            values = fields.setdefault(gpu, {"name": sample.label("modelName")})
            values[attr] = sample.value
    if not fields:
        return [GpuRow(endpoint.host, None, None, state="no DCGM_FI_DEV fields in its /metrics")]
    return gpu_rows_from(endpoint.host, fields)


def route_model(name: str | None) -> str | None:
    """LiteLLM's model name without the provider prefix rigup's routes carry (hosted_vllm/...)."""
    return name.split("/", 1)[1] if name and name.startswith("hosted_vllm/") else name


def route_state(value: float) -> str:
    return ROUTE_STATES[int(value)] if value in ROUTE_STATES else f"state {value:g}"


def route_base(api_base: str | None) -> str | None:
    """A route's API base as rigup wrote it (http://host:port/v1): LiteLLM labels some series with the
    endpoint it called (.../v1/chat/completions) instead. None for a series of no route (LiteLLM writes
    its counters with empty deployment labels for a request it refused before picking one)."""
    if not api_base:
        return None
    if "/v1/" in api_base:
        return api_base.split("/v1/", 1)[0] + "/v1"
    return api_base.rstrip("/")


def current_route_state(states: Sequence[float], last_success_at: float | None, last_failure_at: float | None) -> str:
    """A route's state now. LiteLLM 1.108 writes litellm_deployment_state under a different label set per
    event (integrations/prometheus.py: a success sets 0 with api_base .../v1/chat/completions and no
    model_id, a failure 1 and a cooldown 2 with api_base .../v1 and the model_id), so after a heal the
    failure's series keeps its 1 or 2 forever beside the success's 0. The series written last is the one
    of the latest answer: a success makes the route healthy, a failure gives LiteLLM's failure state,
    both within the latest step is a partial outage. Without any answer seen, series that disagree say
    nothing of now: unknown."""
    failing = max((s for s in states if s > 0), default=None)
    if failing is None:
        return ROUTE_STATES[0] if states else NO_ROUTES
    if not any(s == 0 for s in states):
        return route_state(failing)  # never answered well since LiteLLM started
    if last_success_at is None and last_failure_at is None:
        return UNKNOWN_IDLE
    if last_failure_at is None or (last_success_at is not None and last_success_at > last_failure_at):
        return ROUTE_STATES[0]
    if last_success_at is None or last_failure_at > last_success_at:
        return route_state(failing)
    return ROUTE_STATES[1]


def address_of(api_base: str) -> str:
    """host:port of an API base, what names a route when nothing else does."""
    return urllib.parse.urlsplit(api_base).netloc or api_base


RouteNames = Callable[[str, str], str | None]  # (gateway host, API base) -> the route's name (<host>/<unit>)


@dataclass
class RouteEvidence:
    """Everything a gateway's series say of one route (the gateway and the route's API base)."""

    gateway: str
    api_base: str
    model: str | None = None
    route: str | None = None  # LiteLLM's model_id where a series carries it (rigup writes <host>/<unit>)
    states: list[float] = field(default_factory=list)
    success_rps: float | None = None
    failure_rps: float | None = None
    last_success_at: float | None = None  # when its latest success was counted, as far as the source saw
    last_failure_at: float | None = None

    def learn(self, labels: Callable[[str], str | None]) -> None:
        self.model = self.model or route_model(labels("litellm_model_name"))
        self.route = self.route or labels("model_id") or None

    def add_rates(self, success: float | None, failure: float | None) -> None:
        for attr, value in (("success_rps", success), ("failure_rps", failure)):
            if value is not None:
                setattr(self, attr, (getattr(self, attr) or 0.0) + value)

    def row(self, names: RouteNames | None) -> RouteRow:
        name = self.route or (names(self.gateway, self.api_base) if names else None) or address_of(self.api_base)
        success, failure = self.success_rps, self.failure_rps
        if success is not None or failure is not None:  # LiteLLM has no series of a count before its first
            success, failure = success or 0.0, failure or 0.0
        state = current_route_state(self.states, self.last_success_at, self.last_failure_at)
        return RouteRow(self.gateway, self.model, name, self.api_base, state, success_rps=success, failure_rps=failure)


def route_rows_of(evidence: Mapping[Any, RouteEvidence], names: RouteNames | None) -> list[RouteRow]:
    """A row per route LiteLLM reports a state of (a route only in counters is a request it refused)."""
    rows = (e.row(names) for e in evidence.values() if e.states)
    return sorted(rows, key=lambda r: (r.gateway, r.model or "", r.route or ""))


def fleet_route_names(targets: Sequence[Target]) -> RouteNames:
    """The name rigup gives each route (<host>/<unit>, LiteLLM's model_id), found from its API base: the
    pod listening on that port at that address (127.0.0.1 for a pod on the gateway's own host). LiteLLM
    1.108 labels a route's successes without its model_id, so a route that never failed has no name in
    the gateway's series."""
    pods: list[tuple[int, set[str], str, str]] = []  # (port, addresses, host, name)
    for target in targets:
        if target.recipe is None or target.api_url is None or target.host is None:
            continue
        url = urllib.parse.urlsplit(target.api_url)
        if url.port is None:
            continue
        addresses = {target.host, url.hostname or ""}
        if target.ssh is not None:
            addresses.add(target.ssh.hostname)
        pods.append((url.port, addresses, target.host, f"{target.host}/{target.recipe.paths.unit_name}"))

    def name(gateway: str, api_base: str) -> str | None:
        url = urllib.parse.urlsplit(api_base)
        address = (url.hostname or "").strip("[]")
        loopback = address in ("127.0.0.1", "::1", "localhost")
        found = {n for port, addresses, host, n in pods
                 if port == url.port and (address in addresses or (loopback and host == gateway))}
        return found.pop() if len(found) == 1 else None

    return name


def gateway_evidence(gateway: str, metrics: Exposition) -> dict[str, RouteEvidence]:
    """The routes a gateway's /metrics shows, by API base: its state series and the names its counters carry."""
    routes: dict[str, RouteEvidence] = {}
    for name in (ROUTE_STATE, ROUTE_SUCCESS, ROUTE_FAILURE):
        for sample in metrics.samples(name):
            base = route_base(sample.label("api_base"))
            if base is None:
                continue
            evidence = routes.setdefault(base, RouteEvidence(gateway, base))
            evidence.learn(sample.label)
            if name == ROUTE_STATE:
                evidence.states.append(sample.value)
    return routes


def answers_between(before: Exposition, now: Exposition, name: str) -> dict[str, float]:
    """Per route (API base), how much counter `name` grew between two scrapes. A series the earlier scrape
    lacks counts from 0: LiteLLM creates a route's series at its first success or failure."""
    earlier = {s.labels: s.value for s in before.samples(name)}
    grown: dict[str, float] = {}
    for sample in now.samples(name):
        base = route_base(sample.label("api_base"))
        if base is not None:
            grown[base] = grown.get(base, 0.0) + counter_increase(earlier.get(sample.labels, 0.0), sample.value)
    return grown


LastAnswers = dict[tuple[str, str], list[float | None]]  # (gateway, API base) -> [last success, last failure] at


def route_rows(now: Scrape, before: Scrape | None, seen: LastAnswers | None = None,
               names: RouteNames | None = None) -> list[RouteRow]:
    """A gateway's routes from two scrapes; `seen` carries each route's latest success and failure from
    frame to frame (direct reading has no history but what it saw)."""
    endpoint = now.endpoint
    if now.metrics is None:
        return [RouteRow(endpoint.host, None, None, None, now.error or "down", answered=False)]
    routes = gateway_evidence(endpoint.host, now.metrics)
    seen = seen if seen is not None else {}
    if before is not None and before.metrics is not None and now.at > before.at:
        seconds = now.at - before.at
        ok = answers_between(before.metrics, now.metrics, ROUTE_SUCCESS)
        failed = answers_between(before.metrics, now.metrics, ROUTE_FAILURE)
        for base, evidence in routes.items():
            evidence.add_rates(ok.get(base, 0.0) / seconds, failed.get(base, 0.0) / seconds)
            last = seen.setdefault((endpoint.host, base), [None, None])
            if ok.get(base):
                last[0] = now.at
            if failed.get(base):
                last[1] = now.at
    for base, evidence in routes.items():
        evidence.last_success_at, evidence.last_failure_at = seen.get((endpoint.host, base), (None, None))
    return route_rows_of(routes, names) or [RouteRow(endpoint.host, None, None, None, NO_ROUTES)]


class DirectSource(Source):
    """Scrapes the endpoints every frame; rates and quantiles from the difference to the last frame."""

    def __init__(self, endpoints: Sequence[Endpoint], timeout: float, route_names: RouteNames | None = None) -> None:
        self.endpoints = list(endpoints)
        self.timeout = timeout
        self.route_names = route_names
        self.previous: dict[Endpoint, Scrape] = {}
        self.last_answers: LastAnswers = {}
        self.description = f"direct: {len(self.endpoints)} targets"

    def frame(self) -> Frame:
        scrapes = parallel(self.endpoints, lambda e: scrape(e, self.timeout))
        frame = Frame(self.description, time.time(), first_scrape=not self.previous)
        for now in scrapes:
            before = self.previous.get(now.endpoint)
            if now.endpoint.kind == "pod":
                frame.pods.append(pod_row(now, before))
            elif now.endpoint.kind == "gpu":
                frame.gpus.extend(gpu_rows(now))
            else:
                frame.routes.extend(route_rows(now, before, self.last_answers, self.route_names))
        self.previous = {s.endpoint: s for s in scrapes if s.metrics is not None}
        return frame


# --------------------------------------------------------------------------------------------------
# Prometheus: its HTTP API's instant queries


class PrometheusError(RuntimeError):
    """A query Prometheus refused or answered with something else than a vector."""


class PrometheusUnreachable(PrometheusError):
    """Prometheus did not answer at all."""


Vector = list[tuple[dict[str, str], float]]


def query_prometheus(url: str, promql: str, at: float, timeout: float) -> Vector:
    """GET /api/v1/query: the instant vector as (labels, value) pairs."""
    try:
        reply = requests.get(f"{url}/api/v1/query", params={"query": promql, "time": f"{at:.3f}"}, timeout=timeout)
    except requests.RequestException as exc:
        raise PrometheusUnreachable(why_not(exc, timeout)) from None
    try:
        body = reply.json()
    except ValueError:
        raise PrometheusError(f"HTTP {reply.status_code}, not the API's JSON") from None
    if not isinstance(body, dict) or body.get("status") != "success":
        problem = body.get("error") if isinstance(body, dict) else None
        kind = body.get("errorType") if isinstance(body, dict) else None
        raise PrometheusError(f"{promql}: HTTP {reply.status_code}: {kind or 'error'}: {problem or 'no reason given'}")
    data = body.get("data") or {}
    if data.get("resultType") != "vector":
        raise PrometheusError(f"{promql}: a {data.get('resultType')!r} result, not a vector")
    out: Vector = []
    for item in data.get("result") or ():
        try:
            out.append((dict(item["metric"]), float(item["value"][1])))
        except (KeyError, IndexError, TypeError, ValueError):
            raise PrometheusError(f"{promql}: a result without metric and [time, value]") from None
    return out


def prometheus_queries(rate_window: str = "1m", ttft_window: str = "5m", scrape_interval: str = "15s",
                       step_window: str = "30s") -> dict[str, str]:
    """What a frame asks Prometheus: the fleet's jobs (rigup.desired.monitoring) and their labels. A route's
    latest success and failure: the last step (one scrape interval) of the past ANSWER_LOOKBACK at which its
    counter grew over `step_window` (two scrape intervals, the least increase() can see)."""
    by_pod = "host, pod"
    by_route = "host, litellm_model_name, model_id, api_base"  # rigup.cli.top merges a route's api_base forms
    pods, gpus, gateways = f'job="{JOB_PODS}"', f'job="{JOB_GPU}"', f'job=~"{JOB_GATEWAY}-.*"'
    queries = {
        "pod_up": f"up{{{pods}}}",
        "running": f"sum by ({by_pod}) ({RUNNING}{{{pods}}})",
        "waiting": f"sum by ({by_pod}) ({WAITING}{{{pods}}})",
        "kv_usage": f"avg by ({by_pod}) ({KV_USAGE}{{{pods}}})",
        "generation_tps": f"sum by ({by_pod}) (rate({GENERATION_TOKENS}{{{pods}}}[{rate_window}]))",
        "prompt_tps": f"sum by ({by_pod}) (rate({PROMPT_TOKENS}{{{pods}}}[{rate_window}]))",
        "gpu_up": f"up{{{gpus}}}",
        "gpu_fields": f'{{{gpus},__name__=~"{"|".join(GPU_FIELDS)}"}}',
        "gateway_up": f"up{{{gateways}}}",
        "route_state": f"{ROUTE_STATE}{{{gateways}}}",
        "success_rps": f"sum by ({by_route}) (rate({ROUTE_SUCCESS}{{{gateways}}}[{rate_window}]))",
        "failure_rps": f"sum by ({by_route}) (rate({ROUTE_FAILURE}{{{gateways}}}[{rate_window}]))",
    }
    for name, counter in (("last_success_at", ROUTE_SUCCESS), ("last_failure_at", ROUTE_FAILURE)):
        series = f"{counter}{{{gateways}}}"
        # a series new within the window counts too: LiteLLM creates it at a route's first success or failure,
        # which increase() cannot see (as the alert rule RigupGatewayRouteUnhealthy does)
        grew = f"increase({series}[{step_window}]) > 0 or ({series} unless {series} offset {step_window})"
        queries[name] = (f"max by (host, api_base) (max_over_time(timestamp({grew})"
                         f"[{ANSWER_LOOKBACK}:{scrape_interval}]))")
    for name, q in (("ttft_p50_s", 0.5), ("ttft_p95_s", 0.95)):
        queries[name] = (f"histogram_quantile({q}, sum by (le, {by_pod}) "
                         f"(rate({TTFT}_bucket{{{pods}}}[{ttft_window}])))")
    return queries


def duration(seconds: int) -> str:
    """A PromQL range: 1m, 5m, 90s."""
    return f"{seconds // 60}m" if seconds % 60 == 0 else f"{seconds}s"


Keep = Callable[[str, str | None], bool]  # (host, pod or None) -> whether --limit selects it


class PrometheusSource(Source):
    def __init__(self, url: str, timeout: float, *, scrape_interval_s: int = 15, keep: Keep | None = None,
                 route_names: RouteNames | None = None) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        # rate() needs two samples in its window: four scrape intervals, at least Grafana's usual 1m / 5m
        self.queries = prometheus_queries(duration(max(60, 4 * scrape_interval_s)), duration(max(300, 4 * scrape_interval_s)),
                                          duration(scrape_interval_s), duration(2 * scrape_interval_s))
        self.keep: Keep = keep or (lambda host, pod: True)
        self.route_names = route_names
        self.description = f"Prometheus {self.url}"

    def frame(self) -> Frame:
        at = time.time()
        names = list(self.queries)

        def ask(name: str) -> Vector | PrometheusError:
            try:
                return query_prometheus(self.url, self.queries[name], at, self.timeout)
            except PrometheusError as exc:
                return exc

        answers = dict(zip(names, parallel(names, ask)))
        unreachable = [a for a in answers.values() if isinstance(a, PrometheusUnreachable)]
        if len(unreachable) == len(answers):
            raise unreachable[0]
        frame = Frame(self.description, at)
        results: dict[str, Vector] = {}
        for name, answer in answers.items():
            if isinstance(answer, PrometheusError):
                frame.notes.append(f"{name}: {answer}")
                results[name] = []
            else:
                results[name] = answer
        frame.pods = self._pods(results)
        frame.gpus = self._gpus(results)
        frame.routes = self._routes(results)
        return frame

    def _pods(self, results: Mapping[str, Vector]) -> list[PodRow]:
        rows: dict[tuple[str, str], PodRow] = {}
        for labels, value in results["pod_up"]:
            host, pod = labels.get("host", labels.get("instance", "?")), labels.get("pod", "?")
            if self.keep(host, pod):
                up = value == 1
                rows[(host, pod)] = PodRow(host, pod, labels.get("model"), UP if up else "down (Prometheus: up 0)", up)
        for attr in ("running", "waiting", "kv_usage", "generation_tps", "prompt_tps", "ttft_p50_s", "ttft_p95_s"):
            for labels, value in results[attr]:
                row = rows.get((labels.get("host", "?"), labels.get("pod", "?")))
                if row is not None and row.answered:
                    setattr(row, attr, _finite(value))
        return sorted(rows.values(), key=lambda r: (r.host, r.pod))

    def _gpus(self, results: Mapping[str, Vector]) -> list[GpuRow]:
        fields: dict[str, dict[str, dict[str, Any]]] = {}
        down: list[GpuRow] = []
        for labels, value in results["gpu_up"]:
            host = labels.get("host", labels.get("instance", "?"))
            if value != 1 and self.keep(host, None):
                down.append(GpuRow(host, None, None, state="down (Prometheus: up 0)", answered=False))
        for labels, value in results["gpu_fields"]:
            host = labels.get("host", "?")
            attr = GPU_FIELDS.get(labels.get("__name__", ""))
            if attr is None or not self.keep(host, None):
                continue
            gpu = labels.get("gpu") or labels.get("UUID") or "?"
            fields.setdefault(host, {}).setdefault(gpu, {"name": labels.get("modelName")})[attr] = value
        rows = [row for host, gpus in fields.items() for row in gpu_rows_from(host, gpus)] + down
        return sorted(rows, key=lambda r: (r.host, _index(r.gpu)))

    def _routes(self, results: Mapping[str, Vector]) -> list[RouteRow]:
        routes: dict[tuple[str, str], RouteEvidence] = {}

        def evidence(labels: Mapping[str, str]) -> RouteEvidence | None:
            host, base = labels.get("host", "?"), route_base(labels.get("api_base"))
            if base is None or not self.keep(host, None):
                return None
            found = routes.setdefault((host, base), RouteEvidence(host, base))
            found.learn(labels.get)
            return found

        for labels, value in results["route_state"]:
            if (route := evidence(labels)) is not None:
                route.states.append(value)
        for labels, value in results["success_rps"]:
            if (route := evidence(labels)) is not None:
                route.add_rates(_finite(value), None)
        for labels, value in results["failure_rps"]:
            if (route := evidence(labels)) is not None:
                route.add_rates(None, _finite(value))
        for attr in ("last_success_at", "last_failure_at"):
            for labels, value in results[attr]:
                route = routes.get((labels.get("host", "?"), route_base(labels.get("api_base")) or ""))
                if route is not None and _finite(value) is not None:
                    setattr(route, attr, max(value, getattr(route, attr) or value))
        rows = route_rows_of({key: r for key, r in routes.items() if r.states}, self.route_names)
        with_routes = {row.gateway for row in rows}
        for labels, value in results["gateway_up"]:
            host = labels.get("host", labels.get("instance", "?"))
            if not self.keep(host, None) or host in with_routes:
                continue
            if value == 1:
                rows.append(RouteRow(host, None, None, None, NO_ROUTES))
            else:
                rows.append(RouteRow(host, None, None, None, "down (Prometheus: up 0)", answered=False))
        return sorted(rows, key=lambda r: (r.gateway, r.model or "", r.route or ""))


def _index(gpu: str | None) -> tuple[int, str]:
    return (int(gpu), "") if gpu is not None and gpu.isdigit() else (1 << 30, gpu or "")


class FallbackSource(Source):
    """The fleet's Prometheus; the targets directly for a frame it does not answer."""

    def __init__(self, primary: PrometheusSource, direct: DirectSource) -> None:
        self.primary = primary
        self.direct = direct
        self.description = primary.description

    def frame(self) -> Frame:
        try:
            return self.primary.frame()
        except PrometheusUnreachable as exc:
            frame = self.direct.frame()
            frame.source = f"{frame.source} ({self.primary.description}: {exc})"
            return frame


# --------------------------------------------------------------------------------------------------
# the fleet's Prometheus


@dataclass(frozen=True)
class Monitor:
    host: str
    url: str | None  # None: not reachable from here (problem says why)
    scrape_interval_s: int
    problem: str | None = None


def fleet_monitor(fleet: Fleet) -> Monitor | None:
    """The first host of monitor_group and where its Prometheus answers (0.0.0.0: at its ssh_hostname)."""
    for host in fleet.hosts:
        data = fleet.resolved_data(host.name)
        if not is_monitor(data, [host.group]):
            continue
        listen = str(knob(data, "prometheus_listen_address"))
        address, _, port = listen.rpartition(":")
        address = address.strip("[]")
        ssh = SshSettings.from_data(host.name, data)
        interval = int(knob(data, "prometheus_scrape_interval_s"))
        if address in ("0.0.0.0", "::"):
            reach = "127.0.0.1" if ssh.local else api_host(ssh.hostname)
        elif (address.startswith("127.") or address in ("::1", "localhost")) and not ssh.local:
            return Monitor(host.name, None, interval, f"Prometheus on {host.name} listens on {listen}, its own loopback")
        else:
            reach = f"[{address}]" if ":" in address else address
        return Monitor(host.name, f"http://{reach}:{port}", interval)
    return None


def selection_filter(fleet: Fleet, limit: Sequence[str] | None) -> Keep | None:
    """--limit for rows read from Prometheus: the selected hosts, and of "<host>/<pod>" that pod."""
    if not limit:
        return None
    selected = limit_selection(fleet, limit)
    return lambda host, pod: host in selected and (pod is None or selected[host] is None or pod in selected[host])


# --------------------------------------------------------------------------------------------------
# drawing


def _num(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def seconds_text(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"


def memory_text(used: float | None, free: float | None, unit: str = " GiB") -> str:
    if used is None:
        return "-"
    if free is None:
        return f"{used / 1024:.1f}{unit}"
    return f"{used / 1024:.1f}/{(used + free) / 1024:.1f}{unit}"


def _state_style(state: str, answered: bool) -> str:
    if not answered or state.startswith("complete"):
        return "bold red"
    if state in (UP, "healthy"):
        return "green"
    return "yellow"


def short_route(name: str) -> str:
    """rig-01/rigup-dual.service -> rig-01/dual: rigup names every unit rigup-<pod>.service."""
    host, _, unit = name.rpartition("/")
    short = unit.removeprefix("rigup-").removesuffix(".service")
    return f"{host}/{short}" if host else short


def short_gpu_name(name: str) -> str:
    """NVIDIA GeForce RTX 3090 -> RTX 3090."""
    for prefix in ("NVIDIA GeForce ", "NVIDIA "):
        if name.startswith(prefix):
            return name.removeprefix(prefix)
    return name


@dataclass(frozen=True)
class Column:
    header: str
    short: str  # its header when the terminal is narrow
    justify: str = "left"
    drop: int = 0  # 1: the first to go when the terminal is narrow, 2 the next, ...; 0: never (host, pod, state)


@dataclass(frozen=True)
class Cell:
    text: str
    short: str | None = None  # the value when the terminal is narrow (a shorter form of the same name)
    style: str | None = None

    def shown(self, narrow: bool) -> str:
        return self.short if narrow and self.short is not None else self.text


COLUMN_GAP = 2  # a table's columns are this far apart (show_edge off, paddings collapsed)


def table_width(columns: Sequence[Column], rows: Sequence[Sequence[Cell]], keep: Sequence[int], narrow: bool) -> int:
    from rich.cells import cell_len  # deferred with rich.console: see tests/test_layout.py DEFERRED_IMPORTS

    widths = [max([cell_len(columns[i].short if narrow else columns[i].header),
                   *(cell_len(row[i].shown(narrow)) for row in rows)]) for i in keep]
    return sum(widths) + COLUMN_GAP * (len(widths) - 1)


def fit_columns(columns: Sequence[Column], rows: Sequence[Sequence[Cell]], width: int) -> tuple[list[int], bool]:
    """Which columns to show in `width` characters, and whether in their short forms: every column at
    ease; else short headers and names; else without the least useful column, then the next. A column
    that never drops stays; when even they do not fit, those alone (the terminal wraps nothing: the
    state column folds)."""
    keep = list(range(len(columns)))
    if table_width(columns, rows, keep, False) <= width:
        return keep, False
    for column in sorted((c for c in columns if c.drop), key=lambda c: c.drop):
        if table_width(columns, rows, keep, True) <= width:
            break
        keep.remove(columns.index(column))
    return keep, True


def fitted_table(title: str, columns: Sequence[Column], rows: Sequence[Sequence[Cell]], width: int,
                 empty: str) -> Any:
    from rich import box  # deferred: see table_width()
    from rich.table import Table
    from rich.text import Text

    keep, narrow = fit_columns(columns, rows, width)
    hidden = len(columns) - len(keep)
    more = f" ({hidden} more column{'s' if hidden > 1 else ''} in a wider terminal)" if hidden else ""
    table = Table(title=title + more,
                  title_justify="left", title_style="bold", box=box.SIMPLE_HEAD, show_edge=False,
                  collapse_padding=True, pad_edge=False)
    for i in keep:
        column = columns[i]
        # a column that never drops folds rather than ends in "…": what is cut is lost to the reader
        table.add_column(column.short if narrow else column.header, justify=column.justify,  # type: ignore[arg-type]
                         no_wrap=bool(column.drop), overflow="ellipsis" if column.drop else "fold")
    for row in rows:
        table.add_row(*(Text(row[i].shown(narrow), style=row[i].style or "") for i in keep))
    if not rows:
        table.caption, table.caption_justify = empty, "left"
    return table


POD_COLUMNS = (
    Column("HOST", "HOST"), Column("POD", "POD"), Column("MODEL", "MODEL", drop=1), Column("STATE", "STATE"),
    Column("RUN", "RUN", "right", drop=8), Column("WAIT", "WAIT", "right", drop=6),
    Column("GEN TOK/S", "GEN/S", "right", drop=7), Column("PROMPT TOK/S", "PROMPT/S", "right", drop=2),
    Column("TTFT P50", "TTFT50", "right", drop=5), Column("TTFT P95", "TTFT95", "right", drop=3),
    Column("KV CACHE", "KV", "right", drop=4),
)
GPU_COLUMNS = (
    Column("HOST", "HOST"), Column("GPU", "GPU", "right", drop=6), Column("NAME", "NAME", drop=1),
    Column("STATE", "STATE"), Column("UTIL", "UTIL", "right", drop=5), Column("MEMORY", "MEMORY", "right", drop=4),
    Column("TEMP", "TEMP", "right", drop=3), Column("POWER", "POWER", "right", drop=2),
)
ROUTE_COLUMNS = (
    Column("GATEWAY", "GW", drop=3), Column("MODEL", "MODEL", drop=2), Column("ROUTE", "ROUTE"),
    Column("API BASE", "API BASE", drop=1), Column("STATE", "STATE"), Column("OK/S", "OK/S", "right"),
    Column("FAIL/S", "FAIL/S", "right"),
)


def pod_cells(p: PodRow) -> list[Cell]:
    return [Cell(p.host), Cell(p.pod), Cell(p.model or "-"), Cell(p.state, style=_state_style(p.state, p.answered)),
            Cell(_num(p.running, ".0f")), Cell(_num(p.waiting, ".0f")), Cell(_num(p.generation_tps, ".1f")),
            Cell(_num(p.prompt_tps, ".1f")), Cell(seconds_text(p.ttft_p50_s)), Cell(seconds_text(p.ttft_p95_s)),
            Cell(_num(None if p.kv_usage is None else p.kv_usage * 100, ".1f", "%"))]


def gpu_cells(g: GpuRow) -> list[Cell]:
    return [Cell(g.host), Cell(g.gpu or "-"), Cell(g.name or "-", short_gpu_name(g.name or "-")),
            Cell(g.state, style=_state_style(g.state, g.answered)), Cell(_num(g.util_pct, ".0f", "%")),
            Cell(memory_text(g.mem_used_mib, g.mem_free_mib), memory_text(g.mem_used_mib, g.mem_free_mib, "G")),
            Cell(_num(g.temp_c, ".0f", " C")), Cell(_num(g.power_w, ".0f", " W"))]


def route_cells(r: RouteRow) -> list[Cell]:
    return [Cell(r.gateway), Cell(r.model or "-"), Cell(r.route or "-", short_route(r.route) if r.route else None),
            Cell(r.api_base or "-"), Cell(r.state, style=_state_style(r.state, r.answered)),
            Cell(_num(r.success_rps, ".2f")), Cell(_num(r.failure_rps, ".2f"))]


def header_line(frame: Frame, interval: float, live: bool, width: int) -> tuple[Any, str | None]:
    """The frame's first line, as much as `width` holds (richest first), and the line that says why the
    source is what it is when the header has no room for it."""
    from rich.cells import cell_len  # deferred: see table_width()
    from rich.text import Text

    when = time.localtime(frame.taken_at)
    source, _, why = frame.source.partition(" (")
    why = f"({why}" if why else ""
    keys = "q or Ctrl-C quits" if live else ""
    every = f"every {interval:g} s" if live else ""
    variants = [
        (frame.source, time.strftime("%Y-%m-%d %H:%M:%S", when), ", ".join(p for p in (every, keys) if p), None),
        (frame.source, time.strftime("%H:%M:%S", when), keys, None),
        (source, time.strftime("%H:%M:%S", when), keys, why or None),
        (source, time.strftime("%H:%M:%S", when), "q quits" if live else "", why or None),
        (source, "", "", why or None),
    ]
    for text, at, tail, note in variants:  # the last one, cut to the width, when none fits
        if cell_len("  ".join(p for p in ("rigup top", text, at, tail) if p)) <= width:
            break
    header = Text.assemble(("rigup top", "bold"), *(f"  {p}" for p in (text, at) if p))
    if tail:
        header.append(f"  {tail}", style="dim")
    header.truncate(width, overflow="ellipsis")
    return header, note


def render(frame: Frame, interval: float, live: bool, width: int = BATCH_WIDTH) -> Any:
    """The frame as rich renderables `width` characters wide: a header line and the pods', GPUs' and
    routes' tables, each with the columns that fit (fit_columns)."""
    from rich.console import Group  # deferred: see table_width()
    from rich.text import Text

    header, why = header_line(frame, interval, live, width)
    parts: list[Any] = [header]
    if why:
        parts.append(Text(why, style="yellow"))
    if frame.first_scrape:
        parts.append(Text("rates and TTFT need a second scrape: \"-\" until the next frame", style="dim"))
    for note in frame.notes:
        parts.append(Text(note, style="yellow"))
    for title, columns, rows, what in (
        ("Pods", POD_COLUMNS, [pod_cells(p) for p in frame.pods], "pods"),
        ("GPUs", GPU_COLUMNS, [gpu_cells(g) for g in frame.gpus], "GPU exporters"),
        ("Gateway routes", ROUTE_COLUMNS, [route_cells(r) for r in frame.routes], "gateways"),
    ):
        parts += [Text(""), fitted_table(title, columns, rows, width, f"no {what} in the selection")]
    return Group(*parts)


def frame_document(frame: Frame) -> dict[str, Any]:
    def clean(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, list):
            return [clean(v) for v in value]
        return value

    document = clean(asdict(frame))
    document["unanswered"] = frame.unanswered
    return document


# --------------------------------------------------------------------------------------------------
# the command


def choose_source(args: argparse.Namespace, timeout: float) -> Source:
    """--prometheus URL; else the fleet's Prometheus (falling back to direct); else direct."""
    if args.prometheus and not args.limit:
        return PrometheusSource(args.prometheus, timeout)
    fleet = load_fleet(args.fleet)
    names = fleet_route_names(fleet_targets(fleet=fleet))  # every rig: a gateway routes beyond --limit

    def direct() -> DirectSource:
        return DirectSource(direct_endpoints(fleet_targets(args.limit, fleet=fleet)), timeout, names)

    if args.prometheus:
        return PrometheusSource(args.prometheus, timeout, keep=selection_filter(fleet, args.limit), route_names=names)
    monitor = None if args.direct else fleet_monitor(fleet)
    if monitor is None:
        return direct()
    if monitor.url is None:
        source = direct()
        source.description += f" ({monitor.problem})"
        return source
    keep = selection_filter(fleet, args.limit)
    primary = PrometheusSource(monitor.url, timeout, scrape_interval_s=monitor.scrape_interval_s, keep=keep,
                               route_names=names)
    return FallbackSource(primary, direct())  # the targets resolved (and --limit checked) up front


def cmd_top(args: argparse.Namespace) -> int:
    interval = args.interval
    timeout = max(0.5, min(MAX_TIMEOUT_S, interval))
    try:
        source = choose_source(args, timeout)
    except (RemoteError, ValueError) as exc:
        print(f"rigup top: {exc}", file=sys.stderr)
        return EXIT_BAD_FLEET
    if args.once or args.json:
        try:
            return once(source, args)
        except KeyboardInterrupt:
            return EXIT_INTERRUPTED
    return watch(source, interval)


def once(source: Source, args: argparse.Namespace) -> int:
    frame = source.frame()
    if frame.first_scrape:
        if not (args.quiet or args.json):
            progress(f"rigup top: {frame.source}: scraping again in {args.interval:g} s for rates and quantiles ...")
        time.sleep(args.interval)
        frame = source.frame()
    if args.json:
        print(json.dumps(frame_document(frame), indent=2))
    else:
        console = make_console()
        console.print(render(frame, args.interval, live=False, width=console.width))
    return EXIT_UNANSWERED if frame.unanswered else 0


def make_console() -> Any:
    """The terminal; a file or pipe gets lines of at least BATCH_WIDTH (rich would assume 80)."""
    from rich.console import Console  # deferred: see table_width()

    console = Console()
    return console if console.is_terminal else Console(width=max(console.width, BATCH_WIDTH))


QUIT_KEYS = frozenset("qQ")
KEY_POLL_S = 0.2  # how soon a key or a resized terminal is seen between frames


class Keys:
    """The terminal's keys as they are typed (cbreak mode: no Enter needed; Ctrl-C still interrupts),
    the terminal's settings restored on the way out."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.saved: list[Any] | None = None
        self.closed = False

    def __enter__(self) -> Keys:
        self.saved = termios.tcgetattr(self.fd)
        tty.setcbreak(self.fd, termios.TCSANOW)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.saved is not None:
            termios.tcsetattr(self.fd, termios.TCSADRAIN, self.saved)

    def read(self, timeout: float) -> str:
        """What was typed within `timeout` seconds ("" for nothing)."""
        if self.closed:
            time.sleep(timeout)
            return ""
        ready, _, _ = select.select([self.fd], [], [], max(0.0, timeout))
        if not ready:
            return ""
        typed = os.read(self.fd, 64)
        self.closed = not typed  # the end of input: wait out the interval from now on
        return typed.decode(errors="replace")


def watch(source: Source, interval: float) -> int:
    """Redraw until q or Ctrl-C; on a terminal in its alternate screen (as top does), laid out again when
    the terminal is resized; else frame after frame."""
    from rich.live import Live  # deferred: see table_width()
    from rich.text import Text

    console = make_console()
    try:
        if not console.is_terminal:
            while True:
                started = time.monotonic()
                console.print(render(source.frame(), interval, live=True, width=console.width))
                time.sleep(max(0.0, interval - (time.monotonic() - started)))
        keys = Keys(sys.stdin.fileno()) if sys.stdin.isatty() else None
        with keys or contextlib.nullcontext(), Live(Text(f"rigup top: reading {source.description} ..."),
                                                    console=console, screen=True, auto_refresh=False) as live:
            while True:
                started = time.monotonic()
                frame = source.frame()
                size = console.size
                live.update(render(frame, interval, live=True, width=size.width), refresh=True)
                while (left := interval - (time.monotonic() - started)) > 0:
                    typed = keys.read(min(left, KEY_POLL_S)) if keys else ""
                    if keys is None:
                        time.sleep(min(left, KEY_POLL_S))
                    if QUIT_KEYS & set(typed):
                        return 0
                    if console.size != size:  # resized: this frame laid out again at once
                        size = console.size
                        live.update(render(frame, interval, live=True, width=size.width), refresh=True)
    except KeyboardInterrupt:
        return 0


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not math.isfinite(value) or value < 0.2:
        raise argparse.ArgumentTypeError(f"expected at least 0.2 seconds, got {text!r}")
    return value


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `top [--fleet FILE] [--limit HOST ...] [--interval S] [--once] [--direct | --prometheus URL] [--json]`."""
    parser = subparsers.add_parser(
        "top",
        help="a live view of the fleet: pods' requests, tokens/s, TTFT and KV cache, GPUs, gateway routes",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--fleet", metavar="FILE", help="fleet file (default: $RIGUP_RIGS, else rigs.yaml)")
    add_target_arguments(parser, json_help="print one frame as JSON (implies --once)")
    parser.add_argument("--interval", type=positive_seconds, default=DEFAULT_INTERVAL_S, metavar="S",
                        help=f"seconds between frames (default {DEFAULT_INTERVAL_S:g})")
    parser.add_argument("--once", action="store_true",
                        help="print one frame and exit (exit 1 when a target did not answer)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--direct", action="store_true", help="scrape the targets' /metrics, not the fleet's Prometheus")
    where.add_argument("--prometheus", metavar="URL", help="read this Prometheus (e.g. http://10.0.0.5:9090)")
    parser.set_defaults(func=cmd_top)
    return parser
