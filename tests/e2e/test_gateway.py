"""The fleet's entrance end to end (issue 44): Debian's nginx with its njs module (from the hub's archive) as the
front, vllm-router (the hash-pinned requirements, from the hub's PyPI mirror) per served model behind it, routing
to the sandbox rigs' servers.

One 3-host bed, two entrances: gw-01 (no GPU, serves_variant: false) and rig-01 (it serves a variant
too) in group gateway, rig-02 in group rigs. The scenarios run in file order on it: an entrance without
a client is refused before any change; bring-up routes to both rigs from both entrances and answers, refuses a
missing or wrong key and every path off the allowlist, and no key (a client's, or a pod's own, which the
entrance's hop sends it) shows in an argv, a journal or a world-readable file, and one pod's key does not open another; a converged re-run changes nothing; a rig stopped mid-traffic costs no failed request; a variant switch moves
the routes at that converge, and a client removed from the fleet file is refused after it; a run limited to an
entrance reads the rigs outside it; status shows the routes. Two clients' requests and tokens are counted apart on
the entrance's /metrics/.
"""

from __future__ import annotations

import json
import re
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import requests

from rigup.desired.entrance import ROUTER_PORT_BASE
from rigup.desired.gateway import REQUIREMENTS_FILE
from rigup_testbed.fleet import Testbed
from rigup_testbed.hosts import HostSpec
from rigup_testbed.image import REPO_ROOT
from tests.e2e.helpers import assert_secret_private, entrance_url, fleet_ca_file, key_files, pod_key_of, remote_commands
from tests.e2e.test_serving import OTHER_VARIANT, VARIANT, Bed, _tail, models, served_name, sh, unit_prop
from tests.support.tls import fleet_certificate

pytestmark = pytest.mark.e2e

GATEWAY_KEY = "sk-rigup-gateway-e2e-31c9f0a2d7b4"
TEAMMATE_KEY = "sk-rigup-teammate-e2e-8d1e55a0c3"
INTERVAL_S = 3  # gateway_health_check_interval_s: short, so leaving rotation is quick to see
PORT = 4000
CONFIG = "/opt/rigup/gateway/routes.json"
# vLLM's paths its --api-key does not guard (docs/usage/security.md), and the router's own: refused at the front
REFUSED_PATHS = ("/invocations", "/tokenize", "/detokenize", "/pause", "/update_weights", "/metrics", "/v1/load_lora_adapter",
                 "/workers", "/flush_cache")


GATEWAYS = ("gw-01", "rig-01")


def gateway_url(bed: Bed, gateway: str = "gw-01") -> str:
    return entrance_url(bed.host(gateway).ip, PORT)


def trusted(bed: Bed) -> str:
    """The fleet CA's certificate beside the bed's fleet file: what every client of the entrance verifies it with."""
    return fleet_ca_file(bed.fleet)


