#!/usr/bin/env python3
"""rigfetch: put locked model files on a rig, verified by SHA-256. Python 3 standard library only.

rigup uploads this file to {install_root}/bin/rigfetch.py and runs it on the rig (Ubuntu's python3;
no pip packages). The control machine builds the manifest from the lock file; this script never
decides what the right bytes are, it only makes the disk match the manifest.

Modes:
  rigfetch.py --manifest M.json --check     read stamps only; print what needs work (JSON); no writes
  rigfetch.py --manifest M.json             fetch/verify until every file matches; print counters (JSON)
  rigfetch.py --manifest M.json --listen A:P --expect-peers N
                                            the same, and serve this rig's files (verified ones, and the
                                            verified pieces of ones still arriving) to N fleet peers

Manifest (JSON; --manifest PATH or --manifest-b64 <urlsafe base64 of zlib-compressed JSON>):
  {"version": 1, "state_dir": "/opt/rigup/state", "reserve_bytes": 0, "piece_size": 4194304,
   "models": [{"name": "qwen3.6-27b-dflash", "dir": "/opt/rigup/models/qwen3.6-27b-dflash",
               "hub_url": "https://huggingface.co/z-lab/Qwen3.6-27B-DFlash/resolve/<commit>/",
               "upstreams": ["http://10.0.0.11:8765/", "http://10.0.0.12:8765/"],
               "files": [{"path": "config.json", "size": 1234, "sha256": "<64 hex>"}]}]}
  A model may say "hub_auth": "registry": its hub is a container registry's blob endpoint
  (https://registry-1.docker.io/v2/<repository>/blobs/, files named sha256:<hex>), read as `docker pull`
  reads it: no HF token; on a 401 with a Bearer challenge, an anonymous token from the challenge's realm
  (the distribution token spec), asked again when it expires; a redirect to another origin drops it.

Fleet chain (upstreams): the rigs ahead of this one in the model's chain, the head first. The head reads
the hub; every other rig reads its nearest live upstream while that one is still receiving, so each
rig's downlink and uplink carry the model once and the hub serves it once. Bytes are forwarded in
pieces (piece_size), and only verified ones. A piece's digest is the SHA-256 of the file up to the
piece's end (a copy of the running whole-file hash, finalized), so checking pieces costs no second pass
over the bytes, and the last piece's digest is the locked SHA-256 itself. The head's digests, taken as
the bytes arrive from the hub (before they touch a disk), are the authority; every other rig checks each
piece against them (asked of the upstreams head first) before its verified mark, which is all it
serves, moves past it. A peer whose piece fails is dropped and the piece is read from the next
upstream, then the hub; a dead peer likewise. The lock's whole-file SHA-256 stays the last gate
before any stamp, on every rig.

How it stays cheap and safe:
  * A verified file gets a stamp (size, mtime_ns, inode, sha256) in {state_dir}/model-stamps.json.
    A file whose stat still matches its stamp is trusted without reading it (--reverify re-hashes).
  * Downloads go to .<name>.rigfetch-part next to the target (same file system), hash while
    streaming, resume with an HTTP Range request, and are renamed into place only after the
    SHA-256 matches. A mismatch deletes the part file and retries (--retries), then fails naming
    the file and both hashes.
  * Files that exist but are not stamped (or --reverify) are hashed in parallel, one thread per
    core (hashlib releases the GIL); only mismatching ones are downloaded again.
  * Secrets (HF token, fleet token) arrive as one JSON line on stdin (--secrets-stdin), never on
    the command line, never in the log.
Progress (bytes, rate, ETA) goes to stderr and to {state_dir}/fetch.log.
"""

from __future__ import annotations

import argparse
import base64
import errno
import fcntl
import hashlib
import json
import os
import re
import stat as stat_module
import sys
import threading
import time
import urllib.parse
import zlib

TYPE_CHECKING = False  # typing's own flag: the annotations are strings, and typing is 5 ms of every start
if TYPE_CHECKING:
    from typing import Any, Callable

# The HTTP and thread-pool modules are imported where a download or the fleet server needs them:
# `--check`, which every converged re-run runs, needs none, and they were most of its start-up.

SCRIPT_VERSION = 1
STAMPS_FILE = "model-stamps.json"
LOG_FILE = "fetch.log"
REPORT_FILE = "fetch-report.json"
LOCK_FILE = "fetch.lock"
PART_SUFFIX = ".rigfetch-part"
HASH_BLOCK = 8 << 20  # 8 MiB reads: large enough that the per-call overhead vanishes
NET_BLOCK = 1 << 20
# Fleet chain pieces: a rig forwards a piece only once it is verified, so each hop adds one piece of
# latency (34 ms at 1 Gbit/s); 32 bytes of hash per 4 MiB keeps the hash lists small.
PIECE_SIZE = 4 << 20
FAILPOINTS_FILE = "rigfetch-failpoints.json"
PEER_GRACE = 5.0  # seconds an upstream that does not answer yet keeps this rig from looking further up
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
USER_AGENT = "rigup-rigfetch/%d" % SCRIPT_VERSION

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_DISK = 3


class ManifestError(ValueError):
    pass


class FetchError(Exception):
    """A file could not be fetched; the message is meant for the user."""


class TransientError(Exception):
    """Network trouble worth resuming after (connection reset, short read, 5xx)."""


class MismatchError(Exception):
    """The bytes a source sent are not the locked bytes (hash, size or length mismatch)."""


class SourceRefused(Exception):
    """A source answered with an error that retrying will not fix (401/403/404)."""


class Reauthorized(Exception):
    """A registry hub asked for a (new) bearer token, and this rig got one: ask again at once."""


HUB_AUTHS = ("huggingface", "registry")


# ------------------------------------------------------------------------------------------
# manifest


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


# ------------------------------------------------------------------------------------------
# logging and counters


# With --terse, only these lines reach stderr (what a deploy streams to the user): the plan, the
# periodic progress line, the fleet peer's state, warnings and the end; every line goes to the log.
TERSE_PREFIXES = ("progress:", "done:", "downloading ", "hashing ", "fleet peer", "WARNING", "serving ", "stopped serving")


class Log:
    """Progress lines to stderr and to the log file the user can tail. Never gets secrets."""

    def __init__(self, path: str | None, quiet: bool = False, terse: bool = False) -> None:
        self.lock = threading.Lock()
        self.quiet = quiet
        self.terse = terse
        self.handle = None
        if path is not None:
            try:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                self.handle = open(path, "a", buffering=1)
            except OSError as exc:
                sys.stderr.write("rigfetch: cannot open log %s: %s\n" % (path, exc))

    def __call__(self, message: str) -> None:
        line = "%s %s" % (time.strftime("%Y-%m-%dT%H:%M:%S"), message)
        with self.lock:
            shown = not self.quiet and (not self.terse or message.startswith(TERSE_PREFIXES) or " files: " in message)
            if shown:
                sys.stderr.write("rigfetch: %s\n" % message)
                sys.stderr.flush()
            if self.handle is not None:
                self.handle.write(line + "\n")

    def error(self, message: str) -> None:
        """Always on stderr (also with --quiet): pyinfra shows a failed command's stderr."""
        line = "%s ERROR %s" % (time.strftime("%Y-%m-%dT%H:%M:%S"), message)
        with self.lock:
            sys.stderr.write("rigfetch: ERROR %s\n" % message)
            sys.stderr.flush()
            if self.handle is not None:
                self.handle.write(line + "\n")

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()


class Counters:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.values = {
            "files": 0,
            "files_stamped": 0,  # trusted from a valid stamp: not read
            "files_verified": 0,  # already on disk, hashed, matched
            "files_downloaded": 0,
            "files_failed": 0,
            "files_pruned": 0,
            "bytes_hashed": 0,  # bytes read from disk to hash (existing files and resumed parts)
            "bytes_downloaded": 0,  # bytes received over the network (all sources)
            "bytes_from_hub": 0,
            "bytes_from_peer": 0,
            "bytes_streamed_hashed": 0,  # bytes hashed while they arrived
            "hash_mismatches": 0,
            "pieces_rejected": 0,  # fleet pieces whose hash was not the authority's
            "peers_dropped": 0,
            "resumes": 0,
        }

    def add(self, key: str, amount: int = 1) -> None:
        with self.lock:
            self.values[key] += amount

    def add_each(self, keys: tuple, amount: int) -> None:
        with self.lock:
            for key in keys:
                self.values[key] += amount

    def get(self, key: str) -> int:
        with self.lock:
            return self.values[key]

    def snapshot(self) -> dict:
        with self.lock:
            return dict(self.values)


