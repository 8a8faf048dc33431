"""rigup/desired/trust.py and the https-trust preflight check: which servers a rig must trust, how curl's verdict
and the control machine's clients' certificate failures are said (one line), and `rigup lock` against HTTPS
servers of a private CA: refused in one line with the system's or certifi's store, pinned with ca_bundle."""

from __future__ import annotations

import os
import ssl
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from rigup.checks.preflight import check_https_trust
from rigup.desired.knobs import load_defaults
from rigup.desired.lock import GitNeed, LockError, ModelNeed
from rigup.desired.pins import Resolver, registry_digest
from rigup.desired.trust import (
    TrustError,
    certificate_problem,
    client_environment,
    control_ca_bundle,
    fleet_ca_bundle,
    https_urls,
    origin_of,
    origins,
    registry_origin,
    system_ca_bundle,
    untrusted_line,
    untrusted_message,
    use_fleet_bundle,
)
from rigup.facts.network import HttpsTrust
from rigup.parsers.common import ParseError
from rigup.parsers.curl import TlsProbe, parse_tls_probes
from rigup_testbed import hfhub
from rigup_testbed.gitremotes import GitServer, Remotes, make_remotes
from rigup_testbed.service import BackgroundServer
from rigup_testbed.tls import BedCA, ServerCert, ensure_bed_ca, issue_server_cert
from tests.support.artifacts import QWEN, hub_spec

HUB = "10.213.0.1"
BED = {**load_defaults(), "docker_apt_url": f"https://{HUB}:8080/docker", "docker_apt_key_url": f"https://{HUB}:8080/docker/gpg",
       "nvidia_ctk_apt_url": f"https://{HUB}:8080/ctk", "nvidia_ctk_apt_key_url": f"https://{HUB}:8080/ctk/gpgkey",
       "nvidia_cuda_repo_url": f"https://{HUB}:8080/cuda", "nvidia_cuda_repo_key_url": f"https://{HUB}:8080/cuda/key",
       "hf_endpoint": f"https://{HUB}:8082", "genesis_git_url": f"https://{HUB}:8081/Sandermage/genesis.git",
       "vllm_fork_git_url": f"https://{HUB}:8081/noonghunna/vllm.git", "club3090_git_url": f"https://{HUB}:8081/n/c.git",
       "qwen36_dual_3090_git_url": f"https://{HUB}:8081/n/q.git", "container_registry": f"{HUB}:5001",
       "gateway_pip_index_url": f"https://{HUB}:8083/simple"}  # fmt: skip
CURL_60 = "curl: (60) SSL certificate problem: unable to get local issuer certificate"


# --- which servers, and how curl's verdict is said ----------------------------------------------------


def test_origins_are_the_https_places_the_fleet_file_names_for_the_host() -> None:
    assert origin_of("https://user@mirror.lan:8443/a/b?c") == "https://mirror.lan:8443"
    assert origin_of("http://10.0.0.1/x") is None and origin_of("ftp://x/") is None
    assert registry_origin("docker.io", []) == "https://registry-1.docker.io"
    assert registry_origin("mirror.lan:5000/dockerhub", []) == "https://mirror.lan:5000"
    assert registry_origin("mirror.lan:5000", ["mirror.lan:5000"]) is None  # Docker told: plain HTTP
    assert registry_origin("localhost:5000", []) is None
    urls = https_urls(BED)
    assert "grafana_apt_url" not in urls and "vllm_git_url" not in urls  # grafana off: never reached
    assert urls["container_registry"] == f"https://{HUB}:5001" and urls["genesis_git_url"] == BED["genesis_git_url"]
    assert origins(urls) == [f"https://{HUB}:{p}" for p in (8080, 8082, 8083, 8081, 5001)]
    assert "container_registry" not in https_urls({**BED, "docker_insecure_registries": [f"{HUB}:5001"]})
    assert set(https_urls({**BED, "grafana": True})) >= {"grafana_apt_url", "grafana_apt_key_url", "vllm_git_url"}
    assert https_urls(BED, gateway=True) == {"gateway_pip_index_url": BED["gateway_pip_index_url"]}
    assert https_urls({**BED, "gateway_pip_index_url": None}, gateway=True) == {}  # pip's own config: not ours to read


