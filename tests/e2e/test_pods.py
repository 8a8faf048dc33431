"""Pods end to end: several endpoints per rig, each on GPUs of its own, behind the fleet gateway.

One 2-host bed: quad (4x RTX 3090, in group gateway: it also runs the gateway) serves two `dual` pods
on GPUs 0-1 and 2-3; tri (3x RTX 3090) serves a `dual` pod and a `single` pod, since the 27B model
cannot split 3 ways. The stand-in engine holds its GPU memory budget on the GPUs its container was
given and dies when they lack the room, as vLLM does: two pods on one GPU would fail their gates. The
scenarios run in file order: a port used twice is refused before any change; bring-up; a converged
re-run changes nothing (each pod keyed with its own key, which its neighbour's does not open); one pod's override
restarts that pod alone; the gateway routes to every pod (its hop sending each pod its key);
status reports each pod; dropping a pod stops its unit.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from rigup_testbed.fleet import Testbed
from rigup_testbed.hosts import HostSpec
from rigup_testbed.image import REPO_ROOT
from tests.e2e.helpers import entrance_url, fleet_ca_file, key_files, pod_key_of, remote_commands
from tests.e2e.test_serving import Bed, _tail, port_of, served_name, serving_ops, sh, unit_prop

pytestmark = pytest.mark.e2e

GATEWAY_KEY = "sk-rigup-pods-e2e-5d21c7e9a04b"
GATEWAY_PORT = 4000
DUAL, SINGLE = "dual", "single"
QUAD_PODS = [
    {"name": "left", "variant": DUAL, "gpus": [0, 1], "port": 8030},
    {"name": "right", "variant": DUAL, "gpus": [2, 3], "port": 8031},
]
TRI_PODS = [
    {"name": "pair", "variant": DUAL, "gpus": [0, 1]},
    {"name": "solo", "variant": SINGLE, "gpus": 1},  # a count: the lowest GPU no other pod names (2)
]
UNITS = {"quad": ("rigup-left.service", "rigup-right.service"), "tri": ("rigup-pair.service", "rigup-solo.service")}


def write(bed: Bed, quad: list[dict[str, Any]], tri: list[dict[str, Any]], *, relock: bool = False) -> None:
    bed.group_data = {"gateway": {"pods": quad, "gateway_api_key_file": bed.gateway_key},  # type: ignore[attr-defined]
                      "rigs": {"pods": tri}}
    bed.write(relock=relock)


def started_at(bed: Bed, host: str, unit: str) -> str:
    return unit_prop(bed.host(host), unit, "ExecMainStartTimestampMonotonic")


def gpu_requests(bed: Bed, host: str, pod: str) -> list[str]:
    """The GPU indices the pod's container asked Docker for (its device reservation)."""
    raw = sh(bed.host(host), f"docker inspect --format '{{{{json .HostConfig.DeviceRequests}}}}' rigup-{pod}")
    return [i for request in json.loads(raw) or [] for i in request.get("DeviceIDs") or []]


def memory_used(bed: Bed, host: str) -> list[int]:
    out = sh(bed.host(host), "nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits")
    return [int(line.split(",")[1]) for line in out.splitlines()]


def models_at(bed: Bed, host: str, port: int, pod: str) -> list[str]:
    """The pod's /v1/models, asked with its own key (made on the control machine: rigup.desired.pod_keys)."""
    reply = requests.get(f"http://{bed.host(host).ip}:{port}/v1/models",
                         headers={"Authorization": f"Bearer {pod_key_of(bed.fleet, host, pod)}"}, timeout=30)
    assert reply.status_code == 200, reply.text
    return [m["id"] for m in reply.json()["data"]]


def status_with_key(bed: Bed, host: str, port: int, key: str | None) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return requests.get(f"http://{bed.host(host).ip}:{port}/v1/models", headers=headers, timeout=30).status_code


