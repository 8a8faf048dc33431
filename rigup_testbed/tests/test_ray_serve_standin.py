"""The stand-in `vllm serve --distributed-executor-backend ray` (standins/vllm_entry.py with ray_cluster.py) behind
rigup's REAL member script (files/cluster/rigup-cluster-member), on a real two-node Ray cluster: network namespaces
`rayq-a` (head, 10.252.0.1) and `rayq-b` (worker, 10.252.0.2) joined by a veth pair, each node with its own /tmp
(a bind mount in the mount namespace `ip netns exec` makes, as each container has its own: Ray's
/tmp/ray/ray_current_cluster is what vLLM's ray.init(address=None) joins), its own simulated hardware (2 GPUs,
RIGUP_STANDIN_ROOT) and the environment the `cluster` render transform writes. `ray` is the venv's (Ray 2.58.0),
`vllm` a wrapper running vllm_entry.py on the venv's Python, as the image links it.

  (a) the head first, then the worker: the head's HTTP server does not answer before the worker joined, then
      /health and /v1/models answer; the world is TP 2 x PP 2 = 4 ranks on the two IPs, each on one of its node's
      simulated GPUs (and registered there as a GPU process); SIGTERM (`docker stop`) ends the head with 0
  (b) the worker's processes killed (the rig dies): the head's `vllm serve` exits non-zero with vLLM's words
      (time to detect measured)
  (c) the head alone: vLLM's placement-group timeout wording (the test bed's shorter pg_wait_timeout_s, from
      responder.json) and exit 1, never serving
  (d) a worker whose container has 1 GPU but declares RIGUP_CLUSTER_GPUS=2 to Ray: the placement group forms, the
      rank Ray gives GPU id 1 there fails as vLLM's worker would (invalid device ordinal) and the head exits 1

Needs root (namespaces, veth, bind mounts) and an importable `ray`; everything made here is named `rayq*` and
removed in finally blocks. Each test prints what it measured (run with -s to see it).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from rigup_testbed import hardware
from rigup_testbed.tests.netpair import kill_ns, namespace_pair, ns_pids, wait_exit

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="creates network namespaces, veths and bind mounts (root only)"),
    pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not importable (pip install 'ray==2.58.0')"),
    pytest.mark.skipif(shutil.which("ip") is None, reason="needs iproute2's ip"),
    pytest.mark.timeout(180),
]

REPO = Path(__file__).resolve().parents[2]
MEMBER = REPO / "files" / "cluster" / "rigup-cluster-member"
ENTRY = REPO / "rigup_testbed" / "standins" / "vllm_entry.py"
NS_HEAD, NS_WORKER = "rayq-a", "rayq-b"
VETH_HEAD, VETH_WORKER = "rayq-va", "rayq-vb"
IP_HEAD, IP_WORKER = "10.252.0.1", "10.252.0.2"
RAY_PORTS = "6379 6380 6381 52365 10002 10100"  # gcs node-manager object-manager agent min-worker max-worker
HTTP_PORT = 8000
GPUS, TP, PP = 2, 2, 2
MODEL = "rayq/model"  # a Hub id: the stand-in checks no local directory
READY_BOUND_S = 90
PG_TIMEOUT_S = 8


@pytest.fixture(scope="module")
def netns():
    """The head's and the worker's namespaces, linked; removed (with anything left running) at the end."""
    with namespace_pair((NS_HEAD, VETH_HEAD, IP_HEAD), (NS_WORKER, VETH_WORKER, IP_WORKER)):
        yield


class Member:
    """One rig of the cluster: its root (hardware.json, responder.json, GPU process registry, the model), its
    /tmp, and the member script running in its namespace."""

    def __init__(self, base: Path, name: str, ns: str, ip: str, role: str, pg_timeout: float = READY_BOUND_S,
                 preset: str = "2x3090", socket_ifname: str | None = None) -> None:
        self.ns, self.ip, self.role = ns, ip, role
        # as rigup renders a member: the interface its route to the others leaves by
        self.socket_ifname = socket_ifname or (VETH_HEAD if role == "head" else VETH_WORKER)
        self.dir = base / name
        self.root = self.dir / "root"
        self.tmp = self.dir / "tmp"
        self.tmp.mkdir(parents=True)
        etc = self.root / "etc/rigup-testbed"
        etc.mkdir(parents=True)
        self.hardware = hardware.preset(preset, f"rayq-{name}")
        (etc / "hardware.json").write_text(self.hardware.to_json())
        (etc / "responder.json").write_text(json.dumps({"pg_wait_timeout_s": pg_timeout}))
        (self.root / "run/nvidia-standin/procs").mkdir(parents=True)
        self.proc: subprocess.Popen | None = None

    def start(self, bin_dir: Path) -> subprocess.Popen:
        env = {
            "PATH": f"{bin_dir}:{Path(sys.executable).parent}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": "/root", "LANG": "C.UTF-8",
            "VLLM_HOST_IP": self.ip, "RIGUP_CLUSTER_ROLE": self.role, "RIGUP_CLUSTER_HEAD": f"{IP_HEAD}:6379",
            "RIGUP_CLUSTER_GPUS": str(GPUS), "RIGUP_RAY_PORTS": RAY_PORTS,
            "GLOO_SOCKET_IFNAME": self.socket_ifname, "NCCL_SOCKET_IFNAME": f"={self.socket_ifname}",
            "NVIDIA_VISIBLE_DEVICES": "all",  # the container was given its GPUs
            "RIGUP_STANDIN_ROOT": str(self.root),  # where the stand-ins find this rig's hardware
        }
        serve = ["vllm", "serve", MODEL, "--served-model-name", "rayq", "--tensor-parallel-size", str(TP),
                 "--pipeline-parallel-size", str(PP), "--distributed-executor-backend", "ray",
                 "--host", self.ip, "--port", str(HTTP_PORT)]
        cmd = ["ip", "netns", "exec", self.ns, "/bin/bash", "-c", 'mount --bind "$0" /tmp && exec "$@"', str(self.tmp),
               "env", "-i", *(f"{k}={v}" for k, v in env.items()), "/bin/bash", str(MEMBER), *serve]
        with open(self.dir / "out", "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        return self.proc

    def output(self) -> str:
        try:
            return (self.dir / "out").read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def world(self) -> dict | None:
        f = self.root / "run/rigup-standin/ray-world.json"
        return json.loads(f.read_text()) if f.is_file() else None

    def stop(self) -> None:
        """The member's processes: its namespace's (this module made it: only what this module started)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        kill_ns(self.ns)
        end = time.monotonic() + 5  # SIGKILLed processes leave the namespace once reaped
        while ns_pids(self.ns) and time.monotonic() < end:
            time.sleep(0.1)
        if self.proc is not None:
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def rig(netns):
    """(base dir, bin dir, members list); the members stopped and everything removed at the end."""
    base = Path(tempfile.mkdtemp(prefix="rayq-", dir="/var/tmp"))  # not under /tmp: each member binds over it
    bin_dir = base / "bin"
    bin_dir.mkdir()
    vllm = bin_dir / "vllm"  # the image links `vllm` to vllm_entry.py (registry.vllm_image)
    vllm.write_text(f'#!/bin/sh\nexec {sys.executable} {ENTRY} "$@"\n')
    vllm.chmod(0o755)
    members: list[Member] = []
    t0 = time.monotonic()
    try:
        yield base, bin_dir, members
    finally:
        try:
            for m in reversed(members):
                m.stop()
        finally:
            for ns in (NS_HEAD, NS_WORKER):  # whatever escaped (none expected)
                left = ns_pids(ns)
                kill_ns(ns)
                if left:
                    print(f"[rayq] killed leftovers in {ns}: {left}")
            shutil.rmtree(base, ignore_errors=True)
            print(f"[rayq] test took {time.monotonic() - t0:.1f} s")


