"""`python -m rigup <command>`: thin front ends over the library code the tasks use."""

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

# Each module exposes add_parser(subparsers); the parser it adds sets `func` (args -> exit code).
COMMAND_MODULES = (
    "rigup.cli.render",
    "rigup.cli.doctor",
    "rigup.cli.lock",
    "rigup.cli.sandbox",
    "rigup.cli.verify",
    "rigup.cli.bench",
    "rigup.cli.status",
    "rigup.cli.top",
    "rigup.cli.rollout",
    "rigup.cli.router",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rigup", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module_name in COMMAND_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:  # command not shipped in this tree
                continue
            raise
        module.add_parser(subparsers)
    return parser


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
    args = build_parser().parse_args(argv)
    try:
        if args.command in KNOB_DATA_COMMANDS:
            check_data_args(getattr(args, "data", None) or [], getattr(args, "variant", None))
        return int(args.func(args) or 0)
    except input_errors() as exc:
        print(f"rigup {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
