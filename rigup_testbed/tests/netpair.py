"""Two network namespaces joined by a veth pair, for the tests of the cluster stand-in (Ray nodes on two
"rigs"): created fresh, and removed with everything left running in them."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest


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
    that exists already fails the test (another run, or its leftovers)."""
    for ns in (a[0], b[0]):
        if ns in sh("ip", "netns", "list").stdout.split():
            pytest.fail(f"namespace {ns} exists already: another run of this test, or its leftovers")
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
