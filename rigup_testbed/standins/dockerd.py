#!/usr/bin/python3
"""Stand-in for dockerd (package docker-ce), run by docker.service (Type=notify, socket-activated).

What it shares with the real daemon, because rigup's checks depend on it:
  * reads /etc/docker/daemon.json once at start and refuses to start on invalid JSON, unknown
    directives, a directive given both as flag and in the file, a bad runtime entry or a runtime whose
    binary is not on PATH (the last is stricter than the real daemon, which only fails at container
    start); `docker info` reports the runtimes of the config it loaded, so a daemon.json edit needs a
    restart to show;
  * registers the "nvidia" GPU device driver only when nvidia-container-runtime-hook was on PATH at
    start, and (stricter than real, on purpose) only with the nvidia runtime configured;
  * images: pulls are recorded in /var/lib/docker-standin/images.json with a digest derived from the
    name (or the pinned digest); /etc/rigup-testbed/registry.json {"missing": [refs], "digests":
    {ref: digest}} makes refs unknown or pins what a tag resolves to. An image's config (entrypoint,
    workdir, env) and the layer container.py assembles are its kind's (image_kind: vllm/vllm-openai,
    vllm/vllm-omni, lmcache/vllm-openai, llama.cpp, CUDA, plain), as the real images are built;
  * containers run under the daemon's cgroup, survive the CLI, die with the daemon and come back at
    daemon start per restart policy. A vLLM (or llama.cpp server) container runs responder.py, an
    OpenAI-compatible HTTP server; `nvidia-smi` runs the host's nvidia-smi with the container's GPUs;
    `sleep`, `true`, `echo` run as such (fast paths). A shell, script or Python entrypoint (`bash -c
    SCRIPT -- ARGS`) runs for real in a root assembled from the container's mounts (container.py), where
    shims stand in for python3, pip, vllm and nvidia-smi; anything else exits 127 saying it is not
    simulated. Published ports are bound by the daemon (like docker-proxy) and handed to the container
    process; bind sources are checked/created at start like the engine does.
Clients talk to it over the real socket path with a private JSON RPC (see dockerclient.py).
"""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import re
import shutil
import signal
import socket
import socketserver
import subprocess
import sys
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any

import common
import dockerclient as ref
from container import vllm_args  # noqa: F401 - also dockerd.vllm_args

HERE = Path(__file__).resolve().parent
LOG = "/var/log/docker-standin/calls.log"
STATE_DIR = "/var/lib/docker-standin"
RUN_DIR = "/run/docker-standin"
DEFAULT_CONFIG = "/etc/docker/daemon.json"
BUILTIN_RUNTIMES = {"io.containerd.runc.v2": {"path": "runc"}, "runc": {"path": "runc"}}
# Directives dockerd accepts in daemon.json (subset of the real list that a rig could plausibly use).
KNOWN_DIRECTIVES = {
    "allow-nondistributable-artifacts", "api-cors-header", "authorization-plugins", "bip", "bip6", "bridge",
    "builder", "cdi-spec-dirs", "cgroup-parent", "containerd", "containerd-namespace", "containerd-plugins-namespace",
    "data-root", "debug", "default-address-pools", "default-cgroupns-mode", "default-gateway", "default-gateway-v6",
    "default-ipc-mode", "default-network-opts", "default-runtime", "default-shm-size", "default-ulimits", "dns",
    "dns-opts", "dns-search", "exec-opts", "exec-root", "experimental", "features", "fixed-cidr", "fixed-cidr-v6",
    "group", "host-gateway-ip", "hosts", "icc", "init", "init-path", "insecure-registries", "ip", "ip-forward",
    "ip-masq", "iptables", "ip6tables", "ipv6", "labels", "live-restore", "log-driver", "log-format", "log-level",
    "log-opts", "max-concurrent-downloads", "max-concurrent-uploads", "max-download-attempts", "metrics-addr",
    "min-api-version", "mtu", "no-new-privileges", "node-generic-resources", "oom-score-adjust", "pidfile",
    "proxies", "raw-logs", "registry-mirrors", "runtimes", "seccomp-profile", "selinux-enabled",
    "shutdown-timeout", "storage-driver", "storage-opts", "tls", "tlscacert", "tlscert", "tlskey", "tlsverify",
    "userland-proxy", "userland-proxy-path", "userns-remap",
}


def meta() -> dict[str, str]:
    return common.read_json(HERE / "version.json", {}) or {}


def now_iso() -> str:
    t = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1e9):09d}Z"


def which(name: str) -> str | None:
    if common.test_mode():
        for d in ("/usr/local/bin", "/usr/bin", "/usr/sbin", "/bin"):
            p = common.path(f"{d}/{name}")
            if p.exists():
                return str(p)
        return None
    return shutil.which(name)


class ConfigError(Exception):
    pass


def load_config(path: Path, flag_hosts: list[str]) -> dict[str, Any]:
    """daemon.json as dockerd validates it at start."""
    shown = str(path) if not common.test_mode() else DEFAULT_CONFIG
    if not path.exists():
        return {}
    text = path.read_text()
    if not text.strip():
        return {}
    try:
        config = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"unable to configure the Docker daemon with file {shown}: {exc}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"unable to configure the Docker daemon with file {shown}: json: cannot unmarshal "
                          "array into Go value of type map[string]interface {}")
    unknown = sorted(set(config) - KNOWN_DIRECTIVES)
    if unknown:
        raise ConfigError(f"unable to configure the Docker daemon with file {shown}: the following directives "
                          f"don't match any configuration option: {', '.join(unknown)}")
    if "hosts" in config and flag_hosts:
        raise ConfigError(
            f"unable to configure the Docker daemon with file {shown}: the following directives are specified "
            f"both as a flag and in the configuration file: hosts: (from flag: [{' '.join(flag_hosts)}], "
            f"from file: [{' '.join(config['hosts'])}])")
    runtimes = config.get("runtimes", {})
    if not isinstance(runtimes, dict):
        raise ConfigError(f"unable to configure the Docker daemon with file {shown}: runtimes must be an object")
    for name, rt in runtimes.items():
        if name in BUILTIN_RUNTIMES:
            raise ConfigError(f"runtime name '{name}' is reserved")
        if not isinstance(rt, dict) or not (rt.get("path") or rt.get("runtimeType")):
            raise ConfigError(f"failed to start daemon: runtime {name}: either a runtimeType or a path must be configured")
        path_ = rt.get("path")
        if path_ and not (which(path_) if "/" not in path_ else Path(path_).exists()):
            raise ConfigError(f"failed to start daemon: runtime {name}: exec: \"{path_}\": executable file not found in $PATH")
    default = config.get("default-runtime")
    if default and default not in runtimes and default not in BUILTIN_RUNTIMES:
        raise ConfigError(f"failed to start daemon: default runtime {default} does not exist")
    return config


# --- containers ----------------------------------------------------------------------------------


def expand_env(text: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)(?::-([^}]*))?\}|\$(\w+)",
                  lambda m: env.get(m.group(1) or m.group(3), m.group(2) or "") or (m.group(2) or ""), text)


SHELLS = ("bash", "sh")
PYTHONS = ("python3", "python", "python3.12")


