"""One model across two rigs (issue 29): a `clusters` entry serves a 4-GPU recipe as TP 2 x PP 2 on two
2x RTX 3090 rigs, through vLLM's Ray backend with a real Ray rendezvous (the stand-in engine's `vllm
serve` joins the members' real Ray cluster and places a worker on each simulated GPU before it answers).

One bed: rig-a (the head; group gateway, so it also runs the fleet gateway) and rig-b (the worker). In
file order: bring-up, with each member's gate passing only once the whole cluster serves; the gateway
routes to the head alone; the firewall admits the members alone to Ray's ports and the ephemeral range, and
Ray asks every caller for the cluster's token;
the second converge of the fresh cluster changes nothing and `rigup status` finds no drift; a wrong socket interface fails the gate with Gloo's error and rolls
both members back together; a stopped worker takes the cluster down and the next converge heals it, and
re-validates the worker, whose GPU was flashed meanwhile (issue 43).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pytest
import requests
import yaml

from rigup_testbed.fleet import Testbed
from rigup_testbed.hosts import HostSpec
from tests.e2e.boundary_probe import check_from_outside, plan_of, refused_from_members
from tests.e2e.helpers import REPO_ROOT, assert_secret_private, entrance_url, fleet_ca_file, key_files
from tests.e2e.test_serving import API_KEY, Bed, _tail, served_name, sh, unit_prop

pytestmark = pytest.mark.e2e

VARIANT = "qwen-multi4-autoround-int4-mtp"  # TP 4 on one host upstream; vllm/vllm-openai:v0.27.1
PORT = 8040
UNIT = "rigup-big.service"
CLUSTER = {"name": "big", "variant": VARIANT, "hosts": ["rig-a", "rig-b"], "port": PORT}
GATEWAY_KEY = "sk-rigup-cluster-e2e-0b7d5e11c2a4"
GATEWAY_PORT = 4000


def record(bed: Bed, host: str) -> dict:
    return json.loads(sh(bed.testbed.host(host), "cat /opt/rigup/state/pods/big/provenance.json"))


def served(bed: Bed, host: str, port: int = PORT) -> list[str]:
    reply = requests.get(f"http://{bed.testbed.host(host).ip}:{port}/v1/models",
                         headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
    assert reply.status_code == 200, reply.text
    return [m["id"] for m in reply.json()["data"]]


@pytest.fixture(scope="module")
def bed(testbed_factory: Callable[..., Testbed], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bed]:
    testbed = testbed_factory([HostSpec("rig-a", group="gateway"), HostSpec("rig-b", group="rigs")], "rigcl",
                               host_layer=True)
    b = Bed(testbed, testbed.workdir)
    keys = key_files(tmp_path_factory.mktemp("keys"), rig=API_KEY, gateway=GATEWAY_KEY)
    b.gateway_key = str(keys["gateway"])  # type: ignore[attr-defined]
    b.data = {"serving_api_key_file": str(keys["rig"]), "serving_health_timeout_s": 240,
              "gateway_api_key_file": str(keys["gateway"]), "gateway_health_check_interval_s": 3}
    b.clusters = [CLUSTER]
    b.write()
    yield b
    testbed.down()


def test_two_rigs_serve_one_model_as_one_endpoint(bed: Bed) -> None:
    proc = bed.deploy()
    output = proc.stdout + proc.stderr
    assert "Traceback" not in output
    for host, role in (("rig-a", "head"), ("rig-b", "worker")):
        rig = bed.testbed.host(host)
        assert unit_prop(rig, UNIT, "ActiveState") == "active", host
        rec = record(bed, host)
        assert rec["gate"]["result"] == "passed", (host, rec["gate"])
        assert rec["release"]["cluster"] == {"name": "big", "role": role, "rank": 0 if role == "head" else 1,
                                             "hosts": ["rig-a", "rig-b"]}
    assert served_name(VARIANT) in served(bed, "rig-a")
    # the worker's gate asked the head: its completion came from the whole cluster
    assert record(bed, "rig-b")["release"]["health_url"] == f"http://{bed.testbed.host('rig-a').ip}:{PORT}/v1/models"
    logs = sh(bed.testbed.host("rig-a"), "docker logs rigup-big 2>&1 | tail -n 200")
    assert "rigup cluster member: starting the Ray head" in logs
    # each member's interface and address are the ones its kernel routes to the other member by
    for host, peer in (("rig-a", "rig-b"), ("rig-b", "rig-a")):
        rig = bed.testbed.host(host)
        (route,) = json.loads(sh(rig, f"ip -j route get {bed.testbed.host(peer).ip}"))
        compose = yaml.safe_load(sh(rig, "cat /opt/rigup/variants/big/compose.yaml"))
        (service,) = compose["services"].values()
        env = dict(str(item).partition("=")[::2] for item in service["environment"])
        assert (env["VLLM_HOST_IP"], env["NCCL_SOCKET_IFNAME"], env["GLOO_SOCKET_IFNAME"]) == (
            rig.ip, f"={route['dev']}", route["dev"]), env
        assert env["RIGUP_CLUSTER_HEAD"] == f"{bed.testbed.host('rig-a').ip}:6379"


def test_the_gateway_routes_to_the_head_alone(bed: Bed) -> None:
    url = f"{entrance_url(bed.testbed.host('rig-a').ip, GATEWAY_PORT)}/v1/models"
    deadline = time.monotonic() + 60
    while True:
        reply = requests.get(url, headers={"Authorization": f"Bearer {GATEWAY_KEY}"}, timeout=30,
                             verify=fleet_ca_file(bed.fleet))
        if reply.status_code == 200 and reply.json()["data"] or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert served_name(VARIANT) in [m["id"] for m in reply.json()["data"]]
    routes = json.loads(sh(bed.testbed.host("rig-a"), "cat /opt/rigup/gateway/routes.json"))["routes"]
    assert {route["host"] for route in routes} == {"rig-a"}, routes  # the worker serves nothing itself
    # rigup verify's checks (models, completion, tool call) pass through the gateway: the whole cluster answers
    proc = subprocess.run([sys.executable, "-m", "rigup", "verify", "--url", entrance_url(bed.testbed.host('rig-a').ip,
                           GATEWAY_PORT), "--api-key-file", bed.gateway_key, "--json"],  # type: ignore[attr-defined]
                          cwd=REPO_ROOT, env=bed.env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    # and over the fleet: the cluster is verified once, through its head; the worker says so
    proc = subprocess.run([sys.executable, "-m", "rigup", "verify", "--json"], cwd=REPO_ROOT, env=bed.env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "verified as rig-a/big" in proc.stdout


def _reaches(bed: Bed, from_host: str | None, to_host: str, port: int) -> bool:
    """Whether a TCP connection from `from_host` (None: the hub, on the same LAN outside the cluster) to
    `to_host`:`port` is accepted."""
    address = bed.testbed.host(to_host).ip
    probe = f"timeout 3 bash -c '</dev/tcp/{address}/{port}' && echo open || echo closed"
    if from_host is None:  # the hub: a machine on the same LAN outside the cluster
        out = sh_hub(bed, probe)
    else:
        out = sh(bed.testbed.host(from_host), probe, check=False)
    return out.strip().endswith("open")


def sh_hub(bed: Bed, command: str) -> str:
    netns = bed.testbed.network.hub_netns
    proc = subprocess.run(["ip", "netns", "exec", netns, "bash", "-c", command], capture_output=True, text=True,
                          timeout=60)
    return proc.stdout


def test_outside_the_cluster_no_ray_port_answers(bed: Bed) -> None:
    assert _reaches(bed, "rig-b", "rig-a", 6379)  # the worker reaches the head's GCS
    assert not _reaches(bed, None, "rig-a", 6379)  # a host outside the cluster does not
    assert not _reaches(bed, None, "rig-b", 6380)  # nor a member's raylet
    # off the fleet only the entrance answers (the boundary, issue 42): the head's pod is reached through it
    assert not _reaches(bed, None, "rig-a", PORT)
    assert _reaches(bed, None, "rig-a", GATEWAY_PORT)


# A Ray client of the head's GCS, run in a member's container (its Ray, the real 2.58.0 wheel): it asks for the
# internal KV's keys with Ray's own GcsClient, which presents the token its environment gives (or none) the way
# every Ray process of the member does (rigup.desired.cluster_token).
_RAY_CLIENT = """
import sys
from ray._raylet import GcsClient
try:
    GcsClient(address=sys.argv[1]).internal_kv_keys(b"", namespace=None, timeout=20)
    print("ANSWERED")
