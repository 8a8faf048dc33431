"""Docker operations: daemon.json merged (your keys kept) with the insecure registries and the nvidia runtime."""

from __future__ import annotations

import json
from collections.abc import Mapping
from io import StringIO
from typing import Any

from pyinfra import host
from pyinfra.api import FileUploadCommand, StringCommand, operation

from rigup.facts.docker import DockerDaemonJson, DockerEngineInfo

DAEMON_JSON = "/etc/docker/daemon.json"


def merged_daemon_config(current: Mapping[str, Any] | None, insecure_registries: list[str]) -> dict[str, Any] | None:
    """`current` with the wanted entries added (the user's keys and list entries kept); None when
    nothing is missing."""
    config = dict(current or {})
    have = list(config.get("insecure-registries") or [])
    missing = [r for r in insecure_registries if r not in have]
    if not missing:
        return None
    config["insecure-registries"] = have + missing
    return config


@operation()
def docker_daemon_config(insecure_registries: list[str] | None = None):
    """
    Add settings to /etc/docker/daemon.json without touching the keys already there (the user's,
    the nvidia runtime ``nvidia-ctk`` adds). Restarting Docker is the caller's handler.

    + insecure_registries: ``host:port`` registries Docker may use over plain HTTP (a LAN mirror)

    **Example:**

    .. code:: python

        docker.docker_daemon_config(name="Let Docker pull from the LAN mirror",
                                     insecure_registries=["10.0.0.5:5000"])
    """
    wanted = list(insecure_registries or [])
    merged = merged_daemon_config(host.get_fact(DockerDaemonJson), wanted)
    if merged is None:
        host.noop(f"{DAEMON_JSON} has every wanted setting")
        return
    text = json.dumps(merged, indent=4, sort_keys=True) + "\n"
    yield StringCommand("mkdir", "-p", "/etc/docker")
    yield FileUploadCommand(StringIO(text), DAEMON_JSON)
    yield StringCommand("chmod", "644", DAEMON_JSON)


@operation()
def docker_nvidia_runtime():
    """
    Register the ``nvidia`` runtime with Docker through ``nvidia-ctk runtime configure``, which
    merges it into /etc/docker/daemon.json and keeps every other key. Runs only when
    ``docker info`` does not list the runtime; restarting Docker is the caller's handler.

    **Example:**

    .. code:: python

        runtime = hostops.docker_nvidia_runtime(name="Register the nvidia runtime with Docker")
        systemd.service(name="Restart Docker after runtime change", service="docker.service",
                        restarted=True, _if=runtime.did_change)
    """
    info = host.get_fact(DockerEngineInfo)
    if info is not None and info.has_nvidia_runtime:
        host.noop("docker already lists the nvidia runtime")
        return
    yield StringCommand("nvidia-ctk", "runtime", "configure", "--runtime=docker")


def image_ref(registry: str, image: str) -> str:
    """Prefix `image` with `registry` unless it already names one (first part has "." or ":")."""
    first = image.split("/", 1)[0]
    if "/" in image and ("." in first or ":" in first or first == "localhost"):
        return image
    return f"{registry.rstrip('/')}/{image}"

