#!/usr/bin/env python3
"""Fleet distribution: how long a model takes to reach N rigs on a bandwidth-shaped LAN.

Run from the repo root, as root (it makes network namespaces and shapes their links with tc):

    python bench/fleet_distribution.py --rigs 1 2 4 8 --model-gb 2 --out bench/results.md

The bed: a switch namespace with a bridge; a hub namespace (an HTTP server with Range and sendfile
that counts the bytes it sends: the Hugging Face endpoint's part) and one namespace per rig, each
joined to the switch by a veth pair shaped with netem on both ends (--rate, --delay each way), so every
port has the same uplink and downlink, as on a switched LAN. Every rig runs the real rigfetch.py with
the manifest the model operation would give it:

  chain  rig 1 reads the hub, rig k lists rigs 1..k-1 as its upstreams (what rigup does), so each
         verified piece moves on as it arrives;
  hub    every rig reads the hub (model_fleet_source: off), for comparison.

The model is generated (incompressible, deterministic; cached under --workdir), never stored in the repo.
Reported per N: wall time until every rig holds the model verified, the slowest and fastest rig, bytes
the hub sent, bytes each rig sent its peers, and the physical bound (model size / link rate: no rig
can receive it faster). This is a measurement script, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import http.server
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_artifacts import RIGFETCH, machine, make_file, write_results  # noqa: E402 - path set above

SECTION = "## Fleet distribution: one model to N rigs on a shaped LAN (bench/fleet_distribution.py)"
PREFIX = "rgdist"  # namespace and link names; distinct from every test bed's
SUBNET = "10.231.0"
HUB_PORT = 8000
RIG_PORT = 8765
TOKEN = "bench-fleet-token"


# ------------------------------------------------------------------------------------------
# the hub: static files with Range, sent with sendfile, bytes counted


def serve_hub(root: Path, address: str, port: int) -> None:
    sent = [0]
    lock = threading.Lock()

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:  # noqa: N802 - stdlib naming
            if self.path == "/_stats":
                with lock:
                    body = json.dumps({"bytes_sent": sent[0]}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            path = root / self.path.lstrip("/").split("?")[0]
            if not path.is_file():
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            size = path.stat().st_size
            start, status = 0, 200
            match = re.match(r"^bytes=(\d+)-$", self.headers.get("Range") or "")
            if match:
                start, status = int(match.group(1)), 206
            self.send_response(status)
            self.send_header("Content-Length", str(size - start))
            if status == 206:
                self.send_header("Content-Range", f"bytes {start}-{size - 1}/{size}")
            self.end_headers()
            with open(path, "rb") as handle:
                pos = start
                try:
                    while pos < size:
                        n = self.connection.sendfile(handle, pos, size - pos)
                        if not n:
                            break
                        pos += n
                finally:
                    with lock:
                        sent[0] += pos - start

    server = http.server.ThreadingHTTPServer((address, port), Handler)
    server.daemon_threads = True
    server.serve_forever()


# ------------------------------------------------------------------------------------------
# the bed


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), check=check, capture_output=True, text=True)


def in_ns(ns: str, *args: str) -> list[str]:
    return ["ip", "netns", "exec", ns, *args]


class Bed:
    def __init__(self, rigs: int, rate: str, delay: str) -> None:
        self.rigs, self.rate, self.delay = rigs, rate, delay
        self.names = ["hub"] + [f"r{i}" for i in range(1, rigs + 1)]
        self.shaping = ""

    def ns(self, name: str) -> str:
        return f"{PREFIX}-{name}"

    def address(self, name: str) -> str:
        return f"{SUBNET}.1" if name == "hub" else f"{SUBNET}.{10 + int(name[1:])}"

    def up(self) -> None:
        self.down()
        sw = self.ns("sw")
        sh("ip", "netns", "add", sw)
        sh(*in_ns(sw, "ip", "link", "add", "br0", "type", "bridge"))
        sh(*in_ns(sw, "ip", "link", "set", "br0", "up"))
        for name in self.names:
            ns = self.ns(name)
            sh("ip", "netns", "add", ns)
            sh("ip", "link", "add", f"{PREFIX}{name}a", "type", "veth", "peer", "name", f"{PREFIX}{name}b")
            sh("ip", "link", "set", f"{PREFIX}{name}a", "netns", ns)
            sh("ip", "link", "set", f"{PREFIX}{name}b", "netns", sw)
            sh(*in_ns(ns, "ip", "link", "set", "lo", "up"))
            sh(*in_ns(ns, "ip", "link", "set", f"{PREFIX}{name}a", "name", "eth0"))
            sh(*in_ns(ns, "ip", "addr", "add", f"{self.address(name)}/24", "dev", "eth0"))
            sh(*in_ns(ns, "ip", "link", "set", "eth0", "up"))
            sh(*in_ns(sw, "ip", "link", "set", f"{PREFIX}{name}b", "master", "br0"))
            sh(*in_ns(sw, "ip", "link", "set", f"{PREFIX}{name}b", "up"))
            # Both directions of the port: the rig's uplink (its eth0) and its downlink (the switch's side).
            for where, dev in ((ns, "eth0"), (sw, f"{PREFIX}{name}b")):
                self.shape(where, dev)

    def shape(self, ns: str, dev: str) -> None:
        """netem (rate and delay) where the kernel has it; else tbf (rate only), and self.shaping says so."""
        netem = sh(*in_ns(ns, "tc", "qdisc", "add", "dev", dev, "root", "netem",
                          "delay", self.delay, "rate", self.rate, "limit", "100000"), check=False)  # fmt: skip
        if netem.returncode == 0:
            self.shaping = f"netem rate {self.rate}, delay {self.delay} each way, on both ends of each port's veth"
            return
        sh(*in_ns(ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate, "burst", "256k", "latency", "50ms"))
        self.shaping = (
            f"tbf rate {self.rate} on both ends of each port's veth; no added delay "
            f"(this kernel has no sch_netem: {netem.stderr.strip() or 'netem refused'})"
        )

    def down(self) -> None:
        for name in ["sw", "hub"] + [f"r{i}" for i in range(1, 65)]:
            sh("ip", "netns", "del", self.ns(name), check=False)


# ------------------------------------------------------------------------------------------
# one run


def model_files(workdir: Path, total: int) -> tuple[Path, list[dict]]:
    """Two shards of half the size plus a config, generated once and cached with their hashes."""
    root = workdir / f"model-{total}"
    meta = root / "files.json"
    if meta.exists():
        return root, json.loads(meta.read_text())
    root.mkdir(parents=True, exist_ok=True)
    files = []
    half = total // 2
    for i, size in enumerate((half, total - half)):
        path = root / f"model-{i + 1:05d}-of-00002.safetensors"
        make_file(path, size, seed=101 + i)
        files.append(path)
    config = root / "config.json"
    config.write_text(json.dumps({"architectures": ["BenchModel"], "bytes": total}))
    entries = []
    for path in [config, *files]:
        digest = hashlib.sha256()
        with open(path, "rb") as handle:
            while block := handle.read(16 << 20):
                digest.update(block)
        entries.append({"path": path.name, "size": path.stat().st_size, "sha256": digest.hexdigest()})
    meta.write_text(json.dumps(entries))
    return root, entries


def cpu_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of every core so far, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def run_once(bed: Bed, mode: str, files: list[dict], scratch: Path) -> dict:
    shutil.rmtree(scratch, ignore_errors=True)
    procs = []
    busy0, total0 = cpu_ticks()
    started = time.monotonic()
    rigs = bed.names[1:]
    for k, name in enumerate(rigs):
        upstreams = [f"http://{bed.address(r)}:{RIG_PORT}/" for r in rigs[:k]] if mode == "chain" else []
        model = {"name": "bench", "dir": str(scratch / name / "models" / "bench"),
                 "hub_url": f"http://{bed.address('hub')}:{HUB_PORT}/", "files": files}  # fmt: skip
        if upstreams:
            model["upstreams"] = upstreams
        manifest = {"version": 1, "state_dir": str(scratch / name / "state"), "reserve_bytes": 0, "models": [model]}
        path = scratch / name / "manifest.json"
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps(manifest))
        peers = len(rigs) - 1 - k if mode == "chain" else 0
        cmd = [sys.executable, str(RIGFETCH), "--manifest", str(path), "--quiet", "--secrets-stdin",
               "--listen", f"{bed.address(name)}:{RIG_PORT}", "--expect-peers", str(peers)]  # fmt: skip
        proc = subprocess.Popen(in_ns(bed.ns(name), *cmd), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert proc.stdin is not None
        proc.stdin.write(json.dumps({"fleet_token": TOKEN}) + "\n")
        proc.stdin.close()
        proc.stdin = None  # communicate() must not touch it again
        procs.append((name, proc))
    results = {}
    for name, proc in procs:
        out, _ = proc.communicate()
        lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        fetch = next(line for line in lines if "bytes_downloaded" in line)
        serve = next((line["serve"] for line in lines if "serve" in line), {"bytes_served": 0})
        results[name] = {"code": proc.returncode, "fetch_s": fetch["elapsed_s"], "ok": fetch["ok"],
                         "from_hub": fetch["bytes_from_hub"], "from_peer": fetch["bytes_from_peer"],
                         "served": serve["bytes_served"]}  # fmt: skip
    wall = time.monotonic() - started
    busy1, total1 = cpu_ticks()
    shutil.rmtree(scratch, ignore_errors=True)
    return {"wall_s": wall, "rigs": results, "cpu_busy": (busy1 - busy0) / max(1, total1 - total0)}


def hub_bytes(bed: Bed) -> int:
    """What the hub sent so far (asked from inside the hub's namespace: nothing else can reach it)."""
    url = f"http://{bed.address('hub')}:{HUB_PORT}/_stats"
    code = f"import urllib.request,sys; sys.stdout.write(urllib.request.urlopen({url!r}, timeout=5).read().decode())"
    out = subprocess.run(in_ns(bed.ns("hub"), sys.executable, "-c", code), capture_output=True, text=True, check=True)
    return int(json.loads(out.stdout)["bytes_sent"])


def start_hub(bed: Bed, root: Path) -> subprocess.Popen:
    cmd = [sys.executable, __file__, "--hub-serve", str(root), "--hub-address", bed.address("hub")]
    proc = subprocess.Popen(in_ns(bed.ns("hub"), *cmd))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            hub_bytes(bed)
            return proc
        except subprocess.CalledProcessError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("the bench hub did not start")


def rate_bits(rate: str) -> float:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.lower())
    if not match:
        raise SystemExit(f"--rate must look like 1gbit or 500mbit, got {rate!r}")
    return float(match.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[match.group(2)]


def human(count: float) -> str:
    return f"{count / 1e9:.2f} GB" if count >= 1e8 else f"{count / 1e6:.1f} MB"


# ------------------------------------------------------------------------------------------
# shared with bench/image_distribution.py: one shaped bed per fleet size, and the results block


def on_shaped_beds(sizes: list[int], rate: str, delay: str, measure: Callable[[Bed, int], Iterable[dict]]
                   ) -> tuple[list[dict], str]:
    """`measure(bed, n)` on a bed of n rigs for each n (the bed torn down after it, whatever happens); the
    rows it gives, each printed as it comes, and how the links were shaped."""
    rows, shaping = [], ""
    for n in sizes:
        bed = Bed(n, rate, delay)
        bed.up()
        shaping = bed.shaping
        try:
            for row in measure(bed, n):
                rows.append(row)
                print(json.dumps(row), flush=True)
        finally:
            bed.down()
    return rows, shaping


def publish(label: str, details: list[str], table: list[str], out: str | None, section: str) -> None:
    """Print a "### Measured" block (the machine, `details`, `table`) and put it in `out`'s `section`."""
    lines = [f"### Measured: {label}, {time.strftime('%Y-%m-%d')}", "", *[f"- {k}: {v}" for k, v in machine().items()],
             *details, "", *table]
    text = "\n".join(lines) + "\n"
    print(text)
    if out:
        write_results(Path(out), label, text, section=section)


# ------------------------------------------------------------------------------------------
# main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rigs", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--modes", nargs="+", default=["chain", "hub"], choices=["chain", "hub"])
    parser.add_argument("--model-gb", type=float, default=2.0)
    parser.add_argument("--rate", default="1gbit", help="each port's rate, both ways (tc netem syntax)")
    parser.add_argument("--delay", default="0.2ms", help="each port's one-way delay, both ways")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--workdir", default="/var/tmp/rigup-bench/fleet", help="generated model and rig dirs")
    parser.add_argument("--rig-dir", default="/var/tmp/rigup-bench/fleet/rigs",
                        help="where the rigs' model and state dirs go (e.g. under /dev/shm: the rigs' disks "
                             "then do not share this machine's one disk)")  # fmt: skip
    parser.add_argument("--out", help="results file to update (this benchmark's section only)")
    parser.add_argument("--label", default=platform.node())
    parser.add_argument("--hub-serve", help=argparse.SUPPRESS)
    parser.add_argument("--hub-address", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.hub_serve:
        serve_hub(Path(args.hub_serve), args.hub_address, HUB_PORT)
        return 0
    if os.geteuid() != 0:
        raise SystemExit("run as root: the bed is made of network namespaces shaped with tc")

    workdir = Path(args.workdir)
    root, files = model_files(workdir, int(args.model_gb * 1e9))
    size = sum(f["size"] for f in files)
    bound = size * 8 / rate_bits(args.rate)

    def measure(bed: Bed, n: int) -> Iterator[dict]:
        for mode in args.modes if n > 1 else ["chain"]:
            for _ in range(args.repeat):
                hub = start_hub(bed, root)
                try:
                    result = run_once(bed, mode, files, Path(args.rig_dir))
                    sent = hub_bytes(bed)
                finally:
                    hub.terminate()
                    hub.wait()
                rigs = result["rigs"]
                ok = all(r["ok"] and r["code"] == 0 for r in rigs.values())
                times = [r["fetch_s"] for r in rigs.values()]
                served = [r["served"] for r in rigs.values()]
                yield {
                    "n": n, "mode": mode, "ok": ok, "wall_s": result["wall_s"], "slowest_s": max(times),
                    "fastest_s": min(times), "hub_bytes": sent, "hub_copies": sent / size,
                    "max_served": max(served), "bound_s": bound, "cpu_busy": result["cpu_busy"],
                }  # fmt: skip

    rows, shaping = on_shaped_beds(args.rigs, args.rate, args.delay, measure)
    one = next((r["wall_s"] for r in rows if r["n"] == 1), None)
    details = [
        f"- model: {human(size)} in 3 files (2 shards), generated; physical bound (size / link rate) {bound:.1f} s",
        f"- links: {shaping}",
        f"- rigs' model dirs: {args.rig_dir}",
    ]
    table = [
        "| rigs | mode | wall time to every rig verified | slowest / fastest rig | vs 1 rig | hub sent | most one rig sent its peers | machine CPU busy | all verified |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = f"{r['wall_s'] / one:.2f}x" if one else "-"
        table.append(
            f"| {r['n']} | {r['mode']} | {r['wall_s']:.1f} s ({r['wall_s'] / r['bound_s']:.2f}x the bound) | "
            f"{r['slowest_s']:.1f} / {r['fastest_s']:.1f} s | {ratio} | {human(r['hub_bytes'])} ({r['hub_copies']:.2f} copies) | "
            f"{human(r['max_served'])} | {100 * r['cpu_busy']:.0f} % | {'yes' if r['ok'] else 'NO'} |"
        )
    publish(args.label, details, table, args.out, SECTION)
    return 0


if __name__ == "__main__":
    sys.exit(main())
