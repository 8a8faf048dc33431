"""Where the suite's time goes, printed at the end of every run (a pytest plugin, `-p tests.support.timing`).

    wall            first collected test to the summary, as the person waiting sees it
    unit            the tests not marked e2e (their setup, call and teardown, summed)
    bed bring-up    each test bed's `Testbed.up` (debootstrap, image, hub, boots), reported by the e2e
                    fixtures as the user property `testbed_up_s`
    e2e modules     each e2e module from its first setup to its last teardown (its beds included), with
                    tests/e2e/conftest.py's budget beside it

It reads only test reports, so it works alike in one process and under pytest-xdist (reports reach the
controller with their durations and user properties). `RIGUP_SUITE_TIMINGS=path` also writes the figures
as JSON; tests/durations.json is such a file, from a full run on the CI machine.

It also orders the run for scripts/test's workers (pytest-xdist, one module at a time per worker): the
modules that took longest last time first, so the long ones start at once and the short ones fill in
at the end; a module it has no figure for counts as long. One process runs them in the same order.
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

TIMINGS_ENV = "RIGUP_SUITE_TIMINGS"
LAST_FULL_RUN = Path(__file__).resolve().parents[1] / "durations.json"
BED_UP_PROPERTY = "testbed_up_s"


class SuiteTimings:
    def __init__(self) -> None:
        self.started = time.monotonic()
        self.tests: set[str] = set()
        self.unit_s = 0.0
        self.unit_tests: set[str] = set()
        self.unit_module_s: dict[str, float] = defaultdict(float)
        self.e2e_test_s: dict[str, float] = defaultdict(float)  # setup + call + teardown, per e2e test
        self.beds_up_s: list[float] = []
        self._beds_counted: dict[str, int] = {}

    def add(self, report: pytest.TestReport) -> None:
        module = report.nodeid.split("::", 1)[0]
        self.tests.add(report.nodeid)
        if "e2e" in report.keywords:
            self.e2e_test_s[report.nodeid] += report.duration
        else:
            self.unit_s += report.duration
            self.unit_module_s[module] += report.duration
            self.unit_tests.add(report.nodeid)
        # a test's user properties ride on each of its reports (setup, call, teardown): count each once
        beds = [float(value) for name, value in report.user_properties if name == BED_UP_PROPERTY]
        counted = self._beds_counted.get(report.nodeid, 0)
        self.beds_up_s.extend(beds[counted:])
        self._beds_counted[report.nodeid] = max(counted, len(beds))

    def e2e_modules(self) -> dict[str, dict[str, Any]]:
        """Each e2e module's tests and seconds (its tests' summed), longest first."""
        modules: dict[str, dict[str, Any]] = defaultdict(lambda: {"tests": 0, "seconds": 0.0})
        for nodeid, seconds in self.e2e_test_s.items():
            figure = modules[nodeid.split("::", 1)[0]]
            figure["tests"] += 1
            figure["seconds"] += seconds
        return {module: {"tests": f["tests"], "seconds": round(f["seconds"], 1)}
                for module, f in sorted(modules.items(), key=lambda kv: -kv[1]["seconds"])}

    def as_dict(self) -> dict[str, Any]:
        return {
            "wall_s": round(time.monotonic() - self.started, 1),
            "tests": len(self.tests),
            "unit": {"tests": len(self.unit_tests), "seconds": round(self.unit_s, 1)},
            "bed_bring_up": {"beds": len(self.beds_up_s), "seconds": round(sum(self.beds_up_s), 1)},
            "e2e_modules": self.e2e_modules(),
            "unit_modules": {module: round(seconds, 2) for module, seconds in sorted(self.unit_module_s.items())},
            # where inside a module the time goes (a module's first test carries its bed's bring-up)
            "e2e_tests": {nodeid: round(seconds, 1) for nodeid, seconds in sorted(self.e2e_test_s.items())},
        }

    def lines(self, budget_s: float | None) -> list[str]:
        figures = self.as_dict()
        e2e_s = sum(m["seconds"] for m in figures["e2e_modules"].values())
        out = [
            f"wall {_mmss(figures['wall_s'])} for {figures['tests']} tests",
            f"  unit tests           {figures['unit']['tests']:5d} tests  {_mmss(figures['unit']['seconds'])}",
            f"  e2e modules          {sum(m['tests'] for m in figures['e2e_modules'].values()):5d} tests  "
            f"{_mmss(e2e_s)}, of which bed bring-up {_mmss(figures['bed_bring_up']['seconds'])} "
            f"({figures['bed_bring_up']['beds']} beds)",
        ]
        for module, figure in figures["e2e_modules"].items():
            over = "  OVER BUDGET" if budget_s is not None and figure["seconds"] > budget_s else ""
            out.append(f"    {module:<44} {figure['tests']:3d}  {_mmss(figure['seconds'])}{over}")
        if budget_s is not None:
            out.append(f"  (each e2e module's budget: {_mmss(budget_s)}, tests/e2e/conftest.py E2E_MODULE_BUDGET_S)")
        return out


def over_budget(module: str, took_s: float, budget_s: float) -> str | None:
    """The failure of an e2e module that took longer than its budget, or None."""
    if took_s <= budget_s:
        return None
    return (f"{module} took {took_s:.0f} s, over the {budget_s:.0f} s budget of an e2e module (tests/e2e/conftest.py "
            "E2E_MODULE_BUDGET_S): split it, share a bed or wait on conditions instead of sleeping")


def _mmss(seconds: float) -> str:
    return f"{int(seconds) // 60:d}:{int(seconds) % 60:02d}"


_TIMINGS = SuiteTimings()


def module_seconds(figures_file: Path = LAST_FULL_RUN) -> dict[str, float]:
    """Each module's seconds in the run `figures_file` records: e2e modules whole, unit modules summed."""
    try:
        figures = json.loads(figures_file.read_text())
    except (OSError, ValueError):
        return {}
    seconds = {module: float(f["seconds"]) for module, f in figures.get("e2e_modules", {}).items()}
    seconds.update({module: float(s) for module, s in figures.get("unit_modules", {}).items()})
    return seconds


def longest_first(nodeids: list[str], seconds: dict[str, float]) -> list[str]:
    """The modules of `nodeids` (in their order of first appearance), longest first; unknown ones first of
    all (a new module is assumed long until measured); ties keep their order."""
    modules = list(dict.fromkeys(n.split("::", 1)[0] for n in nodeids))
    unknown = float("inf")
    return sorted(modules, key=lambda m: -seconds.get(m, unknown))


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    order = {m: i for i, m in enumerate(longest_first([i.nodeid for i in items], module_seconds()))}
    items.sort(key=lambda item: order[item.nodeid.split("::", 1)[0]])  # stable: tests keep their order


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # under xdist, workers' reports arrive here on the controller too; a worker prints no summary
    _TIMINGS.add(report)


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    if hasattr(config, "workerinput") or not _TIMINGS.tests:
        return
    budget = _e2e_budget()
    terminalreporter.write_sep("=", "where the time went")
    for line in _TIMINGS.lines(budget):
        terminalreporter.write_line(line)
    target = os.environ.get(TIMINGS_ENV)
    if target:
        Path(target).write_text(json.dumps(_TIMINGS.as_dict(), indent=1) + "\n")


def _e2e_budget() -> float | None:
    try:
        from tests.e2e.conftest import E2E_MODULE_BUDGET_S
    except Exception:  # the e2e conftest's imports need the bed's packages; the summary does without
        return None
    return float(E2E_MODULE_BUDGET_S)
