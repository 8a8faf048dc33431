"""The Ray rendezvous of the stand-in `vllm serve --distributed-executor-backend ray` (standins/ray_cluster.py),
on a real two-node Ray cluster: two network namespaces `rayp-a` (head, 10.251.0.1) and `rayp-b` (worker,
10.251.0.2) joined by a veth pair, CPU-only Ray from PyPI, each node declaring 2 GPUs as a Ray resource, and the
engine asking for TP 2 x PP 2 = 4 bundles {"GPU": 1.0}, as vLLM 0.27.1 does.

  (a) both nodes up: ready with 2 nodes, 4 GPUs, 4 bundles whose actors answered from the expected node IPs
  (b) no worker: the head fails with vLLM's placement-group timeout wording, within its bound
  (c) the worker node dies (every process of its namespace SIGKILLed): the head exits non-zero with vLLM's
      "RayWorkerProc rank=[...] died unexpectedly" and "EngineCore encountered a fatal error." (time measured)
  (d) the GCS port dropped in the head's namespace (nft if installed, else iptables): the worker cannot join
      and the head times out

Needs root (namespaces, veth, firewall) and an importable `ray`; everything made here is named `rayp*` and is
removed by the fixtures, also on failure. Each test prints what it measured (run with -s to see it).
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

from rigup_testbed.tests.netpair import kill_ns, namespace_pair, ns_pids, sh, wait_exit

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="creates network namespaces, veths and firewall rules (root only)"),
    pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not importable (pip install 'ray==2.58.0')"),
    pytest.mark.skipif(shutil.which("ip") is None, reason="needs iproute2's ip"),
    pytest.mark.timeout(240),
]

MODULE = Path(__file__).resolve().parents[1] / "standins" / "ray_cluster.py"
NS_HEAD, NS_WORKER = "rayp-a", "rayp-b"
IP_HEAD, IP_WORKER = "10.251.0.1", "10.251.0.2"
GCS_PORT = 6379
GPUS_PER_NODE, TP, PP = 2, 2, 2
SPECS = "[{'GPU': 1.0}, {'GPU': 1.0}, {'GPU': 1.0}, {'GPU': 1.0}]"
READY_BOUND_S = 90  # two Ray nodes starting at once on a 2-core machine: ~10 s measured


@pytest.fixture(scope="module")
def netns():
    """The head's and the worker's namespaces, linked; removed (with anything left running) at the end."""
    with namespace_pair((NS_HEAD, "rayp-va", IP_HEAD), (NS_WORKER, "rayp-vb", IP_WORKER)):
        yield


class Cluster:
    """The head and worker processes of one test, their logs and temp dirs (short paths: Ray's unix
    sockets live under --temp-dir and must stay under 108 characters)."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="rayp-", dir="/tmp")
        self.procs: list[subprocess.Popen] = []

    def path(self, name: str) -> str:
        return os.path.join(self.dir, name)

    def head(self, timeout: float) -> subprocess.Popen:
        cmd = [
            "ip", "netns", "exec", NS_HEAD, sys.executable, str(MODULE), "head", "--ip", IP_HEAD, "--nodes", "2",
            "--gpus-per-node", str(GPUS_PER_NODE), "--tp", str(TP), "--pp", str(PP), "--timeout", str(timeout),
            "--temp-dir", self.path("h"), "--log", self.path("head-ray.log"), "--ready-file", self.path("ready.json"),
        ]
        return self._start(cmd, "head")

    def worker(self) -> subprocess.Popen:
        cmd = [
            "ip", "netns", "exec", NS_WORKER, sys.executable, str(MODULE), "worker", "--ip", IP_WORKER,
            "--address", f"{IP_HEAD}:{GCS_PORT}", "--gpus-per-node", str(GPUS_PER_NODE),
            "--temp-dir", self.path("w"), "--log", self.path("worker-ray.log"),
        ]
        return self._start(cmd, "worker")

    def _start(self, cmd: list[str], name: str) -> subprocess.Popen:
        out = open(self.path(f"{name}.out"), "wb")
        err = open(self.path(f"{name}.err"), "wb")
        p = subprocess.Popen(cmd, stdout=out, stderr=err, start_new_session=True)
        out.close()
        err.close()
        self.procs.append(p)
        return p

    def text(self, name: str) -> str:
        try:
            return Path(self.path(name)).read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def ready(self) -> dict | None:
        t = self.text("ready.json")
        return json.loads(t) if t else None

    def wait_ready(self, head: subprocess.Popen, bound: float) -> tuple[dict, float]:
        t0 = time.monotonic()
        while time.monotonic() - t0 < bound:
            r = self.ready()
            if r:
                return r, time.monotonic() - t0
            if head.poll() is not None:
                pytest.fail(f"head exited ({head.returncode}) before ready:\n{self.text('head.err')}\n{self.text('head-ray.log')[-3000:]}")
            time.sleep(0.1)
        pytest.fail(f"not ready within {bound} s:\n{self.text('head.err')}\n{self.text('worker-ray.log')[-3000:]}")

    def stop(self) -> None:
        sys.path.insert(0, str(MODULE.parent))
        try:
            import ray_cluster
        finally:
            sys.path.remove(str(MODULE.parent))
        for p in reversed(self.procs):
            if p.poll() is None:
                ray_cluster.stop_tree(p.pid, signal.SIGTERM, wait_s=15)
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