def http_get(ns: str, url: str) -> tuple[int, str] | None:
    """GET from inside `ns` (the head's address is only reachable there); None when nothing answers."""
    r = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c",
                        "import sys,urllib.request\n"
                        "try:\n r=urllib.request.urlopen(sys.argv[1],timeout=2); print(r.status); print(r.read().decode())\n"
                        "except urllib.error.HTTPError as e: print(e.code); print(e.read().decode())\n"
                        "except Exception as e: sys.exit(7)\n", url], capture_output=True, text=True)
    if r.returncode != 0:
        return None
    status, _, body = r.stdout.partition("\n")
    return int(status), body


def start_cluster(rig) -> tuple[Member, Member, subprocess.Popen, float]:
    base, bin_dir, members = rig
    head = Member(base, "a", NS_HEAD, IP_HEAD, "head")
    worker = Member(base, "b", NS_WORKER, IP_WORKER, "worker")
    members += [head, worker]
    t0 = time.monotonic()
    proc = head.start(bin_dir)
    # the head's server must not answer while the worker is missing: wait until the placement group waits
    while "Creating a new placement group" not in head.output():
        assert proc.poll() is None, head.output()
        assert time.monotonic() - t0 < READY_BOUND_S, head.output()
        time.sleep(0.2)
    assert http_get(NS_HEAD, f"http://{IP_HEAD}:{HTTP_PORT}/health") is None, "the head answered before the worker joined"
    worker.start(bin_dir)
    while http_get(NS_HEAD, f"http://{IP_HEAD}:{HTTP_PORT}/health") is None:
        assert proc.poll() is None, head.output() + worker.output()
        assert time.monotonic() - t0 < READY_BOUND_S, head.output() + worker.output()
        time.sleep(0.3)
    return head, worker, proc, time.monotonic() - t0


