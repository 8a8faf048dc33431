"""A LiteLLM 1.108 proxy's /metrics/ for `rigup top`'s tests, with the label sets it really writes per
event (litellm/integrations/prometheus.py of the pinned litellm==1.108.7, files/gateway/requirements.txt):

- a success: set_llm_deployment_success_metrics sets litellm_deployment_state to 0 with model_id from the
  request metadata's model_info (empty on the proxy's path, as the sandbox's gateway showed) and the
  api_base of the payload, the endpoint it called (http://host:port/v1/chat/completions);
- a failure: set_llm_deployment_failure_metrics sets it to 1 (set_deployment_partial_outage) with the
  payload's model_id and api_base (http://host:port/v1), and a cooldown
  (router_utils/cooldown_callbacks.py) to 2 with the deployment's id and litellm.get_api_base (.../v1).

So a route that failed keeps its 1 or 2 beside the 0 of its successes, whatever came after. The counters
carry the same labels as the event's state (tests/support/exporters.py's Writer prints them as
prometheus_client does)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from tests.support.exporters import Writer

CALLER = {"hashed_api_key": "88dc28d0f030c55ed4ab77ed8faf098196cb1c05df778539800c9f1243fe6b4b",
          "api_key_alias": "None", "team": "None", "team_alias": "None", "client_ip": "127.0.0.1",
          "user_agent": "OpenAI/Python 2.8.1"}


@dataclass
class ServedRoute:
    """One route's answers: counts before the fake started (their series exist, not growing) and rates since."""

    model: str  # the served model name
    model_id: str  # rigup's <host>/<unit>
    api_base: str  # http://address:port/v1, as rigup writes it
    success_per_s: float = 0.0
    failure_per_s: float = 0.0
    earlier_successes: int = 0
    earlier_failures: int = 0
    failure_state: int = 2  # what its failures left: 1 a failure, 2 a cooldown

    def successes(self, elapsed: float) -> float:
        return float(self.earlier_successes + int(self.success_per_s * elapsed))

    def failures(self, elapsed: float) -> float:
        return float(self.earlier_failures + int(self.failure_per_s * elapsed))


def litellm_1108_text(routes: Sequence[ServedRoute], started: float, now: float | None = None) -> str:
    elapsed = (now if now is not None else time.time()) - started
    out = Writer(started)
    provider = {"api_provider": "hosted_vllm"}

    def on_success(route: ServedRoute) -> dict[str, str]:
        return {"litellm_model_name": f"hosted_vllm/{route.model}", "model_id": "",
                "api_base": f"{route.api_base}/chat/completions", **provider}

    def on_failure(route: ServedRoute) -> dict[str, str]:
        return {"litellm_model_name": f"hosted_vllm/{route.model}", "model_id": route.model_id,
                "api_base": route.api_base, **provider}

    def requests(labels: dict[str, str], route: ServedRoute) -> dict[str, str]:
        return {"model_group": route.model, "requested_model": route.model, **labels, **CALLER}

    succeeded = [r for r in routes if r.successes(elapsed)]
    failed = [r for r in routes if r.failures(elapsed)]
    out.gauge("litellm_deployment_state",
              "LLM Deployment Analytics - The state of the deployment: 0 = healthy, 1 = partial outage, 2 = complete outage",
              [(on_success(r), 0.0) for r in succeeded] + [(on_failure(r), float(r.failure_state)) for r in failed])
    if succeeded:
        out.counter("litellm_deployment_success_responses",
                    "LLM Deployment Analytics - Total number of successful LLM API calls via litellm",
                    [(requests(on_success(r), r), r.successes(elapsed)) for r in succeeded])
    if failed:
        out.counter("litellm_deployment_failure_responses",
                    "LLM Deployment Analytics - Total number of failed LLM API calls for a specific LLM deploymeny. "
                    "exception_status is the status of the exception from the llm api",
                    [({**requests(on_failure(r), r), "exception_status": "500",
                       "exception_class": "Openai.InternalServerError"}, r.failures(elapsed)) for r in failed])
    return out.text()
