"""Facts about Docker: the engine (docker info), daemon.json, a snap-installed Docker, and images."""

from __future__ import annotations

import shlex
from typing import Any

from pyinfra.api import FactBase, FactProcessError, QuoteString, StringCommand

from rigup.facts.util import _absent, _guarded, _parse
from rigup.parsers.docker import DockerInfo, parse_daemon_json, parse_docker_info


class DockerImageSize(FactBase[int | None]):
    """
    Size in bytes of a local Docker image (``docker image inspect``); None when it is not pulled.

    + image: image reference as compose uses it
    """

    def command(self, image: str) -> str:
        ref = shlex.quote(image)
        return _guarded("docker", f"docker image inspect --format '{{{{.Size}}}}' {ref} 2>/dev/null || true")

    def process(self, output: list[str]) -> int | None:
        if _absent(output):
            return None
        text = output[0].strip() if output else ""  # stderr is dropped: not pulled prints nothing
        if not text:
            return None
        if not text.isdigit():
            raise FactProcessError(f"docker image inspect printed {text!r}, not a size in bytes")
        return int(text)


class DockerEngineInfo(FactBase[DockerInfo | None]):
    """
    ``docker info`` as JSON: server version, runtimes (is ``nvidia`` there?), root dir, cgroup
    driver. None when the docker CLI is not installed; server_version None when the daemon is down.
    """

    command = _guarded("docker", "docker info --format '{{json .}}' 2>&1 || true")

    def process(self, output: list[str]) -> DockerInfo | None:
        if _absent(output):
            return None
        return _parse(output, parse_docker_info)


class DockerDaemonJson(FactBase[dict[str, Any] | None]):
    """/etc/docker/daemon.json as a dict; None when absent or empty (invalid JSON fails the host)."""

    command = "cat /etc/docker/daemon.json 2>/dev/null || true"

    def process(self, output: list[str]) -> dict[str, Any] | None:
        return _parse(output, parse_daemon_json)


class DockerSnap(FactBase[bool]):
    """True when Docker is installed as a snap (rigup refuses it: the toolkit cannot configure it)."""

    default = bool
    command = (
        "if command -v snap >/dev/null 2>&1 && snap list docker >/dev/null 2>&1; then echo snap; "
        "elif [ -e /snap/bin/docker ]; then echo snap; else echo none; fi"
    )

    def process(self, output: list[str]) -> bool:
        return any(line.strip() == "snap" for line in output)


class DockerImageId(FactBase[str | None]):
    """Local id of an image reference (``sha256:...``), or None when it is not pulled."""

    def requires_command(self, *args: Any, **kwargs: Any) -> str:
        return "docker"

    def command(self, ref: str) -> StringCommand:
        return StringCommand("docker image inspect --format '{{.Id}}'", QuoteString(ref), "2>/dev/null || true")

    def process(self, output: list[str]) -> str | None:
        lines = [line.strip() for line in output if line.strip()]
        return lines[0] if lines else None

