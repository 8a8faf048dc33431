"""Run the pyinfra CLI in this (separate) process and dump what the @fake hosts executed as JSON.

Importing pyinfra_cli monkey-patches the whole interpreter with gevent, so tests run it here, in a
subprocess, never inside the pytest process.

    python -m tests.support.fake_cli_runner OUT.json [pyinfra arguments...]
"""

from __future__ import annotations

import json
import sys

from click.testing import CliRunner


def main(argv: list[str]) -> int:
    out_path, args = argv[0], argv[1:]
    import pyinfra
    from pyinfra.context import ctx_state
    from pyinfra_cli.cli import cli

    pyinfra.is_cli = True
    sys.path.append(".")
    result = CliRunner().invoke(cli, args, standalone_mode=False, catch_exceptions=True)
    state = ctx_state.get() if ctx_state.isset() else None
    data = {
        "exit_code": result.exit_code,
        "exception": repr(result.exception) if result.exception and not isinstance(result.exception, SystemExit) else None,
        "output": result.output,
        "failed_hosts": sorted(h.name for h in state.failed_hosts) if state else [],
        "commands": {h.name: [str(c) for c in h.connector.executed_commands] for h in state.inventory} if state else {},
        "op_parallel": {
            name: meta.global_arguments.get("_parallel")
            for meta in (state.op_meta.values() if state else [])
            for name in meta.names
        },
    }
    with open(out_path, "w") as f:
        json.dump(data, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
