"""The monitor's decisions: which hosts run Prometheus, what it scrapes with which labels, the pods'
targets from provenance records, where the keys go, and the rigs' exporters. The files it writes are
checked by the real promtool and amtool (Debian's, from the test bed's archive)."""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from rigup.desired.knobs import load_defaults
from rigup.desired.lock import ImagePin, LockFile
from rigup.desired.metrics_auth import CA_FILE, scrape_auth
from rigup.desired.monitoring import (
    GPU_COUNTERS_FILE,
    KEYS_DIR,
    RULES_FILE,
    MonitoringError,
    ScrapedRig,
    gpu_exporter_image,
    monitor_plan,
    pod_target_groups,
    pod_targets,
    pods_in_targets,
    rig_exporters,
    rules_text,
    targets_file,
)
from rigup.rig import servingctl
from rigup_testbed import debarchive


def data(**values: Any) -> dict[str, Any]:
    return {**load_defaults(), **values}


def key_file(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text + "\n")
    path.chmod(0o600)
    return str(path)


def fleet(tmp_path: Path) -> list[tuple[str, dict[str, Any], list[str]]]:
    """A gateway-only host and two rigs, one without exporters."""
    gw_key = key_file(tmp_path, "gw.key", "sk-gateway-secret")
    return [
        ("gw", data(ssh_hostname="10.0.0.10", serves_variant=False, gateway_api_key_file=gw_key), ["gateway"]),
        ("rig-1", data(ssh_hostname="10.0.0.11"), ["rigs"]),
        ("rig-2", data(ssh_hostname="10.0.0.12", metrics_exporters=False, install_root="/srv/rigup"), ["rigs"]),
    ]


def plan_of(tmp_path: Path, name: str = "gw", **overrides: Any):
    hosts = fleet(tmp_path)
    own = next((d, g) for n, d, g in hosts if n == name)
    return monitor_plan(name, {**own[0], **overrides}, own[1], hosts)


def test_prometheus_runs_beside_the_gateway_unless_monitor_group_says_otherwise(tmp_path: Path) -> None:
    assert plan_of(tmp_path, "rig-1") is None
    assert plan_of(tmp_path, "gw") is not None
    assert plan_of(tmp_path, "gw", monitor_group="ops") is None
    assert plan_of(tmp_path, "rig-1", monitor_group="rigs") is not None


def test_prometheus_yml_scrapes_every_job_and_names_the_gateway_key_file_only(tmp_path: Path) -> None:
    plan = plan_of(tmp_path)
    text = plan.config_text()
    assert "sk-gateway-secret" not in text  # the key is in a 0600 file, never in prometheus.yml
    document = yaml.safe_load(text)
    assert document["global"]["scrape_interval"] == "15s" and document["rule_files"] == [RULES_FILE]
    jobs = {job["job_name"]: job for job in document["scrape_configs"]}
    assert set(jobs) == {"prometheus", "vllm", "gpu", "node", "gateway-gw"}
    assert jobs["vllm"]["file_sd_configs"] == [{"files": [targets_file("vllm")]}]
    gateway = jobs["gateway-gw"]
    assert gateway["metrics_path"] == "/metrics/"
    assert gateway["authorization"] == {"credentials_file": f"{KEYS_DIR}/gateway-gw.key"}
    # the monitor is the gateway host: it reaches the gateway on loopback
    assert gateway["static_configs"] == [{"targets": ["127.0.0.1:4000"], "labels": {"host": "gw"}}]
    assert plan.gateway_keys == {f"{KEYS_DIR}/gateway-gw.key": "sk-gateway-secret"}
    # over TLS, its certificate checked against the fleet CA's (the one the node job trusts too)
    assert gateway["scheme"] == "https" and gateway["tls_config"] == {"ca_file": CA_FILE}
    assert "alerting" not in document  # no webhook: no Alertmanager
    assert plan.defaults_text().endswith("ARGS='--web.listen-address=0.0.0.0:9090 --storage.tsdb.retention.time=15d "
                                         "--web.config.file=/etc/prometheus/rigup-web/prometheus.yml'\n")
    for job in ("gpu", "node"):  # both exporters ask who is calling: https, the login, the fleet CA
        assert {key: jobs[job][key] for key in scrape_auth()} == scrape_auth()
    # Prometheus asks itself who it is: its own job over TLS with the login (rigup.desired.metrics_auth)
    assert jobs["prometheus"] == {"job_name": "prometheus", "static_configs": [
        {"targets": ["127.0.0.1:9090"], "labels": {"host": "gw"}}], **scrape_auth()}
    assert plan.local_url == "https://127.0.0.1:9090"


