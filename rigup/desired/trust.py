"""Whom rigup's HTTPS clients trust, and how a certificate nobody trusts is said: in one line.

On a rig, every client rigup runs checks a server against the system's trust store, as apt, git, curl
and Docker's engine do (/etc/ssl/certs/ca-certificates.crt on Debian and Ubuntu, which
update-ca-certificates builds from /usr/local/share/ca-certificates): the model fetcher and the image
mirror (Python's ssl defaults read that store), pip building the entrance's venv (PIP_CERT names the
store: a pip that carries certifi's bundle would trust only the public CAs). A rig behind a company's
TLS-intercepting proxy, or reaching a mirror with a private CA, trusts that CA the way its system does:
installed there by whoever runs the machine. Preflight reads, from the rig, whether it trusts the server
of every https URL the fleet file names for it (rigup.facts.network.HttpsTrust), and fails the host with
one line naming the URL before anything changes (https_trust_check).

On the control machine (`rigup lock`: git ls-remote and fetch, the Hugging Face API, registries), the
clients check against `ca_bundle` when the fleet file sets it (a PEM bundle: every CA they should trust),
else the system's store too: requests and huggingface_hub would otherwise use certifi's bundle, which a
private CA is never in (control_ca_bundle).
"""

from __future__ import annotations

import os
import ssl
import urllib.parse
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from rigup.desired.knobs import URL_KNOBS, knob, load_defaults
from rigup.parsers.curl import TlsProbe

# The system bundle on Debian/Ubuntu (what update-ca-certificates writes), then other distributions'.
SYSTEM_BUNDLES = ("/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt", "/etc/ssl/cert.pem")
RIG_CA_BUNDLE = SYSTEM_BUNDLES[0]  # the rigs run Ubuntu: the store apt, git, curl and Docker read
TRUST_FIX = ("install the CA that issued it in the host's trust store (/usr/local/share/ca-certificates/<name>.crt, "
             "then update-ca-certificates), or point the URL at a server the host trusts")


class TrustError(RuntimeError):
    """ca_bundle cannot be used: one line naming the knob and the file."""


def origin_of(url: str) -> str | None:
    """scheme://host[:port] of an https URL (what a TLS handshake is made with); None for any other URL."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "https" or not parts.hostname:
        return None
    return f"https://{parts.netloc.rsplit('@', 1)[-1]}"


def registry_origin(container_registry: str, insecure: Iterable[str]) -> str | None:
    """The https origin Docker pulls `container_registry` from; None when it is told to use plain HTTP.
    docker.io is Docker Hub's registry-1.docker.io."""
    host = container_registry.split("://", 1)[-1].rstrip("/").split("/", 1)[0]
    if host in ("docker.io", "index.docker.io"):
        host = "registry-1.docker.io"
    if host in set(insecure) or host.split(":")[0] in ("localhost", "127.0.0.1"):
        return None
    return f"https://{host}"


def https_urls(host_data: Mapping[str, Any], gateway: bool = False) -> dict[str, str]:
    """{knob: URL} of every https place the fleet file names for this host: the apt repositories and their
    keys, the Hugging Face endpoint, the git remotes, the registry (host:port: https unless Docker is told
    it is insecure) and, for an entrance host, its pip index; Grafana's repository (and vLLM's, for its
    dashboards) only with grafana on. A gateway-only host (`gateway`) reaches only its pip index."""
    names = ["gateway_pip_index_url"] if gateway else [
        *(n for n in URL_KNOBS if not n.startswith("grafana_") or knob(host_data, "grafana")),
        *(n for n in load_defaults() if n.endswith("_git_url") and (n != "vllm_git_url" or knob(host_data, "grafana"))),
    ]
    out: dict[str, str] = {}
    for name in names:
        value = knob(host_data, name)
        if isinstance(value, str) and origin_of(value) is not None:
            out[name] = value
    if not gateway:
        registry = str(knob(host_data, "container_registry"))
        insecure = {str(r).split("://", 1)[-1].rstrip("/") for r in knob(host_data, "docker_insecure_registries") or ()}
        origin = registry_origin(registry, insecure)
        if origin is not None:
            out["container_registry"] = origin
    return out


def origins(urls: Mapping[str, str]) -> list[str]:
    """The distinct origins of `urls` (https_urls), in order: one handshake each."""
    return list(dict.fromkeys(o for o in map(origin_of, urls.values()) if o is not None))


