"""`rigup status` on a gateway host: the entrance's front answers /health over TLS, its certificate verified
against the fleet CA's (another CA's certificate is one line, never a skipped check), and each route's health as
its vllm-router reports it (vllm_router_worker_health in the front's /metrics/, asked with a client's key)."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from rigup.cli.status import DRIFT, OK, UNHEALTHY, gateway_items
from rigup.client.targets import api_targets, fleet_targets
from rigup.desired.fleet import load_fleet
from tests.support.json_http import JsonHandler
from tests.support.tls import fleet_certificate, serve_tls

KEY = "sk-gw-test"
# What the entrance's /metrics/ holds of vllm-router 0.1.17's per-worker health (read from a real router behind
# the front, one pod of each model; the front adds the model label): 1 healthy, 0 out of rotation.
METRICS = """# TYPE vllm_router_worker_health gauge
vllm_router_worker_health{model="qwen3.6-27b",worker="http://127.0.0.1:8000"} 1
vllm_router_worker_health{model="qwen3.6-27b",worker="http://10.0.0.2:8000"} 0
# TYPE vllm_router_active_workers gauge
vllm_router_active_workers{model="qwen3.6-27b"} 1
"""


class FakeEntrance(JsonHandler):
    def do_GET(self) -> None:  # noqa: N802
        if self.path == "/health":
            self.reply(200, {"status": "ok"})
        elif self.path == "/metrics/":
            if self.headers.get("Authorization") != f"Bearer {KEY}":
                self.reply(401, {"error": {"message": "a valid bearer key is required", "code": 401}})
            else:
                body = METRICS.encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
        else:
            self.reply(404, {"error": {"message": "not served here", "code": 404}})


@pytest.fixture
def proxy(tmp_path: Path) -> Iterator[str]:
    """The fake entrance over TLS, its certificate issued by the fleet CA in tmp_path/fleet-ca (as the converge
    issues the front's when no gateway_tls_cert_file is named)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeEntrance)
    serve_tls(server, fleet_certificate(tmp_path / "fleet-ca"))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"https://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def fleet_file(tmp_path: Path, port: int, key_mode: int = 0o600, **gateway_data: str | bool) -> Path:
    key = tmp_path / "gateway.key"
    key.write_text(KEY + "\n")
    key.chmod(key_mode)
    path = tmp_path / "rigs.yaml"
    extra = "".join(f", {name}: {str(value).lower() if isinstance(value, bool) else value}"
                    for name, value in gateway_data.items())
    path.write_text(
        "groups:\n"
        "  gateway:\n"
        f"    data: {{gateway_api_key_file: {key}, gateway_port: {port}, serves_variant: false{extra}}}\n"
        "    hosts: {gw-1: {ssh_hostname: 127.0.0.1}}\n"
        "  rigs:\n"
        "    hosts: {rig-2: {ssh_hostname: 10.0.0.2}}\n"
    )
    return path


def test_status_reports_the_entrance_and_each_route_with_its_routers_verdict(proxy: str, tmp_path: Path) -> None:
    port = int(proxy.rsplit(":", 1)[1])
    targets = {t.name: t for t in fleet_targets(fleet=load_fleet(fleet_file(tmp_path, port)))}
    gateway = targets["gw-1"]
    assert gateway.gateway_url == proxy and gateway.gateway_key == KEY and gateway.recipe is None
    assert gateway.gateway_ca == str(tmp_path / "fleet-ca" / "ca.crt")  # the fleet CA's, beside the fleet file
    assert targets["rig-2"].gateway_url is None and targets["rig-2"].recipe is not None
    items = [(i.item, i.state, i.actual) for i in gateway_items(gateway)]
    assert items[0] == ("gateway", OK, "ready (nginx + vllm-router)")
    assert items[1] == ("route qwen3.6-27b", UNHEALTHY, "unhealthy: http://10.0.0.2:8000")
    assert items[2] == ("route qwen3.6-27b", OK, "healthy: http://127.0.0.1:8000")
    assert len(items) == 3


def test_a_front_whose_certificate_another_ca_issued_is_one_line(proxy: str, tmp_path: Path) -> None:
    port = int(proxy.rsplit(":", 1)[1])
    fleet_certificate(tmp_path / "other-ca")  # this fleet file's CA is not the one that issued the front's
    gateway = next(t for t in fleet_targets(fleet=load_fleet(fleet_file(tmp_path, port, fleet_ca_dir="other-ca")))
                   if t.name == "gw-1")
    assert gateway.gateway_ca == str(tmp_path / "other-ca" / "ca.crt")
    [answer] = gateway_items(gateway)
    assert (answer.item, answer.state) == ("gateway", UNHEALTHY)
    assert answer.actual == f"TLS refused: its certificate is not signed by the CA in {tmp_path / 'other-ca' / 'ca.crt'}"


def test_a_fleet_ca_not_made_yet_or_plain_http_only_when_asked(tmp_path: Path) -> None:
    gateway = next(t for t in fleet_targets(fleet=load_fleet(fleet_file(tmp_path, 4000))) if t.name == "gw-1")
    assert gateway.gateway_url is None and "is not there (the fleet CA is made at the first converge)" in (
        gateway.gateway_error or "")
    plain = next(t for t in fleet_targets(fleet=load_fleet(fleet_file(tmp_path, 4000, gateway_plain_http=True)))
                 if t.name == "gw-1")
    assert plain.gateway_url == "http://127.0.0.1:4000" and plain.gateway_ca is None and plain.gateway_error is None


def test_a_gateway_that_does_not_answer_or_a_loose_key_is_reported(tmp_path: Path) -> None:
    fleet_certificate(tmp_path / "fleet-ca")
    targets = {t.name: t for t in fleet_targets(fleet=load_fleet(fleet_file(tmp_path, 1, key_mode=0o644)))}
    gateway = targets["gw-1"]
    assert gateway.gateway_key is None and "readable by group or others" in (gateway.gateway_error or "")
    assert gateway.error is None  # the host's own API key is not at fault
    key, answer = gateway_items(gateway)
    assert (key.item, key.state) == ("gateway key", DRIFT) and "readable by group or others" in key.actual
    assert (answer.item, answer.state) == ("gateway", UNHEALTHY) and answer.actual.startswith("no answer")


def test_verify_bench_and_router_leave_a_gateway_only_host_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RIGUP_RIGS", str(fleet_file(tmp_path, 4000)))
    assert [t.name for t in api_targets(None, None, None)] == ["rig-2"]
    assert [t.name for t in fleet_targets()] == ["gw-1", "rig-2"]  # status still reports it
