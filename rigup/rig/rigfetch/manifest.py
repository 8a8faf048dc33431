"""What the control machine and rigfetch agree on: the manifest (the models, their files and SHA-256s, each
model's hub and chain of upstreams), its two encodings, its validation, the script's version and exit codes."""

from __future__ import annotations

import base64
import json
import os
import re
import zlib

SCRIPT_VERSION = 1
PART_SUFFIX = ".rigfetch-part"  # a download in progress: .<name>.rigfetch-part beside the file
# Fleet chain pieces: a rig forwards a piece only once it is verified, so each hop adds one piece of
# latency (34 ms at 1 Gbit/s); 32 bytes of hash per 4 MiB keeps the hash lists small.
PIECE_SIZE = 4 << 20
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_DISK = 3


HUB_AUTHS = ("huggingface", "registry")  # how a model's hub is read: Hugging Face's resolve URLs, or a registry's blobs


class ManifestError(ValueError):
    """The manifest or the command line cannot be used; the message says why (exit EXIT_USAGE)."""


def load_manifest(path: str | None, b64: str | None) -> dict:
    if (path is None) == (b64 is None):
        raise ManifestError("give exactly one of --manifest and --manifest-b64")
    try:
        if path is not None:
            with open(path, "rb") as handle:
                raw = handle.read()
        else:
            raw = zlib.decompress(base64.urlsafe_b64decode(b64.encode("ascii")))
        manifest = json.loads(raw.decode("utf-8"))
    except (OSError, ValueError, zlib.error) as exc:
        raise ManifestError("cannot read manifest: %s" % exc)
    validate_manifest(manifest)
    return manifest


def encode_manifest(manifest: dict) -> str:
    """The --manifest-b64 form (also used by rigup on the control machine)."""
    raw = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode("utf-8")
    return base64.urlsafe_b64encode(zlib.compress(raw, 9)).decode("ascii")


def validate_manifest(manifest: object) -> None:
    if not isinstance(manifest, dict) or manifest.get("version") != 1:
        raise ManifestError("manifest must be an object with version 1")
    state_dir = manifest.get("state_dir")
    if not isinstance(state_dir, str) or not os.path.isabs(state_dir):
        raise ManifestError("state_dir must be an absolute path")
    piece_size = manifest.get("piece_size", PIECE_SIZE)
    if not isinstance(piece_size, int) or isinstance(piece_size, bool) or piece_size < 4096:
        raise ManifestError("piece_size must be an integer of at least 4096")
    models = manifest.get("models")
    if not isinstance(models, list):
        raise ManifestError("models must be a list")
    names = set()
    dests = set()
    for model in models:
        if not isinstance(model, dict):
            raise ManifestError("each model must be an object")
        name = model.get("name")
        if not isinstance(name, str) or not re.match(r"^[A-Za-z0-9][A-Za-z0-9._-]*$", name):
            raise ManifestError("bad model name %r" % (name,))
        if name in names:
            raise ManifestError("model %s listed twice" % name)
        names.add(name)
        directory = model.get("dir")
        if not isinstance(directory, str) or not os.path.isabs(directory):
            raise ManifestError("%s: dir must be an absolute path" % name)
        url = model.get("hub_url")
        if not _http_dir_url(url):
            raise ManifestError("%s: hub_url must be an http(s) URL ending in /" % name)
        if model.get("hub_auth", "huggingface") not in HUB_AUTHS:
            raise ManifestError("%s: hub_auth must be one of %s" % (name, ", ".join(HUB_AUTHS)))
        upstreams = model.get("upstreams", [])
        if not isinstance(upstreams, list) or not all(_http_dir_url(u) for u in upstreams):
            raise ManifestError("%s: upstreams must be a list of http(s) URLs ending in /" % name)
        files = model.get("files")
        if not isinstance(files, list) or not files:
            raise ManifestError("%s: files must be a non-empty list" % name)
        for entry in files:
            if not isinstance(entry, dict):
                raise ManifestError("%s: each file must be an object" % name)
            rel = entry.get("path")
            if not isinstance(rel, str) or not safe_relpath(rel):
                raise ManifestError("%s: unsafe file path %r" % (name, rel))
            size = entry.get("size")
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise ManifestError("%s/%s: size must be a non-negative integer" % (name, rel))
            digest = entry.get("sha256")
            if not isinstance(digest, str) or not SHA256_RE.match(digest):
                raise ManifestError("%s/%s: sha256 must be 64 lowercase hex digits" % (name, rel))
            dest = os.path.join(directory, rel)
            if dest in dests:
                raise ManifestError("%s listed twice" % dest)
            dests.add(dest)


def _http_dir_url(url: object) -> bool:
    return isinstance(url, str) and url.startswith(("http://", "https://")) and url.endswith("/")


def safe_relpath(rel: str) -> bool:
    if not rel or rel.startswith("/") or "\\" in rel or "\x00" in rel:
        return False
    parts = rel.split("/")
    return all(part not in ("", ".", "..") for part in parts) and not parts[-1].endswith(PART_SUFFIX)
