"""What `rigup top` shows, read from the fleet: a Frame of rows per pod (requests, token rates, time to first
token, KV cache), per GPU (dcgm-exporter's fields) and per gateway route (its answers and its state now),
from one of two sources. DirectSource scrapes the targets' own /metrics and takes rates and quantiles from
the difference between two scrapes; PrometheusSource asks the fleet's Prometheus (prometheus_queries, over
the jobs rigup.desired.monitoring writes); FallbackSource reads directly a frame Prometheus does not
answer. rigup.client.top_sources chooses the source from the fleet file; rigup.cli.top draws the frames."""

from __future__ import annotations

import math
import time
import urllib.parse
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import requests

from rigup.client.fanout import parallel
from rigup.client.openai_client import tls_failure
from rigup.client.ssh import SshSettings
from rigup.desired.fleet import Fleet
from rigup.desired.knobs import knob, url_host
from rigup.desired.metrics_auth import PrometheusLogin, prometheus_login
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
# The entrance's routers (vllm-router 0.1.17; the front's /metrics/ joins them, each sample labelled with its
# model): a route is one worker (a pod's base URL, label worker) of one model's router. Checked against the wheel.
ROUTE_HEALTH = "vllm_router_worker_health"  # 1 in rotation, 0 out (its health checks failed it)
ROUTE_BREAKER = "vllm_router_cb_state"  # 0 closed, 1 open, 2 half_open
ROUTE_OUTCOMES = "vllm_router_cb_outcomes_total"  # answers by worker and outcome (success | failure)
ROUTE_HEALTHY = "healthy"
OUT_OF_ROTATION = "out of rotation"
BREAKER_STATES = {1: "circuit open", 2: "circuit half-open"}

UP = "up"
NO_ROUTES = "no routes yet"  # the entrance routes to no pod


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
    route: str | None  # <host>/<unit> of the pod at api_base (its address when no pod of the fleet listens there)
    api_base: str | None
    state: str  # healthy | out of rotation | circuit open | ... | no routes yet | why the gateway did not answer
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
    ca_file: str | None = None  # an https URL's certificate is verified against it; None: the system's store
    # the metrics login an exporter asks for (basic auth; its certificate verified against the login's CA file)
    login: PrometheusLogin | None = field(default=None, repr=False, compare=False)


@dataclass(frozen=True)
class Scrape:
    endpoint: Endpoint
    at: float  # time.monotonic() when the answer came
    metrics: Exposition | None
    error: str | None = None


def metrics_url(api_url: str) -> str:
    """vLLM's /metrics beside its OpenAI API (http://host:port or .../v1)."""
    return api_url.rstrip("/").removesuffix("/v1") + "/metrics"


def why_not(exc: requests.RequestException, timeout: float, ca_file: str | None = None) -> str:
    """A failed request in a few words."""
    if isinstance(exc, requests.Timeout):
        return f"no answer in {timeout:g} s"
    if isinstance(exc, requests.exceptions.SSLError):
        return tls_failure(exc, ca_file)
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
    login = endpoint.login
    ca_file = login.ca_file if login is not None else endpoint.ca_file
    try:
        reply = requests.get(endpoint.url, headers=headers, timeout=timeout, auth=login.auth if login else None,
                             verify=ca_file or True)
    except requests.RequestException as exc:
        return Scrape(endpoint, time.monotonic(), None, f"down: {why_not(exc, timeout, ca_file)}")
    at = time.monotonic()
    if reply.status_code != 200:
        refused = " (the key refused)" if reply.status_code in (401, 403) and endpoint.key else ""
        refused += " (the metrics login refused)" if reply.status_code in (401, 403) and login else ""
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


def route_api_base(worker: str) -> str:
    """A route's API base as rigup writes it (http://host:port/v1) from the router's worker (the pod's base URL,
    what --worker-urls took)."""
    return worker.rstrip("/") + "/v1"


