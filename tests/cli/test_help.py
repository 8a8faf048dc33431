"""Every command's --help lists its exit statuses, and `rigup --help` lists every command's: the table
(rigup.cli.EXIT_CODES) is held to the constants the commands return."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from rigup import REPO_ROOT
from rigup.cli import COMMAND_MODULES, EXIT_CODES, build_parser, command_of, commands, exit_codes_text
from rigup.cli import rollout as rollout_cli
from rigup.cli import status as status_cli
from rigup.cli import top as top_cli
from rigup.cli import verify as verify_cli


def command_parsers() -> dict[str, argparse.ArgumentParser]:
    return commands(build_parser())


def test_every_command_has_its_exit_codes():
    assert set(command_parsers()) == set(EXIT_CODES)


@pytest.mark.parametrize("command", sorted(EXIT_CODES))
def test_command_help_lists_each_exit_code(command):
    result = subprocess.run([sys.executable, "-m", "rigup", command, "--help"], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert exit_codes_text(command) in result.stdout
    for code, meaning, _ in EXIT_CODES[command]:
        assert f"  {code}  {meaning}" in result.stdout, (code, result.stdout)


def test_subcommands_of_a_command_list_them_too():
    sandbox = command_parsers()["sandbox"]
    action = next(a for a in sandbox._actions if isinstance(a, argparse._SubParsersAction))
    for name, child in action.choices.items():
        assert exit_codes_text("sandbox") in child.format_help(), name


def test_top_level_help_lists_every_code_of_every_command():
    # Was: `rigup --help` showed two of status's five codes, in status's one-line summary.
    text = build_parser().format_help()
    for command, rows in EXIT_CODES.items():
        line = next(line for line in text.splitlines() if line.startswith(f"  {command} "))
        for code, meaning, _ in rows:
            assert f"{code} {meaning}" in line, (command, code, line)


def test_one_line_summaries_leave_the_exit_codes_to_the_table():
    # Was: status's summary read "drift marked (exit 1 drift, 2 unhealthy)", a partial list beside the table.
    for command, parser in command_parsers().items():
        action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
        summary = next(c.help for c in action._choices_actions if c.dest == command)
        assert "exit" not in summary, (command, summary)


def test_table_matches_what_the_commands_return():
    def codes(command):
        return {code for code, _, _ in EXIT_CODES[command]}

    assert {str(status_cli.EXIT_DRIFT), str(status_cli.EXIT_UNHEALTHY), str(status_cli.EXIT_DRIFT | status_cli.EXIT_UNHEALTHY),
            str(status_cli.EXIT_BAD_FLEET)} <= codes("status")
    assert {str(top_cli.EXIT_UNANSWERED), str(top_cli.EXIT_BAD_FLEET), str(top_cli.EXIT_INTERRUPTED)} <= codes("top")
    assert {str(c) for c in (rollout_cli.EXIT_OK, rollout_cli.EXIT_SOME_FAILED, rollout_cli.EXIT_STOPPED,
                             rollout_cli.EXIT_ERROR)} == codes("rollout")
    assert f"at most {verify_cli.MAX_EXIT}" in exit_codes_text("verify")


@pytest.mark.parametrize("command", sorted(EXIT_CODES))
def test_a_command_parsed_alone_is_the_command_of_the_whole_line(command):
    alone = commands(build_parser(only=command))
    assert list(alone) == [command]
    assert alone[command].format_help() == command_parsers()[command].format_help()


def test_running_one_command_imports_no_other_commands_module():
    others = sorted(name for name in COMMAND_MODULES if command_of(name) != "lock")
    probe = ("import sys, rigup.cli\n"
             "try:\n    rigup.cli.main(['lock', '--help'])\nexcept SystemExit:\n    pass\n"
             f"print([m for m in {others!r} if m in sys.modules])")
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.splitlines()[-1] == "[]", result.stdout + result.stderr
    assert "exit status:" in result.stdout  # lock's own help, with its exit statuses


def test_a_command_not_on_the_list_is_refused_with_the_whole_list(capsys):
    from rigup.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["lcok"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "invalid choice: 'lcok'" in err and all(f"'{c}'" in err for c in EXIT_CODES), err
