"""Data-driven tests of rigup's facts, in the style of pyinfra's tests/facts/: one JSON file per
scenario under scenarios/<module>.<Fact>/ gives the fact's keyword arguments and the raw output of its
command ("output" lines, "output_file" relative to the repo root, optionally "output_section" of a
host-facts.txt capture), and the parsed value expected ("fact_value", compared as JSON: to_json()
where the value has one, dataclasses as dicts, tuples as lists) or the "exception" it must raise.
No output at all gives the fact's default(), as pyinfra's get_fact does.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest

from tests.operations.test_scenarios import output_lines, process_output, resolve, scenario_files

SCENARIOS = Path(__file__).parent / "scenarios"
FACT_KEYS = {"fact", "doc", "kwargs", "output", "output_file", "output_section", "fact_value", "exception"}


def to_json(value: Any) -> Any:
    if hasattr(value, "to_json"):
        value = value.to_json()
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if isinstance(value, dict):
        assert all(isinstance(k, str) for k in value), f"keys JSON cannot hold: {list(value)}"
        return {k: to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    return value


@pytest.mark.parametrize("path", scenario_files(SCENARIOS))
def test_fact_scenario(path: Path) -> None:
    spec = json.loads(path.read_text())
    assert set(spec) <= FACT_KEYS, f"unknown keys {set(spec) - FACT_KEYS}"
    assert spec["fact"] == path.parent.name, "the directory names the fact"
    assert ("exception" in spec) != ("fact_value" in spec), "a scenario expects a fact_value or an exception"
    cls = resolve(spec["fact"], "rigup.facts")
    kwargs = spec.get("kwargs", {})
    lines = output_lines({k: v for k, v in spec.items() if k in ("output", "output_file", "output_section")})

    if "exception" in spec:
        with pytest.raises(Exception) as info:
            process_output(cls, kwargs, lines)
        assert type(info.value).__name__ == spec["exception"]["type"], repr(info.value)
        assert re.search(spec["exception"]["match"], str(info.value)), str(info.value)
    else:
        value = process_output(cls, kwargs, lines)
        assert to_json(value) == spec["fact_value"]
        # what `pyinfra INVENTORY fact rigup.facts...` prints (its JSON encoder calls to_json()) is the same
        # (pyinfra_cli itself is not imported: importing it monkey-patches the process with gevent)
        assert json.loads(json.dumps(value, default=lambda o: o.to_json())) == spec["fact_value"]
