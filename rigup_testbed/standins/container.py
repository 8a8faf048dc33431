#!/usr/bin/python3
"""What a stand-in container runs when its command is a program of its own (dockerd's "shell" kind).

dockerd starts `container.py --init SPEC.json` for a container whose entrypoint + command is a shell
(`bash -c SCRIPT -- ARGS...`, `sh -c ...`), a script or a Python file, instead of one of its fast paths
(bare `vllm serve`, nvidia-smi, sleep/true/echo/false, llama-server). Like runc, --init:

  * enters a private mount namespace and assembles the container's root on a tmpfs under the
    container's state dir (gone with the namespace, so nothing written there reaches the host):
    /usr/lib and /lib* of the host read-only (shared libraries and the host Python's stdlib), a
    /usr/bin holding only an allowlist of plain utilities (ALLOWED) plus bash, the shims below, a
    minimal /etc, /dev, /proc, /tmp, the image's own layer (image_files: vLLM's package under
    /usr/local/lib/python3.12/dist-packages/vllm, or /opt/venv's site-packages in LMCache's image,
    /vllm-workspace/examples/*.jinja in vllm/vllm-openai and the images built from it) and every bind
    mount of the container at its target (read-only ones remounted read-only: writes fail with EROFS);
  * chroots into it, resolves argv[0] on the container's PATH and execs it; a failure before the exec
    is written to dockerd's ready pipe, which fails `docker start` with the runtime's wording.

Inside, a real /bin/bash runs the script; bash reads $BASH_ENV (/.rigup/bashenv), whose
command_not_found_handle makes any other command print "rigup stand-in: CMD in a container is not
simulated" and return 127. Shims (this file again, `shim()`), standing in for what needs the real image:

  python3 / python / python3.12 SCRIPT  the script must be a regular file in a mount or the image layer
                                       and compile with the host Python; then "runs" (exit 0)
  python3 -m vllm.X                    the module file under the image's dist-packages (Genesis:
                                       vllm/_genesis/patches/apply_all.py, from a mount), compiled
  python3 -m pip / pip / pip3 install  needs /etc/rigup-testbed/containers.json {"network": true}
  vllm serve / python3 -m vllm.entrypoints.openai.api_server
                                       checks the model dir (in a mount, config.json, *.safetensors or
                                       *.bin) and --chat-template, then leaves the chroot (a handle on
                                       the host root is kept open for it) and execs responder.py with
                                       exactly its own arguments, keeping the published sockets' fds
  nvidia-smi                           the host's stand-in nvidia-smi, seeing only the container's GPUs
  llama-server (llama.cpp images)      responder.py as llama.cpp
  lmcache server (lmcache/vllm-openai)  LMCache's multiprocess KV-cache server: checks its arguments like
                                       the real CLI (an unknown or malformed one exits 2), the L2 `fs`
                                       adapter's directory (a writable mount), warns when the L1 size is
                                       above /dev/shm, then stays up until signalled (it caches nothing;
                                       vLLM's connector to it is not simulated). Only LMCache's image has
                                       it (in /opt/venv/bin, with its vllm and python3: IMAGE_SHIMS); in
                                       other images `lmcache` is a command not found. Other eviction
                                       policies, L2 adapters and `lmcache` commands fail as not simulated

The image's kind (dockerd.image_kind: vllm, vllm-omni, lmcache, llama, cuda, plain) decides the layer and
the shims, as the real images differ. A `--deploy-config FILE` (vLLM-Omni) is read in the container's root
and handed to responder.py, which checks it.

python3 -c / python3 - (stdin) fail loudly as not simulated. Stdlib only, Python >= 3.10.
"""

from __future__ import annotations

import ctypes
import errno
import glob
import json
import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

VLLM_VERSION = "0.11.0"
IMAGE_PYTHON_VERSION = "3.12.3"
VLLM_SITE = "/usr/local/lib/python3.12/dist-packages/vllm"
INFO = "/.rigup/ctr.json"
BASH_ENV = "/.rigup/bashenv"
NETWORK_FILE = "/etc/rigup-testbed/containers.json"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Plain utilities a container gets from the host (bash is always there, sh is bash in POSIX mode).
ALLOWED = ("cat", "cp", "mv", "rm", "mkdir", "ls", "ln", "test", "[", "echo", "printf", "sed", "grep", "awk", "head",
           "tail", "tr", "cut", "env", "true", "false", "sleep", "dirname", "basename", "chmod", "touch", "wc", "sort",
           "uniq", "find")
HOST_BIN_DIRS = ("/usr/bin", "/bin", "/usr/sbin", "/sbin")
TEMPLATES = ("chatml", "deepseekv3", "gemma3_pythonic", "gemma4", "granite", "hermes", "internlm2_tool", "llama3.1_json",
             "llama3.2_json", "llama4_json", "mistral", "mistral_parallel", "qwen3coder", "toolace")
TEMPLATE_TEXT = ("{%- for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{%- endfor %}\n"
                 "{%- if add_generation_prompt %}<|assistant|>\n{%- endif %}\n")


# --- vLLM / llama.cpp command lines --------------------------------------------------------------


