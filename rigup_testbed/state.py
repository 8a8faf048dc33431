"""The ledger of everything a test bed created, so teardown works after a crash.

Each resource is appended to `state.json` BEFORE it is created (a crash between the two leaves an entry
for something that does not exist, which teardown tolerates; the reverse would leak). Teardown walks
the entries newest first. Processes are recorded with their kernel start time, so a recycled PID is
never signalled.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

CGROUP_FS = Path("/sys/fs/cgroup")
CGROUP_TOP = "rigup-testbed"


class TestbedError(RuntimeError):
    """The test bed could not be brought up or torn down."""

    __test__ = False  # not a pytest test class


def run(cmd: list[str], *, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run a command; with `check`, a failure raises TestbedError carrying its stderr."""
    proc = subprocess.run(cmd, text=True, capture_output=True, input=input)
    if check and proc.returncode != 0:
        raise TestbedError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


# --- processes ------------------------------------------------------------------------------


def proc_starttime(pid: int) -> int | None:
    """Kernel start time (clock ticks since boot) of `pid`, or None when it does not exist."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # comm (field 2) may hold spaces and parentheses; fields after the last ')' are fixed.
    rest = stat[stat.rindex(")") + 2 :].split()
    return int(rest[19])


def is_same_process(pid: int, starttime: int) -> bool:
    return proc_starttime(pid) == starttime


def signal_exact(pid: int, starttime: int, sig: int) -> bool:
    """Send `sig` to `pid` only if it is still the process that was recorded. True when sent."""
    if not is_same_process(pid, starttime):
        return False
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    return True


def wait_gone(pid: int, starttime: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not is_same_process(pid, starttime):
            return True
        # Reap it if it is our own child (a zombie keeps its /proc entry).
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        time.sleep(0.05)
    return not is_same_process(pid, starttime)


def stop_process(pid: int, starttime: int, timeout: float = 10.0) -> None:
    """SIGTERM, wait, then SIGKILL the recorded process."""
    if signal_exact(pid, starttime, signal.SIGTERM) and not wait_gone(pid, starttime, timeout):
        signal_exact(pid, starttime, signal.SIGKILL)
        wait_gone(pid, starttime, 5.0)


# --- cgroups ----------------------------------------------------------------------------------


def cgroup_roots() -> list[Path]:
    """Hierarchies a host's processes are placed in: the unified one, plus name=systemd on hybrid
    systems (systemd in the container needs its own subtree in both, or booted hosts fight over
    the same cgroup and break each other's units)."""
    if (CGROUP_FS / "cgroup.controllers").exists():  # pure cgroup2
        return [CGROUP_FS]
    roots = [CGROUP_FS / name for name in ("unified", "systemd") if (CGROUP_FS / name / "cgroup.procs").exists()]
    if not roots:
        raise TestbedError(f"no usable cgroup hierarchy under {CGROUP_FS}")
    return roots


def cgroup_paths(rel: str) -> list[Path]:
    return [root / CGROUP_TOP / rel for root in cgroup_roots()]


def cgroup_pids(rel: str) -> set[int]:
    pids: set[int] = set()
    for base in cgroup_paths(rel):
        if not base.exists():
            continue
        for procs in base.rglob("cgroup.procs"):
            try:
                pids.update(int(p) for p in procs.read_text().split())
            except OSError:
                continue
    return pids


def kill_cgroup(rel: str, timeout: float = 5.0) -> None:
    """SIGKILL every process left in the cgroup subtree `rel` (all of them were started by us)."""
    deadline = time.monotonic() + timeout
    while cgroup_pids(rel):
        for base in cgroup_paths(rel):
            kill_file = base / "cgroup.kill"
            if kill_file.exists():
                try:
                    kill_file.write_text("1")
                    continue
                except OSError:
                    pass
        for pid in cgroup_pids(rel):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            raise TestbedError(f"processes left in cgroup {rel}: {sorted(cgroup_pids(rel))}")
        time.sleep(0.05)


def remove_cgroup(rel: str) -> None:
    for base in cgroup_paths(rel):
        if not base.exists():
            continue
        for d in sorted((p for p in base.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
            d.rmdir()
        base.rmdir()
    # Drop the shared parents when they became empty (another instance may still use them).
    for root in cgroup_roots():
        parent = root / CGROUP_TOP / rel
        for up in list(parent.parents):
            if up == root:
                break
            try:
                up.rmdir()
            except OSError:
                break


# --- the ledger -------------------------------------------------------------------------------


class Ledger:
    """state.json: instance settings plus the ordered list of resources created."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict[str, Any] = {"resources": [], "info": {}}
        if path.exists():
            self.data = json.loads(path.read_text())

    @property
    def resources(self) -> list[dict[str, Any]]:
        return self.data["resources"]

    @property
    def info(self) -> dict[str, Any]:
        return self.data["info"]

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, self.path)

    def add(self, kind: str, **fields: Any) -> dict[str, Any]:
        entry = {"kind": kind, **fields}
        self.resources.append(entry)
        self.save()
        return entry

    def update(self, entry: dict[str, Any], **fields: Any) -> None:
        entry.update(fields)
        self.save()

    def set_info(self, **fields: Any) -> None:
        self.info.update(fields)
        self.save()

    def of_kind(self, kind: str) -> Iterator[dict[str, Any]]:
        return (r for r in self.resources if r["kind"] == kind)

    def teardown(self) -> list[str]:
        """Undo every resource, newest first. Returns the problems met (empty when clean)."""
        problems: list[str] = []
        # Ask every recorded process to stop at once (hosts power off in parallel), then undo in order.
        for entry in self.of_kind("process"):
            signal_exact(entry["pid"], entry["starttime"], signal.SIGTERM)
        while self.resources:
            entry = self.resources[-1]
            try:
                _undo(entry)
            except Exception as exc:  # keep going: leave as little behind as possible
                problems.append(f"{entry['kind']} {entry}: {exc}")
            self.resources.pop()
            self.save()
        return problems


def _undo(entry: dict[str, Any]) -> None:
    kind = entry["kind"]
    if kind == "process":
        stop_process(entry["pid"], entry["starttime"], entry.get("stop_timeout", 10.0))
    elif kind == "cgroup":
        kill_cgroup(entry["rel"])
        remove_cgroup(entry["rel"])
    elif kind == "mount":
        target = entry["target"]
        if _is_mountpoint(target):
            proc = run(["umount", target], check=False)
            if proc.returncode != 0:
                # Still busy: detach it so the directory can go; nothing of ours runs in it any more.
                run(["umount", "--lazy", target])
    elif kind == "netns":
        if Path("/run/netns", entry["name"]).exists():
            run(["ip", "netns", "delete", entry["name"]])
    elif kind == "link":
        if run(["ip", "link", "show", "dev", entry["name"]], check=False).returncode == 0:
            run(["ip", "link", "delete", "dev", entry["name"]])
    elif kind == "dir":
        path = Path(entry["path"])
        if path.exists():
            prefix = os.path.realpath(path)
            if any(m == prefix or m.startswith(prefix + "/") for m in _mounts()):
                raise TestbedError(f"{path} still has a mount under it; not removing")
            shutil.rmtree(path)
    elif kind == "file":
        Path(entry["path"]).unlink(missing_ok=True)
    else:
        raise TestbedError(f"unknown resource kind {kind!r}")


def _mounts() -> set[str]:
    targets = set()
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        targets.add(line.split()[4].replace("\\040", " "))
    return targets


def _is_mountpoint(path: str) -> bool:
    return os.path.realpath(path) in _mounts()


_CHILDREN: dict[int, subprocess.Popen[bytes]] = {}


def spawn(
    ledger: Ledger,
    role: str,
    cmd: list[str],
    *,
    log: Path,
    cgroup_rel: str | None = None,
    netns: str | None = None,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    stop_timeout: float = 10.0,
) -> dict[str, Any]:
    """Start `cmd` detached (own session, survives our exit), optionally inside a network namespace we
    created and a cgroup of ours, and record it in the ledger. Returns its ledger entry."""
    if netns is not None:
        # `ip netns exec` execs the command in place, so the PID we record is the command's own.
        cmd = ["ip", "netns", "exec", netns, *cmd]
    cgroups = cgroup_paths(cgroup_rel) if cgroup_rel is not None else []

    def enter_cgroups() -> None:
        for cg in cgroups:
            (cg / "cgroup.procs").write_text("0\n")

    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
            env=env,
            cwd=cwd,
            preexec_fn=enter_cgroups if cgroups else None,
        )
    starttime = proc_starttime(proc.pid)
    if starttime is None:
        raise TestbedError(f"{role}: {cmd[0]} exited at once; see {log}")
    _CHILDREN[proc.pid] = proc  # keep the handle: dropping it warns while the child runs
    return ledger.add("process", role=role, pid=proc.pid, starttime=starttime, cmd=cmd, log=str(log), stop_timeout=stop_timeout)


def make_cgroup(ledger: Ledger, rel: str) -> None:
    """Create cgroup `rel` (under rigup-testbed/) in every hierarchy and record it."""
    ledger.add("cgroup", rel=rel)
    for path in cgroup_paths(rel):
        path.mkdir(parents=True, exist_ok=True)
