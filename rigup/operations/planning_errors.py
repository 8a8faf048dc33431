"""Task files build their plans while pyinfra loads them; a plan that cannot be built stops the run here."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from pyinfra.api.exceptions import DeployError


@contextmanager
def stop_the_run_on(host: Any, *errors: type[Exception]) -> Iterator[None]:
    """Turn one of `errors` raised inside into pyinfra's DeployError naming the host: pyinfra ends the
    whole run with that one line, no traceback, before any operation of the task runs."""
    try:
        yield
    except errors as exc:
        raise DeployError(f"{host.name}: {exc}") from None
