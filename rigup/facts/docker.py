"""Facts about Docker: the engine (docker info), daemon.json, a snap-installed Docker, and images."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pyinfra.api import FactBase, FactProcessError, QuoteString, StringCommand

from rigup.facts.util import parse_fact_output, run_if_installed, tool_absent
from rigup.parsers.docker import DockerInfo, parse_daemon_json, parse_docker_info


class DockerEngineInfo(FactBase[DockerInfo | None]):
    """
    ``docker info`` as JSON: server version, runtimes (is ``nvidia`` there?), root dir, cgroup
    driver. None when the docker CLI is not installed; server_version None when the daemon is down.
    """

    command = run_if_installed("docker", "docker info --format '{{json .}}' 2>&1 || true")

    def process(self, output: list[str]) -> DockerInfo | None:
        if tool_absent(output):
            return None
        return parse_fact_output(output, parse_docker_info)


class DockerDaemonJson(FactBase[dict[str, Any] | None]):
    """/etc/docker/daemon.json as a dict; None when absent or empty (invalid JSON fails the host)."""

    command = "cat /etc/docker/daemon.json 2>/dev/null || true"

    def process(self, output: list[str]) -> dict[str, Any] | None:
        return parse_fact_output(output, parse_daemon_json)


class DockerSnap(FactBase[bool]):
    """True when Docker is installed as a snap (rigup refuses it: the toolkit cannot configure it)."""

    default = bool
    command = (
        "if command -v snap >/dev/null 2>&1 && snap list docker >/dev/null 2>&1; then echo snap; "
        "elif [ -e /snap/bin/docker ]; then echo snap; else echo none; fi"
    )

    def process(self, output: list[str]) -> bool:
        return any(line.strip() == "snap" for line in output)


@dataclass(frozen=True)
class LocalImage:
    id: str  # sha256:...
    size: int  # bytes

    def to_json(self) -> dict[str, Any]:  # what `pyinfra ... fact rigup.facts.docker.DockerImage` prints
        return {"id": self.id, "size": self.size}


class DockerImage(FactBase[LocalImage | None]):
    """
    A local image as ``docker image inspect`` reports it: its id and size in bytes; None when it is not
    pulled. One fact for both (preflight wants the size, the pull the id): one docker call per run.

    .. code:: python

        LocalImage(id="sha256:4f1c...", size=30000000000)

    + ref: image reference as compose uses it
    """

    def requires_command(self, *args: Any, **kwargs: Any) -> str:
        return "docker"

    def command(self, ref: str) -> StringCommand:
        # stderr is dropped: an image that is not pulled prints nothing
        return StringCommand("docker image inspect --format '{{.Id}} {{.Size}}'", QuoteString(ref), "2>/dev/null || true")

    def process(self, output: list[str]) -> LocalImage | None:
        lines = [line.strip() for line in output if line.strip()]
        if not lines:
            return None
        image_id, _, size = lines[0].partition(" ")
        if not image_id.startswith("sha256:") or not size.isdigit():
            raise FactProcessError(f"docker image inspect printed {lines[0]!r}, not an id and a size in bytes")
        return LocalImage(image_id, int(size))


class ImageMirrorCache(FactBase[dict[str, Any] | None]):
    """
    What the image mirror's helper (rigup/rig/imagemirror.py) says about its cache: the pins it lacks,
    the bytes it holds and its bound. None before the helper and its keep file are on the host.

    .. code:: python

        {"missing": ["vllm/vllm-openai@sha256:..."], "bytes": 1234, "max_bytes": 200000000000}
    """

    def command(self, script: str, keep_file: str) -> StringCommand:
        script_q, keep_q = QuoteString(script), QuoteString(keep_file)
        return StringCommand("if [ -f", script_q, "] && [ -f", keep_q, "]; then python3", script_q, "check", keep_q,
                             "; else echo absent; fi")

    def process(self, output: list[str]) -> dict[str, Any] | None:
        text = "\n".join(output).strip()
        if text == "absent":
            return None
        try:
            value = json.loads(text)
        except ValueError as exc:
            raise FactProcessError(f"the image mirror's check printed no JSON: {text[-300:]!r}") from exc
        return value
