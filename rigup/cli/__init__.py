"""rigup COMMAND (in a checkout: .venv/bin/rigup COMMAND): thin front ends over the library code the tasks use."""

from __future__ import annotations

import argparse
import difflib
import importlib
import sys

from rigup.desired.catalog import CatalogError, variant_names
from rigup.desired.fleet import PYINFRA_KEYS, SSH_KEYS, FleetError
from rigup.desired.knobs import KnobError, check_knob, load_defaults, parse_data_value
from rigup.desired.lock import LockError
from rigup.desired.recipe import RecipeError, check_overrides
from rigup.desired.secrets import SecretError

# Each module exposes add_parser(subparsers); the parser it adds sets `func` (args -> exit code). They are
# imported by name: `sandbox` is the test bed's own command (rigup_testbed sits above the product, which
# imports nothing from it).
COMMAND_MODULES = (
    "rigup.cli.render",
    "rigup.cli.doctor",
    "rigup.cli.lock",
    "rigup_testbed.sandbox",
    "rigup.cli.verify",
    "rigup.cli.bench",
    "rigup.cli.status",
    "rigup.cli.top",
    "rigup.cli.rollout",
    "rigup.cli.router",
)


# Each command's exit statuses as its code returns them, (code, what it means, more): shown by its --help
# and, without the more, by `rigup --help` (tests/cli/test_help.py holds them to the modules' constants
# and runs the cases it can). Every command also exits 2 for a command line argparse refuses.
BAD_INPUT = ("bad input", "a fleet file, --data, --limit or argument that cannot be used: one line on stderr says "
             "why, and nothing ran")
EXIT_CODES: dict[str, tuple[tuple[str, str, str], ...]] = {
    "render": (("0", "written", "--list, --audit: every variant renders, nothing unexplained"),
               ("1", "a variant cannot render or differs unexplained",
                "--list: a variant cannot render; --audit: a difference from upstream is unexplained"),
               ("2", *BAD_INPUT)),
    "doctor": (("0", "every host passed", ""), ("1", "a check failed or a host could not be reached", ""),
               ("2", BAD_INPUT[0], BAD_INPUT[1] + " (nothing connected)")),
    "lock": (("0", "written or unchanged", "--check: the lock covers every pin the fleet needs"),
             ("1", "--check: missing or stale", "the lock file or an entry is missing, or an entry is stale"),
             ("2", BAD_INPUT[0], BAD_INPUT[1] + "; or a pin cannot be resolved")),
    "sandbox": (("0", "done", "status: every rig is running"),
                ("1", "failed", "up failed (what it made is removed) or a sandbox is already up; down failed; "
                                "status: a rig is stopped"),
                ("2", "cannot run here", "not root, a tool the test bed needs is missing, or a bad argument")),
    "verify": (("0", "every check passed", ""), ("N", "that many checks failed", "at most 125"),
               ("2", "also: " + BAD_INPUT[0], BAD_INPUT[1])),
    "bench": (("0", "every run answered", ""), ("1", "a run failed", ""), ("2", *BAD_INPUT)),
    "status": (("0", "ok", "every host serves what the fleet file and lock say, and is healthy"), ("1", "drift", ""),
               ("2", "unhealthy", ""), ("3", "drift and unhealthy", ""),
               ("4", BAD_INPUT[0], "the fleet file or --limit could not be used: one line says why; no host was asked")),
    "top": (("0", "quit", "q or Ctrl-C; --once: every target answered"), ("1", "--once: a target did not answer", ""),
            ("2", *BAD_INPUT), ("130", "--once: Ctrl-C before its frame", "")),
    "rollout": (("0", "every host converged", ""), ("1", "a host is down or failed", "the rollout finished"),
                ("2", "stopped early", "more hosts failed than rollout_max_failures allows"),
                ("3", "could not start", "bad inventory or fleet file, or pyinfra crashed")),
    "router": (("0", "every rig healthy", "the config is written"),
               ("1", "a rig failed its check", "left out of the config; or no rig is healthy: nothing written"),
               ("2", *BAD_INPUT)),
}
EXIT_HEADING = "exit status:"


def exit_codes_text(command: str) -> str:
    """The `exit status:` block of a command's --help."""
    rows = EXIT_CODES[command]
    width = max(len(code) for code, _, _ in rows)
    return "\n".join([EXIT_HEADING] + [f"  {code:>{width}}  {meaning}" + (f" ({more})" if more else "")
                                       for code, meaning, more in rows])


