#!/usr/bin/env python3
"""Converge time and remote commands per rig on 1, 2, 4 and 8 test-bed rigs.

    sudo .venv/bin/python bench/converge.py [--sizes 1,2,4,8] [--repeat 3] [--results bench/results.md]

One bed of max(sizes) rigs (2x RTX 3090 each, rig-01 in group canary) is brought up, locked and
converged once with `pyinfra -y inventory.py deploy.py` (its time per phase and its remote commands
recorded). Then for each size N, with `--limit` to the first N rigs, `--repeat` times each (medians
count):
  - a converged re-run of the full deploy: wall time, control-machine CPU (user+sys of the pyinfra
    process) per rig, and the remote commands per rig (the closing summary's REMOTE COMMANDS column:
    commands plus file transfers, rigup.pyinfra_patches.fact_batching's fact batches included);
  - two no-op deploys on the same rigs, pyinfra's own floor: one operation (a files.directory that
    exists), and as many such operations as the full deploy has (each reads one fact, as pyinfra does).
Before the timed runs, one converged re-run of every rig (its remote commands reported as "first
re-run"): the facts a changing converge does not ask (a checksum of a file that was just uploaded)
are read singly then, and batched from the next run on.
Every timed re-run is checked converged: pyinfra's --json results must show zero operations that
changed anything. The tables go into the "Converge: time and remote commands per rig" section of
bench/results.md, replacing only that section.

Needs what the test bed needs: root, debootstrap, systemd-nspawn (see rigup_testbed).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import resource
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

from rigup.runstate import remote_commands_in  # noqa: E402
from rigup_testbed.fleet import Testbed, host_names  # noqa: E402
from rigup_testbed.hosts import HostSpec  # noqa: E402
from rigup_testbed.image import cache_dir  # noqa: E402

SECTION = "## Converge: time and remote commands per rig (1, 2, 4, 8 rigs)"
OLD_SECTIONS = ("## Serving: converged re-run of the full deploy (1, 2, 4, 8 hosts)",)  # replaced by this one
def noop_deploy(operations: int) -> str:
    return "from pyinfra.operations import files\n\n" + "".join(
        f'files.directory(name="No-op {i}: /tmp exists", path="/tmp")\n' for i in range(operations))


GOAL_COMMANDS = 15  # issue 15: remote commands per rig on a converged re-run
GOAL_VS_NOOP = 2.0  # 1 rig: re-run <= 2x the no-op deploy
GOAL_SCALING = 1.3  # 4 rigs: re-run <= 1.3x its own 1-rig time
PYINFRA = str(Path(sys.executable).with_name("pyinfra"))


def run(cmd: list[str], env: dict[str, str], timeout: float) -> tuple[float, subprocess.CompletedProcess[str]]:
    secs, _, _, proc = timed(cmd, env, timeout)
    return secs, proc


def machine_busy_s() -> float:
    """CPU seconds every core of this machine has spent busy since boot (/proc/stat: all but idle and
    iowait), the rigs' included: they run on this machine's cores."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def timed(cmd: list[str], env: dict[str, str], timeout: float) -> tuple[float, float, float, subprocess.CompletedProcess[str]]:
    """Wall seconds, CPU seconds (user+sys of the child and its children), the whole machine's busy CPU
    seconds meanwhile and the finished process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    busy = machine_busy_s()
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    wall = time.monotonic() - started
    machine = machine_busy_s() - busy
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, machine, proc


def remote_commands(log: str) -> dict[str, int]:
    """The closing summary's REMOTE COMMANDS column, per rig."""
    counts = remote_commands_in(log)
    if counts is None:
        raise SystemExit("the converge printed no REMOTE COMMANDS column (is rigup.pyinfra_patches.fact_batching installed?)")
    return counts


def phase_times(log: str) -> str:
    m = re.search(r"Time per phase \(all hosts, wall\): (.*)$", log, flags=re.M)
    return m.group(1).strip() if m else "(not printed)"


def changed_ops(result: dict) -> dict[str, list[str]]:
    return {op["name"]: op["success"] for op in result["results"]["operations"] if op["success"]}


