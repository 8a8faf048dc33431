#!/usr/bin/env python3
"""Converged re-run of the full deploy on 1, 2, 4 and 8 test-bed hosts: how the no-op run scales.

    sudo .venv/bin/python bench/converge.py [--sizes 1,2,4,8] [--repeat 3] [--results bench/results.md]

One bed of max(sizes) hosts (2x RTX 3090 each, rig-01 in group canary) is brought up, converged once
with `pyinfra -y inventory.py deploy.py`, then for each size N the same command is timed with
`--limit` to the first N hosts, `--repeat` times (the median counts). Every timed run is checked to be
converged: pyinfra's --json results must show zero operations that changed anything. The table and
the 8:1 ratio go into the "Serving: converged re-run" section of bench/results.md, replacing only
that section (other helpers write their own sections in the same file).

Needs what the test bed needs: root, debootstrap, systemd-nspawn (see rigup_testbed).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from rigup_testbed.fleet import Testbed, host_names  # noqa: E402
from rigup_testbed.hosts import HostSpec  # noqa: E402
from rigup_testbed.image import cache_dir  # noqa: E402

SECTION = "## Serving: converged re-run of the full deploy (1, 2, 4, 8 hosts)"
PYINFRA = str(Path(sys.executable).with_name("pyinfra"))


def run(cmd: list[str], env: dict[str, str], timeout: float) -> tuple[float, subprocess.CompletedProcess[str]]:
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return time.monotonic() - started, proc


def changed_ops(result: dict) -> dict[str, list[str]]:
    return {op["name"]: op["success"] for op in result["results"]["operations"] if op["success"]}


def deploy_without(skip: list[str], workdir: Path) -> str:
    """A copy of deploy.py's include list without the tasks named in `skip` (for a bed that cannot run
    them yet); returns its path."""
    source = (REPO_ROOT / "deploy.py").read_text()
    includes = re.findall(r'^local\.include\("tasks/(\w+)\.py"\)', source, flags=re.M)
    unknown = sorted(set(skip) - set(includes))
    if unknown:
        raise SystemExit(f"--skip-task: deploy.py includes no task {', '.join(unknown)}")
    path = workdir / "deploy-partial.py"
    path.write_text(
        "from pyinfra import local\n"
        + "".join(f'local.include("tasks/{name}.py")\n' for name in includes if name not in skip)
    )
    return str(path)


def bench(sizes: list[int], repeat: int, instance: str, deploy: str, host_setup: str | None, skip: list[str]) -> dict:
    total = max(sizes)
    names = host_names(total)
    specs = [HostSpec(n, group="canary" if i == 0 else "rigs") for i, n in enumerate(names)]
    # Not under <cache>/runs: an e2e session tears down every bed it finds there.
    bed = Testbed(cache_dir() / "bench" / instance, instance)
    if bed.created:
        bed.down()  # a crashed earlier run
    scratch = tempfile.mkdtemp(prefix="rigup-bench-")
    started = time.monotonic()
    bed.up(specs)
    up_s = time.monotonic() - started
    try:
        if skip:
            deploy = deploy_without(skip, Path(scratch))
        # The hub's registry speaks plain HTTP, as a LAN mirror often does: Docker must be told.
        registry = bed.urls["container_registry"].split("/")[0]
        fleet = bed.write_fleet(bed.workdir / "rigs.yaml", data={"docker_insecure_registries": [registry]})
        env = {**os.environ, "RIGUP_RIGS": str(fleet), "PYINFRA_PROGRESS": "off"}
        lock_s, proc = run([sys.executable, "-m", "rigup", "lock"], env, 900)
        if proc.returncode != 0:
            raise SystemExit(f"rigup lock failed:\n{proc.stdout}{proc.stderr}")
        if host_setup:
            urls = bed.urls  # {container_registry} -> the hub's registry, and so on for every URL knob
            command = re.sub(r"\{(\w+)\}", lambda m: urls.get(m.group(1), m.group(0)), host_setup)
            for h in bed.hosts:
                h.ssh(f"sudo -n sh -c {shlex.quote(command)}", timeout=300)
        first_s, proc = run([PYINFRA, "-y", "inventory.py", deploy], env, 3600)
        if proc.returncode != 0:
            raise SystemExit("first converge failed:\n" + "\n".join((proc.stdout + proc.stderr).splitlines()[-60:]))
        rows = []
        for n in sizes:
            limit = [arg for name in names[:n] for arg in ("--limit", name)]
            times = []
            for _ in range(repeat):
                secs, proc = run([PYINFRA, "-y", "--json", "inventory.py", deploy, *limit], env, 1800)
                if proc.returncode != 0:
                    raise SystemExit(f"re-run on {n} hosts failed:\n" + (proc.stdout + proc.stderr)[-4000:])
                changed = changed_ops(json.loads(proc.stdout))
                if changed:
                    raise SystemExit(f"re-run on {n} hosts was not converged; changed: {changed}")
                times.append(secs)
            rows.append({"hosts": n, "runs_s": [round(t, 2) for t in times], "median_s": round(statistics.median(times), 2)})
            print(f"{n} host(s): {rows[-1]['runs_s']} -> median {rows[-1]['median_s']} s", flush=True)
    finally:
        bed.down()
        shutil.rmtree(scratch, ignore_errors=True)
    by_n = {r["hosts"]: r["median_s"] for r in rows}
    ratio = round(by_n[max(sizes)] / by_n[min(sizes)], 2) if min(sizes) in by_n and max(sizes) in by_n else None
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.node()} ({os.cpu_count()} CPUs, Python {platform.python_version()})",
        "bed_up_s": round(up_s, 1),
        "lock_s": round(lock_s, 1),
        "first_converge_s": round(first_s, 1),
        "hosts_total": total,
        "repeat": repeat,
        "rows": rows,
        "ratio_max_to_min": ratio,
        "sizes": sizes,
        "deploy": deploy if not skip else f"deploy.py without {', '.join(f'tasks/{t}.py' for t in skip)}",
        "host_setup": host_setup,
    }


def render(result: dict) -> str:
    lo, hi = min(result["sizes"]), max(result["sizes"])
    lines = [
        SECTION,
        "",
        f"Measured {result['date']} on {result['machine']} with `python bench/converge.py` "
        f"(helper \"serving\"). One test bed of {result['hosts_total']} hosts (Debian 12 under systemd-nspawn, "
        "stand-in NVIDIA/Docker packages, 2x RTX 3090 simulated each), converged once "
        f"({result['first_converge_s']} s for all {result['hosts_total']}), then `pyinfra -y inventory.py {result['deploy']} "
        f"--limit <first N hosts>` timed {result['repeat']}x per N. Every timed run was checked converged "
        "(pyinfra --json: zero operations changed).",
        "",
    ]
    if result["deploy"] != "deploy.py" or result["host_setup"]:
        lines += [
            f"Not the plain full deploy: {result['deploy']}"
            + (f", host setup `{result['host_setup']}` run on every host first" if result["host_setup"] else "")
            + ".",
            "",
        ]
    lines += [
        "| hosts | runs (s) | median (s) |",
        "|---:|---|---:|",
    ]
    for row in result["rows"]:
        lines.append(f"| {row['hosts']} | {', '.join(f'{t:.2f}' for t in row['runs_s'])} | {row['median_s']:.2f} |")
    lines += [
        "",
        f"Ratio {hi}:{lo} (median): **{result['ratio_max_to_min']}** "
        f"(1.0 would be perfect parallelism; {hi}.0 would be fully serial).",
        "",
    ]
    if result.get("note"):
        lines += [f"Note: {result['note']}", ""]
    return "\n".join(lines)


def write_section(path: Path, section: str) -> None:
    """Replace this benchmark's section in `path` (or append it); leave every other section alone."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() == SECTION), None)
    if start is None:
        new = text.rstrip("\n") + "\n\n" + section
    else:
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        new = "\n".join(lines[:start] + section.rstrip("\n").splitlines() + ([""] if end < len(lines) else []) + lines[end:]) + "\n"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(new if new.endswith("\n") else new + "\n")
    os.replace(tmp, path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,2,4,8", help="host counts to time (comma separated)")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per size (median reported)")
    parser.add_argument("--results", default=str(REPO_ROOT / "bench" / "results.md"), help="markdown file to update")
    parser.add_argument("--instance", default="rigbn", help="test-bed instance name")
    parser.add_argument("--json", help="also write the raw result here")
    parser.add_argument("--deploy", default="deploy.py", help="deploy file to converge and time (default deploy.py)")
    parser.add_argument(
        "--host-setup",
        help="shell command run as root on every host before the first converge; {knob} is replaced by the "
        "hub URL of that knob (e.g. {container_registry})",
    )
    parser.add_argument("--skip-task", action="append", default=[], help="run deploy.py without tasks/NAME.py (repeatable)")
    parser.add_argument("--note", help="a sentence recorded under the table (why the run differs from the default)")
    args = parser.parse_args()
    sizes = sorted({int(s) for s in args.sizes.split(",")})
    result = bench(sizes, args.repeat, args.instance, args.deploy, args.host_setup, args.skip_task)
    result["note"] = args.note
    section = render(result)
    write_section(Path(args.results), section)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
