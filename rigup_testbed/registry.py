"""The real container registry of the hub (Debian's `docker-registry`, the distribution registry 2.8),
holding images the test bed builds itself.

    python -m rigup_testbed.registry --root DIR --bind IP --port N --ready-file F

starts `docker-registry serve` with its storage under DIR, waits until `/v2/` answers, pushes the test
bed's images through the Registry HTTP API v2 (the same calls `docker push` makes: a blob upload per
layer and config, then the manifest), writes the ready file
({"url": "IP:N", "images": {"repo:tag": "sha256:..."}}) and stops the registry on SIGTERM.

The images are real: a gzip'd tar layer, an image config and a schema-2 manifest, so the digests are the
SHA-256 of what the registry serves and a pull by digest is checked by the engine that pulls it. They are
built from files of this machine, byte for byte the same on every run (fixed mtimes, owners and order),
so their digests are stable too:

  rigup-testbed/busybox:1.35   Debian's static busybox with its applet links; entrypoint none, cmd ["sh"]
  vllm/vllm-openai:<tag>       for every tag the catalog names: vLLM's image layout (entrypoint `vllm
                               serve`, workdir /vllm-workspace, /usr/local/lib/python3.12/dist-packages/vllm)
                               with a Python runtime and, as `vllm`, the stand-in server
                               (standins/vllm_entry.py -> responder.py); and under rigup-testbed-rebuilt
                               the same image built again (another digest: a pin that moves)
  vllm/vllm-omni:<tag>         the same for vLLM-Omni (no entrypoint, workdir /app): its server speaks as
                               vLLM-Omni's does (the image kind in image.json)
  nvidia/cuda:<tag>            the GPU smoke image group_data names (gpu_smoke_image): a shell and a Python
                               runtime; nvidia-smi comes from the container toolkit's hook at start, as the
                               real one's does (the stand-in nvidia-smi is Python, hence the runtime)
  nvidia/k8s/dcgm-exporter:<dcgm>-<exporter>-ubuntu22.04
                               NVIDIA's DCGM exporter (nvcr.io), at upstream's current release and at the tag
                               group_data's gpu_exporter_image names: the real image's entrypoint script,
                               environment and /etc/dcgm-exporter/default-counters.csv, with
                               standins/dcgm_exporter.py as /usr/bin/dcgm-exporter on the Python runtime; it
                               reads the GPUs the toolkit's hook hands the container (FACTS.md section 12)

The Python runtime is the rigs' own Debian 3.11 (from the test bed's root image, --python-root): the
interpreter, its standard library and the shared libraries they load. The GPU and vLLM stay simulated;
the image, its layers, entrypoint and mounts are the engine's to handle.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import hashlib
import http.client
import io
import json
import os
import shutil
import subprocess
import tarfile
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

from rigup.desired.catalog import load_catalog
from rigup.desired.knobs import load_defaults
from rigup_testbed.image import cache_dir
from rigup_testbed.service import run_service
from rigup_testbed.standin_modules import load_standin

BINARY = "/usr/bin/docker-registry"
BUSYBOX = "/bin/busybox"  # Debian's busybox-static
BUSYBOX_APPLETS = ("sh", "cat", "echo", "sleep", "ls", "mkdir", "touch", "id", "kill", "test", "true", "false", "env")
LAYER_TYPE = "application/vnd.docker.image.rootfs.diff.tar.gzip"
CONFIG_TYPE = "application/vnd.docker.container.image.v1+json"
MANIFEST_TYPE = "application/vnd.docker.distribution.manifest.v2+json"
EPOCH = 1759190400  # 2025-09-30, the file times inside every layer


@dataclass(frozen=True)
class Image:
    """One single-layer image: the bytes a push sends."""

    repository: str
    tag: str
    layer: bytes  # gzip'd tar
    config: bytes
    manifest: bytes

    @property
    def digest(self) -> str:
        return "sha256:" + hashlib.sha256(self.manifest).hexdigest()


def _digest(blob: bytes) -> str:
    return "sha256:" + hashlib.sha256(blob).hexdigest()


def _compressed(diff: bytes) -> bytes:
    """gzip of a layer, kept in the test bed's cache by the layer's digest (a 37 MB layer takes seconds)."""
    cached = cache_dir() / "engine-layers" / (hashlib.sha256(diff).hexdigest() + ".tar.gz")
    if cached.is_file():
        return cached.read_bytes()
    layer = gzip.compress(diff, compresslevel=6, mtime=0)
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_bytes(layer)
    os.replace(tmp, cached)
    return layer


def build_image(repository: str, tag: str, files: dict[str, tuple[bytes, int]], links: dict[str, str],
                config: dict[str, object]) -> Image:
    """An image of one layer holding `files` (path -> (content, mode)) and `links` (path -> target)."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        dirs = sorted({str(Path(p).parent).lstrip("/") for p in [*files, *links]} - {""})
        for d in sorted({"/".join(part.split("/")[: i + 1]) for part in dirs for i in range(part.count("/") + 1)}):
            info = tarfile.TarInfo(d)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, EPOCH
            tar.addfile(info)
        for path, (content, mode) in sorted(files.items()):
            info = tarfile.TarInfo(path.lstrip("/"))
            info.size, info.mode, info.mtime = len(content), mode, EPOCH
            tar.addfile(info, io.BytesIO(content))
        for path, target in sorted(links.items()):
            info = tarfile.TarInfo(path.lstrip("/"))
            info.type, info.linkname, info.mode, info.mtime = tarfile.SYMTYPE, target, 0o777, EPOCH
            tar.addfile(info)
    diff = raw.getvalue()
    return _assemble(repository, tag, _compressed(diff), _digest(diff), config)