def deploy_without(skip: list[str], workdir: Path) -> str:
    """A copy of deploy.py's include list without the tasks named in `skip` (for a bed that cannot run
    them yet); returns its path."""
    source = (REPO_ROOT / "deploy.py").read_text()
    include = re.compile(r'^(\s*)local\.include\("tasks/(\w+)\.py"\)$', flags=re.M)
    unknown = sorted(set(skip) - {m.group(2) for m in include.finditer(source)})
    if unknown:
        raise SystemExit(f"--skip-task: deploy.py includes no task {', '.join(unknown)}")
    path = workdir / "deploy-partial.py"
    # deploy.py as it is, each skipped include a `pass` (it may be the only line of its gate's block)
    path.write_text(include.sub(lambda m: f"{m.group(1)}pass  # skipped: tasks/{m.group(2)}.py" if m.group(2) in skip
                                else m.group(0), source))
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
        # (the fleet tells Docker that the hub's registry speaks plain HTTP, as a LAN mirror often does)
        fleet = bed.write_fleet(bed.workdir / "rigs.yaml")
        env = {**os.environ, "RIGUP_RIGS": str(fleet), "PYINFRA_PROGRESS": "off"}
        # Python caches the bytecode of rigup's modules, as on a user's machine (the first converge writes
        # it): a shell that sets PYTHONDONTWRITEBYTECODE would compile about 60 of them on every run.
        env.pop("PYTHONDONTWRITEBYTECODE", None)
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
        first = {"phases": phase_times(proc.stdout + proc.stderr),
                 "commands_per_rig": max(remote_commands(proc.stdout + proc.stderr).values())}
        _, proc = run([PYINFRA, "-y", "--json", "inventory.py", deploy], env, 1800)  # the first re-run
        if proc.returncode != 0:
            raise SystemExit("first re-run failed:\n" + (proc.stdout + proc.stderr)[-4000:])
        first["rerun_commands_per_rig"] = max(remote_commands(proc.stderr).values())
        operations = len(json.loads(proc.stdout)["results"]["operations"])
        first["operations"] = operations
        noop, noop_all = Path(scratch) / "noop.py", Path(scratch) / f"noop{operations}.py"
        noop.write_text(noop_deploy(1))
        noop_all.write_text(noop_deploy(operations))
        rows = []
        for n in sizes:
            limit = [arg for name in names[:n] for arg in ("--limit", name)]
            walls, cpus, machine, cmds, noops, noops_all = [], [], [], [], [], []
            for _ in range(repeat):
                secs, cpu, busy, proc = timed([PYINFRA, "-y", "--json", "inventory.py", deploy, *limit], env, 1800)
                machine.append(busy)
                if proc.returncode != 0:
                    raise SystemExit(f"re-run on {n} hosts failed:\n" + (proc.stdout + proc.stderr)[-4000:])
                changed = changed_ops(json.loads(proc.stdout))
                if changed:
                    raise SystemExit(f"re-run on {n} hosts was not converged; changed: {changed}")
                counts = remote_commands(proc.stderr)
                walls.append(secs)
                cpus.append(cpu / n)
                cmds.append(max(counts.values()))
                for path, into in ((noop, noops), (noop_all, noops_all)):
                    secs, _, _, proc = timed([PYINFRA, "-y", "inventory.py", str(path), *limit], env, 600)
                    if proc.returncode != 0:
                        raise SystemExit(f"no-op deploy on {n} hosts failed:\n" + (proc.stdout + proc.stderr)[-4000:])
                    into.append(secs)
            rows.append({
                "hosts": n, "runs_s": [round(t, 2) for t in walls], "median_s": round(statistics.median(walls), 2),
                "noop_runs_s": [round(t, 2) for t in noops], "noop_median_s": round(statistics.median(noops), 2),
                "noop_all_median_s": round(statistics.median(noops_all), 2),
                "cpu_per_rig_s": round(statistics.median(cpus), 2), "commands_per_rig": max(cmds),
                "machine_cpu_s": round(statistics.median(machine), 2),
                "rig_cpu_per_rig_s": round(statistics.median(m - c * n for m, c in zip(machine, cpus)) / n, 2),
            })
            print(f"{n} host(s): re-run {rows[-1]['runs_s']} (median {rows[-1]['median_s']} s), no-op "
                  f"{rows[-1]['noop_runs_s']}, {rows[-1]['commands_per_rig']} remote commands per rig", flush=True)
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
        "first_converge": first,
        "hosts_total": total,
        "repeat": repeat,
        "rows": rows,
        "ratio_max_to_min": ratio,
        "sizes": sizes,
        "deploy": deploy if not skip else f"deploy.py without {', '.join(f'tasks/{t}.py' for t in skip)}",
        "host_setup": host_setup,
    }