def test_exporter_targets_follow_the_fleet_file(tmp_path: Path) -> None:
    targets = plan_of(tmp_path).static_targets()
    # rig-2 runs no exporters; the gateway-only host is no rig
    assert targets == {
        "node": [{"targets": ["10.0.0.11:9100"], "labels": {"host": "rig-1"}}],
        "gpu": [{"targets": ["10.0.0.11:9400"], "labels": {"host": "rig-1"}}],
    }


def test_the_gateway_scrape_trusts_the_users_ca_or_speaks_plain_http_only_when_told(tmp_path: Path) -> None:
    def gateway_job(**gateway_data: Any) -> tuple[dict[str, Any], Any]:
        hosts = fleet(tmp_path)
        hosts[0] = ("gw", {**hosts[0][1], **gateway_data}, ["gateway"])
        plan = monitor_plan("gw", hosts[0][1], ["gateway"], hosts)
        assert plan is not None
        [job] = [j for j in plan.config_document()["scrape_configs"] if j["job_name"] == "gateway-gw"]
        return job, plan.gateways[0]

    own = {"gateway_tls_cert_file": "/c/tls.crt", "gateway_tls_key_file": "/c/tls.key"}
    job, gateway = gateway_job(**own, gateway_tls_ca_file="/c/our-ca.crt")
    assert job["scheme"] == "https" and job["tls_config"] == {"ca_file": "/etc/prometheus/rigup-web/gateway-gw-ca.crt"}
    assert gateway.ca_source == "/c/our-ca.crt"  # written there by tasks/prometheus.py
    job, gateway = gateway_job(**own)  # a publicly issued certificate: the monitor's system roots
    assert job["scheme"] == "https" and "tls_config" not in job and gateway.ca_source is None
    job, gateway = gateway_job(gateway_plain_http=True)
    assert job["scheme"] == "http" and "tls_config" not in job


def test_a_missing_gateway_key_names_the_host_and_the_knob(tmp_path: Path) -> None:
    hosts = fleet(tmp_path)
    hosts[0] = ("gw", {**hosts[0][1], "gateway_api_key_file": str(tmp_path / "absent.key")}, ["gateway"])
    with pytest.raises(MonitoringError, match=r"the gateway key of 'gw'.*absent\.key"):
        monitor_plan("gw", hosts[0][1], ["gateway"], hosts)


def test_alertmanager_runs_when_a_webhook_file_is_set_and_its_url_stays_out_of_prometheus_yml(tmp_path: Path) -> None:
    url = "https://hooks.example/T000/secret-token"
    plan = plan_of(tmp_path, alertmanager_webhook_url_file=key_file(tmp_path, "hook.url", url))
    assert plan.alertmanager_port == 9093 and plan.webhook_url == url
    # alertmanager.yml holds it (the deploy writes that file 0600), prometheus.yml does not
    receivers = yaml.safe_load(plan.alertmanager_config_text())["receivers"]
    assert receivers == [{"name": "webhook", "webhook_configs": [{"url": url, "send_resolved": True}]}]
    assert "secret-token" not in plan.config_text()
    assert yaml.safe_load(plan.config_text())["alerting"] == {
        "alertmanagers": [{"static_configs": [{"targets": ["127.0.0.1:9093"]}], **scrape_auth()}]}
    # Alertmanager asks for the same login, and its HA gossip (0.0.0.0:9094 by default) is off
    assert plan.alertmanager_defaults_text().endswith(
        "ARGS='--web.listen-address=127.0.0.1:9093 --web.config.file=/etc/prometheus/rigup-web/alertmanager.yml "
        "--cluster.listen-address='\n")
    bad = key_file(tmp_path, "bad.url", "not a url")
    with pytest.raises(MonitoringError, match="must hold one http"):
        plan_of(tmp_path, alertmanager_webhook_url_file=bad)


