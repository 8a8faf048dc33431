#!/usr/bin/python3.11 -S
"""`python3`, `python`, `python3.12`, `pip` and `pip3` inside the test bed's vLLM images for the real engine.

vLLM's image runs its Python programs against torch and CUDA, which no rig here has; so, as in the stand-in
engine (container.py), a script or a `python3 -m vllm.X` module from a bind mount or the image is compiled,
not run, and `pip install` installs nothing and needs the network the test bed grants
(/etc/rigup-testbed/containers.json). `python3 -m vllm.entrypoints.openai.api_server ARGS` is `vllm serve
ARGS`. The container's real mounts (from /proc/self/mountinfo) and the image's own file list (image.json)
decide what a script may come from. The interpreter itself is /usr/bin/python3.11, which the stand-in
server runs on. Stdlib only.
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.realpath(__file__))
PSEUDO = {"proc", "sysfs", "tmpfs", "devpts", "mqueue", "cgroup", "cgroup2", "devtmpfs", "securityfs"}
REAL_PYTHON = "/usr/bin/python3.11"
SERVER_MODULES = ("vllm.entrypoints.openai.api_server", "vllm.entrypoints.cli.main")


def unescape(field: str) -> str:
    return field.encode().decode("unicode_escape") if "\\" in field else field


def mount_targets(mountinfo: str) -> list[str]:
    """Mount points of the container's bind mounts (not its root, not proc/sys/dev and the like)."""
    out = []
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        fields, fstype = left.split(), (right.split() or [""])[0]
        if len(fields) >= 5 and fields[4] != "/" and fstype not in PSEUDO:
            out.append(unescape(fields[4]))
    return out


def container_info() -> dict:
    sys.path.insert(0, HERE)
    import common

    image = common.read_json(os.path.join(HERE, "image.json"), {}) or {}
    network = common.read_json(common.path("/etc/rigup-testbed/containers.json"), {}) or {}
    with open("/proc/self/mountinfo") as f:
        mounts = [{"target": t} for t in mount_targets(f.read())]
    return {"mounts": mounts, "image_files": image.get("files", []), "vllm_site": image.get("vllm_site"),
            "network": bool(network.get("network"))}


def driver_tool(args: list[str]) -> bool:
    """The script is the driver's own nvidia-smi, which the toolkit's hook mounted (its launcher names
    python3): it runs for real, on the real interpreter."""
    script = next((a for a in args if not a.startswith("-")), None)
    smi = os.path.realpath("/usr/bin/nvidia-smi")
    return script is not None and os.path.exists(smi) and os.path.dirname(os.path.realpath(script)) == os.path.dirname(smi)


def main(argv0: str, args: list[str]) -> int:
    name = os.path.basename(argv0)
    if name.startswith("python") and driver_tool(args):
        os.execv(REAL_PYTHON, [REAL_PYTHON, *args])
    if name.startswith("python"):
        if args[:1] == ["-m"] and args[1:2] and args[1] in SERVER_MODULES:
            rest = args[2:]
            rest = rest[1:] if args[1].endswith("cli.main") and rest[:1] == ["serve"] else rest
            os.execv(os.path.join(HERE, "vllm_entry.py"), ["vllm", "serve", *rest])
        ctr = container_info()
        import container

        return container.python(argv0, args, ctr)
    if name in ("pip", "pip3"):
        import container

        return container.pip(args, container_info())
    sys.stderr.write(f"rigup stand-in: {name} in a container is not simulated\n")
    return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[0], sys.argv[1:]))
