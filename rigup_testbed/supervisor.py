"""Keep one test-bed host running: start systemd-nspawn, start it again when the host reboots.

Run detached by hosts.py (standard library only, so it can be started with any python3):

    python3 supervisor.py --machine NAME --run-dir DIR --cgroup DIR [--cgroup DIR] -- NSPAWN_ARGS...

A reboot inside an nspawn container ends systemd-nspawn with exit status 133; a poweroff or halt ends
it with 0. On 133 the host is started again, in a fresh time namespace whose boot-time clock starts at
zero, so the uptime a client reads resets exactly like on real hardware (pyinfra's server.reboot relies
on that). SIGTERM asks the running host to power off and ends the supervisor.

Files in --run-dir: nspawn.pid ("PID STARTTIME" of the current systemd-nspawn), boots (one line per
start: epoch seconds), exit (final status, written once the supervisor stops).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REBOOT_STATUS = 133  # systemd-nspawn: the container asked for a reboot
MAX_QUICK_REBOOTS = 5  # reboots within QUICK_WINDOW_S that mean a boot loop, not a test
QUICK_WINDOW_S = 20.0


def _starttime(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[19])


def _uptime_s() -> int:
    return int(float(Path("/proc/uptime").read_text().split()[0]))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--machine", required=True)
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--cgroup", action="append", default=[], type=Path, help="cgroup dir to run nspawn in")
    parser.add_argument("--nspawn-env", action="append", default=[], metavar="NAME=VALUE",
                        help="environment for systemd-nspawn itself (its SYSTEMD_NSPAWN_* settings)")
    parser.add_argument("nspawn_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    nspawn_args = args.nspawn_args[1:] if args.nspawn_args[:1] == ["--"] else args.nspawn_args
    run_dir: Path = args.run_dir
    nspawn_env = dict(os.environ, **dict(item.split("=", 1) for item in args.nspawn_env))
    run_dir.mkdir(parents=True, exist_ok=True)

    stopping = False
    child: subprocess.Popen[bytes] | None = None

    def on_term(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True
        if child is not None and child.poll() is None:
            # systemd-nspawn turns SIGTERM into a clean poweroff of the container.
            child.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)

    def enter_cgroups() -> None:
        # Runs in the child between fork and exec: nspawn (--keep-unit) then uses this cgroup.
        for cg in args.cgroup:
            (cg / "cgroup.procs").write_text("0\n")

    quick: list[float] = []
    status = 0
    while not stopping:
        # Boot-time clock of the new time namespace starts at ~0: uptime resets on every (re)boot.
        cmd = ["unshare", "--time", "--boottime", f"-{_uptime_s()}", "--", "systemd-nspawn", *nspawn_args]
        child = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, preexec_fn=enter_cgroups, env=nspawn_env)
        (run_dir / "nspawn.pid").write_text(f"{child.pid} {_starttime(child.pid)}\n")
        with open(run_dir / "boots", "a") as boots:
            boots.write(f"{time.time():.3f}\n")
        while True:
            try:
                status = child.wait()
                break
            except InterruptedError:
                continue
        print(f"supervisor: {args.machine}: systemd-nspawn exited with {status}", flush=True)
        if status != REBOOT_STATUS or stopping:
            break
        now = time.monotonic()
        quick = [t for t in quick if now - t < QUICK_WINDOW_S] + [now]
        if len(quick) > MAX_QUICK_REBOOTS:
            print(f"supervisor: {args.machine}: boot loop, giving up", flush=True)
            status = 1
            break
    (run_dir / "nspawn.pid").unlink(missing_ok=True)
    (run_dir / "exit").write_text(f"{status}\n")
    return 0 if status in (0, REBOOT_STATUS) else status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
