"""Fleet monitoring: what the control machine decides for the rigs' exporters and the monitor host.

Every component already speaks Prometheus: vLLM serves /metrics on each pod's port, LiteLLM's proxy on
the gateway's (its prometheus callback), NVIDIA's DCGM exporter (a pinned, locked container per rig)
the GPUs' DCGM_FI_DEV_* fields, and prometheus-node-exporter (the OS package) the host, plus rigup's
own facts as a textfile that rigup-servingctl writes on the rig. Nothing here is an exporter.

The hosts of monitor_group (default: gateway_group's) run Prometheus from the OS package. Its
prometheus.yml is fixed by the fleet file (jobs, rules, the gateway's key file); the pod targets are
file_sd JSON files written at the end of the converge from each rig's provenance record, the same
discovery the gateway routes use, so a variant switch moves them at once and Prometheus picks the
change up without a reload. A pod stays a target while its rig's record names it, running or not:
that is how "pod down" can fire.

Labels on every target: host (the inventory name), and on pods pod, variant and model.
"""

from __future__ import annotations

import json
import posixpath
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from rigup import DEPLOY_ROOT
from rigup.desired.alert_for import ALERT_FOR_S
from rigup.desired.fleet_ca import ca_cert_path
from rigup.desired.gateway import current_records, front_trust, is_loopback, reach_address
from rigup.desired.knobs import knob, knob_int
from rigup.desired.lock import LockFile
from rigup.desired.metrics_auth import (
    ALERTMANAGER_SERVICE,
    CA_FILE,
    GPU_EXPORTER_SERVICE,
    NODE_EXPORTER_SERVICE,
    PROMETHEUS_SERVICE,
    WEB_DIR,
    scrape_auth,
    web_file,
)
from rigup.desired.roles import is_gateway, is_monitor, serves_variant
from rigup.desired.secrets import SecretError, read_secret_file
from rigup.desired.templating import render_template
from rigup.layout import RigLayout

# Debian's and Ubuntu's prometheus packages: the unit reads ARGS from /etc/default/prometheus and
# the configuration from /etc/prometheus (prometheus-node-exporter likewise, with the textfile
# collector reading /var/lib/prometheus/node-exporter by default).
PROMETHEUS_UNIT = "prometheus.service"
PROMETHEUS_DEFAULTS_FILE = "/etc/default/prometheus"
PROMETHEUS_CONFIG_FILE = "/etc/prometheus/prometheus.yml"
RULES_FILE = "/etc/prometheus/rigup-alerts.yml"
TARGETS_DIR = "/etc/prometheus/rigup-targets"  # file_sd: <job>.json
KEYS_DIR = "/etc/prometheus/rigup-keys"  # the gateways' keys, 0600 prometheus: never in prometheus.yml
PROMETHEUS_USER = "prometheus"
ALERTMANAGER_UNIT = "prometheus-alertmanager.service"
ALERTMANAGER_DEFAULTS_FILE = "/etc/default/prometheus-alertmanager"
ALERTMANAGER_CONFIG_FILE = "/etc/prometheus/alertmanager.yml"
NODE_EXPORTER_UNIT = "prometheus-node-exporter.service"
NODE_EXPORTER_DEFAULTS_FILE = "/etc/default/prometheus-node-exporter"
TEXTFILE_DIR = "/var/lib/prometheus/node-exporter"
TEXTFILE_NAME = "rigup.prom"
GPU_EXPORTER_UNIT = "rigup-gpu-exporter.service"
GPU_EXPORTER_CONTAINER = "rigup-gpu-exporter"
GPU_EXPORTER_CONTAINER_PORT = 9400  # dcgm-exporter's own default listen address :9400
GPU_COUNTERS_FILE = DEPLOY_ROOT / "files" / "monitoring" / "dcgm-counters.csv"  # rigup's DCGM fields (-f)
GPU_COUNTERS_IN_CONTAINER = "/etc/dcgm-exporter/rigup-counters.csv"
FACTS_UNIT = "rigup-metrics.service"  # rigup-servingctl textfile, run by its timer
FACTS_TIMER = "rigup-metrics.timer"
SENTINEL_UNIT = "rigup-sentinel.service"  # rigup-servingctl sentinel, run by its timer (docs/sentinel.md)
SENTINEL_TIMER = "rigup-sentinel.timer"
SENTINEL_TEXTFILE_NAME = "rigup-sentinel.prom"

