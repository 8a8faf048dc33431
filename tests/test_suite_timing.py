"""The suite's own clock (tests/support/timing.py): phases summed from reports, the e2e module budget."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

from tests.support.timing import BED_UP_PROPERTY, SuiteTimings, longest_first, module_seconds, over_budget

ROOT = Path(__file__).resolve().parents[1]


def report(nodeid: str, duration: float, *, e2e: bool = False, props: tuple = ()) -> SimpleNamespace:
    return SimpleNamespace(nodeid=nodeid, duration=duration, keywords={"e2e": 1} if e2e else {},
                           user_properties=list(props))


def test_phases_are_summed_per_kind_and_module() -> None:
    timings = SuiteTimings()
    for r in (
        report("tests/a.py::t1", 1.5), report("tests/a.py::t1", 0.5), report("tests/b.py::t2", 2.0),
        report("tests/e2e/test_x.py::s1", 80.0, e2e=True, props=((BED_UP_PROPERTY, 30.0),)),
        report("tests/e2e/test_x.py::s1", 10.0, e2e=True, props=((BED_UP_PROPERTY, 30.0),)),  # its call: same bed
        report("tests/e2e/test_x.py::s2", 10.0, e2e=True),
        report("tests/e2e/test_y.py::s1", 200.0, e2e=True, props=((BED_UP_PROPERTY, 40.5), ("other", 1))),
    ):
        timings.add(r)  # type: ignore[arg-type]
    figures = timings.as_dict()
    assert figures["tests"] == 5  # reports of one test's phases count it once
    assert figures["unit"] == {"tests": 2, "seconds": 4.0}
    assert figures["bed_bring_up"] == {"beds": 2, "seconds": 70.5}
    assert list(figures["e2e_modules"]) == ["tests/e2e/test_y.py", "tests/e2e/test_x.py"]  # longest first
    assert figures["e2e_modules"]["tests/e2e/test_x.py"] == {"tests": 2, "seconds": 100.0}
    assert figures["e2e_tests"] == {"tests/e2e/test_x.py::s1": 90.0, "tests/e2e/test_x.py::s2": 10.0,
                                    "tests/e2e/test_y.py::s1": 200.0}  # each test's phases summed
    lines = timings.lines(budget_s=150)
    assert any("test_y.py" in line and "3:20" in line and "OVER BUDGET" in line for line in lines), lines
    assert any("test_x.py" in line and "1:40" in line and "OVER" not in line for line in lines), lines


def test_a_module_over_budget_is_named_with_the_knob_and_one_within_passes() -> None:
    assert over_budget("tests.e2e.test_x", 100.0, 420) is None
    message = over_budget("tests.e2e.test_x", 431.2, 420)
    assert message is not None and "tests.e2e.test_x took 431 s, over the 420 s budget" in message
    assert "E2E_MODULE_BUDGET_S" in message


def test_a_run_prints_where_its_time_went_and_writes_the_figures(tmp_path: Path) -> None:
    (tmp_path / "test_tiny.py").write_text(textwrap.dedent("""
        import time
        def test_sleeps():
            time.sleep(0.2)
    """))
    out = tmp_path / "timings.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "tests.support.timing", "-p", "no:cacheprovider",
         "--rootdir", str(tmp_path), str(tmp_path / "test_tiny.py")],
        cwd=ROOT, capture_output=True, text=True, env={"PYTHONPATH": str(ROOT), "RIGUP_SUITE_TIMINGS": str(out),
                                                         "PATH": "/usr/bin:/bin"}, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "where the time went" in proc.stdout
    assert "unit tests               1 tests  0:00" in proc.stdout, proc.stdout
    figures = json.loads(out.read_text())
    assert figures["tests"] == 1 and figures["unit"]["seconds"] >= 0.2


def test_the_longest_modules_run_first_and_unmeasured_ones_before_them(tmp_path: Path) -> None:
    figures = tmp_path / "durations.json"
    figures.write_text(json.dumps({"e2e_modules": {"tests/e2e/test_a.py": {"tests": 2, "seconds": 300.0},
                                                   "tests/e2e/test_b.py": {"tests": 1, "seconds": 500.0}},
                                   "unit_modules": {"tests/test_u.py": 3.0, "tests/test_v.py": 9.0}}))
    seconds = module_seconds(figures)
    nodeids = ["tests/test_u.py::t", "tests/e2e/test_a.py::x", "tests/test_v.py::t", "tests/e2e/test_a.py::y",
               "tests/e2e/test_new.py::z", "tests/e2e/test_b.py::w"]
    assert longest_first(nodeids, seconds) == [
        "tests/e2e/test_new.py", "tests/e2e/test_b.py", "tests/e2e/test_a.py", "tests/test_v.py", "tests/test_u.py"]
    assert module_seconds(tmp_path / "missing.json") == {}
    assert longest_first(nodeids, {}) == ["tests/test_u.py", "tests/e2e/test_a.py", "tests/test_v.py",
                                          "tests/e2e/test_new.py", "tests/e2e/test_b.py"]


def test_the_durations_table_puts_two_runs_side_by_side(tmp_path: Path) -> None:
    def run(wall: float, unit: float, modules: dict[str, tuple[int, float]]) -> dict:
        return {"wall_s": wall, "tests": 10 + sum(n for n, _ in modules.values()),
                "unit": {"tests": 10, "seconds": unit}, "bed_bring_up": {"beds": 2, "seconds": 61.0},
                "e2e_modules": {m: {"tests": n, "seconds": s} for m, (n, s) in modules.items()}}

    before = run(3154.0, 410.0, {"tests/e2e/test_a.py": (5, 527.4), "tests/e2e/test_b.py": (2, 600.0)})
    after = run(1500.0, 300.0, {"tests/e2e/test_a.py": (6, 300.0), "tests/e2e/test_new.py": (1, 30.0)})
    (tmp_path / "before.json").write_text(json.dumps(before))
    (tmp_path / "after.json").write_text(json.dumps(after))
    proc = subprocess.run([sys.executable, "-m", "tests.support.durations_table", str(tmp_path / "before.json"),
                           str(tmp_path / "after.json")], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[2] == "| wall clock | 17 -> 17 | 52:34 | 25:00 |"
    assert lines[3] == "| unit tests | 10 -> 10 | 6:50 | 5:00 |"
    # modules longest (before) first; one only in the later run has no time before
    assert [line.split(" | ")[0] for line in lines[5:]] == [
        "| `tests/e2e/test_b.py`", "| `tests/e2e/test_a.py`", "| `tests/e2e/test_new.py`"]
    assert lines[5].endswith("| 2 -> - | 10:00 | - |") and lines[7].endswith("| - -> 1 | - | 0:30 |")
    # a third run, labelled: its own column, the same rows
    (tmp_path / "cold.json").write_text(json.dumps(run(2000.0, 320.0, {"tests/e2e/test_a.py": (6, 400.0)})))
    proc = subprocess.run([sys.executable, "-m", "tests.support.durations_table", str(tmp_path / "before.json"),
                           f"warm={tmp_path / 'after.json'}", f"cold={tmp_path / 'cold.json'}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    lines = proc.stdout.splitlines()
    assert lines[0] == "| phase | tests | before | warm | cold |", proc.stdout
    assert lines[2] == "| wall clock | 17 -> 17 -> 16 | 52:34 | 25:00 | 33:20 |"
    assert lines[6].endswith("| 5 -> 6 -> 6 | 8:47 | 5:00 | 6:40 |"), lines[6]