def vllm_args(tokens: list[str]) -> dict[str, Any]:
    """The vLLM (or llama.cpp server) options a command line carries."""
    out: dict[str, Any] = {"served_model_names": []}
    flags_with_value = {
        "--model": "model", "--port": "port", "--host": "host", "--api-key": "api_key",
        "--tensor-parallel-size": "tp", "-tp": "tp", "--gpu-memory-utilization": "gpu_util",
        "--pipeline-parallel-size": "pp", "-pp": "pp", "--distributed-executor-backend": "distributed_executor_backend",
        "--max-model-len": "max_model_len", "--speculative-config": "speculative_config",
        "--alias": "alias", "-a": "alias", "-m": "model", "--ctx-size": "max_model_len", "-c": "max_model_len",
        "--chat-template": "chat_template", "--deploy-config": "deploy_config",
        # the engine's scheduler and KV cache (responder.py's /metrics: vllm_metrics.engine_for)
        "--max-num-seqs": "max_num_seqs", "--block-size": "block_size",
        "--num-gpu-blocks-override": "num_gpu_blocks_override", "--kv-cache-dtype": "kv_cache_dtype",
    }
    i = 0
    while i < len(tokens):
        t = tokens[i]
        name, eq, value = t.partition("=")
        if name == "--served-model-name":
            vals = [value] if eq else []
            while not eq and i + 1 < len(tokens) and not tokens[i + 1].startswith("-") and tokens[i + 1] not in ("&&", ";", "|"):
                i += 1
                vals.append(tokens[i])
            out["served_model_names"] += vals
        elif name in flags_with_value:
            if not eq and i + 1 < len(tokens):
                i += 1
                value = tokens[i]
            out[flags_with_value[name]] = value
        elif t == "--omni":  # vLLM-Omni's switch (no value)
            out["omni"] = True
        elif t == "--disable-custom-all-reduce":  # responder.json's p2p_corrupts_custom_all_reduce reads it
            out["disable_custom_all_reduce"] = True
        elif t in ("--enable-prefix-caching", "--no-enable-prefix-caching"):
            out["enable_prefix_caching"] = t == "--enable-prefix-caching"
        elif t == "serve" and i + 1 < len(tokens) and not tokens[i + 1].startswith("-"):
            out.setdefault("model", tokens[i + 1])
            i += 1
        i += 1
    return out


# --- the container's root (runs on the host, as root, before the exec) ---------------------------

CLONE_NEWNS = 0x00020000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC = 32, 1024, 2048, 4096, 16384
MS_PRIVATE, MS_RELATIME = 1 << 18, 1 << 21
ST_FLAGS = {2: MS_NOSUID, 4: MS_NODEV, 8: MS_NOEXEC, 1024: MS_NOATIME, 2048: MS_NODIRATIME, 4096: MS_RELATIME}


class SetupError(Exception):
    """The container cannot start; the message is what the runtime reports (after 'error during container init: ')."""

    def __init__(self, message: str, code: int = 127):
        super().__init__(message)
        self.code = code


_libc: Any = None


def libc() -> Any:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
        _libc.unshare.argtypes = [ctypes.c_int]
    return _libc


def _b(s: str | None) -> bytes | None:
    return None if s is None else os.fsencode(s)


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    if libc().mount(_b(source), _b(target), _b(fstype), flags, _b(data)) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), target)


def bind(source: str, target: str, read_only: bool, recursive: bool = True) -> None:
    mount(source, target, None, MS_BIND | (MS_REC if recursive else 0))
    if read_only:
        keep = 0
        flag = os.statvfs(target).f_flag
        for st, ms in ST_FLAGS.items():
            if flag & st:
                keep |= ms
        mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | keep)


def inside(root: str, path: str) -> str:
    """The host path of container path `path`: symlinks followed the way the container sees them
    (an absolute link target starts again at the container's root, `..` never climbs out of it)."""
    todo = [p for p in path.split("/") if p and p != "."]
    done: list[str] = []
    hops = 0
    while todo:
        part = todo.pop(0)
        if part == "..":
            if done:
                done.pop()
            continue
        host = os.path.join(root, *done, part)
        if os.path.islink(host):
            hops += 1
            if hops > 40:
                raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), path)
            target = os.readlink(host)
            if target.startswith("/"):
                done = []
            todo = [p for p in target.split("/") if p and p != "."] + todo
            continue
        done.append(part)
    return os.path.join(root, *done)


def host_tool(name: str) -> str | None:
    for d in HOST_BIN_DIRS:
        p = os.path.join(d, name)
        if os.path.isfile(p) and os.access(p, os.X_OK):
            return os.path.realpath(p)
    return None


# Image kinds (dockerd.image_kind) that are vLLM images: the same vLLM layer, their own shims (IMAGE_SHIMS).
VLLM_IMAGES = ("vllm", "vllm-omni", "lmcache")
VLLM_SITES = {"vllm": VLLM_SITE, "vllm-omni": VLLM_SITE, "lmcache": "/opt/venv/lib/python3.12/site-packages/vllm"}
IMAGE_SHIMS: dict[str, dict[str, str]] = {
    "vllm": {"/usr/local/bin/vllm": "vllm"},
    "vllm-omni": {"/usr/local/bin/vllm": "vllm"},
    # LMCache's image: vLLM and LMCache's CLI in /opt/venv (dockerd.image_config); only it has `lmcache`
    "lmcache": {"/opt/venv/bin/vllm": "vllm", "/opt/venv/bin/lmcache": "lmcache", "/opt/venv/bin/python3": "python",
                "/opt/venv/bin/python": "python"},
    "llama": {"/app/llama-server": "llama-server"},
}


