"""Shared helpers of the stand-in tools (installed next to each tool as common.py).

Every absolute path a stand-in touches goes through `path()`, so the tools can be exercised on any
machine: with RIGUP_STANDIN_ROOT=/tmp/x they read /tmp/x/etc/rigup-testbed/hardware.json, keep their
state under /tmp/x/run, /tmp/x/var/lib, and read /tmp/x/proc/sys/kernel/random/boot_id. On a test-bed
host the variable is unset and the paths are the real ones.

Only the Python standard library: the hosts have python3 and nothing else. A fact batch starts a
dozen stand-ins, so what a plain read needs (hardware(), boot_id(), log_call(), read_json()) works on
strings and imports no pathlib and no typing: about 10 ms of each call here (`spath()` gives the
string, `path()` the Path for the rest).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time

TYPE_CHECKING = False  # typing's own flag, without importing typing
if TYPE_CHECKING:
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
    from pathlib import Path

    return Path(os.environ.get(ROOT_ENV) or "/")


def test_mode() -> bool:
    """True when running against a scratch root instead of a real (container) root."""
    return bool(os.environ.get(ROOT_ENV))


def path(absolute: str) -> Path:
    """`absolute` under the stand-in root."""
    return root() / absolute.lstrip("/")


def spath(absolute: str) -> str:
    """`absolute` under the stand-in root, as a string (what path() gives, without pathlib)."""
    return os.path.join(os.environ.get(ROOT_ENV) or "/", absolute.lstrip("/"))


def read_text(p: str | Path) -> str:
    with open(p) as fh:
        return fh.read()


def read_json(p: str | Path, default: Any = None) -> Any:
    try:
        return json.loads(read_text(p))
    except FileNotFoundError:
        return default
    except (OSError, ValueError):
        return default


def write_json_atomic(p: str | Path, data: Any, mode: int = 0o644) -> None:
    write_text_atomic(p, json.dumps(data, indent=2, sort_keys=True) + "\n", mode)


def write_text_atomic(p: str | Path, text: str, mode: int = 0o644) -> None:
    import tempfile  # here, not at the top: most calls of a stand-in write nothing

    target = os.fspath(p)
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=parent, prefix=f".{os.path.basename(target)}.")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def locked(p: str | Path) -> Iterator[None]:
    """Exclusive lock on `p` (created if missing) for read-modify-write of state files."""
    import fcntl

    os.makedirs(os.path.dirname(os.fspath(p)), exist_ok=True)
    with open(p, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def hardware() -> dict[str, Any]:
    """The host's simulated hardware (rigup_testbed/hardware.py schema), or the one-3090 default."""
    data = read_json(spath(HARDWARE_FILE))
    if not isinstance(data, dict):
        return json.loads(json.dumps(DEFAULT_HARDWARE))
    data.setdefault("gpus", [])
    return data


def gpus_named(gpus: list[dict[str, Any]], names: str) -> list[dict[str, Any]]:
    """The GPUs an NVIDIA_VISIBLE_DEVICES list names (indexes or UUIDs, comma-separated; "all": every
    one), in the hardware's order."""
    if names.strip() == "all":
        return list(gpus)
    wanted = {v.strip() for v in names.split(",")}
    return [g for g in gpus if str(g["index"]) in wanted or g["uuid"] in wanted]


def boot_id() -> str:
    try:
        return read_text(spath("/proc/sys/kernel/random/boot_id")).strip()
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
    p = spath(log_file)
    try:
        os.makedirs(os.path.dirname(p), exist_ok=True)
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