def test_the_head_serves_only_once_every_rank_joined(rig):
    head, worker, proc, took = start_cluster(rig)
    world = head.world()
    print(f"[rayq] serving {took:.1f} s after the head started (executor: {world['seconds']} s)")
    assert http_get(NS_HEAD, f"http://{IP_HEAD}:{HTTP_PORT}/health")[0] == 200
    status, body = http_get(NS_HEAD, f"http://{IP_HEAD}:{HTTP_PORT}/v1/models")
    assert status == 200 and json.loads(body)["data"][0]["id"] == "rayq"
    assert world["world_size"] == TP * PP and world["nodes"] == [IP_HEAD, IP_WORKER] and world["gpus"] == 2 * GPUS
    ranks = world["bundles"]
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    assert [r["ip"] for r in ranks] == [IP_HEAD, IP_HEAD, IP_WORKER, IP_WORKER]  # the driver's node first
    # each rank on one GPU of its own node's simulated hardware, as Ray's GPU id names it
    for r, member in zip(ranks, (head, head, worker, worker)):
        uuids = [g.uuid for g in member.hardware.gpus]
        assert len(r["gpus"]) == 1 and r["gpus"][0]["uuid"] == uuids[int(r["ray_gpu_ids"][0])]
    assert {r["gpus"][0]["uuid"] for r in ranks[:2]} == {g.uuid for g in head.hardware.gpus}
    assert {r["gpus"][0]["uuid"] for r in ranks[2:]} == {g.uuid for g in worker.hardware.gpus}
    # the actors' processes are in the namespaces of the IPs they reported, registered as GPU processes there
    assert {r["pid"] for r in ranks[:2]} <= set(ns_pids(NS_HEAD))
    assert {r["pid"] for r in ranks[2:]} <= set(ns_pids(NS_WORKER))
    for member, mine in ((head, ranks[:2]), (worker, ranks[2:])):
        registered = {json.loads(f.read_text())["pid"] for f in (member.root / "run/nvidia-standin/procs").glob("*.json")}
        assert {r["pid"] for r in mine} <= registered
    assert "rigup cluster member: starting the Ray head on 10.252.0.1:6379" in head.output()
    assert "Application startup complete." in head.output()
    assert proc.poll() is None and worker.proc.poll() is None
    # `docker stop`: SIGTERM to the head's vllm serve (the container's PID 1) is a clean stop, not a dead rank
    proc.send_signal(signal.SIGTERM)
    took = wait_exit(proc, 30)
    print(f"[rayq] SIGTERM: the head's vllm serve exited {proc.returncode} after {took:.1f} s")
    assert proc.returncode == 0, head.output()
    assert "died unexpectedly" not in head.output() and "Shutting down" in head.output()