except Exception as exc:
    print("REFUSED", type(exc).__name__, str(exc).splitlines()[0])
"""


def _ray_client(bed: Bed, member: str, env: str = "") -> str:
    head = f"{bed.testbed.host('rig-a').ip}:6379"
    command = f"docker exec -i {env} rigup-big python3.11 - {head} <<'EOF'\n{_RAY_CLIENT}\nEOF"
    return sh(bed.testbed.host(member), command, check=False).splitlines()[-1]


def test_ray_asks_every_caller_for_the_clusters_token(bed: Bed) -> None:
    """Issue 42: RAY_AUTH_MODE=token on every member, the cluster's token made once 0600 beside the fleet CA and
    handed to each member's Ray as its 0600 secret file: a client the firewall admits (the worker) is refused by the
    head's GCS without the token or with a wrong one, and answered with it."""
    made = bed.fleet.parent / "fleet-ca" / "ray-big.token"
    assert made.stat().st_mode & 0o777 == 0o600
    token = made.read_text().strip()
    assert len(token) == 64
    for host in ("rig-a", "rig-b"):
        rig = bed.testbed.host(host)
        assert _env(bed, host)["RAY_AUTH_MODE"] == "token"
        # Ray reads the token from the file RAY_AUTH_TOKEN_PATH names: never a value of the container's environment
        assert _env(bed, host)["RAY_AUTH_TOKEN_PATH"] == "/run/rigup/secrets/RAY_AUTH_TOKEN"
        assert "RAY_AUTH_TOKEN" not in _env(bed, host)
        for path in ("compose.yaml", ".env"):
            assert token not in sh(rig, f"cat /opt/rigup/variants/big/{path}"), path
        assert sh(rig, "stat -c '%a %U' /opt/rigup/variants/big/secrets/RAY_AUTH_TOKEN") == "600 root"
        assert sh(rig, "cat /opt/rigup/variants/big/secrets/RAY_AUTH_TOKEN") == token
        assert token not in sh(rig, "docker inspect rigup-big"), host
        assert_secret_private(rig, token)  # containerd's state a local user reads among the rest
        assert token not in sh(rig, "ps -eo args"), host  # never on a command line
        assert token not in sh(rig, "journalctl -q --no-pager -o cat"), host  # nor in a log
    assert _ray_client(bed, "rig-b") == "ANSWERED"  # the member's own environment: the token
    refused = _ray_client(bed, "rig-b", "-e RAY_AUTH_MODE=disabled -e RAY_AUTH_TOKEN=")
    assert refused.startswith("REFUSED AuthenticationError") and "InvalidAuthToken" in refused, refused
    wrong = _ray_client(bed, "rig-b", "-e RAY_AUTH_TOKEN=" + "0" * 64)
    assert wrong.startswith("REFUSED AuthenticationError") and "InvalidAuthToken" in wrong, wrong
    print(f"the head's GCS without the token: {refused}")


