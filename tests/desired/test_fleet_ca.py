"""The fleet CA (rigup.desired.fleet_ca) with the real openssl: a CA made once and kept 0600, certificates that
chain to it with the host's names, reused on a re-run without a single openssl call, issued again near
expiry, for other names or under another CA; no key or passphrase ever on openssl's command line."""

from __future__ import annotations

import ssl
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest

from rigup.desired import fleet_ca
from rigup.desired.fleet_ca import (
    FleetCAError,
    certificate_names,
    ensure_ca,
    host_sans,
    issue,
    issued_certificates,
    sans_of,
)
from rigup.desired.knobs import load_defaults


def knobs(tmp_path: Path, **data: Any) -> dict[str, Any]:
    return {**load_defaults(), **data}


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def argv_seen(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """Every command the CA runs, recorded on its way to the real subprocess.run."""
    seen: list[list[str]] = []
    real = subprocess.run

    def recording(argv, *args, **kwargs):
        seen.append(list(argv))
        return real(argv, *args, **kwargs)

    monkeypatch.setattr(fleet_ca.subprocess, "run", recording)
    return seen


def test_rigups_ca_is_made_once_0600_in_a_0700_directory_that_git_ignores(tmp_path: Path, argv_seen) -> None:
    ca = ensure_ca(knobs(tmp_path), base_dir=tmp_path)
    assert ca.directory == tmp_path / "fleet-ca" and not ca.own
    assert mode(ca.directory) == 0o700 and mode(ca.key) == 0o600
    assert (ca.directory / ".gitignore").read_text().splitlines()[-1] == "*"
    text = subprocess.run(["openssl", "x509", "-in", ca.cert, "-noout", "-text"], capture_output=True, text=True, check=True).stdout
    assert "CA:TRUE" in text and "Certificate Sign" in text
    key_bytes, calls = ca.key.read_bytes(), len(argv_seen)
    again = ensure_ca(knobs(tmp_path), base_dir=tmp_path)
    assert again == ca and ca.key.read_bytes() == key_bytes and len(argv_seen) == calls  # kept, nothing run


def test_a_certificate_chains_to_the_ca_with_the_hosts_names_and_serves_tls(tmp_path: Path) -> None:
    ca = ensure_ca(knobs(tmp_path), base_dir=tmp_path)
    sans = host_sans("rig-01", {**load_defaults(), "ssh_hostname": "10.0.0.11"})
    assert sans == ["DNS:rig-01", "IP:10.0.0.11", "DNS:localhost", "IP:127.0.0.1"]
    cert = issue(ca, "rig-01", "node-exporter", sans, days=365, renew_days=30)
    assert cert.renewed and 364 < cert.days_left() <= 365
    assert mode(cert.key) == 0o600 and mode(cert.key.parent) == 0o700
    verified = subprocess.run(["openssl", "verify", "-CAfile", ca.cert, "-verify_hostname", "rig-01",
                               "-verify_ip", "10.0.0.11", cert.cert], capture_output=True, text=True)
    assert verified.returncode == 0, verified.stderr
    wrong_name = subprocess.run(["openssl", "verify", "-CAfile", ca.cert, "-verify_hostname", "rig-02", cert.cert],
                                capture_output=True, text=True)
    assert wrong_name.returncode != 0
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(cert.cert, cert.key)  # the key is the certificate's
    assert issued_certificates(ca) == [("rig-01", "node-exporter", cert.not_after)]
    # the names a certificate carries, as the entrance's readiness wait reads them of a user's certificate
    assert certificate_names(cert.cert) == ["rig-01", "10.0.0.11", "localhost", "127.0.0.1"]
    assert certificate_names(ca.cert) == []  # the CA names no host


def test_a_rerun_reuses_the_certificate_without_running_openssl(tmp_path: Path, argv_seen) -> None:
    ca = ensure_ca(knobs(tmp_path), base_dir=tmp_path)
    first = issue(ca, "rig-01", "prometheus", sans_of(["rig-01"]), days=365, renew_days=30)
    before, calls = first.cert.read_bytes(), len(argv_seen)
    second = issue(ca, "rig-01", "prometheus", sans_of(["rig-01"]), days=365, renew_days=30)
    assert not second.renewed and second.cert.read_bytes() == before and len(argv_seen) == calls


def test_near_expiry_other_names_or_another_ca_issue_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ca = ensure_ca(knobs(tmp_path), base_dir=tmp_path)
    first = issue(ca, "rig-01", "alertmanager", sans_of(["rig-01"]), days=60, renew_days=30)
    serial = first.cert.read_bytes()
    real_time = fleet_ca.time.time
    monkeypatch.setattr(fleet_ca.time, "time", lambda: real_time() + 29 * fleet_ca.DAY_S)  # 31 days left: kept
    assert not issue(ca, "rig-01", "alertmanager", sans_of(["rig-01"]), days=60, renew_days=30).renewed
    monkeypatch.setattr(fleet_ca.time, "time", lambda: real_time() + 31 * fleet_ca.DAY_S)  # 29 days left: renewed
    renewed = issue(ca, "rig-01", "alertmanager", sans_of(["rig-01"]), days=60, renew_days=30)
    assert renewed.renewed and renewed.cert.read_bytes() != serial
    monkeypatch.setattr(fleet_ca.time, "time", real_time)
    assert issue(ca, "rig-01", "alertmanager", sans_of(["rig-01", "10.0.0.5"]), days=60, renew_days=30).renewed
    ca.cert.unlink()
    ca.key.unlink()
    other = ensure_ca(knobs(tmp_path), base_dir=tmp_path)  # a new CA: what the old one issued is issued again
    again = issue(other, "rig-01", "alertmanager", sans_of(["rig-01", "10.0.0.5"]), days=60, renew_days=30)
    assert again.renewed
    assert subprocess.run(["openssl", "verify", "-CAfile", other.cert, again.cert], capture_output=True).returncode == 0


def test_the_users_own_encrypted_ca_issues_with_no_secret_on_a_command_line(tmp_path: Path, argv_seen) -> None:
    own = tmp_path / "own"
    own.mkdir()
    passphrase = own / "pass"
    passphrase.write_text("correct horse battery staple\n")
    passphrase.chmod(0o600)
    key, cert = own / "ca.key", own / "ca.crt"
    subprocess.run(["openssl", "genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-aes256",
                    "-pass", f"file:{passphrase}", "-out", key], check=True, capture_output=True)
    key.chmod(0o600)
    subprocess.run(["openssl", "req", "-x509", "-new", "-key", key, "-passin", f"file:{passphrase}", "-subj", "/CN=own CA",
                    "-days", "30", "-addext", "basicConstraints=critical,CA:TRUE", "-out", cert], check=True, capture_output=True)
    data = knobs(tmp_path, fleet_ca_cert_file=str(cert), fleet_ca_key_file=str(key), fleet_ca_key_passphrase_file=str(passphrase))
    ca = ensure_ca(data, base_dir=tmp_path)
    assert ca.own and ca.cert == cert
    issued = issue(ca, "mon", "prometheus", sans_of(["mon", "192.0.2.7"]), days=20, renew_days=5)
    assert subprocess.run(["openssl", "verify", "-CAfile", cert, issued.cert], capture_output=True).returncode == 0
    secrets = ["correct horse", "PRIVATE KEY", *ca.key.read_text().splitlines()[1:-1], *issued.key.read_text().splitlines()[1:-1]]
    assert argv_seen and all(s not in arg for argv in argv_seen for arg in map(str, argv) for s in secrets)
    assert any("-passin" in argv for argv in argv_seen)  # the passphrase went by file


@pytest.mark.parametrize("data,expected", [
    ({"fleet_ca_cert_file": "/x/ca.crt"}, "fleet_ca_key_file: not set"),
    ({"fleet_ca_key_passphrase_file": "/x/pass"}, "fleet_ca_key_passphrase_file: set without fleet_ca_key_file"),
])
def test_an_incomplete_own_ca_is_one_line_naming_the_knob(tmp_path: Path, data: dict, expected: str) -> None:
    with pytest.raises(FleetCAError, match=expected):
        ensure_ca(knobs(tmp_path, **data), base_dir=tmp_path)


def test_a_ca_key_others_can_read_is_refused(tmp_path: Path) -> None:
    ca = ensure_ca(knobs(tmp_path), base_dir=tmp_path)
    ca.key.chmod(0o644)
    with pytest.raises(FleetCAError, match=r"readable by group or others \(mode 0644\); chmod 600 it"):
        ensure_ca(knobs(tmp_path), base_dir=tmp_path)


def test_a_renewal_window_as_long_as_the_validity_is_refused(tmp_path: Path) -> None:
    ca = ensure_ca(knobs(tmp_path), base_dir=tmp_path)
    with pytest.raises(FleetCAError, match="fleet_cert_renew_days"):
        issue(ca, "rig-01", "prometheus", sans_of(["rig-01"]), days=30, renew_days=30)


def test_a_name_that_cannot_be_in_a_certificate_is_refused() -> None:
    with pytest.raises(FleetCAError, match="cannot be a certificate's name"):
        sans_of(["rig 01"])


def test_a_connector_name_is_left_out_of_the_sans_and_the_addresses_stay() -> None:
    sans = host_sans("@local", {**load_defaults(), "ssh_hostname": "10.0.0.11"})
    assert sans == ["IP:10.0.0.11", "DNS:localhost", "IP:127.0.0.1"]