def record(pod: str | None, variant: str, port: int, *, bind: str = "0.0.0.0", at: str = "2026-12-01T10:00:00Z") -> dict[str, Any]:
    out = {"variant": variant, "unit": f"rigup-{pod or variant}.service", "written_at": at, "gate": {"result": "passed"},
           "release": {"served_model_name": f"model-{variant}", "host_port": port, "bind_address": bind}}
    if pod:
        out["pod"] = pod
    return out


def test_pods_are_targets_from_their_records_running_or_not() -> None:
    rig = ScrapedRig("rig-1", "10.0.0.11", "/opt/rigup", 9100, 9400)
    targets, notes = pod_targets(rig, [record("chat", "dual", 8000), record("code", "single", 8001),
                                       record(None, "local", 8002, bind="127.0.0.1")])
    assert [(t.pod, t.address, t.model) for t in targets] == [("chat", "10.0.0.11:8000", "model-dual"),
                                                            ("code", "10.0.0.11:8001", "model-single")]
    assert notes == ["rig-1: rigup-local.service listens where the monitor cannot reach it (127.0.0.1)"]
    groups = pod_target_groups(targets)
    assert groups[0] == {"targets": ["10.0.0.11:8000"],
                         "labels": {"host": "rig-1", "pod": "chat", "variant": "dual", "model": "model-dual"}}
    # what a rig outside the run keeps: the file's own targets, read back
    assert pods_in_targets(json.dumps(groups)) == targets
    assert pods_in_targets("not json") == [] and pods_in_targets(None) == []


def test_a_monitor_on_the_rig_itself_scrapes_its_loopback_pod() -> None:
    local = ScrapedRig("rig-1", "127.0.0.1", "/opt/rigup", 9100, 9400)
    targets, notes = pod_targets(local, [record(None, "dual", 8000, bind="127.0.0.1")])
    assert [t.address for t in targets] == ["127.0.0.1:8000"] and notes == []


def test_a_variant_switch_keeps_one_target_per_unit_the_newest() -> None:
    rig = ScrapedRig("rig-1", "10.0.0.11", "/opt/rigup", 9100, 9400)
    old = {**record(None, "dual", 8000, at="2026-12-01T10:00:00Z"), "unit": "rigup-x.service"}
    new = {**record(None, "single", 8001, at="2026-12-02T10:00:00Z"), "unit": "rigup-x.service"}
    targets, _ = pod_targets(rig, [old, new])
    assert [(t.variant, t.address) for t in targets] == [("single", "10.0.0.11:8001")]