def test_from_outside_only_ssh_and_the_entrance_answer_and_members_are_asked_who_they_are(bed: Bed) -> None:
    """Issue 42's probe on the bed with the most roles (an entrance, a monitor, rigs, a cluster): from the hub every
    TCP port of both members is scanned and every row's requests tried (Ray's dashboard and job API among them,
    tests/e2e/boundary_probe.py): only SSH and the entrance answer; from a member the firewall admits, every
    service that asks who is calling refuses a caller without credentials. The worker's pod port has no
    listener: the head serves the cluster's API."""
    fleet = plan_of(bed.fleet)
    answer = check_from_outside(fleet, lambda h: bed.testbed.host(h).ip, bed.testbed.network.hub_netns,
                                {("rig-a", GATEWAY_PORT): GATEWAY_KEY})
    print(f"outsider's scan of {len(answer['scan'])} hosts and {len(answer['probes'])} requests: {answer['seconds']} s")

    def run_on(member: str | None, command: str) -> str:
        if member is None:  # the control machine
            return subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60).stdout
        return sh(bed.testbed.host(member), command, check=False)

    asked, silent = refused_from_members(fleet, lambda h: bed.testbed.host(h).ip, run_on)
    print(f"members without credentials: {asked}")
    assert [what.split(" from ")[0] for what in silent] == [f"each pod's vLLM API on rig-b:{PORT}/v1/models"], silent
    assert {what.split(" on ")[0] for what in asked} == {
        "the entrance (the fleet's API)", "each pod's vLLM API", "node_exporter", "the DCGM exporter (Docker-published)",
        "Prometheus"}, asked


