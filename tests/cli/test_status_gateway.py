"""`rigup status` on a gateway host: the gateway's readiness and LiteLLM's verdict on every route.

The server below answers as LiteLLM 1.108's proxy does (the shapes were read from a real proxy run
against two rigup responders, one of them stopped): /health/readiness without a key, /health with the
master key, healthy_endpoints and unhealthy_endpoints carrying each deployment's model_info id."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rigup.cli.runner import api_targets, fleet_targets
from rigup.cli.status import DRIFT, OK, UNHEALTHY, gateway_items
from rigup.desired.fleet import load_fleet
from tests.support.json_http import JsonHandler

KEY = "sk-gw-test"
HEALTH: dict[str, Any] = {
    "healthy_endpoints": [
        {"api_base": "http://127.0.0.1:8000/v1", "model": "hosted_vllm/qwen3.6-27b", "model_id": "rig-1/rigup-dual.service"}
    ],
    "unhealthy_endpoints": [
        {"api_base": "http://10.0.0.2:8000/v1", "model": "hosted_vllm/qwen3.6-27b", "model_id": "rig-2/rigup-dual.service",
         "error": "litellm.InternalServerError: Hosted_vllmException - Cannot connect to host 10.0.0.2:8000\nstack trace: ..."}
    ],
    "healthy_count": 1,
    "unhealthy_count": 1,
}


class FakeProxy(JsonHandler):
    def do_GET(self) -> None:  # noqa: N802
        if self.path == "/health/readiness":
            self.reply(200, {"status": "healthy", "db": "Not connected"})
        elif self.path == "/health":
            if self.headers.get("Authorization") != f"Bearer {KEY}":
                self.reply(401, {"error": {"message": "Authentication Error", "code": "401"}})
            else:
                self.reply(200, HEALTH)
        else:
            self.reply(404, {"detail": "Not Found"})


@pytest.fixture
def proxy() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeProxy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def fleet_file(tmp_path: Path, port: int, key_mode: int = 0o600) -> Path:
    key = tmp_path / "gateway.key"
    key.write_text(KEY + "\n")
    key.chmod(key_mode)
    path = tmp_path / "rigs.yaml"
    path.write_text(
        "groups:\n"
        "  gateway:\n"
        f"    data: {{gateway_api_key_file: {key}, gateway_port: {port}, serves_variant: false}}\n"
        "    hosts: {gw-1: {ssh_hostname: 127.0.0.1}}\n"
        "  rigs:\n"
        "    hosts: {rig-2: {ssh_hostname: 10.0.0.2}}\n"
    )
    return path


def test_status_reports_the_gateway_and_each_route_with_litellms_verdict(proxy: str, tmp_path: Path) -> None:
    port = int(proxy.rsplit(":", 1)[1])
    targets = {t.name: t for t in fleet_targets(fleet=load_fleet(fleet_file(tmp_path, port)))}
    gateway = targets["gw-1"]
    assert gateway.gateway_url == proxy and gateway.gateway_key == KEY and gateway.recipe is None
    assert targets["rig-2"].gateway_url is None and targets["rig-2"].recipe is not None
    items = [(i.item, i.state, i.actual) for i in gateway_items(gateway)]
    assert items[0] == ("gateway", OK, "ready")
    assert items[1] == ("route qwen3.6-27b", OK, "healthy: rig-1/rigup-dual.service at http://127.0.0.1:8000/v1")
    assert items[2][:2] == ("route qwen3.6-27b", UNHEALTHY)
    assert items[2][2].startswith("unhealthy: rig-2/rigup-dual.service at http://10.0.0.2:8000/v1: litellm.Internal")
    assert "\n" not in items[2][2]


def test_a_gateway_that_does_not_answer_or_a_loose_key_is_reported(tmp_path: Path) -> None:
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
