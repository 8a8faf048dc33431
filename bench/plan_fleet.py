#!/usr/bin/env python3
"""Planning cost of a whole fleet (rigup.desired.fleet_plan.plan_fleet) for 8, 32 and 128 simulated hosts.

    .venv/bin/python bench/plan_fleet.py [--sizes 8,32,128] [--repeat 3] [--results bench/results.md]

Plan only, no bed and no network: for each size N a fleet file of N hosts is written (N-1 rigs, every
fourth one serving two pods, the others cycling the dual and dual-dflash variants, all pulling through
rig-001's image mirror; one gateway-only host running the gateway and the monitor) with a lock that pins
every need (made-up commits and hashes, as the unit tests' offline lock), and upstream's recipe files
are read from the test bed's fixture trees (rigup_testbed.recipes, what the bed's git remotes commit).
Then, timed, what a converge of the whole fleet plans before its first operation: the fleet file read,
plan_fleet over its hosts, every host's pods, model plan, image pins and registry, the image chain,
the gateway's routes and the monitor's targets (FleetPlan.plan_everything, gateway(), monitor()).
Reported per size: the median wall time of --repeat runs, per host, the recipes resolved (each pod
once: the count must equal the pods) and what asking every host's part again costs (nothing is planned
twice). The table goes into the "Fleet planning" section of bench/results.md, as a "### Measured" block
of this machine (an older block of the same machine replaced, every other part of the file left alone).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_artifacts import write_results  # noqa: E402 - path set above

from rigup.desired import plan as plan_module  # noqa: E402
from rigup.desired.fleet import load_fleet  # noqa: E402
from rigup.desired.fleet_plan import fleet_entries, plan_fleet  # noqa: E402
from rigup.desired.knobs import load_defaults  # noqa: E402
from rigup.desired.lock import LockFile  # noqa: E402
from rigup.desired.upstream import use_reader  # noqa: E402
from rigup_testbed.recipes import working_trees  # noqa: E402
from tests.support.fit_fake import offline_lock  # noqa: E402

SECTION = "## Fleet planning: plan_fleet for 8, 32 and 128 hosts (bench/plan_fleet.py)"
PODS = [{"name": "left", "variant": "dual", "gpus": [0, 1], "port": 8010},
        {"name": "right", "variant": "dual", "gpus": [2, 3], "port": 8011}]
VARIANTS = ("dual", "dual-dflash")


def rig_data(i: int) -> dict[str, Any]:
    """The i-th rig's own keys: every fourth one serves two pods, the others one variant in turn."""
    own: dict[str, Any] = {"ssh_hostname": f"10.0.{i // 250}.{i % 250 + 1}"}
    if i % 4 == 3:
        own["pods"] = PODS
    else:
        own["variant"] = VARIANTS[i % 2]
    return own


def write_fleet(directory: Path, hosts: int) -> Path:
    """A fleet file of `hosts` hosts (hosts-1 rigs, one gateway-only host) and its lock, in `directory`."""
    lock = LockFile()
    for data in ({"variant": v} for v in VARIANTS):  # every need of the variants the rigs serve
        part = LockFile.load(offline_lock({**load_defaults(), **data}, directory / "part.lock.yaml"))
        lock.git.update(part.git)
        lock.models.update(part.models)
        lock.images.update(part.images)
    lock.save(directory / "rigs.lock.yaml")
    key = directory / "gateway.key"
    key.write_text("sk-bench\n")
    key.chmod(0o600)
    lines = ["data:", "  image_mirror_host: rig-001", f"  lock_file: '{directory / 'rigs.lock.yaml'}'", "groups:", "  rigs:", "    hosts:"]
    lines += [f"      rig-{i + 1:03d}: {rig_data(i)}" for i in range(hosts - 1)]
    lines += ["  gateway:", f"    data: {{serves_variant: false, gateway_api_key_file: '{key}'}}", "    hosts:",
              "      gw: {ssh_hostname: 10.9.9.9, image_mirror_host: null}"]
    text = "\n".join(lines) + "\n"
    path = directory / "rigs.yaml"
    path.write_text(text)
    return path


def plan_once(path: Path) -> tuple[float, float, int, int, float]:
    """Seconds to plan the whole fleet, seconds to ask every host's part again, recipes resolved, pods, and
    the CPU seconds of the planning (this process's: what other work on a shared machine does not inflate)."""
    resolved = [0]
    real = plan_module.resolve

    def counting(*args: Any, **kwargs: Any) -> Any:
        resolved[0] += 1
        return real(*args, **kwargs)

    plan_module.resolve = counting
    try:
        start, cpu = time.perf_counter(), time.process_time()
        plan = plan_fleet(fleet_entries(load_fleet(path)))
        plan.plan_everything()
        for host in plan.hosts:
            host.gateway(read_secrets=False), host.monitor(read_secrets=False)
        planned, cpu = time.perf_counter() - start, time.process_time() - cpu
        pods = sum(len(h.pods) for h in plan.hosts)
        start = time.perf_counter()
        for host in plan.hosts:  # what every task of every host asks of the plan
            host.pods, host.models if host.roles.rig else None, host.mirror_pins, host.registry
        plan.image_chain()
        again = time.perf_counter() - start
        return planned, again, resolved[0], pods, cpu
    finally:
        plan_module.resolve = real