def test_a_fresh_clusters_second_converge_changes_nothing_and_status_says_so(bed: Bed) -> None:
    # The first converge installed the driver after the deploy was planned: it wrote the files with the
    # interconnect the driver then reported (rigup.operations.serving_plans), so the second plans the same
    # files and restarts nothing (issue 41: it restarted both members for NVLINK_MODE=auto -> force_off).
    members = {host: bed.testbed.host(host) for host in ("rig-a", "rig-b")}
    started = {host: unit_prop(rig, UNIT, "ExecMainStartTimestampMonotonic") for host, rig in members.items()}
    for host in members:
        assert _env(bed, host)["NVLINK_MODE"] == "force_off", host  # the bed's PCIe GPUs, without P2P
    proc = bed.pyinfra("--json", "deploy.py")
    assert proc.returncode == 0, _tail(proc)
    result = json.loads(proc.stdout)
    changed = {op["name"]: op["success"] for op in result["results"]["operations"] if op["success"]}
    assert changed == {}, f"operations that changed on the second converge: {changed}"
    assert {host: unit_prop(rig, UNIT, "ExecMainStartTimestampMonotonic") for host, rig in members.items()} == started
    # status renders each member as the deploy did (its interface and addresses read on it): no drift
    proc = subprocess.run([sys.executable, "-m", "rigup", "status", "--json"], cwd=REPO_ROOT, env=bed.env(),
                          capture_output=True, text=True, timeout=300)
    report = json.loads(proc.stdout)
    drifted = {h["host"]: [i for i in h["items"] if i["state"] != "ok" and i["state"] != "info"] for h in report["hosts"]}
    assert proc.returncode == 0, (drifted, proc.stderr[-2000:])
    assert {h["host"]: h["verdict"] for h in report["hosts"]} == {"rig-a/big": "OK", "rig-b/big": "OK"}, drifted
    assert "DRIFT" not in proc.stdout


def _env(bed: Bed, host: str) -> dict[str, str]:
    compose = yaml.safe_load(sh(bed.testbed.host(host), "cat /opt/rigup/variants/big/compose.yaml"))
    (service,) = compose["services"].values()
    return dict(str(item).partition("=")[::2] for item in service["environment"])