def route_state(health: float | None, breaker: float | None) -> str:
    """A route's state now, as its model's router says: vllm_router_worker_health (1 in rotation, 0 out: its health
    checks failed it) and vllm_router_cb_state (0 closed, 1 open: requests skip the pod, 2 half-open: one tries it)."""
    if health is not None and health < 1:
        return f"{OUT_OF_ROTATION}, circuit open" if breaker == 1 else OUT_OF_ROTATION
    return BREAKER_STATES.get(int(breaker), f"circuit state {breaker:g}") if breaker else ROUTE_HEALTHY


def address_of(api_base: str) -> str:
    """host:port of an API base, what names a route when nothing else does."""
    return urllib.parse.urlsplit(api_base).netloc or api_base


RouteNames = Callable[[str, str], str | None]  # (gateway host, API base) -> the route's name (<host>/<unit>)


@dataclass
class RouteEvidence:
    """What an entrance's routers say of one route: a worker of one model's router."""

    gateway: str
    model: str
    worker: str
    health: float | None = None
    breaker: float | None = None
    success_rps: float | None = None
    failure_rps: float | None = None

    def row(self, names: RouteNames | None) -> RouteRow:
        base = route_api_base(self.worker)
        name = (names(self.gateway, base) if names else None) or address_of(base)
        return RouteRow(self.gateway, self.model or None, name, base, route_state(self.health, self.breaker),
                        success_rps=self.success_rps, failure_rps=self.failure_rps)


def route_rows_of(evidence: Mapping[Any, RouteEvidence], names: RouteNames | None) -> list[RouteRow]:
    """A row per route its router reports the health of (vllm_router_worker_health)."""
    rows = (e.row(names) for e in evidence.values() if e.health is not None)
    return sorted(rows, key=lambda r: (r.gateway, r.model or "", r.route or ""))


def gateway_evidence(gateway: str, metrics: Exposition) -> dict[tuple[str, str], RouteEvidence]:
    """The routes an entrance's /metrics/ shows, by (model, worker): each router's samples, labelled with its model."""
    routes: dict[tuple[str, str], RouteEvidence] = {}
    for name, attr in ((ROUTE_HEALTH, "health"), (ROUTE_BREAKER, "breaker")):
        for sample in metrics.samples(name):
            model, worker = sample.label("model") or "", sample.label("worker")
            if worker:
                setattr(routes.setdefault((model, worker), RouteEvidence(gateway, model, worker)), attr, sample.value)
    return routes


def outcomes_between(before: Exposition, now: Exposition) -> dict[tuple[str, str, str], float]:
    """Per (model, worker, outcome), how many answers the routers counted between two scrapes (a series the earlier
    scrape lacks counts from 0: the router makes it at its first such outcome)."""
    earlier = {s.labels: s.value for s in before.samples(ROUTE_OUTCOMES)}
    grown: dict[tuple[str, str, str], float] = {}
    for sample in now.samples(ROUTE_OUTCOMES):
        key = (sample.label("model") or "", sample.label("worker") or "", sample.label("outcome") or "")
        grown[key] = grown.get(key, 0.0) + counter_increase(earlier.get(sample.labels, 0.0), sample.value)
    return grown


def route_rows(now: Scrape, before: Scrape | None, names: RouteNames | None = None) -> list[RouteRow]:
    """An entrance's routes from two scrapes of its /metrics/: each router's verdict now, and its answers per second
    between the scrapes (none on the first)."""
    endpoint = now.endpoint
    if now.metrics is None:
        return [RouteRow(endpoint.host, None, None, None, now.error or "down", answered=False)]
    routes = gateway_evidence(endpoint.host, now.metrics)
    if before is not None and before.metrics is not None and now.at > before.at:
        seconds = now.at - before.at
        grown = outcomes_between(before.metrics, now.metrics)
        for (model, worker), evidence in routes.items():
            evidence.success_rps = grown.get((model, worker, "success"), 0.0) / seconds
            evidence.failure_rps = grown.get((model, worker, "failure"), 0.0) / seconds
    return route_rows_of(routes, names) or [RouteRow(endpoint.host, None, None, None, NO_ROUTES)]


