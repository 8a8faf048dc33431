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
"""

from __future__ import annotations

import argparse
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

from rigup_testbed.service import run_service

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
    layer = gzip.compress(diff, mtime=0)
    image_config = {
        "architecture": "amd64",
        "os": "linux",
        "created": "2025-09-30T00:00:00Z",
        "config": config,
        "rootfs": {"type": "layers", "diff_ids": [_digest(diff)]},
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


def test_bed_images() -> list[Image]:
    return [busybox_image()]


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
        images = {f"{image.repository}:{image.tag}": push(address, image) for image in test_bed_images()}
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