def goals(result: dict) -> list[str]:
    """Issue 15's three bars, each with the measured value and met / NOT met."""
    by_n = {r["hosts"]: r for r in result["rows"]}
    out = []
    worst = max(r["commands_per_rig"] for r in result["rows"])
    out.append(f"remote commands per rig on a converged re-run <= {GOAL_COMMANDS}: {worst} "
               f"({'met' if worst <= GOAL_COMMANDS else 'NOT met'})")
    if 1 in by_n:
        ratio = by_n[1]["median_s"] / by_n[1]["noop_median_s"]
        out.append(f"1 rig: re-run <= {GOAL_VS_NOOP}x the no-op deploy: {ratio:.2f}x "
                   f"({'met' if ratio <= GOAL_VS_NOOP else 'NOT met'})")
    if 1 in by_n and 4 in by_n:
        ratio = by_n[4]["median_s"] / by_n[1]["median_s"]
        out.append(f"4 rigs: re-run <= {GOAL_SCALING}x its 1-rig time: {ratio:.2f}x "
                   f"({'met' if ratio <= GOAL_SCALING else 'NOT met'})")
    return out


def render(result: dict) -> str:
    lines = [
        SECTION,
        "",
        f"Measured {result['date']} on {result['machine']} with `python bench/converge.py --sizes "
        f"{','.join(map(str, result['sizes']))} --repeat {result['repeat']}`. One test bed of {result['hosts_total']} rigs "
        "(Debian 12 under systemd-nspawn on this same machine, stand-in NVIDIA packages, Docker's real engine, 2x RTX 3090 "
        f"simulated each): bed up in {result['bed_up_s']} s, `rigup lock` {result['lock_s']} s, first converge of all "
        f"{result['hosts_total']} rigs {result['first_converge_s']} s ({result['first_converge']['commands_per_rig']} "
        "remote commands on the busiest rig); the first converged re-run sent at most "
        f"{result['first_converge']['rerun_commands_per_rig']} (facts the changing run did not ask are read singly "
        "once, then batched). Every timed re-run was checked converged (pyinfra --json: zero operations changed).",
        "",
        f"First converge, time per phase (all rigs at once, wall): {result['first_converge']['phases']}.",
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
        f"| rigs | converged re-run, runs (s) | median (s) | pyinfra no-op, 1 operation (s) | re-run / no-op | "
        f"pyinfra no-op, {result['first_converge']['operations']} operations (s) | remote commands per rig | "
        "control CPU per rig (s) | whole machine CPU (s) | rest per rig (s) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        lines.append(
            f"| {row['hosts']} | {', '.join(f'{t:.2f}' for t in row['runs_s'])} | {row['median_s']:.2f} | "
            f"{row['noop_median_s']:.2f} | {row['median_s'] / row['noop_median_s']:.2f} | "
            f"{row['noop_all_median_s']:.2f} | {row['commands_per_rig']} | {row['cpu_per_rig_s']:.2f} | "
            f"{row['machine_cpu_s']:.2f} | {row['rig_cpu_per_rig_s']:.2f} |"
        )
    lines += [
        "",
        f"Whole machine CPU: every core of this {os.cpu_count()}-CPU machine busy during the re-run (medians); "
        "the rest per rig is that less pyinfra's own CPU, per rig: the rigs' sshd, sudo, the fact batch and the "
        "stand-ins it runs (and anything else the machine did meanwhile). On a real fleet that part runs on the "
        "rigs' own cores.",
        "",
        "Goals (issue 15):",
        "",
    ] + [f"- {g}" for g in goals(result)] + [""]
    if result.get("note"):
        lines += [f"Note: {result['note']}", ""]
    return "\n".join(lines)


def write_section(path: Path, section: str) -> None:
    """Replace this benchmark's section in `path` (or append it); leave every other section alone."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    lines = text.splitlines()
    for old in OLD_SECTIONS:  # a section this benchmark wrote under an earlier title
        at = next((i for i, line in enumerate(lines) if line.strip() == old), None)
        if at is not None:
            end = next((i for i in range(at + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
            lines = lines[:at] + lines[end:]
    text = "\n".join(lines) + "\n"
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