def _assemble(repository: str, tag: str, layer: bytes, diff_id: str, config: dict[str, object]) -> Image:
    """The image config and manifest around one layer (`diff_id`: the digest of its uncompressed tar)."""
    image_config = {
        "architecture": "amd64",
        "os": "linux",
        "created": "2025-09-30T00:00:00Z",
        "config": config,
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        "history": [{"created": "2025-09-30T00:00:00Z", "created_by": "rigup test bed (rigup_testbed/registry.py)"}],
    }
    config_blob = json.dumps(image_config, sort_keys=True).encode()
    manifest = json.dumps({
        "schemaVersion": 2,
        "mediaType": MANIFEST_TYPE,
        "config": {"mediaType": CONFIG_TYPE, "size": len(config_blob), "digest": _digest(config_blob)},
        "layers": [{"mediaType": LAYER_TYPE, "size": len(layer), "digest": _digest(layer)}],
    }, indent=3).encode()
    return Image(repository, tag, layer, config_blob, manifest)


def rebuilt(image: Image, tag: str, labels: dict[str, str]) -> Image:
    """`image` built again: the same layer, a config with `labels` (so another digest), under `tag`."""
    config = json.loads(image.config)
    return _assemble(image.repository, tag, image.layer, config["rootfs"]["diff_ids"][0],
                     {**config["config"], "Labels": labels})