def untrusted_line(urls: Mapping[str, str], probes: Mapping[str, TlsProbe]) -> tuple[str, str] | None:
    """(knob, message) when the host does not trust a server it will reach: the first such URL with its knob,
    how many more, and curl's reason; None when every server it reached was trusted."""
    bad = [(name, url, probes[o]) for name, url in urls.items() if (o := origin_of(url)) in probes and probes[o].untrusted]
    if not bad:
        return None
    name, url, probe = bad[0]
    more = f" (and {len(bad) - 1} more: {', '.join(n for n, _, _ in bad[1:])})" if len(bad) > 1 else ""
    reason = f": {probe.reason}" if probe.reason else ""
    return name, f"{url} ({name}){more}: the server's certificate is not trusted by this host (curl exit {probe.status}{reason})"


# --- the control machine ------------------------------------------------------------------------


def system_ca_bundle() -> str | None:
    """The control machine's system trust store as one PEM file: OpenSSL's default CA file when it is there,
    else the first of SYSTEM_BUNDLES that is; None when there is none (the clients' own defaults then)."""
    default = ssl.get_default_verify_paths()
    for path in (os.environ.get("SSL_CERT_FILE"), default.cafile, default.openssl_cafile, *SYSTEM_BUNDLES):
        if path and os.path.isfile(path):
            return path
    return None


def control_ca_bundle(ca_bundle: str | None, base_dir: Path | None = None) -> str | None:
    """The PEM bundle the control machine's clients check HTTPS servers against: `ca_bundle` (relative: to the
    fleet file's directory, `base_dir`), which must be a readable file; else the system's (system_ca_bundle)."""
    if ca_bundle is None:
        return system_ca_bundle()
    path = Path(str(ca_bundle)).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    if not path.is_file() or not os.access(path, os.R_OK):
        raise TrustError(f"ca_bundle: {path} is not a readable file (a PEM bundle of the CAs the control machine's clients trust)")
    return str(path)


def fleet_ca_bundle(values: Iterable[Any], base_dir: Path | None = None, system: bool = True) -> str | None:
    """control_ca_bundle of the one ca_bundle the fleet's hosts name; none named: the system's store (with
    `system`), else None."""
    named = {v for v in values if v is not None}
    if len(named) > 1:
        raise TrustError(f"hosts name different ca_bundle values ({sorted(map(str, named))}); the control machine uses one")
    if not named and not system:
        return None
    return control_ca_bundle(named.pop() if named else None, base_dir)


# The fleet file's ca_bundle as a path (None: not set), once rigup.desired.fleet.load_fleet read it: what the
# control machine's clients that no host's data reaches (the upstream git cache) check against.
_FLEET_BUNDLE: list[str | None] = [None]


def use_fleet_bundle(bundle: str | None) -> None:
    _FLEET_BUNDLE[0] = bundle


def fleet_bundle() -> str | None:
    """The loaded fleet file's ca_bundle (a readable path), or None."""
    return _FLEET_BUNDLE[0]


def client_environment(bundle: str | None) -> dict[str, str]:
    """What a client child process on the control machine (git) is given to check HTTPS against `bundle`."""
    return {"GIT_SSL_CAINFO": bundle, "SSL_CERT_FILE": bundle} if bundle else {}


# How each client says the certificate failed: Python's ssl (requests, httpx, urllib), curl with OpenSSL
# (git's https), git with GnuTLS (Debian's git-remote-https).
_MARKERS = ("certificate verify failed:", "SSL certificate problem:", "server certificate verification failed")


def _reason(text: str) -> str | None:
    for marker in _MARKERS:
        if marker in text:
            after = text.split(marker, 1)[1] if marker.endswith(":") else marker + text.split(marker, 1)[1]
            line = after.strip().splitlines()[0] if after.strip() else marker.rstrip(":")
            return line.split(" (_ssl.c")[0].rstrip(")'\" ").strip() or marker.rstrip(":")
    return None


def certificate_problem(exc: BaseException) -> str | None:
    """Why the server's certificate was refused, when `exc` (a requests, httpx, urllib, ssl or git error, or
    one raised from such) failed on it; None for any other failure."""
    seen: set[int] = set()
    stack: list[Any] = [exc]
    while stack:
        current = stack.pop()
        if not isinstance(current, BaseException) or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, ssl.SSLCertVerificationError):
            return getattr(current, "verify_message", None) or _reason(str(current)) or "certificate verify failed"
        reason = _reason(" ".join(str(part) for part in (current, getattr(current, "stderr", "") or "")))
        if reason is not None:
            return reason
        stack += [current.__cause__, current.__context__, getattr(current, "reason", None), *getattr(current, "args", ())]
    return None


def untrusted_message(url: str, problem: str, bundle: str | None) -> str:
    """One line for a control machine's client that did not trust `url`'s certificate."""
    against = f"ca_bundle {bundle}" if bundle else "the system's trust store"
    return (f"{url}: the server's certificate is not trusted ({problem}); checked against {against}: add the CA that "
            "issued it to the system's store or name a bundle holding it in ca_bundle")
