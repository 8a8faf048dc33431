"""`python -m rigup <command>`: thin front ends over the library code the tasks use."""

from __future__ import annotations

import argparse
import importlib
import sys

# Each module exposes add_parser(subparsers); the parser it adds sets `func` (args -> exit code).
COMMAND_MODULES = (
    "rigup.cli.render",
    "rigup.cli.doctor",
    "rigup.cli.lock",
    "rigup.cli.sandbox",
    "rigup.cli.verify",
    "rigup.cli.bench",
    "rigup.cli.status",
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
