"""The fleet CA: one certificate authority on the control machine, issuing each host's service certificates.

Where it lives: fleet_ca_dir (default `fleet-ca`, relative to the fleet file's directory as lock_file is),
a 0700 directory holding ca.key (0600) and ca.crt, made with openssl on first use, and a `.gitignore` of
`*` (the fleet file's directory is often a git checkout: the CA's key must never be committed). Or the
user's own CA: fleet_ca_cert_file and fleet_ca_key_file (a 0600 file; fleet_ca_key_passphrase_file, a
0600 file, when the key is encrypted: openssl reads it with `-passin file:`).

What it issues: issue(ca, host, service, sans) -> Issued, a certificate for one service on one host
(serverAuth and clientAuth, the host's names and addresses as its SANs), kept under
issued/<host>/<service>.crt and .key (0600) with a record (.json) of what was asked. A converge calls
issue() for every certificate it puts on a host: the one on file is reused while it names the same SANs,
was issued by the CA in use and has more than fleet_cert_renew_days left; otherwise a new key and
certificate replace it (renewal before expiry is part of the converge). Reuse reads only the record and
the files' bytes, so a converged re-run starts no openssl at all.

Secrets: every private key is written by openssl into a file created 0600 beforehand (never on stdout,
never in argv); keys and passphrases are passed to openssl as file paths only.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import ipaddress
import json
import os
import re
import secrets
import ssl
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rigup.desired.knobs import knob
from rigup.desired.lock import fleet_dir
from rigup.desired.secrets import SecretError, check_private_file

CA_CERT_NAME = "ca.crt"
CA_KEY_NAME = "ca.key"
ISSUED_DIR = "issued"
CA_DAYS = 3650  # rigup's own CA: ten years; `rigup doctor` shows what is left
CA_SUBJECT = "/CN=rigup fleet CA"
KEY_ALGORITHM = ("-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256")  # Go's TLS (Prometheus) and nginx take P-256
SERVICE_NAME = re.compile(r"[a-z0-9][a-z0-9-]*")
DAY_S = 86400


class FleetCAError(RuntimeError):
    """The fleet CA cannot be used or cannot issue: one line naming the file or knob and what to do."""


@dataclass(frozen=True)
class FleetCA:
    """The CA in use: its certificate and key files, and the passphrase file of the key (the user's, if any)."""

    directory: Path  # where issued certificates are kept (and rigup's own CA)
    cert: Path
    key: Path
    passphrase_file: Path | None = None
    own: bool = False  # the user's CA (fleet_ca_cert_file), not rigup's

    @property
    def cert_pem(self) -> str:
        """The CA's certificate (public): what a client needs to trust the fleet's services."""
        return self.cert.read_text()

    def fingerprint(self) -> str:
        return hashlib.sha256(self.cert.read_bytes()).hexdigest()


@dataclass(frozen=True)
class Issued:
    """One service's certificate and key on the control machine (the key file is 0600)."""

    cert: Path
    key: Path
    not_after: float  # seconds since the epoch
    renewed: bool  # issued by this call (False: the one on file was still good)

    def days_left(self, now: float | None = None) -> float:
        return (self.not_after - (time.time() if now is None else now)) / DAY_S


# one CA operation at a time in this process (pyinfra plans hosts in greenlets: threading's lock is then
# gevent's), and across processes (two converges of one fleet) an flock on the CA's directory
_PROCESS_LOCK = threading.Lock()


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    with _PROCESS_LOCK:
        fd = os.open(directory / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)


def openssl(*args: str | os.PathLike[str]) -> str:
    """Run openssl with `args` (paths, options: never a key or a passphrase) and return its stdout."""
    argv = ["openssl", *map(str, args)]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
    except FileNotFoundError:
        raise FleetCAError("openssl is not installed on the control machine (the fleet CA needs it: apt install openssl)") from None
    if done.returncode != 0:
        error = " ".join(done.stderr.split())[:300]
        raise FleetCAError(f"openssl {args[0]} failed (exit {done.returncode}): {error}")
    return done.stdout


def _private_file(path: Path) -> None:
    """Create `path` empty with mode 0600 before openssl writes a key into it (openssl keeps the mode)."""
    path.unlink(missing_ok=True)
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))