def _exit_codes_summary() -> str:
    """`rigup --help`'s block: every command's exit statuses, one line each."""
    width = max(map(len, EXIT_CODES))
    lines = [f"{EXIT_HEADING} (COMMAND --help says more)"]
    for command, rows in EXIT_CODES.items():
        lines.append(f"  {command:<{width}}  " + "; ".join(f"{code} {meaning}" for code, meaning, _ in rows))
    return "\n".join(lines)


class _KeepsExitCodes(argparse.HelpFormatter):
    """Wraps descriptions as the parser's own formatter does, but prints the exit status block line by line."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if text.startswith(EXIT_HEADING):
            return "\n".join(indent + line for line in text.splitlines())
        return super()._fill_text(text, width, indent)


def _with_exit_codes(parser: argparse.ArgumentParser, text: str) -> None:
    """Give `parser` (and its own subcommands, as `sandbox up`) the exit status block as its epilog."""
    parser.epilog = text
    if not issubclass(parser.formatter_class, _KeepsExitCodes):
        parser.formatter_class = type("ExitCodesFormatter", (_KeepsExitCodes, parser.formatter_class), {})
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _with_exit_codes(child, text)


def command_of(module_name: str) -> str:
    """The command a module of COMMAND_MODULES adds (its last name: rigup.cli.lock adds `lock`)."""
    return module_name.rpartition(".")[2]


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; with `only` (a command's name), the parser of that command alone: a run of one
    command imports its own module, not every command's (`rigup lock` 0.37 s of CPU instead of 0.65 s)."""
    parser = argparse.ArgumentParser(prog="rigup", description=__doc__, epilog=_exit_codes_summary(),
                                     formatter_class=_KeepsExitCodes)
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module_name in COMMAND_MODULES:
        if only is not None and command_of(module_name) != only:
            continue
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:  # command not shipped in this tree
                continue
            raise
        module.add_parser(subparsers)
    for command, child in subparsers.choices.items():
        _with_exit_codes(child, exit_codes_text(command))
    return parser


def commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The commands `parser` (build_parser's) has, by name."""
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


# Commands whose --data KEY=VALUE sets knobs (checked here like a fleet file's values, before the command runs).
KNOB_DATA_COMMANDS = ("render", "doctor")


def input_errors() -> tuple[type[Exception], ...]:
    """What a bad input raises (fleet file, knob value, variant or its overrides, lock or secret file):
    the message already names the file, the host, the key, the value and what is allowed."""
    return (FleetError, KnobError, RecipeError, CatalogError, LockError, SecretError)


def check_data_args(pairs: list[str], variant: str | None = None) -> None:
    """Check `--data KEY=VALUE` knob overrides the way the fleet file's values are checked (KnobError);
    variant_overrides too when the command names the variant (render)."""
    knobs = load_defaults()
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key:
            raise KnobError(f"--data expects KEY=VALUE, got {pair!r}")
        if key in SSH_KEYS or key in PYINFRA_KEYS:
            continue  # connection settings: the command decides whether it takes them
        if key not in knobs:
            close = difflib.get_close_matches(key, knobs, n=3, cutoff=0.75)
            hint = f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""
            raise KnobError(f"--data {pair}: unknown knob {key!r}{hint}; the knobs are declared in group_data/all.py")
        value = parse_data_value(text)
        try:
            check_knob(key, value)
            if key == "variant_overrides" and value and variant in variant_names():
                check_overrides(variant, value)
        except KnobError as exc:
            raise KnobError(f"--data {pair}: {exc}") from None
        except RecipeError as exc:
            named = f"variant {variant!r}" in str(exc)
            raise KnobError(f"--data {pair}: {'' if named else f'variant {variant!r}: '}{exc}") from None


def main(argv: list[str] | None = None) -> int:
    """Run one command. A bad input is one line on stderr, `rigup <command>: <message>`, and exit 2."""
    words = sys.argv[1:] if argv is None else argv
    # the command named first gets its parser alone; anything else (--help, a typo) the whole command line's
    named = words[0] if words and words[0] in EXIT_CODES else None
    parser = build_parser(only=named)
    if named is not None and named not in commands(parser):  # not shipped in this tree: the whole list says so
        parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command in KNOB_DATA_COMMANDS:
            check_data_args(getattr(args, "data", None) or [], getattr(args, "variant", None))
        return int(args.func(args) or 0)
    except input_errors() as exc:
        print(f"rigup {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
