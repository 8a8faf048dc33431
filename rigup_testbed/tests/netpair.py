"""Two network namespaces joined by a veth pair, for the tests of the cluster stand-in (Ray nodes on two
"rigs"): created fresh, and removed with everything left running in them. Their names and addresses are
fixed, so a second run of the same test on this machine (another checkout's suite) waits for the first
on a machine-wide lock instead of colliding with it."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

LOCKS = Path("/var/tmp/rigup-testbed/runs")  # machine-wide, beside the test beds' own locks


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


def ns_pids(ns: str) -> list[int]:
    return [int(p) for p in sh("ip", "netns", "pids", ns, check=False).stdout.split()]


def kill_ns(ns: str, sig: int = signal.SIGKILL) -> None:
    """Every process of a namespace the test created (so: processes the test started)."""
    for p in ns_pids(ns):
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


def wait_exit(p: subprocess.Popen, bound: float) -> float:
    """Seconds until `p` exits; the test fails when it runs past `bound`."""
    t0 = time.monotonic()
    try:
        p.wait(timeout=bound)
    except subprocess.TimeoutExpired:
        pytest.fail(f"did not exit within {bound} s")
    return time.monotonic() - t0


@contextmanager
def namespace_pair(a: tuple[str, str, str], b: tuple[str, str, str]) -> Iterator[None]:
    """Namespaces a and b, each (namespace, veth, address in a /24), linked by the veth pair; a namespace
    that exists already once the machine-wide lock is held fails the test (leftovers of a killed run)."""
    LOCKS.mkdir(parents=True, exist_ok=True)
    lock = open(LOCKS / f"netpair-{a[0]}.lock", "w")
    fcntl.flock(lock, fcntl.LOCK_EX)  # another run of this test on the machine: wait for it to end
    for ns in (a[0], b[0]):
        if ns in sh("ip", "netns", "list").stdout.split():
            lock.close()
            pytest.fail(f"namespace {ns} exists already: leftovers of an earlier run of this test")
    try:
        sh("ip", "netns", "add", a[0])
        sh("ip", "netns", "add", b[0])
        sh("ip", "link", "add", a[1], "type", "veth", "peer", "name", b[1])
        for ns, dev, ip in (a, b):
            sh("ip", "link", "set", dev, "netns", ns)
            sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            sh("ip", "-n", ns, "link", "set", dev, "up")
        yield
    finally:
        for ns in (a[0], b[0]):
            kill_ns(ns)
        time.sleep(0.2)
        for ns in (a[0], b[0]):
            sh("ip", "netns", "del", ns, check=False)  # deletes the veth pair with it
        sh("ip", "link", "del", a[1], check=False)
        lock.close()