def own_pidns() -> str:
    """This process's pid namespace ("pid:[4026531836]"), as /proc names it."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def proc_starttime(pid: int | str = "self") -> int | None:
    """When a process started (clock ticks since boot, /proc/PID/stat field 22): with its pid, what tells
    one process from another one that reuses the pid, and the same in every pid namespace."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def host_pid(pid: int, pidns: str, starttime: int | None = None) -> int | None:
    """The pid, in this process's namespace, of process `pid` of namespace `pidns` that started at
    `starttime` (a GPU process inside a container registers its own pid; the driver, like the real one,
    reports host pids). None when no such process is visible from here. Reads only what /proc shows
    every user (NSpid, the start time), as nvidia-smi answers non-root callers too."""
    if not pidns or pidns == own_pidns():
        return pid if pid_alive(pid) and (starttime is None or proc_starttime(pid) == starttime) else None
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as f:
                nspid = next((line.split()[1:] for line in f if line.startswith("NSpid:")), [])
        except OSError:
            continue
        if len(nspid) < 2 or nspid[-1] != str(pid):
            continue
        if starttime is not None and proc_starttime(name) != starttime:
            continue
        try:
            if os.readlink(f"/proc/{name}/ns/pid") != pidns:
                continue
        except PermissionError:
            pass  # another user's process: the start time has told it apart
        except OSError:
            continue
        return int(name)
    return None


def registration_alive(entry: dict[str, Any]) -> bool:
    """Whether the GPU process an entry of /run/nvidia-standin/procs names still runs. From inside a
    container, a process of another pid namespace cannot be seen: it counts as alive (the container
    hook drops the dead ones on the host before each container starts, as the driver frees their memory)."""
    pid, pidns = int(entry.get("pid", 0) or 0), str(entry.get("pidns") or "")
    if pid <= 0:
        return False
    if pidns and pidns != own_pidns() and in_container():
        return True
    return host_pid(pid, pidns, entry.get("starttime")) is not None


# --- how busy a GPU's engine is ------------------------------------------------------------------
# An engine (responder.py) records in its /run/nvidia-standin/procs entry whether it has a request
# running, each time that changes, with exponential averages of that 0/1 signal over these time
# constants (seconds): what nvidia_smi.Gpu reads its utilisation and power (fast) and its temperature
# (slow, a heatsink's) from. A record stays valid without rewrites: its averages move toward `busy`.
UTIL_TAU_S = 1.0  # NVML averages utilisation over a sample period of 1/6 s to 1 s (nvml.h, nvmlUtilization_t)
THERMAL_TAU_S = 30.0


def activity_at(record: dict[str, Any] | None, now: float) -> tuple[float, float]:
    """(fast, slow) averages of an engine's busy signal at `now` (wall clock) from its last record."""
    if not isinstance(record, dict):
        return 0.0, 0.0
    busy, at = float(record.get("busy", 0)), float(record.get("at", now))
    elapsed = max(0.0, now - at)

    def toward(value: Any, tau: float) -> float:
        start = float(value or 0.0)
        return busy + (start - busy) * math.exp(-elapsed / tau)

    return toward(record.get("fast"), UTIL_TAU_S), toward(record.get("slow"), THERMAL_TAU_S)


def activity_record(previous: dict[str, Any] | None, busy: bool, now: float) -> dict[str, Any]:
    """The record an engine writes when it becomes busy or idle: the averages carried to `now`."""
    fast, slow = activity_at(previous, now)
    return {"busy": 1 if busy else 0, "at": now, "fast": fast, "slow": slow}


def in_container() -> bool:
    """Inside a Docker container (the engine writes /.dockerenv into each one's root)."""
    return os.path.exists("/.dockerenv")


def loaded_driver_version() -> str | None:
    """Version of the loaded NVIDIA kernel module, from /proc like every real tool reads it."""
    import re

    try:
        text = read_text(spath(PROC_DRIVER_VERSION))
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


# --- a YAML subset (the hosts have no PyYAML) ----------------------------------------------------
#
# Block mappings and sequences, plain / single- / double-quoted scalars, flow sequences and mappings on
# one line, comments and a leading "---": what deploy configs and similar small files are written in.
# Anything else (anchors, aliases, tags, block scalars, multi-line flows, tabs, several documents) is
# refused with YamlError naming the line, never guessed at. Scalars resolve as PyYAML's safe loader does:
# null/~, the YAML 1.1 booleans (yes/no/on/off too), ints (0x, 0o-style 0NN, 0b), floats, else strings
# (timestamps are refused).


class YamlError(ValueError):
    """The text is not YAML in the subset load_yaml reads; the message names the line."""