def busybox_image() -> Image:
    busybox = Path(BUSYBOX)
    if not busybox.is_file():
        raise FileNotFoundError(f"{BUSYBOX} is missing: install Debian's busybox-static (scripts/setup does)")
    return build_image(
        "rigup-testbed/busybox", "1.35",
        {"/bin/busybox": (busybox.read_bytes(), 0o755), "/etc/passwd": (b"root:x:0:0:root:/root:/bin/sh\n", 0o644),
         "/etc/group": (b"root:x:0:\n", 0o644)},
        {f"/bin/{applet}": "busybox" for applet in BUSYBOX_APPLETS},
        {"Cmd": ["sh"], "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]},
    )


STANDIN_DIR = Path(__file__).resolve().parent / "standins"
RICH_RESPONDER = Path(__file__).resolve().parent / "openai_responder.py"
PYTHON = "python3.11"
STDLIB_SKIPPED = ("test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "pydoc_data", "__pycache__",
                  "distutils", "unittest", "site-packages", "dist-packages")
LIB_DIRS = ("lib/x86_64-linux-gnu", "usr/lib/x86_64-linux-gnu")
DLOPENED_LIBS = ("libgcc_s.so.1",)
BASE_ENV = ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8"]
SMOKE_IMAGE_ENV = ["NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_DRIVER_CAPABILITIES=compute,utility"]  # as nvidia/cuda sets


def _needed(path: Path) -> list[str]:
    out = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True).stdout
    return [line.split("[", 1)[1].split("]", 1)[0] for line in out.splitlines() if "(NEEDED)" in line]


def python_runtime(root: Path) -> tuple[dict[str, tuple[bytes, int]], dict[str, str]]:
    """The rigs' Python (from the test bed's Debian root `root`), bash and busybox's utilities, with the
    shared libraries they load: files and links of an image layer."""
    files: dict[str, tuple[bytes, int]] = {}
    links: dict[str, str] = {"/usr/bin/python3": PYTHON, "/usr/bin/python": PYTHON, "/bin/sh": "bash",
                             "/lib64/ld-linux-x86-64.so.2": "/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2"}
    stdlib = root / "usr/lib" / PYTHON
    for path in sorted(stdlib.rglob("*")):
        rel = path.relative_to(root)
        if any(part in STDLIB_SKIPPED for part in rel.parts) or path.is_dir() or path.name.startswith("_test"):
            continue
        if path.is_symlink():
            links["/" + str(rel)] = os.readlink(path)
        else:
            files["/" + str(rel)] = (path.read_bytes(), 0o644)
    elves = [root / "usr/bin" / PYTHON, root / "bin/bash"] + [root / p.lstrip("/") for p in files if p.endswith(".so")]
    for elf in elves:
        files["/" + str(elf.relative_to(root))] = (elf.read_bytes(), 0o755)
    # glibc dlopens libgcc_s at pthread_exit (a server's threads ending at shutdown): no ELF names it, and
    # without it the process aborts ("libgcc_s.so.1 must be installed for pthread_exit to work", exit 139)
    todo = [name for elf in elves for name in _needed(elf)] + list(DLOPENED_LIBS)
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        found = next((root / d / name for d in LIB_DIRS if (root / d / name).exists()), None)
        if found is None:
            raise FileNotFoundError(f"{name}: not in {root}'s {' or '.join(LIB_DIRS)}")
        real = found.resolve()
        files[f"/lib/x86_64-linux-gnu/{name}"] = (real.read_bytes(), 0o755)
        todo += _needed(real)
    busybox = Path(BUSYBOX).read_bytes()
    files["/usr/lib/busybox/busybox"] = (busybox, 0o755)
    for applet in ("cat", "ls", "sleep", "echo", "mkdir", "rm", "cp", "mv", "ln", "grep", "sed", "awk", "head", "tail", "tr",
                   "cut", "env", "kill", "ps", "true", "false", "test", "[", "printf", "touch", "wc", "sort", "uniq", "find",
                   "xargs", "tee", "dirname", "basename", "chmod", "id", "date"):
        links.setdefault(f"/usr/bin/{applet}", "/usr/lib/busybox/busybox")
    files["/etc/passwd"] = (b"root:x:0:0:root:/root:/bin/bash\n", 0o644)
    files["/etc/group"] = (b"root:x:0:\n", 0o644)
    return files, links


REBUILT_TAG = "rigup-testbed-rebuilt"  # the vLLM image built again: another digest of the same repository