JOB_PODS, JOB_GPU, JOB_NODE, JOB_GATEWAY, JOB_PROMETHEUS = "vllm", "gpu", "node", "gateway", "prometheus"
# rigup's units, and Docker's, reported by node_exporter's systemd collector (crash loops, failed units).
SYSTEMD_UNITS_WATCHED = r"(rigup-.+|docker|containerd|prometheus-node-exporter)\.service"
# A crash-looping unit's alert resolves once the unit has been active this long (its start time, from
# the systemd collector's start-time metrics): longer than a pod that loads for minutes and then
# crashes stays up, so such a loop does not flap; a start by hand or by a converge resolves it at once.
CRASH_LOOP_STABLE_S = 300


def prometheus_duration(seconds: int) -> str:
    """A Prometheus duration of whole seconds, in its largest exact unit (900 -> 15m, 90 -> 90s)."""
    for unit, size in (("h", 3600), ("m", 60)):
        if seconds and seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


# LiteLLM's per-route response counters: a route's state is whichever of them moved last.
# vllm-router's per-pod health (1 in rotation, 0 out), in the entrance's /metrics/ with each model's name (rigup's
# njs dispatch adds the model label); worker is the pod's base URL (http://rig:port, what --worker-urls took).
ROUTE_HEALTH = "vllm_router_worker_health"


def route_failing_expr(gateway_job: str = 'job=~"gateway-.+"') -> str:
    """PromQL: per entrance route (host, api_base, requested_model), 1 while the model's router keeps the pod out
    of rotation (its health checks or its circuit breaker failed it), 0 while it is in: the state
    RigupGatewayRouteUnhealthy alerts on, for a graph. api_base is the route's as rigup writes it (worker + /v1)."""
    health = f'{ROUTE_HEALTH}{{{gateway_job}}}'
    labelled = f'label_replace(label_replace({health}, "api_base", "$1/v1", "worker", "(.+)"), "requested_model", "$1", "model", "(.+)")'
    return f"max by (host, api_base, requested_model) (1 - {labelled})"


# node_exporter's filesystem defaults (1.5) leave out /mnt and /media, where models often live, and
# overlay, which a rig's root may be: both kept here, so the models' disk always has its series.
# Docker's own overlay mounts stay out by their mount point.
FILESYSTEM_MOUNTS_EXCLUDED = "^/(dev|proc|run|sys|var/lib/docker/.+|var/lib/containers/storage/.+)($|/)"
FILESYSTEM_TYPES_EXCLUDED = (
    "^(autofs|binfmt_misc|bpf|cgroup2?|configfs|debugfs|devpts|devtmpfs|fusectl|hugetlbfs|iso9660|mqueue|nsfs|"
    "proc|procfs|pstore|rpc_pipefs|securityfs|selinuxfs|squashfs|sysfs|tracefs)$"
)


class MonitoringError(ValueError):
    """A monitoring setting rigup cannot use; the message names the host and the knob."""


@dataclass(frozen=True)
class GpuExporterImage:
    """The DCGM exporter's image: gpu_exporter_image split, plus its digest from the lock."""

    registry: str  # nvcr.io
    repository: str  # nvidia/k8s/dcgm-exporter
    tag: str
    digest: str | None

    @property
    def lock_name(self) -> str:
        return f"image:{self.repository}:{self.tag}"

    @property
    def ref(self) -> str:
        ref = f"{self.registry}/{self.repository}:{self.tag}"
        return f"{ref}@{self.digest}" if self.digest else ref


