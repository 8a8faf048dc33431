"""The entrance's decisions: routes from what rigs serve, the routes file, its clients and keys, its plan and unit."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from rigup.desired.entrance import Client, nginx_site
from rigup.desired.gateway import (
    GatewayError,
    RigEndpoint,
    Route,
    front_trust,
    gateway_paths,
    gateway_plan,
    key_env,
    requirements_sha256,
    requirements_text,
    route_for,
    router_unit_text,
    router_version,
    routes_in_config,
    routes_text,
    workers_by_model,
)
from rigup.desired.knobs import KnobError, check_knob
from rigup.desired.pod_keys import pod_key

REMOTE = RigEndpoint("rig-2", "10.0.0.12", "RIGUP_RIG_KEY_RIG_2", local=False)


def record(*, gate: str = "passed", bind: str = "0.0.0.0", port: int = 8000, key: bool = True) -> dict[str, Any]:
    return {
        "variant": "dual",
        "unit": "rigup-dual.service",
        "gate": {"result": gate},
        "release": {"served_model_name": "qwen3.6-27b-autoround", "host_port": port, "bind_address": bind,
                    "api_key_env": "VLLM_API_KEY" if key else None},
    }


def test_a_rig_whose_release_passed_and_runs_is_a_route() -> None:
    route, why = route_for(REMOTE, record(), ["rigup-dual.service"])
    assert route == Route("rig-2", "rigup-dual.service", "dual", "qwen3.6-27b-autoround",
                          "http://10.0.0.12:8000/v1", "RIGUP_RIG_KEY_RIG_2")
    assert why == "serves qwen3.6-27b-autoround"
    open_rig, _ = route_for(REMOTE, record(key=False), ["rigup-dual.service"])
    assert open_rig is not None and open_rig.key_env is None  # an open API gets no key


@pytest.mark.parametrize(
    ("served", "active", "reason"),
    [
        (None, [], "no release has passed rigup's health gate here"),
        (record(gate="failed"), ["rigup-dual.service"], "its last health gate did not pass (failed)"),
        (record(), ["rigup-single.service"], "rigup-dual.service is not running"),
        (record(bind="127.0.0.1"), ["rigup-dual.service"], "listens on 127.0.0.1 only"),
        ({"gate": {"result": "passed"}, "release": {}}, [], "names no unit, served model or port"),
    ],
)
def test_no_route_without_a_passed_running_reachable_release(served: Any, active: list[str], reason: str) -> None:
    route, why = route_for(REMOTE, served, active)
    assert route is None and reason in why


def test_the_gateway_reaches_its_own_rig_on_loopback() -> None:
    me = RigEndpoint("rig-1", "127.0.0.1", None, local=True)
    route, _ = route_for(me, record(bind="127.0.0.1", port=8001, key=False), ["rigup-dual.service"])
    assert route is not None and route.api_base == "http://127.0.0.1:8001/v1"
    v6 = RigEndpoint("rig-6", "fd00::6", None, local=False)
    route6, _ = route_for(v6, record(), ["rigup-dual.service"])
    assert route6 is not None and route6.api_base == "http://[fd00::6]:8000/v1"


def routes() -> list[Route]:
    return [
        Route("rig-b", "rigup-dual.service", "dual", "qwen", "http://10.0.0.2:8000/v1", "RIGUP_RIG_KEY_RIG_B"),
        Route("rig-a", "rigup-dual.service", "dual", "qwen", "http://10.0.0.1:8000/v1", None),
        Route("rig-c", "rigup-gemma.service", "gemma-dual", "gemma", "http://10.0.0.3:8010/v1", None),
    ]


def test_the_routes_file_is_stable_and_reads_back_as_its_routes() -> None:
    text = routes_text(routes())
    assert text == routes_text(list(reversed(routes())))
    assert sorted(routes_in_config(text), key=lambda r: r.host) == sorted(routes(), key=lambda r: r.host)
    assert "RIGUP_RIG_KEY_RIG_B" in text  # the name of the rig's key, never a key
    assert routes_in_config(None) == [] and routes_in_config("{") == [] and routes_in_config('{"routes": [{"x": 1}]}') == []


def test_each_model_gets_its_rigs_as_workers() -> None:
    assert workers_by_model(routes()) == {"qwen": ["http://10.0.0.2:8000", "http://10.0.0.1:8000"],
                                          "gemma": ["http://10.0.0.3:8010"]}


def secret(tmp_path: Path, name: str, value: str, mode: int = 0o600) -> str:
    path = tmp_path / name
    path.write_text(value + "\n")
    path.chmod(mode)
    return str(path)


def test_gateway_plan_routes_to_every_rig_with_its_key(tmp_path: Path) -> None:
    gw_key = secret(tmp_path, "gw", "sk-gateway-0123456789")
    rig_key = secret(tmp_path, "rig", "rig-secret")
    fleet = [
        ("rig-1", {"gateway_api_key_file": gw_key, "fleet_ca_dir": str(tmp_path / "fleet-ca")}),
        ("rig-2", {"ssh_hostname": "10.0.0.2", "serving_api_key_file": rig_key, "install_root": "/srv/rigup"}),
        ("box", {"serves_variant": False}),
    ]
    plan = gateway_plan("rig-1", fleet[0][1], ["gateway"], fleet)
    assert plan is not None
    assert plan.rigs == (
        RigEndpoint("rig-1", "127.0.0.1", key_env("rig-1"), local=True),
        RigEndpoint("rig-2", "10.0.0.2", key_env("rig-2"), local=False),
    )
    assert plan.install_roots == {"rig-1": "/opt/rigup", "rig-2": "/srv/rigup"}
    assert plan.clients == (Client("default", "sk-gateway-0123456789"),)
    # each routed pod's key, by its host:port: the rig's serving_api_key_file key, else the pod's own
    routes = [Route("rig-2", "rigup-dual.service", "dual", "m", "http://10.0.0.2:8000/v1", None),
              Route("rig-1", "rigup-left.service", "dual", "m", "http://127.0.0.1:8030/v1", None),
              Route("gone", "rigup-dual.service", "dual", "m", "http://10.0.0.9:8000/v1", None)]
    keys = plan.pod_keys(routes)
    assert keys["10.0.0.2:8000"] == "rig-secret" and "10.0.0.9:8000" not in keys  # a rig no longer in the fleet
    assert keys["127.0.0.1:8030"] == pod_key(fleet[0][1], "rig-1", "left") and len(keys["127.0.0.1:8030"]) == 64
    # TLS by default: a certificate the fleet CA issues at converge for the host's names (fleet_ca_issues)
    assert plan.readiness_url == "https://127.0.0.1:4000/health" and plan.fleet_ca_issues
    assert plan.tls == ("/opt/rigup/gateway/tls.crt", "/opt/rigup/gateway/tls.key")
    assert plan.cert_sans == ("DNS:rig-1", "DNS:localhost", "IP:127.0.0.1")
    assert plan.readiness([]) == ("https://127.0.0.1:4000/health", None)
    assert plan.paths.venv == f"/opt/rigup/gateway/venv-{requirements_sha256()[:12]}"
    assert "rig-secret" not in repr(plan) and "sk-gateway" not in repr(plan)
    assert gateway_plan("rig-2", fleet[1][1], ["rigs"], fleet) is None  # not in gateway_group


def test_clients_come_from_their_key_files_and_a_missing_one_is_made_0600(tmp_path: Path) -> None:
    alice = secret(tmp_path, "alice.key", "alice-key-0123456789abcdef")
    made = tmp_path / "keys" / "bob.key"
    data = {"gateway_clients": [{"name": "alice", "key_file": alice}, {"name": "bob", "key_file": str(made)}]}
    plan = gateway_plan("gw", data, ["gateway"], [])
    assert plan is not None and [c.name for c in plan.clients] == ["alice", "bob"]
    assert made.stat().st_mode & 0o777 == 0o600
    assert plan.clients[1].key == made.read_text().strip() and len(plan.clients[1].key) >= 40
    again = gateway_plan("gw", data, ["gateway"], [])
    assert again is not None and again.clients == plan.clients  # made once, then read


@pytest.mark.parametrize(
    ("clients", "message"),
    [
        ("alice", "gateway_clients must be a list"),
        ([{"name": "alice"}], r"gateway_clients\[0\] must have exactly the keys name and key_file"),
        ([{"name": "Alice!", "key_file": "/k"}], r"gateway_clients\[0\].name 'Alice!': lowercase"),
        ([{"name": "a", "key_file": "/k1"}, {"name": "a", "key_file": "/k2"}], "lists client 'a' twice"),
    ],
)
def test_bad_clients_are_refused_naming_the_knob(clients: Any, message: str) -> None:
    with pytest.raises(GatewayError, match=message):
        gateway_plan("gw", {"gateway_clients": clients}, ["gateway"], [])


def test_gateway_plan_refuses_no_client_a_readable_key_or_one_nginx_would_parse(tmp_path: Path) -> None:
    with pytest.raises(GatewayError, match="gateway_api_key_file is not set and gateway_clients is empty"):
        gateway_plan("gw", {}, ["gateway"], [])
    gw_key = secret(tmp_path, "gw", "sk-gateway-0123456789")
    loose = secret(tmp_path, "loose", "k", mode=0o644)
    with pytest.raises(GatewayError, match=r"the key of rig 'rig-9'.*readable by group or others"):
        gateway_plan("gw", {"gateway_api_key_file": gw_key}, ["gateway"], [("rig-9", {"serving_api_key_file": loose})])
    loose_client = secret(tmp_path, "c", "client-key-0123456789", mode=0o640)
    with pytest.raises(GatewayError, match="readable by group or others"):
        gateway_plan("gw", {"gateway_clients": [{"name": "c", "key_file": loose_client}]}, ["gateway"], [])
    quoted = secret(tmp_path, "q", 'key"one')
    with pytest.raises(GatewayError, match="serving_api_key_file of rig 'r1': the key holds a quote"):
        gateway_plan("gw", {"gateway_api_key_file": gw_key}, ["gateway"], [("r1", {"serving_api_key_file": quoted})])


def test_the_front_speaks_tls_with_a_named_certificate_and_a_0600_key(tmp_path: Path) -> None:
    gw_key = secret(tmp_path, "gw", "sk-gateway-0123456789")
    cert = tmp_path / "tls.crt"
    cert.write_text("-----BEGIN CERTIFICATE-----\n")
    key = tmp_path / "tls.key"
    key.write_text("-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n")
    key.chmod(0o600)
    data = {"gateway_api_key_file": gw_key, "gateway_tls_cert_file": str(cert), "gateway_tls_key_file": str(key)}
    plan = gateway_plan("gw", data, ["gateway"], [])
    assert plan is not None and plan.tls == ("/opt/rigup/gateway/tls.crt", "/opt/rigup/gateway/tls.key")
    assert plan.readiness_url == "https://127.0.0.1:4000/health"
    key.chmod(0o644)
    with pytest.raises(GatewayError, match="readable by group or others"):
        gateway_plan("gw", data, ["gateway"], [])
    with pytest.raises(GatewayError, match="set together"):
        gateway_plan("gw", {"gateway_api_key_file": gw_key, "gateway_tls_cert_file": str(cert)}, ["gateway"], [])


def test_the_fleet_ca_certificate_names_the_host_as_the_fleet_reaches_it_and_clients_trust_the_fleet_ca(
    tmp_path: Path,
) -> None:
    gw_key = secret(tmp_path, "gw", "sk-gateway-0123456789")
    data = {"gateway_api_key_file": gw_key, "ssh_hostname": "10.0.0.9", "gateway_bind_address": "10.0.0.9",
            "fleet_ca_dir": str(tmp_path / "ca")}
    plan = gateway_plan("gw-1", data, ["gateway"], [])
    assert plan is not None and plan.fleet_ca_issues and plan.scheme == "https"
    assert plan.cert_sans == ("DNS:gw-1", "IP:10.0.0.9", "DNS:localhost", "IP:127.0.0.1")
    assert plan.readiness_url == "https://10.0.0.9:4000/health" and plan.readiness([]) == (plan.readiness_url, None)
    assert plan.client_ca == str(tmp_path / "ca" / "ca.crt") and front_trust(data) == ("https", plan.client_ca)
    # what nginx is given: TLS on the front's one listener
    site = nginx_site([], plan.paths, bind_address=plan.bind_address, port=plan.port, tls=plan.tls)
    assert "listen 10.0.0.9:4000 ssl;" in site and "ssl_protocols TLSv1.2 TLSv1.3;" in site
    assert "ssl_certificate /opt/rigup/gateway/tls.crt;" in site and "ssl_certificate_key /opt/rigup/gateway/tls.key;" in site


def test_plain_http_only_when_the_fleet_file_says_so(tmp_path: Path) -> None:
    gw_key = secret(tmp_path, "gw", "sk-gateway-0123456789")
    data = {"gateway_api_key_file": gw_key, "gateway_plain_http": True}
    plan = gateway_plan("gw", data, ["gateway"], [])
    assert plan is not None and plan.tls is None and not plan.fleet_ca_issues and plan.client_ca is None
    assert plan.readiness_url == "http://127.0.0.1:4000/health" and front_trust(data) == ("http", None)
    site = nginx_site([], plan.paths, bind_address=plan.bind_address, port=plan.port, tls=plan.tls)
    assert "listen 0.0.0.0:4000;" in site and "ssl" not in site
    with pytest.raises(GatewayError, match="gateway_plain_http is true but gateway_tls_cert_file or gateway_tls_ca_file"):
        gateway_plan("gw", {**data, "gateway_tls_ca_file": "/ca.crt"}, ["gateway"], [])
    with pytest.raises(KnobError, match="gateway_plain_http"):
        check_knob("gateway_plain_http", "yes")  # a bool, as the fleet file's loader checks it


def test_the_users_certificate_is_checked_against_their_ca_by_its_own_name(tmp_path: Path) -> None:
    gw_key = secret(tmp_path, "gw", "sk-gateway-0123456789")
    cert, key = tmp_path / "tls.crt", secret(tmp_path, "tls.key", "-----BEGIN PRIVATE KEY-----")
    cert.write_text("-----BEGIN CERTIFICATE-----\n")
    data = {"gateway_api_key_file": gw_key, "gateway_tls_cert_file": str(cert), "gateway_tls_key_file": key}
    public = gateway_plan("gw", data, ["gateway"], [])
    assert public is not None and not public.fleet_ca_issues and public.client_ca is None  # the system's roots
    own = gateway_plan("gw", {**data, "gateway_tls_ca_file": "~/ca.crt"}, ["gateway"], [])
    assert own is not None and own.client_ca == str(Path("~/ca.crt").expanduser()) and own.cert_sans == ()
    # the readiness wait asks by a name the certificate carries, connected to the front's own address
    assert own.readiness(["api.example.com", "10.1.1.1"]) == (
        "https://api.example.com:4000/health", "api.example.com:4000:127.0.0.1:4000")
    assert own.readiness(["*.example.com"])[0] == "https://rigup-ready.example.com:4000/health"
    assert own.readiness(["api.example.com", "127.0.0.1"]) == ("https://127.0.0.1:4000/health", None)
    with pytest.raises(GatewayError, match="gateway_tls_ca_file is set without gateway_tls_cert_file"):
        gateway_plan("gw", {"gateway_api_key_file": gw_key, "gateway_tls_ca_file": "/ca.crt"}, ["gateway"], [])


def test_the_pin_is_vllm_router_with_every_line_hashed() -> None:
    assert router_version() == "0.1.17"
    pins: dict[str, list[str]] = {}
    current = None
    for line in requirements_text().splitlines():
        if not line or line.startswith("#"):
            continue
        if line.startswith(" "):
            assert current is not None and line.strip().startswith("--hash=sha256:"), line
            pins[current].append(line.strip().removeprefix("--hash=sha256:").rstrip(" \\"))
        else:
            current = line.rstrip(" \\")
            assert "==" in current and current not in pins, current
            pins[current] = []
    assert any(p.startswith("vllm-router==") for p in pins) and len(pins) > 20
    assert all(hashes and all(len(h) == 64 for h in hashes) for hashes in pins.values())


def test_the_router_unit_verifies(tmp_path: Path) -> None:
    if shutil.which("systemd-analyze") is None:
        pytest.fail("systemd-analyze not installed (Debian package systemd; scripts/setup installs it)")
    paths = gateway_paths("/opt/rigup")
    root = tmp_path / "root"
    shutil.copytree("/usr/lib/systemd/system", root / "usr/lib/systemd/system", symlinks=True)
    router = root / paths.venv.lstrip("/") / "bin/vllm-router"
    router.parent.mkdir(parents=True)
    router.write_text("#!/bin/sh\nexit 0\n")
    router.chmod(0o755)
    env = root / paths.router_env("qwen").lstrip("/")
    env.parent.mkdir(parents=True)
    env.write_text("ROUTER_ARGS=--port 30100\n")
    unit = root / "etc/systemd/system/rigup-router@.service"
    unit.parent.mkdir(parents=True)
    unit.write_text(router_unit_text(paths))
    out = subprocess.run(["systemd-analyze", "verify", "--man=no", f"--root={root}", "rigup-router@qwen.service"],
                         capture_output=True, text=True, timeout=60)
    problems = [line for line in (out.stdout + out.stderr).splitlines() if "rigup-router" in line]
    assert out.returncode == 0 and not problems, out.stdout + out.stderr
    assert f"ExecStart={paths.venv}/bin/vllm-router $ROUTER_ARGS" in unit.read_text()
    assert f"EnvironmentFile={paths.routers_dir}/%i.env" in unit.read_text()


def test_the_index_url_knob_refuses_credentials_without_echoing_them() -> None:
    from rigup.desired.knobs import KnobError, check_knob

    assert check_knob("gateway_pip_index_url", "http://10.0.0.1:8083/simple")
    with pytest.raises(KnobError) as refused:
        check_knob("gateway_pip_index_url", "https://ops:hunter2@mirror.lan/simple")
    assert "without credentials" in str(refused.value) and "hunter2" not in str(refused.value)


def test_a_unit_named_by_two_records_routes_from_the_newest() -> None:
    from rigup.desired.gateway import current_records

    # the host moved from `variant: dual` to pods with one named dual: both records name rigup-dual.service
    old = {"unit": "rigup-dual.service", "written_at": "2026-11-30T04:00:01+00:00", "release": {"host_port": 8010}}
    new = {"unit": "rigup-dual.service", "pod": "dual", "written_at": "2026-12-01T09:12:40+00:00",
           "release": {"host_port": 8030}}
    other = {"unit": "rigup-right.service", "pod": "right", "written_at": "2026-12-01T09:10:00+00:00"}
    assert current_records([old, new, other]) == [new, other]
    assert current_records([new, old]) == [new]
    assert current_records([]) == []