class DirectSource(Source):
    """Scrapes the endpoints every frame; rates and quantiles from the difference to the last frame."""

    def __init__(self, endpoints: Sequence[Endpoint], timeout: float, route_names: RouteNames | None = None) -> None:
        self.endpoints = list(endpoints)
        self.timeout = timeout
        self.route_names = route_names
        self.previous: dict[Endpoint, Scrape] = {}
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
                frame.routes.extend(route_rows(now, before, self.route_names))
        self.previous = {s.endpoint: s for s in scrapes if s.metrics is not None}
        return frame


# --------------------------------------------------------------------------------------------------
# Prometheus: its HTTP API's instant queries


class PrometheusError(RuntimeError):
    """A query Prometheus refused or answered with something else than a vector."""


class PrometheusUnreachable(PrometheusError):
    """Prometheus did not answer at all."""


Vector = list[tuple[dict[str, str], float]]


def query_prometheus(url: str, promql: str, at: float, timeout: float, login: PrometheusLogin | None = None) -> Vector:
    """GET /api/v1/query: the instant vector as (labels, value) pairs; with `login`, as the fleet's Prometheus asks
    (basic auth, its certificate checked against the fleet CA's)."""
    try:
        reply = requests.get(f"{url}/api/v1/query", params={"query": promql, "time": f"{at:.3f}"}, timeout=timeout,
                             auth=login.auth if login else None, verify=login.ca_file if login else True)
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


def prometheus_queries(rate_window: str = "1m", ttft_window: str = "5m") -> dict[str, str]:
    """What a frame asks Prometheus: the fleet's jobs (rigup.desired.monitoring) and their labels. A route's
    routes: each router's verdict of its workers and their answers per second, by entrance host, model and worker."""
    by_pod = "host, pod"
    by_route = "host, model, worker"
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
        "route_health": f"max by ({by_route}) ({ROUTE_HEALTH}{{{gateways}}})",
        "route_breaker": f"max by ({by_route}) ({ROUTE_BREAKER}{{{gateways}}})",
        "success_rps": f'sum by ({by_route}) (rate({ROUTE_OUTCOMES}{{{gateways},outcome="success"}}[{rate_window}]))',
        "failure_rps": f'sum by ({by_route}) (rate({ROUTE_OUTCOMES}{{{gateways},outcome="failure"}}[{rate_window}]))',
    }
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
                 route_names: RouteNames | None = None, login: PrometheusLogin | None = None) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.login = login
        # rate() needs two samples in its window: four scrape intervals, at least Grafana's usual 1m / 5m
        self.queries = prometheus_queries(duration(max(60, 4 * scrape_interval_s)), duration(max(300, 4 * scrape_interval_s)))
        self.keep: Keep = keep or (lambda host, pod: True)
        self.route_names = route_names
        self.description = f"Prometheus {self.url}"

    def frame(self) -> Frame:
        at = time.time()
        names = list(self.queries)

        def ask(name: str) -> Vector | PrometheusError:
            try:
                return query_prometheus(self.url, self.queries[name], at, self.timeout, self.login)
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
        routes: dict[tuple[str, str, str], RouteEvidence] = {}

        def evidence(labels: Mapping[str, str], create: bool) -> RouteEvidence | None:
            host, model, worker = labels.get("host", "?"), labels.get("model", ""), labels.get("worker")
            if not worker or not self.keep(host, None):
                return None
            if create:
                return routes.setdefault((host, model, worker), RouteEvidence(host, model, worker))
            return routes.get((host, model, worker))

        for labels, value in results["route_health"]:
            if (route := evidence(labels, True)) is not None:
                route.health = value
        for attr in ("route_breaker", "success_rps", "failure_rps"):
            for labels, value in results[attr]:
                if (route := evidence(labels, False)) is not None:
                    setattr(route, attr.removeprefix("route_"), _finite(value))
        rows = route_rows_of(routes, self.route_names)
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
# the rigs' sentinels (docs/sentinel.md): a quarantined or outvoted pod, marked in its row