@pytest.fixture(scope="module")
def bed(testbed_factory: Callable[..., Testbed], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bed]:
    specs = [HostSpec("quad", hardware="4x3090", group="gateway"), HostSpec("tri", hardware="3x3090", group="rigs")]
    testbed = testbed_factory(specs, "rigpods", host_layer=True)
    b = Bed(testbed, testbed.workdir)
    gateway_key = key_files(tmp_path_factory.mktemp("keys"), gateway=GATEWAY_KEY)["gateway"]
    # no serving_api_key_file: every pod carries its own key (rigup.desired.pod_keys)
    b.data = {"serving_health_timeout_s": b.data["serving_health_timeout_s"], "gateway_health_check_interval_s": 3}
    b.gateway_key = str(gateway_key)  # type: ignore[attr-defined]
    write(b, QUAD_PODS, TRI_PODS, relock=True)
    yield b
    testbed.down()  # its gateway checks every route each 3 s: not under the modules after this one


def test_a_port_two_pods_publish_is_refused_before_any_change(bed: Bed) -> None:
    write(bed, [QUAD_PODS[0], {**QUAD_PODS[1], "port": QUAD_PODS[0]["port"]}], TRI_PODS)
    proc = bed.deploy(expect_ok=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    # the fleet file check refuses it, naming the file, the host and the knob
    assert (f"{bed.fleet.resolve()}: group 'gateway' data: 'pods': pods: port 8030 is published by both pod left "
            "(dual) and pod right (dual): give each pod its own 'port'") in output, _tail(proc)
    assert "Traceback" not in output
    assert sh(bed.host("quad"), "test -e /opt/rigup && echo yes || echo no") == "no"


def test_bring_up_serves_every_pod_on_its_own_gpus(bed: Bed) -> None:
    write(bed, QUAD_PODS, TRI_PODS)
    proc = bed.deploy()
    assert "Traceback" not in proc.stdout + proc.stderr
    expected = {
        "quad": [("left", QUAD_PODS[0]["port"], ["0", "1"]), ("right", QUAD_PODS[1]["port"], ["2", "3"])],
        "tri": [("pair", port_of(DUAL), ["0", "1"]), ("solo", port_of(SINGLE), ["2"])],
    }
    for host, pods in expected.items():
        rig = bed.host(host)
        for pod, port, gpus in pods:
            unit = f"rigup-{pod}.service"
            assert unit_prop(rig, unit, "ActiveState") == "active"
            assert unit_prop(rig, unit, "UnitFileState") == "enabled"
            assert gpu_requests(bed, host, pod) == gpus
            assert models_at(bed, host, port, pod) == [served_name(DUAL if pod != "solo" else SINGLE)]
            record = json.loads(sh(rig, f"cat /opt/rigup/state/pods/{pod}/provenance.json"))
            assert record["pod"] == pod and record["gate"]["result"] == "passed"
            assert record["release"]["gpu_ids"] == [int(g) for g in gpus]
        # each pod takes its own key alone: none, or its neighbour's on the same rig, is refused
        (first, first_port, _), (second, second_port, _) = pods
        assert status_with_key(bed, host, first_port, None) == 401
        assert status_with_key(bed, host, first_port, pod_key_of(bed.fleet, host, second)) == 401
        assert status_with_key(bed, host, second_port, pod_key_of(bed.fleet, host, first)) == 401
        # every card holds a pod's engine (a pod on another's GPUs would have died for lack of memory)
        assert all(used > 20000 for used in memory_used(bed, host)), memory_used(bed, host)
        assert sh(rig, "test -e /opt/rigup/state/provenance.json && echo yes || echo no") == "no"


def test_converged_rerun_reports_zero_changes(bed: Bed) -> None:
    before = {(h, u): started_at(bed, h, u) for h, units in UNITS.items() for u in units}
    proc = bed.pyinfra("--json", "deploy.py")
    assert proc.returncode == 0, _tail(proc)
    changed = [op["name"] for op in json.loads(proc.stdout)["results"]["operations"] if op["success"]]
    assert changed == [], changed
    assert before == {(h, u): started_at(bed, h, u) for h, units in UNITS.items() for u in units}
    # two pods cost no more round trips than one variant: every fact read once, in one batch
    counts = remote_commands(proc.stderr)
    assert set(counts) == {"quad", "tri"} and all(n <= 15 for n in counts.values()), counts


def test_one_pods_override_restarts_that_pod_alone(bed: Bed) -> None:
    before = {(h, u): started_at(bed, h, u) for h, units in UNITS.items() for u in units}
    right = {**QUAD_PODS[1], "variant_overrides": {"max_num_seqs": 1}}
    write(bed, [QUAD_PODS[0], right], TRI_PODS)
    result = bed.deploy_json()
    after = {(h, u): started_at(bed, h, u) for h, units in UNITS.items() for u in units}
    restarted = sorted(key for key in before if before[key] != after[key])
    assert restarted == [("quad", "rigup-right.service")], restarted
    # One gate ran, on quad. (Not judged by operation names: pyinfra makes one operation of the same line
    # and loop position on every host and names it after the host that reached it first, so quad's second
    # pod's gate can be listed as "[pod solo]", tri's second pod.)
    gated = [(op["name"], sorted(op["success"])) for op in serving_ops(result) if op["success"] and "Health-gate" in op["name"]]
    assert len(gated) == 1 and gated[0][1] == ["quad"], gated
    command = sh(bed.host("quad"), "docker inspect --format '{{json .Args}}' rigup-right")
    assert '"--max-num-seqs","1"' in command.replace(" ", "")


def test_the_gateway_routes_to_every_pod(bed: Bed) -> None:
    doc = json.loads(sh(bed.host("quad"), "cat /opt/rigup/gateway/routes.json"))
    routes = sorted((e["model"], e["host"], e["unit"], e["api_base"]) for e in doc["routes"])
    dual, single, tri = served_name(DUAL), served_name(SINGLE), bed.host("tri").ip
    assert routes == sorted([
        (dual, "quad", "rigup-left.service", f"http://127.0.0.1:{QUAD_PODS[0]['port']}/v1"),
        (dual, "quad", "rigup-right.service", f"http://127.0.0.1:{QUAD_PODS[1]['port']}/v1"),
        (dual, "tri", "rigup-pair.service", f"http://{tri}:{port_of(DUAL)}/v1"),
        (single, "tri", "rigup-solo.service", f"http://{tri}:{port_of(SINGLE)}/v1"),
    ])
    url = entrance_url(bed.host('quad').ip, GATEWAY_PORT)
    for model in {dual, single}:
        body = {"model": model, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8, "temperature": 0}
        reply = requests.post(f"{url}/v1/chat/completions", json=body, verify=fleet_ca_file(bed.fleet),
                              headers={"Authorization": f"Bearer {GATEWAY_KEY}"}, timeout=60)
        assert reply.status_code == 200, reply.text


def test_status_reports_each_pod(bed: Bed) -> None:
    proc = subprocess.run([sys.executable, "-m", "rigup", "status", "--json"], cwd=REPO_ROOT, env=bed.env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    hosts = {h["host"]: h for h in json.loads(proc.stdout)["hosts"]}
    assert sorted(hosts) == ["quad/left", "quad/right", "tri/pair", "tri/solo"]
    for name, status in hosts.items():
        assert status["verdict"] == "OK", (name, status)
        assert not any(item["item"] == "other variants" for item in status["items"]), status


def test_verify_and_bench_take_one_pod(bed: Bed, tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "rigup", "verify", "--json", "--limit", "quad/right"], cwd=REPO_ROOT,
                          env=bed.env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (report,) = json.loads(proc.stdout)["hosts"]
    assert (report["host"], report["url"]) == ("quad/right", f"http://{bed.host('quad').ip}:{QUAD_PODS[1]['port']}")
    assert report["failed"] == 0 and {r["check"] for r in report["results"]} >= {"models", "completion"}
    proc = subprocess.run([sys.executable, "-m", "rigup", "bench", "--json", "--limit", "tri/solo", "--only", "narr",
                           "--warmups", "0", "--runs", "1", "--results-dir", str(tmp_path), "--no-chart"],
                          cwd=REPO_ROOT, env=bed.env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (document,) = json.loads(proc.stdout)["results"]
    assert (document["host"], document["variant"]) == ("tri/solo", SINGLE)
    assert [p.parent.name for p in tmp_path.glob("*/*.json")] == ["tri_solo"]  # saved per pod


def test_dropping_a_pod_stops_its_unit(bed: Bed) -> None:
    pair_started = started_at(bed, "tri", "rigup-pair.service")
    write(bed, QUAD_PODS, TRI_PODS[:1])
    bed.deploy()
    tri = bed.host("tri")
    assert unit_prop(tri, "rigup-solo.service", "ActiveState") == "inactive"
    assert unit_prop(tri, "rigup-solo.service", "UnitFileState") == "disabled"
    assert unit_prop(tri, "rigup-pair.service", "ActiveState") == "active"
    assert started_at(bed, "tri", "rigup-pair.service") == pair_started  # the pod that stays keeps running
    doc = json.loads(sh(bed.host("quad"), "cat /opt/rigup/gateway/routes.json"))
    assert [e["unit"] for e in doc["routes"] if e["host"] == "tri"] == ["rigup-pair.service"]


# apt's own hook, run before every dpkg invocation: which rigup units were active then, in which boot
WITNESS = "/usr/local/sbin/rigup-e2e-dpkg-witness"
WITNESS_SCRIPT = """#!/bin/sh
units=$(systemctl list-units --state=active --no-legend --plain 'rigup-*.service' | cut -d' ' -f1 | xargs)
echo "$(cat /proc/sys/kernel/random/boot_id) $units" >> /var/log/rigup-e2e-dpkg-witness
"""


def test_a_driver_change_stops_every_pod_first_and_brings_them_back(bed: Bed) -> None:
    """A driver swap under running pods: the driver task stops each pod's unit (not rigup-<variant>)
    before apt touches the driver, reboots, and the pods serve again after the health gate."""
    quad = bed.host("quad")
    boots, boot_id = quad.boots(), sh(quad, "cat /proc/sys/kernel/random/boot_id").strip()
    for unit in UNITS["quad"]:
        assert unit_prop(quad, unit, "ActiveState") == "active", unit
    script = base64.b64encode(WITNESS_SCRIPT.encode()).decode()
    sh(quad, f"echo {script} | base64 -d | sudo tee {WITNESS} >/dev/null && sudo chmod 755 {WITNESS}")
    sh(quad, f"echo 'DPkg::Pre-Invoke {{\"{WITNESS}\";}};' | sudo tee /etc/apt/apt.conf.d/99rigup-e2e-witness >/dev/null")
    bed.group_data["gateway"]["nvidia_driver_flavour"] = "proprietary"  # type: ignore[attr-defined]
    bed.write(relock=False)  # open -> proprietary: the same branch, another driver, installed and rebooted into
    bed.deploy()

    assert quad.boots() == boots + 1
    assert sh(quad, "dpkg-query -W -f='${Status}' nvidia-driver-580") == "hold ok installed"  # and held again
    witnessed = [line.split() for line in sh(quad, "cat /var/log/rigup-e2e-dpkg-witness").splitlines()]
    before_reboot = [set(line[1:]) for line in witnessed if line and line[0] == boot_id]
    assert before_reboot, witnessed  # the driver's apt transaction ran before the reboot
    # the gateway and the GPU power unit may run on; no pod may
    assert not [units & set(UNITS["quad"]) for units in before_reboot if units & set(UNITS["quad"])], (
        f"pods still running while dpkg changed the driver: {witnessed}")
    for unit in UNITS["quad"]:
        assert unit_prop(quad, unit, "ActiveState") == "active", unit
    for pod in QUAD_PODS:
        assert models_at(bed, "quad", pod["port"], pod["name"]) == [served_name(DUAL)]
