"""`rigup top`: a live view of the fleet in the terminal, redrawn every few seconds.

Per pod: requests running and waiting, generated and prompt tokens per second, time to first token
(p50, p95) and KV-cache use. Per GPU: utilisation, memory, temperature and power. Per gateway route:
LiteLLM's state of the deployment (healthy, partial or complete outage) and its answers per second.

Where it reads: the fleet's Prometheus (the first host of monitor_group, by default gateway_group's,
at prometheus_listen_address) through its HTTP API, or the one --prometheus names. With --direct, or
when the fleet has no monitor host, the targets themselves: each pod's /metrics, each rig's GPU exporter
(gpu_exporter_port, when metrics_exporters is on) and each gateway's /metrics/ with the gateway key.
Read directly, rates and quantiles are the difference between two scrapes, so the first frame shows
"-" for them. When the fleet's Prometheus does not answer, the frame is read directly and the header
says why. A target that does not answer is a row saying so.

Ctrl-C quits (exit 0). --once prints one frame (direct: after two scrapes --interval apart) and exits
0 when every target answered, 1 when one did not; 2: the fleet file or --limit could not be used (one
line says why).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
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


def answer_rates(success: float | None, failure: float | None) -> tuple[float | None, float | None]:
    """LiteLLM has no series of a route's successes before its first success (of failures likewise):
    the missing one is 0 once the other exists."""
    if success is None and failure is None:
        return None, None
    return success or 0.0, failure or 0.0


def route_base(api_base: str | None) -> str | None:
    """A route's API base as rigup wrote it (http://host:port/v1): LiteLLM labels some series with the
    endpoint it called (.../v1/chat/completions) instead."""
    if api_base is None or "/v1/" not in api_base:
        return api_base
    return api_base.split("/v1/", 1)[0] + "/v1"


def merged_routes(rows: Sequence[RouteRow]) -> list[RouteRow]:
    """One row per gateway, model and API base. LiteLLM keeps a series of a route's state per label set
    it saw (with and without model_id, per endpoint path): the merged row names the route, shows the
    worst state and sums the answers."""
    order = {name: i for i, name in enumerate(ROUTE_STATES.values())}
    merged: dict[tuple[str, str | None, str | None], RouteRow] = {}
    for row in rows:
        key = (row.gateway, row.model, route_base(row.api_base))
        known = merged.get(key)
        if known is None or not row.answered or row.model is None:
            merged[key] = RouteRow(row.gateway, row.model, row.route, key[2], row.state, row.answered,
                                   row.success_rps, row.failure_rps)
            continue
        known.route = known.route or row.route
        if order.get(row.state, len(order)) > order.get(known.state, len(order)):
            known.state = row.state
        for attr in ("success_rps", "failure_rps"):
            values = [v for v in (getattr(known, attr), getattr(row, attr)) if v is not None]
            setattr(known, attr, sum(values) if values else None)
    return list(merged.values())


def route_rows(now: Scrape, before: Scrape | None) -> list[RouteRow]:
    endpoint = now.endpoint
    if now.metrics is None:
        return [RouteRow(endpoint.host, None, None, None, now.error or "down", answered=False)]
    metrics = now.metrics
    states = metrics.samples(ROUTE_STATE)
    if not states:
        return [RouteRow(endpoint.host, None, None, None, NO_ROUTES)]
    rows = []
    for sample in states:
        model_id = sample.label("model_id")
        row = RouteRow(endpoint.host, route_model(sample.label("litellm_model_name")), model_id,
                       sample.label("api_base"), route_state(sample.value))
        if before is not None and before.metrics is not None and model_id is not None:
            seconds = now.at - before.at
            row.success_rps, row.failure_rps = answer_rates(
                _rate(before.metrics, metrics, ROUTE_SUCCESS, seconds, model_id=model_id),
                _rate(before.metrics, metrics, ROUTE_FAILURE, seconds, model_id=model_id))
        rows.append(row)
    return merged_routes(rows)


class DirectSource(Source):
    """Scrapes the endpoints every frame; rates and quantiles from the difference to the last frame."""

    def __init__(self, endpoints: Sequence[Endpoint], timeout: float) -> None:
        self.endpoints = list(endpoints)
        self.timeout = timeout
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
                frame.routes.extend(route_rows(now, before))
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


def prometheus_queries(rate_window: str = "1m", ttft_window: str = "5m") -> dict[str, str]:
    """What a frame asks Prometheus: the fleet's jobs (rigup.desired.monitoring) and their labels."""
    by_pod = "host, pod"
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
        "success_rps": f"sum by (host, model_id) (rate({ROUTE_SUCCESS}{{{gateways}}}[{rate_window}]))",
        "failure_rps": f"sum by (host, model_id) (rate({ROUTE_FAILURE}{{{gateways}}}[{rate_window}]))",
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
    def __init__(self, url: str, timeout: float, *, scrape_interval_s: int = 15, keep: Keep | None = None) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        # rate() needs two samples in its window: four scrape intervals, at least Grafana's usual 1m / 5m
        self.queries = prometheus_queries(duration(max(60, 4 * scrape_interval_s)), duration(max(300, 4 * scrape_interval_s)))
        self.keep: Keep = keep or (lambda host, pod: True)
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
        rows: list[RouteRow] = []
        success = {(lab.get("host"), lab.get("model_id")): v for lab, v in results["success_rps"]}
        failure = {(lab.get("host"), lab.get("model_id")): v for lab, v in results["failure_rps"]}
        with_routes: set[str] = set()
        for labels, value in results["route_state"]:
            host = labels.get("host", "?")
            if not self.keep(host, None):
                continue
            with_routes.add(host)
            key = (host, labels.get("model_id"))
            row = RouteRow(host, route_model(labels.get("litellm_model_name")), labels.get("model_id"),
                           labels.get("api_base"), route_state(value))
            row.success_rps, row.failure_rps = answer_rates(_finite(success.get(key)), _finite(failure.get(key)))
            rows.append(row)
        for labels, value in results["gateway_up"]:
            host = labels.get("host", labels.get("instance", "?"))
            if not self.keep(host, None) or host in with_routes:
                continue
            if value == 1:
                rows.append(RouteRow(host, None, None, None, NO_ROUTES))
            else:
                rows.append(RouteRow(host, None, None, None, "down (Prometheus: up 0)", answered=False))
        return sorted(merged_routes(rows), key=lambda r: (r.gateway, r.model or "", r.route or ""))


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


