"""Grafana on the monitor host: a provisioned Prometheus datasource and rigup's fleet overview, as files.

The overview's panels are PromQL over what the fleet's Prometheus scrapes (rigup.desired.monitoring's
jobs and labels): per pod throughput, latency, queue and KV cache; per GPU utilisation, memory,
temperature and power; the nodes' model disks; the gateway's routes; rollouts (releases, gates,
rollbacks). Every query is run against the test bed's real Prometheus by tests/e2e/test_monitoring.py,
and each must return data there.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import yaml

from rigup.desired.monitoring import JOB_GPU, JOB_NODE, JOB_PODS

GRAFANA_PACKAGE = "grafana"
GRAFANA_UNIT = "grafana-server.service"
DATASOURCE_FILE = "/etc/grafana/provisioning/datasources/rigup.yaml"
DASHBOARDS_PROVIDER_FILE = "/etc/grafana/provisioning/dashboards/rigup.yaml"
DASHBOARDS_DIR = "/var/lib/grafana/dashboards/rigup"
OVERVIEW_FILE = f"{DASHBOARDS_DIR}/rigup-fleet.json"
GRAFANA_PORT_DROPIN = "/etc/systemd/system/grafana-server.service.d/rigup-port.conf"
DATASOURCE_UID = "rigup-prometheus"


@dataclass(frozen=True)
class Panel:
    title: str
    expr: str
    legend: str
    unit: str = "short"


POD = "{{host}}/{{pod}}"
GPU = "{{host}} GPU {{gpu}}"

ROWS: tuple[tuple[str, tuple[Panel, ...]], ...] = (
    ("Pods", (
        Panel("Pods up", f'up{{job="{JOB_PODS}"}}', POD),
        Panel("Generated tokens/s", f"sum by (host, pod) (rate(vllm:generation_tokens_total[1m]))", POD),
        Panel("Prompt tokens/s", "sum by (host, pod) (rate(vllm:prompt_tokens_total[1m]))", POD),
        Panel("Requests running", "sum by (host, pod) (vllm:num_requests_running)", POD),
        Panel("Requests waiting", "sum by (host, pod) (vllm:num_requests_waiting)", POD),
        Panel("KV cache used", "max by (host, pod) (vllm:kv_cache_usage_perc)", POD, "percentunit"),
        Panel("Time to first token p50",
              "histogram_quantile(0.5, sum by (le, host, pod) (rate(vllm:time_to_first_token_seconds_bucket[5m])))", POD, "s"),
        Panel("Time to first token p95",
              "histogram_quantile(0.95, sum by (le, host, pod) (rate(vllm:time_to_first_token_seconds_bucket[5m])))", POD, "s"),
        Panel("Inter-token latency p95",
              "histogram_quantile(0.95, sum by (le, host, pod) (rate(vllm:inter_token_latency_seconds_bucket[5m])))", POD, "s"),
        Panel("Request latency p95",
              "histogram_quantile(0.95, sum by (le, host, pod) (rate(vllm:e2e_request_latency_seconds_bucket[5m])))", POD, "s"),
        Panel("Prefix cache hit rate",
              "sum by (host, pod) (rate(vllm:prefix_cache_hits_total[5m])) / "
              "sum by (host, pod) (rate(vllm:prefix_cache_queries_total[5m]))", POD, "percentunit"),
        Panel("Requests finished/s", "sum by (host, pod, finished_reason) (rate(vllm:request_success_total[5m]))",
              POD + " {{finished_reason}}"),
    )),
    ("GPUs", (
        Panel("GPU utilisation", "DCGM_FI_DEV_GPU_UTIL", GPU, "percent"),
        Panel("GPU memory used", "DCGM_FI_DEV_FB_USED * 1024 * 1024", GPU, "bytes"),
        Panel("GPU temperature", "DCGM_FI_DEV_GPU_TEMP", GPU, "celsius"),
        Panel("GPU power draw", "DCGM_FI_DEV_POWER_USAGE", GPU, "watt"),
        Panel("GPU power limit", "DCGM_FI_DEV_POWER_MGMT_LIMIT", GPU, "watt"),
        Panel("GPU last XID", "DCGM_FI_DEV_XID_ERRORS", GPU),
        Panel("GPU exporters up", f'up{{job="{JOB_GPU}"}}', "{{host}}"),
    )),
    ("Rigs", (
        Panel("CPU busy", f'1 - avg by (host) (rate(node_cpu_seconds_total{{job="{JOB_NODE}", mode="idle"}}[5m]))', "{{host}}",
              "percentunit"),
        Panel("Memory available", f'node_memory_MemAvailable_bytes{{job="{JOB_NODE}"}}', "{{host}}", "bytes"),
        Panel("Model disk free",
              "node_filesystem_avail_bytes * on (instance, mountpoint) group_left () rigup_model_filesystem",
              "{{host}} {{mountpoint}}", "bytes"),
        Panel("rigup units active", 'node_systemd_unit_state{name=~"rigup-.+", state="active"}', "{{host}} {{name}}"),
    )),
    ("Gateway and rollouts", (
        Panel("Gateway up", 'up{job=~"gateway-.+"}', "{{host}}"),
        Panel("Gateway routes (0 healthy, 1 partial, 2 down)", "litellm_deployment_state",
              "{{host}} {{litellm_model_name}} {{api_base}}"),
        Panel("Releases served", "rigup_release_info", "{{host}}/{{pod}} {{variant}} {{release}}"),
        Panel("Generation", "rigup_generation", POD),
        Panel("Last gate passed", "rigup_gate_last_passed", POD),
        Panel("Rollbacks", "rigup_rollbacks_total", POD),
    )),
)


def panels() -> list[Panel]:
    return [panel for _, row in ROWS for panel in row]


def overview_dashboard() -> dict[str, Any]:
    """rigup's fleet overview in Grafana's dashboard JSON (schema 39): a row per area, timeseries panels."""
    out: list[dict[str, Any]] = []
    ident, y = 1, 0
    for title, row in ROWS:
        out.append({"type": "row", "title": title, "id": ident, "collapsed": False, "panels": [],
                    "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}})
        ident, y = ident + 1, y + 1
        for i, panel in enumerate(row):
            out.append({
                "type": "timeseries", "title": panel.title, "id": ident,
                "datasource": {"type": "prometheus", "uid": DATASOURCE_UID},
                "gridPos": {"h": 8, "w": 8, "x": 8 * (i % 3), "y": y + 8 * (i // 3)},
                "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
                "targets": [{"refId": "A", "expr": panel.expr, "legendFormat": panel.legend,
                             "datasource": {"type": "prometheus", "uid": DATASOURCE_UID}}],
            })
            ident += 1
        y += 8 * ((len(row) + 2) // 3)
    return {"uid": "rigup-fleet", "title": "rigup fleet", "tags": ["rigup", "vllm"], "timezone": "browser",
            "schemaVersion": 39, "version": 1, "refresh": "10s", "time": {"from": "now-1h", "to": "now"},
            "panels": out}


def overview_text() -> str:
    return json.dumps(overview_dashboard(), indent=2, sort_keys=True) + "\n"


def datasource_text(prometheus_url: str) -> str:
    document = {"apiVersion": 1, "datasources": [{
        "name": "rigup Prometheus", "uid": DATASOURCE_UID, "type": "prometheus", "access": "proxy",
        "url": prometheus_url, "isDefault": True, "editable": False}]}
    return "# Written by rigup (tasks/monitoring.py).\n" + yaml.safe_dump(document, sort_keys=False)


def dashboards_provider_text() -> str:
    document = {"apiVersion": 1, "providers": [{
        "name": "rigup", "folder": "rigup", "type": "file", "disableDeletion": True, "allowUiUpdates": False,
        "options": {"path": DASHBOARDS_DIR}}]}
    return "# Written by rigup (tasks/monitoring.py).\n" + yaml.safe_dump(document, sort_keys=False)


def port_dropin_text(port: int) -> str:
    return f"# Written by rigup (tasks/monitoring.py): grafana_port.\n[Service]\nEnvironment=GF_SERVER_HTTP_PORT={port}\n"