_YAML_BOOLS = {word: value for words, value in (("yes true on", True), ("no false off", False))
               for lower in words.split() for word in (lower, lower.capitalize(), lower.upper())}


def _yaml_scalar(text: str, line: int) -> Any:
    import re

    t = text.strip()
    if not t:
        return None
    if t[0] in "&*!|>%@`":
        raise YamlError(f"line {line}: {t[0]!r} (anchors, aliases, tags, block scalars) is not simulated")
    if t[0] == "'":
        if len(t) < 2 or not t.endswith("'"):
            raise YamlError(f"line {line}: unterminated single-quoted string")
        return t[1:-1].replace("''", "'")
    if t[0] == '"':
        try:
            value = json.loads(t)
        except ValueError:
            raise YamlError(f"line {line}: a double-quoted string this reader cannot decode: {t}") from None
        if not isinstance(value, str):
            raise YamlError(f"line {line}: unterminated double-quoted string")
        return value
    if t in ("~", "null", "Null", "NULL"):
        return None
    if t in _YAML_BOOLS:
        return _YAML_BOOLS[t]
    # PyYAML's (YAML 1.1) int and float forms, sexagesimal numbers aside
    if re.fullmatch(r"[-+]?(0|[1-9][0-9_]*)", t):
        return int(t.replace("_", ""))
    if re.fullmatch(r"[-+]?0x[0-9a-fA-F_]+|[-+]?0[0-7_]+|[-+]?0b[01_]+", t):
        sign, body = (-1 if t[0] == "-" else 1), t.lstrip("+-").replace("_", "")
        base = 16 if body[:2] == "0x" else 2 if body[:2] == "0b" else 8
        return sign * int(body[2:] if base != 8 else body, base)
    if re.fullmatch(r"[-+]?[0-9][0-9_]*\.[0-9_]*([eE][-+][0-9]+)?|\.[0-9][0-9_]*([eE][-+][0-9]+)?", t):
        return float(t.replace("_", ""))
    if re.match(r"[0-9]{4}-[0-9]{1,2}-[0-9]{1,2}([Tt ]|$)", t):
        raise YamlError(f"line {line}: a timestamp ({t}) is not simulated")
    if re.fullmatch(r"[-+]?\.(inf|Inf|INF)|\.(nan|NaN|NAN)", t):
        return float(t.replace(".", "").lower())
    return t


def _yaml_flow(text: str, line: int) -> Any:
    """A flow sequence or mapping that opens and closes on this line."""
    pos = 0

    def skip() -> None:
        nonlocal pos
        while pos < len(text) and text[pos] == " ":
            pos += 1

    def item(stop: str) -> Any:
        nonlocal pos
        skip()
        if pos < len(text) and text[pos] in "[{":
            return collection()
        start = pos
        if pos < len(text) and text[pos] in "'\"":
            quote = text[pos]
            pos += 1
            while pos < len(text) and not (text[pos] == quote and not (quote == '"' and text[pos - 1] == "\\")):
                pos += 1
            pos += 1
        else:
            while pos < len(text) and text[pos] not in stop and not (text[pos] == ":" and text[pos + 1:pos + 2] in (" ", "")):
                pos += 1
        return _yaml_scalar(text[start:pos], line)

    def collection() -> Any:
        nonlocal pos
        opening = text[pos]
        closing = "]" if opening == "[" else "}"
        pos += 1
        out: Any = [] if opening == "[" else {}
        while True:
            skip()
            if pos < len(text) and text[pos] == closing:
                pos += 1
                return out
            value = item(",]}" if opening == "[" else ",}:")
            skip()
            if opening == "{":
                if pos >= len(text) or text[pos] != ":":
                    raise YamlError(f"line {line}: a flow mapping entry needs 'key: value'")
                pos += 1
                out[value] = item(",}")
                skip()
            else:
                out.append(value)
            if pos < len(text) and text[pos] == ",":
                pos += 1
            elif pos >= len(text) or text[pos] != closing:
                raise YamlError(f"line {line}: a flow collection must close on its line (multi-line flows are not "
                                "simulated)")

    value = collection()
    skip()
    if pos != len(text):
        raise YamlError(f"line {line}: text after a flow collection: {text[pos:]!r}")
    return value


