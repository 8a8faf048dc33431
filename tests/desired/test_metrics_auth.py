"""node_exporter, Prometheus and Alertmanager ask who is calling (rigup.desired.metrics_auth): Debian's real
node_exporter under rigup's web config and a fleet-CA certificate refuses a caller without the password (401) and
answers Prometheus' login over TLS, as Debian's Prometheus and Alertmanager do under rigup's flags, with `rigup
top`'s client logging in; the password is made once 0600 and its bcrypt hash kept stable, and Prometheus' node
job carries the login as a password file and the CA as a file."""

from __future__ import annotations

import socket
import ssl
import stat
import subprocess
import time
import urllib.error
import urllib.request
from base64 import b64encode
from dataclasses import replace
from pathlib import Path

import bcrypt
import pytest

from rigup.client.fleet_metrics import PrometheusError, query_prometheus
from rigup.desired.fleet_ca import ensure_ca, host_sans, issue
from rigup.desired.knobs import load_defaults
from rigup.desired.metrics_auth import (
    CA_FILE,
    METRICS_USER,
    NODE_EXPORTER_SERVICE,
    PASSWORD_FILE,
    PROMETHEUS_SERVICE,
    WEB_DIR,
    PrometheusLogin,
    metrics_credentials,
    node_exporter_web_flag,
    prometheus_login,
    scrape_auth,
    web_config_text,
)
from rigup.desired.monitoring import MonitorPlan, rig_exporters
from rigup_testbed import debarchive


def knobs(**data) -> dict:
    return {**load_defaults(), **data}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, context: ssl.SSLContext | None = None, login: tuple[str, str] | None = None) -> int:
    request = urllib.request.Request(url)
    if login is not None:
        request.add_header("Authorization", "Basic " + b64encode(f"{login[0]}:{login[1]}".encode()).decode())
    try:
        with urllib.request.urlopen(request, timeout=5, context=context) as reply:
            return reply.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_the_password_is_made_once_0600_and_its_hash_is_stable(tmp_path: Path) -> None:
    ca = ensure_ca(knobs(), base_dir=tmp_path)
    first = metrics_credentials(knobs(), ca)
    password_file = ca.directory / "metrics.password"
    assert stat.S_IMODE(password_file.stat().st_mode) == 0o600 and password_file.read_text().strip() == first.password
    again = metrics_credentials(knobs(), ca)
    assert again == first and again.password_hash.startswith("$2b$")  # the same web config on a re-run
    assert bcrypt.checkpw(first.password.encode(), first.password_hash.encode())
    own = tmp_path / "mine"
    own.write_text("s3cret-of-mine\n")
    own.chmod(0o600)
    mine = metrics_credentials(knobs(metrics_password_file=str(own)), ca)
    assert mine.password == "s3cret-of-mine" and bcrypt.checkpw(b"s3cret-of-mine", mine.password_hash.encode())
    own.write_text("changed\n")  # a new password: hashed again, not the old hash kept
    assert bcrypt.checkpw(b"changed", metrics_credentials(knobs(metrics_password_file=str(own)), ca).password_hash.encode())


def test_a_run_checks_the_kept_hash_once_for_all_its_hosts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """bcrypt's check costs ~70 ms of CPU by design; a converge asks for the credentials of every host's web config."""
    ca = ensure_ca(knobs(), base_dir=tmp_path)
    first = metrics_credentials(knobs(), ca)  # made and kept
    checks: list[bytes] = []
    real_check = bcrypt.checkpw
    monkeypatch.setattr(bcrypt, "checkpw", lambda password, hashed: checks.append(hashed) or real_check(password, hashed))
    hosts = [metrics_credentials(knobs(), ca) for _ in range(5)]
    assert hosts == [first] * 5 and len(checks) <= 1, checks
    (ca.directory / "metrics.bcrypt").write_text("$2b$10$" + "x" * 53 + "\n")  # a kept hash that does not match
    assert bcrypt.checkpw(first.password.encode(), metrics_credentials(knobs(), ca).password_hash.encode())
    assert metrics_credentials(knobs(), ca).password_hash != "$2b$10$" + "x" * 53


