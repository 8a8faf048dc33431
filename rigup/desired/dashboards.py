"""Grafana on the monitor host: a provisioned Prometheus datasource and rigup's fleet overview, as files.

The overview's panels are PromQL over what the fleet's Prometheus scrapes (rigup.desired.monitoring's
jobs and labels): per pod throughput, latency, queue and KV cache; per GPU utilisation, memory,
temperature and power; the nodes' model disks; the gateway's routes; rollouts (releases, gates,
rollbacks); each entrance client's requests and tokens in and out. Every query is run against the test bed's real Prometheus by tests/e2e/test_monitoring.py,
and each must return data there.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from rigup.desired.catalog import load_catalog
from rigup.desired.metrics_auth import MetricsCredentials
from rigup.desired.monitoring import JOB_GPU, JOB_NODE, JOB_PODS, route_failing_expr
from rigup.desired.recipe import pods_of
from rigup.desired.roles import serves_variant
from rigup.desired.templating import render_template

GRAFANA_PACKAGE = "grafana"
GRAFANA_USER = "grafana"  # the user its deb runs it as: the datasource file (it holds a password) is its own
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
        # judged as RigupGatewayRouteUnhealthy judges it: the model's router's health of each pod
        Panel("Gateway routes failing (1: the router keeps the pod out of rotation, 0: in)", route_failing_expr(),
              "{{host}} {{api_base}}"),
        Panel("Releases served", "rigup_release_info", "{{host}}/{{pod}} {{variant}} {{release}}"),
        Panel("Generation", "rigup_generation", POD),
        Panel("Last gate passed", "rigup_gate_last_passed", POD),
        Panel("Asked for a release that failed its gate (RigupGateFailed)", "rigup_release_failed_gate", POD),
        Panel("Rollbacks", "rigup_rollbacks_total", POD),
    )),
    # each client's use of the entrance, as rigup-entrance-usage counts it from nginx's usage log (its name, never
    # its key; tokens from the responses' usage) and the entrance's /metrics/ serves it (docs/gateway.md)
    ("Entrance clients", (
        Panel("Requests/s per client", "sum by (client, code) (rate(rigup_gateway_client_requests_total[5m]))",
              "{{client}} {{code}}", "reqps"),
        Panel("Prompt tokens/s per client (in)",
              "sum by (client) (rate(rigup_gateway_client_prompt_tokens_total[5m]))", "{{client}}"),
        Panel("Completion tokens/s per client (out)",
              "sum by (client) (rate(rigup_gateway_client_completion_tokens_total[5m]))", "{{client}}"),
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


def datasource_text(prometheus_url: str, login: MetricsCredentials, ca_pem: str) -> str:
    """Grafana's datasource: the fleet's Prometheus, which asks for TLS and basic auth (rigup.desired.metrics_auth),
    read with `login` (its user and password: the file is written 0600 for Grafana's user) and trusting the fleet
    CA's certificate `ca_pem` (Grafana's datasource settings: basicAuth, basicAuthUser, jsonData.tlsAuthWithCACert,
    secureJsonData.basicAuthPassword and tlsCACert)."""
    document = {"apiVersion": 1, "datasources": [{
        "name": "rigup Prometheus", "uid": DATASOURCE_UID, "type": "prometheus", "access": "proxy",
        "url": prometheus_url, "isDefault": True, "editable": False,
        "basicAuth": True, "basicAuthUser": login.user, "jsonData": {"tlsAuthWithCACert": True},
        "secureJsonData": {"basicAuthPassword": login.password, "tlsCACert": ca_pem}}]}
    return "# Written by rigup (tasks/grafana.py).\n" + yaml.safe_dump(document, sort_keys=False)


def dashboards_provider_text(vllm_refs: Iterable[str] = ()) -> str:
    """rigup's folder, and a folder per vLLM version whose dashboards are provisioned."""
    providers = [{"name": "rigup", "folder": "rigup", "type": "file", "disableDeletion": True,
                  "allowUiUpdates": False, "options": {"path": DASHBOARDS_DIR}}]
    for ref in sorted(set(vllm_refs)):
        providers.append({"name": f"vllm-{ref_label(ref)}", "folder": f"vLLM {ref_label(ref)}", "type": "file",
                          "disableDeletion": True, "allowUiUpdates": False, "options": {"path": vllm_ref_dir(ref)}})
    document = {"apiVersion": 1, "providers": providers}
    return "# Written by rigup (tasks/grafana.py).\n" + yaml.safe_dump(document, sort_keys=False)


def port_dropin_text(port: int) -> str:
    return render_template("grafana-server-rigup-port.conf.j2", port=port)


# --- vLLM's official dashboards, at the vLLM version of each image the fleet serves ------------------------

VLLM_DASHBOARDS_DIR = "/var/lib/grafana/dashboards/vllm"
VLLM_SOURCE = "vllm"  # its lock entries: git:vllm@<ref>, one per vLLM version served
_RELEASE_TAG = re.compile(r"v[0-9]+\.[0-9]+\.[0-9]+([.-][A-Za-z0-9.]+)?")
_NIGHTLY_TAG = re.compile(r"nightly-([0-9a-f]{40})")
_UID = re.compile(r"[^A-Za-z0-9_-]")
UID_MAX = 40  # Grafana's limit on a dashboard uid
_DATASOURCE_INPUT = re.compile(r"\$\{(DS_[A-Za-z0-9_]+)\}")


