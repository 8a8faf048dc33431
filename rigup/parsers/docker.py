"""Parsers for docker info and /etc/docker/daemon.json."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from rigup.parsers.common import JsonDataclass, ParseError, split_lines


@dataclass(frozen=True)
class DockerInfo(JsonDataclass):
    server_version: str | None  # None when the daemon did not answer
    runtimes: tuple[str, ...]
    default_runtime: str | None
    root_dir: str | None
    cgroup_driver: str | None
    errors: tuple[str, ...] = ()

    @property
    def running(self) -> bool:
        return self.server_version is not None

    @property
    def has_nvidia_runtime(self) -> bool:
        return "nvidia" in self.runtimes


def parse_docker_info(output: str | Iterable[str]) -> DockerInfo:
    """Parse `docker info --format '{{json .}}'`; a stopped daemon gives server_version None."""
    lines = split_lines(output)
    json_line = next((line for line in lines if line.strip().startswith("{")), None)
    if json_line is None:
        text = " ".join(line.strip() for line in lines if line.strip())
        return DockerInfo(None, (), None, None, None, errors=(text,) if text else ())
    try:
        data = json.loads(json_line)
    except ValueError as exc:
        raise ParseError(f"docker info did not print JSON: {json_line[:200]!r}") from exc
    if not isinstance(data, Mapping):
        raise ParseError("docker info JSON is not an object")
    other = [line.strip() for line in lines if line.strip() and line is not json_line]
    errors = tuple([*(str(e) for e in data.get("ServerErrors") or ()), *other])
    runtimes = data.get("Runtimes") or {}
    return DockerInfo(
        server_version=data.get("ServerVersion") or None,
        runtimes=tuple(sorted(runtimes)) if isinstance(runtimes, Mapping) else (),
        default_runtime=data.get("DefaultRuntime") or None,
        root_dir=data.get("DockerRootDir") or None,
        cgroup_driver=data.get("CgroupDriver") or None,
        errors=errors,
    )


def parse_daemon_json(output: str | Iterable[str]) -> dict[str, Any] | None:
    """Parse /etc/docker/daemon.json; None when the file is empty or absent."""
    text = "\n".join(split_lines(output)).strip()
    if not text:
        return None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ParseError(f"/etc/docker/daemon.json is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ParseError("/etc/docker/daemon.json is not a JSON object")
    return data

