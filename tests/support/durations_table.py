"""Runs' figures (tests/support/timing.py's JSON, `RIGUP_SUITE_TIMINGS=path`) side by side, as the Markdown
tables in tests/README.md: `python -m tests.support.durations_table BEFORE.json AFTER.json [MORE.json ...]`,
each argument optionally `label=path` (the column's heading; default: before, after, then the file's name).

Rows: the wall clock, unit tests, bed bring-up, then every e2e module, longest in the first run first.
Seconds are each phase's own test time, summed; under several workers the phases overlap, so only the
wall clock is what a person waits for.
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


def rows(*runs: dict[str, Any]) -> list[tuple[str, ...]]:
    """(phase, tests in each run joined by ' -> ', then each run's time) for each phase of any run."""

    def phase(name: str, figures: list[dict[str, Any] | None], count: str = "tests", suffix: str = "") -> tuple[str, ...]:
        tests = " -> ".join(str(f[count]) if f else "-" for f in figures) + suffix
        return (name, tests, *(_mmss(f["seconds"]) if f else "-" for f in figures))

    out = [("wall clock", " -> ".join(str(r["tests"]) for r in runs), *(_mmss(r["wall_s"]) for r in runs)),
           phase("unit tests", [r.get("unit") for r in runs]),
           phase("bed bring-up", [r.get("bed_bring_up") for r in runs], count="beds", suffix=" beds")]
    modules = [r["e2e_modules"] for r in runs]

    def first_seconds(module: str) -> float:
        return next(m[module]["seconds"] for m in modules if module in m)

    for module in sorted(set().union(*modules), key=lambda m: -first_seconds(m)):
        out.append(phase(f"`{module}`", [m.get(module) for m in modules]))
    return out


def table(runs: list[dict[str, Any]], labels: list[str]) -> str:
    lines = [f"| phase | tests | {' | '.join(labels)} |", "|---|---|" + "---|" * len(labels)]
    lines += ["| " + " | ".join(row) + " |" for row in rows(*runs)]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: python -m tests.support.durations_table [LABEL=]BEFORE.json [LABEL=]AFTER.json [...]", file=sys.stderr)
        return 2
    defaults = ["before", "after"]
    labels, runs = [], []
    for i, arg in enumerate(argv):
        label, sep, path = arg.partition("=")
        if not sep:
            label, path = (defaults[i] if i < len(defaults) else Path(arg).stem), arg
        labels.append(label)
        runs.append(json.loads(Path(path).read_text()))
    print(table(runs, labels))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