def memory_text(used: float | None, free: float | None) -> str:
    if used is None:
        return "-"
    if free is None:
        return f"{used / 1024:.1f} GiB"
    return f"{used / 1024:.1f}/{(used + free) / 1024:.1f} GiB"


def _state_style(state: str, answered: bool) -> str:
    if not answered or state.startswith("complete"):
        return "bold red"
    if state in (UP, "healthy"):
        return "green"
    return "yellow"


def render(frame: Frame, interval: float, live: bool) -> Any:
    """The frame as rich renderables: a header line and the pods', GPUs' and routes' tables."""
    from rich import box  # deferred with rich.console: see tests/test_layout.py DEFERRED_IMPORTS
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(frame.taken_at))
    header = Text.assemble(("rigup top", "bold"), f"  {frame.source}  {when}")
    if live:
        header.append(f"  every {interval:g} s, Ctrl-C quits", style="dim")
    parts: list[Any] = [header]
    if frame.first_scrape:
        parts.append(Text("rates and TTFT need a second scrape: \"-\" until the next frame", style="dim"))
    for note in frame.notes:
        parts.append(Text(note, style="yellow"))

    def table(title: str, columns: Sequence[tuple[str, str]]) -> Table:
        t = Table(title=title, title_justify="left", title_style="bold", box=box.SIMPLE_HEAD, pad_edge=False)
        for name, justify in columns:
            # a long reason or URL is cut short rather than squeezing the numbers out of the row
            wide = name in ("STATE", "API BASE", "ROUTE", "MODEL")
            t.add_column(name, justify=justify, no_wrap=True, overflow="ellipsis",  # type: ignore[arg-type]
                         max_width=WIDE_COLUMN if wide else None)
        return t

    pods = table("Pods", [("HOST", "left"), ("POD", "left"), ("MODEL", "left"), ("STATE", "left"), ("RUN", "right"),
                          ("WAIT", "right"), ("GEN TOK/S", "right"), ("PROMPT TOK/S", "right"), ("TTFT P50", "right"),
                          ("TTFT P95", "right"), ("KV CACHE", "right")])
    for p in frame.pods:
        pods.add_row(p.host, p.pod, p.model or "-", Text(p.state, style=_state_style(p.state, p.answered)),
                     _num(p.running, ".0f"), _num(p.waiting, ".0f"), _num(p.generation_tps, ".1f"),
                     _num(p.prompt_tps, ".1f"), seconds_text(p.ttft_p50_s), seconds_text(p.ttft_p95_s),
                     _num(None if p.kv_usage is None else p.kv_usage * 100, ".1f", "%"))
    gpus = table("GPUs", [("HOST", "left"), ("GPU", "right"), ("NAME", "left"), ("STATE", "left"), ("UTIL", "right"),
                          ("MEMORY", "right"), ("TEMP", "right"), ("POWER", "right")])
    for g in frame.gpus:
        gpus.add_row(g.host, g.gpu or "-", g.name or "-", Text(g.state, style=_state_style(g.state, g.answered)),
                     _num(g.util_pct, ".0f", "%"), memory_text(g.mem_used_mib, g.mem_free_mib),
                     _num(g.temp_c, ".0f", " C"), _num(g.power_w, ".0f", " W"))
    routes = table("Gateway routes", [("GATEWAY", "left"), ("MODEL", "left"), ("ROUTE", "left"), ("API BASE", "left"),
                                      ("STATE", "left"), ("OK/S", "right"), ("FAIL/S", "right")])
    for r in frame.routes:
        routes.add_row(r.gateway, r.model or "-", r.route or "-", r.api_base or "-",
                       Text(r.state, style=_state_style(r.state, r.answered)),
                       _num(r.success_rps, ".2f"), _num(r.failure_rps, ".2f"))
    for t, what in ((pods, "pods"), (gpus, "GPU exporters"), (routes, "gateways")):
        if not t.row_count:
            t.caption, t.caption_justify = f"no {what} in the selection", "left"
        parts.append(t)
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

    def direct() -> DirectSource:
        return DirectSource(direct_endpoints(fleet_targets(args.limit, fleet=fleet)), timeout)

    if args.prometheus:
        return PrometheusSource(args.prometheus, timeout, keep=selection_filter(fleet, args.limit))
    monitor = None if args.direct else fleet_monitor(fleet)
    if monitor is None:
        return direct()
    if monitor.url is None:
        source = direct()
        source.description += f" ({monitor.problem})"
        return source
    keep = selection_filter(fleet, args.limit)
    primary = PrometheusSource(monitor.url, timeout, scrape_interval_s=monitor.scrape_interval_s, keep=keep)
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
        make_console().print(render(frame, args.interval, live=False))
    return EXIT_UNANSWERED if frame.unanswered else 0


def make_console() -> Any:
    """The terminal; a file or pipe gets lines of at least BATCH_WIDTH (rich would assume 80)."""
    from rich.console import Console  # deferred: see render()

    console = Console()
    return console if console.is_terminal else Console(width=max(console.width, BATCH_WIDTH))


def watch(source: Source, interval: float) -> int:
    """Redraw until Ctrl-C; on a terminal in its alternate screen (as top does), else frame after frame."""
    from rich.live import Live  # deferred: see render()
    from rich.text import Text

    console = make_console()
    try:
        if not console.is_terminal:
            while True:
                started = time.monotonic()
                console.print(render(source.frame(), interval, live=True))
                time.sleep(max(0.0, interval - (time.monotonic() - started)))
        with Live(Text(f"rigup top: reading {source.description} ..."), console=console, screen=True,
                  auto_refresh=False) as live:
            while True:
                started = time.monotonic()
                live.update(render(source.frame(), interval, live=True), refresh=True)
                time.sleep(max(0.0, interval - (time.monotonic() - started)))
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
