"""`rigup router`: a LiteLLM proxy config with one OpenAI endpoint over the healthy rigs.

    rigup router [--limit HOST|GROUP ...] [--out litellm.yaml] [--include-unhealthy]
    litellm --config litellm.yaml        # then every client talks to the proxy

Each rig of the fleet whose /v1/models lists its variant's served model becomes one deployment of
that model name; rigs serving the same name share it, and LiteLLM's router spreads requests over them
and retries another rig when one fails. Every pod is keyed (rigup.desired.pod_keys), and the key itself is never
written: a rig with serving_api_key_file gets `api_key: os.environ/<VAR>` (its key, exported where the proxy runs),
a pod with its own key `os.environ/<VAR>_<POD>` (<POD> its target name in capitals, e.g. RIGUP_API_KEY_RIG_01 or
RIGUP_API_KEY_QUAD_LEFT: export each pod's fleet-ca/pod-keys/<host>/<pod>.key there).
"""

from __future__ import annotations

import argparse
import datetime
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from rigup.cli.runner import parallel
from rigup.client.openai_client import ApiClient
from rigup.client.ssh import RemoteError
from rigup.client.targets import Target, fleet_targets
from rigup.desired.knobs import knob
from rigup.desired.roles import serves_variant

API_KEY_ENV = "RIGUP_API_KEY"


@dataclass(frozen=True)
class RigHealth:
    target: Target
    healthy: bool
    reason: str  # "serves <model>" or why not


def check(target: Target, timeout: float = 5.0) -> RigHealth:
    if target.error or target.api_url is None or target.served_model is None:
        return RigHealth(target, False, target.error or "no recipe")
    client = ApiClient(target.api_url, target.api_key)
    try:
        result = client.models(timeout=timeout)
    finally:
        client.close()
    if not result.ok:
        return RigHealth(target, False, f"GET /v1/models: {result.describe_failure()}")
    if target.served_model not in result.models:
        return RigHealth(target, False, f"/v1/models lists {sorted(result.models)}, not {target.served_model}")
    return RigHealth(target, True, f"serves {target.served_model}")


def key_env(target: Target, api_key_env: str = API_KEY_ENV) -> str:
    """The variable the proxy reads a deployment's key from: `api_key_env` for a rig's serving_api_key_file key
    (one for all such rigs), `<api_key_env>_<TARGET>` for a pod's own key."""
    if knob(target.data, "serving_api_key_file") is not None:
        return api_key_env
    return f"{api_key_env}_{re.sub(r'[^A-Za-z0-9]+', '_', target.name).upper()}"


def build_config(rigs: Sequence[RigHealth], include_unhealthy: bool = False, api_key_env: str = API_KEY_ENV) -> dict[str, Any]:
    """The LiteLLM config document (model_list + router_settings)."""
    model_list: list[dict[str, Any]] = []
    for rig in rigs:
        if not rig.healthy and not include_unhealthy:
            continue
        target = rig.target
        assert target.api_url is not None and target.served_model is not None
        model_list.append(
            {
                "model_name": target.served_model,
                "litellm_params": {
                    "model": f"openai/{target.served_model}",
                    "api_base": f"{target.api_url}/v1",
                    "api_key": f"os.environ/{key_env(target, api_key_env)}",
                },
                "model_info": {"id": target.name, "rigup_variant": target.variant},
            }
        )
    return {
        "model_list": model_list,
        "router_settings": {"routing_strategy": "least-busy", "num_retries": 2, "allowed_fails": 1, "cooldown_time": 60},
    }


def _cmd_router(args: argparse.Namespace) -> int:
    try:
        targets = fleet_targets(args.limit)
    except RemoteError as exc:
        print(f"rigup router: {exc}", file=sys.stderr)
        return 2
    targets = [t for t in targets if serves_variant(t.data)]  # a gateway-only host serves nothing
    rigs = parallel(targets, check)
    for rig in rigs:
        mark = "ok  " if rig.healthy else "SKIP" if not args.include_unhealthy else "bad "
        print(f"{mark} {rig.target.name}: {rig.reason}", file=sys.stderr)
    config = build_config(rigs, args.include_unhealthy, args.api_key_env)
    deployed = [r.target for r in rigs if r.healthy or args.include_unhealthy]
    if not config["model_list"]:
        print("rigup router: no healthy rig; nothing to route to", file=sys.stderr)
        return 1
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    text = (
        f"# LiteLLM proxy config written by `rigup router` at {stamp}.\n"
        f"# Run: litellm --config {args.out or 'litellm.yaml'}"
        + f"  (with {', '.join(sorted({key_env(d, args.api_key_env) for d in deployed}))} exported: each pod's API key)"
        + "\n"
        + yaml.safe_dump(config, sort_keys=False, default_flow_style=False)
    )
    if args.out:
        Path(args.out).write_text(text)
        print(f"rigup router: {len(config['model_list'])} deployment(s) written to {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0 if all(r.healthy for r in rigs) else 1


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `router [--limit X ...] [--out FILE] [--include-unhealthy] [--api-key-env VAR]`."""
    parser = subparsers.add_parser(
        "router",
        help="write a LiteLLM config: one OpenAI endpoint over every healthy rig serving the same model",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("--limit", action="append", default=[], help="host or group (repeatable)")
    parser.add_argument("--out", help="write the config here (default: stdout)")
    parser.add_argument("--include-unhealthy", action="store_true", help="list rigs that fail the check too")
    parser.add_argument("--api-key-env", default=API_KEY_ENV, help=f"environment variable the proxy reads the rigs' key from (default {API_KEY_ENV})")
    parser.set_defaults(func=_cmd_router)
    return parser