def _new_key(path: Path) -> None:
    _private_file(path)
    openssl("genpkey", *KEY_ALGORITHM, "-out", path)


def _require_private(path: Path, name: str) -> None:
    """A key or passphrase file must be a regular file that group and others cannot read."""
    try:
        check_private_file(path, name)
    except SecretError as exc:
        raise FleetCAError(str(exc)) from None


def ca_directory(host_data: Mapping[str, Any], base_dir: Path | None = None) -> Path:
    """fleet_ca_dir as a path: absolute, or relative to `base_dir` (default: the fleet file's directory)."""
    path = Path(str(knob(host_data, "fleet_ca_dir"))).expanduser()
    return path if path.is_absolute() else (base_dir if base_dir is not None else fleet_dir()) / path


def make_ca_directory(directory: Path) -> None:
    """fleet_ca_dir made 0700 with a .gitignore of * (what rigup keeps there is private: keys, passwords, tokens)."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    if stat.S_IMODE(directory.stat().st_mode) != 0o700:
        os.chmod(directory, 0o700)
    ignore = directory / ".gitignore"
    if not ignore.exists():  # the CA's key must never be committed with the fleet file beside it
        ignore.write_text("# rigup's fleet CA: private keys, never committed\n*\n")


def ensure_ca(host_data: Mapping[str, Any], base_dir: Path | None = None) -> FleetCA:
    """The fleet's CA from the knobs: the user's (fleet_ca_cert_file, fleet_ca_key_file), checked; else rigup's
    own in fleet_ca_dir, made now if it is not there yet."""
    directory = ca_directory(host_data, base_dir)
    own_cert, own_key = knob(host_data, "fleet_ca_cert_file"), knob(host_data, "fleet_ca_key_file")
    passphrase = knob(host_data, "fleet_ca_key_passphrase_file")
    if (own_cert is None) != (own_key is None):
        missing = "fleet_ca_key_file" if own_key is None else "fleet_ca_cert_file"
        raise FleetCAError(f"{missing}: not set; your own CA needs both fleet_ca_cert_file and fleet_ca_key_file (or neither: rigup's CA in fleet_ca_dir)")
    make_ca_directory(directory)
    if own_cert is not None:
        cert, key = Path(str(own_cert)).expanduser(), Path(str(own_key)).expanduser()
        if not cert.is_file():
            raise FleetCAError(f"fleet_ca_cert_file: {cert} does not exist")
        _require_private(key, "fleet_ca_key_file")
        pass_file = Path(str(passphrase)).expanduser() if passphrase is not None else None
        if pass_file is not None:
            _require_private(pass_file, "fleet_ca_key_passphrase_file")
        return FleetCA(directory, cert, key, pass_file, own=True)
    if passphrase is not None:
        raise FleetCAError("fleet_ca_key_passphrase_file: set without fleet_ca_key_file (rigup's own CA key has no passphrase)")
    ca = FleetCA(directory, directory / CA_CERT_NAME, directory / CA_KEY_NAME)
    with _locked(directory):
        if ca.cert.is_file() and ca.key.is_file():
            _require_private(ca.key, f"the fleet CA's key ({CA_KEY_NAME} in fleet_ca_dir)")
            return ca
        if ca.cert.exists() != ca.key.exists():
            present = ca.cert if ca.cert.exists() else ca.key
            raise FleetCAError(f"fleet_ca_dir: {present} is there without its pair; restore it, or remove it for a new CA "
                               "(every certificate is then issued again at the next converge)")
        _new_key(ca.key)
        openssl("req", "-x509", "-new", "-key", ca.key, "-sha256", "-days", str(CA_DAYS), "-subj", CA_SUBJECT,
                "-addext", "basicConstraints=critical,CA:TRUE,pathlen:0",
                "-addext", "keyUsage=critical,keyCertSign,cRLSign",
                "-addext", "subjectKeyIdentifier=hash",
                "-out", ca.cert)
        os.chmod(ca.cert, 0o644)
    return ca


def host_sans(name: str, data: Mapping[str, Any], local: bool = True) -> list[str]:
    """The SANs of a service on host `name`: its inventory name (unless it is a pyinfra connector's, such as
    '@local', which no client dials), its ssh_hostname and model_fleet_address (how the fleet reaches it),
    and with `local` localhost and 127.0.0.1 (the host's own checks)."""
    names = [name if not name.startswith("@") else None, data.get("ssh_hostname"), knob(data, "model_fleet_address")]
    if local:
        names += ["localhost", "127.0.0.1"]
    return sans_of(str(n) for n in names if n)


def sans_of(names: Iterable[str]) -> list[str]:
    """`names` as openssl's subjectAltName entries (IP:... for addresses, DNS:... for names), each once."""
    out: list[str] = []
    for value in names:
        try:
            entry = f"IP:{ipaddress.ip_address(value)}"
        except ValueError:
            if not re.fullmatch(r"[A-Za-z0-9*]([A-Za-z0-9.*-]*[A-Za-z0-9])?", value):
                raise FleetCAError(f"{value!r} cannot be a certificate's name: a DNS name (letters, digits, '-', '.') or an IP address") from None
            entry = f"DNS:{value.lower()}"
        if entry not in out:
            out.append(entry)
    return out


def certificate_names(cert: Path | str) -> list[str]:
    """The DNS names and IP addresses a certificate's subjectAltName holds (the first certificate of a PEM
    file), in its order; [] when it has none."""
    text = openssl("x509", "-in", Path(cert).expanduser(), "-noout", "-ext", "subjectAltName")
    names = []
    for entry in text.partition("Subject Alternative Name:")[2].split(","):
        kind, _, value = entry.strip().partition(":")
        if kind in ("DNS", "IP Address") and value:
            names.append(value.strip())
    return names


def not_after(cert: Path) -> float:
    """When `cert` expires, in seconds since the epoch (openssl's notAfter)."""
    line = openssl("x509", "-in", cert, "-noout", "-enddate").strip()
    return float(ssl.cert_time_to_seconds(line.partition("=")[2]))


def _record_of(crt: Path) -> Path:
    return crt.with_suffix(".json")


def _still_good(ca: FleetCA, crt: Path, key: Path, sans: list[str], renew_days: float) -> float | None:
    """notAfter of the certificate on file when it can be kept: its record names these SANs and this CA,
    its bytes are what was recorded, its key is there (0600) and more than renew_days are left; else None."""
    try:
        record = json.loads(_record_of(crt).read_text())
        same = (record.get("sans") == sans and record.get("ca") == ca.fingerprint()
                and record.get("sha256") == hashlib.sha256(crt.read_bytes()).hexdigest())
        key_ok = key.is_file() and not key.stat().st_mode & 0o077
    except (OSError, ValueError):
        return None
    expires = float(record.get("not_after", 0))
    return expires if same and key_ok and expires - time.time() > renew_days * DAY_S else None


def issue(ca: FleetCA, host: str, service: str, sans: list[str], days: int, renew_days: float) -> Issued:
    """The certificate of `service` on `host` with exactly `sans` (sans_of / host_sans), valid `days`:
    the one on file while still good (see the module's docstring), else a new key and certificate."""
    if not SERVICE_NAME.fullmatch(service):
        raise FleetCAError(f"service {service!r}: lowercase letters, digits and '-' only")
    if not sans:
        raise FleetCAError(f"{host}/{service}: a certificate needs at least one name")
    if renew_days >= days:
        raise FleetCAError(f"fleet_cert_renew_days ({renew_days}) must be below fleet_cert_days ({days}): every converge would issue again")
    folder = ca.directory / ISSUED_DIR / host
    crt, key = folder / f"{service}.crt", folder / f"{service}.key"
    with _locked(ca.directory):
        expires = _still_good(ca, crt, key, sans, renew_days)
        if expires is not None:
            return Issued(crt, key, expires, renewed=False)
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder, prefix=".issue-") as work_dir:
            work = Path(work_dir)
            new_key, csr, new_crt, extensions = work / "key", work / "csr", work / "crt", work / "ext.cnf"
            _new_key(new_key)
            cn = f"{service}.{host}".replace("/", "_").replace("\\", "_")[:64]
            openssl("req", "-new", "-key", new_key, "-subj", f"/CN={cn}", "-out", csr)
            extensions.write_text(
                "[v3]\n"
                "basicConstraints = critical,CA:FALSE\n"
                "keyUsage = critical,digitalSignature,keyEncipherment\n"
                "extendedKeyUsage = serverAuth,clientAuth\n"
                f"subjectAltName = {','.join(sans)}\n"
                "subjectKeyIdentifier = hash\n"
                "authorityKeyIdentifier = keyid,issuer\n"
            )
            passin = ("-passin", f"file:{ca.passphrase_file}") if ca.passphrase_file is not None else ()
            openssl("x509", "-req", "-in", csr, "-CA", ca.cert, "-CAkey", ca.key, *passin,
                    "-set_serial", f"0x{secrets.token_hex(16)}", "-days", str(days), "-sha256",
                    "-extfile", extensions, "-extensions", "v3", "-out", new_crt)
            expires = not_after(new_crt)
            os.replace(new_key, key)
            os.replace(new_crt, crt)
        os.chmod(crt, 0o644)
        _record_of(crt).write_text(json.dumps({
            "sans": sans, "ca": ca.fingerprint(), "sha256": hashlib.sha256(crt.read_bytes()).hexdigest(),
            "not_after": expires, "issued": time.time(),
        }, indent=1) + "\n")
    return Issued(crt, key, expires, renewed=True)


