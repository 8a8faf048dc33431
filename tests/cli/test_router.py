"""`rigup router`: a LiteLLM config over the rigs whose /v1/models lists their model, checked
against real HTTP servers on loopback (two healthy rigs, one serving the wrong model, one down)."""

from __future__ import annotations

import argparse
import http.server
import json
import threading
from pathlib import Path
from typing import Any

import pytest
import yaml

from rigup.cli import router
from rigup.desired.pod_keys import pod_key

MODEL = "qwen3.6-27b-autoround"  # dual's --served-model-name upstream
KEY = "sk-router-test-000111"


def serve(model: str, key: str | None = None) -> http.server.ThreadingHTTPServer:
    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def do_GET(self) -> None:  # noqa: N802
            if key and self.headers.get("Authorization") != f"Bearer {key}":
                status, body = 401, {"error": "Unauthorized"}
            else:
                status, body = 200, {"object": "list", "data": [{"id": model, "object": "model"}]}
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True).start()
    return srv


@pytest.fixture
def fleet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    own = pod_key({}, "rig-01", "dual", tmp_path)  # rig-01's pod's own key, as its converge made it
    for rig in ("rig-03", "rig-04"):
        pod_key({}, rig, "dual", tmp_path)
    servers = [serve(MODEL, own), serve(MODEL, KEY), serve("something-else")]
    key_file = tmp_path / "api.key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    ports = [s.server_address[1] for s in servers]
    hosts = {
        "rig-01": {"ssh_hostname": "127.0.0.1", "variant_overrides": {"port": ports[0]}},
        "rig-02": {"ssh_hostname": "127.0.0.1", "variant_overrides": {"port": ports[1]}, "serving_api_key_file": str(key_file)},
        "rig-03": {"ssh_hostname": "127.0.0.1", "variant_overrides": {"port": ports[2]}},
        "rig-04": {"ssh_hostname": "127.0.0.1", "variant_overrides": {"port": 9}},  # nothing listens
    }
    path = tmp_path / "rigs.yaml"
    path.write_text(yaml.safe_dump({"data": {"variant": "dual"}, "groups": {"rigs": {"hosts": hosts}}}))
    monkeypatch.setenv("RIGUP_RIGS", str(path))
    yield ports
    for s in servers:
        s.shutdown()
        s.server_close()


def test_router_config_lists_only_healthy_rigs(fleet, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    out = tmp_path / "litellm.yaml"
    args = argparse.Namespace(limit=[], out=str(out), include_unhealthy=False, api_key_env="RIGUP_API_KEY")
    assert router._cmd_router(args) == 1  # written, but not every rig is healthy
    text = out.read_text()
    assert KEY not in text and "with RIGUP_API_KEY, RIGUP_API_KEY_RIG_01 exported" in text
    config = yaml.safe_load(text)
    assert config["model_list"] == [
        {
            "model_name": MODEL,
            "litellm_params": {"model": f"openai/{MODEL}", "api_base": f"http://127.0.0.1:{fleet[0]}/v1",
                               "api_key": "os.environ/RIGUP_API_KEY_RIG_01"},
            "model_info": {"id": "rig-01", "rigup_variant": "dual"},
        },
        {
            "model_name": MODEL,
            "litellm_params": {"model": f"openai/{MODEL}", "api_base": f"http://127.0.0.1:{fleet[1]}/v1", "api_key": "os.environ/RIGUP_API_KEY"},
            "model_info": {"id": "rig-02", "rigup_variant": "dual"},
        },
    ]
    assert config["router_settings"]["routing_strategy"] == "least-busy"
    err = capsys.readouterr().err
    assert "SKIP rig-03: /v1/models lists ['something-else']" in err
    assert "SKIP rig-04: GET /v1/models: no response" in err


def test_each_pod_of_a_host_is_a_deployment_and_limit_takes_one_pod(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from rigup.client.targets import fleet_targets

    servers = [serve(MODEL, pod_key({}, "quad", "left", tmp_path)), serve(MODEL, pod_key({}, "quad", "right", tmp_path))]
    try:
        ports = [s.server_address[1] for s in servers]
        pods = [{"name": "left", "variant": "dual", "gpus": [0, 1], "port": ports[0]},
                {"name": "right", "variant": "dual", "gpus": [2, 3], "port": ports[1]}]
        path = tmp_path / "rigs.yaml"
        hosts = {"quad": {"ssh_hostname": "127.0.0.1", "pods": pods}, "solo": {"ssh_hostname": "127.0.0.1"}}
        path.write_text(yaml.safe_dump({"data": {"variant": "dual"}, "groups": {"rigs": {"hosts": hosts}}}))
        monkeypatch.setenv("RIGUP_RIGS", str(path))
        targets = fleet_targets()
        assert [(t.name, t.host, t.recipe.paths.unit_name) for t in targets] == [
            ("quad/left", "quad", "rigup-left.service"), ("quad/right", "quad", "rigup-right.service"),
            ("solo", "solo", "rigup-dual.service")]
        assert targets[0].host_units == targets[1].host_units == ("rigup-left.service", "rigup-right.service")
        assert [t.name for t in fleet_targets(["quad/right"])] == ["quad/right"]
        assert [t.name for t in fleet_targets(["quad"])] == ["quad/left", "quad/right"]
        out = tmp_path / "litellm.yaml"
        args = argparse.Namespace(limit=["quad"], out=str(out), include_unhealthy=False, api_key_env="RIGUP_API_KEY")
        assert router._cmd_router(args) == 0
        deployments = yaml.safe_load(out.read_text())["model_list"]
        assert [(d["model_info"]["id"], d["litellm_params"]["api_base"]) for d in deployments] == [
            ("quad/left", f"http://127.0.0.1:{ports[0]}/v1"), ("quad/right", f"http://127.0.0.1:{ports[1]}/v1")]
    finally:
        for s in servers:
            s.shutdown()
            s.server_close()