def gpu_exporter_image(data: Mapping[str, Any], lock: LockFile | None = None) -> GpuExporterImage:
    reference = str(knob(data, "gpu_exporter_image"))
    name, _, tag = reference.rpartition(":")
    registry, _, repository = name.partition("/")
    digest = lock.image_digest(f"image:{repository}:{tag}") if lock is not None else None
    return GpuExporterImage(registry, repository, tag, digest)


@dataclass(frozen=True)
class RigExporters:
    """What a rig runs for the monitor: node_exporter (with rigup's textfile) and the GPU exporter."""

    node_port: int
    gpu_port: int
    image: GpuExporterImage
    install_root: str
    facts_interval_s: int  # metrics_facts_interval_s: rigup-metrics.timer's period
    sentinel_interval_s: int  # the sentinel's knobs (group_data/all.py), rendered into its unit and timer
    sentinel_fail_after: int
    sentinel_pass_after: int
    # node_exporter's flag naming its web config (rigup.desired.metrics_auth: TLS and basic auth), by the
    # rig's OS release; None: no web config (plain HTTP)
    web_config_flag: str | None = None

    @property
    def node_exporter_args(self) -> str:
        """ARGS for /etc/default/prometheus-node-exporter: its port, its web config, the textfile directory and
        the systemd collector over rigup's and Docker's units (restart counts show a crash loop)."""
        web_config = [f"{self.web_config_flag}={web_file(NODE_EXPORTER_SERVICE, 'yml')}"] if self.web_config_flag else []
        return " ".join([
            f"--web.listen-address=:{self.node_port}",
            *web_config,
            f"--collector.textfile.directory={TEXTFILE_DIR}",
            "--collector.systemd",
            f"--collector.systemd.unit-include={SYSTEMD_UNITS_WATCHED}",
            "--collector.systemd.enable-restarts-metrics",
            "--collector.systemd.enable-start-time-metrics",
            f"--collector.filesystem.mount-points-exclude={FILESYSTEM_MOUNTS_EXCLUDED}",
            f"--collector.filesystem.fs-types-exclude={FILESYSTEM_TYPES_EXCLUDED}",
        ])

    def defaults_text(self) -> str:
        return (
            "# Written by rigup (tasks/metrics.py): node_exporter's flags for the fleet's Prometheus.\n"
            f"ARGS='{self.node_exporter_args}'\n"
        )

    @property
    def counters_file(self) -> str:
        """rigup's DCGM fields on the rig, mounted into the exporter's container."""
        return RigLayout(self.install_root).gpu_counters

    @property
    def textfile(self) -> str:
        return posixpath.join(TEXTFILE_DIR, TEXTFILE_NAME)

    def facts_unit_text(self, ctl: str, driver_branch: int, model_dir: str) -> str:
        return render_template("rigup-metrics.service.j2", exporters=self, ctl=ctl, driver_branch=driver_branch,
                               model_dir=model_dir)

    def facts_timer_text(self) -> str:
        return render_template("rigup-metrics.timer.j2", interval_s=self.facts_interval_s)

    def sentinel_unit_text(self, ctl: str) -> str:
        return render_template("rigup-sentinel.service.j2", exporters=self, ctl=ctl,
                               out=posixpath.join(TEXTFILE_DIR, SENTINEL_TEXTFILE_NAME),
                               fail_after=self.sentinel_fail_after, pass_after=self.sentinel_pass_after)

    def sentinel_timer_text(self) -> str:
        return render_template("rigup-sentinel.timer.j2", interval_s=self.sentinel_interval_s)

    def gpu_unit_text(self) -> str:
        """The GPU exporter's unit: its container asks for TLS and basic auth (--web-config-file), its certificate,
        key and web config mounted read-only where the web config names them."""
        web = [web_file(GPU_EXPORTER_SERVICE, suffix) for suffix in ("crt", "key", "yml")]
        return render_template("rigup-gpu-exporter.service.j2", exporters=self, container=GPU_EXPORTER_CONTAINER,
                               container_port=GPU_EXPORTER_CONTAINER_PORT, counters=GPU_COUNTERS_IN_CONTAINER,
                               web_files=web, web_config=web[2])


