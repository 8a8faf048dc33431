"""Commands whose output pyinfra shows as it arrives, at every verbosity: the long work of a converge
(model downloads, image pulls, the health gate) then prints its progress lines per host while it
runs, instead of one silent line for 10-30 minutes. What they did goes to the converge's account
(rigup.runstate.account), summed up per host when the run ends."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from pyinfra.api import StringCommand

# (host, ok, output, seconds) -> None, called once the command ended
Done = Callable[[Any, bool, Any, float], None]


class StreamedCommand(StringCommand):
    """A StringCommand printed line by line as it runs (pyinfra's print_output), whatever -v says."""

    on_done: Done | None = None

    def execute(self, state: Any, host: Any, connector_arguments: Any) -> Any:
        connector_arguments.update(self.connector_arguments)
        started = time.monotonic()
        ok, output = host.run_shell_command(
            self, print_output=True, print_input=state.print_input, **connector_arguments
        )
        if self.on_done is not None:
            self.on_done(host, ok, output, time.monotonic() - started)
        return ok, output


def streamed(command: StringCommand, on_done: Done | None = None) -> StreamedCommand:
    """`command`, with the same bits and connector arguments (stdin, sudo, ...), streamed."""
    out = StreamedCommand(*command.bits, _separator=command.separator, **command.connector_arguments)
    out.on_done = on_done
    return out
