"""The fleet gateway end to end: the real LiteLLM proxy (the hash-pinned requirements, installed on the
gateway host from the hub's PyPI mirror) routing to the sandbox rigs' servers.

One 3-host bed, two gateways: gw-01 (no GPU, serves_variant: false) and rig-01 (it serves a variant
too) in group gateway, rig-02 in group rigs. The scenarios run in file order on it: a gateway without
its key is refused before any change; bring-up routes to both rigs from both gateways and answers; a
converged re-run changes nothing; a stopped rig leaves rotation while the gateway keeps answering; a
variant switch moves the routes at that converge; a run limited to a gateway reads the rigs outside it
(a rig switched in a run of its own is routed to by the gateway's next run); status shows the routes.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import requests
import yaml

from rigup.desired.gateway import REQUIREMENTS_FILE
from rigup_testbed.fleet import Testbed
from rigup_testbed.hosts import HostSpec
from rigup_testbed.image import REPO_ROOT
from tests.e2e.helpers import key_files
from tests.e2e.test_serving import API_KEY, OTHER_VARIANT, VARIANT, Bed, _tail, served_name, sh, unit_prop

pytestmark = pytest.mark.e2e

GATEWAY_KEY = "sk-rigup-gateway-e2e-31c9f0a2d7b4"
INTERVAL_S = 3  # gateway_health_check_interval_s: short, so leaving rotation is quick to see
PORT = 4000
CONFIG = "/opt/rigup/gateway/config.yaml"


GATEWAYS = ("gw-01", "rig-01")


def gateway_url(bed: Bed, gateway: str = "gw-01") -> str:
    return f"http://{bed.host(gateway).ip}:{PORT}"


def chat(bed: Bed, model: str, key: str | None = GATEWAY_KEY, timeout: float = 30, gateway: str = "gw-01") -> requests.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"model": model, "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 16, "temperature": 0}
    return requests.post(f"{gateway_url(bed, gateway)}/v1/chat/completions", json=body, headers=headers, timeout=timeout)


def routes(bed: Bed, gateway: str = "gw-01") -> list[tuple[str, str, str]]:
    doc = yaml.safe_load(sh(bed.host(gateway), f"cat {CONFIG}"))
    return sorted((e["model_name"], e["model_info"]["rigup_host"], e["litellm_params"]["api_base"])
                  for e in doc["model_list"])


def health(bed: Bed, gateway: str = "gw-01") -> dict[str, Any]:
    reply = requests.get(f"{gateway_url(bed, gateway)}/health", headers={"Authorization": f"Bearer {GATEWAY_KEY}"},
                         timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> float:
    started = time.monotonic()
    while not predicate():
        assert time.monotonic() - started < timeout, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.5)
    return time.monotonic() - started


@pytest.fixture(scope="module")
def bed(testbed_factory: Callable[..., Testbed], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bed]:
    specs = [HostSpec("gw-01", hardware="none", group="gateway", data={"serves_variant": False}), HostSpec("rig-01", group="gateway"),
             HostSpec("rig-02", group="rigs")]
    testbed = testbed_factory(specs, "rigsgw")
    b = Bed(testbed, testbed.workdir)
    keys = key_files(tmp_path_factory.mktemp("keys"), rig=API_KEY, gateway=GATEWAY_KEY)
    rig_key, gateway_key = keys["rig"], keys["gateway"]
    b.data = {**b.data, "serving_api_key_file": str(rig_key), "gateway_health_check_interval_s": INTERVAL_S}
    b.gateway_key = str(gateway_key)  # type: ignore[attr-defined]
    b.write()
    yield b
    # Down now, not at the session's end: two LiteLLM proxies checking every route each 3 s would load the
    # machine under the modules after this one.
    testbed.down()


def test_a_gateway_without_its_key_is_refused_before_any_change(bed: Bed) -> None:
    proc = bed.deploy(expect_ok=False)
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    assert any(f"{gateway}: gateway_api_key_file is not set" in output for gateway in GATEWAYS), _tail(proc)
    assert "Traceback" not in output
    for name in ("gw-01", "rig-01", "rig-02"):  # refused while pyinfra prepared the run: nothing ran anywhere
        assert sh(bed.host(name), "test -e /opt/rigup && echo yes || echo no") == "no"


def test_bring_up_routes_to_every_rig_and_answers(bed: Bed) -> None:
    bed.group_data = {"gateway": {"gateway_api_key_file": bed.gateway_key}}  # type: ignore[attr-defined]
    bed.write(relock=False)
    proc = bed.deploy()
    output = proc.stdout + proc.stderr
    name, port, rig2 = served_name(VARIANT), _port(), bed.host("rig-02").ip
    expected = {
        "gw-01": [(name, "rig-01", f"http://{bed.host('rig-01').ip}:{port}/v1"), (name, "rig-02", f"http://{rig2}:{port}/v1")],
        "rig-01": [(name, "rig-01", f"http://127.0.0.1:{port}/v1"), (name, "rig-02", f"http://{rig2}:{port}/v1")],
    }
    for gateway in GATEWAYS:
        gw = bed.host(gateway)
        assert unit_prop(gw, "rigup-gateway.service", "ActiveState") == "active"
        assert unit_prop(gw, "rigup-gateway.service", "UnitFileState") == "enabled"
        assert routes(bed, gateway) == sorted(expected[gateway])
        reply = chat(bed, name, gateway=gateway)
        assert reply.status_code == 200, reply.text
        message = reply.json()["choices"][0]["message"]
        assert message.get("content") or message.get("reasoning_content"), message
        # Refused without the key or with another one. (LiteLLM answers a wrong key with 400 "No connected
        # db.": it looks keys other than the master key up as virtual keys, and there is no database.)
        missing = chat(bed, name, key=None, gateway=gateway)
        assert missing.status_code == 401 and "No api key passed in" in missing.text, missing.text
        refused = chat(bed, name, key="sk-wrong", gateway=gateway)
        assert refused.status_code in (400, 401) and "choices" not in refused.text
        # the keys: in the 0600 environment file only
        assert sh(gw, "stat -c '%a %U' /opt/rigup/gateway/gateway.env") == "600 root"
        for secret in (GATEWAY_KEY, API_KEY):
            assert secret not in output
            assert secret not in sh(gw, "ps -eo args")
            assert secret not in sh(gw, f"cat {CONFIG} /etc/systemd/system/rigup-gateway.service")
            assert secret not in sh(gw, "journalctl -u rigup-gateway.service --no-pager -o cat", check=False)
        version = sh(gw, "/opt/rigup/gateway/venv-*/bin/pip show litellm | sed -n 's/^Version: //p'")
        assert version and f"litellm=={version} " in REQUIREMENTS_FILE.read_text()
    # rigup verify's checks (models, completion, tool call) pass through the gateway as on a rig
    proc = subprocess.run([sys.executable, "-m", "rigup", "verify", "--url", gateway_url(bed), "--api-key-file",
                           bed.gateway_key, "--json"], cwd=REPO_ROOT, env=bed.env(),  # type: ignore[attr-defined]
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    # the gateway-only box got no driver, Docker or variant
    box = bed.host("gw-01")
    assert sh(box, "ls /opt/rigup") == "gateway"
    assert sh(box, "command -v docker nvidia-smi || true") == ""
    assert "Wait for the gateway to answer" in output


def _port() -> int:
    from tests.e2e.test_serving import port_of

    return port_of(VARIANT)


def test_a_converged_rerun_changes_nothing(bed: Bed) -> None:
    before = unit_prop(bed.host("rig-01"), "rigup-gateway.service", "ExecMainStartTimestamp")
    result = bed.deploy_json()
    changed = {op["name"]: op["success"] for op in result["results"]["operations"] if op["success"]}
    assert changed == {}, f"operations that changed on a converged re-run: {changed}"
    assert unit_prop(bed.host("rig-01"), "rigup-gateway.service", "ExecMainStartTimestamp") == before


def test_a_stopped_rig_leaves_rotation_and_the_gateway_keeps_answering(bed: Bed) -> None:
    name = served_name(VARIANT)
    rig2 = bed.host("rig-02")
    sh(rig2, f"systemctl stop rigup-{VARIANT}.service")
    try:
        started = time.monotonic()
        codes = []
        while time.monotonic() - started < 2 * INTERVAL_S:
            codes.append(chat(bed, name).status_code)  # retried on rig-01 when it lands on rig-02
        assert set(codes) == {200}, codes

        def rig2_out() -> bool:
            unhealthy = [e.get("model_id") for e in health(bed)["unhealthy_endpoints"]]
            return f"rig-02/rigup-{VARIANT}.service" in unhealthy

        waited = wait_for(rig2_out, 10 * INTERVAL_S, "rig-02 to be reported unhealthy")
        print(f"rig-02 stopped: {len(codes)} requests in {2 * INTERVAL_S} s, all answered; /health reports it "
              f"unhealthy {time.monotonic() - started:.1f} s after the stop (waited {waited:.1f} s for it)")
    finally:
        sh(rig2, f"systemctl start rigup-{VARIANT}.service")
    wait_for(lambda: chat(bed, name).status_code == 200, 120, "the gateway to answer after rig-02 is back")


def test_a_variant_switch_moves_the_routes_at_that_converge(bed: Bed) -> None:
    bed.group_data = {**bed.group_data, "rigs": {"variant": OTHER_VARIANT}}
    bed.write()
    bed.deploy()
    new, old = served_name(OTHER_VARIANT), served_name(VARIANT)
    for gateway in GATEWAYS:
        assert {(model, host) for model, host, _ in routes(bed, gateway)} == {(new, "rig-02"), (old, "rig-01")}
        reply = chat(bed, new, gateway=gateway)
        assert reply.status_code == 200, reply.text
        models = requests.get(f"{gateway_url(bed, gateway)}/v1/models",
                              headers={"Authorization": f"Bearer {GATEWAY_KEY}"}, timeout=30)
        assert {m["id"] for m in models.json()["data"]} == {new, old}


def test_a_run_limited_to_a_gateway_reads_the_rigs_outside_it(bed: Bed) -> None:
    """A rig switched in a run of its own (--limit, as a rollout step does) is routed to by the next run
    of the gateway alone: the gateway reads every rig when it writes its routes."""
    before = routes(bed)
    result = bed.deploy_json("--limit", "gw-01")
    changed = {op["name"]: op["success"] for op in result["results"]["operations"] if op["success"]}
    assert changed == {}, changed  # nothing moved: the same routes
    assert routes(bed) == before and {host for _, host, _ in before} == {"rig-01", "rig-02"}
    bed.group_data = {**bed.group_data, "rigs": {"variant": VARIANT}}
    bed.write(relock=False)
    bed.deploy("--limit", "rig-02")
    assert routes(bed) == before  # gw-01 was not in that run
    bed.deploy("--limit", "gw-01")
    name = served_name(VARIANT)
    assert {(model, host) for model, host, _ in routes(bed)} == {(name, "rig-01"), (name, "rig-02")}
    bed.deploy()  # rig-01's gateway too


def test_status_shows_each_gateway_and_its_routes(bed: Bed) -> None:
    proc = subprocess.run([sys.executable, "-m", "rigup", "status", "--json"], cwd=REPO_ROOT, env=bed.env(),
                          capture_output=True, text=True, timeout=300)
    document = json.loads(proc.stdout)
    items = {h["host"]: h["items"] for h in document["hosts"]}
    for gateway in GATEWAYS:
        [answer] = [i for i in items[gateway] if i["item"] == "gateway"]
        assert answer["state"] == "ok" and answer["actual"].startswith("ready"), items[gateway]
        seen = sorted(i["actual"].split()[1] for i in items[gateway] if i["item"].startswith("route "))
        assert seen == [f"rig-01/rigup-{VARIANT}.service", f"rig-02/rigup-{VARIANT}.service"], items[gateway]
        assert all(i["state"] == "ok" for i in items[gateway] if i["item"].startswith("route "))
    assert "gateway" not in {i["item"] for i in items["rig-02"]}
    assert GATEWAY_KEY not in proc.stdout + proc.stderr