def image_files(image: str) -> dict[str, str]:
    """The image's own layer: container path -> text (shims are added separately)."""
    if image in VLLM_IMAGES:
        site = VLLM_SITES[image]
        files = {
            f"{site}/__init__.py": f'__version__ = "{VLLM_VERSION}"\n',
            f"{site}/version.py": f'__version__ = "{VLLM_VERSION}"\n__version_tuple__ = (0, 11, 0)\n',
            f"{site}/entrypoints/__init__.py": "",
            f"{site}/entrypoints/utils.py": "# rigup stand-in: the image's module club-3090's PR 41800 overlay patches\n",
            f"{site}/entrypoints/openai/__init__.py": "",
            f"{site}/entrypoints/openai/api_server.py": "# rigup stand-in: the OpenAI server is responder.py\n",
            f"{site}/entrypoints/cli/__init__.py": "",
            f"{site}/entrypoints/cli/main.py": "# rigup stand-in: the vllm command is a shim\n",
        }
        if image != "lmcache":  # vllm/vllm-openai's examples (vLLM-Omni's image is built FROM it; LMCache's is not)
            for t in TEMPLATES:
                files[f"/vllm-workspace/examples/tool_chat_template_{t}.jinja"] = TEMPLATE_TEXT
        return files
    if image == "cuda":
        return {"/opt/nvidia/nvidia_entrypoint.sh": '#!/bin/bash\nexec "$@"\n'}
    return {}


def shim_text(interp: str, name: str) -> str:
    return (f"#!{interp} -IS\n# rigup stand-in shim: {name}\nimport sys\nsys.path.insert(0, '/.rigup')\n"
            f"import container\nsys.exit(container.shim({name!r}, sys.argv[0], sys.argv[1:]))\n")


BASHENV_TEXT = """\
# rigup stand-in: read by every non-interactive bash of the container ($BASH_ENV).
command_not_found_handle() {
    printf 'rigup stand-in: %s in a container is not simulated\\n' "$1" >&2
    return 127
}
"""


def build_root(rootfs: str, spec: dict[str, Any], network: bool) -> dict[str, Any]:
    """Assemble the container's root under `rootfs` (already a fresh tmpfs); returns /.rigup/ctr.json."""

    def at(path: str) -> str:
        return inside(rootfs, path)

    def mkdirs(path: str, mode: int = 0o755) -> str:
        p = at(path)
        os.makedirs(p, exist_ok=True)
        os.chmod(p, mode)
        return p

    def write(path: str, text: str, mode: int = 0o644) -> None:
        p = at(path)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "w") as fh:
            fh.write(text)
        os.chmod(p, mode)

    def bind_file(source: str, path: str, read_only: bool = True) -> None:
        p = at(path)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        if not os.path.exists(p):
            open(p, "a").close()
        bind(source, p, read_only, recursive=False)

    for d in ("usr/bin", "usr/sbin", "usr/lib", "usr/libexec", "usr/share", "usr/local/bin", "usr/local/sbin",
              "usr/local/lib", "usr/local/share", "etc", "dev", "proc", "sys", "run", "var/tmp", "var/lib", "var/log",
              "home", "opt", "srv", "mnt", "media", ".rigup"):
        os.makedirs(os.path.join(rootfs, d), exist_ok=True)
    mkdirs("/root", 0o700)
    mkdirs("/tmp", 0o1777)
    for link, target in (("bin", "usr/bin"), ("sbin", "usr/sbin")):
        os.symlink(target, os.path.join(rootfs, link))
    # Shared libraries (and the host Python's stdlib when it is the system one): read-only, as on the host.
    for d in ("/lib", "/lib32", "/lib64", "/libx32", "/usr/lib32", "/usr/lib64", "/usr/libx32"):
        if os.path.islink(d):
            os.symlink(os.readlink(d), os.path.join(rootfs, d.lstrip("/")))
        elif os.path.isdir(d):
            bind(d, mkdirs(d), True)
    bind("/usr/lib", at("/usr/lib"), True)
    # The host interpreter the shims run on.
    exe = os.path.realpath(sys.executable)
    if exe.startswith(("/usr/bin/", "/bin/")):
        interp = "/usr/libexec/rigup-standin/python3"  # finds its stdlib in /usr/lib like at home
        bind_file(exe, interp)
    else:  # a Python of its own prefix (a CI toolcache, pyenv): the whole prefix at the same path
        prefix = os.path.realpath(sys.base_prefix)
        bind(prefix, mkdirs(prefix), True)
        interp = exe
    # Plain utilities and bash, from the host.
    for name in ("bash", *ALLOWED):
        src = host_tool(name)
        if src:
            bind_file(src, f"/usr/bin/{name}")
    os.symlink("bash", at("/usr/bin/sh"))
    # /etc
    write("/etc/hostname", spec["hostname"] + "\n")
    write("/etc/hosts", f"127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n172.17.0.2\t{spec['hostname']}\n")
    write("/etc/passwd", "root:x:0:0:root:/root:/bin/bash\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n")
    write("/etc/group", "root:x:0:\nnogroup:x:65534:\n")
    for f in ("/etc/resolv.conf", "/etc/ld.so.cache"):
        try:
            shutil.copyfile(f, at(f))
        except OSError:
            pass
    # /dev, /proc
    for dev in ("null", "zero", "full", "random", "urandom", "tty"):
        if os.path.exists(f"/dev/{dev}"):
            bind_file(f"/dev/{dev}", f"/dev/{dev}", read_only=False)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, at(f"/dev/{name}"))
    mount("shm", mkdirs("/dev/shm", 0o1777), "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
          f"mode=1777,size={int(spec.get('shm_size') or 67108864)}")
    bind("/proc", at("/proc"), False)
    # The image's layer and the shims.
    layer = image_files(spec["image"])
    for path, text in layer.items():
        write(path, text, 0o755 if text.startswith("#!") else 0o644)
    shims = {"/usr/bin/python3": "python", "/usr/bin/python": "python", "/usr/bin/python3.12": "python",
             "/usr/bin/pip": "pip", "/usr/bin/pip3": "pip"}
    shims.update(IMAGE_SHIMS.get(spec["image"], {}))
    if spec.get("gpus") and spec.get("nvidia_smi"):  # the nvidia runtime hands nvidia-smi in with the GPUs
        shims["/usr/bin/nvidia-smi"] = "nvidia-smi"
    for path, name in shims.items():
        write(path, shim_text(interp, name), 0o755)
    for f in ("container.py",):
        shutil.copyfile(os.path.join(os.path.dirname(os.path.abspath(__file__)), f), at(f"/.rigup/{f}"))
    write(BASH_ENV, BASHENV_TEXT)
    mkdirs(spec.get("workdir") or "/")
    # The container's own bind mounts, shallow targets first (as Docker sorts them).
    mounts = []
    for m in sorted(spec.get("mounts", []), key=lambda m: len([p for p in m["target"].split("/") if p])):
        src, target = m["source"], m["target"]
        try:
            dst = at(target)
            if os.path.isdir(src):
                os.makedirs(dst, exist_ok=True)
            else:
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                if not os.path.exists(dst):
                    open(dst, "a").close()
            bind(src, dst, m.get("ro", False))
        except OSError as exc:
            raise SetupError(f'error mounting "{src}" to rootfs at "{target}": {exc.strerror.lower() if exc.strerror else exc}',
                             126) from None
        mounts.append({"target": target, "ro": bool(m.get("ro"))})
    return {"mounts": mounts, "image": spec["image"], "image_files": sorted(layer),
            "vllm_site": VLLM_SITES.get(spec["image"]), "network": network,
            "gpus": spec.get("gpus") or [], "host": spec["host"]}