def test_rig_exporters_and_the_locked_gpu_exporter_image() -> None:
    assert rig_exporters(data(metrics_exporters=False)) is None
    assert rig_exporters(data(serves_variant=False)) is None
    image = gpu_exporter_image(data(gpu_exporter_image="mirror.lan:5000/nvidia/k8s/dcgm-exporter:4.5.3-4.8.2-ubuntu22.04"))
    assert (image.registry, image.repository, image.tag) == ("mirror.lan:5000", "nvidia/k8s/dcgm-exporter", "4.5.3-4.8.2-ubuntu22.04")
    assert image.ref == "mirror.lan:5000/nvidia/k8s/dcgm-exporter:4.5.3-4.8.2-ubuntu22.04"
    digest = "sha256:" + "ab" * 32
    lock = LockFile()
    lock.images[image.lock_name] = ImagePin(image.lock_name, image.repository, image.tag, digest)
    exporters = rig_exporters(data(gpu_exporter_image="mirror.lan:5000/nvidia/k8s/dcgm-exporter:4.5.3-4.8.2-ubuntu22.04"), lock)
    assert exporters.image.ref.endswith(f":4.5.3-4.8.2-ubuntu22.04@{digest}")
    unit = exporters.gpu_unit_text()
    web = "/etc/prometheus/rigup-web/gpu-exporter"
    # its web config (TLS and basic auth, metrics_auth): the three files mounted read-only where it names them
    assert (f"--pull never --gpus all --cap-add SYS_ADMIN -p 9400:9400 -v /opt/rigup/metrics/dcgm-counters.csv:"
            f"/etc/dcgm-exporter/rigup-counters.csv:ro -v {web}.crt:{web}.crt:ro -v {web}.key:{web}.key:ro "
            f"-v {web}.yml:{web}.yml:ro {exporters.image.ref} -f /etc/dcgm-exporter/rigup-counters.csv "
            f"--web-config-file {web}.yml\n") in unit
    assert "--collector.textfile.directory=/var/lib/prometheus/node-exporter" in exporters.defaults_text()


def test_the_facts_and_sentinel_timers_run_at_their_knobs_periods() -> None:
    import configparser

    def timer(text: str) -> dict[str, str]:
        parsed = configparser.ConfigParser(strict=False)
        parsed.read_string(text)
        return dict(parsed["Timer"])

    assert timer(rig_exporters(data()).facts_timer_text())["onunitactivesec"] == "15s"  # group_data/all.py's
    exporters = rig_exporters(data(metrics_facts_interval_s=120, sentinel_interval_s=45))
    assert timer(exporters.facts_timer_text()) == {"onactivesec": "1s", "onunitactivesec": "120s", "accuracysec": "1s"}
    assert timer(exporters.sentinel_timer_text())["onunitactivesec"] == "45s"


def test_the_fields_file_asks_for_what_the_alerts_and_top_read() -> None:
    fields = {line.split(",")[0] for line in GPU_COUNTERS_FILE.read_text().splitlines() if line and not line.startswith("#")}
    rules = rules_text(data())
    for name in ("DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_CLOCKS_EVENT_REASONS", "DCGM_FI_DEV_XID_ERRORS",
                 "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_POWER_MGMT_LIMIT"):
        assert name in rules and name in fields
    assert not any(f.startswith("DCGM_FI_PROF_") for f in fields)  # GeForce: no profiling fields


# --- the real tools on what the deploy writes ------------------------------------------------------

# Every alert the issue asks for, and the exporters' own: tests/desired/test_alert_rules.py fires and
# clears each one with promtool.
ALERTS = [
    "RigupPodDown", "RigupGateFailed", "RigupUnitCrashLooping", "RigupKvCacheFull", "RigupTtftHigh",
    "RigupGpuHot", "RigupGpuThrottled", "RigupGpuXid", "RigupGpuAtPowerCap", "RigupExporterDown",
    "RigupModelDiskFull", "RigupDriverDrift", "RigupReleaseDrift", "RigupGatewayDown", "RigupGatewayRouteUnhealthy",
    "RigupPodQuarantined", "RigupPodOutvoted", "RigupSpecDecodeAcceptanceCollapsed", "RigupPodLengthFinishSurge",
    "RigupPodDegenerateAnswers",
]


def run_tool(name: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(debarchive.program(name)), *args], capture_output=True, text=True, timeout=120)


