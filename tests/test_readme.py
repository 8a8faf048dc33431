"""The README and the docs/ pages: their generated tables are current, the commands they show run as
written, the README's phase table is deploy.py's, and every page is reachable and every link resolves."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from rigup import REPO_ROOT, command
from rigup.desired.catalog import variant_names
from rigup.desired.knobs import load_defaults
from rigup.desired.lock import LOCK_COMMAND

README = REPO_ROOT / "README.md"
DOCS = REPO_ROOT / "docs"


def load_script():
    loader = importlib.machinery.SourceFileLoader("doc_tables", str(REPO_ROOT / "scripts" / "doc-tables"))
    spec = importlib.util.spec_from_loader("doc_tables", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def test_generated_tables_are_current_and_each_is_on_one_page():
    script = load_script()
    pages = {page: (REPO_ROOT / page).read_text() for page in script.PAGES}
    for page, text in pages.items():
        assert script.render(text) == text, f"{page}: tables are stale: run scripts/doc-tables"
    for marker in script.TABLES:
        holders = [page for page, text in pages.items() if f"<!-- {marker}:begin -->" in text]
        assert len(holders) == 1, f"the {marker} table is on {holders or 'no page'}; scripts/doc-tables PAGES lists where"


def test_every_knob_and_variant_is_documented():
    knobs = (DOCS / "knobs.md").read_text()
    for knob in load_defaults():
        assert f"| `{knob}` |" in knobs, knob
    variants = (DOCS / "variants.md").read_text()
    for variant in variant_names():
        assert f"| `{variant}` |" in variants, variant


# --------------------------------------------------------------------------------------------
# Every command the README and the sandbox section of docs/testbed.md show, and every command rigup prints as a
# next step, works as written from a fresh shell in the checkout: nothing activated, PATH=/usr/bin:/bin.
# Commands that need a fleet or a bed cannot run here; each must at least resolve (its program exists)
# and answer `--help` for the subcommand it names, and the files it reads must exist.

CLEAN_PATH = "/usr/bin:/bin"
# An inline code span is a command when it starts so (after VAR=value assignments).
COMMAND_START = re.compile(r"^(?:[A-Za-z_]\w*=\S+\s+)*(?:sudo\s+)?(?:\./\w|\.venv/bin/\w|scripts/\w|python3?\s|pyinfra\s|rigup\s|export\s)")


def section(text: str, heading: str) -> str:
    """A page's text under `heading` down to the next heading of the same or a higher level."""
    level = len(heading) - len(heading.lstrip("#"))
    start = text.index(f"\n{heading}\n")
    ends = [m.start() for m in re.finditer(r"^#{1,%d} " % level, text[start + 1:], re.M)][1:]
    return text[start: start + 1 + ends[0]] if ends else text[start:]


def commands_in(text: str) -> list[str]:
    """The lines of its ```sh blocks and its inline code spans that are commands."""
    lines = [line for block in re.findall(r"```sh\n(.*?)```", text, re.S) for line in block.splitlines() if line.strip()]
    spans = [span for span in re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S)) if COMMAND_START.match(span)]
    return lines + spans


def documented_commands() -> list[str]:
    sandbox = section((DOCS / "testbed.md").read_text(), "## The test bed and the sandbox")
    return commands_in(README.read_text()) + commands_in(sandbox)


def printed_commands() -> list[str]:
    """The commands `sandbox up` prints as its next steps and its --help shows (run from the checkout)."""
    from rigup_testbed import sandbox

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
    commands = documented_commands() + printed_commands()
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
    table = section(README.read_text(), "## What a converge does")
    rows = re.findall(r"^\| [^|]+ \| `(tasks/\w+\.py)` \|", table, re.M)
    included = list(dict.fromkeys(re.findall(r'local\.include\("(tasks/\w+\.py)"\)', (REPO_ROOT / "deploy.py").read_text())))
    assert rows == included


# --------------------------------------------------------------------------------------------
# The README is the way in: every docs/ page is linked from it, and every relative link of the README and
# the docs leads to a file of the checkout and, with a #anchor, to a heading of that page.

LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")


def prose(text: str) -> str:
    """`text` without its code blocks and inline code, where brackets are not links."""
    return re.sub(r"`[^`\n]*`", "", re.sub(r"^```.*?^```", "", text, flags=re.S | re.M))


def heading_anchors(text: str) -> set[str]:
    """The ids GitHub gives a page's headings: lower case, punctuation but - and _ dropped, spaces as -,
    a repeated one suffixed -1, -2, ..."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} (.+?)\s*$", re.sub(r"^```.*?^```", "", text, flags=re.S | re.M), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        repeats = seen.get(slug, 0)
        seen[slug] = repeats + 1
        anchors.add(f"{slug}-{repeats}" if repeats else slug)
    return anchors


def broken_links(page: Path) -> list[str]:
    """One line per relative link of `page` that leads nowhere: no such file, or no heading of that anchor."""
    problems = []
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: leave the checkout
            continue
        path, _, anchor = target.partition("#")
        destination = (page.parent / path).resolve() if path else page
        if not destination.exists():
            problems.append(f"{page.name}: ({target}): no such file")
        elif anchor and destination.suffix == ".md" and anchor not in heading_anchors(destination.read_text()):
            problems.append(f"{page.name}: ({target}): {destination.name} has no heading with that anchor")
    return problems


def doc_pages() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(REPO_ROOT / target.partition("#")[0]).resolve() for target in LINK.findall(prose(README.read_text()))}
    assert doc_pages(), "docs/ has no pages"
    unlinked = [page.name for page in doc_pages() if page.resolve() not in linked]
    assert not unlinked, f"docs/ pages the README does not link: {unlinked}"


def test_every_relative_link_of_the_readme_and_docs_resolves():
    problems = [problem for page in [README, *doc_pages()] for problem in broken_links(page)]
    assert not problems, "\n".join(problems)


def test_a_link_to_a_missing_file_or_heading_is_caught(tmp_path):
    (tmp_path / "b.md").write_text("# Moving bytes: a fleet's chain\n\n## Tests\n\n## Tests\n\n```sh\n# not a heading\n```\n")
    (tmp_path / "a.md").write_text(
        "[ok](b.md) [ok](b.md#moving-bytes-a-fleets-chain) [ok](b.md#tests-1) [ok](https://pyinfra.com) [ok](#top)\n"
        "[gone](c.md) [gone](b.md#not-a-heading) [gone](b.md#tests-2) [gone](#nowhere)\n"
        "```\n[code, not a link](d.md)\n```\n`[inline code](e.md)`\n\n# Top\n"
    )
    assert broken_links(tmp_path / "a.md") == [
        "a.md: (c.md): no such file",
        "a.md: (b.md#not-a-heading): b.md has no heading with that anchor",
        "a.md: (b.md#tests-2): b.md has no heading with that anchor",
        "a.md: (#nowhere): a.md has no heading with that anchor",
    ]