def test_curls_verdicts_parse_and_an_untrusted_server_is_one_line_naming_the_url_and_knob() -> None:
    probes = parse_tls_probes([f"==> https://{HUB}:8080 60 {CURL_60}", f"==> https://{HUB}:8082 60 {CURL_60}",
                               f"==> https://{HUB}:8081 0 ", f"==> https://{HUB}:5001 7 curl: (7) Failed to connect", ""])
    assert probes is not None and probes[f"https://{HUB}:8081"] == TlsProbe(f"https://{HUB}:8081", 0, "")
    assert probes[f"https://{HUB}:8080"].untrusted and not probes[f"https://{HUB}:5001"].untrusted  # unreachable: not this check
    assert probes[f"https://{HUB}:8080"].reason == "SSL certificate problem: unable to get local issuer certificate"
    assert parse_tls_probes(["==> no-curl"]) is None
    for bad in (["garbage"], ["==> http://x 0"], ["==> https://x ok"]):
        with pytest.raises(ParseError):
            parse_tls_probes(bad)
    urls = https_urls(BED)
    found = untrusted_line(urls, probes)
    assert found is not None
    knob, line = found
    assert knob == "nvidia_cuda_repo_url" and "\n" not in line
    assert line == (f"https://{HUB}:8080/cuda (nvidia_cuda_repo_url) (and 6 more: nvidia_cuda_repo_key_url, docker_apt_url, "
                    "docker_apt_key_url, nvidia_ctk_apt_url, nvidia_ctk_apt_key_url, hf_endpoint): the "
                    "server's certificate is not trusted by this host (curl exit 60: SSL certificate problem: unable to get "
                    "local issuer certificate)")
    check = check_https_trust(probes, BED)
    assert check is not None and check.failed and check.key == "nvidia_cuda_repo_url"
    described = check.describe("rig-02")
    assert described.startswith(f"rig-02: https-trust: https://{HUB}:8080/cuda (nvidia_cuda_repo_url)") and "\n" not in described
    assert "update-ca-certificates" in described
    good = {o: TlsProbe(o, 0) for o in origins(urls)}
    assert untrusted_line(urls, good) is None
    ok = check_https_trust(good, BED)
    assert ok is not None and ok.ok and ok.message == "5 HTTPS servers checked: every certificate trusted"
    assert check_https_trust(None, BED) is None  # no curl: not checked
    gateway = check_https_trust({f"https://{HUB}:8083": TlsProbe(f"https://{HUB}:8083", 60, CURL_60)}, BED, gateway=True)
    assert gateway is not None and gateway.failed and gateway.key == "gateway_pip_index_url"


# --- against real TLS servers of a private CA ---------------------------------------------------------


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> tuple[BedCA, ServerCert, BedCA]:
    root = tmp_path_factory.mktemp("pki")
    ca = ensure_bed_ca("bed", root)
    return ca, issue_server_cert(ca, root / "server", ["127.0.0.1", "127.0.0.2"]), ensure_bed_ca("other", root)


class _Ok(__import__("http.server").server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    do_HEAD = do_GET

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def tls_server(pki: tuple[BedCA, ServerCert, BedCA]) -> Iterator[str]:
    _, cert, _ = pki
    # 127.0.0.2: not loopback's usual name, which `rigup lock` reaches over plain HTTP as Docker does
    server = BackgroundServer("127.0.0.2", 0, _Ok, "tls-ok", tls=(cert.cert, cert.key))
    server.start()
    yield f"https://127.0.0.2:{server.port}"
    server.stop()


def test_the_rigs_fact_says_trusted_with_the_ca_and_60_without(pki: tuple[BedCA, ServerCert, BedCA], tls_server: str,
                                                                 tmp_path: Path) -> None:
    ca, _, other = pki
    command = HttpsTrust().command([tls_server, "https://127.0.0.1:1"])
    for bundle, status in ((ca.cert, 0), (other.cert, 60)):
        done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=30,
                              env={"PATH": "/usr/bin:/bin", "CURL_CA_BUNDLE": str(bundle)})
        probes = HttpsTrust().process(done.stdout.splitlines())
        assert probes is not None and probes[tls_server].status == status, done.stdout
        assert probes["https://127.0.0.1:1"].status == 7  # nothing listens: unreachable, not untrusted
    assert HttpsTrust().command([]) == "true"


def test_a_certificate_failure_of_any_client_is_named_in_one_line(pki: tuple[BedCA, ServerCert, BedCA], tls_server: str,
                                                                   tmp_path: Path) -> None:
    ca, _, other = pki
    with pytest.raises(requests.RequestException) as caught:
        requests.get(tls_server, timeout=10, verify=str(other.cert))
    assert certificate_problem(caught.value) == "unable to get local issuer certificate"
    with pytest.raises(urllib.error.URLError) as urllib_caught:
        urllib.request.urlopen(tls_server, timeout=10, context=ssl.create_default_context(cafile=str(other.cert)))
    assert certificate_problem(urllib_caught.value) == "unable to get local issuer certificate"
    assert requests.get(tls_server, timeout=10, verify=str(ca.cert)).text == "ok"
    assert certificate_problem(ConnectionRefusedError(111, "Connection refused")) is None
    git = subprocess.run(["git", "ls-remote", f"{tls_server}/x.git"], capture_output=True, text=True, timeout=30,
                         env={"PATH": "/usr/bin:/bin", "GIT_SSL_CAINFO": str(other.cert), "HOME": str(tmp_path)})
    problem = certificate_problem(RuntimeError(git.stderr))
    assert problem is not None and "\n" not in problem, git.stderr
    line = untrusted_message(tls_server, "unable to get local issuer certificate", "/etc/corp-ca.pem")
    assert line == (f"{tls_server}: the server's certificate is not trusted (unable to get local issuer certificate); checked "
                    "against ca_bundle /etc/corp-ca.pem: add the CA that issued it to the system's store or name a bundle "
                    "holding it in ca_bundle")


