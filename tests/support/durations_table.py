"""Two runs' figures (tests/support/timing.py's JSON, `RIGUP_SUITE_TIMINGS=path`) side by side, as the
Markdown table in tests/README.md: `python -m tests.support.durations_table BEFORE.json AFTER.json`.

Rows: the wall clock, unit tests, bed bring-up, then every e2e module, longest (before) first. Seconds are
each phase's own test time, summed; under several workers the phases overlap, so only the wall clock is
what a person waits for.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _mmss(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{int(seconds) // 60:d}:{int(seconds) % 60:02d}"


def rows(before: dict[str, Any], after: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """(phase, tests before -> after, time before, time after) for each phase of either run."""

    def count(run: dict[str, Any], key: str) -> str:
        return str(run[key]["tests"]) if key in run else "-"

    out = [
        ("wall clock", f"{before['tests']} -> {after['tests']}", _mmss(before["wall_s"]), _mmss(after["wall_s"])),
        ("unit tests", f"{count(before, 'unit')} -> {count(after, 'unit')}",
         _mmss(before["unit"]["seconds"]), _mmss(after["unit"]["seconds"])),
    ]
    beds = (before.get("bed_bring_up"), after.get("bed_bring_up"))
    out.append(("bed bring-up", " -> ".join(str(b["beds"]) if b else "-" for b in beds) + " beds",
                _mmss(beds[0]["seconds"] if beds[0] else None), _mmss(beds[1]["seconds"] if beds[1] else None)))
    first, second = before["e2e_modules"], after["e2e_modules"]
    order = sorted(set(first) | set(second), key=lambda m: -first.get(m, second.get(m, {"seconds": 0}))["seconds"])
    for module in order:
        a, b = first.get(module), second.get(module)
        out.append((f"`{module}`", f"{a['tests'] if a else '-'} -> {b['tests'] if b else '-'}",
                    _mmss(a["seconds"] if a else None), _mmss(b["seconds"] if b else None)))
    return out


def table(before: dict[str, Any], after: dict[str, Any]) -> str:
    lines = ["| phase | tests | before | after |", "|---|---|---|---|"]
    lines += [f"| {phase} | {tests} | {t0} | {t1} |" for phase, tests, t0, t1 in rows(before, after)]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m tests.support.durations_table BEFORE.json AFTER.json", file=sys.stderr)
        return 2
    before, after = (json.loads(Path(p).read_text()) for p in argv)
    print(table(before, after))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
