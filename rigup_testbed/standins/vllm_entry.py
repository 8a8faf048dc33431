#!/usr/bin/python3.11
"""`vllm` inside the test bed's images for the real engine (rigup_testbed/registry.py builds them).

`vllm serve ARGS` (the image's entrypoint, or a compose command) becomes responder.py serving the OpenAI
API on the --host/--port it names, inside the container, with this container's own command line: the
model directory, chat template and deploy config are read at their container paths (the mounts are
real), the GPUs are the ones the container toolkit's hook handed it (NVIDIA_VISIBLE_DEVICES, with the
simulated hardware the hook mounts at /etc/rigup-testbed). The process stays the container's PID 1 when
the entrypoint execs it, so `docker kill` and `docker stop` reach the server itself. Other `vllm`
subcommands fail loudly as not simulated. Stdlib only.
"""

from __future__ import annotations

import json
import os
import socket
import sys

HERE = os.path.dirname(os.path.realpath(__file__))  # the command is a link to this file
RUN = "/run/rigup-standin"


def visible_gpus(hardware: dict, visible: str | None) -> list[str]:
    """UUIDs of the GPUs NVIDIA_VISIBLE_DEVICES names (indexes or UUIDs; "all"), in the order given."""
    gpus = hardware.get("gpus", [])
    if not visible or visible in ("void", "none"):
        return []
    if visible == "all":
        return [g["uuid"] for g in gpus]
    out = []
    for wanted in (v.strip() for v in visible.split(",")):
        out += [g["uuid"] for g in gpus if str(g["index"]) == wanted or g["uuid"] == wanted]
    return out


def main(argv: list[str]) -> int:
    sys.path.insert(0, HERE)
    import common
    import container

    if argv[:1] != ["serve"]:
        sys.stderr.write(f"rigup stand-in: vllm {' '.join(argv[:1])} in a container is not simulated\n")
        return 127
    image = common.read_json(os.path.join(HERE, "image.json"), {}) or {}
    tokens = ["vllm", *argv]
    os.makedirs(RUN, exist_ok=True)
    spec = {
        "id": socket.gethostname(),
        "name": socket.gethostname(),
        "kind": "vllm",
        "image": image.get("kind", "vllm"),
        "args": container.vllm_args(tokens),
        "argv": tokens,
        "gpus": visible_gpus(common.hardware(), os.environ.get("NVIDIA_VISIBLE_DEVICES")),
        # The server binds --host/--port itself, as vLLM does; the engine publishes the port.
        "network_mode": "host",
        "listen": [],
        "binds": [{"Destination": "/", "Source": "/"}],  # paths are the container's own
        "status_file": f"{RUN}/status.json",
        "ctr_socket": f"{RUN}/ctr.sock",
    }
    with open(f"{RUN}/spec.json", "w") as f:
        json.dump(spec, f)
    import responder

    return responder.main([f"{RUN}/spec.json"])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