def test_a_dead_worker_ends_the_heads_vllm_serve(rig):
    head, worker, proc, _ = start_cluster(rig)
    t0 = time.monotonic()
    kill_ns(NS_WORKER)  # the rig dies: every process of its namespace, its raylet and actors included
    took = wait_exit(proc, 60)
    out = head.output()
    print(f"[rayq] dead worker: the head's vllm serve exited {proc.returncode} after {took:.1f} s; its last words:")
    print("\n".join(out.rstrip().splitlines()[-8:]))
    assert proc.returncode != 0, out
    assert re.search(r"RayWorkerProc rank=\[(2|3|2, 3)\] died unexpectedly, shutting down executor\.", out), out
    assert "EngineCore encountered a fatal error.\nRuntimeError: Executor failed." in out
    assert time.monotonic() - t0 < 60
    assert http_get(NS_HEAD, f"http://{IP_HEAD}:{HTTP_PORT}/health") is None


def test_a_head_alone_fails_with_vllms_placement_group_wording(rig):
    base, bin_dir, members = rig
    head = Member(base, "a", NS_HEAD, IP_HEAD, "head", pg_timeout=PG_TIMEOUT_S)
    members.append(head)
    t0 = time.monotonic()
    proc = head.start(bin_dir)
    took = wait_exit(proc, PG_TIMEOUT_S + 60)
    out = head.output()
    print(f"[rayq] head alone: exited {proc.returncode} after {took:.1f} s (placement-group timeout {PG_TIMEOUT_S} s); "
          "its last words:")
    print("\n".join(out.rstrip().splitlines()[-9:]))
    specs = "[{'GPU': 1.0}, {'GPU': 1.0}, {'GPU': 1.0}, {'GPU': 1.0}]"
    assert proc.returncode == 1, out
    assert (f"ValueError: Cannot provide a placement group requiring 4.0 GPUs (placement_group_specs={specs}) "
            f"within {PG_TIMEOUT_S} seconds.\nTensor parallel size may exceed available GPUs in your cluster.") in out
    assert "EngineCore failed to start." in out
    assert "Application startup complete." not in out and head.world() is None
    assert time.monotonic() - t0 >= PG_TIMEOUT_S


def test_a_node_declaring_more_gpus_than_it_has_fails_the_engine_start(rig):
    base, bin_dir, members = rig
    head = Member(base, "a", NS_HEAD, IP_HEAD, "head")
    worker = Member(base, "b", NS_WORKER, IP_WORKER, "worker", preset="1x3090")  # RIGUP_CLUSTER_GPUS says 2
    members += [head, worker]
    proc = head.start(bin_dir)
    worker.start(bin_dir)
    took = wait_exit(proc, READY_BOUND_S)
    out = head.output()
    print(f"[rayq] 1-GPU worker declaring 2: the head exited {proc.returncode} after {took:.1f} s")
    assert proc.returncode == 1, out
    assert "EngineCore failed to start." in out
    assert f"RuntimeError: CUDA error: invalid device ordinal (Ray GPU id(s) ['1'] on node {IP_WORKER}, which has 1 GPU(s)" in out
    assert "Application startup complete." not in out and head.world() is None


@pytest.mark.parametrize(("ifname", "words"), [
    ("lo", "RuntimeError: Gloo connectFullMesh failed with [../third_party/gloo/gloo/transport/tcp/pair.cc:144] no error"),
    ("eth9", "RuntimeError: [enforce fail at ../third_party/gloo/gloo/transport/tcp/device.cc:83] ifa != nullptr. "
             "Unable to find address for: eth9"),
])
def test_a_wrong_socket_interface_fails_the_gloo_rendezvous_in_torchs_words(rig, ifname: str, words: str):
    """GLOO_SOCKET_IFNAME naming the loopback: each rank listens on 127.0.0.1 and the other node's ranks
    reach their own loopback instead (vllm-project/vllm#5094, #7074); naming no interface: torch cannot
    find its address."""
    base, bin_dir, members = rig
    head = Member(base, "a", NS_HEAD, IP_HEAD, "head", socket_ifname=ifname)
    worker = Member(base, "b", NS_WORKER, IP_WORKER, "worker", socket_ifname=ifname)
    members += [head, worker]
    proc = head.start(bin_dir)
    worker.start(bin_dir)
    took = wait_exit(proc, READY_BOUND_S)
    out = head.output()
    print(f"[rayq] GLOO_SOCKET_IFNAME={ifname}: the head exited {proc.returncode} after {took:.1f} s")
    assert proc.returncode == 1, out
    assert words in out and "EngineCore failed to start." in out
    assert "Application startup complete." not in out and head.world() is None
