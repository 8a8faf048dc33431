"""The README's knob and variant tables match group_data/all.py and the catalog."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import re
import shlex
import shutil
import subprocess

import pytest

from rigup import REPO_ROOT, command
from rigup.desired.catalog import variant_names
from rigup.desired.knobs import load_defaults
from rigup.desired.lock import LOCK_COMMAND


def load_script():
    loader = importlib.machinery.SourceFileLoader("readme_tables", str(REPO_ROOT / "scripts" / "readme-tables"))
    spec = importlib.util.spec_from_loader("readme_tables", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def test_readme_tables_are_current():
    readme = (REPO_ROOT / "README.md").read_text()
    assert load_script().render(readme) == readme, "README tables are stale: run scripts/readme-tables"


def test_every_knob_and_variant_is_documented():
    readme = (REPO_ROOT / "README.md").read_text()
    for knob in load_defaults():
        assert f"| `{knob}` |" in readme, knob
    for variant in variant_names():
        assert f"| `{variant}` |" in readme, variant


# --------------------------------------------------------------------------------------------
# Every command the README's quick start and sandbox section show, and every command rigup prints as a
# next step, works as written from a fresh shell in the checkout: nothing activated, PATH=/usr/bin:/bin.
# Commands that need a fleet or a bed cannot run here; each must at least resolve (its program exists)
# and answer `--help` for the subcommand it names, and the files it reads must exist.

CLEAN_PATH = "/usr/bin:/bin"
# An inline code span is a command when it starts so (after VAR=value assignments).
COMMAND_START = re.compile(r"^(?:[A-Za-z_]\w*=\S+\s+)*(?:sudo\s+)?(?:\./\w|\.venv/bin/\w|scripts/\w|python3?\s|pyinfra\s|rigup\s|export\s)")


def section(readme: str, heading: str) -> str:
    """The README's text under `heading` down to the next heading of the same or a higher level."""
    level = len(heading) - len(heading.lstrip("#"))
    start = readme.index(f"\n{heading}\n")
    ends = [m.start() for m in re.finditer(r"^#{1,%d} " % level, readme[start + 1:], re.M)][1:]
    return readme[start: start + 1 + ends[0]] if ends else readme[start:]


def commands_in(text: str) -> list[str]:
    """The lines of its ```sh blocks and its inline code spans that are commands."""
    lines = [line for block in re.findall(r"```sh\n(.*?)```", text, re.S) for line in block.splitlines() if line.strip()]
    spans = [span for span in re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S)) if COMMAND_START.match(span)]
    return lines + spans


def readme_commands() -> list[str]:
    readme = (REPO_ROOT / "README.md").read_text()
    quick_start = readme[: readme.index("\n### The machine you are on\n")]
    return commands_in(quick_start) + commands_in(section(readme, "## The test bed and the sandbox"))


def printed_commands() -> list[str]:
    """The commands `sandbox up` prints as its next steps and its --help shows (run from the checkout)."""
    from rigup.cli import sandbox

    hint = sandbox.next_steps(sandbox.FLEET_FILE)
    assert hint.startswith("next:  ")
    described = [line.strip() for line in (sandbox.__doc__ or "").splitlines() if line.startswith("    ")]
    # what the deploy, doctor and `rigup lock` tell the user to run (rigup.command's form)
    hints = [LOCK_COMMAND, f"{LOCK_COMMAND} --prune", f"{command()} render --list"]
    return [line.strip() for line in hint.removeprefix("next:  ").splitlines()] + described + hints


def problem_running(line: str) -> str | None:
    """Why `line` would not run as written from a fresh shell in the checkout (None: it would)."""
    tokens = shlex.split(line, comments=True)
    while tokens and re.match(r"^[A-Za-z_]\w*=", tokens[0]):
        tokens.pop(0)
    if tokens[:1] == ["sudo"]:
        tokens.pop(0)
    if not tokens:
        return "no command"
    if tokens[0] == "export":
        return None if all(re.match(r"^[A-Za-z_]\w*=\S+$", t) for t in tokens[1:]) else "export expects NAME=value"
    program, args = tokens[0], tokens[1:]
    if "/" in program:
        path = REPO_ROOT / program
        if not (path.is_file() and os.access(path, os.X_OK)):
            return f"{program}: no such executable in the checkout"
    elif shutil.which(program, path=CLEAN_PATH) is None:
        return f"{program}: not found on PATH={CLEAN_PATH} (nothing is activated in a fresh shell)"
    read = [a for a in args if re.fullmatch(r"[\w.-]+\.py", a)] + ([args[0]] if program == "cp" else [])
    missing = [name for name in read if not (REPO_ROOT / name).exists()]
    if missing:
        return f"reads {', '.join(missing)}, which the checkout lacks"
    words = args[:2] if args[:1] == ["-m"] else []
    for arg in args[len(words):]:
        if not re.fullmatch(r"[a-z][a-z-]*", arg):
            break
        words.append(arg)
    argv = ["env", "-i", f"PATH={CLEAN_PATH}", program, *words, "--help"]
    result = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        return f"`{' '.join(argv[3:])}` exits {result.returncode}: {(result.stderr or result.stdout).strip()[-300:]}"
    return None


def test_documented_and_printed_commands_work_as_written_in_a_clean_shell():
    commands = readme_commands() + printed_commands()
    assert any(c.startswith(".venv/bin/pyinfra") for c in commands) and any("sandbox up" in c for c in commands)
    problems = {command: problem for command in dict.fromkeys(commands) if (problem := problem_running(command))}
    assert not problems, "\n".join(f"{command}\n    -> {why}" for command, why in problems.items())


@pytest.mark.parametrize("line,why", [
    ("python -m rigup lock", "python: not found"),
    ("RIGUP_RIGS=sandbox/rigs.yaml pyinfra -y inventory.py deploy.py", "pyinfra: not found"),
    ("python3 -m rigup lock", "exits 1"),
    (".venv/bin/rigup sandbox upp --hosts 2", "exits 2"),
    (".venv/bin/pyinfra inventory.py deploy-nope.py", "reads deploy-nope.py"),
])  # fmt: skip
def test_a_command_that_cannot_run_as_written_is_caught(line, why):
    assert why in (problem_running(line) or ""), problem_running(line)


def test_phase_table_lists_every_task_deploy_py_includes_in_its_order():
    # Was: the metrics and monitoring phases were missing from the table.
    readme = (REPO_ROOT / "README.md").read_text()
    table = section(readme, "## What a converge does").split("\n\n### ")[0]
    rows = re.findall(r"^\| [^|]+ \| `(tasks/\w+\.py)` \|", table, re.M)
    included = list(dict.fromkeys(re.findall(r'local\.include\("(tasks/\w+\.py)"\)', (REPO_ROOT / "deploy.py").read_text())))
    assert rows == included
