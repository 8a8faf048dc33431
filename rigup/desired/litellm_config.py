"""LiteLLM's proxy config as rigup wrote it before issue 44 put nginx and vllm-router in the entrance: kept only so
bench/entrance.py measures LiteLLM exactly as rigup configured it (bench/results.md, section Entrance). No
converge installs LiteLLM any more (docs/gateway.md says why: 0.29x direct at 32 streams, paced)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import yaml

from rigup.desired.gateway import Route

MASTER_KEY_ENV = "LITELLM_MASTER_KEY"
CONFIG_HEADER = "# Rendered by rigup from what each rig serves (provenance + running unit). Do not edit.\n"
# LiteLLM's provider for an OpenAI-compatible vLLM server (no model-cost lookups, no key format checks).
PROVIDER = "hosted_vllm"


def config_document(routes: Iterable[Route], *, health_check_interval_s: int, num_retries: int) -> dict[str, Any]:
    """LiteLLM's proxy config: a deployment per route (rigup's fields in model_info identify it), the
    gateway key from the environment, background checks that route around a failing rig, retries."""
    model_list = [
        {
            "model_name": r.model,
            "litellm_params": {
                "model": f"{PROVIDER}/{r.model}",
                "api_base": r.api_base,
                # vLLM without --api-key accepts any bearer; the key itself stays in the environment file
                "api_key": f"os.environ/{r.key_env}" if r.key_env else "EMPTY",
            },
            "model_info": {"id": r.route_id, "rigup_host": r.host, "rigup_unit": r.unit, "rigup_variant": r.variant},
        }
        for r in sorted(routes, key=lambda r: (r.model, r.host, r.unit))
    ]
    return {
        "model_list": model_list,
        "router_settings": {
            "routing_strategy": "simple-shuffle",
            "num_retries": num_retries,
            # a route that fails once is cooled down at once, so the retry goes to another rig of the model
            # (LiteLLM never cools down the only deployment of a model)
            "allowed_fails": 0,
            # longer than the check interval, so a route the checks found failing stays out until re-checked
            "cooldown_time": 2 * health_check_interval_s,
        },
        "general_settings": {
            "master_key": f"os.environ/{MASTER_KEY_ENV}",
            "background_health_checks": True,
            "health_check_interval": health_check_interval_s,
            "enable_health_check_routing": True,
            "health_check_staleness_threshold": 3 * health_check_interval_s,
        },
        # prometheus: /metrics (behind the master key) for the fleet's Prometheus: each route's state,
        # failures, cooldowns and latency
        "litellm_settings": {"telemetry": False, "drop_params": True, "callbacks": ["prometheus"]},
    }


def config_text(routes: Iterable[Route], *, health_check_interval_s: int, num_retries: int) -> str:
    document = config_document(routes, health_check_interval_s=health_check_interval_s, num_retries=num_retries)
    return CONFIG_HEADER + yaml.safe_dump(document, sort_keys=False, default_flow_style=False)