def chat(bed: Bed, model: str, key: str | None = GATEWAY_KEY, timeout: float = 30, gateway: str = "gw-01",
         session: str | None = None) -> requests.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if session:
        headers["X-Session-ID"] = session
    body = {"model": model, "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 16, "temperature": 0}
    return requests.post(f"{gateway_url(bed, gateway)}/v1/chat/completions", json=body, headers=headers, timeout=timeout,
                         verify=trusted(bed))


def routes(bed: Bed, gateway: str = "gw-01") -> list[tuple[str, str, str]]:
    doc = json.loads(sh(bed.host(gateway), f"cat {CONFIG}"))
    return sorted((e["model"], e["host"], e["api_base"]) for e in doc["routes"])


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
    testbed = testbed_factory(specs, "rigsgw", host_layer=True)
    b = Bed(testbed, testbed.workdir)
    keys = key_files(tmp_path_factory.mktemp("keys"), gateway=GATEWAY_KEY, teammate=TEAMMATE_KEY)
    gateway_key = keys["gateway"]
    b.teammate_key = str(keys["teammate"])  # type: ignore[attr-defined]
    # no serving_api_key_file: every pod carries its own key, made on the control machine (rigup.desired.pod_keys)
    b.data = {**b.data, "gateway_health_check_interval_s": INTERVAL_S}
    b.gateway_key = str(gateway_key)  # type: ignore[attr-defined]
    b.write()
    yield b
    # Down now, not at the session's end: two entrances' routers checking every pod each 3 s would load the
    # machine under the modules after this one.
    testbed.down()


def test_a_gateway_without_its_key_is_refused_before_any_change(bed: Bed) -> None:
    proc = bed.deploy(expect_ok=False)
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    assert any(f"{gateway}: gateway_api_key_file is not set and gateway_clients is empty" in output
               for gateway in GATEWAYS), _tail(proc)
    assert "Traceback" not in output
    for name in ("gw-01", "rig-01", "rig-02"):  # refused while pyinfra prepared the run: nothing ran anywhere
        assert sh(bed.host(name), "test -e /opt/rigup && echo yes || echo no") == "no"


def test_bring_up_routes_to_every_rig_and_answers(bed: Bed) -> None:
    clients = [{"name": "teammate", "key_file": bed.teammate_key}]  # type: ignore[attr-defined]
    bed.group_data = {"gateway": {"gateway_api_key_file": bed.gateway_key, "gateway_clients": clients}}  # type: ignore[attr-defined]
    bed.write(relock=False)
    proc = bed.deploy(expect_ok=False)
    output = proc.stdout + proc.stderr
    failed = [line for line in output.splitlines() if "rror" in line or "rigup:" in line or "failed" in line.lower()]
    assert proc.returncode == 0, "\n".join(failed[-60:])
    name, port, rig2 = served_name(VARIANT), _port(), bed.host("rig-02").ip
    expected = {
        "gw-01": [(name, "rig-01", f"http://{bed.host('rig-01').ip}:{port}/v1"), (name, "rig-02", f"http://{rig2}:{port}/v1")],
        "rig-01": [(name, "rig-01", f"http://127.0.0.1:{port}/v1"), (name, "rig-02", f"http://{rig2}:{port}/v1")],
    }
    router = "rigup-router@" + re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") + ".service"
    for gateway in GATEWAYS:
        gw = bed.host(gateway)
        for unit in ("nginx.service", router):
            assert unit_prop(gw, unit, "ActiveState") == "active", unit
            assert unit_prop(gw, unit, "UnitFileState") == "enabled", unit
        assert routes(bed, gateway) == sorted(expected[gateway])
        for key in (GATEWAY_KEY, TEAMMATE_KEY):  # each client with its own key
            reply = chat(bed, name, key=key, gateway=gateway)
            assert reply.status_code == 200, reply.text
            message = reply.json()["choices"][0]["message"]
            assert message.get("content") or message.get("reasoning_content") or message.get("reasoning"), message
        # Refused without a key or with another one, and off the allowlist (vLLM's unguarded paths first)
        assert chat(bed, name, key=None, gateway=gateway).status_code == 401
        assert chat(bed, name, key="sk-wrong-0123456789abcdef", gateway=gateway).status_code == 401
        assert chat(bed, "no-such-model", gateway=gateway).status_code == 404
        for path in REFUSED_PATHS:
            for method in ("GET", "POST"):
                reply = requests.request(method, f"{gateway_url(bed, gateway)}{path}", json={"model": name, "prompt": "x"},
                                         headers={"Authorization": f"Bearer {GATEWAY_KEY}"}, timeout=30,
                                         verify=trusted(bed))
                assert reply.status_code == 404, (gateway, method, path, reply.status_code)
        # streamed through the front as the pod makes it
        with requests.post(f"{gateway_url(bed, gateway)}/v1/chat/completions", stream=True, timeout=60,
                           headers={"Authorization": f"Bearer {GATEWAY_KEY}"}, verify=trusted(bed),
                           json={"model": name, "stream": True, "max_tokens": 8,
                                 "messages": [{"role": "user", "content": "Hi"}]}) as streamed:
            events = [line for line in streamed.iter_lines() if line.startswith(b"data: ")]
        assert streamed.status_code == 200 and events[-1] == b"data: [DONE]" and len(events) > 2
        # the keys: in the 0600 includes only; none in an argv, a journal, nginx's own files or a file others read
        assert sh(gw, "stat -c '%a %U' /opt/rigup/gateway/clients.map /opt/rigup/gateway/pod-key.conf") == "600 root\n600 root"
        assert sh(gw, "ls /etc/systemd/system/rigup-gateway.service 2>/dev/null || echo none") == "none"  # no LiteLLM
        # each pod's own key, made on the control machine: the entrance's hop holds them (pod-key.conf)
        pod_keys = [pod_key_of(bed.fleet, rig, VARIANT) for rig in ("rig-01", "rig-02")]
        for secret in (GATEWAY_KEY, TEAMMATE_KEY, *pod_keys):
            assert secret not in output
            # on no argv, in no journal line, and only in files their owner alone reads: root's (nginx's includes,
            # the last good record; a serving rig's 0600 key file), or prometheus' (the
            # monitor's scrape key)
            assert assert_secret_private(gw, secret), (gateway, secret[:4])
        assert sh(gw, "sudo grep -c Bearer /opt/rigup/gateway/pod-key.conf") == "2"  # the hop's map: a key per pod
    # pod A's key does not open pod B: each pod takes its own key alone, on its rig and nowhere else readable
    port = _port()
    for rig, other in (("rig-01", "rig-02"), ("rig-02", "rig-01")):
        host = bed.host(rig)
        assert models(host, port)[0] == 401 and models(host, port, pod_key_of(bed.fleet, other, VARIANT))[0] == 401
        assert models(host, port, pod_key_of(bed.fleet, rig, VARIANT))[0] == 200
        holders = assert_secret_private(host, pod_key_of(bed.fleet, rig, VARIANT))
        assert f"600 root /opt/rigup/variants/{VARIANT}/secrets/VLLM_API_KEY" in holders, holders
        version = sh(gw, "/opt/rigup/gateway/venv-*/bin/pip show vllm-router | sed -n 's/^Version: //p'")
        assert version and f"vllm-router=={version} " in REQUIREMENTS_FILE.read_text()
    # rigup verify's checks (models, completion, tool call) pass through the entrance as on a rig, its certificate
    # checked against the fleet CA's (no --ca-file: the fleet file's entrance at that address)
    proc = subprocess.run([sys.executable, "-m", "rigup", "verify", "--url", gateway_url(bed), "--api-key-file",
                           bed.gateway_key, "--json"], cwd=REPO_ROOT, env=bed.env(),  # type: ignore[attr-defined]
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    # the gateway-only box got no driver, Docker or variant
    box = bed.host("gw-01")
    assert sh(box, "ls /opt/rigup") == "bin\ngateway"  # bin: rigup-quarantine-routes (tasks/quarantine_routes.py)
    assert sh(box, "command -v docker nvidia-smi || true") == ""
    assert "Wait for the entrance to answer" in output
    assert ROUTER_PORT_BASE  # the router listens on loopback only: the front is the one way in
    assert sh(box, f"ss -Hltn 'sport = :{ROUTER_PORT_BASE}' | awk '{{print $4}}'") == f"127.0.0.1:{ROUTER_PORT_BASE}"


def _port() -> int:
    from tests.e2e.test_serving import port_of

    return port_of(VARIANT)


def test_the_entrance_answers_https_with_the_fleet_cas_chain_and_refuses_a_client_of_another_ca(
    bed: Bed, tmp_path: Path
) -> None:
    ca = trusted(bed)
    for gateway in GATEWAYS:
        gw = bed.host(gateway)
        # the chain: the certificate the fleet CA issued for the host's names, verified as any TLS client does
        context = ssl.create_default_context(cafile=ca)
        with socket.create_connection((gw.ip, PORT), timeout=10) as raw, \
                context.wrap_socket(raw, server_hostname=gw.ip) as tls:
            seen = tls.getpeercert()
            version = tls.version()
        assert ("IP Address", gw.ip) in seen["subjectAltName"] and ("DNS", gateway) in seen["subjectAltName"], seen
        assert dict(item[0] for item in seen["issuer"])["commonName"] == "rigup fleet CA"
        assert version in ("TLSv1.2", "TLSv1.3")
        assert sh(gw, "stat -c '%a %U' /opt/rigup/gateway/tls.key") == "600 root"
        assert sh(gw, "openssl verify -CAfile /opt/rigup/gateway/tls-ca.crt /opt/rigup/gateway/tls.crt").endswith(": OK")
        # plain HTTP to the front: nginx's 400, never an answer from a route
        plain = requests.get(f"http://{gw.ip}:{PORT}/v1/models", headers={"Authorization": f"Bearer {GATEWAY_KEY}"},
                             timeout=10)
        assert plain.status_code == 400, plain.text
    # a client that trusts another CA is refused at the handshake: requests, and rigup verify with one line
    other = fleet_certificate(tmp_path / "other-ca").ca_cert
    with pytest.raises(requests.exceptions.SSLError):
        requests.get(f"{gateway_url(bed)}/health", timeout=10, verify=str(other))
    proc = subprocess.run([sys.executable, "-m", "rigup", "verify", "--url", gateway_url(bed), "--api-key-file",
                           bed.gateway_key, "--ca-file", str(other), "--json"],  # type: ignore[attr-defined]
                          cwd=REPO_ROOT, env=bed.env(), capture_output=True, text=True, timeout=120)
    [host] = json.loads(proc.stdout)["hosts"]
    assert proc.returncode == 1 and [(r["check"], r["outcome"]) for r in host["results"]] == [("tls", "fail")], proc.stdout
    assert host["results"][0]["detail"] == (f"TLS refused: its certificate is not signed by the CA in {other} "
                                            f"({gateway_url(bed)})")


def test_a_converged_rerun_changes_nothing(bed: Bed) -> None:
    before = unit_prop(bed.host("rig-01"), "nginx.service", "ExecMainStartTimestamp")
    result = bed.deploy_json()
    changed = {op["name"]: op["success"] for op in result["results"]["operations"] if op["success"]}
    assert changed == {}, f"operations that changed on a converged re-run: {changed}"
    assert unit_prop(bed.host("rig-01"), "nginx.service", "ExecMainStartTimestamp") == before
    proc = bed.deploy()  # what a converged re-run sends each host, the entrances' route reads included
    assert max(remote_commands(proc.stdout + proc.stderr).values()) <= 2, proc.stdout[-3000:]


def client_usage(bed: Bed, gateway: str = "gw-01") -> dict[str, float]:
    """The per-client series of the entrance's /metrics/ (rigup-entrance-usage's, joined with the routers')."""
    reply = requests.get(f"{gateway_url(bed, gateway)}/metrics/", headers={"Authorization": f"Bearer {GATEWAY_KEY}"},
                         timeout=30, verify=trusted(bed))
    assert reply.status_code == 200, reply.text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in reply.text.splitlines()
            if line.startswith("rigup_gateway_client_")}


def streamed_usage(bed: Bed, model: str, key: str, include_usage: bool) -> dict[str, int] | None:
    body = {"model": model, "stream": True, "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}],
            **({"stream_options": {"include_usage": True}} if include_usage else {})}
    with requests.post(f"{gateway_url(bed)}/v1/chat/completions", stream=True, timeout=60, json=body,
                       headers={"Authorization": f"Bearer {key}"}, verify=trusted(bed)) as reply:
        events = [line[6:] for line in reply.iter_lines() if line.startswith(b"data: {")]
    assert reply.status_code == 200 and events
    usages = [json.loads(e)["usage"] for e in events if json.loads(e).get("usage")]
    return usages[-1] if usages else None


def test_usage_is_counted_per_client_on_the_entrances_metrics(bed: Bed) -> None:
    """Two clients' requests and tokens are counted apart (rigup-entrance-usage, from nginx's usage log, joined
    into /metrics/): tokens from each answer's usage, a stream's where it asked for it, and a stream without
    it counted as a request whose tokens were not seen."""
    name = served_name(VARIANT)
    who = {client: f'client="{client}",model="{name}"' for client in ("default", "teammate")}
    before = client_usage(bed)
    expected: dict[str, float] = {}

    def add(series: str, value: float) -> None:
        expected[series] = expected.get(series, 0.0) + value

    for client, key, turns in (("default", GATEWAY_KEY, 3), ("teammate", TEAMMATE_KEY, 1)):
        for _ in range(turns):
            reply = chat(bed, name, key=key)
            assert reply.status_code == 200, reply.text
            add(f'rigup_gateway_client_requests_total{{{who[client]},code="200"}}', 1)
            add(f"rigup_gateway_client_prompt_tokens_total{{{who[client]}}}", reply.json()["usage"]["prompt_tokens"])
            add(f"rigup_gateway_client_completion_tokens_total{{{who[client]}}}", reply.json()["usage"]["completion_tokens"])
    usage = streamed_usage(bed, name, TEAMMATE_KEY, include_usage=True)
    assert usage is not None
    add(f'rigup_gateway_client_requests_total{{{who["teammate"]},code="200"}}', 1)
    add(f"rigup_gateway_client_prompt_tokens_total{{{who['teammate']}}}", usage["prompt_tokens"])
    add(f"rigup_gateway_client_completion_tokens_total{{{who['teammate']}}}", usage["completion_tokens"])
    assert streamed_usage(bed, name, TEAMMATE_KEY, include_usage=False) is None
    add(f'rigup_gateway_client_requests_total{{{who["teammate"]},code="200"}}', 1)
    add(f"rigup_gateway_client_unmetered_requests_total{{{who['teammate']}}}", 1)
    assert chat(bed, name, key=None).status_code == 401  # no client: not counted

    def grown() -> dict[str, float]:
        now = client_usage(bed)
        return {series: now.get(series, 0.0) - before.get(series, 0.0) for series in expected}

    wait_for(lambda: grown() == expected, 30, f"the counters to grow by {expected}")
    print(f"usage per client counted apart: {grown()}")
    now = client_usage(bed)
    assert not any('client=""' in series for series in now)
    assert all(secret not in "".join(now) for secret in (GATEWAY_KEY, TEAMMATE_KEY))


def test_a_rig_stopped_mid_traffic_costs_no_failed_request(bed: Bed) -> None:
    name = served_name(VARIANT)
    rig2 = bed.host("rig-02")
    codes: list[int] = []
    stop_at = time.monotonic() + 4 * INTERVAL_S

    def client(index: int) -> None:
        turn = 0
        while time.monotonic() < stop_at:  # sessions of their own: some hash to rig-02
            codes.append(chat(bed, name, session=f"session-{index}-{turn % 4}").status_code)
            turn += 1

    clients = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for thread in clients:
        thread.start()
    try:
        time.sleep(INTERVAL_S)  # traffic flowing to both rigs first
        sh(rig2, f"systemctl kill -s KILL rigup-{VARIANT}.service; systemctl stop rigup-{VARIANT}.service")
        for thread in clients:
            thread.join()
        assert codes and set(codes) == {200}, {c: codes.count(c) for c in set(codes)}
        print(f"rig-02 stopped under 4 streams of session traffic: {len(codes)} requests, all answered")
    finally:
        for thread in clients:
            thread.join()
        sh(rig2, f"systemctl start rigup-{VARIANT}.service")
    wait_for(lambda: chat(bed, name).status_code == 200, 120, "the entrance to answer after rig-02 is back")


def test_a_variant_switch_moves_the_routes_at_that_converge(bed: Bed) -> None:
    # ... and the teammate, removed from the fleet file, is refused after the same converge
    bed.group_data = {**bed.group_data, "rigs": {"variant": OTHER_VARIANT},
                      "gateway": {"gateway_api_key_file": bed.gateway_key}}  # type: ignore[attr-defined]
    bed.write()
    bed.deploy()
    new, old = served_name(OTHER_VARIANT), served_name(VARIANT)
    for gateway in GATEWAYS:
        assert {(model, host) for model, host, _ in routes(bed, gateway)} == {(new, "rig-02"), (old, "rig-01")}
        reply = chat(bed, new, gateway=gateway)
        assert reply.status_code == 200, reply.text
        assert chat(bed, new, key=TEAMMATE_KEY, gateway=gateway).status_code == 401
        models = requests.get(f"{gateway_url(bed, gateway)}/v1/models",
                              headers={"Authorization": f"Bearer {GATEWAY_KEY}"}, timeout=30, verify=trusted(bed))
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
        port = _port()
        rig1 = "127.0.0.1" if gateway == "rig-01" else bed.host("rig-01").ip
        assert seen == sorted([f"http://{rig1}:{port}", f"http://{bed.host('rig-02').ip}:{port}"]), items[gateway]
        assert all(i["state"] == "ok" for i in items[gateway] if i["item"].startswith("route "))
    assert "gateway" not in {i["item"] for i in items["rig-02"]}
    assert GATEWAY_KEY not in proc.stdout + proc.stderr
