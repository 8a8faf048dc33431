"""What `rigup top` shows, read from the fleet: a Frame of rows per pod (requests, token rates, time to first
token, KV cache), per GPU (dcgm-exporter's fields) and per gateway route (its answers and its state now),
from one of two sources. DirectSource scrapes the targets' own /metrics and takes rates and quantiles from
the difference between two scrapes; PrometheusSource asks the fleet's Prometheus (prometheus_queries, over
the jobs rigup.desired.monitoring writes); FallbackSource reads directly a frame Prometheus does not
answer. rigup.cli.top chooses the source from the fleet file and draws the frames."""

from __future__ import annotations

import math
import time
import urllib.parse
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import requests

from rigup.client.fanout import parallel
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


def prometheus_queries(rate_window: str = "1m", ttft_window: str = "5m", scrape_interval: str = "15s",
                       step_window: str = "30s") -> dict[str, str]:
    """What a frame asks Prometheus: the fleet's jobs (rigup.desired.monitoring) and their labels. A route's
    latest success and failure: the last step (one scrape interval) of the past ANSWER_LOOKBACK at which its
    counter grew over `step_window` (two scrape intervals, the least increase() can see)."""
    by_pod = "host, pod"
    by_route = "host, litellm_model_name, model_id, api_base"  # route_base merges a route's api_base forms
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
                 route_names: RouteNames | None = None, login: PrometheusLogin | None = None) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.login = login
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