# The vLLM image kinds the registry builds (standins/dockerd.image_config cites each one's upstream
# Dockerfile): repository and image config. vLLM-Omni's image is built FROM vllm/vllm-openai with
# WORKDIR /app and ENTRYPOINT [] (vllm-project/vllm-omni docker/Dockerfile.cuda@11a683cf): a compose's
# command is the whole `vllm serve MODEL --omni ...`. LMCache's image is not built: the catalog pins it by
# upstream's digest, which no image built here can have (tests/e2e/test_recipes.py serves it on the
# stand-in engine).
VLLM_KINDS = {
    "vllm": ("vllm/vllm-openai", {"Entrypoint": ["vllm", "serve"], "WorkingDir": "/vllm-workspace"}),
    "vllm-omni": ("vllm/vllm-omni", {"Entrypoint": None, "WorkingDir": "/app"}),
}


def vllm_image(runtime: tuple[dict[str, tuple[bytes, int]], dict[str, str]], tag: str, kind: str = "vllm") -> Image:
    """A vLLM image of `kind` (VLLM_KINDS) whose `vllm` is the stand-in server on the rigs' Python."""
    repository, config = VLLM_KINDS[kind]
    files, links = dict(runtime[0]), dict(runtime[1])
    lib = "/usr/lib/rigup-standin"
    for module in ("common.py", "responder.py", "container.py", "vllm_entry.py", "image_shim.py", "vllm_metrics.py"):
        executable = module in ("vllm_entry.py", "image_shim.py")
        files[f"{lib}/{module}"] = ((STANDIN_DIR / module).read_bytes(), 0o755 if executable else 0o644)
    if RICH_RESPONDER.is_file():
        files[f"{lib}/openai_responder.py"] = (RICH_RESPONDER.read_bytes(), 0o644)
    links["/usr/local/bin/vllm"] = f"{lib}/vllm_entry.py"
    # vLLM's Python programs need torch and a GPU: python3 and pip are the stand-in's (image_shim.py)
    for command in ("/usr/bin/python3", "/usr/bin/python", "/usr/bin/python3.12", "/usr/local/bin/pip", "/usr/local/bin/pip3"):
        links[command] = f"{lib}/image_shim.py"
    # the vLLM package's files upstream's entrypoints look for (the overlays they patch, the chat
    # templates in /vllm-workspace/examples), as the stand-in engine's images have them
    container = load_standin("container")
    site = container.VLLM_SITES[kind]
    files.update({path: (text.encode(), 0o644) for path, text in container.image_files(kind).items()})
    files["/vllm-workspace/.keep"] = (b"", 0o644)
    if config["WorkingDir"] != "/vllm-workspace":
        files[f"{config['WorkingDir']}/.keep"] = (b"", 0o644)
    listing = sorted([*files, *links])
    files[f"{lib}/image.json"] = (json.dumps({"kind": kind, "vllm_site": site, "files": listing}).encode(), 0o644)
    return build_image(repository, tag, files, links, {**config, "Env": BASE_ENV})


def smoke_image(runtime: tuple[dict[str, tuple[bytes, int]], dict[str, str]], reference: str) -> Image:
    repository, tag = reference.rsplit(":", 1)
    return build_image(repository, tag, *runtime, {"Cmd": ["bash"], "Env": BASE_ENV + SMOKE_IMAGE_ENV})


# NVIDIA's DCGM exporter (NVIDIA/dcgm-exporter@691c92762eb551313c825f6efe4ceeee20982801, tag 4.5.3-4.8.2:
# Makefile tags <dcgm>-<exporter>-ubuntu22.04, the Helm chart's repository nvcr.io/nvidia/k8s/dcgm-exporter,
# docker/Dockerfile's runtime-ubuntu stage: ENTRYPOINT the entrypoint script, NVIDIA_* environment, etc/ at
# /etc/dcgm-exporter). The registry holds it under its repository path; a rig pulls it from the hub.
DCGM_EXPORTER_REPOSITORY = "nvidia/k8s/dcgm-exporter"
DCGM_EXPORTER_TAG = "4.5.3-4.8.2-ubuntu22.04"
DCGM_EXPORTER_ENTRYPOINT = "/usr/local/dcgm/dcgm-exporter-entrypoint.sh"
DCGM_EXPORTER_ENV = ["NVIDIA_DRIVER_CAPABILITIES=compute,utility,compat32", "NVIDIA_DISABLE_REQUIRE=true",
                     "NVIDIA_VISIBLE_DEVICES=all"]