def test_a_wrong_socket_interface_fails_the_gate_with_the_rendezvous_error_and_rolls_every_member_back(bed: Bed) -> None:
    good = {host: record(bed, host)["generation"] for host in ("rig-a", "rig-b")}
    routed = {host: _env(bed, host)["GLOO_SOCKET_IFNAME"] for host in good}
    # lo exists on every member, so preflight lets it through with a warning; Gloo then binds each rank to
    # 127.0.0.1 and no rank on the other member can reach it (vllm-project/vllm#5094)
    bed.clusters = [{**CLUSTER, "socket_interface": "lo"}]
    bed.write(relock=False)
    try:
        proc = bed.deploy(expect_ok=False)
    finally:
        bed.clusters = [CLUSTER]
        bed.write(relock=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, _tail(proc)
    assert "Traceback" not in output
    assert "socket_interface 'lo' on rig-a is not" in output  # preflight's warning
    assert "Gloo connectFullMesh failed" in output, _tail(proc, 200)  # the rendezvous error, in the gate's reason
    assert output.count("cluster big: the health gate failed; this member rolled back to its last good generation") == 2, _tail(proc)
    for host in ("rig-a", "rig-b"):
        rec = record(bed, host)
        assert rec["generation"] == good[host] and rec["last_rollback"]["outcome"] == "rolled back", (host, rec)
        assert "connectFullMesh" in rec["last_rollback"]["reason"], rec["last_rollback"]
        assert _env(bed, host)["GLOO_SOCKET_IFNAME"] == routed[host]  # the good generation's files are back
        assert unit_prop(bed.testbed.host(host), UNIT, "ActiveState") == "active"
    assert served_name(VARIANT) in served(bed, "rig-a")
    # the fleet file is right again and the cluster serves it: a converge restarts nothing; it only marks
    # each member's standing gate failure superseded (the fleet no longer asks for it), so RigupGateFailed clears
    started = {host: unit_prop(bed.testbed.host(host), UNIT, "ExecMainStartTimestampMonotonic") for host in good}
    proc = bed.pyinfra("--json", "deploy.py")
    assert proc.returncode == 0, _tail(proc)
    changed = {op["name"] for op in json.loads(proc.stdout)["results"]["operations"] if op["success"]}
    assert changed == {"tasks/serving.py | Ensure the variant serves its recorded release [pod big]"}, changed
    for host in good:
        rec = record(bed, host)
        assert rec["generation"] == good[host] and rec["last_rollback"].get("superseded_at"), (host, rec)
        assert unit_prop(bed.testbed.host(host), UNIT, "ExecMainStartTimestampMonotonic") == started[host]


def test_a_stopped_worker_takes_the_cluster_down_and_the_next_converge_heals_it(bed: Bed) -> None:
    head, worker = bed.testbed.host("rig-a"), bed.testbed.host("rig-b")
    before = unit_prop(head, UNIT, "NRestarts")
    sh(worker, f"systemctl stop {UNIT}")
    started = time.monotonic()
    while time.monotonic() - started < 120:
        if unit_prop(head, UNIT, "NRestarts") != before or unit_prop(head, UNIT, "ActiveState") != "active":
            break
        time.sleep(1)
    detected = time.monotonic() - started
    assert detected < 120, "the head kept serving without its worker"
    print(f"the head noticed the stopped worker after {detected:.1f} s")
    # meanwhile the worker's GPU 0 is flashed with another VBIOS (the bed's hardware fixture, which the stand-in
    # nvidia-smi reports): the converge that heals the cluster also re-validates the worker (issue 43): its P2P
    # cache removed with its container, restarted, the cluster's gate asks every probe through the head and
    # records the worker's new fingerprint; the head's rig did not change
    before = {host: record(bed, host) for host in ("rig-a", "rig-b")}
    assert before["rig-b"]["fingerprint"]["gpu0.vbios"] == "94.02.42.00.A9", before["rig-b"]["fingerprint"]
    sh(worker, """python3 -c 'import json; p = "/etc/rigup-testbed/hardware.json"; d = json.load(open(p)); """
               """d["gpus"][0]["vbios_version"] = "94.02.42.00.B1"; json.dump(d, open(p, "w"), indent=2)'""")
    proc = bed.deploy()
    output = proc.stdout + proc.stderr
    summary = output[output.index("--> What this converge did, per host:"):]
    said = ("fingerprint changed: GPU0 VBIOS 94.02.42.00.A9 to 94.02.42.00.B1 -> P2P cache removed (the container's, "
            "with compose down: none is kept on the host), member restarted: the cluster's gate asks the full probe set "
            "(4 probes: arithmetic, recall, tool-call, json-shape)")
    assert said in summary and summary.count("fingerprint changed") == 1, summary
    for host in ("rig-a", "rig-b"):
        assert unit_prop(bed.testbed.host(host), UNIT, "ActiveState") == "active"
    assert served_name(VARIANT) in served(bed, "rig-a")
    after = {host: record(bed, host) for host in ("rig-a", "rig-b")}
    assert after["rig-b"]["fingerprint"] == {**before["rig-b"]["fingerprint"], "gpu0.vbios": "94.02.42.00.B1"}
    assert after["rig-b"]["gate"]["at"] > before["rig-b"]["gate"]["at"] and sorted(after["rig-b"]["gate"]["probes"]) == \
        sorted(["arithmetic", "recall", "tool-call", "json-shape"])
    assert after["rig-a"]["fingerprint"] == before["rig-a"]["fingerprint"]