@pytest.fixture
def cluster(netns):
    c = Cluster()
    t0 = time.monotonic()
    try:
        yield c
    finally:
        try:
            c.stop()
        finally:
            for ns in (NS_HEAD, NS_WORKER):  # whatever escaped the process tree (none expected)
                left = ns_pids(ns)
                kill_ns(ns)
                if left:
                    print(f"[rayp] killed leftovers in {ns}: {left}")
            shutil.rmtree(c.dir, ignore_errors=True)
            print(f"[rayp] test took {time.monotonic() - t0:.1f} s")


def ns_memory_kb(ns: str) -> tuple[int, int, int]:
    """(processes, RSS kB, PSS kB) of a namespace."""
    rss = pss = n = 0
    for p in ns_pids(ns):
        try:
            for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines():
                if line.startswith("Rss:"):
                    rss += int(line.split()[1])
                elif line.startswith("Pss:"):
                    pss += int(line.split()[1])
            n += 1
        except OSError:
            pass
    return n, rss, pss


def test_ready_with_two_nodes_and_four_gpu_bundles(cluster):
    t0 = time.monotonic()
    head = cluster.head(timeout=120)
    cluster.worker()
    report, waited = cluster.wait_ready(head, READY_BOUND_S)
    print(f"[rayp] ready {time.monotonic() - t0:.1f} s after both started (driver: {report['seconds']} s)")
    for ns in (NS_HEAD, NS_WORKER):
        n, rss, pss = ns_memory_kb(ns)
        print(f"[rayp] {ns}: {n} processes, RSS {rss // 1024} MiB, PSS {pss // 1024} MiB")

    assert report["ready"] is True
    assert report["nodes"] == [IP_HEAD, IP_WORKER]
    assert report["gpus"] == 4
    assert report["world_size"] == 4 and len(report["bundles"]) == 4
    # PACK puts two bundles on each node; ranks are driver-node first, as vLLM sorts them
    assert [b["ip"] for b in report["bundles"]] == [IP_HEAD, IP_HEAD, IP_WORKER, IP_WORKER]
    assert sorted(b["bundle"] for b in report["bundles"]) == [0, 1, 2, 3]
    assert len({b["pid"] for b in report["bundles"]}) == 4
    assert len({b["node_id"] for b in report["bundles"]}) == 2
    # the actors' processes really are in the namespaces of the IPs they reported
    assert {b["pid"] for b in report["bundles"][:2]} <= set(ns_pids(NS_HEAD))
    assert {b["pid"] for b in report["bundles"][2:]} <= set(ns_pids(NS_WORKER))
    assert head.poll() is None  # still serving (watching)
    assert "ready" in cluster.text("head.out")