def classify(c: dict[str, Any]) -> tuple[str, list[str]]:
    """(kind, argv tokens) of what the container runs: vllm | llama | nvidia-smi | simple | shell | unknown.

    shell: a shell, a script or a Python file, run for real in an assembled root (container.py); the
    others are fast paths that run the stand-in directly."""
    entry = c["Config"].get("Entrypoint") or []
    cmd = c["Config"].get("Cmd") or []
    image = c["Config"]["Image"]
    env = dict(e.split("=", 1) for e in c["Config"].get("Env", []) if "=" in e)
    image_name = ref.parse_ref(image)["path"]
    argv = list(entry + cmd)
    while argv and argv[0].endswith("nvidia_entrypoint.sh"):  # the CUDA images' entrypoint only execs "$@"
        argv = argv[1:]
    prog = Path(argv[0]).name if argv else ""
    if prog in SHELLS or (prog in PYTHONS and "vllm.entrypoints.openai.api_server" not in argv) \
            or prog in ("pip", "pip3") or (argv and argv[0].startswith("/") and prog not in ("llama-server", "nvidia-smi",
                                                                                          "sleep", "true", "echo", "false")):
        return "shell", argv
    tokens = [expand_env(t, env) for t in entry + cmd]
    default_entry = image_config(image_name).get("Entrypoint") or []
    if default_entry and not entry and not (cmd[:1] and not cmd[0].startswith("-")):
        tokens = default_entry + tokens  # the image's own entrypoint (vllm/vllm-openai's `vllm serve`)
    if (any(Path(t).name == "vllm" for t in tokens) and "serve" in tokens) \
            or "vllm.entrypoints.openai.api_server" in tokens:
        return "vllm", tokens
    if "llama.cpp" in image_name or any(Path(t).name == "llama-server" for t in tokens):
        return "llama", tokens
    words = [t for t in tokens if not t.endswith("nvidia_entrypoint.sh")]
    if words[:1] == ["nvidia-smi"]:
        return "nvidia-smi", words
    if words[:1] in (["sleep"], ["true"], ["echo"], ["false"]):
        return "simple", words
    return "unknown", words


# Images that are not plain vLLM images although their name says vllm, by repository (on any registry or
# mirror path): each kind's layer (container.py) and config (image_config) are the real image's.
IMAGE_REPOSITORIES = {"vllm/vllm-omni": "vllm-omni", "lmcache/vllm-openai": "lmcache"}


def image_kind(image: str) -> str:
    """Which image an assembled container root gets: vllm (vllm/vllm-openai and other vLLM builds),
    vllm-omni, lmcache (LMCache's vLLM image), llama, cuda or plain."""
    name = ref.parse_ref(image)["path"]
    for repository, kind in IMAGE_REPOSITORIES.items():
        if name == repository or name.endswith("/" + repository):
            return kind
    if "vllm" in name:
        return "vllm"
    if "llama.cpp" in name:
        return "llama"
    if "cuda" in name:
        return "cuda"
    return "plain"


def host_source(source: str) -> Path:
    """Where a bind source lives for the daemon (named volumes live under the stand-in root)."""
    if source.startswith("/var/lib/docker/"):
        return common.path(source)
    return Path(source)


def missing_source(source: str) -> str:
    return f'invalid mount config for type "bind": bind source path does not exist: {source}'


