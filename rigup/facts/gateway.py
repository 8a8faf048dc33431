"""Facts of the gateway task: what a rig serves now (its provenance record and running rigup units),
the gateway's current config, and whether a pinned venv is complete."""

from __future__ import annotations

import json
from typing import Any

from pyinfra.api import FactBase, FactProcessError, QuoteString, StringCommand

UNITS_MARK = "--rigup-active-units--"
RECORD_MARK = "--rigup-provenance-record--"


class ServedRecord(FactBase[dict[str, Any]]):
    """
    What a rig serves: the provenance record of each of its pods (``{install_root}/state/provenance.json``
    for a host without pods, ``state/pods/<pod>/provenance.json`` for each pod a host lists; none before
    a release passed the gate) and the rigup units systemd runs now:

    .. code:: python

        {"records": [{"variant": "dual", "unit": "rigup-dual.service", "gate": {"result": "passed"}, ...}],
         "active_units": ["rigup-dual.service"]}
    """

    default = dict

    def command(self, install_root: str) -> StringCommand:
        state = install_root.rstrip("/") + "/state"
        return StringCommand(
            "for f in", QuoteString(f"{state}/provenance.json"), StringCommand(QuoteString(f"{state}/pods/"),
                                                                                 "*/provenance.json;", _separator=""),
            'do [ -f "$f" ] || continue; echo', RECORD_MARK, '; cat "$f"; echo; done; echo', UNITS_MARK,
            "; systemctl list-units --type=service --state=active --no-legend --plain 'rigup-*.service' 2>/dev/null"
            " | awk '{print $1}'",
        )  # fmt: skip

    def process(self, output: list[str]) -> dict[str, Any]:
        mark = output.index(UNITS_MARK) if UNITS_MARK in output else len(output)
        records: list[dict[str, Any]] = []
        chunks: list[list[str]] = []
        for line in output[:mark]:
            if line == RECORD_MARK:
                chunks.append([])
            elif chunks:
                chunks[-1].append(line)
        for chunk in chunks:
            try:
                record = json.loads("\n".join(chunk))
            except ValueError:
                continue  # a torn or foreign file: no route from it
            if isinstance(record, dict):
                records.append(record)
        return {
            "records": records,
            "active_units": [line.strip() for line in output[mark + 1 :] if line.strip().endswith(".service")],
        }


class TextFile(FactBase[str | None]):
    """A small text file's content; None when it does not exist."""

    def command(self, path: str) -> StringCommand:
        return StringCommand("if [ -f", QuoteString(path), "]; then cat", QuoteString(path), "; else echo __absent__; fi")

    def process(self, output: list[str]) -> str | None:
        if output == ["__absent__"]:
            return None
        return "\n".join(output) + "\n" if output else ""


class VenvComplete(FactBase[str | None]):
    """The requirements hash recorded in ``{venv}/.rigup-installed`` once its install finished; None if
    the venv is absent or unfinished."""

    def command(self, venv: str) -> StringCommand:
        marker = QuoteString(f"{venv.rstrip('/')}/.rigup-installed")
        return StringCommand("cat", marker, "2>/dev/null || true")

    def process(self, output: list[str]) -> str | None:
        text = "".join(output).strip()
        return text or None


class GatewayVenvs(FactBase[list[str]]):
    """The gateway venv directories (``{root}/venv-*``) on the host."""

    default = list

    def command(self, root: str) -> StringCommand:
        return StringCommand("for d in", StringCommand(QuoteString(root.rstrip("/")), "/venv-*", _separator=""),
                             '; do [ -d "$d" ] && echo "$d"; done; true')

    def process(self, output: list[str]) -> list[str]:
        return sorted(line.strip() for line in output if line.strip())


class UnitAgainstFiles(FactBase[dict[str, Any]]):
    """
    A unit's state and when its main process started, with the modification time of each file it
    runs from (wall-clock epoch seconds, sub-second; a missing file is left out):

    .. code:: python

        {"active": "active", "enabled": "enabled", "started": 1796136648.25, "reload": False,
         "mtimes": {"/opt/rigup/gateway/config.yaml": 1796136600.5}}

    The start comes from systemd's monotonic timestamp mapped through "now" (``systemctl show
    --timestamp=unix`` needs systemd 251; Ubuntu 22.04 has 249); ``started`` is None when the main
    process never started.
    """

    default = dict

    def command(self, unit: str, paths: list[str]) -> StringCommand:
        return StringCommand(
            "systemctl show -p ActiveState -p UnitFileState -p ExecMainStartTimestampMonotonic -p NeedDaemonReload",
            QuoteString(unit), "&& python3 -c", QuoteString(CLOCK_AND_MTIMES), *[QuoteString(p) for p in paths],
        )  # fmt: skip

    def process(self, output: list[str]) -> dict[str, Any]:
        shown: dict[str, str] = {}
        mtimes: dict[str, float] = {}
        now_wall = now_mono = None
        for line in output:
            if line.startswith("mtime "):
                _, stamp, path = line.split(" ", 2)
                mtimes[path] = float(stamp)
            elif line.startswith("clock "):
                _, wall, mono = line.split()
                now_wall, now_mono = float(wall), float(mono)
            elif "=" in line:
                key, _, value = line.partition("=")
                shown[key] = value.strip()
        if "ActiveState" not in shown or now_wall is None or now_mono is None:
            raise FactProcessError(f"systemctl show / the clock printed nothing usable: {output[-3:]}")
        start_us = int(shown.get("ExecMainStartTimestampMonotonic") or 0)
        return {
            "active": shown.get("ActiveState"),
            "enabled": shown.get("UnitFileState"),
            "started": now_wall - (now_mono - start_us / 1e6) if start_us > 0 else None,
            "reload": shown.get("NeedDaemonReload") == "yes",
            "mtimes": mtimes,
        }


# Run on the host: the wall and monotonic clocks now, then each existing path's mtime.
CLOCK_AND_MTIMES = (
    "import os, sys, time\n"
    "print('clock', repr(time.time()), repr(time.monotonic()))\n"
    "for p in sys.argv[1:]:\n"
    "    if os.path.exists(p): print('mtime', repr(os.stat(p).st_mtime), p)\n"
)