def test_ca_bundle_is_the_fleets_one_file_else_the_system_store(tmp_path: Path) -> None:
    bundle = tmp_path / "corp.pem"
    bundle.write_text("-----BEGIN CERTIFICATE-----\n")
    assert control_ca_bundle("corp.pem", tmp_path) == str(bundle)
    assert control_ca_bundle(None) == system_ca_bundle()
    with pytest.raises(TrustError, match=r"^ca_bundle: .*missing.pem is not a readable file"):
        control_ca_bundle("missing.pem", tmp_path)
    assert fleet_ca_bundle([None, str(bundle), str(bundle)]) == str(bundle)
    with pytest.raises(TrustError, match="different ca_bundle values"):
        fleet_ca_bundle([str(bundle), "/other.pem"])
    assert client_environment(str(bundle)) == {"GIT_SSL_CAINFO": str(bundle), "SSL_CERT_FILE": str(bundle)}
    assert client_environment(None) == {}


@pytest.fixture(scope="module")
def tls_remotes(pki: tuple[BedCA, ServerCert, BedCA], tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Remotes, str]]:
    _, cert, _ = pki
    root = tmp_path_factory.mktemp("git")
    rem = make_remotes(root)
    with GitServer(root, tls=(cert.cert, cert.key)) as server:
        assert server.url is not None and server.url.startswith("https://")
        yield rem, server.url


@pytest.fixture(scope="module")
def tls_hub(pki: tuple[BedCA, ServerCert, BedCA], tmp_path_factory: pytest.TempPathFactory) -> Iterator[hfhub.HfHub]:
    _, cert, _ = pki
    with hfhub.HfHub(tmp_path_factory.mktemp("hub"), spec=hub_spec(), tls=(cert.cert, cert.key),
                     config=hfhub.HubConfig(redirect_lfs=True)) as hub:
        yield hub


def test_lock_pins_over_https_with_ca_bundle_and_refuses_an_untrusted_server_in_one_line(
        pki: tuple[BedCA, ServerCert, BedCA], tls_remotes: tuple[Remotes, str], tls_hub: hfhub.HfHub,
        tls_server: str) -> None:
    ca, _, other = pki
    rem, base = tls_remotes
    git = GitNeed("git:vllm-fork", rem.vllm.url(base), "marlin-pad-sub-tile-n", False)
    model = ModelNeed(f"model:{QWEN}", QWEN, "main", tls_hub.url or "", False)
    assert Resolver(ca_bundle=str(ca.cert)).git(git).commit
    assert Resolver(ca_bundle=str(ca.cert)).model(model).files  # the API through huggingface_hub, files through requests
    assert tls_hub.admin(ca_file=ca.cert).stats()["total_bytes"] >= 0
    for need, call in ((git, "git"), (model, "model")):
        with pytest.raises(LockError) as refused:
            getattr(Resolver(ca_bundle=str(other.cert)), call)(need)
        text = str(refused.value)
        assert "\n" not in text and "the server's certificate is not trusted" in text and f"ca_bundle {other.cert}" in text
        assert text.startswith("https://127.0.0.1:"), text
    registry = tls_server.removeprefix("https://")
    with pytest.raises(LockError, match=r"^image vllm/vllm-openai:v1: https://127\.0\.0\.2:\d+: the server's certificate is not trusted"):
        registry_digest(registry, "vllm/vllm-openai", "v1", ca_bundle=str(other.cert))
    with pytest.raises(LockError, match="answered HTTP 200|gave no usable digest"):  # trusted: the handshake passed
        registry_digest(registry, "vllm/vllm-openai", "v1", ca_bundle=str(ca.cert))


def test_the_fleet_files_ca_bundle_reaches_the_upstream_git_cache(tmp_path: Path) -> None:
    from rigup.desired.fleet import FleetError, load_fleet
    from rigup.desired.upstream import _git_env

    bundle = tmp_path / "ca.pem"
    bundle.write_text("-----BEGIN CERTIFICATE-----\n")
    fleet = tmp_path / "rigs.yaml"
    hosts = "groups:\n  rigs:\n    hosts:\n      rig-01: {ssh_hostname: 10.0.0.2}\n"
    try:
        fleet.write_text(f"data:\n  ca_bundle: ca.pem\n{hosts}")
        load_fleet(fleet)
        assert _git_env()["GIT_SSL_CAINFO"] == str(bundle)  # relative: to the fleet file's directory
        fleet.write_text(f"data:\n  ca_bundle: gone.pem\n{hosts}")
        with pytest.raises(FleetError, match=r"rigs\.yaml: ca_bundle: .*gone\.pem is not a readable file"):
            load_fleet(fleet)
        fleet.write_text(hosts)
        load_fleet(fleet)
        assert "GIT_SSL_CAINFO" not in _git_env() or _git_env()["GIT_SSL_CAINFO"] == os.environ.get("GIT_SSL_CAINFO")
    finally:
        use_fleet_bundle(None)
