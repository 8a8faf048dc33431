"""Fake exporters for `rigup top`'s tests: vLLM's, NVIDIA dcgm-exporter's and LiteLLM's /metrics as
they print them, with counters that move with the clock, on HTTP servers on 127.0.0.1.

The shapes: vLLM V1 (vllm/v1/metrics/loggers.py) and LiteLLM 1.108 (litellm/integrations/prometheus.py,
its label lists in litellm/types/integrations/prometheus.py) write through prometheus_client, which
names a counter's series x_total, adds an x_created gauge per series and prints floats as Go does;
dcgm-exporter 4.x writes one gauge per DCGM field with labels gpu, UUID, pci_bus_id, device, modelName,
Hostname and DCGM_FI_DRIVER_VERSION."""

from __future__ import annotations

import base64
import http.server
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tests.support.tls import ServerCert, serve_tls

# vLLM's buckets for vllm:time_to_first_token_seconds
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)


def go_float(value: float) -> str:
    """A value as prometheus_client prints it (its floatToGoString)."""
    value = float(value)
    if value == float("inf"):
        return "+Inf"
    if value == float("-inf"):
        return "-Inf"
    if value != value:
        return "NaN"
    text = repr(value)
    dot = text.find(".")
    if value > 0 and dot > 6:
        mantissa = f"{text[0]}.{text[1:dot]}{text[dot + 1:]}".rstrip("0.")
        return f"{mantissa}e+0{dot - 1}"
    return text


def labels_text(labels: dict[str, str], sort: bool = True) -> str:
    """{name="value",...} with the text format's escapes; sorted by name as prometheus_client prints them."""
    pairs = sorted(labels.items()) if sort else labels.items()
    escaped = {k: v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"') for k, v in pairs}
    return "{" + ",".join(f'{k}="{v}"' for k, v in escaped.items()) + "}" if labels else ""


class Writer:
    """prometheus_client's text output, family by family."""

    def __init__(self, created: float) -> None:
        self.lines: list[str] = []
        self.created = created

    def gauge(self, name: str, help_text: str, series: Sequence[tuple[dict[str, str], float]]) -> None:
        self.lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge"]
        self.lines += [f"{name}{labels_text(labels)} {go_float(value)}" for labels, value in series]

    def counter(self, name: str, help_text: str, series: Sequence[tuple[dict[str, str], float]]) -> None:
        self.lines += [f"# HELP {name}_total {help_text}", f"# TYPE {name}_total counter"]
        self.lines += [f"{name}_total{labels_text(labels)} {go_float(value)}" for labels, value in series]
        self.lines += [f"# HELP {name}_created {help_text}", f"# TYPE {name}_created gauge"]
        self.lines += [f"{name}_created{labels_text(labels)} {go_float(self.created)}" for labels, _ in series]

    def histogram(self, name: str, help_text: str, labels: dict[str, str], bounds: Sequence[float],
                  observations: Sequence[float]) -> None:
        self.lines += [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        for bound in [*bounds, float("inf")]:
            count = sum(1 for o in observations if o <= bound)
            self.lines.append(f"{name}_bucket{labels_text({**labels, 'le': go_float(bound)})} {go_float(count)}")
        self.lines.append(f"{name}_count{labels_text(labels)} {go_float(len(observations))}")
        self.lines.append(f"{name}_sum{labels_text(labels)} {go_float(sum(observations))}")
        self.lines += [f"# HELP {name}_created {help_text}", f"# TYPE {name}_created gauge",
                       f"{name}_created{labels_text(labels)} {go_float(self.created)}"]

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


@dataclass
class VllmPod:
    """A vLLM V1 server's /metrics: fixed gauges, token counters growing at the given rates, and
    `ttft_per_s` first tokens a second, each taking `ttft_s` (a cycle of values)."""

    model: str
    running: int = 3
    waiting: int = 1
    kv_usage: float = 0.42
    generation_tps: float = 850.0
    prompt_tps: float = 2400.0
    ttft_per_s: float = 4.0
    ttft_s: tuple[float, ...] = (0.07, 0.09, 0.12, 0.3)
    started: float = field(default_factory=time.time)

    def text(self, now: float | None = None) -> str:
        elapsed = (now if now is not None else time.time()) - self.started
        labels = {"engine": "0", "model_name": self.model}
        out = Writer(self.started)
        out.gauge("vllm:num_requests_running", "Number of requests in model execution batches.", [(labels, self.running)])
        out.gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", [(labels, self.waiting)])
        out.gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", [(labels, self.kv_usage)])
        out.counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                    [(labels, float(int(self.prompt_tps * elapsed)))])
        out.counter("vllm:generation_tokens", "Number of generation tokens processed.",
                    [(labels, float(int(self.generation_tps * elapsed)))])
        count = int(self.ttft_per_s * elapsed)
        observations = [self.ttft_s[i % len(self.ttft_s)] for i in range(count)]
        out.histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", labels,
                      TTFT_BUCKETS, observations)
        return out.text()


@dataclass
class Gpu:
    index: int
    name: str = "NVIDIA GeForce RTX 3090"
    util: int = 97
    used_mib: int = 22850
    free_mib: int = 1264
    temp_c: int = 66
    power_w: float = 301.456


