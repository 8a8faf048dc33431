"""The real container registry of the hub (Debian's `docker-registry`, the distribution registry 2.8),
holding images the test bed builds itself.

    python -m rigup_testbed.registry --root DIR --bind IP --port N --ready-file F

starts `docker-registry serve` with its storage under DIR, waits until `/v2/` answers, pushes the test
bed's images through the Registry HTTP API v2 (the same calls `docker push` makes: a blob upload per
layer and config, then the manifest; over HTTPS with --tls-cert/--tls-key/--tls-ca, distribution's own
TLS with the bed's certificate: rigup_testbed/tls.py), writes the ready file
({"url": "IP:N", "images": {"repo:tag": "sha256:..."}}) and stops the registry on SIGTERM.

The images are real: gzip'd tar layers, an image config and a schema-2 manifest, so the digests are the
SHA-256 of what the registry serves and a pull by digest is checked by the engine that pulls it. They are
built from files of this machine, byte for byte the same on every run (fixed mtimes, owners and order),
so their digests are stable too:

  rigup-testbed/busybox:1.35   Debian's static busybox with its applet links; entrypoint none, cmd ["sh"]
  vllm/vllm-openai:<tag>       for every tag the catalog names: vLLM's image layout (entrypoint `vllm
                               serve`, workdir /vllm-workspace, /usr/local/lib/python3.12/dist-packages/vllm)
                               with a Python runtime and, as `vllm`, the stand-in server
                               (standins/vllm_entry.py -> responder.py), and a second layer with Ray
                               (ray_layer: `ray` for vLLM's Ray backend and rigup's cluster member script);
                               and under rigup-testbed-rebuilt the same image built again (another digest:
                               a pin that moves)
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
import fcntl
import gzip
import hashlib
import http.client
import io
import json
import os
import re
import shutil
import ssl
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

from rigup.desired.catalog import load_catalog
from rigup.desired.knobs import load_defaults
from rigup_testbed.image import cache_dir
from rigup_testbed.service import add_tls_arguments, run_service, tls_of
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
    """One image: the bytes a push sends."""

    repository: str
    tag: str
    layers: tuple[bytes, ...]  # gzip'd tars, base first
    config: bytes
    manifest: bytes

    @property
    def layer(self) -> bytes:
        """The base layer (every image has one: the files build_image was given)."""
        return self.layers[0]

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


def _layer_tar(files: dict[str, tuple[bytes, int]], links: dict[str, str]) -> bytes:
    """The uncompressed tar of one layer: every parent directory, then `files` (path -> (content, mode)),
    then `links` (path -> target), each sorted, with fixed times and owners (the same bytes every run)."""
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
    return raw.getvalue()


@dataclass(frozen=True)
class Layer:
    """A built layer to stack on an image's base layer: the gzip'd tar and its diff_id (the digest of the
    uncompressed tar), with the line its history entry carries."""

    blob: bytes
    diff_id: str
    created_by: str


def build_image(repository: str, tag: str, files: dict[str, tuple[bytes, int]], links: dict[str, str],
                config: dict[str, object], extra_layers: tuple[Layer, ...] = ()) -> Image:
    """An image whose base layer holds `files` (path -> (content, mode)) and `links` (path -> target), with
    `extra_layers` on top of it in order. Without them the image is what it always was (one layer, the
    same config and manifest bytes, so the same digest)."""
    diff = _layer_tar(files, links)
    return _assemble(repository, tag, [_compressed(diff), *(x.blob for x in extra_layers)],
                     [_digest(diff), *(x.diff_id for x in extra_layers)], config,
                     [x.created_by for x in extra_layers])


HISTORY_CREATED = "2025-09-30T00:00:00Z"
BASE_CREATED_BY = "rigup test bed (rigup_testbed/registry.py)"


def _assemble(repository: str, tag: str, layers: list[bytes] | bytes, diff_ids: list[str] | str,
              config: dict[str, object], created_by: list[str] | None = None) -> Image:
    """The image config and manifest around its layers, base first (`diff_ids`: the digests of their
    uncompressed tars, in the same order; `created_by`: the history line of each layer above the base).
    One layer and one diff_id may be given bare."""
    layers = [layers] if isinstance(layers, bytes) else list(layers)
    diff_ids = [diff_ids] if isinstance(diff_ids, str) else list(diff_ids)
    created_by = list(created_by or [])
    if not layers or len(diff_ids) != len(layers) or len(created_by) != len(layers) - 1:
        raise ValueError(f"{repository}:{tag}: {len(layers)} layers, {len(diff_ids)} diff_ids, "
                         f"{len(created_by)} history lines above the base")
    image_config = {
        "architecture": "amd64",
        "os": "linux",
        "created": HISTORY_CREATED,
        "config": config,
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
        "history": [{"created": HISTORY_CREATED, "created_by": line} for line in [BASE_CREATED_BY, *created_by]],
    }
    config_blob = json.dumps(image_config, sort_keys=True).encode()
    manifest = json.dumps({
        "schemaVersion": 2,
        "mediaType": MANIFEST_TYPE,
        "config": {"mediaType": CONFIG_TYPE, "size": len(config_blob), "digest": _digest(config_blob)},
        "layers": [{"mediaType": LAYER_TYPE, "size": len(layer), "digest": _digest(layer)} for layer in layers],
    }, indent=3).encode()
    return Image(repository, tag, tuple(layers), config_blob, manifest)


def rebuilt(image: Image, tag: str, labels: dict[str, str]) -> Image:
    """`image` built again: the same layers, a config with `labels` (so another digest), under `tag`."""
    config = json.loads(image.config)
    return _assemble(image.repository, tag, list(image.layers), config["rootfs"]["diff_ids"],
                     {**config["config"], "Labels": labels}, [h["created_by"] for h in config["history"][1:]])


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


# --- Ray in the vLLM image (issue 29: a cluster of rigs runs vLLM's Ray backend) --------------------
#
# vLLM's image has Ray (vLLM's requirements/cuda.txt: ray[cgraph]); the stand-in's `vllm serve
# --distributed-executor-backend ray` and rigup's member script (`ray start`) run the real one. A second
# layer holds `pip install ray==RAY_VERSION` for the image's Python (Debian's 3.11, whose site module looks in
# /usr/local/lib/python3.11/dist-packages), the `ray` console script on that interpreter (/usr/bin/python3 is
# the image shim), and the shared libraries Ray's binaries load that the base layer lacks (libstdc++ and
# friends, from the rigs' root). The wheels are downloaded once into the test bed's cache; the layer is
# cached by what makes it (the wheels' and libraries' hashes), so a warm build reads one file.

RAY_VERSION = "2.58.0"
RAY_LAYER_FORMAT = 1  # bump when the layer's layout changes in a way its key cannot see
RAY_SITE = f"/usr/local/lib/{PYTHON}/dist-packages"
RAY_SCRIPT = "/usr/local/bin/ray"
RAY_KINDS = ("vllm",)  # vllm/vllm-openai only: not vLLM-Omni's image, busybox, CUDA or the DCGM exporter
RAY_PIP_TARGET = ("--only-binary=:all:", "--python-version", "3.11", "--implementation", "cp",
                  "--platform", "manylinux2014_x86_64")


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def ray_wheels(cache: Path | None = None) -> Path:
    """ray==RAY_VERSION and its dependencies' wheels for the image's Python, downloaded once (pip download,
    under a lock; `wheels.json` marks a complete download) into <test-bed cache>/ray-wheels/ray-<version>."""
    base = (cache or cache_dir()) / "ray-wheels"
    dest = base / f"ray-{RAY_VERSION}-cp311-manylinux2014_x86_64"
    base.mkdir(parents=True, exist_ok=True)
    with open(base / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (dest / "wheels.json").is_file():
            return dest
        building = Path(tempfile.mkdtemp(prefix=".building-", dir=base))
        try:
            cmd = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--no-input",
                   "--progress-bar", "off", f"ray=={RAY_VERSION}", *RAY_PIP_TARGET, "-d", str(building)]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"pip download failed (exit {done.returncode}):\n  {' '.join(cmd)}\n{done.stdout[-3000:]}"
                                   f"{done.stderr[-3000:]}")
            wheels = {w.name: _sha256_file(w) for w in sorted(building.glob("*.whl"))}
            (building / "wheels.json").write_text(json.dumps(wheels, indent=1, sort_keys=True) + "\n")
            building.chmod(0o755)
            if dest.exists():
                shutil.rmtree(dest)
            building.rename(dest)
        finally:
            shutil.rmtree(building, ignore_errors=True)
    return dest


def _elf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"\x7fELF"


def _library_closure(root: Path, names: list[str]) -> dict[str, Path]:
    """soname -> the file in `root` (resolved), for `names` and everything they load in turn."""
    found: dict[str, Path] = {}
    todo = list(names)
    while todo:
        name = todo.pop()
        if name in found:
            continue
        where = next((root / d / name for d in LIB_DIRS if (root / d / name).exists()), None)
        if where is None:
            raise FileNotFoundError(f"{name}: not in {root}'s {' or '.join(LIB_DIRS)}")
        found[name] = where.resolve()
        todo += _needed(found[name])
    return found


def ray_layer(root: Path, runtime: tuple[dict[str, tuple[bytes, int]], dict[str, str]]) -> Layer:
    """The Ray layer for an image whose base layer is `runtime` (python_runtime(root)): cached under
    <test-bed cache>/engine-layers/ray-<key>.tar.gz (+ .json: its diff_id, size, how long the build took)."""
    wheels_dir = ray_wheels()
    wheels = json.loads((wheels_dir / "wheels.json").read_text())
    base_paths = set(runtime[0]) | set(runtime[1])
    store = cache_dir() / "engine-layers"
    wheel_key = hashlib.sha256(json.dumps({"format": RAY_LAYER_FORMAT, "wheels": wheels, "site": RAY_SITE,
                                           "script": RAY_SCRIPT}, sort_keys=True).encode()).hexdigest()
    needed_file = store / f"ray-{wheel_key[:32]}.needed.json"  # the sonames Ray's ELF files load (wheels only)

    def key_of(libs: dict[str, Path]) -> str:
        shipped = {n: _sha256_file(p) for n, p in sorted(libs.items()) if f"/lib/x86_64-linux-gnu/{n}" not in base_paths}
        return hashlib.sha256(json.dumps({"wheels": wheel_key, "libs": shipped}, sort_keys=True).encode()).hexdigest()

    created_by = f"pip install ray=={RAY_VERSION} --target {RAY_SITE} (rigup_testbed/registry.py ray_layer)"
    if needed_file.is_file():
        key = key_of(_library_closure(root, json.loads(needed_file.read_text())))
        blob, meta = store / f"ray-{key}.tar.gz", store / f"ray-{key}.json"
        if blob.is_file() and meta.is_file():
            return Layer(blob.read_bytes(), json.loads(meta.read_text())["diff_id"], created_by)

    started = time.monotonic()
    files: dict[str, tuple[bytes, int]] = {}
    links: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="ray-layer-") as tmp:
        target = Path(tmp) / "site"
        cmd = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "--no-input", "--no-index",
               "--find-links", str(wheels_dir), "--target", str(target), "--no-compile", *RAY_PIP_TARGET,
               f"ray=={RAY_VERSION}"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"pip install failed (exit {done.returncode}):\n  {' '.join(cmd)}\n{done.stdout[-3000:]}"
                               f"{done.stderr[-3000:]}")
        shutil.rmtree(target / "bin", ignore_errors=True)  # scripts on pip's own interpreter: written below
        sonames: set[str] = set()
        for path in sorted(target.rglob("*")):
            rel = f"{RAY_SITE}/{path.relative_to(target)}"
            if path.is_symlink():
                links[rel] = os.readlink(path)
            elif path.is_file():
                executable = os.access(path, os.X_OK)
                files[rel] = (path.read_bytes(), 0o755 if executable else 0o644)
                if (executable or ".so" in path.name) and _elf(path):
                    sonames.update(_needed(path))
    entry = "ray.scripts.scripts:main"  # ray's entry_points.txt: console_scripts `ray`
    module, func = entry.split(":")
    files[RAY_SCRIPT] = (f"#!/usr/bin/{PYTHON}\nimport sys\nfrom {module} import {func}\nif __name__ == '__main__':\n"
                         f"    sys.argv[0] = sys.argv[0].removesuffix('.exe')\n    sys.exit({func}())\n".encode(), 0o755)
    needed = sorted(sonames)
    libs = _library_closure(root, needed)
    for name, real in sorted(libs.items()):
        if f"/lib/x86_64-linux-gnu/{name}" not in base_paths:
            files[f"/lib/x86_64-linux-gnu/{name}"] = (real.read_bytes(), 0o755)
    diff = _layer_tar(files, links)
    files.clear()
    diff_id = _digest(diff)
    blob_bytes = gzip.compress(diff, compresslevel=6, mtime=0)
    key = key_of(libs)
    store.mkdir(parents=True, exist_ok=True)
    for path, data in ((store / f"ray-{key}.tar.gz", blob_bytes),
                       (store / f"ray-{key}.json", json.dumps({"diff_id": diff_id, "size": len(blob_bytes), "tar_size": len(diff),
                                                                "build_seconds": round(time.monotonic() - started, 2)}).encode()),
                       (needed_file, json.dumps(needed).encode())):
        tmp_path = path.with_suffix(f".{os.getpid()}.tmp")
        tmp_path.write_bytes(data)
        os.replace(tmp_path, path)
    return Layer(blob_bytes, diff_id, created_by)


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


def vllm_image(runtime: tuple[dict[str, tuple[bytes, int]], dict[str, str]], tag: str, kind: str = "vllm",
               ray: Layer | None = None) -> Image:
    """A vLLM image of `kind` (VLLM_KINDS) whose `vllm` is the stand-in server on the rigs' Python; with
    `ray` (ray_layer, for the kinds in RAY_KINDS) Ray is its second layer, the first one unchanged."""
    repository, config = VLLM_KINDS[kind]
    if ray is not None and kind not in RAY_KINDS:
        raise ValueError(f"the {kind} image gets no Ray layer (RAY_KINDS: {RAY_KINDS})")
    files, links = dict(runtime[0]), dict(runtime[1])
    lib = "/usr/lib/rigup-standin"
    for module in ("common.py", "responder.py", "container.py", "vllm_entry.py", "image_shim.py", "vllm_metrics.py",
                   "ray_cluster.py"):  # vllm_entry's Ray backend (the Ray it imports is the second layer's)
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
    return build_image(repository, tag, files, links, {**config, "Env": BASE_ENV}, (ray,) if ray else ())


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
        # one image per kind, under every tag the catalog names; vLLM's with Ray (a second layer)
        vllm = vllm_image(runtime, "latest", ray=ray_layer(python_root, runtime))
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
             headers: dict[str, str] | None = None, context: ssl.SSLContext | None = None) -> http.client.HTTPResponse:
    """One request to the registry at host:port: over HTTPS checked with `context` when given, else plain HTTP."""
    host, port = address.rsplit(":", 1)
    conn: http.client.HTTPConnection = (http.client.HTTPSConnection(host, int(port), timeout=30, context=context)
                                        if context is not None else http.client.HTTPConnection(host, int(port), timeout=30))
    conn.request(method, path, body=body, headers={"Content-Length": str(len(body)), **(headers or {})})
    response = conn.getresponse()
    response.read()
    conn.close()
    return response


def push_blob(address: str, repository: str, blob: bytes, context: ssl.SSLContext | None = None) -> None:
    digest = _digest(blob)
    if _request(address, "HEAD", f"/v2/{repository}/blobs/{digest}", context=context).status == 200:
        return
    started = _request(address, "POST", f"/v2/{repository}/blobs/uploads/", context=context)
    if started.status != 202:
        raise RuntimeError(f"registry {address}: starting an upload to {repository} answered {started.status}")
    location = urllib.parse.urlsplit(started.headers["Location"])
    query = f"{location.query}&" if location.query else ""
    done = _request(address, "PUT", f"{location.path}?{query}digest={digest}", blob,
                    {"Content-Type": "application/octet-stream"}, context)
    if done.status != 201:
        raise RuntimeError(f"registry {address}: uploading {digest} to {repository} answered {done.status}")


def push_manifest(address: str, repository: str, tag: str, manifest: bytes, context: ssl.SSLContext | None = None) -> str:
    """PUT a schema-2 manifest under `tag`; returns the digest the registry answers."""
    put = _request(address, "PUT", f"/v2/{repository}/manifests/{tag}", manifest, {"Content-Type": MANIFEST_TYPE}, context)
    if put.status != 201:
        raise RuntimeError(f"registry {address}: manifest {repository}:{tag} answered {put.status}")
    return put.headers.get("Docker-Content-Digest", "")


def push(address: str, image: Image, context: ssl.SSLContext | None = None) -> str:
    """Push `image` to the registry at host:port (over HTTPS checked with `context` when given); returns the
    digest the registry answers for its tag."""
    for layer in image.layers:
        push_blob(address, image.repository, layer, context)
    push_blob(address, image.repository, image.config, context)
    digest = push_manifest(address, image.repository, image.tag, image.manifest, context)
    if digest != image.digest:
        raise RuntimeError(f"registry {address}: {image.repository}:{image.tag} stored as {digest}, built as {image.digest}")
    return digest


# --- the service -----------------------------------------------------------------------------------


def served_blob_bytes(log: Path, repository: str | None = None) -> int:
    """Bytes of blob GETs a registry answered (of `repository`, or every one), from the "response completed"
    lines distribution logs at info level (http.request.uri, http.response.written)."""
    prefix = f"/v2/{repository}/blobs/" if repository else "/blobs/"
    total = 0
    for line in log.read_text(errors="replace").splitlines():
        if "response completed" not in line or "http.request.method=GET" not in line:
            continue
        uri = re.search(r'http\.request\.uri="([^"]+)"', line)
        written = re.search(r"http\.response\.written=(\d+)", line)
        if uri and written and (uri.group(1).startswith(prefix) if repository else prefix in uri.group(1)):
            total += int(written.group(1))
    return total


def config_text(storage: Path, bind: str, port: int, tls: tuple[Path, Path] | None = None) -> str:
    # info: the registry's "response completed" line per request, with the bytes it wrote (served_blob_bytes);
    # tls: distribution's http.tls (certificate, key), so it serves HTTPS as Docker Hub does
    tls_text = f"  tls:\n    certificate: {tls[0]}\n    key: {tls[1]}\n" if tls else ""
    return (
        "version: 0.1\n"
        "log:\n  level: info\n  accesslog:\n    disabled: true\n"
        f"storage:\n  filesystem:\n    rootdirectory: {storage}\n  delete:\n    enabled: true\n"
        f"http:\n  addr: {bind}:{port}\n{tls_text}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rigup_testbed.registry", description=__doc__.splitlines()[0])
    parser.add_argument("--root", required=True, type=Path)
    parser.add_argument("--bind", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--ready-file", required=True, type=Path)
    parser.add_argument("--python-root", type=Path, help="the rigs' root file system: images with a Python runtime")
    add_tls_arguments(parser)
    parser.add_argument("--tls-ca", type=Path, help="the CA that issued --tls-cert: the pushes check the registry with it")
    args = parser.parse_args(argv)
    tls = tls_of(args)
    context = None
    if tls is not None:
        if args.tls_ca is None:
            raise SystemExit("--tls-cert needs --tls-ca (the pushes check the registry's certificate)")
        context = ssl.create_default_context(cafile=str(args.tls_ca))
    if shutil.which(BINARY) is None:
        raise SystemExit(f"{BINARY} is missing: install Debian's docker-registry (scripts/setup does)")
    args.root.mkdir(parents=True, exist_ok=True)
    config = args.root / "config.yml"
    config.write_text(config_text(args.root / "data", args.bind, args.port, tls))
    address = f"{args.bind}:{args.port}"
    log = open(args.root / "registry.log", "ab")
    child = subprocess.Popen([BINARY, "serve", str(config)], stdout=log, stderr=log, stdin=subprocess.DEVNULL)

    def start() -> tuple[dict[str, object], list[str]]:
        deadline = time.monotonic() + 30
        while True:
            if child.poll() is not None:
                raise SystemExit(f"docker-registry exited with {child.returncode}; see {args.root / 'registry.log'}")
            try:
                if _request(address, "GET", "/v2/", context=context).status == 200:
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.1)
        images = {f"{image.repository}:{image.tag}": push(address, image, context) for image in test_bed_images(args.python_root)}
        return {"url": address, "images": images, "log": str(args.root / "registry.log"), "pid": os.getpid()}, [address]

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
