#!/usr/bin/python3.11
"""`vllm` inside the test bed's images for the real engine (rigup_testbed/registry.py builds them).

`vllm serve ARGS` (the image's entrypoint, or a compose command) becomes responder.py serving the OpenAI
API on the --host/--port it names, inside the container, with this container's own command line: the
model directory, chat template and deploy config are read at their container paths (the mounts are
real), the GPUs are the ones the container toolkit's hook handed it (the simulated hardware it mounts at
/etc/rigup-testbed lists only those). The process stays the container's PID 1 when
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
        # the toolkit's hook mounted a hardware file listing only the GPUs this container was given
        "gpus": [g["uuid"] for g in common.hardware().get("gpus", [])]
        if os.environ.get("NVIDIA_VISIBLE_DEVICES", "void") not in ("", "void", "none") else [],
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