def lookup(argv0: str, path_var: str) -> str | None:
    """argv[0] resolved like runc does (in the container's root, on the container's PATH)."""
    if "/" in argv0:
        return argv0
    for d in path_var.split(":"):
        p = os.path.join(d or ".", argv0)
        if os.path.isfile(p) and os.access(p, os.X_OK):
            return p
    return None


def init(spec_file: str) -> int:
    spec = json.loads(Path(spec_file).read_text())
    ready = int(spec["ready_fd"])

    def fail(message: str, code: int) -> int:
        try:
            os.write(ready, json.dumps({"error": message, "code": code}).encode())
        except OSError:
            pass
        sys.stderr.write(f"rigup stand-in: {message}\n")
        return code

    import common  # next to this file on the host

    conf = common.read_json(common.path(NETWORK_FILE), {}) or {}
    network = bool(conf.get("network")) if isinstance(conf, dict) else False
    rootfs = os.path.join(spec["cdir"], "rootfs")
    try:
        os.makedirs(rootfs, exist_ok=True)
        if libc().unshare(CLONE_NEWNS) != 0:
            e = ctypes.get_errno()
            raise OSError(e, f"unshare(CLONE_NEWNS): {os.strerror(e)}")
        mount(None, "/", None, MS_REC | MS_PRIVATE)
        mount("rootfs", rootfs, "tmpfs", MS_NOSUID | MS_NODEV, "mode=755,size=1g")
        info = build_root(rootfs, spec, network)
        host_root = os.open("/", os.O_RDONLY | os.O_DIRECTORY)
        os.set_inheritable(host_root, True)  # the shims that stand in for GPU work leave the root through it
        info["hostfd"] = host_root
        with open(inside(rootfs, INFO), "w") as fh:
            json.dump(info, fh, indent=1)
        os.chroot(rootfs)
        os.chdir(spec.get("workdir") or "/")
    except SetupError as exc:
        return fail(str(exc), exc.code)
    except OSError as exc:
        return fail(f"rigup stand-in could not assemble the container root: {exc}", 126)
    env = dict(spec["env"])
    env.setdefault("BASH_ENV", BASH_ENV)
    argv = spec["argv"]
    prog = lookup(argv[0], env.get("PATH", DEFAULT_PATH))
    if prog is None:
        return fail(f'exec: "{argv[0]}": executable file not found in $PATH', 127)
    os.set_inheritable(ready, False)  # closes at the exec: dockerd reads EOF, the container has started
    try:
        os.execve(prog, argv, env)
    except OSError as exc:
        os.set_inheritable(ready, True)
        if exc.errno == errno.ENOENT and not os.path.lexists(prog):
            return fail(f'exec: "{prog}": stat {prog}: no such file or directory', 127)
        what = "is a directory" if exc.errno == errno.EISDIR or os.path.isdir(prog) else (exc.strerror or str(exc)).lower()
        return fail(f"exec {prog}: {what}", 127 if exc.errno == errno.ENOENT else 126)
    return 0  # not reached