QUARANTINED = "QUARANTINED"
SENTINEL_QUERIES = {
    # the rig's sentinel holds the pod (its labels are the evidence: a fixed probe, never user text)
    "quarantined": "rigup_sentinel_quarantined == 1",
    # the monitor's replica consensus: the pod's greedy answer is its release identity's minority
    "outvoted": 'ALERTS{alertname="RigupPodOutvoted", alertstate="firing"}',
}


def sentinel_marks(results: Mapping[str, Vector]) -> dict[tuple[str, str], str]:
    """(host, pod) -> the state a quarantined or outvoted pod shows: QUARANTINED and its evidence."""
    marks: dict[tuple[str, str], str] = {}
    for labels, _ in results.get("outvoted", []):
        marks[(labels.get("host", "?"), labels.get("pod", "?"))] = (
            f"{QUARANTINED}: outvoted on probe {labels.get('probe')} (answer {labels.get('answer')})")
    for labels, _ in results.get("quarantined", []):
        marks[(labels.get("host", "?"), labels.get("pod", "?"))] = (
            f"{QUARANTINED}: probe {labels.get('probe')} answered {labels.get('answer')} ({labels.get('expected')})")
    return marks


class SentinelMarks(Source):
    """Another source's frame with each quarantined or outvoted pod's state saying so, as the fleet's
    Prometheus has it (the sentinel's series and the RigupPodOutvoted alert). A frame read directly from the
    targets without that Prometheus cannot know it: `rigup status` reads the rigs' own records."""

    def __init__(self, source: Source, url: str, timeout: float, login: PrometheusLogin | None = None) -> None:
        self.source = source
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.login = login
        self.description = source.description

    def frame(self) -> Frame:
        frame = self.source.frame()
        results: dict[str, Vector] = {}
        for name, promql in SENTINEL_QUERIES.items():
            try:
                results[name] = query_prometheus(self.url, promql, frame.taken_at, self.timeout, self.login)
            except PrometheusError as exc:
                frame.notes.append(f"sentinel {name}: {exc}")
        marks = sentinel_marks(results)
        for row in frame.pods:
            if (row.host, row.pod) in marks:
                row.state = marks[(row.host, row.pod)]
        return frame


# --------------------------------------------------------------------------------------------------
# the fleet's Prometheus


@dataclass(frozen=True)
class Monitor:
    """The fleet's Prometheus: its host, where it answers from here, how often it scrapes, and the login it asks for."""

    host: str
    url: str | None  # None: not reachable from here (problem says why)
    scrape_interval_s: int
    problem: str | None = None
    login: PrometheusLogin | None = None


def fleet_monitor(fleet: Fleet) -> Monitor | None:
    """The first host of monitor_group and where its Prometheus answers (0.0.0.0: at its ssh_hostname), over TLS with
    the login it asks for (rigup.desired.metrics_auth.prometheus_login: as the converge left it on this machine)."""
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
            reach = "127.0.0.1" if ssh.local else url_host(ssh.hostname)
        elif (address.startswith("127.") or address in ("::1", "localhost")) and not ssh.local:
            return Monitor(host.name, None, interval, f"Prometheus on {host.name} listens on {listen}, its own loopback")
        else:
            reach = f"[{address}]" if ":" in address else address
        login = prometheus_login(data, fleet.path.parent)
        if isinstance(login, str):
            return Monitor(host.name, None, interval, f"Prometheus on {host.name} asks who is calling: {login}")
        return Monitor(host.name, f"https://{reach}:{port}", interval, login=login)
    return None
