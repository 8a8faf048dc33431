#!/usr/bin/env python3
"""Artifact benchmarks: hashing, download+verify, and the re-run cost of the model step.

Run from the repo root (sections are independent; --hash and --download need only the standard
library, so they also run on a bare machine with `python3 bench/bench_artifacts.py --hash --download`):

    python bench/bench_artifacts.py --hash --download --rerun --out bench/results.md

  --hash      SHA-256 throughput on the same data: `sha256sum` (coreutils), one core of hashlib
              (rigfetch's hash_file), and rigfetch verifying one file per core in parallel.
  --download  a large file over loopback HTTP: raw transfer (to /dev/null and to a file) vs
              rigfetch's download + streaming SHA-256 + fsync + rename.
  --rerun     the model step on an already converged rig: `rigfetch --check`, `rigfetch` (stamps
              only) and the pyinfra model task (tasks/model.py on @local), with bytes read/hashed.

This is a measurement script, not a test: it prints a table and writes Markdown; it asserts nothing.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import http.server
import json
import os
import platform
import shutil
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from rigup.rig.onefile import write_rigfetch  # noqa: E402 - path set above
from rigup.rig.rigfetch.disk import hash_file  # noqa: E402
from rigup.rig.rigfetch.manifest import encode_manifest  # noqa: E402

RIGFETCH = write_rigfetch()  # the zipapp the tasks upload
GB = 1e9


# ------------------------------------------------------------------------------------------
# helpers


def make_file(path: Path, size: int, seed: int) -> None:
    """Incompressible, deterministic bytes (a 64 MiB random block, rotated per block)."""
    import random

    block = random.Random(seed).randbytes(64 << 20)
    with open(path, "wb") as out:
        written, i = 0, 0
        while written < size:
            k = (i * 7919) % len(block)
            piece = (block[k:] + block[:k])[: size - written]
            out.write(piece)
            written += len(piece)
            i += 1


def warm(path: Path) -> None:
    """Read the file once so every contender hashes from the page cache (CPU, not disk)."""
    with open(path, "rb", buffering=0) as handle:
        while handle.read(16 << 20):
            pass


def timed(fn, repeat: int = 3) -> float:  # noqa: ANN001 - small script
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def machine() -> dict[str, str]:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    flags = ""
    try:
        text = Path("/proc/cpuinfo").read_text()
        flags = "sha_ni" if " sha_ni" in text else "no sha_ni"
    except OSError:
        pass
    return {
        "cpu": f"{cpu} ({flags})",
        "cores": str(os.cpu_count()),
        "python": platform.python_version(),
        "openssl": ssl.OPENSSL_VERSION,
        "kernel": platform.release(),
    }


# ------------------------------------------------------------------------------------------
# hashing


def bench_hash(work: Path, size: int) -> list[tuple[str, str, str]]:
    cores = os.cpu_count() or 1
    rows: list[tuple[str, str, str]] = []
    one = work / "hash-0.bin"
    make_file(one, size, 0)
    warm(one)

    if shutil.which("sha256sum"):
        t = timed(lambda: subprocess.run(["sha256sum", str(one)], check=True, capture_output=True))
        rows.append(("sha256sum (coreutils), 1 file", f"{size / GB:.1f} GB", f"{size / t / GB:.2f} GB/s"))
    t = timed(lambda: hash_file(str(one)))
    single = size / t / GB
    rows.append(("hashlib, one core (rigfetch.hash_file)", f"{size / GB:.1f} GB", f"{single:.2f} GB/s"))

    # rigfetch verify phase: one file per core, hashed by a thread each (hashlib drops the GIL).
    files = [one]
    for i in range(1, cores):
        path = work / f"hash-{i}.bin"
        make_file(path, size, i)
        warm(path)
        files.append(path)
    state = work / "state"
    model = {
        "name": "bench",
        "dir": str(work),
        "hub_url": "http://127.0.0.1:9/unused/",
        "peer_url": None,
        "files": [{"path": p.name, "size": size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()} for p in files],
    }
    manifest = {"version": 1, "state_dir": str(state), "reserve_bytes": 0, "models": [model]}
    man_path = work / "manifest.json"
    man_path.write_text(json.dumps(manifest))

    def reverify() -> dict:
        proc = subprocess.run(
            [sys.executable, str(RIGFETCH), "--manifest", str(man_path), "--reverify", "--quiet"],
            check=True, capture_output=True, text=True,
        )  # fmt: skip
        return json.loads(proc.stdout.splitlines()[-1])

    report = reverify()
    assert report["bytes_hashed"] == size * cores and report["bytes_downloaded"] == 0
    t = timed(reverify)
    total = size * cores
    rows.append(
        (f"rigfetch --reverify, {cores} files on {cores} threads", f"{total / GB:.1f} GB",
         f"{total / t / GB:.2f} GB/s ({total / t / GB / single:.1f}x one core)")
    )  # fmt: skip
    if shutil.which("sha256sum"):
        t = timed(lambda: subprocess.run(["sha256sum", *map(str, files)], check=True, capture_output=True))
        rows.append((f"sha256sum, same {cores} files one after another", f"{total / GB:.1f} GB", f"{total / t / GB:.2f} GB/s"))
    # Threads in one process vs a process per file: same throughput means the GIL is not in the way.
    with concurrent.futures.ThreadPoolExecutor(cores) as pool:
        t = timed(lambda: list(pool.map(lambda p: hash_file(str(p)), files)))
    rows.append((f"hashlib in {cores} threads (in process)", f"{total / GB:.1f} GB", f"{total / t / GB:.2f} GB/s"))
    for path in files:
        path.unlink()
    shutil.rmtree(state, ignore_errors=True)
    return rows


# ------------------------------------------------------------------------------------------
# download


class _Static(http.server.BaseHTTPRequestHandler):
    """Serves one file with sendfile (the same way rigfetch's fleet server does)."""

    protocol_version = "HTTP/1.1"
    path_on_disk = ""

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802 - stdlib naming
        size = os.path.getsize(self.path_on_disk)
        self.send_response(200)
        self.send_header("Content-Length", str(size))
        self.send_header("Content-Type", "application/octet-stream")
        self.end_headers()
        with open(self.path_on_disk, "rb") as handle:
            self.wfile.flush()
            self.connection.sendfile(handle, 0, size)


def bench_download(work: Path, size: int) -> list[tuple[str, str, str]]:
    src_dir = work / "src"
    src_dir.mkdir()
    src = src_dir / "model.safetensors"
    make_file(src, size, 42)
    digest = hash_file(str(src)).hexdigest()
    warm(src)
    handler = type("Static", (_Static,), {"path_on_disk": str(src)})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/"
    rows: list[tuple[str, str, str]] = []
    try:
        def python_discard() -> None:
            with urllib.request.urlopen(url + "model.safetensors") as response:
                while response.read(1 << 20):
                    pass

        t = timed(python_discard)
        rows.append(("raw: urllib read, discarded", f"{size / GB:.1f} GB", f"{size / t / GB:.2f} GB/s"))
        if shutil.which("curl"):
            t = timed(lambda: subprocess.run(["curl", "-sf", "-o", "/dev/null", url + "x"], check=True))
            rows.append(("raw: curl -o /dev/null", f"{size / GB:.1f} GB", f"{size / t / GB:.2f} GB/s"))
            dest = work / "curl.out"
            t = timed(lambda: subprocess.run(["curl", "-sf", "-o", str(dest), url + "x"], check=True))
            rows.append(("raw: curl -o file (no hash, no fsync)", f"{size / GB:.1f} GB", f"{size / t / GB:.2f} GB/s"))
            dest.unlink()

        dest_dir = work / "dest"
        state = work / "dstate"
        manifest = {
            "version": 1, "state_dir": str(state), "reserve_bytes": 0,
            "models": [{"name": "bench", "dir": str(dest_dir), "hub_url": url, "peer_url": None,
                        "files": [{"path": "model.safetensors", "size": size, "sha256": digest}]}],
        }  # fmt: skip
        man_path = work / "dmanifest.json"
        man_path.write_text(json.dumps(manifest))

        def fetch() -> None:
            shutil.rmtree(dest_dir, ignore_errors=True)
            shutil.rmtree(state, ignore_errors=True)
            proc = subprocess.run(
                [sys.executable, str(RIGFETCH), "--manifest", str(man_path), "--quiet"], capture_output=True, text=True
            )
            report = json.loads(proc.stdout.splitlines()[-1])
            assert proc.returncode == 0 and report["bytes_downloaded"] == size, proc.stderr

        t = timed(fetch)
        rows.append(("rigfetch: download + SHA-256 + fsync + rename", f"{size / GB:.1f} GB", f"{size / t / GB:.2f} GB/s"))
        shutil.rmtree(dest_dir, ignore_errors=True)
    finally:
        server.shutdown()
        server.server_close()
        src.unlink()
    return rows


# ------------------------------------------------------------------------------------------
# re-run of the model step


def bench_rerun(work: Path, model_gb: float) -> list[tuple[str, str, str]]:
    from rigup_testbed.gitremotes import GitServer, make_remotes
    from rigup_testbed.hfhub import HfHub, sandbox_spec

    rows: list[tuple[str, str, str]] = []
    # The real sizes: Qwen3.6-27B int4 AutoRound (17.5 GB in the catalog) plus the DFlash draft (1.75 GB).
    main = int(model_gb * GB)
    sizes = {"qwen_shard1": main * 3 // 4, "qwen_shard2": main - main * 3 // 4, "qwen_dflash": int(min(model_gb, 1.75) * GB)}
    hub = HfHub(work / "hub", spec=sandbox_spec(sizes=sizes))
    url = hub.start()
    rem = make_remotes(work / "git")
    git = GitServer(work / "git")
    gurl = git.start()
    try:
        fleet = work / "rigs.yaml"
        fleet.write_text(
            f"data:\n  hf_endpoint: {url}\n  vllm_fork_git_url: {rem.vllm.url(gurl)}\n"
            "groups:\n  rigs:\n    hosts:\n      rig: {ssh_hostname: 127.0.0.1, variant: dual-dflash}\n"
        )
        env = {**os.environ, "RIGUP_RIGS": str(fleet), "PYTHONPATH": str(REPO_ROOT)}
        subprocess.run([sys.executable, "-m", "rigup", "lock"], cwd=REPO_ROOT, env=env, check=True, capture_output=True)
        root = work / "rig"
        pyinfra = str(Path(sys.executable).with_name("pyinfra"))
        cmd = [
            pyinfra, "-y", "@local", "tasks/model.py",
            "--data", f"install_root={root}/opt", "--data", f"model_dir={root}/models",
            "--data", f"hf_endpoint={url}", "--data", "variant=dual-dflash", "--data", "_sudo=false",
            "--data", f"vllm_fork_git_url={rem.vllm.url(gurl)}",
        ]  # fmt: skip
        start = time.perf_counter()
        first = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
        first_s = time.perf_counter() - start
        assert first.returncode == 0, (first.stdout + first.stderr)[-3000:]
        report = json.loads((root / "opt" / "state" / "fetch-report.json").read_text())
        model_bytes = report["bytes_downloaded"]
        rows.append(
            ("model task, first converge (pyinfra @local, fake hub on loopback)", f"{model_bytes / GB:.2f} GB downloaded",
             f"{first_s:.1f} s ({model_bytes / first_s / GB:.2f} GB/s)")
        )  # fmt: skip
        hub.admin().reset_stats()
        second_s = timed(lambda: subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, check=True))
        stats = hub.admin().stats()
        after = json.loads((root / "opt" / "state" / "fetch-report.json").read_text())
        assert after == report, "rigfetch ran on the re-run"
        rows.append(
            ("model task, re-run (pyinfra @local; all No changes)", "0 B hashed, 0 B downloaded",
             f"{second_s:.2f} s ({stats['total_bytes']} B from the hub)")
        )  # fmt: skip
        # The parts of that cost: the check the fact runs, and a stamps-only fetch.
        from rigup.desired.lock import LockFile
        from rigup.desired.models import model_entry
        from rigup.desired.recipe import resolve

        lock = LockFile.load(work / "rigs.lock.yaml")
        data = {"variant": "dual-dflash", "install_root": f"{root}/opt", "model_dir": f"{root}/models",
                "serving_bind_address": "0.0.0.0", "vllm_fork_git_url": rem.vllm.url(gurl)}  # fmt: skip
        from rigup.desired.knobs import load_defaults

        recipe = resolve({**load_defaults(), **data}, lock)
        models = [model_entry(m, lock.models[m.lock_name], url) for m in recipe.models]
        man = {"version": 1, "state_dir": f"{root}/opt/state", "reserve_bytes": 0, "models": models}
        b64 = encode_manifest(man)
        t = timed(lambda: subprocess.run([sys.executable, str(RIGFETCH), "--check", "--manifest-b64", b64],
                                         check=True, capture_output=True), repeat=5)  # fmt: skip
        nfiles = sum(len(m["files"]) for m in models)
        rows.append((f"rigfetch --check ({nfiles} files, stamps only)", "0 B read", f"{t * 1000:.0f} ms"))
        t = timed(lambda: subprocess.run([sys.executable, str(RIGFETCH), "--manifest-b64", b64, "--quiet"],
                                         check=True, capture_output=True), repeat=5)  # fmt: skip
        rows.append(("rigfetch fetch on a verified rig (stamps only)", "0 B read", f"{t * 1000:.0f} ms"))
        t = timed(lambda: subprocess.run([sys.executable, str(RIGFETCH), "--manifest-b64", b64, "--quiet",
                                          "--reverify"], check=True, capture_output=True))  # fmt: skip
        rows.append(("rigfetch --reverify (model_reverify=true)", f"{model_bytes / GB:.2f} GB hashed", f"{t:.2f} s"))
    finally:
        git.stop()
        hub.stop()
    return rows


# ------------------------------------------------------------------------------------------


SECTION = "## Artifacts: hashing, download + verify, model-step re-run (bench/bench_artifacts.py)"


def write_results(path: Path, label: str, text: str, section: str = SECTION) -> None:
    """Put `text` (a "### Measured: <label>" block) into this benchmark's section of the shared
    results file, replacing an older block with the same label; other sections stay untouched."""
    lines = (path.read_text() if path.exists() else "# Benchmarks\n").splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() == section), None)
    if start is None:
        lines += ["", section, ""]
        start = len(lines) - 2
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    heading = f"### Measured: {label}"
    block_start = next((i for i in range(start, end) if lines[i].startswith(heading)), None)
    new_block = text.rstrip("\n").splitlines()
    if block_start is None:
        lines[end:end] = (["", *new_block] if lines[end - 1].strip() else new_block) + ([""] if end < len(lines) else [])
    else:
        block_end = next(
            (i for i in range(block_start + 1, end) if lines[i].startswith(("### ", "## "))), end
        )
        lines[block_start:block_end] = new_block + ([""] if block_end < len(lines) else [])
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(lines).rstrip("\n") + "\n")
    os.replace(tmp, path)