def test_promtool_accepts_the_rules_and_the_config(tmp_path: Path) -> None:
    plan = plan_of(tmp_path, alertmanager_webhook_url_file=key_file(tmp_path, "hook.url", "https://hooks.example/x"))
    rules = tmp_path / "rigup-alerts.yml"
    rules.write_text(plan.rules_text)
    checked = run_tool("promtool", "check", "rules", str(rules))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in checked.stdout
    alerts = [rule["alert"] for group in yaml.safe_load(plan.rules_text)["groups"] for rule in group["rules"]]
    assert sorted(alerts) == sorted(ALERTS)
    # the config as written, its absolute paths moved under tmp_path (promtool opens what it names)
    keys = tmp_path / "keys"
    keys.mkdir()
    (keys / "gateway-gw.key").write_text("k\n")
    text = plan.config_text().replace(RULES_FILE, str(rules)).replace(KEYS_DIR, str(keys))
    config = tmp_path / "prometheus.yml"
    config.write_text(text)
    checked = run_tool("promtool", "check", "config", str(config))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS" in checked.stdout
    broken = tmp_path / "broken.yml"
    broken.write_text(text.replace("scrape_interval: 15s", "scrape_interval: fifteen"))
    assert run_tool("promtool", "check", "config", str(broken)).returncode != 0


def test_amtool_accepts_the_alertmanager_config(tmp_path: Path) -> None:
    plan = plan_of(tmp_path, alertmanager_webhook_url_file=key_file(tmp_path, "hook.url", "https://hooks.example/x"))
    config = tmp_path / "alertmanager.yml"
    config.write_text(plan.alertmanager_config_text())
    checked = run_tool("amtool", "check-config", str(config))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "Found:" in checked.stdout and "receivers" in checked.stdout


def test_node_exporter_runs_with_rigups_flags_and_reports_the_models_filesystem(tmp_path: Path) -> None:
    """The real node_exporter under rigup's ARGS, split on whitespace as systemd splits an unbraced $ARGS:
    every flag is accepted, the textfile directory is read, and the filesystem of the models (this
    checkout's, whatever its type: a rig's root may be overlay) has its series."""
    exporters = rig_exporters(data())
    textfile_dir = tmp_path / "textfile"
    textfile_dir.mkdir()
    (textfile_dir / "rigup.prom").write_text("# TYPE rigup_probe gauge\nrigup_probe 1\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [a.replace(":9100", f"127.0.0.1:{port}").replace("/var/lib/prometheus/node-exporter", str(textfile_dir))
            for a in exporters.node_exporter_args.split()]
    args = [a for a in args if not a.startswith("--collector.systemd")]  # no systemd bus on this machine
    proc = subprocess.Popen([str(debarchive.node_exporter()), *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        text = ""
        for _ in range(50):
            try:
                text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
                break
            except OSError:
                assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
                time.sleep(0.1)
        assert "rigup_probe 1" in text
        mountpoint = servingctl.mountpoint_of(str(tmp_path))
        assert f'mountpoint="{mountpoint}"' in text and "node_filesystem_avail_bytes{" in text, mountpoint
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_the_crash_loop_rule_reads_a_start_time_node_exporter_serves_and_every_flag_is_accepted(tmp_path: Path) -> None:
    """RigupUnitCrashLooping resolves on the unit's start time (node_systemd_unit_start_time_seconds),
    which node_exporter serves only with its start-time flag: the flag is in rigup's ARGS, and the real
    node_exporter starts with every one of them (the systemd collector reads the bus per scrape only)."""
    rules = yaml.safe_load(plan_of(tmp_path).rules_text)
    (crash,) = [r for g in rules["groups"] for r in g["rules"] if r["alert"] == "RigupUnitCrashLooping"]
    assert "node_systemd_unit_start_time_seconds" in crash["expr"]
    flags = rig_exporters(data()).node_exporter_args.split()
    assert "--collector.systemd.enable-start-time-metrics" in flags
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [a.replace(":9100", f"127.0.0.1:{port}").replace("/var/lib/prometheus/node-exporter", str(tmp_path))
            for a in flags]
    proc = subprocess.Popen([str(debarchive.node_exporter()), *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        for _ in range(50):
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.1)
        else:
            raise AssertionError("node_exporter did not listen")
    finally:
        proc.terminate()
        proc.wait(timeout=10)