# --- shims (run inside the container's root) -----------------------------------------------------


def info() -> dict[str, Any]:
    with open(INFO) as fh:
        return json.load(fh)


def err(msg: str) -> None:
    sys.stderr.write(msg.rstrip("\n") + "\n")
    sys.stderr.flush()


def not_simulated(what: str) -> int:
    err(f"rigup stand-in: {what} in a container is not simulated")
    return 1


def provided(path: str, ctr: dict[str, Any]) -> bool:
    """True when `path` (resolved) comes from a bind mount or the image's layer, not the container's own writes."""
    real = os.path.realpath(path)
    for m in ctr["mounts"]:
        t = os.path.realpath(m["target"])
        if real == t or real.startswith(t.rstrip("/") + "/"):
            return True
    return real in {os.path.realpath(p) for p in ctr["image_files"]}


def check_compiles(path: str) -> str | None:
    """None when `path` compiles with the host Python, else the traceback text Python prints."""
    try:
        with open(path, "rb") as fh:
            source = fh.read()
        compile(source, path, "exec", dont_inherit=True)
    except SyntaxError as exc:
        lines = [f'  File "{exc.filename}", line {exc.lineno}']
        if exc.text:
            lines.append("    " + exc.text.rstrip("\n").strip())
            if exc.offset:
                lead = len(exc.text) - len(exc.text.lstrip())
                lines.append("    " + " " * max(0, exc.offset - 1 - lead) + "^")
        lines.append(f"{type(exc).__name__}: {exc.msg}")
        return "\n".join(lines)
    except (ValueError, OSError) as exc:
        return f"SyntaxError: {exc}"
    return None


def run_script(argv0: str, script: str, args: list[str], ctr: dict[str, Any]) -> int:
    path = os.path.abspath(script)
    if os.path.isdir(path):
        err(f"{argv0}: can't find '__main__' module in {script!r}")
        return 1
    if not os.path.isfile(path):
        err(f"{argv0}: can't open file {path!r}: [Errno 2] No such file or directory")
        return 2
    if not provided(path, ctr):
        err(f"rigup stand-in: python3 {script}: only scripts from a bind mount or the image are simulated, "
            f"{os.path.realpath(path)} is in the container's own filesystem")
        return 1
    problem = check_compiles(path)
    if problem:
        err(problem)
        return 1
    print(f"rigup stand-in: python3 {script}{' ' + ' '.join(args) if args else ''}: compiled, ran (simulated)", flush=True)
    return 0


def run_module(argv0: str, mod: str, args: list[str], ctr: dict[str, Any]) -> int:
    if mod == "pip":
        return pip(args, ctr)
    if mod == "vllm.entrypoints.openai.api_server":
        return serve(["python3", "-m", mod, *args], ctr, "vllm")
    if mod == "vllm.entrypoints.cli.main":
        return vllm(args, ctr)
    parts = mod.split(".")
    site = ctr.get("vllm_site")
    if parts[0] != "vllm":
        return not_simulated(f"python3 -m {mod}")
    if not site:
        err(f"{argv0}: Error while finding module specification for {mod!r} (ModuleNotFoundError: No module named 'vllm')")
        return 1
    base = os.path.dirname(site)  # dist-packages
    found = None
    for k in range(1, len(parts) + 1):
        p = os.path.join(base, *parts[:k])
        last = k == len(parts)
        if last and os.path.isfile(p + ".py"):
            found = p + ".py"
        elif last and os.path.isfile(os.path.join(p, "__main__.py")):
            found = os.path.join(p, "__main__.py")
        elif not last and os.path.isdir(p):
            continue
        if found is None:
            missing = ".".join(parts[:k])
            err(f"{argv0}: Error while finding module specification for {mod!r} (ModuleNotFoundError: No module named "
                f"{missing!r})")
            where = os.path.join(base, *parts) + ".py"
            hint = f"rigup stand-in: looked for {where}"
            if parts[1:2] == ["_genesis"]:
                genesis = os.path.join(site, "_genesis")
                hint = (f"rigup stand-in: looked for the Genesis tree at {genesis} (the image's Python reads "
                        f"{base}, not site-packages): ")
                hint += ("it is empty or incomplete" if os.path.isdir(genesis) else "nothing is mounted there")
                elsewhere = [m["target"] for m in ctr["mounts"] if m["target"].rstrip("/").endswith("/_genesis")
                             and os.path.realpath(m["target"]) != os.path.realpath(genesis)]
                if elsewhere:
                    hint += f"; a tree is mounted at {', '.join(elsewhere)}, which is not on the image's sys.path"
            err(hint)
            return 1
        break
    assert found is not None
    if not provided(found, ctr):
        err(f"rigup stand-in: python3 -m {mod}: {found} is in the container's own filesystem, not a mount or the image")
        return 1
    problem = check_compiles(found)
    if problem:
        err("Traceback (most recent call last):\n" + problem)
        return 1
    print(f"rigup stand-in: python3 -m {mod}: {found} compiled, ran (simulated)", flush=True)
    return 0