def dcgm_exporter_image(runtime: tuple[dict[str, tuple[bytes, int]], dict[str, str]], tag: str) -> Image:
    """The DCGM exporter's image at `tag` (<dcgm>-<exporter>-<os>): the stand-in exporter behind the real
    entrypoint script's path, which execs /usr/bin/dcgm-exporter with the container's arguments."""
    files, links = dict(runtime[0]), dict(runtime[1])
    lib = "/usr/lib/rigup-standin"
    exporter = load_standin("dcgm_exporter")
    files[f"{lib}/dcgm_exporter.py"] = ((STANDIN_DIR / "dcgm_exporter.py").read_bytes(), 0o755)
    version = "-".join(tag.split("-")[:2])  # the build's version: <dcgm>-<exporter>
    files[f"{lib}/dcgm-exporter.json"] = (json.dumps({"version": version}).encode(), 0o644)
    links["/usr/bin/dcgm-exporter"] = f"{lib}/dcgm_exporter.py"
    files[DCGM_EXPORTER_ENTRYPOINT] = (b'#!/bin/bash\nset -euo pipefail\nexec /usr/bin/dcgm-exporter "$@"\n', 0o755)
    files["/etc/dcgm-exporter/default-counters.csv"] = (exporter.default_counters_csv().encode(), 0o644)
    repository = DCGM_EXPORTER_REPOSITORY
    return build_image(repository, tag, files, links, {
        "Entrypoint": [DCGM_EXPORTER_ENTRYPOINT], "WorkingDir": "/", "Env": BASE_ENV + DCGM_EXPORTER_ENV,
        "Labels": {"name": "NVIDIA DCGM Exporter", "vendor": "NVIDIA", "version": version.split("-")[1]}})


def dcgm_exporter_tags() -> list[str]:
    """Upstream's current tag, and the one group_data's gpu_exporter_image names (when it names one)."""
    tags = {DCGM_EXPORTER_TAG}
    reference = str(load_defaults().get("gpu_exporter_image") or "")
    name, _, tag = reference.rpartition(":")
    if name.endswith("/" + DCGM_EXPORTER_REPOSITORY) and tag:
        tags.add(tag)
    return sorted(tags)


def catalog_tags(repository: str) -> list[str]:
    """Every tag the catalog names for `repository`, except images it pins by upstream's digest."""
    return sorted({str(spec["tag"]) for spec in load_catalog()["images"].values()
                   if spec.get("repository") == repository and spec.get("tag") and not spec.get("digest")})


def smoke_reference() -> str:
    return str(load_defaults()["gpu_smoke_image"])


def test_bed_images(python_root: Path | None = None) -> list[Image]:
    images = [busybox_image()]
    if python_root is not None:
        runtime = python_runtime(python_root)
        vllm = vllm_image(runtime, "latest")  # one image per kind, under every tag the catalog names
        images += [dataclasses.replace(vllm, tag=tag) for tag in catalog_tags("vllm/vllm-openai")]
        omni = vllm_image(runtime, "latest", "vllm-omni")
        images += [dataclasses.replace(omni, tag=tag) for tag in catalog_tags("vllm/vllm-omni")]
        # what a tag that moved upstream to a new build points to: another digest of the same repository
        images.append(rebuilt(vllm, REBUILT_TAG, {"org.rigup.testbed.build": "2"}))
        images.append(smoke_image(runtime, smoke_reference()))
        images += [dcgm_exporter_image(runtime, tag) for tag in dcgm_exporter_tags()]
    return images


# --- the Registry HTTP API v2, as `docker push` uses it ------------------------------------------------


