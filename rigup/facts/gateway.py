"""Facts of the entrance task: whether a pinned venv is complete, the venvs of earlier pins, the routers."""

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


class RouterEnvFiles(FactBase[list[str]]):
    """The routers' environment files (``{directory}/*.env``) on the host: one per served model."""

    default = list

    def command(self, directory: str) -> StringCommand:
        return StringCommand("for f in", StringCommand(QuoteString(directory.rstrip("/")), "/*.env", _separator=""),
                             '; do [ -f "$f" ] && echo "$f"; done; true')

    def process(self, output: list[str]) -> list[str]:
        return sorted(line.strip() for line in output if line.strip())


class RouterInstances(FactBase[list[str]]):
    """The rigup-router@<slug>.service instances systemd knows (loaded or enabled), by name."""

    default = list

    def command(self) -> str:
        return ("{ systemctl list-units --all --plain --no-legend 'rigup-router@*.service';"
                " ls /etc/systemd/system/multi-user.target.wants/ 2>/dev/null; } | grep -o 'rigup-router@[^ ]*\\.service' | sort -u; true")

    def process(self, output: list[str]) -> list[str]:
        return sorted({line.strip() for line in output if line.strip()})