def python(argv0: str, args: list[str], ctr: dict[str, Any]) -> int:
    i = 0
    while i < len(args):
        a = args[i]
        if a in ("-V", "--version"):
            print(f"Python {IMAGE_PYTHON_VERSION}")
            return 0
        if a == "-c" or (a[:1] == "-" and len(a) > 2 and "c" in a[1:] and set(a[1:]) <= set("bBdEiIOPqsSuvc")):
            return not_simulated("python3 -c")
        if a == "-m":
            if i + 1 >= len(args):
                err("Argument expected for the -m option")
                return 2
            return run_module(argv0, args[i + 1], args[i + 2:], ctr)
        if a.startswith("-m") and len(a) > 2:
            return run_module(argv0, a[2:], args[i + 1:], ctr)
        if a == "-":
            return not_simulated("python3 - (a script on stdin)")
        if a in ("-W", "-X", "--check-hash-based-pycs"):
            i += 2
            continue
        if a.startswith("-"):
            i += 1
            continue
        return run_script(argv0, a, args[i + 1:], ctr)
    return not_simulated("python3 reading a script from stdin")


PIP_VALUE_FLAGS = {"-r", "--requirement", "-c", "--constraint", "-i", "--index-url", "--extra-index-url", "-f",
                   "--find-links", "-t", "--target", "--prefix", "--root", "--trusted-host", "--progress-bar",
                   "--cache-dir", "--upgrade-strategy", "--platform", "--python-version", "--implementation", "--abi",
                   "--root-user-action", "-C", "--config-settings", "--global-option", "--no-binary", "--only-binary",
                   "--src", "--log", "--proxy", "--timeout", "--retries", "--exists-action", "--cert",
                   "--client-cert", "--python", "--keyring-provider", "--report"}


def pip(args: list[str], ctr: dict[str, Any]) -> int:
    i = 0
    while i < len(args) and args[i].startswith("-"):
        if args[i] in ("-V", "--version"):
            print("pip 24.0 from /usr/local/lib/python3.12/dist-packages/pip (python 3.12)")
            return 0
        i += 2 if args[i] in PIP_VALUE_FLAGS else 1
    if i >= len(args):
        return not_simulated("pip without a command")
    sub, rest = args[i], args[i + 1:]
    if sub != "install":
        return not_simulated(f"pip {sub}")
    quiet = any(a in ("-q", "--quiet") or re.fullmatch(r"-q+", a) for a in args)
    reqs: list[str] = []
    j = 0
    while j < len(rest):
        a = rest[j]
        name, eq, value = a.partition("=")
        if a in ("-e", "--editable"):
            j += 1
            if j < len(rest):
                reqs.append(rest[j])
        elif name in ("-r", "--requirement"):
            if not eq:
                j += 1
                value = rest[j] if j < len(rest) else ""
            try:
                with open(value) as fh:
                    reqs += [line.split("#")[0].strip() for line in fh if line.split("#")[0].strip()
                             and not line.strip().startswith("-")]
            except OSError as exc:
                err(f"ERROR: Could not open requirements file: [Errno {exc.errno}] {exc.strerror}: {value!r}")
                return 1
        elif name in PIP_VALUE_FLAGS:
            j += 0 if eq else 1
        elif not a.startswith("-"):
            reqs.append(a)
        j += 1
    if not reqs:
        err('ERROR: You must give at least one requirement to install (see "pip help install")')
        return 1
    local = [r for r in reqs if r.startswith(("/", "./", "../", "file:"))]
    for r in local:
        p = r[5:] if r.startswith("file:") else r
        if not os.path.exists(p):
            err(f"ERROR: Invalid requirement: {r!r}: Expected package name at the start of dependency specifier\n"
                f"Hint: It looks like a path. File {r!r} does not exist.")
            return 1
    remote = [r for r in reqs if r not in local]
    if remote and not ctr.get("network"):
        first = re.split(r"[<>=!~;\[\s@]", remote[0], maxsplit=1)[0].lower()
        for n in range(4, -1, -1):
            err(f"WARNING: Retrying (Retry(total={n}, connect=None, read=None, redirect=None, status=None)) after "
                "connection broken by 'NewConnectionError('<pip._vendor.urllib3.connection.HTTPSConnection object at "
                f"0x7f3a1c2b5d90>: Failed to establish a new connection: [Errno 101] Network is unreachable')': /simple/{first}/")
        err(f"ERROR: Could not find a version that satisfies the requirement {remote[0]} (from versions: none)")
        err(f"ERROR: No matching distribution found for {remote[0]}")
        err(f"rigup stand-in: pip install {' '.join(reqs)}: network is unreachable from the container (the test bed "
            f"allows it with {NETWORK_FILE} {{\"network\": true}})")
        return 1
    print(f"rigup stand-in: pip would install: {' '.join(reqs)}", flush=True)
    if not quiet:
        names = [re.split(r"[<>=!~;\[\s@]", r, maxsplit=1)[0] for r in reqs]
        print("Successfully installed " + " ".join(names), flush=True)
    return 0


