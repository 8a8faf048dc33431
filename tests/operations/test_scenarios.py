"""rigup's host operations, pyinfra-style: scenarios/<module>.<operation>/<scenario>.json gives the
args, the facts (raw "output" lines or an "output_file" relative to the repo root, parsed by the real
fact's process(); a literal "value"; or "by_kwargs" entries) and the expected "commands" and
"noop_description", or "exception". Every scripted fact must be read."""

from __future__ import annotations

import importlib
import json
import re
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from pyinfra.api.command import FileUploadCommand

from tests.support.opharness import ScriptedHost, raw_commands, render

REPO = Path(__file__).resolve().parents[2]
SCENARIOS = Path(__file__).parent / "scenarios"
_SECTION = re.compile(r"^=+ \$ (?P<command>.*)$")  # host-facts.txt: "=== $ COMMAND", output, "[rc=N]"
OP_KEYS = {"op", "doc", "args", "data", "facts", "commands", "noop_description", "exception"}
OUTPUT_KEYS = {"kwargs", "output", "output_file", "output_section", "value"}


def scenario_files(root: Path) -> list[Any]:
    return [pytest.param(p, id=f"{p.parent.name}/{p.stem}") for p in sorted(root.glob("*/*.json"))]


def resolve(name: str, package: str) -> Any:
    """"docker.DockerDaemonJson" -> rigup.facts.docker.DockerDaemonJson; "pyinfra.x.Y" as is."""
    module, _, attr = name.rpartition(".")
    return getattr(importlib.import_module(module if name.startswith("pyinfra.") else f"{package}.{module}"), attr)


def file_lines(rel: str, section: str | None = None) -> list[str]:
    lines = (REPO / rel).read_text().splitlines()
    if section is None:
        return lines
    starts = [i for i, line in enumerate(lines) if (m := _SECTION.match(line)) and m["command"] == section]
    assert len(starts) == 1, f"{rel}: {len(starts)} sections for {section!r}"
    out: list[str] = []
    for line in lines[starts[0] + 1 :]:
        if re.fullmatch(r"\[rc=\d+\]", line):
            return out
        out.append(line)
    raise AssertionError(f"{rel}: section {section!r} has no [rc=N] line")


def output_lines(spec: dict[str, Any]) -> list[str]:
    assert set(spec) <= OUTPUT_KEYS and len({"output", "output_file", "value"} & set(spec)) == 1, spec
    if "output_file" in spec:
        return file_lines(spec["output_file"], spec.get("output_section"))
    lines: list[str] = []
    for item in spec["output"]:  # a line, or {"file": ..., "section": ...} spliced in
        lines += [item] if isinstance(item, str) else file_lines(item["file"], item.get("section"))
    return lines


def process_output(cls: type, kwargs: dict[str, Any], lines: list[str]) -> Any:
    """What pyinfra's get_fact returns for this output (exit status 0): default() when empty."""
    fact = cls()
    if callable(fact.command):
        fact.command(**kwargs)  # checks the kwargs; some facts keep them for process()
    return fact.process(lines) if lines else fact.default()


def _answer(name: str, cls: type, entries: list[dict[str, Any]], used: set, **kwargs: Any) -> Any:
    for i, entry in enumerate(entries):
        if "kwargs" not in entry or entry["kwargs"] == json.loads(json.dumps(kwargs)):
            used.add((name, i))
            if "value" in entry:
                return entry["value"]
            return process_output(cls, kwargs, output_lines(entry))
    raise AssertionError(f"fact {name} read with {kwargs}: no by_kwargs entry matches")


def rendered(command: Any) -> Any:
    if isinstance(command, FileUploadCommand) and hasattr(command.src, "read"):
        command.src.seek(0)
        return {"upload": command.dest, "content": command.src.read().splitlines()}
    out = render(command)
    return list(out) if isinstance(out, tuple) else out


@pytest.mark.parametrize("path", scenario_files(SCENARIOS))
def test_operation_scenario(path: Path) -> None:
    spec = json.loads(path.read_text())
    assert set(spec) <= OP_KEYS, f"unknown keys {set(spec) - OP_KEYS}"
    assert spec["op"] == path.parent.name, "the directory names the operation"
    assert ("exception" in spec) != ("commands" in spec), "a scenario expects commands or an exception"
    used: set[tuple[str, int]] = set()
    facts, wanted = {}, set()
    for name, fact_spec in spec.get("facts", {}).items():
        entries = fact_spec["by_kwargs"] if "by_kwargs" in fact_spec else [fact_spec]
        assert "by_kwargs" not in fact_spec or len(fact_spec) == 1, fact_spec
        for i, entry in enumerate(entries):
            if "value" in entry:
                assert set(entry) <= {"kwargs", "value"}, entry
            else:
                output_lines(entry)  # checks the keys; a missing capture fails here, not when read
            wanted.add((name, i))
        cls = resolve(name, "rigup.facts")
        facts[cls] = partial(_answer, name, cls, entries, used)
    host = ScriptedHost(facts, spec.get("data"))
    op = resolve(spec["op"], "rigup.operations")

    if "exception" in spec:
        with pytest.raises(Exception) as info:
            raw_commands(op, host, **spec.get("args", {}))
        assert type(info.value).__name__ == spec["exception"]["type"], repr(info.value)
        assert re.search(spec["exception"]["match"], str(info.value)), str(info.value)
    else:
        commands = [rendered(c) for c in raw_commands(op, host, **spec.get("args", {}))]
        assert commands == spec["commands"]
        if not commands:
            assert "noop_description" in spec, "an operation that yields nothing must say why"
        noted = spec.get("noop_description", [])  # one text, or a list for an op built from several
        expected_noops = noted if isinstance(noted, list) else [noted]
        assert host.noops == expected_noops
    assert wanted - used == set(), f"scripted but never read: {sorted(wanted - used)}"