def test_node_exporter_refuses_a_caller_without_the_password_and_answers_prometheus_over_tls(tmp_path: Path) -> None:
    ca = ensure_ca(knobs(), base_dir=tmp_path)
    login = metrics_credentials(knobs(), ca)
    cert = issue(ca, "rig-01", NODE_EXPORTER_SERVICE, host_sans("rig-01", knobs(ssh_hostname="10.9.9.9")), days=30, renew_days=5)
    web = tmp_path / "web"
    web.mkdir()
    (web / "node-exporter.crt").write_bytes(cert.cert.read_bytes())
    (web / "node-exporter.key").write_bytes(cert.key.read_bytes())
    config = web / "node-exporter.yml"
    config.write_text(web_config_text(NODE_EXPORTER_SERVICE, login).replace(WEB_DIR, str(web)))
    checked = subprocess.run([str(debarchive.promtool()), "check", "web-config", str(config)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    port = free_port()
    exporters = replace(rig_exporters(knobs()), web_config_flag="--web.config.file")  # rigup's flags, as the rig runs them
    flags = [a.replace(":9100", f"127.0.0.1:{port}").replace(WEB_DIR, str(web)).replace("/var/lib/prometheus/node-exporter", str(tmp_path))
             for a in exporters.node_exporter_args.split()]
    assert f"--web.config.file={web}/node-exporter.yml" in flags
    proc = subprocess.Popen([str(debarchive.node_exporter()), *[f for f in flags if not f.startswith("--collector.systemd")]],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        trusting = ssl.create_default_context(cafile=str(ca.cert))
        url = f"https://127.0.0.1:{port}/metrics"
        for _ in range(50):
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.1)
        assert get(url, trusting) == 401
        assert get(url, trusting, (METRICS_USER, "wrong")) == 401
        assert get(url, trusting, (METRICS_USER, login.password)) == 200
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):  # not the fleet's CA: refused
            get(url, ssl.create_default_context(), (METRICS_USER, login.password))
        assert get(f"http://127.0.0.1:{port}/metrics") == 400  # plain HTTP is not served
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_the_flag_follows_the_release_and_prometheus_scrapes_the_nodes_with_files_only() -> None:
    assert node_exporter_web_flag("ubuntu", "22.04") == "--web.config"  # node_exporter 1.3.1
    assert node_exporter_web_flag("ubuntu", "24.04") == "--web.config.file"  # 1.7.0
    assert node_exporter_web_flag("debian", "12") == "--web.config.file"  # the test bed's 1.5.0
    assert scrape_auth() == {
        "scheme": "https",
        "basic_auth": {"username": METRICS_USER, "password_file": PASSWORD_FILE},
        "tls_config": {"ca_file": CA_FILE},
    }
    assert "--web.config" not in rig_exporters(knobs()).node_exporter_args  # no flag: no web config


def _serve(argv: list[str], port: int) -> subprocess.Popen[str]:
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for _ in range(100):
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return proc
        time.sleep(0.1)
    proc.terminate()
    raise AssertionError(f"{argv[0]} did not listen on {port}")


def _web_files(tmp_path: Path, ca, login, service: str) -> Path:
    """`service`'s certificate, key and web config as the monitor host has them, under tmp_path/web."""
    web = tmp_path / "web"
    web.mkdir(exist_ok=True)
    cert = issue(ca, "gw", service, host_sans("gw", knobs(ssh_hostname="10.9.9.5")), days=30, renew_days=5)
    (web / f"{service}.crt").write_bytes(cert.cert.read_bytes())
    (web / f"{service}.key").write_bytes(cert.key.read_bytes())
    (web / f"{service}.yml").write_text(web_config_text(service, login).replace(WEB_DIR, str(web)))
    return web


def test_prometheus_asks_who_is_calling_and_rigup_top_logs_in(tmp_path: Path) -> None:
    """Debian's Prometheus under rigup's flags and web config: a caller without the password gets 401; the client
    `rigup top` reads with (query_prometheus with prometheus_login: the control machine's password and CA
    certificate) gets its answers over TLS. (Debian's Alertmanager reads its templates from /usr/share: it runs
    under rigup's flags on the bed, tests/e2e/test_monitoring.py.)"""
    ca = ensure_ca(knobs(), base_dir=tmp_path)
    login = metrics_credentials(knobs(), ca)
    top_login = prometheus_login(knobs(), base_dir=tmp_path)
    assert isinstance(top_login, PrometheusLogin) and top_login.auth == (METRICS_USER, login.password)
    assert top_login.ca_file == str(ca.cert) and login.password not in repr(top_login)
    web = _web_files(tmp_path, ca, login, PROMETHEUS_SERVICE)
    port = free_port()
    (tmp_path / "prometheus.yml").write_text("global: {scrape_interval: 1m}\n")
    plan = MonitorPlan(host="gw", listen_address=f"127.0.0.1:{port}", retention="1d", scrape_interval_s=60, rigs=(),
                       gateways=(), alertmanager_port=None, rules_text="")
    flags = [a.replace(WEB_DIR, str(web)) for a in plan.defaults_text().split("ARGS='")[1].rstrip("'\n").split()]
    prometheus = _serve([str(debarchive.prometheus()), *flags, f"--config.file={tmp_path / 'prometheus.yml'}",
                         f"--storage.tsdb.path={tmp_path / 'tsdb'}"], port)
    try:
        trusting = ssl.create_default_context(cafile=str(ca.cert))
        for url in (f"https://127.0.0.1:{port}/api/v1/query?query=vector(1)", f"https://127.0.0.1:{port}/-/ready"):
            assert get(url, trusting) == 401
            assert get(url, trusting, (METRICS_USER, "wrong")) == 401
            assert get(url, trusting, (METRICS_USER, login.password)) == 200
        with pytest.raises(PrometheusError, match="HTTP 401"):
            query_prometheus(f"https://127.0.0.1:{port}", "vector(1)", time.time(), 5.0,
                             PrometheusLogin(METRICS_USER, "wrong", top_login.ca_file))
        assert query_prometheus(f"https://127.0.0.1:{port}", "vector(7)", time.time(), 5.0, top_login) == [({}, 7.0)]
    finally:
        prometheus.terminate()
        prometheus.wait(timeout=10)
    (tmp_path / "fleet-ca" / "metrics.password").unlink()
    assert "metrics.password" in str(prometheus_login(knobs(), base_dir=tmp_path))  # nothing made: says what is missing