def _yaml_lines(text: str) -> list[tuple[int, int, str]]:
    """(line number, indent, content without comment) of each line that holds something."""
    out = []
    for number, raw in enumerate(text.splitlines(), 1):
        if "\t" in raw[: len(raw) - len(raw.lstrip(" \t"))]:
            raise YamlError(f"line {number}: a tab in the indentation")
        quote, cut = None, len(raw)
        for i, c in enumerate(raw):
            if quote:
                if c == quote:
                    quote = None
            elif c in "'\"" and (i == 0 or raw[i - 1] in " [{,:-"):
                quote = c
            elif c == "#" and (i == 0 or raw[i - 1] in " \t"):
                cut = i
                break
        content = raw[:cut].rstrip()
        if not content.strip():
            continue
        if content.strip() in ("---", "...") and not out:
            continue
        if content.startswith(("---", "...")):
            raise YamlError(f"line {number}: several documents in one file are not simulated")
        out.append((number, len(content) - len(content.lstrip(" ")), content.strip()))
    return out


def _yaml_key(content: str) -> tuple[str, str] | None:
    """(key, rest) when the line is a mapping entry `key: rest` (or `key:`), else None."""
    quote = None
    for i, c in enumerate(content):
        if quote:
            if c == quote:
                quote = None
        elif c in "'\"" and i == 0:
            quote = c
        elif c == ":" and (i + 1 == len(content) or content[i + 1] == " "):
            return content[:i], content[i + 1:].strip()
        elif c in "[{" and i == 0:
            return None
    return None


def _yaml_value(rest: str, number: int) -> Any:
    return _yaml_flow(rest, number) if rest[:1] in ("[", "{") else _yaml_scalar(rest, number)


def _yaml_block(lines: list[tuple[int, int, str]], i: int, indent: int) -> tuple[Any, int]:
    number, ind, content = lines[i]
    if content == "-" or content.startswith("- "):
        out: list[Any] = []
        while i < len(lines) and lines[i][1] == indent and (lines[i][2] == "-" or lines[i][2].startswith("- ")):
            number, _, content = lines[i]
            rest = content[1:].strip()
            if not rest:
                if i + 1 < len(lines) and lines[i + 1][1] > indent:
                    value, i = _yaml_block(lines, i + 1, lines[i + 1][1])
                else:
                    value, i = None, i + 1
            elif _yaml_key(rest) is not None and rest[:1] not in "[{":
                # "- key: value" opens a mapping whose keys line up with `key`
                col = indent + len(content) - len(rest)
                lines[i] = (number, col, rest)
                value, i = _yaml_block(lines, i, col)
            else:
                value, i = _yaml_value(rest, number), i + 1
            out.append(value)
        return out, i
    mapping: dict[Any, Any] = {}
    while i < len(lines) and lines[i][1] == indent:
        number, _, content = lines[i]
        entry = None if content == "-" or content.startswith("- ") else _yaml_key(content)
        if entry is None:
            raise YamlError(f"line {number}: expected 'key: value' here: {content!r}")
        key = _yaml_scalar(entry[0], number)
        if key in mapping:
            raise YamlError(f"line {number}: duplicate key {key!r}")
        rest = entry[1]
        i += 1
        if rest:
            mapping[key] = _yaml_value(rest, number)
        elif i < len(lines) and (lines[i][1] > indent or (lines[i][1] == indent and lines[i][2][:2] in ("- ", "-"))):
            mapping[key], i = _yaml_block(lines, i, lines[i][1])
        else:
            mapping[key] = None
    return mapping, i


def load_yaml(text: str) -> Any:
    """The one document of `text` (see the subset above); raises YamlError."""
    lines = _yaml_lines(text)
    if not lines:
        return None
    if len(lines) == 1 and _yaml_key(lines[0][2]) is None and not lines[0][2].startswith("-"):
        return _yaml_value(lines[0][2], lines[0][0])
    value, i = _yaml_block(lines, 0, lines[0][1])
    if i != len(lines):
        number, _, content = lines[i]
        raise YamlError(f"line {number}: unexpected indentation: {content!r}")
    return value
