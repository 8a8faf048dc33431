"""Shared helpers of the stand-in tools (installed next to each tool as common.py).

Every absolute path a stand-in touches goes through `path()`, so the tools can be exercised on any
machine: with RIGUP_STANDIN_ROOT=/tmp/x they read /tmp/x/etc/rigup-testbed/hardware.json, keep their
state under /tmp/x/run, /tmp/x/var/lib, and read /tmp/x/proc/sys/kernel/random/boot_id. On a test-bed
host the variable is unset and the paths are the real ones.

Only the Python standard library: the hosts have python3 and nothing else.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, NoReturn

ROOT_ENV = "RIGUP_STANDIN_ROOT"
HARDWARE_FILE = "/etc/rigup-testbed/hardware.json"
RESPONDER_FILE = "/etc/rigup-testbed/responder.json"
REGISTRY_FILE = "/etc/rigup-testbed/registry.json"

# What a host looks like before the test bed wrote its hardware.json: one RTX 3090.
DEFAULT_HARDWARE: dict[str, Any] = {
    "schema": 1,
    "preset": "1x3090",
    "driver_cuda": None,
    "secure_boot": False,
    "topology": None,
    "gpus": [
        {
            "index": 0,
            "name": "NVIDIA GeForce RTX 3090",
            "architecture": "Ampere",
            "uuid": "GPU-5f0c2d61-7c1a-4a8e-9d3e-2b7f1e6a0c11",
            "pci_bus_id": "00000000:01:00.0",
            "memory_total_mib": 24576,
            "memory_used_mib": 1,
            "compute_cap": "8.6",
            "power_limit_w": 350,
            "power_default_w": 350,
            "power_min_w": 100,
            "power_max_w": 350,
        }
    ],
}


PROC_DRIVER_VERSION = "/proc/driver/nvidia/version"
# CUDA version each driver branch reports (hardware.json "driver_cuda" overrides, see driver_cuda()).
CUDA_BY_BRANCH = {"550": "12.4", "570": "12.8", "575": "12.9", "580": "13.0", "590": "13.1"}


def root() -> Path:
    return Path(os.environ.get(ROOT_ENV) or "/")


def test_mode() -> bool:
    """True when running against a scratch root instead of a real (container) root."""
    return bool(os.environ.get(ROOT_ENV))


def path(absolute: str) -> Path:
    """`absolute` under the stand-in root."""
    return root() / absolute.lstrip("/")


def read_json(p: Path, default: Any = None) -> Any:
    try:
        return json.loads(p.read_text())
    except FileNotFoundError:
        return default
    except (OSError, ValueError):
        return default


def write_json_atomic(p: Path, data: Any, mode: int = 0o644) -> None:
    write_text_atomic(p, json.dumps(data, indent=2, sort_keys=True) + "\n", mode)


def write_text_atomic(p: Path, text: str, mode: int = 0o644) -> None:
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, p)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def locked(p: Path) -> Iterator[None]:
    """Exclusive lock on `p` (created if missing) for read-modify-write of state files."""
    p.parent.mkdir(parents=True, exist_ok=True)
    with open(p, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def hardware() -> dict[str, Any]:
    """The host's simulated hardware (rigup_testbed/hardware.py schema), or the one-3090 default."""
    data = read_json(path(HARDWARE_FILE))
    if not isinstance(data, dict):
        return json.loads(json.dumps(DEFAULT_HARDWARE))
    data.setdefault("gpus", [])
    return data


def boot_id() -> str:
    try:
        return path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "unknown"


def log_call(log_file: str, tool: str, argv: list[str] | None = None) -> None:
    """Append one JSON line per invocation; tests read it to see what rigup ran (and with what)."""
    entry = {
        "ts": round(time.time(), 3),
        "tool": tool,
        "argv": list(sys.argv[1:] if argv is None else argv),
        "uid": os.getuid(),
        "cwd": os.getcwd() if os.path.exists(".") else "",
    }
    p = path(log_file)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        with open(p, "a") as fh:
            fh.write(json.dumps(entry) + "\n")
    except OSError:
        pass  # a non-root caller without write access still gets the tool's real behaviour


def fail(message: str, code: int = 1) -> NoReturn:
    sys.stderr.write(message if message.endswith("\n") else message + "\n")
    sys.stderr.flush()
    raise SystemExit(code)


def is_root() -> bool:
    # In test mode the scratch root belongs to whoever runs the tests: treat them as root.
    return test_mode() or os.geteuid() == 0


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def loaded_driver_version() -> str | None:
    """Version of the loaded NVIDIA kernel module, from /proc like every real tool reads it."""
    import re

    try:
        text = path(PROC_DRIVER_VERSION).read_text()
    except OSError:
        return None
    m = re.search(r"Kernel Module(?: for x86_64)?\s+(\d+\.\d+(?:\.\d+)?)", text)
    return m.group(1) if m else None


def driver_cuda(version: str, default: str | None = None) -> str:
    """CUDA version a driver `version` reports: hardware.json "driver_cuda" (a string, or a map from
    branch to string) wins, then the package's own value, then the per-branch table."""
    branch = version.split(".")[0]
    override = hardware().get("driver_cuda")
    if isinstance(override, dict):
        override = override.get(branch)
    if override:
        return str(override)
    return default or CUDA_BY_BRANCH.get(branch, "13.0")