def human_bytes(count: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(count) < 1000 or unit == "TB":
            return ("%d %s" % (count, unit)) if unit == "B" else ("%.1f %s" % (count, unit))
        count /= 1000.0
    return "%d B" % count  # pragma: no cover


def human_seconds(seconds: float) -> str:
    seconds = int(seconds)
    if seconds >= 3600:
        return "%dh%02dm" % (seconds // 3600, seconds % 3600 // 60)
    if seconds >= 60:
        return "%dm%02ds" % (seconds // 60, seconds % 60)
    return "%ds" % seconds


# ------------------------------------------------------------------------------------------
# stamps


class Stamps:
    """Verified-file stamps: {dest: {size, mtime_ns, ino, sha256, verified_at}} in one JSON file."""

    def __init__(self, state_dir: str, log: Log | None = None) -> None:
        self.path = os.path.join(state_dir, STAMPS_FILE)
        self.lock = threading.Lock()
        self.entries: dict = {}
        try:
            with open(self.path, "r") as handle:
                data = json.load(handle)
            if isinstance(data, dict) and isinstance(data.get("files"), dict):
                self.entries = data["files"]
        except FileNotFoundError:
            pass
        except (OSError, ValueError) as exc:
            # A damaged stamp file only costs a re-hash; never trust half of it.
            if log is not None:
                log("stamp file %s unreadable (%s): every file will be hashed" % (self.path, exc))
            self.entries = {}

    def valid(self, dest: str, st: os.stat_result, sha256: str, size: int) -> bool:
        entry = self.entries.get(dest)
        return (
            isinstance(entry, dict)
            and entry.get("sha256") == sha256
            and entry.get("size") == size == st.st_size
            and entry.get("mtime_ns") == st.st_mtime_ns
            and entry.get("ino") == st.st_ino
        )

    def put(self, dest: str, st: os.stat_result, sha256: str) -> None:
        with self.lock:
            self.entries[dest] = {
                "size": st.st_size,
                "mtime_ns": st.st_mtime_ns,
                "ino": st.st_ino,
                "sha256": sha256,
                "verified_at": int(time.time()),
            }
            self._save()

    def drop(self, dest: str) -> None:
        with self.lock:
            if self.entries.pop(dest, None) is not None:
                self._save()

    def _save(self) -> None:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as handle:
            json.dump({"version": 1, "files": self.entries}, handle, sort_keys=True, indent=1)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, self.path)


# ------------------------------------------------------------------------------------------
# planning (shared by --check and fetch)


class Item:
    __slots__ = ("model", "rel", "key", "dest", "part", "size", "sha256", "action", "part_size", "url_hub", "upstreams",
                 "hub_auth")

    def __init__(self, model: dict, entry: dict) -> None:
        self.model = model["name"]
        self.rel = entry["path"]
        self.dest = os.path.join(model["dir"], entry["path"])
        directory, base = os.path.split(self.dest)
        self.part = os.path.join(directory, "." + base + PART_SUFFIX)
        self.size = entry["size"]
        self.sha256 = entry["sha256"]
        quoted = urllib.parse.quote(entry["path"], safe="/")
        self.key = "%s/%s" % (model["name"], quoted)  # the file's path on a fleet server
        self.url_hub = model["hub_url"] + quoted
        self.upstreams = tuple(model.get("upstreams") or ())  # fleet chain, head first
        self.hub_auth = model.get("hub_auth", "huggingface")
        self.action = "fetch"
        self.part_size = 0

    @property
    def label(self) -> str:
        return "%s/%s" % (self.model, self.rel)


def plan(manifest: dict, stamps: Stamps, reverify: bool) -> tuple:
    """Classify every file: ok (valid stamp), verify (on disk, hash it), fetch (missing/wrong size).

    Also returns stamped files under the manifest's model dirs that the manifest no longer lists
    (left behind by an older lock): they are ours to remove.
    """
    items = []
    wanted = set()
    for model in manifest["models"]:
        for entry in model["files"]:
            item = Item(model, entry)
            wanted.add(item.dest)
            try:
                st = os.stat(item.dest)
            except FileNotFoundError:
                st = None
            if st is not None and not _is_regular(st):
                item.action = "fetch"
            elif st is not None and not reverify and stamps.valid(item.dest, st, item.sha256, item.size):
                item.action = "ok"
            elif st is not None and st.st_size == item.size:
                item.action = "verify"
            else:
                item.action = "fetch"
            if item.action == "fetch":
                try:
                    item.part_size = os.stat(item.part).st_size
                except FileNotFoundError:
                    item.part_size = 0
            items.append(item)
    dirs = tuple(model["dir"].rstrip("/") + "/" for model in manifest["models"])
    prune = sorted(dest for dest in stamps.entries if dest not in wanted and dest.startswith(dirs) and os.path.lexists(dest))
    return items, prune


def _is_regular(st: os.stat_result) -> bool:
    return stat_module.S_ISREG(st.st_mode)


def check_report(manifest: dict, items: list, prune: list) -> dict:
    work = [
        {"path": item.dest, "action": item.action, "size": item.size, "part_size": item.part_size}
        for item in items
        if item.action != "ok"
    ]
    return {
        "script_version": SCRIPT_VERSION,
        "files": len(items),
        "ok": sum(1 for item in items if item.action == "ok"),
        "work": work,
        "prune": prune,
        "download_bytes": sum(i.size - min(i.part_size, i.size) for i in items if i.action == "fetch"),
        "hash_bytes": sum(i.size for i in items if i.action == "verify"),
    }


# ------------------------------------------------------------------------------------------
# hashing


def hash_file(
    path: str,
    counters: Counters | None = None,
    hasher: Any = None,
    limit: int | None = None,
    on_bytes: Callable[[int], None] | None = None,
) -> Any:
    """SHA-256 of a file (or its first `limit` bytes), read in large blocks; returns the hasher.

    `on_bytes(n)` is called after each block (progress reporting)."""
    hasher = hasher if hasher is not None else hashlib.sha256()
    buffer = bytearray(HASH_BLOCK)
    view = memoryview(buffer)
    remaining = limit
    with open(path, "rb", buffering=0) as handle:
        try:
            os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        except (AttributeError, OSError):
            pass
        while remaining is None or remaining > 0:
            want = HASH_BLOCK if remaining is None else min(HASH_BLOCK, remaining)
            count = handle.readinto(view[:want])
            if not count:
                break
            hasher.update(view[:count])
            if counters is not None:
                counters.add("bytes_hashed", count)
            if on_bytes is not None:
                on_bytes(count)
            if remaining is not None:
                remaining -= count
    return hasher


# ------------------------------------------------------------------------------------------
# fetching


class Progress:
    """Bytes still to download, per active file, for the periodic progress line."""

    def __init__(self, total: int, verb: str = "downloaded", sources: Callable[[], str] | None = None) -> None:
        self.lock = threading.Lock()
        self.verb = verb
        self.sources = sources  # "X from the hub, Y from fleet peers" for a download's line
        self.total = total
        self.done = 0
        self.active: dict = {}
        self.started = time.monotonic()
        self.window: list = [(self.started, 0)]

    def add(self, label: str, amount: int, file_done: int, file_size: int) -> None:
        with self.lock:
            self.done += amount
            self.active[label] = (file_done, file_size)

    def finish(self, label: str) -> None:
        with self.lock:
            self.active.pop(label, None)

    def line(self) -> str:
        with self.lock:
            now = time.monotonic()
            self.window.append((now, self.done))
            self.window = [(t, d) for (t, d) in self.window if now - t <= 20.0] or [(now, self.done)]
            t0, d0 = self.window[0]
            rate = (self.done - d0) / (now - t0) if now > t0 else 0.0
            left = max(self.total - self.done, 0)
            eta = human_seconds(left / rate) if rate > 0 else "?"
            pct = (100.0 * self.done / self.total) if self.total else 100.0
            files = ", ".join(
                "%s %d%%" % (label.rsplit("/", 1)[-1], 100 * d // s if s else 100)
                for label, (d, s) in sorted(self.active.items())
            )
            return "progress: %s %s / %s (%.0f%%) at %s/s, ETA %s%s%s" % (
                self.verb,
                human_bytes(self.done),
                human_bytes(self.total),
                pct,
                human_bytes(rate),
                eta,
                (" (%s)" % self.sources()) if self.sources is not None else "",
                ("; " + files) if files else "",
            )


class Partial:
    """A part file being downloaded: the running hash of its first `have` bytes, and the same at `mark`,
    the end of its last verified piece, where a rejected piece or a broken transfer rewinds to."""

    __slots__ = ("hasher", "have", "valid", "mark", "mark_hasher")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.hasher = hashlib.sha256()
        self.have = 0
        self.valid = False
        self.settle()

    def settle(self) -> None:
        """Everything so far is verified."""
        self.mark = self.have
        self.mark_hasher = self.hasher.copy()

    def rewind(self) -> None:
        self.have = self.mark
        self.hasher = self.mark_hasher.copy()


class PieceMismatch(Exception):
    """A peer sent a piece whose hash is not the authority's."""


class NoAuthority(Exception):
    """No upstream can vouch for a piece: this rig reads the rest of the file from the hub."""


class NotYet(Exception):
    """A peer has not started on the file yet (it answers 503): ask again shortly."""


class Track:
    """A file this rig fetches (or checks) in this run, as its fleet server sees it: how far the part file
    is verified (all that may be forwarded) and the hashes of its pieces."""

    def __init__(self, item: Item, piece_size: int) -> None:
        self.item = item
        self.piece_size = piece_size
        self.cond = threading.Condition()
        self.state = "waiting"  # waiting | active | done | failed
        self.verified = 0
        self.generation = 0  # bumped when the part file starts over: a reader of the old one must stop
        self.digests: dict = {}  # piece index -> SHA-256 of this rig's bytes up to that piece's end
        self.own: set = set()  # pieces read from the hub: their digests are the authority
        self.authority: dict = {}  # piece index -> digest an authority gave (used to check a peer's piece)
        self.hub_reader = not item.upstreams  # reads the file from the hub (the chain's head, or fallen back)

    @property
    def pieces(self) -> int:
        return (self.item.size + self.piece_size - 1) // self.piece_size

    def set_state(self, state: str) -> None:
        with self.cond:
            self.state = state
            self.cond.notify_all()

    def restart(self) -> None:
        with self.cond:
            if self.verified:
                self.generation += 1  # a reader holds the old part file open: it must stop
            self.verified = 0
            self.digests.clear()
            self.own.clear()
            self.cond.notify_all()

    def verified_to(self, offset: int, index: int, digest: str, own: bool) -> None:
        with self.cond:
            self.digests[index] = digest
            if own:
                self.own.add(index)
            self.verified = offset
            self.cond.notify_all()

    def authoritative_run(self, start: int) -> list | None:
        """The digests this rig vouches for from piece `start` on: all of them once the whole file
        matched the lock, else the run it read from the hub. None: the file is done but was verified on
        disk, not received, so its digests are to be hashed from disk."""
        with self.cond:
            if self.state == "done":
                if len(self.digests) < self.pieces:
                    return None
                return [self.digests[i] for i in range(start, self.pieces)]
            run = []
            index = start
            while index in self.own:
                run.append(self.digests[index])
                index += 1
            return run

    def may_vouch(self) -> bool:
        """Whether waiting on this rig can give a piece's authoritative digest."""
        with self.cond:
            return self.state == "done" or (self.hub_reader and self.state in ("waiting", "active"))


class Fetcher:
    def __init__(self, manifest: dict, args: argparse.Namespace, secrets: dict, log: Log) -> None:
        self.manifest = manifest
        self.args = args
        self.log = log
        self.hf_token = secrets.get("hf_token") or None
        self.fleet_token = secrets.get("fleet_token") or None
        self.registry_tokens: dict = {}  # (realm, service, scope) -> [token, whether the hub took it]
        self.registry_scope: dict = {}  # a hub's blob endpoint -> the (realm, service, scope) it last asked for
        self.registry_lock = threading.Lock()
        self.counters = Counters()
        self.stamps = Stamps(manifest["state_dir"], log)
        self.piece_size = int(manifest.get("piece_size", PIECE_SIZE))
        self.failures: list = []
        self.failures_lock = threading.Lock()
        self.peer_lock = threading.Lock()
        self.peer_ok: dict = {}  # peer base URL -> True (answered ping) / False (given up)
        self.peer_silent: set = set()  # peers that never answered a ping
        self.peer_first_try: dict = {}  # peer base URL -> when this rig first pinged it
        self.vouch_dead: set = set()  # upstreams that did not answer a piece-hash question
        self.stop = threading.Event()
        self.progress: Progress | None = None
        self.served = None  # the fleet server, when this rig serves: its byte count goes in the report
        self.items, self.prune = plan(manifest, self.stamps, args.reverify)
        # What the fleet server may forward: every file this run downloads or checks, by its server path.
        self.tracks = {
            "/%s/%s" % (item.model, item.rel): Track(item, self.piece_size) for item in self.items if item.action != "ok"
        }

    def track(self, item: Item) -> Track:
        return self.tracks["/%s/%s" % (item.model, item.rel)]

    # -- entry point ---------------------------------------------------------------------
    def run(self) -> int:
        started = time.monotonic()
        items, prune = self.items, self.prune
        self.counters.add("files", len(items))
        self.counters.add("files_stamped", sum(1 for i in items if i.action == "ok"))
        for dest in prune:
            self._prune(dest)
        todo_verify = [i for i in items if i.action == "verify"]
        todo_fetch = [i for i in items if i.action == "fetch"]
        self.log(
            "%d files: %d stamped, %d to hash, %d to download%s"
            % (
                len(items),
                len(items) - len(todo_verify) - len(todo_fetch),
                len(todo_verify),
                len(todo_fetch),
                (" (reverify)" if self.args.reverify else ""),
            )
        )
        with_work = todo_verify + todo_fetch
        try:
            code = self._check_disk(todo_fetch)
            if code != EXIT_OK:
                return code
            if todo_verify:
                mismatched = self._verify(todo_verify)
                todo_fetch.extend(mismatched)
            if todo_fetch:
                self._download_all(todo_fetch)
        finally:
            for track in self.tracks.values():
                if track.state != "done":
                    track.set_state("failed")
            self._tell_peers_done(with_work)
        return self._finish(started)

    def _finish(self, started: float) -> int:
        report = self.counters.snapshot()
        report["elapsed_s"] = round(time.monotonic() - started, 3)
        report["failures"] = list(self.failures)
        report["script_version"] = SCRIPT_VERSION
        report["ok"] = not self.failures
        try:
            path = self.args.report or os.path.join(self.manifest["state_dir"], REPORT_FILE)
            tmp = path + ".tmp"
            with open(tmp, "w") as handle:
                json.dump(report, handle, sort_keys=True, indent=1)
            os.replace(tmp, path)
        except OSError as exc:
            self.log("cannot write report: %s" % exc)
        sys.stdout.write(json.dumps(report, sort_keys=True) + "\n")
        sys.stdout.flush()
        if self.failures:
            for failure in self.failures:
                self.log.error(failure)
            return EXIT_FAILED
        self.log(
            "done: %d files ok; %s downloaded (%s from the hub, %s from fleet peers), %s hashed from disk, %.1fs"
            % (
                report["files"],
                human_bytes(report["bytes_downloaded"]),
                human_bytes(report["bytes_from_hub"]),
                human_bytes(report["bytes_from_peer"]),
                human_bytes(report["bytes_hashed"]),
                report["elapsed_s"],
            )
        )
        return EXIT_OK

    def _fail(self, message: str) -> None:
        with self.failures_lock:
            self.failures.append(message)
        self.counters.add("files_failed")

    def _prune(self, dest: str) -> None:
        try:
            os.unlink(dest)
            self.log("removed %s (no longer in the lock)" % dest)
            self.counters.add("files_pruned")
        except FileNotFoundError:
            pass
        except OSError as exc:
            self.log("cannot remove %s: %s" % (dest, exc))
        self.stamps.drop(dest)

    # -- disk space ----------------------------------------------------------------------
    def _check_disk(self, items: list) -> int:
        needed: dict = {}
        for item in items:
            directory = os.path.dirname(item.dest)
            os.makedirs(directory, exist_ok=True)
            dev = os.stat(directory).st_dev
            path, amount = needed.get(dev, (directory, 0))
            # Files to verify are not counted: they are usually right, and a wrong one is
            # caught by ENOSPC with a clear message rather than refusing a re-verify on a full disk.
            amount += item.size - min(item.part_size, item.size)
            needed[dev] = (path, amount)
        reserve = int(self.manifest.get("reserve_bytes") or 0)
        for path, amount in needed.values():
            vfs = os.statvfs(path)
            free = vfs.f_bavail * vfs.f_frsize
            if amount + reserve > free:
                message = (
                    "not enough disk space for the model files on the file system of %s: need %s "
                    "(+ %s reserve), %s free" % (path, human_bytes(amount), human_bytes(reserve), human_bytes(free))
                )
                self.failures.append(message)
                self._finish(time.monotonic())
                return EXIT_DISK
        return EXIT_OK

    # -- verify files already on disk ----------------------------------------------------
    def _verify(self, items: list) -> list:
        jobs = max(1, min(self.args.hash_jobs or os.cpu_count() or 1, len(items)))
        total = sum(item.size for item in items)
        self.log("hashing %d files (%s) with %d threads" % (len(items), human_bytes(total), jobs))
        mismatched = []
        self.progress = Progress(total, verb="hashed")
        reporter = threading.Thread(target=self._report_progress, daemon=True)
        reporter.start()
        try:
            results = self._verify_pool(items, jobs)
        finally:
            self.stop.set()
            reporter.join()
            self.stop.clear()
        self.log(self.progress.line())
        self.progress = None
        for item, ok in results:
            if ok:
                self._mark_done(item)
                continue
            item.action = "fetch"
            try:
                item.part_size = os.stat(item.part).st_size
            except FileNotFoundError:
                item.part_size = 0
            mismatched.append(item)
        return mismatched

    def _verify_pool(self, items: list, jobs: int) -> list:
        import concurrent.futures  # here, not at the top: see the note below the imports

        results = []
        with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
            futures = {pool.submit(self._verify_one, item): item for item in items}
            for future in concurrent.futures.as_completed(futures):
                item = futures[future]
                try:
                    ok = future.result()
                except OSError as exc:
                    self.log("%s: cannot read (%s): fetching it again" % (item.label, exc))
                    ok = False
                results.append((item, ok))
        return results

    def _verify_one(self, item: Item) -> bool:
        before = os.stat(item.dest)
        progress = self.progress
        done = [0]

        def on_bytes(count: int) -> None:
            done[0] += count
            if progress is not None:
                progress.add(item.label, count, done[0], item.size)

        digest = hash_file(item.dest, self.counters, on_bytes=on_bytes).hexdigest()
        if progress is not None:
            progress.finish(item.label)
        after = os.stat(item.dest)
        if digest == item.sha256 and (before.st_mtime_ns, before.st_size) == (after.st_mtime_ns, after.st_size):
            self.stamps.put(item.dest, after, item.sha256)
            self.counters.add("files_verified")
            self.log("%s verified on disk" % item.label)
            return True
        self.log("%s on disk does not match the lock (sha256 %s, want %s): fetching it again" % (item.label, digest, item.sha256))
        return False

    def _mark_done(self, item: Item) -> None:
        """The file matches the lock: its fleet server serves it whole, piece hashes from disk if asked."""
        track = self.track(item)
        with track.cond:
            track.state = "done"
            track.verified = item.size
            track.cond.notify_all()

    # -- downloads -----------------------------------------------------------------------
    def _download_all(self, items: list) -> None:
        import concurrent.futures  # here, not at the top: see the note below the imports

        total = sum(item.size - min(item.part_size, item.size) for item in items)
        self.progress = Progress(total, sources=self._source_totals)
        jobs = max(1, min(self.args.jobs, len(items)))
        self.log("downloading %d files (%s) with %d connections" % (len(items), human_bytes(total), jobs))
        reporter = threading.Thread(target=self._report_progress, daemon=True)
        reporter.start()
        try:
            with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
                futures = {pool.submit(self._download_one, item): item for item in items}
                for future in concurrent.futures.as_completed(futures):
                    item = futures[future]
                    try:
                        future.result()
                    except FetchError as exc:
                        self._fail(str(exc))
                    except Exception as exc:  # noqa: BLE001 - report any crash against the file
                        self._fail("%s: %s: %s" % (item.label, type(exc).__name__, exc))
                    finally:
                        if self.track(item).state != "done":
                            self.track(item).set_state("failed")
        finally:
            self.stop.set()
            reporter.join()
        self.log(self.progress.line())

    def _source_totals(self) -> str:
        parts = [
            "%s from the hub" % human_bytes(self.counters.get("bytes_from_hub")),
            "%s from fleet peers" % human_bytes(self.counters.get("bytes_from_peer")),
        ]
        if self.served is not None:
            parts.append("%s served" % human_bytes(self.served.bytes_served))
        return ", ".join(parts)

    def _report_progress(self) -> None:
        while not self.stop.wait(self.args.progress_interval):
            if self.progress is not None:
                self.log(self.progress.line())

    def _source(self, item: Item, track: Track) -> tuple:
        """(kind, url, peer base) to read the file from now: the nearest live upstream, else the hub."""
        if not track.hub_reader:
            base = self._live_upstream(item.upstreams)
            if base is not None:
                return "peer", base + item.key, base
            with track.cond:
                track.hub_reader = True
            self.log("%s: no fleet peer can send it: reading the hub" % item.label)
        return "hub", item.url_hub, None

    def _live_upstream(self, upstreams: tuple) -> str | None:
        """The nearest upstream that serves. Fleet peers start serving in the same pyinfra operation, so one
        that does not answer yet gets PEER_GRACE seconds (within --peer-wait) before this rig looks further
        up the chain: the chain keeps its shape when a peer starts late, and a dead peer does not keep this
        rig from a live one."""
        deadline = time.monotonic() + self.args.peer_wait
        while True:
            waiting = False
            for base in reversed(upstreams):
                with self.peer_lock:
                    known = self.peer_ok.get(base)
                    first = self.peer_first_try.setdefault(base, time.monotonic())
                if known is False:
                    continue
                if known or self._ping(base):
                    with self.peer_lock:
                        if base not in self.peer_ok:
                            self.peer_ok[base] = True
                            self.log("fleet peer %s is serving" % base)
                        if self.peer_ok[base]:
                            return base
                    continue
                if time.monotonic() - first < min(PEER_GRACE, self.args.peer_wait) and time.monotonic() < deadline:
                    waiting = True
                    break
                with self.peer_lock:
                    if base not in self.peer_ok:
                        self.peer_ok[base] = False
                        self.peer_silent.add(base)
                        self.log("fleet peer %s did not answer" % base)
            if not waiting:
                return None
            time.sleep(0.3)

    def _ping(self, base: str) -> bool:
        # here, not at the top: see the note below the imports
        import http.client
        import urllib.error
        import urllib.request

        try:
            with _open(self._request(base + "_rigfetch/ping", "peer"), timeout=3) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError, http.client.HTTPException):
            return False

    def _drop_peer(self, base: str, why: str) -> None:
        with self.peer_lock:
            if self.peer_ok.get(base):
                self.log("fleet peer %s dropped (%s)" % (base, why))
                self.counters.add("peers_dropped")
            self.peer_ok[base] = False

    def _tell_peers_done(self, items: list) -> None:
        """Tell each upstream of a file this rig needed that it is finished (an upstream stops serving
        once every peer it expects said so)."""
        # here, not at the top: see the note below the imports
        import http.client
        import urllib.error
        import urllib.request

        bases = {base for item in items for base in item.upstreams}
        with self.peer_lock:
            silent = set(self.peer_silent)
        for base in sorted(bases - silent):
            try:
                request = self._request(base + "_rigfetch/done", "peer", method="POST")
                with _open(request, timeout=5) as response:
                    response.read()
            except (urllib.error.URLError, OSError, http.client.HTTPException):
                pass

    def _request(self, url: str, kind: str, method: str = "GET", offset: int = 0, item: Item | None = None) -> Any:
        import urllib.request  # here, not at the top: see the note below the imports

        request = urllib.request.Request(url, method=method)
        request.add_header("User-Agent", USER_AGENT)
        request.add_header("Accept-Encoding", "identity")
        if offset:
            request.add_header("Range", "bytes=%d-" % offset)
        if kind == "peer":
            token = self.fleet_token
        elif item is not None and item.hub_auth == "registry":
            with self.registry_lock:  # never the HF token: the registry's own, once it asked for one
                scope = self.registry_scope.get(_hub_dir(item))
                token = self.registry_tokens[scope][0] if scope in self.registry_tokens else None
        else:
            token = self.hf_token
        if token:
            # Kept across a redirect on the same origin, dropped on one to another (_OriginRedirects): the
            # hub redirects LFS files to a CDN whose signed URLs must not see the token.
            request.add_header("Authorization", "Bearer %s" % token)
        return request

    def _registry_token(self, item: Item, challenge: str) -> None:
        """Get the anonymous bearer token a registry hub's 401 challenge points to (shared by the model's
        files); raise SourceRefused when there is none to get, or a fresh one was refused already."""
        import urllib.request  # here, not at the top: see the note below the imports

        scheme, _, rest = challenge.partition(" ")
        params = dict(re.findall(r'(\w+)="([^"]*)"', rest))
        realm = params.pop("realm", None)
        if scheme.lower() != "bearer" or not realm:
            raise SourceRefused("HTTP 401 without a bearer challenge (%r): rigfetch reads registries anonymously" % challenge)
        key = (realm, params.get("service", ""), params.get("scope", ""))
        with self.registry_lock:
            self.registry_scope[_hub_dir(item)] = key
            held = self.registry_tokens.get(key)
            if held is not None and not held[1]:  # one that never worked: refused, not expired
                raise SourceRefused("HTTP 401 with a fresh token from %s: the registry refuses anonymous pulls" % realm)
            query = urllib.parse.urlencode(sorted(params.items()))
            try:
                with _open(urllib.request.Request(realm + ("&" if "?" in realm else "?") + query,
                                                  headers={"User-Agent": USER_AGENT}), self.args.timeout) as response:
                    body = json.loads(response.read())
            except (OSError, ValueError) as exc:
                raise TransientError("no token from %s: %s" % (realm, exc))
            token = body.get("token") or body.get("access_token") if isinstance(body, dict) else None
            if not isinstance(token, str) or not token:
                raise SourceRefused("%s answered without a token" % realm)
            self.registry_tokens[key] = [token, False]
        self.log("%s: got a registry token from %s" % (item.label, realm))

    # -- piece hashes --------------------------------------------------------------------
    def _authority_digest(self, item: Item, track: Track, index: int) -> str | None:
        """The digest piece `index` must have, from the first upstream (head first) that vouches for it:
        one that read it from the hub, or holds the whole file verified against the lock."""
        with track.cond:
            known = track.authority.get(index)
        if known is not None:
            return known
        for base in item.upstreams:
            with self.peer_lock:
                if base in self.vouch_dead:
                    continue
            digests = self._ask_digests(base, item, index)
            if digests is None:
                with self.peer_lock:
                    self.vouch_dead.add(base)
                continue
            if digests:
                with track.cond:
                    for offset, digest in enumerate(digests):
                        track.authority[index + offset] = digest
                return digests[0]
        return None

    def _ask_digests(self, base: str, item: Item, index: int) -> list | None:
        """The digests `base` vouches for from piece `index` on ([] when it cannot), None if it did not answer."""
        # here, not at the top: see the note below the imports
        import http.client
        import urllib.error
        import urllib.request

        url = "%s_rigfetch/pieces/%s?from=%d&size=%d" % (base, item.key, index, self.piece_size)
        while True:
            try:
                with _open(self._request(url, "peer"), timeout=self.args.timeout) as response:
                    answer = json.loads(response.read().decode("utf-8"))
            except urllib.error.HTTPError as exc:
                exc.close()
                return []
            except (urllib.error.URLError, OSError, http.client.HTTPException, ValueError):
                return None
            if not (isinstance(answer, dict) and answer.get("pending")):
                break
            # It reads that piece from the hub and has not got there yet: ask again (it waited already).
        digests = answer.get("digests")
        if not isinstance(digests, list) or not all(isinstance(d, str) and SHA256_RE.match(d) for d in digests):
            return []
        return digests

    # -- one file ------------------------------------------------------------------------
    def _download_one(self, item: Item) -> None:
        os.makedirs(os.path.dirname(item.dest), exist_ok=True)
        track = self.track(item)
        track.set_state("active")
        partial = Partial()
        mismatches = 0
        stalls = 0
        peer_stalls = 0
        while True:
            kind, url, base = self._source(item, track)
            try:
                self._sync_part(item, partial, track)
                if partial.have < item.size:
                    self._stream(item, kind, url, partial, track)
                digest = partial.hasher.hexdigest()
                if digest != item.sha256:
                    raise MismatchError("sha256 %s, want %s" % (digest, item.sha256), digest)
                self._install(item, track)
                return
            except NotYet:
                time.sleep(0.2)  # the peer serves it once it starts on it: not a failure
            except Reauthorized:
                continue
            except PieceMismatch as exc:
                self.counters.add("pieces_rejected")
                self._rewind(item, partial)
                self._drop_peer(base, "piece %s of %s failed its hash" % (exc.args[0], item.label))
            except NoAuthority:
                self._rewind(item, partial)
                with track.cond:
                    track.hub_reader = True
                self.log("%s: no upstream vouches for its next piece: reading the rest from the hub" % item.label)
            except MismatchError as exc:
                self.counters.add("hash_mismatches")
                self._remove_part(item)
                partial.reset()
                track.restart()
                with track.cond:
                    track.hub_reader = True  # whatever vouched for these pieces was wrong: the hub only
                mismatches += 1
                self.log(
                    "%s: wrong bytes from %s: %s (attempt %d/%d)" % (item.label, url, exc.args[0], mismatches, self.args.retries)
                )
                if mismatches >= self.args.retries:
                    got = exc.args[1] if len(exc.args) > 1 else exc.args[0]
                    raise FetchError(
                        "%s: SHA-256 mismatch after %d attempts from %s: expected %s, got %s"
                        % (item.dest, mismatches, url, item.sha256, got)
                    )
            except SourceRefused as exc:
                if kind == "peer":
                    self._drop_peer(base, str(exc))
                    continue
                raise FetchError("%s: %s refused: %s" % (item.dest, url, exc))
            except TransientError as exc:
                progressed = len(exc.args) > 1 and exc.args[-1] == "progress"
                if kind == "peer":
                    self._rewind(item, partial)  # the next source may be another: start at a verified piece
                    peer_stalls = 0 if progressed else peer_stalls + 1
                    if peer_stalls >= 2:
                        self._drop_peer(base, exc.args[0])
                        peer_stalls = 0
                    continue
                stalls = 0 if progressed else stalls + 1
                limit = max(3, self.args.retries * 2)
                if stalls >= limit:
                    raise FetchError("%s: giving up after %d failed attempts: %s" % (item.dest, stalls, exc.args[0]))
                delay = min(30.0, self.args.retry_delay * (2 ** max(stalls - 1, 0)))
                self.log("%s: %s; resuming at byte %d in %.1fs" % (item.label, exc.args[0], partial.have, delay))
                time.sleep(delay)

    def _rewind(self, item: Item, partial: Partial) -> None:
        """Drop what follows the last verified piece, on disk, in the running hash and in the progress."""
        lost = partial.have - partial.mark
        partial.rewind()
        if lost and self.progress is not None:
            self.progress.add(item.label, -lost, partial.have, item.size)
        try:
            with open(item.part, "r+b") as handle:
                handle.truncate(partial.have)
        except FileNotFoundError:
            partial.reset()

    def _sync_part(self, item: Item, partial: Partial, track: Track) -> None:
        """Make `partial` describe the part file on disk: reuse the running hash after a retry in this
        process; after a crash or an interrupted earlier run, keep the part's whole pieces that still
        check out (against the authority, or as read from the hub) and hash them."""
        try:
            size = os.stat(item.part).st_size
        except FileNotFoundError:
            size = 0
        if size > item.size:
            self._remove_part(item)
            size = 0
        if partial.valid and size == partial.have:
            return
        partial.reset()
        track.restart()
        kept = 0
        if size:
            with open(item.part, "rb", buffering=0) as handle:
                while kept < size:
                    block = handle.read(min(self.piece_size, size - kept))
                    if not block:
                        break
                    self.counters.add("bytes_hashed", len(block))
                    if kept + len(block) < item.size and len(block) < self.piece_size:
                        # A piece cut short: the hub's reader keeps it and reads on from its end;
                        # a peer's reader has no digest to check it against yet, so drops it.
                        if track.hub_reader:
                            partial.hasher.update(block)
                            kept += len(block)
                            partial.have = kept
                        break
                    partial.hasher.update(block)
                    digest = partial.hasher.copy().hexdigest()
                    index = kept // self.piece_size
                    if not track.hub_reader and self._authority_digest(item, track, index) != digest:
                        partial.rewind()
                        break
                    kept += len(block)
                    partial.have = kept
                    partial.settle()
                    track.verified_to(kept, index, digest, track.hub_reader)
        if kept != size:
            with open(item.part, "r+b") as handle:
                handle.truncate(kept)
        if kept:
            self.log("%s: found a partial download of %d bytes; resuming after %d verified" % (item.label, size, kept))
        partial.valid = True

    def _stream(self, item: Item, kind: str, url: str, partial: Partial, track: Track) -> None:
        """Append the rest of the file to the part file, hashing as it arrives; each whole piece is
        checked (a peer's against the authority) before the verified mark moves past it."""
        # here, not at the top: see the note below the imports
        import http.client
        import urllib.error
        import urllib.request

        if partial.have:
            self.counters.add("resumes")
        request = self._request(url, kind, offset=partial.have, item=item)
        try:
            response = _open(request, timeout=self.args.timeout)
        except urllib.error.HTTPError as exc:
            exc.close()
            if exc.code == 503 and kind == "peer":
                raise NotYet()
            if exc.code == 401 and kind == "hub" and item.hub_auth == "registry":
                self._registry_token(item, exc.headers.get("WWW-Authenticate") or "")
                raise Reauthorized()
            if exc.code == 416 and partial.have:
                # The source cannot continue from our offset: start the file over.
                self._remove_part(item)
                partial.reset()
                track.restart()
                raise TransientError("range not satisfiable; restarting", "progress")
            if exc.code in (401, 403):
                hint = " (is HF_TOKEN set and accepted for this repository?)" if kind == "hub" else ""
                raise SourceRefused("HTTP %d%s" % (exc.code, hint))
            if exc.code == 404:
                raise SourceRefused("HTTP 404: the file is not at the locked revision" if kind == "hub" else "HTTP 404")
            raise TransientError("HTTP %d" % exc.code)
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
            raise TransientError("connection failed: %s" % (getattr(exc, "reason", None) or exc))
        if kind == "hub" and item.hub_auth == "registry":
            with self.registry_lock:  # the token worked: a later 401 means it expired
                held = self.registry_tokens.get(self.registry_scope.get(_hub_dir(item)))
                if held is not None:
                    held[1] = True
        with response:
            mode = "ab"
            if partial.have and response.status == 206:
                start, total = _content_range(response.headers.get("Content-Range"))
                if start != partial.have:
                    raise TransientError("source answered a range from byte %d, asked %d" % (start, partial.have))
                if total is not None and total != item.size:
                    raise MismatchError("source has %d bytes, want %d" % (total, item.size))
            elif response.status == 200:
                # A full answer (no Range support, or a fresh start): the hash must cover every byte.
                if partial.have:
                    partial.reset()
                    track.restart()
                partial.valid = True
                mode = "wb"
                length = response.headers.get("Content-Length")
                if length is not None and length.isdigit() and int(length) != item.size:
                    raise MismatchError("source has %s bytes, want %d" % (length, item.size))
            else:
                raise TransientError("unexpected HTTP %d" % response.status)
            counted = ("bytes_downloaded", "bytes_from_peer" if kind == "peer" else "bytes_from_hub", "bytes_streamed_hashed")
            start_have = partial.have
            with open(item.part, mode) as out:
                os.fchmod(out.fileno(), 0o644)
                try:
                    while True:
                        # read1: whatever has arrived (up to a block), so a peer's pieces move on as they come
                        chunk = response.read1(NET_BLOCK)
                        if not chunk:
                            break
                        if partial.have + len(chunk) > item.size:
                            raise MismatchError("source sent more than the locked %d bytes" % item.size)
                        self._take(item, kind, partial, track, out, memoryview(chunk))
                        self.counters.add_each(counted, len(chunk))
                        if self.progress is not None:
                            self.progress.add(item.label, len(chunk), partial.have, item.size)
                except (OSError, http.client.HTTPException) as exc:
                    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
                        raise FetchError("%s: disk full while writing %s" % (item.dest, item.part))
                    out.flush()
                    raise TransientError("transfer interrupted: %s" % exc, "progress" if partial.have > start_have else "stall")
                out.flush()
                os.fsync(out.fileno())
            if partial.have < item.size:
                raise TransientError(
                    "connection closed at byte %d of %d" % (partial.have, item.size),
                    "progress" if partial.have > start_have else "stall",
                )

    def _take(self, item: Item, kind: str, partial: Partial, track: Track, out: Any, view: memoryview) -> None:
        """Write and hash one received chunk, closing each piece it completes."""
        pos = 0
        while pos < len(view):
            piece_end = min((partial.have // self.piece_size + 1) * self.piece_size, item.size)
            take = min(len(view) - pos, piece_end - partial.have)
            part = view[pos : pos + take]
            out.write(part)
            partial.hasher.update(part)
            partial.have += take
            pos += take
            if partial.have == piece_end:
                index = (piece_end - 1) // self.piece_size
                digest = partial.hasher.copy().hexdigest()  # the prefix's: no second pass over the bytes
                own = kind == "hub"
                if not own:
                    want = self._authority_digest(item, track, index)
                    if want is None:
                        raise NoAuthority()
                    if want != digest:
                        raise PieceMismatch(index, digest, want)
                out.flush()  # the fleet server reads the part file: the piece must be there before the mark moves
                partial.settle()
                track.verified_to(partial.have, index, digest, own)

    def _install(self, item: Item, track: Track) -> None:
        if not os.path.exists(item.part) and item.size == 0:
            open(item.part, "wb").close()
        os.chmod(item.part, 0o644)
        os.replace(item.part, item.dest)
        _fsync_dir(os.path.dirname(item.dest))
        self.stamps.put(item.dest, os.stat(item.dest), item.sha256)
        track.set_state("done")
        self.counters.add("files_downloaded")
        if self.progress is not None:
            self.progress.finish(item.label)
        self.log("%s downloaded and verified (%s)" % (item.label, human_bytes(item.size)))

    def _remove_part(self, item: Item) -> None:
        try:
            os.unlink(item.part)
        except FileNotFoundError:
            pass


def _hub_dir(item: Item) -> str:
    """The hub URL the item's file is under (a registry repository's blob endpoint): models of one
    repository share its token."""
    return item.url_hub.rsplit("/", 1)[0]


def _origin(url: str) -> tuple:
    """(scheme, host, port) of a URL, the scheme's default port filled in: what a browser calls its origin."""
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    return scheme, (parts.hostname or "").lower(), parts.port or {"http": 80, "https": 443}.get(scheme)


_OPENER = None


def _open(request: Any, timeout: float) -> Any:
    """urllib's urlopen, except that a redirect to another origin drops the Authorization header and one on
    the same origin keeps it, as huggingface_hub and curl do: the Hub answers an LFS file with a 302 to a
    CDN (signed URLs; the token must not leave the Hub), and a renamed repository with a redirect on the Hub
    itself, where a gated repository still needs the token. urllib alone either forwards it to every host
    (add_header) or to none (add_unredirected_header)."""
    global _OPENER
    if _OPENER is None:
        # here, not at the top: see the note below the imports
        import urllib.request

        class _OriginRedirects(urllib.request.HTTPRedirectHandler):
            def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[no-untyped-def]
                new = super().redirect_request(req, fp, code, msg, headers, newurl)
                if new is not None and _origin(newurl) != _origin(req.full_url):
                    new.remove_header("Authorization")
                return new

        _OPENER = urllib.request.build_opener(_OriginRedirects)
    return _OPENER.open(request, timeout=timeout)


def _content_range(value: str | None) -> tuple:
    match = re.match(r"^\s*bytes\s+(\d+)-(\d+)/(\d+|\*)\s*$", value or "")
    if not match:
        raise TransientError("bad Content-Range %r" % (value,))
    total = None if match.group(3) == "*" else int(match.group(3))
    return int(match.group(1)), total


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------------------
# fleet server


def _fleet_server(address: tuple, fetcher: Fetcher, token: str, log: Log, expect_peers: int) -> Any:
    """A FleetServer listening on `address` for `fetcher`'s files (its classes are built here: http.server
    and hmac are imported only by a rig that serves)."""
    import hmac
    import http.server

    class FleetServer(http.server.ThreadingHTTPServer):
        daemon_threads = True
        allow_reuse_address = True

        def __init__(self, address: tuple, fetcher: Fetcher, token: str, log: Log, expect_peers: int) -> None:
            super().__init__(address, FleetHandler)
            self.token = token
            self.log = log
            self.stamps = fetcher.stamps  # shared: a file this run stamps is served whole at once
            self.tracks = fetcher.tracks
            self.files: dict = {}
            for model in fetcher.manifest["models"]:
                for entry in model["files"]:
                    key = "/%s/%s" % (model["name"], entry["path"])
                    self.files[key] = (os.path.join(model["dir"], entry["path"]), entry["size"], entry["sha256"])
            self.failpoints = _failpoints(fetcher.manifest["state_dir"], log)
            self.expect_peers = expect_peers
            self.peers_done = 0
            self.active = 0
            self.last_activity = time.monotonic()
            self.bytes_served = 0
            self.started = time.monotonic()
            self.closing = False
            self.state_lock = threading.Lock()
            self.disk_digests: dict = {}  # (dest, piece size) -> digests of a stamped file, hashed once if asked
            self.disk_lock = threading.Lock()

        def touch(self, delta: int) -> None:
            with self.state_lock:
                self.active += delta
                self.last_activity = time.monotonic()

        def served(self, count: int) -> None:
            with self.state_lock:
                self.bytes_served += count
                self.last_activity = time.monotonic()

        def stamped(self, dest: str, size: int, sha256: str) -> bool:
            try:
                return self.stamps.valid(dest, os.stat(dest), sha256, size)
            except OSError:
                return False

        def digests_on_disk(self, dest: str, size: int, sha256: str, piece_size: int) -> list | None:
            """Piece digests of a file this rig holds verified against the lock (hashed once per run)."""
            with self.disk_lock:
                key = (dest, piece_size)
                if key not in self.disk_digests:
                    if not self.stamped(dest, size, sha256):
                        return None
                    digests = []
                    hasher = hashlib.sha256()
                    with open(dest, "rb", buffering=0) as handle:
                        while True:
                            block = handle.read(piece_size)
                            if not block:
                                break
                            hasher.update(block)
                            digests.append(hasher.copy().hexdigest())
                    self.disk_digests[key] = digests
                return self.disk_digests[key]

    class FleetHandler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server: FleetServer

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - stdlib signature
            self.server.log("serve: %s %s" % (self.address_string(), format % args))

        def _authorized(self) -> bool:
            header = self.headers.get("Authorization") or ""
            given = header[7:] if header.startswith("Bearer ") else ""
            return hmac.compare_digest(given.encode("utf-8"), self.server.token.encode("utf-8"))

        def _plain(self, code: int, text: str, content_type: str = "text/plain") -> None:
            body = (text + "\n").encode("utf-8")
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def do_POST(self) -> None:  # noqa: N802 - stdlib naming
            self.server.touch(0)
            if not self._authorized():
                return self._plain(401, "unauthorized")
            if self.path == "/_rigfetch/done":
                with self.server.state_lock:
                    self.server.peers_done += 1
                return self._plain(200, "bye")
            return self._plain(404, "not found")

        def do_HEAD(self) -> None:  # noqa: N802
            self.do_GET()

        def do_GET(self) -> None:  # noqa: N802
            self.server.touch(1)
            try:
                self._get()
            finally:
                self.server.touch(-1)

        def _get(self) -> None:
            if not self._authorized():
                return self._plain(401, "unauthorized")
            parts = urllib.parse.urlsplit(self.path)
            path = urllib.parse.unquote(parts.path)
            if path == "/_rigfetch/ping":
                return self._plain(200, "ok")
            if path.startswith("/_rigfetch/pieces/"):
                return self._pieces(path[len("/_rigfetch/pieces") :], urllib.parse.parse_qs(parts.query))
            entry = self.server.files.get(path)
            if entry is None:
                return self._plain(404, "not in the manifest")
            dest, size, sha256 = entry
            track = self.server.tracks.get(path)
            state = track.state if track is not None else "done"
            if state == "failed" or (state == "done" and not self.server.stamped(dest, size, sha256)):
                return self._plain(404, "not verified here")
            if state == "waiting":
                return self._plain(503, "not started on it yet")
            span = self._range(size)
            if span is None:
                return None
            start, end, status = span
            count = end - start + 1 if size else 0
            self.send_response(status)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(count))
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("X-Rigfetch-Sha256", sha256)
            if status == 206:
                self.send_header("Content-Range", "bytes %d-%d/%d" % (start, end, size))
            self.end_headers()
            if self.command == "HEAD" or count == 0:
                return None
            self.wfile.flush()
            try:
                self._send(path, track, dest, start, end + 1)
            except (OSError, _Abandon) as exc:  # the peer went away, or this rig's copy started over
                self.close_connection = True
                self.server.log("serve: %s: transfer of %s stopped: %s" % (self.address_string(), path, exc))
            return None

        def _range(self, size: int) -> tuple | None:
            header = self.headers.get("Range")
            if not header:
                return 0, size - 1, 200
            match = re.match(r"^bytes=(\d+)-(\d*)$", header.strip())
            if not match or int(match.group(1)) >= size:
                self.send_response(416)
                self.send_header("Content-Range", "bytes */%d" % size)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return None
            end = min(int(match.group(2)), size - 1) if match.group(2) else size - 1
            return int(match.group(1)), end, 206

        def _send(self, path: str, track: Any, dest: str, pos: int, stop: int) -> None:
            """Send bytes [pos, stop) of a file: as soon as they are verified here when it is still arriving."""
            handle = None
            generation = None
            try:
                while pos < stop:
                    if track is None:
                        ready, name = stop, dest
                    else:
                        with track.cond:
                            while track.state == "active" and track.verified <= pos and not self.server.closing:
                                if generation is not None and track.generation != generation:
                                    break
                                track.cond.wait(1.0)
                            if track.state == "failed" or self.server.closing:
                                raise _Abandon("this rig's copy failed")
                            if generation is not None and track.generation != generation:
                                # The part file was replaced (even if the new one is done): the open
                                # handle holds the old bytes.
                                raise _Abandon("this rig's copy started over")
                            if generation is None:
                                generation = track.generation
                            done = track.state == "done"
                            ready = stop if done else min(track.verified, stop)
                            name = track.item.dest if done else track.item.part
                        if ready <= pos:
                            continue
                    if handle is None:
                        try:
                            handle = open(name, "rb")
                        except FileNotFoundError:
                            time.sleep(0.05)  # renamed into place between the check and the open
                            continue
                    sent = self._send_span(path, handle, pos, ready - pos)
                    self.server.served(sent)
                    pos += sent
            finally:
                if handle is not None:
                    handle.close()

        def _send_span(self, path: str, handle: Any, pos: int, count: int) -> int:
            corrupt = self.server.failpoints.get("corrupt_served_piece")
            if corrupt and "/" + corrupt["file"] == path:
                at = corrupt["piece"] * corrupt["piece_size"]
                if pos <= at < pos + count:
                    # Test-only failpoint (see _failpoints): flip one byte of this piece on its way out.
                    sent = self.connection.sendfile(handle, pos, at - pos) if at > pos else 0
                    if pos + sent != at:
                        return sent
                    byte = os.pread(handle.fileno(), 1, at)
                    self.connection.sendall(bytes([byte[0] ^ 0xFF]))
                    self.server.log(
                        "FAILPOINT corrupt_served_piece: sent piece %d of %s with one byte flipped" % (corrupt["piece"], path)
                    )
                    return sent + 1
            return self.connection.sendfile(handle, pos, count)

        def _pieces(self, path: str, query: dict) -> None:
            entry = self.server.files.get(path)
            try:
                start = int(query.get("from", ["0"])[0])
                piece_size = int(query.get("size", [str(PIECE_SIZE)])[0])
            except ValueError:
                return self._plain(400, "bad query")
            if entry is None or start < 0 or piece_size < 4096:
                return self._plain(404, "not in the manifest")
            dest, size, sha256 = entry
            track = self.server.tracks.get(path)
            digests = None
            pending = False
            if track is not None and track.piece_size == piece_size:
                deadline = time.monotonic() + 15.0
                with track.cond:
                    while not track.authoritative_run(start) and track.may_vouch() and track.state != "done":
                        left = deadline - time.monotonic()
                        if left <= 0 or self.server.closing:
                            break
                        track.cond.wait(min(left, 1.0))
                    digests = track.authoritative_run(start)
                    pending = not digests and track.state != "done" and track.may_vouch() and start < track.pieces
            if digests is None and not pending:
                # Not fetched in this run, or verified on disk in it: a stamped file vouches from disk.
                digests = (self.server.digests_on_disk(dest, size, sha256, piece_size) or [])[start:]
            answer = {"digests": digests, "pending": pending} if pending else {"digests": digests}
            return self._plain(200, json.dumps(answer), "application/json")

    return FleetServer(address, fetcher, token, log, expect_peers)


class _Abandon(Exception):
    """A transfer this rig can no longer continue (its own copy failed or started over)."""


def _failpoints(state_dir: str, log: Log) -> dict:
    """Test-only fault injection, read from {state_dir}/rigfetch-failpoints.json when a test put it there:
    {"corrupt_served_piece": {"file": "<model>/<path>", "piece": N, "piece_size": P}} makes this rig's
    fleet server flip one byte of that piece whenever it sends it (a peer with bad memory or a bad NIC),
    so tests can show that the rigs below it catch and route around it. No file, no effect."""
    path = os.path.join(state_dir, FAILPOINTS_FILE)
    try:
        with open(path) as handle:
            points = json.load(handle)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log("WARNING: ignoring %s: %s" % (path, exc))
        return {}
    if not isinstance(points, dict):
        return {}
    log("WARNING: failpoints active from %s: %s" % (path, ", ".join(sorted(points))))
    return points


def start_server(fetcher: Fetcher, args: argparse.Namespace, token: str | None, log: Log) -> Any:
    """Start serving in a background thread; None when that is impossible (peers then use the hub)."""
    if not token:
        log("WARNING: no fleet token on stdin; not serving (fleet peers will use the hub)")
        return None
    host, _, port = args.listen.rpartition(":")
    try:
        server = _fleet_server((host or "0.0.0.0", int(port)), fetcher, token, log, args.expect_peers)
    except (OSError, ValueError) as exc:
        # This rig itself is fine, so this is not its failure; peers fall back to other upstreams or the hub.
        log("WARNING: cannot serve model files on %s (%s): fleet peers will read elsewhere" % (args.listen, exc))
        return None
    log(
        "serving %d files (verified pieces as they arrive) on %s for %d peers"
        % (len(server.files), args.listen, args.expect_peers)
    )
    server.started = time.monotonic()
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True)
    thread.start()
    return server


def wait_server(server: Any, args: argparse.Namespace, log: Log) -> dict:
    """Serve until every expected peer said it is done, or nobody asked for a while, or the TTL."""
    why = ""
    try:
        while True:
            with server.state_lock:
                active, done, idle = server.active, server.peers_done, time.monotonic() - server.last_activity
            if active == 0 and done >= args.expect_peers:
                why = "all %d expected peers finished" % args.expect_peers
                break
            if active == 0 and idle >= args.idle_timeout:
                why = "idle for %ds (%d of %d peers finished)" % (idle, done, args.expect_peers)
                break
            if time.monotonic() - server.started >= args.ttl:
                why = "time limit of %ds reached" % args.ttl
                break
            time.sleep(0.1)
    finally:
        server.closing = True
        server.shutdown()
        server.server_close()
    log("stopped serving: %s; %s served" % (why, human_bytes(server.bytes_served)))
    return {"bytes_served": server.bytes_served, "peers_done": server.peers_done, "reason": why}


# ------------------------------------------------------------------------------------------
# command line


def read_secrets(enabled: bool) -> dict:
    if not enabled:
        return {}
    line = sys.stdin.readline()
    if not line.strip():
        return {}
    try:
        secrets = json.loads(line)
    except ValueError:
        raise ManifestError("--secrets-stdin: stdin is not one JSON line")
    if not isinstance(secrets, dict):
        raise ManifestError("--secrets-stdin: expected a JSON object")
    return {key: value for key, value in secrets.items() if isinstance(value, str)}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rigfetch", description="Fetch and verify locked model files.")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--manifest", help="path of the JSON manifest")
    source.add_argument("--manifest-b64", help="the manifest as urlsafe base64 of zlib-compressed JSON")
    parser.add_argument("--check", action="store_true", help="report what needs work from stamps only; write nothing")
    parser.add_argument("--reverify", action="store_true", help="hash every file, ignoring stamps")
    parser.add_argument("--retries", type=int, default=3, help="attempts per file on a hash mismatch")
    parser.add_argument("--jobs", type=int, default=4, help="files downloaded at once")
    parser.add_argument("--hash-jobs", type=int, default=0, help="files hashed at once (0: one per core)")
    parser.add_argument("--timeout", type=float, default=60.0, help="network read timeout in seconds")
    parser.add_argument("--retry-delay", type=float, default=2.0, help="first back-off after a network error (s)")
    parser.add_argument("--peer-wait", type=float, default=60.0, help="seconds to wait for a fleet peer to serve")
    parser.add_argument("--progress-interval", type=float, default=5.0, help="seconds between progress lines")
    parser.add_argument("--secrets-stdin", action="store_true", help="read {hf_token, fleet_token} JSON from stdin")
    parser.add_argument("--report", help="where to write the JSON counters (default: state_dir/fetch-report.json)")
    parser.add_argument("--log", help="progress log (default: state_dir/fetch.log)")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr (the log still gets it)")
    parser.add_argument("--terse", action="store_true", help="on stderr only the plan, progress, peer state and end lines")
    parser.add_argument("--listen", default="0.0.0.0:8765", help="address:port to serve fleet peers on")
    parser.add_argument("--expect-peers", type=int, default=0, help="serve until this many fleet peers finish (0: no serving)")
    parser.add_argument("--idle-timeout", type=float, default=120.0, help="stop serving after this long idle (s)")
    parser.add_argument("--ttl", type=float, default=6 * 3600.0, help="hard time limit for serving (s)")
    return parser


def main(argv: list | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        manifest = load_manifest(args.manifest, args.manifest_b64)
        if args.retries < 1 or args.jobs < 1:
            raise ManifestError("--retries and --jobs must be at least 1")
    except ManifestError as exc:
        sys.stderr.write("rigfetch: %s\n" % exc)
        return EXIT_USAGE
    state_dir = manifest["state_dir"]

    if args.check:
        stamps = Stamps(state_dir)
        items, prune = plan(manifest, stamps, args.reverify)
        sys.stdout.write(json.dumps(check_report(manifest, items, prune), sort_keys=True) + "\n")
        return EXIT_OK

    try:
        secrets = read_secrets(args.secrets_stdin)
    except ManifestError as exc:
        sys.stderr.write("rigfetch: %s\n" % exc)
        return EXIT_USAGE
    log = Log(args.log or os.path.join(state_dir, LOG_FILE), quiet=args.quiet, terse=args.terse)
    try:
        os.makedirs(state_dir, exist_ok=True)
        with open(os.path.join(state_dir, LOCK_FILE), "a") as lock_handle:
            try:
                fcntl.flock(lock_handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                log("another rigfetch is running on this rig; waiting for it")
                fcntl.flock(lock_handle.fileno(), fcntl.LOCK_EX)
            fetcher = Fetcher(manifest, args, secrets, log)
            # Serve from the start: files this rig has whole, and the verified pieces of those still arriving.
            server = start_server(fetcher, args, secrets.get("fleet_token"), log) if args.expect_peers > 0 else None
            fetcher.served = server
            try:
                return fetcher.run()
            finally:
                if server is not None:
                    _emit({"serve": wait_server(server, args, log)})
    finally:
        log.close()


def _emit(report: dict) -> None:
    sys.stdout.write(json.dumps(report, sort_keys=True) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