def test_missing_worker_times_out_with_vllms_wording(cluster):
    timeout = 10
    t0 = time.monotonic()
    head = cluster.head(timeout=timeout)
    took = wait_exit(head, timeout + 40)  # + the head's own start (~5 s) and stop (~2 s)
    print(f"[rayp] head failed {took:.1f} s after start (placement-group timeout {timeout} s)")
    err = cluster.text("head.err")
    assert head.returncode == 3, err
    assert (
        f"ValueError: Cannot provide a placement group requiring 4.0 GPUs (placement_group_specs={SPECS}) "
        f"within {timeout} seconds.\nTensor parallel size may exceed available GPUs in your cluster."
    ) in err
    assert "Waiting for creating a placement group of specs for 10 seconds. specs=" + SPECS in err
    assert cluster.ready() is None
    assert time.monotonic() - t0 >= timeout


def test_killed_worker_fails_the_head_with_the_node_died_message(cluster):
    head = cluster.head(timeout=120)
    worker = cluster.worker()
    cluster.wait_ready(head, READY_BOUND_S)
    t0 = time.monotonic()
    kill_ns(NS_WORKER)  # the rig dies: every process of its namespace, its raylet and actors included
    detected = None
    while time.monotonic() - t0 < 60 and head.poll() is None:
        if detected is None and "died unexpectedly" in cluster.text("head.err"):
            detected = time.monotonic() - t0
        time.sleep(0.05)
    wait_exit(head, 30)
    took = time.monotonic() - t0
    print(f"[rayp] node death: message after {detected} s, head exited after {took:.1f} s")
    err = cluster.text("head.err")
    assert head.returncode == 4, err
    # the ranks on the dead node (2 and 3): whichever run() ref ray.wait returned first, as vLLM's monitor logs it
    assert re.search(r"RayWorkerProc rank=\[(2|3|2, 3)\] died unexpectedly, shutting down executor\.", err), err
    assert "EngineCore encountered a fatal error.\nRuntimeError: Executor failed." in err
    # Ray's own error about the actor (ActorUnavailableError while the socket closes, or ActorDiedError
    # "The actor died because its node has died" once the GCS marks the node dead)
    assert "ActorUnavailableError" in err or "ActorDiedError" in err
    assert detected is not None and detected < 30
    worker.wait(timeout=10)


def firewall_drop(ns: str, port: int) -> tuple[list[str], list[str]]:
    """Drop TCP to `port` in `ns` from anything but the head itself; (add, remove) commands."""
    if shutil.which("nft"):
        add = f"add table inet rayp; add chain inet rayp in {{ type filter hook input priority 0; }}; " \
              f"add rule inet rayp in ip saddr != {IP_HEAD} tcp dport {port} drop"
        return ["nft", add], ["nft", "delete table inet rayp"]
    rule = ["INPUT", "-p", "tcp", "--dport", str(port), "!", "-s", IP_HEAD, "-m", "comment", "--comment", "rayp", "-j", "DROP"]
    return ["iptables", "-A", *rule], ["iptables", "-D", *rule]


def test_blocked_gcs_port_keeps_the_worker_out_and_the_head_times_out(cluster):
    add, remove = firewall_drop(NS_HEAD, GCS_PORT)
    print(f"[rayp] firewall: {add[0]}")
    sh("ip", "netns", "exec", NS_HEAD, *add)
    try:
        timeout = 15
        head = cluster.head(timeout=timeout)
        cluster.worker()
        took = wait_exit(head, timeout + 45)
        print(f"[rayp] head failed {took:.1f} s after start")
        err = cluster.text("head.err")
        assert head.returncode == 3, err
        assert f"Cannot provide a placement group requiring 4.0 GPUs (placement_group_specs={SPECS}) within {timeout} seconds." in err
        assert cluster.ready() is None
        assert f"Failed to connect to GCS at address {IP_HEAD}:{GCS_PORT}" in cluster.text("worker-ray.log")
    finally:
        sh("ip", "netns", "exec", NS_HEAD, *remove, check=False)
