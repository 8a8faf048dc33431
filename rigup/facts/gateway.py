"""Facts of the gateway task: whether a pinned venv is complete, and the venvs of earlier pins."""

from __future__ import annotations

from pyinfra.api import FactBase, QuoteString, StringCommand


class VenvComplete(FactBase[str | None]):
    """The requirements hash recorded in ``{venv}/.rigup-installed`` once its install finished; None if
    the venv is absent or unfinished."""

    def command(self, venv: str) -> StringCommand:
        marker = QuoteString(f"{venv.rstrip('/')}/.rigup-installed")
        return StringCommand("cat", marker, "2>/dev/null || true")

    def process(self, output: list[str]) -> str | None:
        text = "".join(output).strip()
        return text or None


class GatewayVenvs(FactBase[list[str]]):
    """The gateway venv directories (``{root}/venv-*``) on the host."""

    default = list

    def command(self, root: str) -> StringCommand:
        return StringCommand("for d in", StringCommand(QuoteString(root.rstrip("/")), "/venv-*", _separator=""),
                             '; do [ -d "$d" ] && echo "$d"; done; true')

    def process(self, output: list[str]) -> list[str]:
        return sorted(line.strip() for line in output if line.strip())
