"""rigup_testbed/tls.py and the hub's HTTPS: the bed's CA made once, a server certificate for the hub's
address, every hub service started with it, and its clients checking it."""

from __future__ import annotations

import ssl
import subprocess
import sys
import types
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from rigup_testbed import hubserve
from rigup_testbed.hub import Hub
from rigup_testbed.registry import config_text
from rigup_testbed.tls import ensure_bed_ca, issue_server_cert, san_entries


def test_the_ca_is_made_once_and_issues_server_certificates_for_addresses(tmp_path: Path) -> None:
    ca = ensure_bed_ca("bed", tmp_path)
    pem = ca.pem
    assert ensure_bed_ca("bed", tmp_path).pem == pem  # kept: the rigs' trust layer is cached by it
    assert (ca.key.stat().st_mode & 0o777) == 0o600 and (ca.key.parent.stat().st_mode & 0o777) == 0o700
    assert ensure_bed_ca("other", tmp_path).pem != pem
    assert san_entries(["10.213.0.1", "hub.bed", "::1"]) == "IP:10.213.0.1,DNS:hub.bed,IP:::1"
    cert = issue_server_cert(ca, tmp_path / "srv", ["10.213.0.1"])
    assert (cert.key.stat().st_mode & 0o777) == 0o600
    text = subprocess.run(["openssl", "x509", "-in", str(cert.cert), "-noout", "-text"], capture_output=True, text=True,
                          check=True).stdout
    assert "IP Address:10.213.0.1" in text and "TLS Web Server Authentication" in text and "CA:FALSE" in text
    subprocess.run(["openssl", "verify", "-CAfile", str(ca.cert), str(cert.cert)], check=True, capture_output=True)
    with pytest.raises(ValueError):
        issue_server_cert(ca, tmp_path / "none", [])


def test_every_hub_service_starts_with_the_certificate(tmp_path: Path) -> None:
    hub = Hub(tmp_path, "10.213.0.1")
    hub.repo_info = types.SimpleNamespace(root=tmp_path / "apt", urls=lambda url: {}, engine_urls=lambda url: {})
    hub.pypi_root = tmp_path / "pypi"
    assert all("--tls-cert" not in svc.args for svc in hub._plan())  # before start(): no certificate yet
    hub.ca = ensure_bed_ca("bed", tmp_path / "tls")
    hub.server_cert = issue_server_cert(hub.ca, tmp_path / "srv", ["10.213.0.1"])
    plan = {svc.name: svc for svc in hub._plan()}
    assert set(plan) == {"apt", "registry", "engine-registry", "hf", "git", "pypi"}
    for svc in plan.values():
        args = dict(zip(svc.args, svc.args[1:]))
        assert args["--tls-cert"] == str(hub.server_cert.cert) and args["--tls-key"] == str(hub.server_cert.key), svc.name
    assert "--tls-ca" in plan["engine-registry"].args  # it pushes the bed's images to itself, checking the certificate
    assert hub.trusted_cas() == [hub.ca.pem] and hub.ca_cert == hub.ca.cert
    assert Hub(tmp_path / "plain", "10.213.0.1", tls=False).trusted_cas() == []
    # distribution's own TLS
    assert config_text(tmp_path / "data", "10.213.0.1", 5001, (Path("/c.crt"), Path("/k.key"))).endswith(
        "http:\n  addr: 10.213.0.1:5001\n  tls:\n    certificate: /c.crt\n    key: /k.key\n")


def test_the_static_server_speaks_https_checked_against_the_beds_ca(tmp_path: Path) -> None:
    ca = ensure_bed_ca("bed", tmp_path / "tls")
    other = ensure_bed_ca("other", tmp_path / "tls")
    cert = issue_server_cert(ca, tmp_path / "srv", ["127.0.0.1"])
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "InRelease").write_text("signed\n")
    ready = tmp_path / "ready.json"
    proc = subprocess.Popen([sys.executable, "-m", "rigup_testbed.hubserve", "static", "--root", str(tmp_path / "root"),
                             "--bind", "127.0.0.1", "--port", "0", "--ready-file", str(ready),
                             "--tls-cert", str(cert.cert), "--tls-key", str(cert.key)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        assert url.startswith("https://127.0.0.1:")
        with urllib.request.urlopen(f"{url}/InRelease", timeout=10, context=ssl.create_default_context(cafile=str(ca.cert))) as reply:
            assert reply.read() == b"signed\n"
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            urllib.request.urlopen(f"{url}/InRelease", timeout=10, context=ssl.create_default_context(cafile=str(other.cert)))
    finally:
        proc.terminate()
        proc.wait(10)
    with pytest.raises(SystemExit, match="go together"):
        hubserve.main(["static", "--root", str(tmp_path), "--ready-file", str(ready), "--tls-cert", str(cert.cert)])
