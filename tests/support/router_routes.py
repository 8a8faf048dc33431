"""The fleet entrance's /metrics/ for `rigup top`'s tests: each model's vllm-router 0.1.17 exposition joined by the
front's njs (templates/rigup-entrance.js.j2: every sample gets its model as the first label), with the series and
labels the pinned wheel writes per worker (a pod's base URL, what --worker-urls took), as a router with two pods
showed them (one killed under traffic):

    vllm_router_worker_health{worker="http://127.0.0.1:37991"} 0                      (1 healthy, 0 unhealthy)
    vllm_router_cb_state{worker="http://127.0.0.1:37991"} 1                           (0 closed, 1 open, 2 half_open)
    vllm_router_cb_outcomes_total{worker="http://127.0.0.1:37991",outcome="failure"} 1
    vllm_router_processed_requests_total{worker="http://127.0.0.1:35813"} 8

A counter's series appears with its first count (the metrics crate writes no zero series)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class RouterRoute:
    """One worker of one model's router: its health and circuit now, its answers before the fake started and since."""

    model: str  # the served model name (the njs join's label)
    worker: str  # http://address:port, no /v1
    healthy: bool = True
    breaker: int = 0  # 0 closed, 1 open, 2 half_open
    success_per_s: float = 0.0
    failure_per_s: float = 0.0
    earlier_successes: int = 0
    earlier_failures: int = 0

    def successes(self, elapsed: float) -> int:
        return self.earlier_successes + int(self.success_per_s * elapsed)

    def failures(self, elapsed: float) -> int:
        return self.earlier_failures + int(self.failure_per_s * elapsed)


def entrance_text(routes: Sequence[RouterRoute], started: float, now: float | None = None) -> str:
    elapsed = (now if now is not None else time.time()) - started
    lines = ['# HELP vllm_router_requests_total Total number of requests by route and method',
             '# TYPE vllm_router_requests_total counter']
    for model in sorted({r.model for r in routes}):
        total = sum(r.successes(elapsed) + r.failures(elapsed) for r in routes if r.model == model)
        lines.append(f'vllm_router_requests_total{{model="{model}",route="/v1/chat/completions"}} {total}')

    def family(name: str, kind: str, help_text: str, samples: list[tuple[RouterRoute, str, float]]) -> None:
        if samples:
            lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"])
            lines.extend(f'{name}{{model="{r.model}",worker="{r.worker}"{extra}}} {value:g}' for r, extra, value in samples)

    family("vllm_router_cb_outcomes_total", "counter",
           "Total number of circuit breaker outcomes by worker and outcome type (success/failure)",
           [(r, f',outcome="{outcome}"', count) for r in routes
            for outcome, count in (("success", r.successes(elapsed)), ("failure", r.failures(elapsed))) if count])
    family("vllm_router_processed_requests_total", "counter", "Total requests processed by each worker",
           [(r, "", r.successes(elapsed) + r.failures(elapsed)) for r in routes if r.successes(elapsed) + r.failures(elapsed)])
    family("vllm_router_worker_health", "gauge", "Worker health status (1=healthy, 0=unhealthy)",
           [(r, "", 1.0 if r.healthy else 0.0) for r in routes])
    family("vllm_router_cb_state", "gauge", "Circuit breaker state per worker (0=closed, 1=open, 2=half_open)",
           [(r, "", float(r.breaker)) for r in routes])
    # the front's own per-client counters, joined as they are (rigup-entrance-usage)
    lines += ["# HELP rigup_gateway_client_requests_total Requests of each client to a model path of the entrance, by status code",
              "# TYPE rigup_gateway_client_requests_total counter"]
    return "\n".join(lines) + "\n"