def rig_exporters(data: Mapping[str, Any], lock: LockFile | None = None) -> RigExporters | None:
    """The exporters of a rig (None: metrics_exporters is off, or the host serves no variant)."""
    if not knob(data, "metrics_exporters") or not serves_variant(data):
        return None
    return RigExporters(
        node_port=knob(data, "node_exporter_port"),
        gpu_port=knob(data, "gpu_exporter_port"),
        image=gpu_exporter_image(data, lock),
        install_root=str(knob(data, "install_root")),
        facts_interval_s=knob_int(data, "metrics_facts_interval_s", minimum=5),
        sentinel_interval_s=knob_int(data, "sentinel_interval_s", minimum=5),
        sentinel_fail_after=knob_int(data, "sentinel_fail_after", minimum=1),
        sentinel_pass_after=knob_int(data, "sentinel_pass_after", minimum=1),
    )


# --------------------------------------------------------------------------------------------------
# the monitor host


@dataclass(frozen=True)
class ScrapedRig:
    """A rig of the fleet as the monitor sees it."""

    host: str
    address: str | None  # where the monitor reaches it; None: nowhere (pyinfra's @local seen from another host)
    install_root: str  # where its provenance records are
    node_port: int | None  # None: it runs no exporters
    gpu_port: int | None


@dataclass(frozen=True)
class ScrapedGateway:
    host: str
    address: str
    port: int
    key_file: str  # on the monitor host, 0600 prometheus
    scheme: str = "https"  # "http" only with the gateway's gateway_plain_http
    ca_file: str | None = None  # on the monitor host: the CA its certificate is verified against; None: system roots
    ca_source: str | None = None  # the control-machine file written to ca_file; None: CA_FILE, written anyway

    @property
    def job(self) -> str:
        return f"{JOB_GATEWAY}-{re.sub(r'[^A-Za-z0-9_.-]', '_', self.host)}"


@dataclass(frozen=True)
class PodTarget:
    host: str
    address: str  # host:port of the pod's API (its /metrics)
    pod: str
    variant: str
    model: str