class DashboardError(ValueError):
    """A vLLM dashboard file rigup cannot provision; the message names the version and the file."""


def image_vllm_ref(repository: str, tag: str) -> str | None:
    """The vLLM git ref an image runs, or None when its tag does not say.

    vllm/vllm-openai's release tags are vLLM's own release tags (v0.27.1); its nightly-<sha> tags are
    built from that vLLM commit (club-3090's CHANGELOG: nightly-07351e08… is vLLM dev205+g07351e088, see
    the catalog's provenance). Other images (vLLM-Omni, LMCache's build, a named build such as
    gemma4-unified) name no vLLM version: their pods get no vLLM dashboards, with a note."""
    if repository != "vllm/vllm-openai":
        return None
    if _RELEASE_TAG.fullmatch(tag):
        return tag
    nightly = _NIGHTLY_TAG.fullmatch(tag)
    return nightly.group(1) if nightly else None


def ref_label(ref: str) -> str:
    """A vLLM ref as people read it: a tag as is, a commit by its first 12 digits."""
    return ref[:12] if re.fullmatch(r"[0-9a-f]{40}", ref) else ref


def served_vllm_refs(
    fleet: Iterable[tuple[str, Mapping[str, Any], Iterable[str]]],
) -> tuple[dict[str, list[str]], list[str]]:
    """vLLM ref -> the pods ("host/pod") that serve an image of it, over every host that serves a
    variant; and a note per pod whose image names no vLLM version."""
    catalog = load_catalog()
    refs: dict[str, list[str]] = {}
    notes: list[str] = []
    for name, data, _groups in fleet:
        if not serves_variant(data):
            continue
        for pod in pods_of(data):
            image_key = catalog["variants"][pod.variant]["image"]
            image = catalog["images"][image_key]
            ref = image_vllm_ref(str(image["repository"]), str(image["tag"]))
            if ref is None:
                notes.append(f"{name}/{pod.name}: image {image['repository']}:{image['tag']} names no vLLM version; "
                             "no vLLM dashboards for it")
            else:
                refs.setdefault(ref, []).append(f"{name}/{pod.name}")
    return refs, notes


@dataclass(frozen=True)
class VllmDashboard:
    ref: str  # the vLLM tag or commit it comes from
    file: str  # its name in vLLM's dashboards directory
    text: str  # as provisioned: uid and title made unique to the version

    @property
    def dest(self) -> str:
        return f"{vllm_ref_dir(self.ref)}/{self.file}"


def vllm_ref_dir(ref: str) -> str:
    return f"{VLLM_DASHBOARDS_DIR}/{_UID.sub('-', ref_label(ref))}"


def provisioned_vllm_dashboard(text: str, ref: str, file: str) -> str:
    """vLLM's dashboard JSON as rigup provisions it. Several vLLM versions can be served at once, and
    Grafana keeps one dashboard per uid: the uid gets the version (cut to Grafana's 40 characters), the
    title says it, and a tag names it. A dashboard exported for import (`__inputs` with ${DS_...}) is
    pointed at rigup's datasource, which file provisioning would otherwise leave unresolved."""
    label = ref_label(ref)
    inputs = set(_DATASOURCE_INPUT.findall(text))
    for name in inputs:
        text = text.replace("${" + name + "}", DATASOURCE_UID)
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DashboardError(f"vLLM {label}: {file} is not JSON ({exc})") from None
    if not isinstance(document, dict) or not isinstance(document.get("panels"), list):
        raise DashboardError(f"vLLM {label}: {file} is not a Grafana dashboard (no panels list)")
    document.pop("__inputs", None)
    document.pop("id", None)
    suffix = "-" + _UID.sub("-", label)
    base = _UID.sub("-", str(document.get("uid") or file.removesuffix(".json")))
    document["uid"] = base[: UID_MAX - len(suffix)] + suffix
    document["title"] = f"{document.get('title') or file.removesuffix('.json')} (vLLM {label})"
    document["tags"] = sorted({*map(str, document.get("tags") or []), "vllm", f"vllm-{label}"})
    return json.dumps(document, indent=2, sort_keys=True) + "\n"


def vllm_dashboards(refs: Mapping[str, str], reader: Any, url: str, path: str) -> tuple[list[VllmDashboard], list[str]]:
    """The dashboards of each vLLM version (ref -> its locked commit), read at that commit from `path` of
    the vLLM repository at `url` through `reader` (rigup.desired.upstream), and a note per version that has
    none there (older vLLM releases kept them elsewhere)."""
    out: list[VllmDashboard] = []
    notes: list[str] = []
    for ref, commit in sorted(refs.items()):
        files = [name for name in reader.names(VLLM_SOURCE, url, commit, path) if name.endswith(".json")]
        if not files:
            notes.append(f"vLLM {ref_label(ref)} has no dashboards under {path}")
        for name in files:
            text = reader.read(VLLM_SOURCE, url, commit, f"{path}/{name}")
            out.append(VllmDashboard(ref, name, provisioned_vllm_dashboard(text, ref, name)))
    return out, notes


def vllm_lock_name(ref: str) -> str:
    return f"git:{VLLM_SOURCE}@{ref}"