class Engine:
    def __init__(self, config: dict[str, Any], hook: bool):
        self.lock = threading.RLock()
        self.config = config
        self.hook = hook
        self.runtimes = dict(BUILTIN_RUNTIMES)
        for name, rt in (config.get("runtimes") or {}).items():
            entry = {"path": rt.get("path")} if rt.get("path") else {"runtimeType": rt.get("runtimeType")}
            if rt.get("runtimeArgs"):
                entry["runtimeArgs"] = rt["runtimeArgs"]
            self.runtimes[name] = entry
        self.default_runtime = config.get("default-runtime", "runc")
        self.state_dir = common.path(STATE_DIR)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.images: dict[str, Any] = common.read_json(self.state_dir / "images.json", {}) or {}
        self.images.setdefault("images", {})
        self.containers: dict[str, Any] = common.read_json(self.state_dir / "containers.json", {}) or {}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.stop_requested: set[str] = set()
        self.shutting_down = False
        self.id = meta().get("engine_id") or hashlib.sha256(common.boot_id().encode()).hexdigest()[:36]
        self.started = time.time()

    @staticmethod
    def ctr_socket(cid: str) -> Path:
        """The container's own port, for health checks (short path: AF_UNIX names are limited to 107 bytes)."""
        d = common.path(RUN_DIR) / "c"
        d.mkdir(parents=True, exist_ok=True)
        return d / f"{cid[:12]}.sock"

    # persistence
    def save(self) -> None:
        common.write_json_atomic(self.state_dir / "images.json", self.images)
        common.write_json_atomic(self.state_dir / "containers.json", self.containers, 0o600)

    # images
    def find_image(self, name: str) -> dict[str, Any] | None:
        imgs = self.images["images"]
        if name.startswith("sha256:") and name in imgs:
            return imgs[name]
        for img in imgs.values():
            if name in img["RepoTags"] or name in img["RepoDigests"] or img["Id"].startswith("sha256:" + name):
                return img
        try:
            fam = ref.familiar(name)
        except Exception:
            return None
        for img in imgs.values():
            if fam in img["RepoTags"] or fam in img["RepoDigests"]:
                return img
        return None

    def registry_digest(self, p: dict[str, str], image: str) -> str:
        """Ask a private registry (Registry API v2 manifests) what a reference resolves to, like a real pull.

        HTTPS checked against the system's trust store (/etc/ssl/certs, as the real engine on Linux), plain
        HTTP only for insecure registries (daemon.json "insecure-registries", or loopback), as with the real
        engine. docker.io is simulated locally (hosts have no internet)."""
        import ssl
        import urllib.error
        import urllib.request

        host = p["domain"]
        hostname = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
        insecure = set(self.config.get("insecure-registries", []))
        plain = host in insecure or hostname in insecure or hostname == "localhost" or hostname.startswith("127.")
        scheme = "http" if plain else "https"
        ref_part = p["digest"] or p["tag"]
        url = f"{scheme}://{host}/v2/{p['path']}/manifests/{ref_part}"
        req = urllib.request.Request(url, method="HEAD", headers={
            "Accept": "application/vnd.docker.distribution.manifest.v2+json, application/vnd.oci.image.index.v1+json"})
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return p["digest"] or resp.headers.get("Docker-Content-Digest") or ref.fake_digest(image)
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                what = f"{host}/{p['path']}:{p['tag']}" if p["tag"] else ref.familiar(image)
                raise ref.DaemonError(f"manifest for {what} not found: manifest unknown: manifest unknown", 404) from None
            raise ref.DaemonError(f"received unexpected HTTP status: {exc.code} {exc.reason}", 500) from None
        except OSError as exc:
            reason = getattr(exc, "reason", exc)
            if isinstance(reason, ssl.SSLCertVerificationError):  # the engine's words (Go's crypto/x509)
                raise ref.DaemonError(f'Get "https://{host}/v2/": tls: failed to verify certificate: x509: '
                                      "certificate signed by unknown authority", 500) from None
            if isinstance(reason, ssl.SSLError):
                raise ref.DaemonError(f'Get "https://{host}/v2/": http: server gave HTTP response to HTTPS client', 500) from None
            raise ref.DaemonError(f'Get "{scheme}://{host}/v2/": dial tcp {host}: connect: {reason}', 500) from None

    def pull(self, image: str) -> dict[str, Any]:
        registry = common.read_json(common.path(common.REGISTRY_FILE), {}) or {}
        p = ref.parse_ref(image)
        fam_name = ref.familiar_name(p)
        fam = ref.familiar(image)
        # registry.json keys may name the image with or without its registry host.
        keys = {fam, ref.canonical(image), f"{p['path']}:{p['tag']}" if p["tag"] else f"{p['path']}@{p['digest']}"}
        if keys & set(registry.get("missing", [])):
            what = f"{fam_name}:{p['tag']}" if p["tag"] else fam
            raise ref.DaemonError(f"manifest for {what} not found: manifest unknown: manifest unknown", 404)
        delay = float(registry.get("pull_delay_s", 0) or 0)
        pinned = next((registry.get("digests", {})[k] for k in sorted(keys) if k in registry.get("digests", {})), None)
        if p["domain"] != "docker.io":
            digest = self.registry_digest(p, image)
        else:
            digest = p["digest"] or pinned or ref.fake_digest(image)
        image_id = "sha256:" + hashlib.sha256(f"rigup-standin-config:{fam_name}@{digest}".encode()).hexdigest()
        first = f"{p['tag']}: Pulling from {fam_name}" if not p["digest"] else f"{digest}: Pulling from {fam_name}"
        with self.lock:
            existing = self.images["images"].get(image_id)
            lines = [first]
            if existing is None:
                if delay:
                    time.sleep(delay)
                layer = image_id[7:19]
                lines += [f"{layer}: Pulling fs layer", f"{layer}: Download complete", f"{layer}: Pull complete"]
                existing = {
                    "Id": image_id, "RepoTags": [], "RepoDigests": [], "Created": now_iso(),
                    "Size": 1_000_000 + int(image_id[7:13], 16), "Config": image_config(fam_name),
                    "Architecture": "amd64", "Os": "linux",
                }
                status = "Downloaded newer image for"
            else:
                status = "Image is up to date for"
            # A tag moves to the newest image pulled for it, like on a real engine.
            if p["tag"]:
                tag = f"{fam_name}:{p['tag']}"
                for img in self.images["images"].values():
                    if tag in img["RepoTags"] and img["Id"] != image_id:
                        img["RepoTags"].remove(tag)
                if tag not in existing["RepoTags"]:
                    existing["RepoTags"].append(tag)
            rd = f"{fam_name}@{digest}"
            if rd not in existing["RepoDigests"]:
                existing["RepoDigests"].append(rd)
            self.images["images"][image_id] = existing
            self.save()
        shown = f"{fam_name}:{p['tag']}" if not p["digest"] else f"{fam_name}@{digest}"
        base = ref.canonical(image).split("@")[0]
        if not p["digest"]:
            base = base.rsplit(":", 1)[0]
        lines += [f"Digest: {digest}", f"Status: {status} {shown}",
                  f"{base}@{digest}" if p["digest"] else f"{base}:{p['tag']}"]
        return {"lines": lines, "image": existing}

    def remove_image(self, name: str, force: bool) -> list[str]:
        with self.lock:
            img = self.find_image(name)
            if img is None:
                raise ref.DaemonError(f"No such image: {name}", 404)
            users = [c["Id"] for c in self.containers.values() if c["Image"] == img["Id"]]
            if users and not force:
                raise ref.DaemonError(f"conflict: unable to remove repository reference \"{name}\" (must force) - "
                                      f"container {users[0][:12]} is using its referenced image {img['Id'][7:19]}", 409)
            del self.images["images"][img["Id"]]
            self.save()
            return [f"Untagged: {t}" for t in img["RepoTags"] + img["RepoDigests"]] + [f"Deleted: {img['Id']}"]

    # containers
    def find(self, name: str) -> dict[str, Any]:
        name = name.lstrip("/")
        with self.lock:
            for c in self.containers.values():
                if c["Name"] == "/" + name or c["Id"] == name:
                    return c
            matches = [c for c in self.containers.values() if c["Id"].startswith(name)]
            if len(matches) == 1:
                return matches[0]
        raise ref.DaemonError(f"No such container: {name}", 404)

    def create(self, spec: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            img = self.find_image(spec["image"])
            if img is None:
                raise ref.DaemonError(f"No such image: {ref.familiar(spec['image'])}", 404)
            name = spec.get("name") or f"standin_{hashlib.sha256(str(time.time()).encode()).hexdigest()[:8]}"
            if not re.fullmatch(r"[a-zA-Z0-9][a-zA-Z0-9_.-]*", name):
                raise ref.DaemonError(f'Invalid container name ({name}), only [a-zA-Z0-9][a-zA-Z0-9_.-] are allowed', 400)
            for c in self.containers.values():
                if c["Name"] == "/" + name:
                    raise ref.DaemonError(
                        f'Conflict. The container name "/{name}" is already in use by container "{c["Id"]}". '
                        "You have to remove (or rename) that container to be able to reuse that name.", 409)
            runtime = spec.get("runtime") or self.default_runtime
            binds = [{"source": b["source"], "target": b["target"], "read_only": bool(b.get("read_only")),
                      "create_host_path": bool(b.get("create_host_path", True))} for b in spec.get("binds") or []]
            for b in binds:
                if not b["create_host_path"] and not os.path.exists(host_source(b["source"])):
                    raise ref.DaemonError(missing_source(b["source"]), 400)
            cid = hashlib.sha256(f"{name}:{time.time()}:{os.getpid()}".encode()).hexdigest()
            image_cfg = img.get("Config", {})
            env = dict(e.split("=", 1) for e in image_cfg.get("Env", []))
            env.update({k: "" if v is None else str(v) for k, v in (spec.get("env") or {}).items()})
            c = {
                "Id": cid, "Name": "/" + name, "Created": now_iso(), "Image": img["Id"],
                "Path": "", "Args": [], "RestartCount": 0,
                "Config": {
                    "Image": spec["image"], "Hostname": cid[:12],
                    "Cmd": spec["cmd"] if spec.get("cmd") is not None else image_cfg.get("Cmd"),
                    "Entrypoint": spec["entrypoint"] if spec.get("entrypoint") is not None else image_cfg.get("Entrypoint"),
                    "Env": [f"{k}={v}" for k, v in env.items()], "Labels": spec.get("labels") or {},
                    "Healthcheck": spec.get("healthcheck"),
                    "WorkingDir": spec.get("working_dir") or image_cfg.get("WorkingDir") or "",
                },
                "HostConfig": {
                    "Runtime": runtime, "RestartPolicy": restart_policy(spec.get("restart")),
                    "PortBindings": port_bindings(spec.get("ports") or []), "NetworkMode": spec.get("network_mode") or "bridge",
                    "Binds": [f"{b['source']}:{b['target']}{':ro' if b.get('read_only') else ''}" for b in spec.get("binds") or []],
                    "DeviceRequests": [device_request(spec["gpus"])] if spec.get("gpus") else None,
                    "AutoRemove": bool(spec.get("auto_remove")),
                    "IpcMode": spec.get("ipc") or "private", "ShmSize": int(spec.get("shm_size") or 67108864),
                },
                "Mounts": [{"Type": "bind", "Source": b["source"], "Destination": b["target"], "RW": not b.get("read_only")}
                           for b in spec.get("binds") or []],
                "State": {"Status": "created", "Running": False, "Paused": False, "Restarting": False, "OOMKilled": False,
                          "Dead": False, "Pid": 0, "ExitCode": 0, "Error": "", "StartedAt": "0001-01-01T00:00:00Z",
                          "FinishedAt": "0001-01-01T00:00:00Z"},
                "standin": {"ports": spec.get("ports") or [], "gpus_request": spec.get("gpus"),
                            "user_stopped": False, "binds": binds},
            }
            self.containers[cid] = c
            self.save()
            return c

    def gpu_devices(self, c: dict[str, Any]) -> list[dict[str, Any]]:
        """GPUs the container gets, after the checks the real engine and the nvidia hook make."""
        req = c["standin"].get("gpus_request")
        runtime = c["HostConfig"]["Runtime"]
        env = dict(e.split("=", 1) for e in c["Config"]["Env"] if "=" in e)
        if runtime not in self.runtimes:
            raise ref.DaemonError(f"unknown or invalid runtime name: {runtime}", 400)
        if req is None and not (runtime == "nvidia" and env.get("NVIDIA_VISIBLE_DEVICES") not in (None, "", "void", "none")):
            return []
        if req is not None and not (self.hook and "nvidia" in self.runtimes):
            caps = req.get("capabilities") or [["gpu"]]
            raise ref.DaemonError(
                f'could not select device driver "{req.get("driver", "")}" with capabilities: '
                f'[{" ".join("[" + " ".join(cs) + "]" for cs in caps)}]', 500)
        prefix = ("failed to create task for container: failed to create shim task: OCI runtime create failed: "
                  "runc create failed: unable to start container process: error during container init: error running "
                  "prestart hook #0: exit status 1, stdout: , stderr: Auto-detected mode as 'legacy'\n"
                  "nvidia-container-cli: initialization error: ")
        us = common.read_json(common.path("/usr/lib/nvidia-standin/utils/userspace.json"))
        if not us:
            raise ref.DaemonError(prefix + "load library failed: libnvidia-ml.so.1: cannot open shared object file: "
                                  "no such file or directory: unknown", 500)
        loaded = common.loaded_driver_version()
        if loaded is None:
            raise ref.DaemonError(prefix + "nvml error: driver not loaded: unknown", 500)
        if loaded != us.get("version"):
            raise ref.DaemonError(prefix + "nvml error: driver/library version mismatch: unknown", 500)
        gpus = common.hardware().get("gpus", [])
        if req is not None:
            ids = req.get("device_ids") or []
            count = int(req.get("count", 0) or 0)
        else:
            vis = env["NVIDIA_VISIBLE_DEVICES"]
            ids = [] if vis == "all" else vis.split(",")
            count = -1 if vis == "all" else 0
        if ids:
            chosen = [g for g in gpus if str(g["index"]) in ids or g["uuid"] in ids]
            missing = [i for i in ids if i not in {str(g["index"]) for g in gpus} | {g["uuid"] for g in gpus}]
            if missing:
                raise ref.DaemonError(prefix + f"device error: {missing[0]}: unknown device: unknown", 500)
            return chosen
        if count == -1:
            return list(gpus)
        if count > len(gpus):
            raise ref.DaemonError(prefix + "requirement error: unsatisfied condition: cuda>=0, please update your "
                                  f"driver to a newer version, or use an earlier cuda container: unknown (asked for "
                                  f"{count} GPUs, host has {len(gpus)})", 500)
        return list(gpus[:count])

    def start(self, name: str) -> dict[str, Any]:
        with self.lock:
            c = self.find(name)
            if c["State"]["Running"]:
                return c
            gpus = self.gpu_devices(c)
            self._mount_sources(c)
            kind, tokens = classify(c)
            if kind == "nvidia-smi" and not which("nvidia-smi"):
                raise ref.DaemonError('failed to create task for container: failed to create shim task: OCI runtime '
                                      'create failed: runc create failed: unable to start container process: error '
                                      'during container init: exec: "nvidia-smi": executable file not found in $PATH: unknown', 500)
            sockets = self._bind_ports(c)
            try:
                self._spawn(c, kind, tokens, gpus, sockets)
            finally:
                for s in sockets:
                    s.close()
            c["standin"]["user_stopped"] = False
            self.save()
            return c

    @staticmethod
    def _mount_sources(c: dict[str, Any]) -> None:
        """Bind sources at start, as the engine sets them up: a missing one is created as an empty
        directory (short syntax, create_host_path: true) or fails the start (long syntax without it)."""
        binds = c["standin"].get("binds") or [{"source": m["Source"], "target": m["Destination"], "read_only": not m["RW"],
                                               "create_host_path": True} for m in c["Mounts"]]
        for b in binds:
            src = host_source(b["source"])
            if os.path.exists(src):
                continue
            if not b["create_host_path"]:
                raise ref.DaemonError(missing_source(b["source"]), 400)
            try:
                src.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise ref.DaemonError(f'error while creating mount source path \'{b["source"]}\': mkdir {b["source"]}: '
                                      f'{(exc.strerror or str(exc)).lower()}', 500) from None

    def _bind_ports(self, c: dict[str, Any]) -> list[socket.socket]:
        if c["HostConfig"]["NetworkMode"] == "host":
            return []
        out = []
        for p in c["standin"]["ports"]:
            host_ip = p.get("host_ip") or "0.0.0.0"
            port = int(p["host_port"])
            for other in self.containers.values():
                if other is c or not other["State"]["Running"]:
                    continue
                if any(int(q["host_port"]) == port for q in other["standin"]["ports"]):
                    for s in out:
                        s.close()
                    raise ref.DaemonError(
                        f"driver failed programming external connectivity on endpoint {c['Name'][1:]} ({c['Id']}): "
                        f"Bind for {host_ip}:{port} failed: port is already allocated", 500)
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host_ip, port))
                s.listen(64)
            except OSError as exc:
                s.close()
                for o in out:
                    o.close()
                raise ref.DaemonError(
                    f"failed to set up container networking: driver failed programming external connectivity on "
                    f"endpoint {c['Name'][1:]} ({c['Id']}): failed to bind host port for {host_ip}:{port}:"
                    f"172.17.0.2:{p['container_port']}/tcp: {exc.strerror.lower() if exc.strerror else exc}", 500)
            out.append(s)
        return out

    def _spawn(self, c: dict[str, Any], kind: str, tokens: list[str], gpus: list[dict[str, Any]],
               sockets: list[socket.socket]) -> None:
        cdir = self.state_dir / "containers" / c["Id"]
        cdir.mkdir(parents=True, exist_ok=True)
        env = dict(e.split("=", 1) for e in c["Config"]["Env"] if "=" in e)
        proc_env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root",
                    "HOSTNAME": c["Config"]["Hostname"], **env}
        if common.test_mode():
            proc_env[common.ROOT_ENV] = os.environ[common.ROOT_ENV]
        if gpus:
            proc_env["NVIDIA_VISIBLE_DEVICES"] = ",".join(str(g["index"]) for g in gpus)
        log = open(cdir / "container.log", "ab")
        fds: list[int] = []
        ready: int | None = None
        responder_spec = {
            "id": c["Id"], "name": c["Name"][1:], "kind": kind, "image": image_kind(c["Config"]["Image"]),
            "args": vllm_args(tokens),
            "gpus": [g["uuid"] for g in gpus], "network_mode": c["HostConfig"]["NetworkMode"],
            "listen": [{"fd": s.fileno(), "container_port": int(p["container_port"])}
                       for s, p in zip(sockets, c["standin"]["ports"])],
            "binds": c["Mounts"], "status_file": str(cdir / "status.json"), "ctr_socket": str(self.ctr_socket(c["Id"])),
        }
        if kind in ("vllm", "llama"):
            fds = [s.fileno() for s in sockets]
            spec_file = cdir / "spec.json"
            common.write_json_atomic(spec_file, responder_spec, 0o600)
            argv = [sys.executable, str(HERE / "responder.py"), str(spec_file)]
        elif kind == "shell":
            argv, fds, ready = self._shell_init(c, tokens, gpus, sockets, cdir, responder_spec, proc_env)
            proc_env = {k: v for k, v in proc_env.items() if k in ("PATH", common.ROOT_ENV)}
        elif kind == "nvidia-smi":
            argv = [which("nvidia-smi") or "nvidia-smi"] + tokens[1:]
        elif kind == "simple":
            argv = tokens if tokens[0] != "sleep" else ["sleep", "2147483647" if tokens[1:] in ([], ["infinity"]) else tokens[1]]
        else:
            argv = ["sh", "-c", 'echo "rigup stand-in: running $0 in a container is not simulated" >&2; exit 127',
                    " ".join(tokens) or "(image default command)"]
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=proc_env,
                                    pass_fds=fds, start_new_session=True, cwd="/")
        finally:
            log.close()
            if ready is not None:
                os.close(fds[-1])
        if ready is not None:
            failure = self._await_exec(ready, proc)
            if failure:
                c["State"].update({"Status": "exited" if c["State"]["StartedAt"][:4] != "0001" else "created",
                                   "ExitCode": int(failure.get("code", 127)), "Error": failure["error"]})
                raise ref.DaemonError(
                    "failed to create task for container: failed to create shim task: OCI runtime create failed: runc "
                    "create failed: unable to start container process: error during container init: "
                    f"{failure['error']}: unknown", 500)
        self.procs[c["Id"]] = proc
        c["Path"], c["Args"] = (tokens[0], tokens[1:]) if tokens else ("", [])
        c["State"].update({"Status": "running", "Running": True, "Restarting": False, "Pid": proc.pid, "ExitCode": 0,
                           "StartedAt": now_iso(), "FinishedAt": "0001-01-01T00:00:00Z", "Error": ""})
        c["standin"]["started"] = time.time()
        c["standin"]["kind"] = kind
        if c["Config"].get("Healthcheck") and kind in ("vllm", "llama", "shell"):
            c["State"]["Health"] = {"Status": "starting", "FailingStreak": 0, "Log": []}
            threading.Thread(target=self._health_loop, args=(c["Id"], proc), daemon=True).start()
        else:
            c["State"].pop("Health", None)
        threading.Thread(target=self._monitor, args=(c["Id"], proc), daemon=True).start()

    def _shell_init(self, c: dict[str, Any], argv: list[str], gpus: list[dict[str, Any]], sockets: list[socket.socket],
                    cdir: Path, responder_spec: dict[str, Any], env: dict[str, str]) -> tuple[list[str], list[int], int]:
        """container.py --init: the container's own argv in a root assembled from its mounts (see container.py)."""
        common.write_json_atomic(cdir / "spec.json", responder_spec, 0o600)
        ready, ready_w = os.pipe()
        ctr_env = {k: v for k, v in env.items() if k != common.ROOT_ENV}
        # An image pulled before the stand-in recorded WorkingDir gets its kind's.
        workdir = c["Config"].get("WorkingDir") or image_config(c["Config"]["Image"]).get("WorkingDir") or "/"
        spec = {
            "argv": argv, "env": ctr_env, "hostname": c["Config"]["Hostname"], "workdir": workdir,
            "image": image_kind(c["Config"]["Image"]), "gpus": [g["index"] for g in gpus],
            "shm_size": c["HostConfig"].get("ShmSize"), "cdir": str(cdir), "ready_fd": ready_w,
            "nvidia_smi": which("nvidia-smi") if gpus else None,
            "mounts": [{"source": str(host_source(m["Source"])), "target": m["Destination"], "ro": not m["RW"]}
                       for m in c["Mounts"]],
            "host": {"python": sys.executable, "responder": str(HERE / "responder.py"), "spec": str(cdir / "spec.json"),
                     "nvidia_smi": which("nvidia-smi") if gpus else None,
                     "root_env": os.environ.get(common.ROOT_ENV) if common.test_mode() else None},
        }
        common.write_json_atomic(cdir / "init.json", spec, 0o600)
        return ([sys.executable, str(HERE / "container.py"), "--init", str(cdir / "init.json")],
                [s.fileno() for s in sockets] + [ready_w], ready)

    @staticmethod
    def _await_exec(ready: int, proc: subprocess.Popen[bytes]) -> dict[str, Any] | None:
        """What container.py --init reported before its exec (None: the container's process runs)."""
        import select

        data = b""
        deadline = time.monotonic() + 60
        try:
            while time.monotonic() < deadline:
                r, _, _ = select.select([ready], [], [], 0.5)
                if r:
                    chunk = os.read(ready, 65536)
                    if not chunk:
                        break
                    data += chunk
            else:
                os.killpg(proc.pid, signal.SIGKILL)
                data = json.dumps({"error": "rigup stand-in: the container root took over 60 s to assemble"}).encode()
        finally:
            os.close(ready)
        if not data:
            return None
        proc.wait()
        try:
            return json.loads(data)
        except ValueError:
            return {"error": data.decode(errors="replace"), "code": 126}

    def _monitor(self, cid: str, proc: subprocess.Popen[bytes]) -> None:
        code = proc.wait()
        if self.containers.get(cid, {}).get("standin", {}).get("kind") == "shell":
            try:  # what the script left running in the background dies with it, as in its PID namespace
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        with self.lock:
            c = self.containers.get(cid)
            if c is None or self.procs.get(cid) is not proc:
                return
            del self.procs[cid]
            c["State"].update({"Status": "exited", "Running": False, "Pid": 0, "ExitCode": code if code >= 0 else 128 - code,
                               "FinishedAt": now_iso()})
            if "Health" in c["State"]:
                c["State"]["Health"]["Status"] = "unhealthy"
            policy = c["HostConfig"]["RestartPolicy"]
            restart = (not self.shutting_down and cid not in self.stop_requested and (
                policy["Name"] in ("always", "unless-stopped")
                or (policy["Name"] == "on-failure" and c["State"]["ExitCode"] != 0
                    and (not policy["MaximumRetryCount"] or c["RestartCount"] < policy["MaximumRetryCount"]))))
            self.stop_requested.discard(cid)
            if c["HostConfig"]["AutoRemove"] and not restart:
                c["standin"]["removed_at_exit"] = True
            if restart:
                c["State"].update({"Status": "restarting", "Restarting": True})
            self.save()
        if restart:
            delay = min(60.0, 0.1 * (2 ** min(c["RestartCount"], 10)))
            time.sleep(delay)
            with self.lock:
                if self.shutting_down or cid not in self.containers or self.containers[cid]["State"]["Running"]:
                    return
                if cid in self.stop_requested:
                    self.stop_requested.discard(cid)
                    self.containers[cid]["State"].update({"Status": "exited", "Restarting": False})
                    self.save()
                    return
                c["RestartCount"] += 1
                try:
                    self.start(cid)
                except ref.DaemonError as exc:
                    c["State"].update({"Status": "exited", "Restarting": False, "Error": str(exc)})
                    self.save()

    def _health_loop(self, cid: str, proc: subprocess.Popen[bytes]) -> None:
        c = self.containers[cid]
        hc = c["Config"]["Healthcheck"] or {}
        interval = duration(hc.get("interval"), 30.0)
        timeout = duration(hc.get("timeout"), 30.0)
        retries = int(hc.get("retries") or 3)
        start_period = duration(hc.get("start_period"), 0.0)
        start_interval = duration(hc.get("start_interval"), 5.0)
        path = health_path(hc.get("test") or [])
        started = time.monotonic()
        sock = str(self.ctr_socket(cid))
        while proc.poll() is None and not self.shutting_down:
            in_start = time.monotonic() - started < start_period
            time.sleep(start_interval if in_start else interval)
            if proc.poll() is not None:
                return
            ok, output = probe(sock, path, timeout)
            with self.lock:
                h = c["State"].get("Health")
                if h is None or self.procs.get(cid) is not proc:
                    return
                h["Log"] = (h["Log"] + [{"Start": now_iso(), "End": now_iso(), "ExitCode": 0 if ok else 1,
                                          "Output": output}])[-5:]
                if ok:
                    h["Status"], h["FailingStreak"] = "healthy", 0
                elif not in_start:
                    h["FailingStreak"] += 1
                    if h["FailingStreak"] >= retries:
                        h["Status"] = "unhealthy"

    def stop(self, name: str, timeout: float = 10.0, user: bool = True) -> dict[str, Any]:
        with self.lock:
            c = self.find(name)
            proc = self.procs.get(c["Id"])
            if user:
                c["standin"]["user_stopped"] = True
            if proc is None:
                if c["State"]["Restarting"]:
                    self.stop_requested.add(c["Id"])
                    c["State"].update({"Status": "exited", "Restarting": False})
                    self.save()
                return c
            self.stop_requested.add(c["Id"])
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for _ in range(100):  # let the monitor thread record the exit
            with self.lock:
                if not c["State"]["Running"]:
                    break
            time.sleep(0.02)
        self.save()
        return c

    def remove(self, name: str, force: bool) -> None:
        c = self.find(name)
        if c["State"]["Running"]:
            if not force:
                raise ref.DaemonError(f"cannot remove container \"{c['Name']}\": container is running: stop the "
                                      "container before removing or force remove", 409)
            self.stop(name, timeout=0.5)
        with self.lock:
            self.containers.pop(c["Id"], None)
            cdir = self.state_dir / "containers" / c["Id"]
            # A container root is only mounted in its own namespace; never recurse into one seen from here.
            if not os.path.ismount(cdir / "rootfs"):
                shutil.rmtree(cdir, ignore_errors=True)
            self.save()

    def wait(self, name: str) -> int:
        c = self.find(name)
        while True:
            with self.lock:
                if not c["State"]["Running"] and not c["State"]["Restarting"]:
                    return int(c["State"]["ExitCode"])
            time.sleep(0.05)

    def logs(self, name: str, tail: int | None) -> str:
        c = self.find(name)
        try:
            text = (self.state_dir / "containers" / c["Id"] / "container.log").read_text(errors="replace")
        except OSError:
            return ""
        if tail is not None and tail >= 0:
            lines = text.splitlines(keepends=True)
            text = "".join(lines[-tail:] if tail else [])
        return text

    def summary(self, c: dict[str, Any]) -> dict[str, Any]:
        img = self.images["images"].get(c["Image"], {})
        return {
            "Id": c["Id"], "Names": [c["Name"]], "Image": c["Config"]["Image"], "ImageID": c["Image"],
            "Command": " ".join((c["Config"].get("Entrypoint") or []) + (c["Config"].get("Cmd") or [])),
            "Created": c["Created"], "State": c["State"]["Status"], "Status": status_text(c),
            "Ports": c["standin"]["ports"], "Labels": c["Config"]["Labels"], "Health": c["State"].get("Health", {}).get("Status", ""),
            "ExitCode": c["State"]["ExitCode"], "Mounts": c["Mounts"], "RepoTags": img.get("RepoTags", []),
        }

    def info(self) -> dict[str, Any]:
        m = meta()
        running = sum(1 for c in self.containers.values() if c["State"]["Running"])
        total = len(self.containers)
        os_release = {}
        try:
            for line in common.path("/etc/os-release").read_text().splitlines():
                k, _, v = line.partition("=")
                os_release[k] = v.strip('"')
        except OSError:
            pass
        mirrors = self.config.get("registry-mirrors", [])
        return {
            "ID": self.id, "Containers": total, "ContainersRunning": running, "ContainersPaused": 0,
            "ContainersStopped": total - running, "Images": len(self.images["images"]), "Driver": "overlay2",
            "DriverStatus": [["Backing Filesystem", "extfs"], ["Supports d_type", "true"], ["Using metacopy", "false"],
                             ["Native Overlay Diff", "true"], ["userxattr", "false"]],
            "Plugins": {"Volume": ["local"], "Network": ["bridge", "host", "ipvlan", "macvlan", "null", "overlay"],
                        "Authorization": None,
                        "Log": ["awslogs", "fluentd", "gcplogs", "gelf", "journald", "json-file", "local", "splunk", "syslog"]},
            "MemoryLimit": True, "SwapLimit": True, "CpuCfsPeriod": True, "CpuCfsQuota": True, "CPUShares": True,
            "CPUSet": True, "PidsLimit": True, "IPv4Forwarding": True, "Debug": bool(self.config.get("debug")),
            "NFd": 30, "OomKillDisable": False, "NGoroutines": 50, "SystemTime": now_iso(),
            "LoggingDriver": self.config.get("log-driver", "json-file"), "CgroupDriver": "systemd", "CgroupVersion": "2",
            "NEventsListener": 0, "KernelVersion": os.uname().release,
            "OperatingSystem": os_release.get("PRETTY_NAME", "Linux"), "OSVersion": os_release.get("VERSION_ID", ""),
            "OSType": "linux", "Architecture": os.uname().machine, "IndexServerAddress": "https://index.docker.io/v1/",
            "RegistryConfig": {"InsecureRegistryCIDRs": ["::1/128", "127.0.0.0/8"], "IndexConfigs": {},
                               "Mirrors": mirrors},
            "NCPU": os.cpu_count() or 1, "MemTotal": _mem_total(), "GenericResources": None,
            "DockerRootDir": self.config.get("data-root", "/var/lib/docker"), "HttpProxy": "", "HttpsProxy": "",
            "NoProxy": "", "Name": socket.gethostname(), "Labels": self.config.get("labels", []),
            "ExperimentalBuild": bool(self.config.get("experimental")), "ServerVersion": m.get("version", "28.5.2"),
            "Runtimes": self.runtimes, "DefaultRuntime": self.default_runtime,
            "Swarm": {"NodeID": "", "NodeAddr": "", "LocalNodeState": "inactive", "ControlAvailable": False,
                      "Error": "", "RemoteManagers": None},
            "LiveRestoreEnabled": bool(self.config.get("live-restore")), "Isolation": "", "InitBinary": "docker-init",
            "ContainerdCommit": {"ID": m.get("containerd_commit", "")}, "RuncCommit": {"ID": "v1.3.0-0-g4ca628d1"},
            "InitCommit": {"ID": "de40ad0"}, "SecurityOptions": ["name=seccomp,profile=builtin", "name=cgroupns"],
            "CDISpecDirs": self.config.get("cdi-spec-dirs", ["/etc/cdi", "/var/run/cdi"]),
            "Warnings": None,
            "standin": {"nvidia_device_driver": bool(self.hook and "nvidia" in self.runtimes),
                        "config_loaded_at": self.started},
        }

    def version(self) -> dict[str, Any]:
        m = meta()
        return {
            "Platform": {"Name": "Docker Engine - Community"},
            "Components": [
                {"Name": "Engine", "Version": m.get("version", "28.5.2"),
                 "Details": {"ApiVersion": m.get("api", "1.51"), "Arch": "amd64", "BuildTime": m.get("build_time", ""),
                             "Experimental": "false", "GitCommit": m.get("git_commit", ""), "GoVersion": m.get("go", ""),
                             "KernelVersion": os.uname().release, "MinAPIVersion": "1.24", "Os": "linux"}},
                {"Name": "containerd", "Version": m.get("containerd", "1.7.28"),
                 "Details": {"GitCommit": m.get("containerd_commit", "")}},
                {"Name": "runc", "Version": "1.3.0", "Details": {"GitCommit": "v1.3.0-0-g4ca628d1"}},
                {"Name": "docker-init", "Version": "0.19.0", "Details": {"GitCommit": "de40ad0"}},
            ],
            "Version": m.get("version", "28.5.2"), "ApiVersion": m.get("api", "1.51"), "MinAPIVersion": "1.24",
            "GitCommit": m.get("git_commit", ""), "GoVersion": m.get("go", ""), "Os": "linux", "Arch": "amd64",
            "KernelVersion": os.uname().release, "BuildTime": m.get("build_time", ""),
        }

    def boot_containers(self) -> None:
        """At daemon start nothing runs; restart what the restart policy says should come back."""
        with self.lock:
            for cid, c in list(self.containers.items()):
                if c["standin"].get("removed_at_exit"):
                    del self.containers[cid]
                    continue
                was_running = c["State"]["Running"] or c["State"]["Restarting"]
                if was_running:
                    c["State"].update({"Status": "exited", "Running": False, "Restarting": False, "Pid": 0,
                                       "ExitCode": 255 if not c["standin"].get("clean_shutdown") else c["State"]["ExitCode"],
                                       "FinishedAt": now_iso()})
                c["standin"].pop("clean_shutdown", None)
            self.save()
            for cid, c in list(self.containers.items()):
                policy = c["HostConfig"]["RestartPolicy"]["Name"]
                if policy == "always" or (policy == "unless-stopped" and not c["standin"]["user_stopped"]):
                    try:
                        self.start(cid)
                    except ref.DaemonError as exc:
                        c["State"]["Error"] = str(exc)
                        self.save()

    def shutdown(self) -> None:
        with self.lock:
            self.shutting_down = True
            running = [cid for cid in self.procs]
        for cid in running:
            with self.lock:
                self.containers[cid]["standin"]["clean_shutdown"] = True
            try:
                self.stop(cid, timeout=10, user=False)
            except ref.DaemonError:
                pass
        with self.lock:
            for c in self.containers.values():
                if c["State"]["Running"]:
                    c["State"]["Running"] = False
            self.save()


