#!/usr/bin/python3
"""Stand-in for the NVIDIA Container Toolkit CLIs, dispatched on the name it is called by:

  nvidia-ctk                       --version; runtime configure --runtime=docker (edits daemon.json like
                                   the real one: merge, keep the user's keys, 4-space indent, sorted keys);
                                   system create-dev-char-symlinks; cdi generate / cdi list
  nvidia-container-runtime         --version; as Docker's `nvidia` OCI runtime: a `create` whose process asks
                                   for GPUs (NVIDIA_VISIBLE_DEVICES) gets the prestart hook below in its
                                   bundle's config.json, then every call is runc's
  nvidia-container-runtime-hook    --version; `prestart`, as the real engine runs it for a container with a
                                   GPU device request (dockerd adds it and NVIDIA_VISIBLE_DEVICES): checks the
                                   driver is loaded and each requested GPU exists, drops the registrations of
                                   GPU processes that died (their memory is free again), and mounts the
                                   driver's side into the container's root in the container's own mount
                                   namespace, as nvidia-container-cli does: nvidia-smi (this stand-in's, so
                                   the image must have python3), /proc/driver, /etc/rigup-testbed (the
                                   simulated hardware, listing only the container's GPUs) read-only and
                                   /run/nvidia-standin (GPU processes)
  nvidia-cdi-hook                  --version
  nvidia-container-cli             --version; info (driver and GPUs, or the real "driver not loaded")

Version and commit come from version.json next to the script (written by the package build).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import common

LOG = "/var/log/nvidia-standin/calls.log"
DOCKER_CONFIG = "/etc/docker/daemon.json"


def info(msg: str) -> None:
    sys.stderr.write(f"INFO[0000] {msg}\n")


def error(msg: str) -> int:
    sys.stderr.write(f"ERRO[0000] {msg}\n")
    return 1


def meta() -> dict[str, str]:
    data = common.read_json(Path(__file__).resolve().parent / "version.json", {})
    return {"version": str(data.get("version", "0.0.0")), "commit": str(data.get("commit", "0" * 40))}


def parse_flags(args: list[str], known: dict[str, bool]) -> tuple[dict[str, Any], list[str]]:
    """urfave/cli style flags: --name=value, --name value, -name; `known` maps name -> takes a value."""
    opts: dict[str, Any] = {}
    rest: list[str] = []
    i = 0
    while i < len(args):
        a = args[i]
        if a.startswith("-") and a != "-":
            name, eq, value = a.lstrip("-").partition("=")
            if name not in known:
                raise ValueError(f"flag provided but not defined: -{name}")
            if known[name]:
                if not eq:
                    i += 1
                    if i >= len(args):
                        raise ValueError(f"flag needs an argument: -{name}")
                    value = args[i]
                opts[name] = value
            else:
                opts[name] = value.lower() not in ("false", "0") if eq else True
        else:
            rest.append(a)
        i += 1
    return opts, rest


def runtime_configure(args: list[str]) -> int:
    try:
        opts, rest = parse_flags(args, {"runtime": True, "config": True, "set-as-default": False,
                                        "nvidia-set-as-default": False, "dry-run": False, "cdi.enabled": False,
                                        "runtime-name": True, "nvidia-runtime-name": True, "config-mode": True})
    except ValueError as exc:
        return error(str(exc))
    if rest:
        return error(f"unexpected arguments: {' '.join(rest)}")
    runtime = opts.get("runtime", "docker")
    if runtime != "docker":
        return error(f"unable to load config for runtime {runtime}: the rigup stand-in only simulates docker")
    path = Path(opts["config"]) if "config" in opts else common.path(DOCKER_CONFIG)
    name = opts.get("nvidia-runtime-name") or opts.get("runtime-name") or "nvidia"
    config: dict[str, Any] = {}
    if path.exists():
        info(f"Loading config from {path}")
        text = path.read_text()
        if text.strip():
            try:
                config = json.loads(text)
            except ValueError as exc:
                return error(f"unable to load config: unable to load config from {path}: {exc}")
            if not isinstance(config, dict):
                return error(f"unable to load config: {path} does not hold a JSON object")
    else:
        info("Config file does not exist; using empty config")
    runtimes = config.get("runtimes") or {}
    runtimes[name] = {"args": [], "path": "nvidia-container-runtime"}
    config["runtimes"] = runtimes
    if opts.get("set-as-default") or opts.get("nvidia-set-as-default"):
        config["default-runtime"] = name
    if opts.get("cdi.enabled"):
        config.setdefault("features", {})["cdi"] = True
    output = json.dumps(config, indent=4, sort_keys=True)
    if opts.get("dry-run"):
        sys.stdout.write(output + "\n")
        return 0
    try:
        path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        with open(path, "w") as fh:  # keeps the mode and owner of an existing file, like os.WriteFile
            fh.write(output)
    except OSError as exc:
        return error(f"unable to flush config: unable to open {path} for writing: {exc}")
    info(f"Wrote updated config to {path}")
    info("It is recommended that docker daemon be restarted.")
    return 0


def create_dev_char_symlinks(args: list[str]) -> int:
    try:
        opts, _ = parse_flags(args, {"create-all": False, "dev-char-path": True, "driver-root": True,
                                     "load-kernel-modules": False, "create-device-nodes": False,
                                     "watch": False, "dry-run": False})
    except ValueError as exc:
        return error(str(exc))
    if common.loaded_driver_version() is None:
        if opts.get("create-all") or opts.get("load-kernel-modules"):
            return error("failed to load NVIDIA kernel modules: failed to load module nvidia: exit status 1; "
                         "output=modprobe: FATAL: Module nvidia not found")
        return error("failed to create symlinks: no NVIDIA device nodes found")
    char_dir = Path(opts["dev-char-path"]) if "dev-char-path" in opts else common.path("/dev/char")
    links = {"195:255": "nvidiactl"}
    for minor, _gpu in enumerate(common.hardware().get("gpus", [])):
        links[f"195:{minor}"] = f"nvidia{minor}"
    for key, dev in sorted(links.items()):
        link = char_dir / key
        target = f"../{dev}"
        if link.is_symlink() and os.readlink(link) == target:
            continue
        info(f"Creating link {link} => /dev/{dev}")
        if not opts.get("dry-run"):
            char_dir.mkdir(parents=True, exist_ok=True)
            if link.is_symlink() or link.exists():
                link.unlink()
            link.symlink_to(target)
    return 0


def cdi_spec(gpus: list[dict[str, Any]]) -> str:
    lines = ["---", "cdiVersion: 0.5.0", "kind: nvidia.com/gpu", "devices:"]
    names: list[tuple[str, list[int]]] = [(str(i), [i]) for i in range(len(gpus))]
    names += [(g["uuid"], [i]) for i, g in enumerate(gpus)]
    names.append(("all", list(range(len(gpus)))))
    for name, minors in names:
        lines += [f"- name: {name}", "  containerEdits:", "    deviceNodes:"]
        lines += [f"    - path: /dev/nvidia{m}" for m in minors]
    lines += ["containerEdits:", "  deviceNodes:", "  - path: /dev/nvidiactl"]
    return "\n".join(lines) + "\n"


def cdi(args: list[str]) -> int:
    if args[:1] == ["generate"]:
        try:
            opts, _ = parse_flags(args[1:], {"output": True, "format": True, "device-name-strategy": True})
        except ValueError as exc:
            return error(str(exc))
        if common.loaded_driver_version() is None:
            return error("failed to generate CDI spec: failed to create device CDI specs: failed to initialize "
                         "NVML: ERROR_DRIVER_NOT_LOADED")
        spec = cdi_spec(common.hardware().get("gpus", []))
        if "output" in opts:
            out = Path(opts["output"])
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(spec)
            info("Generated CDI spec with version 0.5.0")
        else:
            sys.stdout.write(spec)
        return 0
    if args[:1] == ["list"]:
        found = []
        for d in ("/etc/cdi", "/var/run/cdi"):
            for f in sorted(common.path(d).glob("*.yaml")) if common.path(d).is_dir() else []:
                found += [f"nvidia.com/gpu={line.split(':', 1)[1].strip()}"
                          for line in f.read_text().splitlines() if line.startswith("- name:")]
        info(f"Found {len(found)} CDI devices")
        for name in found:
            print(name)
        return 0
    return error("cdi: only 'generate' and 'list' are simulated")


def nvidia_ctk(argv: list[str]) -> int:
    m = meta()
    if argv in (["--version"], ["-v"], ["version"]):
        print(f"NVIDIA Container Toolkit CLI version {m['version']}\ncommit: {m['commit']}")
        return 0
    if argv[:2] == ["runtime", "configure"]:
        return runtime_configure(argv[2:])
    if argv[:2] == ["system", "create-dev-char-symlinks"]:
        return create_dev_char_symlinks(argv[2:])
    if argv[:1] == ["cdi"]:
        return cdi(argv[1:])
    sys.stderr.write(f"nvidia-ctk stand-in: '{' '.join(argv)}' is not simulated\n")
    return 1


def container_cli(argv: list[str]) -> int:
    m = meta()
    if argv in (["--version"], ["-V"]):
        print(f"cli-version: {m['version']}\nlib-version: {m['version']}\nbuild date: 2025-10-01T00:00+00:00\n"
              f"build revision: {m['commit']}\nbuild compiler: x86_64-linux-gnu-gcc-7 7.5.0\n"
              "build platform: x86_64\nbuild flags: -D_GNU_SOURCE -D_FORTIFY_SOURCE=2 -DNDEBUG -std=gnu11 -O2 -g")
        return 0
    if argv[-1:] == ["info"]:
        driver = common.loaded_driver_version()
        if driver is None:
            sys.stderr.write("nvidia-container-cli: initialization error: nvml error: driver not loaded\n")
            return 1
        print(f"NVRM version:   {driver}\nCUDA version:   {common.driver_cuda(driver)}\n")
        for minor, g in enumerate(common.hardware().get("gpus", [])):
            brand = "GeForce" if "GeForce" in g["name"] else "NVIDIA"
            print(f"Device Index:   {minor}\nDevice Minor:   {minor}\nModel:          {g['name']}\n"
                  f"Brand:          {brand}\nGPU UUID:       {g['uuid']}\nBus Location:   {g['pci_bus_id']}\n"
                  f"Architecture:   {g['compute_cap']}\n")
        return 0
    sys.stderr.write(f"nvidia-container-cli stand-in: '{' '.join(argv)}' is not simulated\n")
    return 1


def other(tool: str, argv: list[str]) -> int:
    m = meta()
    titles = {"nvidia-container-runtime": "NVIDIA Container Runtime", "nvidia-container-runtime-hook":
              "NVIDIA Container Runtime Hook", "nvidia-cdi-hook": "NVIDIA CDI Hook"}
    if argv in (["--version"], ["-v"], ["version"]):
        print(f"{titles.get(tool, tool)} version {m['version']}\ncommit: {m['commit']}")
        if tool == "nvidia-container-runtime":
            print("spec: 1.2.1\n\nrunc version 1.3.0\ncommit: v1.3.0-0-g4ca628d1\nspec: 1.2.1\ngo: go1.23.8\n"
                  "libseccomp: 2.5.4")
        return 0
    sys.stderr.write(f"{tool} stand-in: {' '.join(argv) or '(no arguments)'} is not simulated\n")
    return 1


HOOK = "/usr/bin/nvidia-container-runtime-hook"
NVIDIA_SMI = "/usr/bin/nvidia-smi"
PROCS_DIR = "/run/nvidia-standin/procs"


def _visible(env_list: list[str]) -> str | None:
    env = dict(e.split("=", 1) for e in env_list if "=" in e)
    return env.get("NVIDIA_VISIBLE_DEVICES")


def hook(argv: list[str]) -> int:
    """`nvidia-container-runtime-hook prestart`: OCI state on stdin, the bundle's config.json beside it."""
    if argv != ["prestart"]:
        return other("nvidia-container-runtime-hook", argv)
    import subprocess

    state = json.loads(sys.stdin.read() or "{}")
    bundle = str(state.get("bundle") or ".")
    config = json.loads(Path(bundle, "config.json").read_text())
    visible = _visible(config.get("process", {}).get("env", []))
    if not visible or visible in ("void", "none"):
        return 0
    if common.loaded_driver_version() is None:
        sys.stderr.write("nvidia-container-cli: initialization error: nvml error: driver not loaded\n")
        return 1
    hardware = common.hardware()
    gpus = hardware.get("gpus", [])
    unknown = [name.strip() for name in visible.split(",") if name.strip() != "all" and not common.gpus_named(gpus, name)]
    if unknown:
        sys.stderr.write(f"nvidia-container-cli: device error: {unknown[0]}: unknown device\n")
        return 1
    procs = common.spath(PROCS_DIR)
    for name in os.listdir(procs) if os.path.isdir(procs) else []:
        entry = common.read_json(os.path.join(procs, name), {})
        if isinstance(entry, dict) and not common.registration_alive(entry):
            try:
                os.unlink(os.path.join(procs, name))
            except OSError:
                pass
    root = str(config.get("root", {}).get("path") or "rootfs")
    root = root if root.startswith("/") else os.path.join(bundle, root)
    smi = os.path.realpath(NVIDIA_SMI)
    os.makedirs(procs, exist_ok=True)
    # The GPUs the container was given are the only ones it has, whoever asks (a `docker exec` has no
    # NVIDIA_VISIBLE_DEVICES): as the real hook creates only their device nodes, the simulated hardware
    # the container sees lists only them, with their host indexes and UUIDs.
    mine = {**hardware, "gpus": common.gpus_named(gpus, visible)}
    container_hw = os.path.join(bundle, "rigup-standin-hardware.json")
    common.write_json_atomic(container_hw, mine)
    binds = [(os.path.dirname(smi), "ro"), ("/etc/rigup-testbed", "ro"), ("/proc/driver", "ro"), ("/run/nvidia-standin", "rw")]
    script = ["set -e"]
    for src, mode in binds:
        script.append(f'mkdir -p "{root}{src}" && mount --bind "{src}" "{root}{src}"'
                      + (f' && mount -o remount,bind,ro "{root}{src}"' if mode == "ro" else ""))
    target = f"{root}{common.HARDWARE_FILE}"
    script.append(f'mount --bind "{container_hw}" "{target}" && mount -o remount,bind,ro "{target}"')
    script.append(f'mkdir -p "{root}/usr/bin" && rm -f "{root}{NVIDIA_SMI}" && ln -s "{smi}" "{root}{NVIDIA_SMI}"')
    proc = subprocess.run(["nsenter", f"--mount=/proc/{int(state['pid'])}/ns/mnt", "--", "sh", "-c", "\n".join(script)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(f"nvidia-container-cli: mount error: {proc.stderr.strip()}\n")
        return 1
    return 0


def runtime(argv: list[str]) -> int:
    """Docker's `nvidia` runtime: runc, with the prestart hook added to a GPU container's bundle at create."""
    if argv in (["--version"], ["-v"], ["version"]):
        return other("nvidia-container-runtime", argv)
    if "create" in argv:
        bundle = "."
        for i, a in enumerate(argv):
            if a in ("--bundle", "-b") and i + 1 < len(argv):
                bundle = argv[i + 1]
            elif a.startswith("--bundle="):
                bundle = a.split("=", 1)[1]
        path = Path(bundle, "config.json")
        config = json.loads(path.read_text())
        visible = _visible(config.get("process", {}).get("env", []))
        prestart = config.setdefault("hooks", {}).setdefault("prestart", [])
        if visible and visible not in ("void", "none") and not any(h.get("path") == HOOK for h in prestart):
            prestart.append({"path": HOOK, "args": ["nvidia-container-runtime-hook", "prestart"]})
            path.write_text(json.dumps(config))
    os.execvp("runc", ["runc", *argv])
    return 127


def main(argv: list[str]) -> int:
    tool = os.path.basename(sys.argv[0])
    if tool.endswith(".py"):
        tool = os.environ.get("RIGUP_STANDIN_TOOL", "nvidia-ctk")
    common.log_call(LOG, tool, argv)
    if tool == "nvidia-ctk":
        return nvidia_ctk(argv)
    if tool == "nvidia-container-cli":
        return container_cli(argv)
    if tool == "nvidia-container-runtime-hook":
        return hook(argv)
    if tool == "nvidia-container-runtime":
        return runtime(argv)
    return other(tool, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
