"""Facts of units rigup runs from files it writes: a unit's state against those files' modification
times (restart only what changed since it started), and a small text file's content (a config rigup
compares before it writes)."""

from __future__ import annotations

from typing import Any

from pyinfra.api import FactBase, FactProcessError, QuoteString, StringCommand


class TextFile(FactBase[str | None]):
    """A small text file's content; None when it does not exist."""

    def command(self, path: str) -> StringCommand:
        return StringCommand("if [ -f", QuoteString(path), "]; then cat", QuoteString(path), "; else echo __absent__; fi")

    def process(self, output: list[str]) -> str | None:
        if output == ["__absent__"]:
            return None
        return "\n".join(output) + "\n" if output else ""


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