def table(title: str, rows: list[tuple[str, str, str]], headers: tuple[str, str, str]) -> str:
    out = [f"#### {title}", "", f"| {headers[0]} | {headers[1]} | {headers[2]} |", "|---|---|---|"]
    out += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    return "\n".join(out) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hash", action="store_true")
    parser.add_argument("--download", action="store_true")
    parser.add_argument("--rerun", action="store_true")
    parser.add_argument("--hash-gb", type=float, default=1.0, help="bytes per hashed file (one per core)")
    parser.add_argument("--download-gb", type=float, default=2.0)
    parser.add_argument("--rerun-model-gb", type=float, default=17.5, help="main model size for --rerun (GB)")
    parser.add_argument("--workdir", help="scratch directory (default: a temp dir under the repo's .cache)")
    parser.add_argument("--out", help="results file to update (this benchmark's section only), e.g. bench/results.md")
    parser.add_argument("--label", default=platform.node(), help="machine label for the Markdown section")
    args = parser.parse_args()
    if not (args.hash or args.download or args.rerun):
        args.hash = args.download = args.rerun = True

    base = Path(args.workdir) if args.workdir else REPO_ROOT / ".cache"
    base.mkdir(parents=True, exist_ok=True)
    sections: list[str] = []
    info = machine()
    sections.append(
        f"### Measured: {args.label}, {time.strftime('%Y-%m-%d')}\n\n"
        + "\n".join(f"- {k}: {v}" for k, v in info.items())
        + "\n"
    )
    with tempfile.TemporaryDirectory(prefix="rigup-bench-", dir=base) as tmp:
        work = Path(tmp)
        if args.hash:
            d = work / "hash"
            d.mkdir()
            rows = bench_hash(d, int(args.hash_gb * GB))
            sections.append(table("SHA-256 throughput (page cache, best of 3)", rows, ("what", "data", "throughput")))
        if args.download:
            d = work / "download"
            d.mkdir()
            rows = bench_download(d, int(args.download_gb * GB))
            sections.append(table("Download over loopback HTTP (best of 3)", rows, ("what", "data", "throughput")))
        if args.rerun:
            d = work / "rerun"
            d.mkdir()
            rows = bench_rerun(d, args.rerun_model_gb)
            sections.append(table("Model step on a converged rig", rows, ("what", "work", "time")))
    text = "\n".join(sections)
    print(text)
    if args.out:
        write_results(Path(args.out), args.label, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
