#!/usr/bin/env python3
"""Image distribution: how long a container image takes to reach N rigs through the fleet's image mirror.

Run from the repo root, as root (network namespaces shaped with tc, as bench/fleet_distribution.py):

    python bench/image_distribution.py --rigs 1 2 4 8 --image-gb 2 --out bench/results.md

The bed is fleet_distribution.py's: a switch namespace with a bridge, a hub namespace and one namespace
per rig, every port shaped both ways. Real parts: Debian's docker-registry (the distribution registry
2.8) as the hub's registry, and as the image mirror on rig 1 with rigup's own config
(rigup.desired.image_mirror.MirrorRole) warmed by rigup's own helper (rigup/rig/imagemirror.py warm),
as tasks/image_mirror.py does before any rig pulls. Each rig's pull is what `docker pull` does on the
wire: the manifest, then the config and the layers in parallel (Docker's default of 3 at a time), each
checked against its digest (the layers are not extracted: that is disk and CPU work of the rig, not the
network's).

  relay   tasks/image_mirror.py's way: the mirror on rig 1, a relay (the same registry on 127.0.0.1,
          proxying the mirror) on every other rig; the image's blobs move along the chain (the real
          rigfetch.py, rig 1 reading the hub as a registry client, each rig forwarding verified pieces to
          the next while they arrive) into each registry's staging; the helper links them into each
          registry (the mirror's first), and every rig pulls from its own registry at once;
  mirror  the mirror alone: it caches the image (its helper), then every rig pulls from it at once;
  hub     every rig pulls from the hub at once (no image_mirror_host), for comparison.

The image is generated (incompressible layers of random bytes, cached under --workdir; a registry never
looks inside a layer), never stored in the repo. Reported per N: wall time until every rig holds every
blob verified, the slowest and fastest rig, bytes the hub's registry sent (from its own log), and the
physical bound (image size / link rate). A measurement script, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fleet_distribution import (  # noqa: E402
    RIG_PORT,
    RIGFETCH,
    TOKEN,
    Bed,
    human,
    in_ns,
    on_shaped_beds,
    publish,
    rate_bits,
)

from rigup.desired.image_mirror import RELAY_ADDRESS, MirrorRole  # noqa: E402
from rigup.rig.imagemirror import pin_name  # noqa: E402
from rigup_testbed.registry import (  # noqa: E402
    CONFIG_TYPE,
    LAYER_TYPE,
    MANIFEST_TYPE,
    config_text,
    push_blob,
    push_manifest,
    served_blob_bytes,
)

HELPER = REPO_ROOT / "rigup" / "rig" / "imagemirror.py"
REGISTRY = "/usr/bin/docker-registry"
SECTION = "## Image distribution: one image to N rigs through the fleet's mirror (bench/image_distribution.py)"
REGISTRY_PORT = 5000
REPOSITORY = "bench/vllm-openai"
PARALLEL_LAYERS = 3  # dockerd's max-concurrent-downloads default
LAYERS = 8


# ------------------------------------------------------------------------------------------
# the image: built once into a registry's storage, which the hub's registry then serves


def wait_answers(ns: str | None, url: str, timeout: float = 20) -> None:
    code = f"import urllib.request; urllib.request.urlopen({url!r}, timeout=2).read()"
    deadline = time.monotonic() + timeout
    prefix = in_ns(ns) if ns else []
    while subprocess.run([*prefix, sys.executable, "-c", code], capture_output=True).returncode != 0:
        if time.monotonic() > deadline:
            raise SystemExit(f"no answer from {url}")
        time.sleep(0.2)


def build_image(workdir: Path, total: int) -> tuple[Path, str, int]:
    """(storage dir, manifest digest, image bytes): LAYERS random layers and a config, pushed once."""
    root = workdir / f"image-{total}"
    meta = root / "image.json"
    if meta.exists():
        info = json.loads(meta.read_text())
        return root / "storage", info["digest"], info["bytes"]
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    config_file = root / "config.yml"
    config_file.write_text(config_text(root / "storage", "127.0.0.1", 5999))
    proc = subprocess.Popen([REGISTRY, "serve", str(config_file)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_answers(None, "http://127.0.0.1:5999/v2/")
        import random

        rng = random.Random(7)
        layers = []
        for i in range(LAYERS):
            size = total // LAYERS + (total % LAYERS if i == LAYERS - 1 else 0)
            blob = rng.randbytes(size)
            push_blob("127.0.0.1:5999", REPOSITORY, blob)
            layers.append({"mediaType": LAYER_TYPE, "size": size, "digest": "sha256:" + hashlib.sha256(blob).hexdigest()})
            del blob
        config = json.dumps({"architecture": "amd64", "os": "linux", "config": {},
                             "rootfs": {"type": "layers", "diff_ids": [x["digest"] for x in layers]}}).encode()
        push_blob("127.0.0.1:5999", REPOSITORY, config)
        manifest = json.dumps({"schemaVersion": 2, "mediaType": MANIFEST_TYPE,
                               "config": {"mediaType": CONFIG_TYPE, "size": len(config),
                                          "digest": "sha256:" + hashlib.sha256(config).hexdigest()},
                               "layers": layers}).encode()
        digest = push_manifest("127.0.0.1:5999", REPOSITORY, "bench", manifest)
    finally:
        proc.terminate()
        proc.wait()
    image_bytes = sum(x["size"] for x in layers) + len(config)
    meta.write_text(json.dumps({"digest": digest, "bytes": image_bytes}))
    return root / "storage", digest, image_bytes


# ------------------------------------------------------------------------------------------
# a rig's pull (run inside its namespace): what docker pull reads, checked by digest


def pull(base: str, digest: str) -> dict:
    started = time.monotonic()
    request = urllib.request.Request(f"{base}/v2/{REPOSITORY}/manifests/{digest}", headers={"Accept": MANIFEST_TYPE})
    body = urllib.request.urlopen(request, timeout=60).read()
    ok = "sha256:" + hashlib.sha256(body).hexdigest() == digest
    manifest = json.loads(body)
    blobs = [manifest["config"]["digest"], *(x["digest"] for x in manifest["layers"])]

    def one(blob: str) -> bool:
        hasher = hashlib.sha256()
        with urllib.request.urlopen(f"{base}/v2/{REPOSITORY}/blobs/{blob}", timeout=600) as response:
            while chunk := response.read(1 << 20):
                hasher.update(chunk)
        return "sha256:" + hasher.hexdigest() == blob

    with ThreadPoolExecutor(PARALLEL_LAYERS) as pool:
        ok = all(pool.map(one, blobs)) and ok
    return {"ok": ok, "elapsed_s": time.monotonic() - started}


# ------------------------------------------------------------------------------------------
# one run


def start_registry(bed: Bed, name: str, config_text: str, workdir: Path, address: str | None = None,
                   ) -> tuple[subprocess.Popen, Path]:
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "config.yml"
    config.write_text(config_text)
    log = workdir / "registry.log"
    with log.open("ab") as out:
        proc = subprocess.Popen(in_ns(bed.ns(name), REGISTRY, "serve", str(config)), stdout=out, stderr=out)
    wait_answers(bed.ns(name), f"http://{address or bed.address(name)}:{REGISTRY_PORT}/v2/")
    return proc, log


def run_helper(bed: Bed, name: str, command: str, keep: Path) -> None:
    done = subprocess.run(in_ns(bed.ns(name), sys.executable, str(HELPER), command, str(keep)), capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise SystemExit(f"{name}: rigup-image-mirror {command} failed: {done.stderr}")


def keep_file(role: MirrorRole, path: Path) -> Path:
    path.write_text(json.dumps(dict(json.loads(role.keep_text()), unit=None)))
    return path


def chain(bed: Bed, roles: dict[str, MirrorRole], blobs: list[tuple[str, int]], scratch: Path) -> dict[str, dict]:
    """Every rig's rigfetch at once, in rig order (rig 1 heads the chain): the pin's blobs into each
    registry's staging, as image_blobs_staged runs it."""
    name_of_pin = pin_name(next(iter(roles.values())).keep[0])  # every rig names the pin alike
    files = [{"path": d, "size": size, "sha256": d[7:]} for d, size in blobs]
    rigs, procs = list(roles), []
    for k, name in enumerate(rigs):
        role = roles[name]
        model = {"name": name_of_pin, "dir": f"{role.staging}/{name_of_pin}", "hub_auth": "registry",
                 "hub_url": f"{role.upstream}/v2/{REPOSITORY}/blobs/", "files": files}
        if k:
            model["upstreams"] = [f"http://{bed.address(r)}:{RIG_PORT}/" for r in rigs[:k]]
        manifest = {"version": 1, "state_dir": str(scratch / name / "state"), "reserve_bytes": 0, "models": [model]}
        path = scratch / name / "manifest.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(manifest))
        cmd = [sys.executable, str(RIGFETCH), "--manifest", str(path), "--quiet", "--secrets-stdin",
               "--listen", f"{bed.address(name)}:{RIG_PORT}", "--expect-peers", str(len(rigs) - 1 - k)]
        proc = subprocess.Popen(in_ns(bed.ns(name), *cmd), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert proc.stdin is not None
        proc.stdin.write(json.dumps({"fleet_token": TOKEN}) + "\n")
        proc.stdin.close()
        proc.stdin = None
        procs.append((name, proc))
    reports = {}
    for name, proc in procs:
        out, _ = proc.communicate()
        lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        reports[name] = next(line for line in lines if "bytes_downloaded" in line)
        if proc.returncode != 0:
            raise SystemExit(f"{name}: rigfetch failed: {reports[name].get('failures')}")
    return reports


def run_relay(bed: Bed, storage: Path, digest: str, blobs: list[tuple[str, int]], scratch: Path,
              procs: list[subprocess.Popen]) -> tuple[float, dict[str, str]]:
    """Registries up (the mirror on r1, relays elsewhere), the chain, then the helper's links (the mirror's
    first: a relay's warm reads the manifests from it). Returns (seconds until every registry holds the
    image, each rig's registry URL)."""
    hub = f"http://{bed.address('hub')}:{REGISTRY_PORT}"
    pin = f"{REPOSITORY}@{digest}"
    roles: dict[str, MirrorRole] = {}
    for name in bed.names[1:]:
        data = scratch / name / "data"
        if name == "r1":
            roles[name] = MirrorRole(upstream=hub, port=REGISTRY_PORT, max_bytes=10**13, clients=tuple(bed.names[1:]),
                                     keep=(pin,), storage=str(data), staging=str(data / "rigup-staging"))
        else:
            roles[name] = MirrorRole(upstream=f"http://{bed.address('r1')}:{REGISTRY_PORT}", port=REGISTRY_PORT,
                                     max_bytes=0, clients=(), keep=(pin,), storage=str(data), address=RELAY_ADDRESS,
                                     pins_only=True, staging=str(data / "rigup-staging"))
        proc, _ = start_registry(bed, name, roles[name].config_text(), scratch / name,
                                 None if name == "r1" else RELAY_ADDRESS)
        procs.append(proc)
    started = time.monotonic()
    chain(bed, roles, blobs, scratch)
    keeps = {name: keep_file(role, scratch / name / "keep.json") for name, role in roles.items()}
    run_helper(bed, "r1", "warm", keeps["r1"])
    with ThreadPoolExecutor(max(1, len(keeps) - 1)) as pool:
        list(pool.map(lambda name: run_helper(bed, name, "warm", keeps[name]), [n for n in keeps if n != "r1"]))
    urls = {name: f"http://{bed.address(name) if name == 'r1' else RELAY_ADDRESS}:{REGISTRY_PORT}" for name in roles}
    return time.monotonic() - started, urls


def run_once(bed: Bed, mode: str, storage: Path, digest: str, image_bytes: int, scratch: Path,
             blobs: list[tuple[str, int]]) -> dict:
    shutil.rmtree(scratch, ignore_errors=True)
    hub, hub_log = start_registry(bed, "hub", config_text(storage, bed.address("hub"), REGISTRY_PORT),
                                  scratch / "hub")
    procs: list[subprocess.Popen] = [hub]
    started = time.monotonic()
    warm_s = 0.0
    try:
        source = bed.address("hub")
        sources = {name: f"http://{source}:{REGISTRY_PORT}" for name in bed.names[1:]}
        if mode == "relay":
            warm_s, sources = run_relay(bed, storage, digest, blobs, scratch, procs)
        elif mode == "mirror":
            role = MirrorRole(upstream=f"http://{bed.address('hub')}:{REGISTRY_PORT}", port=REGISTRY_PORT,
                              max_bytes=10**13, clients=tuple(bed.names[1:]), keep=(f"{REPOSITORY}@{digest}",),
                              storage=str(scratch / "mirror" / "data"))
            mirror, _ = start_registry(bed, "r1", role.config_text(), scratch / "mirror")
            procs.append(mirror)
            keep = scratch / "mirror" / "keep.json"
            keep.write_text(json.dumps(dict(json.loads(role.keep_text()), unit=None)))
            warm = subprocess.run(in_ns(bed.ns("r1"), sys.executable, str(HELPER), "warm", str(keep)),
                                  capture_output=True, text=True)
            if warm.returncode != 0:
                raise SystemExit(f"warming the mirror failed: {warm.stderr}")
            warm_s = time.monotonic() - started
            sources = {name: f"http://{bed.address('r1')}:{REGISTRY_PORT}" for name in bed.names[1:]}
        pulls = []
        for name in bed.names[1:]:
            cmd = [sys.executable, __file__, "--pull", sources[name], "--digest", digest]
            pulls.append((name, subprocess.Popen(in_ns(bed.ns(name), *cmd), stdout=subprocess.PIPE, text=True)))
        rigs = {}
        for name, proc in pulls:
            out, _ = proc.communicate()
            rigs[name] = json.loads(out.strip().splitlines()[-1]) if proc.returncode == 0 else {"ok": False, "elapsed_s": 0}
        wall = time.monotonic() - started
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait()
    sent = served_blob_bytes(hub_log, REPOSITORY)
    shutil.rmtree(scratch, ignore_errors=True)
    return {"wall_s": wall, "warm_s": warm_s, "rigs": rigs, "hub_bytes": sent, "hub_copies": sent / image_bytes}


# ------------------------------------------------------------------------------------------
# main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rigs", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--modes", nargs="+", default=["relay", "mirror", "hub"], choices=["relay", "mirror", "hub"])
    parser.add_argument("--image-gb", type=float, default=2.0)
    parser.add_argument("--rate", default="1gbit", help="each port's rate, both ways (tc syntax)")
    parser.add_argument("--delay", default="0.2ms", help="each port's one-way delay, both ways (netem)")
    parser.add_argument("--workdir", default="/var/tmp/rigup-bench/image", help="the generated image")
    parser.add_argument("--rig-dir", default="/var/tmp/rigup-bench/image/run", help="registries' storage and logs")
    parser.add_argument("--out", help="results file to update (this benchmark's section only)")
    parser.add_argument("--label", default=platform.node())
    parser.add_argument("--pull", help=argparse.SUPPRESS)
    parser.add_argument("--digest", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.pull:
        print(json.dumps(pull(args.pull, args.digest)))
        return 0
    if os.geteuid() != 0:
        raise SystemExit("run as root: the bed is made of network namespaces shaped with tc")

    storage, digest, image_bytes = build_image(Path(args.workdir), int(args.image_gb * 1e9))
    manifest = json.loads((storage / "docker/registry/v2/blobs/sha256" / digest[7:9] / digest[7:] / "data").read_text())
    blobs = [(manifest["config"]["digest"], manifest["config"]["size"])] + [(x["digest"], x["size"]) for x in manifest["layers"]]
    bound = image_bytes * 8 / rate_bits(args.rate)

    def measure(bed: Bed, n: int) -> Iterator[dict]:
        for mode in args.modes:
            result = run_once(bed, mode, storage, digest, image_bytes, Path(args.rig_dir), blobs)
            times = [r["elapsed_s"] for r in result["rigs"].values()]
            yield {"n": n, "mode": mode, "ok": all(r["ok"] for r in result["rigs"].values()),
                   "wall_s": result["wall_s"], "warm_s": result["warm_s"], "slowest_s": max(times),
                   "fastest_s": min(times), "hub_bytes": result["hub_bytes"], "hub_copies": result["hub_copies"],
                   "bound_s": bound}

    rows, shaping = on_shaped_beds(args.rigs, args.rate, args.delay, measure)
    one = {mode: next((r["wall_s"] for r in rows if r["n"] == 1 and r["mode"] == mode), None) for mode in args.modes}
    details = [
        f"- image: {human(image_bytes)} in {LAYERS} layers and a config, generated; physical bound (size / link "
        f"rate) {bound:.1f} s",
        f"- links: {shaping}",
        f"- registries: {subprocess.run([REGISTRY, '--version'], capture_output=True, text=True).stdout.strip()}",
    ]
    table = [
        "| rigs | mode | wall time to every rig pulled | of which before the pulls (relay: chain and links; mirror: "
        "its warm-up) | slowest / fastest pull | "
        "vs 1 rig (same mode) | hub sent | all verified |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        base = one.get(r["mode"])
        ratio = f"{r['wall_s'] / base:.2f}x" if base else "-"
        table.append(
            f"| {r['n']} | {r['mode']} | {r['wall_s']:.1f} s ({r['wall_s'] / r['bound_s']:.2f}x the bound) | "
            f"{r['warm_s']:.1f} s | {r['slowest_s']:.1f} / {r['fastest_s']:.1f} s | {ratio} | "
            f"{human(r['hub_bytes'])} ({r['hub_copies']:.2f} copies) | {'yes' if r['ok'] else 'NO'} |"
        )
    publish(args.label, details, table, args.out, SECTION)
    return 0


if __name__ == "__main__":
    sys.exit(main())