@dataclass(frozen=True)
class MonitorPlan:
    """What a monitor host gets: Prometheus' flags, config, rules and targets; Alertmanager when a
    webhook is set; the gateways' keys (secrets, written 0600 for the prometheus user)."""

    host: str
    listen_address: str
    retention: str
    scrape_interval_s: int
    rigs: tuple[ScrapedRig, ...]
    gateways: tuple[ScrapedGateway, ...]
    alertmanager_port: int | None  # None: no Alertmanager
    rules_text: str
    gateway_keys: dict[str, str] = field(default_factory=dict, repr=False)  # key file -> key
    webhook_url: str | None = field(default=None, repr=False)
    grafana_port: int | None = None  # None: no Grafana

    @property
    def port(self) -> int:
        return int(self.listen_address.rpartition(":")[2])

    @property
    def local_url(self) -> str:
        """Prometheus as the monitor host itself reaches it (TLS: its certificate names 127.0.0.1 and localhost)."""
        address = self.listen_address.rpartition(":")[0].strip("[]")
        if address in ("0.0.0.0", "::"):
            address = "127.0.0.1"
        return f"https://{_bracketed(address)}:{self.port}"

    def defaults_text(self) -> str:
        """Prometheus' flags: where it listens, what it keeps, and its web config (TLS from the fleet CA and basic
        auth: rigup.desired.metrics_auth), so it asks every caller who it is."""
        args = (f"--web.listen-address={self.listen_address} --storage.tsdb.retention.time={self.retention} "
                f"--web.config.file={web_file(PROMETHEUS_SERVICE, 'yml')}")
        return f"# Written by rigup (tasks/prometheus.py): Prometheus' flags.\nARGS='{args}'\n"

    def config_document(self) -> dict[str, Any]:
        interval = f"{self.scrape_interval_s}s"

        def file_sd(job: str) -> dict[str, Any]:
            return {"job_name": job, "file_sd_configs": [{"files": [targets_file(job)]}]}

        jobs: list[dict[str, Any]] = [
            {"job_name": JOB_PROMETHEUS, "static_configs": [
                {"targets": [self.local_url.removeprefix("https://")], "labels": {"host": self.host}}],
             **scrape_auth()},  # its own web config asks Prometheus too
            file_sd(JOB_PODS),
            {**file_sd(JOB_GPU), **scrape_auth()},  # so does the DCGM exporter (metrics_auth)
            {**file_sd(JOB_NODE), **scrape_auth()},  # node_exporter asks for TLS and basic auth (metrics_auth)
        ]
        for gateway in self.gateways:
            tls = {"tls_config": {"ca_file": gateway.ca_file}} if gateway.scheme == "https" and gateway.ca_file else {}
            jobs.append({
                "job_name": gateway.job,
                # the front serves the routers' expositions at /metrics/ (the entrance's allowlist)
                "metrics_path": "/metrics/",
                "scheme": gateway.scheme,
                **tls,
                "authorization": {"credentials_file": gateway.key_file},
                "static_configs": [{"targets": [f"{_bracketed(gateway.address)}:{gateway.port}"],
                                    "labels": {"host": gateway.host}}],
            })
        document: dict[str, Any] = {
            "global": {"scrape_interval": interval, "evaluation_interval": interval,
                       "scrape_timeout": f"{min(self.scrape_interval_s, 10)}s"},
            "rule_files": [RULES_FILE],
            "scrape_configs": jobs,
        }
        if self.alertmanager_port is not None:
            document["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{self.alertmanager_port}"]}],
                                                       **scrape_auth()}]}  # Alertmanager's web config asks the same
        return document

    def config_text(self) -> str:
        header = "# Written by rigup (tasks/prometheus.py) from the fleet file; the pod targets are in rigup-targets/.\n"
        return header + yaml.safe_dump(self.config_document(), sort_keys=False, default_flow_style=False)

    def static_targets(self) -> dict[str, list[dict[str, Any]]]:
        """The file_sd documents of the exporters' jobs: they follow the fleet file, not what runs."""
        gpu, node = [], []
        for rig in self.rigs:
            if rig.address is None or rig.node_port is None or rig.gpu_port is None:
                continue
            node.append({"targets": [f"{_bracketed(rig.address)}:{rig.node_port}"], "labels": {"host": rig.host}})
            gpu.append({"targets": [f"{_bracketed(rig.address)}:{rig.gpu_port}"], "labels": {"host": rig.host}})
        return {JOB_GPU: gpu, JOB_NODE: node}

    def alertmanager_config_text(self) -> str:
        """alertmanager.yml, holding the webhook's URL (it may carry a token): the file is written 0600 for
        the user Alertmanager runs as. The URL cannot move to a file of its own: webhook_config's url_file
        needs Alertmanager 0.26 or newer, and Ubuntu 22.04 ships 0.23 (Debian 12, the test bed's, 0.25)."""
        document = {
            "route": {"receiver": "webhook", "group_by": ["alertname", "host"], "group_wait": "30s",
                      "group_interval": "5m", "repeat_interval": "4h"},
            "receivers": [{"name": "webhook", "webhook_configs": [{"url": self.webhook_url, "send_resolved": True}]}],
        }
        header = "# Written by rigup (tasks/alertmanager.py): every alert goes to the webhook of alertmanager_webhook_url_file.\n"
        return header + yaml.safe_dump(document, sort_keys=False, default_flow_style=False)

    def alertmanager_defaults_text(self) -> str:
        """Alertmanager's flags: loopback, its web config (TLS and basic auth, as Prometheus'), and no HA cluster
        (its gossip listens on 0.0.0.0:9094 by default; an empty cluster.listen-address turns it off:
        cmd/alertmanager/main.go line 201 at v0.23.0, 61046b1)."""
        args = (f"--web.listen-address=127.0.0.1:{self.alertmanager_port} "
                f"--web.config.file={web_file(ALERTMANAGER_SERVICE, 'yml')} --cluster.listen-address=")
        return f"# Written by rigup (tasks/alertmanager.py): Alertmanager's flags.\nARGS='{args}'\n"