def issued_certificates(ca: FleetCA) -> list[tuple[str, str, float]]:
    """(host, service, notAfter) of every certificate on file, from their records (for `rigup doctor`)."""
    out = []
    for record in sorted((ca.directory / ISSUED_DIR).glob("*/*.json")):
        try:
            expires = float(json.loads(record.read_text())["not_after"])
        except (OSError, ValueError, KeyError):
            continue
        out.append((record.parent.name, record.stem, expires))
    return out


@dataclass(frozen=True)
class CertificateAge:
    """One certificate `rigup doctor` reports: what it is, its file, and its days to expiry (None: not made yet)."""

    what: str  # "CA" or "<host>/<service>"
    path: Path
    days_left: float | None


def ca_cert_path(host_data: Mapping[str, Any], base_dir: Path | None = None) -> Path:
    """Where the CA's certificate is on the control machine (the user's fleet_ca_cert_file, else rigup's in
    fleet_ca_dir): what a client of the fleet's services trusts. Nothing is made."""
    own = knob(host_data, "fleet_ca_cert_file")
    return Path(str(own)).expanduser() if own is not None else ca_directory(host_data, base_dir) / CA_CERT_NAME


def ca_report(host_data: Mapping[str, Any], base_dir: Path | None = None) -> list[CertificateAge]:
    """The CA's days to expiry and every issued certificate's, read-only (nothing is made): the CA first,
    then the issued certificates soonest-expiring first."""
    directory = ca_directory(host_data, base_dir)
    cert = ca_cert_path(host_data, base_dir)
    now = time.time()
    ca_age = CertificateAge("CA", cert, (not_after(cert) - now) / DAY_S if cert.is_file() else None)
    issued = [CertificateAge(f"{host}/{service}", directory / ISSUED_DIR / host / f"{service}.crt", (expires - now) / DAY_S)
              for host, service, expires in issued_certificates(FleetCA(directory, cert, directory / CA_KEY_NAME))]
    return [ca_age, *sorted(issued, key=lambda c: c.days_left or 0.0)]