def measure(sizes: list[int], repeat: int) -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="rigup-plan-bench-") as tmp:
        for size in sizes:
            directory = Path(tmp) / str(size)
            directory.mkdir()
            path = write_fleet(directory, size)
            plan_once(path)  # warm: catalog, templates and fixture trees read once per process
            runs = [plan_once(path) for _ in range(repeat)]
            walls = [r[0] for r in runs]
            resolved, pods = runs[-1][2], runs[-1][3]
            if resolved != pods:
                raise SystemExit(f"{size} hosts: {resolved} recipes resolved for {pods} pods: a pod planned twice")
            rows.append({"hosts": size, "pods": pods, "walls": walls, "median": statistics.median(walls),
                         "cpus": [r[4] for r in runs], "cpu": statistics.median(r[4] for r in runs),
                         "again": statistics.median(r[1] for r in runs), "resolved": resolved})
            print(f"{size} hosts, {pods} pods: {', '.join(f'{w:.2f}' for w in walls)} s wall, "
                  f"{', '.join(f'{r[4]:.2f}' for r in runs)} s CPU; again "
                  f"{rows[-1]['again'] * 1000:.1f} ms", flush=True)
    return rows


def measured_commit() -> str:
    """The commit the planning code was measured at (HEAD of this checkout), and whether rigup/ differed from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True, check=True).stdout.strip()

    try:
        head = git("rev-parse", "--short=7", "HEAD")
        dirty = git("status", "--porcelain", "--", "rigup", "group_data", "templates")
    except (OSError, subprocess.CalledProcessError):
        return "an unknown commit (not a git checkout)"
    return head + (" with uncommitted changes to rigup/, group_data/ or templates/" if dirty else "")


def label() -> str:
    return f"{platform.node()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"


def measured(rows: list[dict[str, Any]], command: str) -> str:
    """The "### Measured: <label>" block of this run (bench_artifacts.write_results replaces the one of the
    same label in this benchmark's section)."""
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    base = rows[0]
    lines = [
        f"### Measured: {label()}", "",
        f"{now}, at {measured_commit()}, with `{command}`. Plan only (no bed, no network): the fleet file read, `plan_fleet` over its hosts and "
        "everything a converge of the whole fleet plans before its first operation (every host's pods, model "
        "plan, image pins and registry, the image chain, the gateway's routes, the monitor's targets); the fleet: "
        "every fourth rig two pods, the others dual or dual-dflash, all through rig-001's image mirror, plus one "
        "gateway-only host. Upstream's files from the test bed's fixture trees.", "",
        f"| hosts | pods | wall, runs (s) | CPU, runs (s) | CPU median (s) | CPU per host (ms) | CPU per pod (ms) | "
        f"growth vs {base['hosts']} hosts (CPU / hosts) | recipes resolved | every host's part asked again (ms) |",
        "|---:|---:|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        growth = (row["cpu"] / base["cpu"]) / (row["hosts"] / base["hosts"])
        lines.append(
            f"| {row['hosts']} | {row['pods']} | {', '.join(f'{w:.2f}' for w in row['walls'])} | "
            f"{', '.join(f'{c:.2f}' for c in row['cpus'])} | {row['cpu']:.2f} | "
            f"{row['cpu'] / row['hosts'] * 1000:.1f} | {row['cpu'] / row['pods'] * 1000:.1f} | {growth:.2f} | "
            f"{row['resolved']} | {row['again'] * 1000:.1f} |")
    lines += [
        "",
        "CPU: this process's user+system seconds while it planned (the machine was shared with other test runs, "
        "which inflate wall time but not these). "
        f"Growth vs {base['hosts']} hosts: the CPU median's ratio to the smallest fleet's, divided by the hosts' "
        "ratio (1.00: linear; the pods grow a little faster than the hosts, every fourth rig having two). "
        "Recipes resolved equals the pods: each pod is planned once per run however many tasks and hosts ask "
        "(before the FleetPlan, the image mirror task planned every host's pins on every host, N^2 host plans, "
        "hidden behind a process-wide memo).",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="8,32,128", help="host counts to plan (comma separated)")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per size (median reported)")
    parser.add_argument("--results", default=str(REPO_ROOT / "bench" / "results.md"), help="markdown file to update")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    previous = use_reader(working_trees())
    try:
        rows = measure(sizes, args.repeat)
    finally:
        use_reader(previous)
    command = f"python bench/plan_fleet.py --sizes {args.sizes} --repeat {args.repeat}"
    write_results(Path(args.results), label(), measured(rows, command), section=SECTION)
    print(f"written: {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