def targets_file(job: str) -> str:
    return posixpath.join(TARGETS_DIR, f"{job}.json")


def targets_text(groups: Sequence[Mapping[str, Any]]) -> str:
    return json.dumps(list(groups), indent=2, sort_keys=True) + "\n"


def _bracketed(address: str) -> str:
    return f"[{address}]" if ":" in address else address


def rules_text(data: Mapping[str, Any]) -> str:
    return render_template(
        "rigup-alerts.yml.j2",
        ttft_p95_s=float(knob(data, "alert_ttft_p95_s")),
        gpu_temp_c=float(knob(data, "alert_gpu_temp_c")),
        disk_free_ratio=float(knob(data, "alert_disk_free_ratio")),
        stable_s=CRASH_LOOP_STABLE_S,
        held_for=lambda alert: prometheus_duration({**ALERT_FOR_S, **(knob(data, "alert_for_s") or {})}[alert]),
        route_failing=route_failing_expr(f'job=~"{JOB_GATEWAY}-.+"'),
        jobs={"pods": JOB_PODS, "gpu": JOB_GPU, "node": JOB_NODE, "gateway": JOB_GATEWAY},
    )


def monitor_plan(
    host_name: str,
    data: Mapping[str, Any],
    groups: Iterable[str],
    fleet: Iterable[tuple[str, Mapping[str, Any], Iterable[str]]],
    *,
    read_secrets: bool = True,
) -> MonitorPlan | None:
    """The monitor plan of one host (None: it is not in monitor_group). `fleet` is every host of the
    inventory with its data and groups, in order: the ones serving a variant are scraped as rigs, the
    gateway_group ones as gateways."""
    if not is_monitor(data, groups):
        return None
    rigs, gateways, keys = [], [], {}
    for name, other, other_groups in fleet:
        local = name == host_name
        address = reach_address(name, other, host_name)
        if serves_variant(other):
            exporters = knob(other, "metrics_exporters")
            rigs.append(ScrapedRig(
                host=name,
                address=address,
                install_root=str(knob(other, "install_root")),
                node_port=knob(other, "node_exporter_port") if exporters else None,
                gpu_port=knob(other, "gpu_exporter_port") if exporters else None,
            ))
        if is_gateway(other, other_groups) and address is not None:
            key_file = posixpath.join(KEYS_DIR, f"gateway-{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}.key")
            bind = str(knob(other, "gateway_bind_address"))
            reach = address if bind in ("0.0.0.0", "::") else bind
            if is_loopback(reach) and not local:
                continue  # a gateway bound to its own loopback: out of reach, and its own monitor scrapes it
            scheme, trusted = front_trust(other)
            if trusted is None or scheme == "http":  # the system's roots, or plain HTTP
                ca_file, ca_source = None, None
            elif trusted == str(ca_cert_path(data)):  # the fleet CA the monitor trusts for node_exporter too
                ca_file, ca_source = CA_FILE, None
            else:  # the gateway's own CA (gateway_tls_ca_file), or another fleet CA's
                ca_file, ca_source = posixpath.join(WEB_DIR, f"gateway-{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}-ca.crt"), trusted
            gateways.append(ScrapedGateway(name, reach, knob(other, "gateway_port"), key_file, scheme, ca_file, ca_source))
            if read_secrets:
                source = knob(other, "gateway_api_key_file")
                if source is None:
                    raise MonitoringError(f"host {name!r}: gateway_api_key_file is not set (the monitor scrapes "
                                          "the gateway's /metrics with that key)")
                try:
                    keys[key_file] = read_secret_file(source, f"gateway_api_key_file of {name!r}")
                except SecretError as exc:
                    raise MonitoringError(f"the gateway key of {name!r}, which the monitor scrapes with: {exc}") from None
    webhook_file = knob(data, "alertmanager_webhook_url_file")
    webhook = None
    if webhook_file is not None and read_secrets:
        try:
            webhook = read_secret_file(webhook_file, "alertmanager_webhook_url_file")
        except SecretError as exc:
            raise MonitoringError(f"host {host_name!r}: {exc}") from None
        if not re.match(r"^https?://\S+$", webhook):
            raise MonitoringError(f"host {host_name!r}: alertmanager_webhook_url_file ({webhook_file}) must hold "
                                  "one http(s):// URL")
    return MonitorPlan(
        host=host_name,
        listen_address=str(knob(data, "prometheus_listen_address")),
        retention=str(knob(data, "prometheus_retention")),
        scrape_interval_s=knob_int(data, "prometheus_scrape_interval_s", minimum=1),
        rigs=tuple(rigs),
        gateways=tuple(gateways),
        alertmanager_port=knob(data, "alertmanager_port") if webhook_file is not None else None,
        rules_text=rules_text(data),
        gateway_keys=keys,
        webhook_url=webhook,
        grafana_port=knob(data, "grafana_port") if knob(data, "grafana") else None,
    )