def vllm_error(msg: str) -> int:
    sys.stdout.write(f"ERROR {time.strftime('%m-%d %H:%M:%S')} [core.py] EngineCore failed to start.\n")
    sys.stdout.write(f"Traceback (most recent call last):\n  ...\n{msg}\n")
    sys.stdout.flush()
    return 1


def has_weights(d: str) -> bool:
    return any(glob.glob(os.path.join(glob.escape(d), pat)) for pat in ("*.safetensors", "*.bin"))


def check_model(model: str, ctr: dict[str, Any]) -> str | None:
    """None when vLLM would load `model` here, else the error it dies with."""
    if model.startswith(("/", "./", "../")) or os.path.isdir(model):
        p = os.path.realpath(model)
        if not os.path.isdir(p) or not provided(p, ctr):
            return (f"OSError: Incorrect path_or_model_id: '{model}'. Please provide either the path to a local folder "
                    "or the repo_id of a model on the Hub.")
        if not os.path.isfile(os.path.join(p, "config.json")):
            return (f"OSError: {model} does not appear to have a file named config.json. Checkout "
                    f"'https://huggingface.co/{model}/tree/None' for available files.")
        if not has_weights(p):
            return f"RuntimeError: Cannot find any model weights with `{model}`"
        return None
    hub = os.environ.get("HF_HUB_CACHE") or os.path.join(os.environ.get("HF_HOME") or "/root/.cache/huggingface", "hub")
    snaps = glob.glob(os.path.join(glob.escape(hub), "models--" + model.replace("/", "--"), "snapshots", "*"))
    if any(os.path.isfile(os.path.join(s, "config.json")) and has_weights(s) and provided(s, ctr) for s in snaps):
        return None
    if ctr.get("network") and os.environ.get("HF_HUB_OFFLINE") not in ("1", "true", "True"):
        return None
    return ("OSError: We couldn't connect to 'https://huggingface.co' to load the files, and couldn't find them in the "
            f"cached files. Check your internet connection or see how to run the library in offline mode at "
            f"'https://huggingface.co/docs/transformers/installation#offline-mode'. (model {model!r})")


def leave_root(ctr: dict[str, Any]) -> dict[str, Any]:
    """Back to the host's root (through the handle --init kept open), for the stand-ins that do GPU work."""
    fd = int(ctr["hostfd"])
    os.fchdir(fd)
    os.chroot(".")
    os.chdir("/")
    os.close(fd)
    host = dict(ctr["host"])
    env = {k: v for k, v in os.environ.items() if k != "BASH_ENV" or v != BASH_ENV}
    if host.get("root_env"):
        env["RIGUP_STANDIN_ROOT"] = host["root_env"]
    if ctr.get("gpus"):
        env["NVIDIA_VISIBLE_DEVICES"] = ",".join(str(g) for g in ctr["gpus"])
    host["env"] = env
    return host


def serve(tokens: list[str], ctr: dict[str, Any], kind: str) -> int:
    a = vllm_args(tokens)
    model = a.get("model") or ""
    if kind == "vllm":
        if not model:
            err("usage: vllm serve [model_tag] [options]\nvllm serve: error: the following arguments are required: model_tag")
            return 2
        problem = check_model(model, ctr)
        if problem:
            return vllm_error(problem)
        template = a.get("chat_template")
        if template and "{" not in template and not os.path.isfile(template):
            return vllm_error(f"ValueError: The supplied chat template string ({template}) appears path-like, but "
                              "doesn't exist!")
        deploy = a.get("deploy_config")
        if deploy:  # read here, in the container's root; responder.py parses and checks it
            try:
                with open(deploy) as fh:
                    deploy_text = fh.read()
            except OSError as exc:
                return vllm_error(f"{type(exc).__name__}: [Errno {exc.errno}] {exc.strerror}: {deploy!r} "
                                  "(--deploy-config)")
    elif model and not os.path.isfile(model):
        err(f"gguf_init_from_file: failed to open GGUF file '{model}' (No such file or directory)")
        return 1
    host = leave_root(ctr)
    spec = json.loads(Path(host["spec"]).read_text())
    spec.update({"kind": kind, "args": a, "argv": tokens,
                 "serve_port": int(a.get("port") or (8080 if kind == "llama" else 8000))})
    if kind == "vllm" and a.get("deploy_config"):
        spec["deploy_config_text"] = deploy_text
    exec_spec = os.path.join(os.path.dirname(host["spec"]), "exec-spec.json")
    tmp = exec_spec + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(spec, fh, indent=1)
    os.chmod(tmp, 0o600)
    os.replace(tmp, exec_spec)
    os.execve(host["python"], [host["python"], host["responder"], exec_spec], host["env"])
    return 0  # not reached


def vllm(args: list[str], ctr: dict[str, Any]) -> int:
    if args[:1] in (["-v"], ["--version"]):
        print(VLLM_VERSION)
        return 0
    if args[:1] == ["serve"]:
        return serve(["vllm", *args], ctr, "vllm")
    if not args or args[0] in ("-h", "--help"):
        print("usage: vllm [-h] [-v] {chat,complete,serve,bench,collect-env,run-batch} ...")
        return 0 if args else 2
    return not_simulated(f"vllm {args[0]}")