def _request(address: str, method: str, path: str, body: bytes = b"",
             headers: dict[str, str] | None = None) -> http.client.HTTPResponse:
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request(method, path, body=body, headers={"Content-Length": str(len(body)), **(headers or {})})
    response = conn.getresponse()
    response.read()
    conn.close()
    return response


def _push_blob(address: str, repository: str, blob: bytes) -> None:
    digest = _digest(blob)
    if _request(address, "HEAD", f"/v2/{repository}/blobs/{digest}").status == 200:
        return
    started = _request(address, "POST", f"/v2/{repository}/blobs/uploads/")
    if started.status != 202:
        raise RuntimeError(f"registry {address}: starting an upload to {repository} answered {started.status}")
    location = urllib.parse.urlsplit(started.headers["Location"])
    query = f"{location.query}&" if location.query else ""
    done = _request(address, "PUT", f"{location.path}?{query}digest={digest}", blob,
                    {"Content-Type": "application/octet-stream"})
    if done.status != 201:
        raise RuntimeError(f"registry {address}: uploading {digest} to {repository} answered {done.status}")


def push(address: str, image: Image) -> str:
    """Push `image` to the registry at host:port; returns the digest the registry answers for its tag."""
    _push_blob(address, image.repository, image.layer)
    _push_blob(address, image.repository, image.config)
    put = _request(address, "PUT", f"/v2/{image.repository}/manifests/{image.tag}", image.manifest,
                   {"Content-Type": MANIFEST_TYPE})
    if put.status != 201:
        raise RuntimeError(f"registry {address}: manifest {image.repository}:{image.tag} answered {put.status}")
    digest = put.headers.get("Docker-Content-Digest", "")
    if digest != image.digest:
        raise RuntimeError(f"registry {address}: {image.repository}:{image.tag} stored as {digest}, built as {image.digest}")
    return digest


# --- the service -----------------------------------------------------------------------------------


def config_text(storage: Path, bind: str, port: int) -> str:
    return (
        "version: 0.1\n"
        "log:\n  level: warn\n"
        f"storage:\n  filesystem:\n    rootdirectory: {storage}\n  delete:\n    enabled: true\n"
        f"http:\n  addr: {bind}:{port}\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rigup_testbed.registry", description=__doc__.splitlines()[0])
    parser.add_argument("--root", required=True, type=Path)
    parser.add_argument("--bind", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--ready-file", required=True, type=Path)
    parser.add_argument("--python-root", type=Path, help="the rigs' root file system: images with a Python runtime")
    args = parser.parse_args(argv)
    if shutil.which(BINARY) is None:
        raise SystemExit(f"{BINARY} is missing: install Debian's docker-registry (scripts/setup does)")
    args.root.mkdir(parents=True, exist_ok=True)
    config = args.root / "config.yml"
    config.write_text(config_text(args.root / "data", args.bind, args.port))
    address = f"{args.bind}:{args.port}"
    log = open(args.root / "registry.log", "ab")
    child = subprocess.Popen([BINARY, "serve", str(config)], stdout=log, stderr=log, stdin=subprocess.DEVNULL)

    def start() -> tuple[dict[str, object], list[str]]:
        deadline = time.monotonic() + 30
        while True:
            if child.poll() is not None:
                raise SystemExit(f"docker-registry exited with {child.returncode}; see {args.root / 'registry.log'}")
            try:
                if _request(address, "GET", "/v2/").status == 200:
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.1)
        images = {f"{image.repository}:{image.tag}": push(address, image) for image in test_bed_images(args.python_root)}
        return {"url": address, "images": images, "pid": os.getpid()}, [address]

    def stop() -> None:
        child.terminate()
        try:
            child.wait(10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        log.close()

    def failed() -> str | None:
        return None if child.poll() is None else f"docker-registry exited with {child.returncode}"

    return run_service(args.ready_file, start, stop, failed)


if __name__ == "__main__":
    raise SystemExit(main())