def pod_targets(rig: ScrapedRig, records: Sequence[Mapping[str, Any]]) -> tuple[list[PodTarget], list[str]]:
    """The pods a rig's provenance records name (running or not: a stopped pod is a target that is
    down), and a note per record that gives none."""
    targets, notes = [], []
    for record in current_records(records):
        release = record.get("release") if isinstance(record.get("release"), Mapping) else {}
        member = release.get("cluster") if isinstance(release.get("cluster"), Mapping) else {}
        if member.get("role") == "worker":
            continue  # its head serves (and exports the metrics of) the whole cluster
        unit, model, port = record.get("unit"), release.get("served_model_name"), release.get("host_port")
        if not (isinstance(unit, str) and isinstance(model, str) and isinstance(port, int)):
            notes.append(f"{rig.host}: a provenance record names no unit, served model or port")
            continue
        bind = str(release.get("bind_address") or "0.0.0.0")
        address = rig.address if bind in ("0.0.0.0", "::") else bind
        if address is None or (is_loopback(address) and rig.address != "127.0.0.1"):
            notes.append(f"{rig.host}: {unit} listens where the monitor cannot reach it ({bind})")
            continue
        pod = str(record.get("pod") or record.get("variant") or unit.removeprefix("rigup-").removesuffix(".service"))
        targets.append(PodTarget(rig.host, f"{_bracketed(address)}:{port}", pod, str(record.get("variant")), model))
    return targets, notes


def pod_target_groups(targets: Iterable[PodTarget]) -> list[dict[str, Any]]:
    """The file_sd document of the pods' job: one group per pod, with its labels."""
    return [
        {"targets": [t.address], "labels": {"host": t.host, "pod": t.pod, "variant": t.variant, "model": t.model}}
        for t in sorted(targets, key=lambda t: (t.host, t.pod))
    ]


def pods_in_targets(text: str | None) -> list[PodTarget]:
    """The pod targets a file_sd document rigup wrote holds (a rig outside the run keeps its own)."""
    try:
        groups = json.loads(text) if text else []
    except ValueError:
        return []
    out = []
    for group in groups if isinstance(groups, list) else []:
        try:
            labels, (address,) = group["labels"], group["targets"]
            out.append(PodTarget(str(labels["host"]), str(address), str(labels["pod"]), str(labels["variant"]),
                                 str(labels["model"])))
        except (KeyError, TypeError, ValueError):
            continue
    return out