# `lmcache server` options: name -> (type, default). Types: int, float (positive), str, "json" (an object).
LMCACHE_SERVER_OPTIONS: dict[str, tuple[Any, Any]] = {
    "--host": (str, "localhost"), "--port": (int, 5555), "--chunk-size": (int, 256), "--l1-size-gb": (float, None),
    "--eviction-policy": (str, "LRU"), "--l2-adapter": ("json", None),
}
LMCACHE_USAGE = ("usage: lmcache server [-h] [--host HOST] [--port PORT] [--chunk-size CHUNK_SIZE] "
                 "[--l1-size-gb L1_SIZE_GB] [--eviction-policy EVICTION_POLICY] [--l2-adapter L2_ADAPTER]")


def lmcache(args: list[str], ctr: dict[str, Any]) -> int:
    if not args or args[0] in ("-h", "--help"):
        print("usage: lmcache [-h] {server} ...")
        return 0 if args else 2
    if args[0] != "server":
        return not_simulated(f"lmcache {args[0]}")

    def usage_error(msg: str) -> int:
        err(f"{LMCACHE_USAGE}\nlmcache server: error: {msg}")
        return 2

    opts: dict[str, Any] = {name: default for name, (_, default) in LMCACHE_SERVER_OPTIONS.items()}
    rest, i = args[1:], 0
    while i < len(rest):
        name, eq, value = rest[i].partition("=")
        if name in ("-h", "--help"):
            print(LMCACHE_USAGE)
            return 0
        if name not in LMCACHE_SERVER_OPTIONS:
            return usage_error(f"unrecognized arguments: {' '.join(rest[i:])}")
        if not eq:
            if i + 1 >= len(rest) or rest[i + 1].startswith("--"):
                return usage_error(f"argument {name}: expected one argument")
            i += 1
            value = rest[i]
        kind = LMCACHE_SERVER_OPTIONS[name][0]
        try:
            if kind == "json":
                opts[name] = json.loads(value)
                if not isinstance(opts[name], dict):
                    raise ValueError
            else:
                opts[name] = kind(value)
                if kind in (int, float) and opts[name] <= 0:
                    raise ValueError
        except ValueError:
            what = {int: "positive int", float: "positive float", "json": "JSON object"}.get(kind, "")
            return usage_error(f"argument {name}: invalid {what} value: {value!r}")
        i += 1
    if opts["--l1-size-gb"] is None:
        return not_simulated("lmcache server without --l1-size-gb (the stand-in does not know LMCache's default)")
    if opts["--eviction-policy"] != "LRU":
        return not_simulated(f"lmcache server --eviction-policy {opts['--eviction-policy']}")
    l2 = opts["--l2-adapter"]
    l2_text = "none"
    if l2 is not None:
        if l2.get("type") != "fs":
            return not_simulated(f"lmcache server --l2-adapter type {l2.get('type')!r}")
        base = l2.get("base_path")
        if not isinstance(base, str) or not base:
            err("ValueError: the fs L2 adapter needs a base_path")
            return 1
        if not os.path.isdir(base) or not provided(base, ctr):
            err(f"FileNotFoundError: [Errno 2] No such file or directory: {base!r} (the fs L2 adapter's base_path; "
                f"rigup stand-in: it must be a directory from a bind mount)")
            return 1
        if not os.access(base, os.W_OK):
            err(f"PermissionError: [Errno 13] Permission denied: {base!r} (the fs L2 adapter writes there)")
            return 1
        l2_text = f"fs {base}"
    shm = os.statvfs("/dev/shm")
    shm_gb = shm.f_frsize * shm.f_blocks / 1e9
    if opts["--l1-size-gb"] > shm_gb:
        err(f"LMCache WARNING: --l1-size-gb {opts['--l1-size-gb']:g} is above /dev/shm ({shm_gb:.2f} GB): the cache "
            f"falls back to pickling through the socket (slow)")
    print(f"rigup stand-in: lmcache server listening on {opts['--host']}:{opts['--port']} (simulated): L1 "
          f"{opts['--l1-size-gb']:g} GB, chunk {opts['--chunk-size']} tokens, eviction LRU, L2 {l2_text}", flush=True)
    while True:  # a server: up until it is signalled (SIGTERM/SIGKILL end it as they end the real one)
        signal.pause()


def nvidia_smi(args: list[str], ctr: dict[str, Any]) -> int:
    host = leave_root(ctr)
    tool = host["nvidia_smi"]
    os.execve(tool, [tool, *args], host["env"])
    return 0  # not reached


def shim(name: str, argv0: str, args: list[str]) -> int:
    ctr = info()
    if name == "python":
        return python(argv0, args, ctr)
    if name == "pip":
        return pip(args, ctr)
    if name == "vllm":
        return vllm(args, ctr)
    if name == "nvidia-smi":
        return nvidia_smi(args, ctr)
    if name == "llama-server":
        return serve(["llama-server", *args], ctr, "llama")
    if name == "lmcache":
        return lmcache(args, ctr)
    return not_simulated(name)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--init"] and len(sys.argv) == 3:
        sys.exit(init(sys.argv[2]))
    sys.stderr.write("usage: container.py --init SPEC.json\n")
    sys.exit(2)