def _mem_total() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def device_request(gpus: dict[str, Any]) -> dict[str, Any]:
    """A GPU request as `docker inspect` shows it (HostConfig.DeviceRequests: Docker's field names)."""
    return {"Driver": gpus.get("driver", ""), "Count": int(gpus.get("count") or 0),
            "DeviceIDs": list(gpus.get("device_ids") or []) or None, "Capabilities": gpus.get("capabilities"),
            "Options": {}}


def restart_policy(value: str | None) -> dict[str, Any]:
    name, _, count = (value or "no").partition(":")
    if name not in ("no", "always", "unless-stopped", "on-failure"):
        raise ref.DaemonError(f"invalid restart policy '{name}'", 400)
    return {"Name": name, "MaximumRetryCount": int(count or 0)}


def port_bindings(ports: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for p in ports:
        out.setdefault(f"{p['container_port']}/{p.get('proto', 'tcp')}", []).append(
            {"HostIp": p.get("host_ip") or "", "HostPort": str(p["host_port"])})
    return out


def duration(value: Any, default: float) -> float:
    """Compose/Docker durations: '30s', '1m30s', '500ms', nanoseconds as int."""
    if value in (None, "", 0):
        return default
    if isinstance(value, (int, float)):
        return float(value) / 1e9
    total = 0.0
    for num, unit in re.findall(r"([\d.]+)(ms|us|ns|h|m|s)", str(value)):
        total += float(num) * {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}[unit]
    return total or default


def health_path(test: list[str] | str) -> str:
    text = " ".join(test) if isinstance(test, list) else str(test)
    m = re.search(r"https?://[^/\s]+(/[^\s'\"]*)", text)
    return m.group(1) if m else "/health"


def probe(sock_path: str, path: str, timeout: float) -> tuple[bool, str]:
    """GET `path` from inside the container (the responder's container-side socket)."""
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(timeout)
        s.connect(sock_path)
        s.sendall(f"GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n".encode())
        data = b""
        while True:
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
        s.close()
        status = data.split(b" ", 2)[1] if data.startswith(b"HTTP/") else b"000"
        return status == b"200", f"HTTP {status.decode()}"
    except OSError as exc:
        return False, f"curl: (7) Failed to connect to localhost: {exc}"


def status_text(c: dict[str, Any]) -> str:
    st = c["State"]
    if st["Restarting"]:
        return f"Restarting ({st['ExitCode']}) Less than a second ago"
    if st["Running"]:
        age = human_age(time.time() - c["standin"].get("started", time.time()))
        health = c["State"].get("Health", {}).get("Status")
        suffix = {"starting": " (health: starting)", "healthy": " (healthy)", "unhealthy": " (unhealthy)"}.get(health or "", "")
        return f"Up {age}{suffix}"
    if st["Status"] == "created":
        return "Created"
    return f"Exited ({st['ExitCode']}) {human_age(time.time() - _parse_iso(st['FinishedAt']))} ago"


def _parse_iso(text: str) -> float:
    try:
        return time.mktime(time.strptime(text[:19], "%Y-%m-%dT%H:%M:%S")) - time.timezone
    except ValueError:
        return time.time()


def human_age(seconds: float) -> str:
    if seconds < 1:
        return "Less than a second"
    if seconds < 60:
        return f"{int(seconds)} seconds" if int(seconds) != 1 else "1 second"
    if seconds < 3600:
        return f"{int(seconds // 60)} minutes" if int(seconds // 60) != 1 else "About a minute"
    return f"{int(seconds // 3600)} hours" if int(seconds // 3600) != 1 else "About an hour"


CUDA_PATH = "/usr/local/nvidia/bin:/usr/local/cuda/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
VLLM_ENV = [f"PATH={CUDA_PATH}", "NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_DRIVER_CAPABILITIES=compute,utility",
            "VLLM_USAGE_SOURCE=production-docker-image"]


def image_config(name: str) -> dict[str, Any]:
    """Image config (entrypoint/cmd/workdir/env) of well-known images, per image kind as the real images are
    built; others get a plain shell."""
    kind = image_kind(name)
    if kind == "vllm":  # vllm/vllm-openai: ENTRYPOINT ["vllm", "serve"], WORKDIR /vllm-workspace
        return {"Entrypoint": ["vllm", "serve"], "Cmd": None, "WorkingDir": "/vllm-workspace", "Env": list(VLLM_ENV),
                "Labels": {}}
    if kind == "vllm-omni":
        # vLLM-Omni's image has no entrypoint: a compose's command is the whole `vllm serve MODEL --omni ...`
        # (club-3090 models/qwen3-omni-30b-a3b/vllm-omni/compose/dual/autoround-int4/omni.yml@4a29ab57;
        # vllm-project/vllm-omni docker/Dockerfile.cuda@11a683cf: FROM vllm/vllm-openai, WORKDIR /app,
        # ENTRYPOINT [] which clears the base image's CMD as well).
        return {"Entrypoint": None, "Cmd": None, "WorkingDir": "/app", "Env": list(VLLM_ENV), "Labels": {}}
    if kind == "lmcache":
        # LMCache's vLLM image (LMCache/LMCache docker/Dockerfile@ab6cf272): vLLM and LMCache in /opt/venv,
        # WORKDIR /workspace, ENTRYPOINT ["/opt/venv/bin/vllm", "serve"]; the venv's bin is on PATH (upstream
        # entrypoints run `lmcache server` and `vllm serve` by name).
        return {"Entrypoint": ["/opt/venv/bin/vllm", "serve"], "Cmd": None, "WorkingDir": "/workspace",
                "Env": [f"PATH=/opt/venv/bin:{CUDA_PATH}", *VLLM_ENV[1:]], "Labels": {}}
    if kind == "cuda":
        return {"Entrypoint": ["/opt/nvidia/nvidia_entrypoint.sh"], "Cmd": ["/bin/bash"],
                "Env": ["PATH=/usr/local/nvidia/bin:/usr/local/cuda/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                        "NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_DRIVER_CAPABILITIES=compute,utility"], "Labels": {}}
    if kind == "llama":
        return {"Entrypoint": ["/app/llama-server"], "Cmd": None, "Env": ["LLAMA_ARG_HOST=0.0.0.0"], "Labels": {}}
    return {"Entrypoint": None, "Cmd": ["/bin/sh"], "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
            "Labels": {}}


# --- server --------------------------------------------------------------------------------------


class Handler(http.server.BaseHTTPRequestHandler):
    server: "Server"
    protocol_version = "HTTP/1.0"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - base class signature
        pass

    def address_string(self) -> str:
        return "unix"

    def _reply(self, status: int, data: Any) -> None:
        body = json.dumps(data).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802
        if self.path.startswith("/_ping"):
            self._reply(200, "OK")
        else:
            self._reply(404, {"message": "page not found"})

    def do_POST(self) -> None:  # noqa: N802
        method = urllib.parse.urlparse(self.path).path.removeprefix("/rpc/")
        length = int(self.headers.get("Content-Length") or 0)
        try:
            params = json.loads(self.rfile.read(length) or b"{}")
            self._reply(200, dispatch(self.server.engine, method, params))
        except ref.DaemonError as exc:
            self._reply(exc.status, {"message": str(exc)})
        except Exception as exc:  # a bug in the stand-in must surface, not hang the client
            self._reply(500, {"message": f"rigup stand-in dockerd: {type(exc).__name__}: {exc}"})


class Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    engine: Engine


def dispatch(e: Engine, method: str, p: dict[str, Any]) -> Any:
    if method == "ping":
        return "OK"
    if method == "info":
        return e.info()
    if method == "version":
        return e.version()
    if method == "images":
        return list(e.images["images"].values())
    if method == "image_inspect":
        img = e.find_image(p["ref"])
        if img is None:
            raise ref.DaemonError(f"No such image: {p['ref']}", 404)
        return img
    if method == "pull":
        return e.pull(p["ref"])
    if method == "image_remove":
        return e.remove_image(p["ref"], bool(p.get("force")))
    if method == "containers":
        with e.lock:
            items = [e.summary(c) for c in e.containers.values() if p.get("all") or c["State"]["Running"]
                     or c["State"]["Restarting"]]
        return sorted(items, key=lambda s: s["Created"], reverse=True)
    if method == "inspect":
        with e.lock:
            return json.loads(json.dumps({k: v for k, v in e.find(p["name"]).items() if k != "standin"}))
    if method == "create":
        return {"Id": e.create(p["spec"])["Id"], "Warnings": []}
    if method == "start":
        e.start(p["name"])
        return {}
    if method == "stop":
        e.stop(p["name"], float(p.get("timeout", 10)))
        return {}
    if method == "remove":
        e.remove(p["name"], bool(p.get("force")))
        return {}
    if method == "wait":
        return {"StatusCode": e.wait(p["name"])}
    if method == "logs":
        return {"text": e.logs(p["name"], p.get("tail"))}
    raise ref.DaemonError(f"unknown method {method}", 404)


def sd_notify(message: str) -> None:
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.connect(addr)
        s.sendall(message.encode())


def listen_socket(hosts: list[str], config: dict[str, Any]) -> socket.socket:
    hosts = hosts or config.get("hosts") or ["unix:///var/run/docker.sock"]
    host = hosts[0]
    if host.startswith("fd://"):
        if os.environ.get("LISTEN_PID") == str(os.getpid()) and int(os.environ.get("LISTEN_FDS", "0")) >= 1:
            return socket.socket(fileno=3)
        raise ConfigError("failed to load listeners: no sockets found via socket activation: make sure the service "
                          "was started by systemd")
    if not host.startswith("unix://"):
        raise ConfigError(f"the rigup stand-in dockerd only listens on unix sockets, not {host}")
    path = common.path(host[len("unix://"):])
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() or path.is_symlink():
        path.unlink()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    os.chmod(path, 0o660)
    try:
        import grp

        os.chown(path, 0, grp.getgrnam(config.get("group", "docker")).gr_gid)
    except (KeyError, PermissionError):
        pass
    s.listen(64)
    return s


def main(argv: list[str]) -> int:
    common.log_call(LOG, "dockerd", argv)
    hosts: list[str] = []
    config_file = common.path(DEFAULT_CONFIG)
    i = 0
    while i < len(argv):
        a = argv[i]
        name, eq, value = a.partition("=")
        if name in ("-H", "--host", "--config-file", "--containerd", "--data-root", "--log-level", "-l"):
            if not eq:
                i += 1
                value = argv[i] if i < len(argv) else ""
            if name in ("-H", "--host"):
                hosts.append(value)
            elif name == "--config-file":
                config_file = Path(value)
        elif a in ("-v", "--version"):
            m = meta()
            print(f"Docker version {m.get('version', '28.5.2')}, build {m.get('git_commit', '')[:7]}")
            return 0
        elif a in ("-D", "--debug", "--validate"):
            if a == "--validate":
                try:
                    load_config(config_file, hosts)
                except ConfigError as exc:
                    print(exc, file=sys.stderr)
                    return 1
                print("configuration OK")
                return 0
        else:
            print(f'unknown flag: {a}', file=sys.stderr)
            return 125
        i += 1
    try:
        config = load_config(config_file, hosts)
        listener = listen_socket(hosts, config)
    except (ConfigError, OSError) as exc:
        print(exc, file=sys.stderr)
        return 1
    engine = Engine(config, hook=which("nvidia-container-runtime-hook") is not None)
    run_dir = common.path(RUN_DIR)
    run_dir.mkdir(parents=True, exist_ok=True)
    common.write_json_atomic(run_dir / "loaded-config.json", {"config": config, "runtimes": engine.runtimes,
                                                             "pid": os.getpid(), "boot_id": common.boot_id()})
    common.write_text_atomic(common.path("/var/run/docker.pid"), f"{os.getpid()}")
    server = Server(listener.getsockname() or "fd", Handler, bind_and_activate=False)
    server.socket.close()
    server.socket = listener
    server.engine = engine
    engine.boot_containers()

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True).start()
    print(f"API listen on {hosts[0] if hosts else '/var/run/docker.sock'}", file=sys.stderr)
    sd_notify("READY=1")
    stop.wait()
    sd_notify("STOPPING=1")
    print("Processing signal 'terminated'", file=sys.stderr)
    engine.shutdown()
    server.shutdown()
    try:
        common.path("/var/run/docker.pid").unlink()
    except OSError:
        pass
    print("Daemon shutdown complete", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