def dcgm_text(hostname: str, gpus: Sequence[Gpu], driver: str = "580.95.05") -> str:
    """dcgm-exporter 4.x's /metrics for these GPUs (a subset of etc/default-counters.csv)."""
    fields = [
        ("DCGM_FI_DEV_SM_CLOCK", "SM clock frequency (in MHz).", "gauge", lambda g: 1755),
        ("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C).", "gauge", lambda g: int(g.temp_c)),
        ("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).", "gauge", lambda g: g.power_w),
        ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "Total energy consumption since boot (in mJ).", "counter",
         lambda g: 91234567 + g.index),
        ("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", "gauge", lambda g: int(g.util)),
        ("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB).", "gauge", lambda g: int(g.free_mib)),
        ("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).", "gauge", lambda g: int(g.used_mib)),
        ("DCGM_FI_DEV_XID_ERRORS", "Value of the last XID error encountered.", "gauge", lambda g: 0),
    ]
    lines = []
    for name, help_text, kind, value in fields:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        for gpu in gpus:
            labels = {"gpu": str(gpu.index), "UUID": f"GPU-5b3e2f4c-8d1a-4e7f-9c2b-00000000000{gpu.index}",
                      "pci_bus_id": f"00000000:{gpu.index + 1:02X}:00.0", "device": f"nvidia{gpu.index}",
                      "modelName": gpu.name, "Hostname": hostname, "DCGM_FI_DRIVER_VERSION": driver}
            number = value(gpu)
            series = f"{name}{labels_text(labels, sort=False)}"  # in dcgm-exporter's own order
            lines.append(f"{series} {number:f}" if isinstance(number, float) else f"{series} {number}")
    return "\n".join(lines) + "\n"


@dataclass
class Route:
    model: str  # the served model name
    model_id: str  # rigup's <host>/<unit>
    api_base: str
    state: int = 0  # 0 healthy, 1 partial outage, 2 complete outage
    success_per_s: float = 2.0
    failure_per_s: float = 0.0


def litellm_text(routes: Sequence[Route], started: float, now: float | None = None) -> str:
    """LiteLLM 1.108's proxy /metrics/ for these deployments (its deployment metrics and their labels)."""
    elapsed = (now if now is not None else time.time()) - started
    out = Writer(started)
    caller = {"hashed_api_key": "88dc28d0f030c55ed4ab77ed8faf098196cb1c05df778539800c9f1243fe6b4b",
              "api_key_alias": "None", "team": "None", "team_alias": "None", "client_ip": "127.0.0.1",
              "user_agent": "OpenAI/Python 2.8.1"}

    def deployment(route: Route) -> dict[str, str]:
        return {"litellm_model_name": f"hosted_vllm/{route.model}", "model_id": route.model_id,
                "api_base": route.api_base, "api_provider": "hosted_vllm"}

    out.gauge("litellm_deployment_state",
              "LLM Deployment Analytics - The state of the deployment: 0 = healthy, 1 = partial outage, 2 = complete outage",
              [(deployment(r), float(r.state)) for r in routes])

    def requests(route: Route) -> dict[str, str]:
        d = deployment(route)
        return {"model_group": route.model, "requested_model": route.model, "litellm_model_name": d["litellm_model_name"],
                "model_id": route.model_id, "api_base": route.api_base, "api_provider": "hosted_vllm", **caller}

    out.counter("litellm_deployment_success_responses",
                "LLM Deployment Analytics - Total number of successful LLM API calls via litellm",
                [(requests(r), float(int(r.success_per_s * elapsed))) for r in routes if r.success_per_s])
    failures = [r for r in routes if r.failure_per_s]
    if failures:
        out.counter("litellm_deployment_failure_responses",
                    "LLM Deployment Analytics - Total number of failed LLM API calls for a specific LLM deploymeny. "
                    "exception_status is the status of the exception from the llm api",
                    [({**requests(r), "exception_status": "500", "exception_class": "Openai.InternalServerError"},
                      float(int(r.failure_per_s * elapsed))) for r in failures])
    return out.text()


class MetricsServer:
    """An HTTP server on 127.0.0.1 answering GET `path` with `text()` (401 without `key` when one is set, or
    without basic auth `login`, as exporter-toolkit's web config asks); over TLS with `tls`'s certificate
    (tests.support.tls) when one is given."""

    def __init__(self, text: Callable[[], str], path: str = "/metrics", key: str | None = None,
                 tls: ServerCert | None = None, login: tuple[str, str] | None = None) -> None:
        basic = "Basic " + base64.b64encode(f"{login[0]}:{login[1]}".encode()).decode() if login else None
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802
                outer.requests += 1
                if self.path != path:
                    self._reply(404, "404 page not found\n")
                elif key and self.headers.get("Authorization") != f"Bearer {key}":
                    self._reply(401, '{"error": {"message": "Authentication Error, No api key passed in."}}')
                elif basic and self.headers.get("Authorization") != basic:
                    self._reply(401, "Unauthorized\n")
                else:
                    self._reply(200, text())

            def _reply(self, status: int, body: str) -> None:
                data = body.encode()
                self.send_response(status)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.requests = 0
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        if tls is not None:
            serve_tls(self.server, tls)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
