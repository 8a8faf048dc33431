"""The gateway's decisions: routes from what rigs serve, the LiteLLM config, its keys, its plan and unit."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from rigup.desired.gateway import (
    MASTER_KEY_ENV,
    GatewayError,
    RigEndpoint,
    Route,
    config_document,
    config_text,
    env_text,
    gateway_paths,
    gateway_plan,
    key_env,
    litellm_version,
    requirements_sha256,
    requirements_text,
    route_for,
    routes_in_config,
    unit_text,
)

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


def test_config_has_a_deployment_per_route_sharing_the_model_name() -> None:
    doc = config_document(routes(), health_check_interval_s=7, num_retries=3)
    entries = [(e["model_name"], e["model_info"]["id"], e["litellm_params"]["api_base"]) for e in doc["model_list"]]
    assert entries == [
        ("gemma", "rig-c/rigup-gemma.service", "http://10.0.0.3:8010/v1"),
        ("qwen", "rig-a/rigup-dual.service", "http://10.0.0.1:8000/v1"),
        ("qwen", "rig-b/rigup-dual.service", "http://10.0.0.2:8000/v1"),
    ]
    keys = [e["litellm_params"]["api_key"] for e in doc["model_list"]]
    assert keys == ["EMPTY", "EMPTY", "os.environ/RIGUP_RIG_KEY_RIG_B"]  # names of variables, never keys
    assert all(e["litellm_params"]["model"] == "hosted_vllm/" + e["model_name"] for e in doc["model_list"])
    general = doc["general_settings"]
    assert general["master_key"] == f"os.environ/{MASTER_KEY_ENV}"
    assert general["background_health_checks"] is True and general["health_check_interval"] == 7
    assert general["enable_health_check_routing"] is True
    assert doc["router_settings"]["num_retries"] == 3 and doc["router_settings"]["allowed_fails"] == 0
    assert doc["router_settings"]["cooldown_time"] > general["health_check_interval"]


def test_config_text_is_stable_and_reads_back_as_its_routes() -> None:
    text = config_text(routes(), health_check_interval_s=10, num_retries=2)
    assert text == config_text(list(reversed(routes())), health_check_interval_s=10, num_retries=2)
    assert sorted(routes_in_config(text), key=lambda r: r.host) == sorted(routes(), key=lambda r: r.host)
    foreign = yaml.safe_load(text)
    foreign["model_list"].append({"model_name": "gpt", "litellm_params": {"model": "openai/gpt"}})
    assert len(routes_in_config(yaml.safe_dump(foreign))) == 3  # not rigup's: not carried
    assert routes_in_config(None) == [] and routes_in_config("model_list: [") == []


def test_env_text_quotes_values_and_refuses_what_would_break_it() -> None:
    assert env_text("sk-gw", {"RIGUP_RIG_KEY_B": "kb", "RIGUP_RIG_KEY_A": "ka"}) == (
        f"{MASTER_KEY_ENV}='sk-gw'\nRIGUP_RIG_KEY_A='ka'\nRIGUP_RIG_KEY_B='kb'\n"
    )
    for bad in ("", "a'b", "a\nb", "a$b"):
        with pytest.raises(GatewayError):
            env_text(bad, {})


def secret(tmp_path: Path, name: str, value: str, mode: int = 0o600) -> str:
    path = tmp_path / name
    path.write_text(value + "\n")
    path.chmod(mode)
    return str(path)


def test_gateway_plan_routes_to_every_rig_with_its_key(tmp_path: Path) -> None:
    gw_key = secret(tmp_path, "gw", "sk-gateway")
    rig_key = secret(tmp_path, "rig", "rig-secret")
    fleet = [
        ("rig-1", {"gateway_api_key_file": gw_key}),
        ("rig-2", {"ssh_hostname": "10.0.0.2", "serving_api_key_file": rig_key, "install_root": "/srv/rigup"}),
        ("box", {"serves_variant": False}),
    ]
    plan = gateway_plan("rig-1", fleet[0][1], ["gateway"], fleet)
    assert plan is not None
    assert plan.rigs == (
        RigEndpoint("rig-1", "127.0.0.1", None, local=True),
        RigEndpoint("rig-2", "10.0.0.2", key_env("rig-2"), local=False),
    )
    assert plan.install_roots == {"rig-1": "/opt/rigup", "rig-2": "/srv/rigup"}
    assert plan.env_text == f"{MASTER_KEY_ENV}='sk-gateway'\nRIGUP_RIG_KEY_RIG_2='rig-secret'\n"
    assert plan.readiness_url == "http://127.0.0.1:4000/health/readiness"
    assert plan.paths.venv == f"/opt/rigup/gateway/venv-{requirements_sha256()[:12]}"
    assert gateway_plan("rig-2", fleet[1][1], ["rigs"], fleet) is None  # not in gateway_group


def test_gateway_plan_refuses_a_missing_gateway_key_or_a_readable_rig_key(tmp_path: Path) -> None:
    with pytest.raises(GatewayError, match="gateway_api_key_file is not set"):
        gateway_plan("gw", {}, ["gateway"], [])
    gw_key = secret(tmp_path, "gw", "sk-gateway")
    loose = secret(tmp_path, "loose", "k", mode=0o644)
    fleet = [("rig-9", {"serving_api_key_file": loose})]
    with pytest.raises(GatewayError, match=r"the key of rig 'rig-9'.*readable by group or others"):
        gateway_plan("gw", {"gateway_api_key_file": gw_key}, ["gateway"], fleet)


def test_the_pin_is_litellm_with_every_line_hashed() -> None:
    assert litellm_version()
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
    assert any(p.startswith("litellm==") for p in pins) and len(pins) > 100
    assert all(hashes and all(len(h) == 64 for h in hashes) for hashes in pins.values())


def test_the_gateway_unit_verifies(tmp_path: Path) -> None:
    if shutil.which("systemd-analyze") is None:
        pytest.fail("systemd-analyze not installed (Debian package systemd; scripts/setup installs it)")
    paths = gateway_paths("/opt/rigup")
    root = tmp_path / "root"
    shutil.copytree("/usr/lib/systemd/system", root / "usr/lib/systemd/system", symlinks=True)
    litellm = root / paths.venv.lstrip("/") / "bin/litellm"
    litellm.parent.mkdir(parents=True)
    litellm.write_text("#!/bin/sh\nexit 0\n")
    litellm.chmod(0o755)
    unit = root / "etc/systemd/system/rigup-gateway.service"
    unit.parent.mkdir(parents=True)
    unit.write_text(unit_text(paths, bind_address="0.0.0.0", port=4000))
    out = subprocess.run(["systemd-analyze", "verify", "--man=no", f"--root={root}", "/etc/systemd/system/rigup-gateway.service"],
                         capture_output=True, text=True, timeout=60)
    problems = [line for line in (out.stdout + out.stderr).splitlines() if "rigup-gateway" in line]
    assert out.returncode == 0 and not problems, out.stdout + out.stderr
    assert f"ExecStart={paths.venv}/bin/litellm --config {paths.config_file} --host 0.0.0.0 --port 4000" in unit.read_text()
    assert f"EnvironmentFile={paths.env_file}" in unit.read_text()


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
