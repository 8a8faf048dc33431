"""The test bed's certificate authority: the hub speaks HTTPS, as the world the rigs stand in for does.

    ca = ensure_bed_ca()                                   # made once on this machine (cache_dir()/tls)
    cert, key = issue_server_cert(ca, hub_dir / "tls", ["10.213.0.1", "127.0.0.1"])
    context = server_context(cert, key)                    # what every hub service wraps its socket in

The CA is one per machine (kept under the test bed's cache, 0700, its key 0600, made with openssl as rigup
makes its fleet CA: rigup.desired.fleet_ca), so the overlay layer that installs it into the rigs' trust
store (rigup_testbed/image.py ensure_layer) is built once and shared by every bed, as the other cached
layers are. Each bed's hub gets its own server certificate for the addresses it serves on (the hub's
address in that bed's subnet), issued when the hub starts (~30 ms). The rigs trust the CA the way an Ubuntu
box trusts one: /usr/local/share/ca-certificates/rigup-testbed-ca.crt and update-ca-certificates, which puts
it in /etc/ssl/certs/ca-certificates.crt, the bundle apt, git, curl, Python's ssl module and Docker's
engine read. The control machine does not: a test's fleet file names the CA as `ca_bundle`, rigup's knob for
a CA the control machine's clients check against (a company's TLS-intercepting proxy is the real case).

Another CA (`ensure_bed_ca(name="other")`) issues certificates no rig trusts, for tests of the failure.
Secrets: keys are written by openssl into files created 0600 beforehand, never in argv or on stdout.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import ssl
from dataclasses import dataclass
from pathlib import Path

from rigup.desired.fleet_ca import KEY_ALGORITHM, openssl
from rigup_testbed.image import cache_dir

CA_DAYS = 3650
SERVER_DAYS = 30  # a bed lives for minutes; a server certificate is issued at every hub start


@dataclass(frozen=True)
class BedCA:
    cert: Path
    key: Path

    @property
    def pem(self) -> bytes:
        return self.cert.read_bytes()


@dataclass(frozen=True)
class ServerCert:
    cert: Path
    key: Path
    names: tuple[str, ...]


def _private_file(path: Path) -> None:
    path.unlink(missing_ok=True)
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))


def ensure_bed_ca(name: str = "bed", root: Path | None = None) -> BedCA:
    """The machine's test-bed CA `name` under root (default cache_dir()/tls), made on first use."""
    directory = (root if root is not None else cache_dir() / "tls") / name
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    ca = BedCA(directory / "ca.crt", directory / "ca.key")
    with open(directory / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if ca.cert.is_file() and ca.key.is_file():
            return ca
        tmp_key, tmp_cert = directory / "ca.key.tmp", directory / "ca.crt.tmp"
        _private_file(tmp_key)
        openssl("genpkey", *KEY_ALGORITHM, "-out", tmp_key)
        openssl("req", "-x509", "-new", "-key", tmp_key, "-sha256", "-days", str(CA_DAYS),
                "-subj", f"/CN=rigup test-bed CA ({name})",
                "-addext", "basicConstraints=critical,CA:TRUE,pathlen:0",
                "-addext", "keyUsage=critical,keyCertSign,cRLSign",
                "-addext", "subjectKeyIdentifier=hash",
                "-out", tmp_cert)  # fmt: skip
        os.chmod(tmp_cert, 0o644)
        os.replace(tmp_key, ca.key)
        os.replace(tmp_cert, ca.cert)
    return ca


def san_entries(names: list[str] | tuple[str, ...]) -> str:
    """subjectAltName's value for `names`: IP:<address> for addresses, DNS:<name> for the rest."""
    out = []
    for name in names:
        try:
            ipaddress.ip_address(name)
            out.append(f"IP:{name}")
        except ValueError:
            out.append(f"DNS:{name}")
    return ",".join(out)


def issue_server_cert(ca: BedCA, directory: Path, names: list[str] | tuple[str, ...]) -> ServerCert:
    """A serverAuth certificate signed by `ca` for `names` (addresses or DNS names), written into
    `directory` as server.crt (0644) and server.key (0600)."""
    if not names:
        raise ValueError("a server certificate needs at least one name")
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    key, csr, cert = directory / "server.key", directory / "server.csr", directory / "server.crt"
    ext = directory / "server.ext"
    _private_file(key)
    openssl("genpkey", *KEY_ALGORITHM, "-out", key)
    openssl("req", "-new", "-key", key, "-subj", f"/CN={names[0]}", "-out", csr)
    ext.write_text(f"subjectAltName={san_entries(names)}\n"
                   "basicConstraints=critical,CA:FALSE\n"
                   "keyUsage=critical,digitalSignature\n"
                   "extendedKeyUsage=serverAuth\n")
    openssl("x509", "-req", "-in", csr, "-CA", ca.cert, "-CAkey", ca.key, "-CAcreateserial",
            "-days", str(SERVER_DAYS), "-sha256", "-extfile", ext, "-out", cert)  # fmt: skip
    csr.unlink()
    ext.unlink()
    os.chmod(cert, 0o644)
    return ServerCert(cert, key, tuple(names))


def server_context(cert: Path | str, key: Path | str) -> ssl.SSLContext:
    """What a hub service wraps its listening socket in (TLS 1.2 or later, Python's defaults otherwise)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(str(cert), str(key))
    return context


def client_context(ca: BedCA | Path | str) -> ssl.SSLContext:
    """A client context that trusts only the bed's CA (the control machine's side of the hub's services)."""
    return ssl.create_default_context(cafile=str(ca.cert if isinstance(ca, BedCA) else ca))
