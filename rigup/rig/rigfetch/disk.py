"""What is on this rig's disk: the stamps of verified files, the plan of each file of a manifest (ok,
verify, fetch; shared by --check and a fetch), and hashing."""

from __future__ import annotations

import hashlib
import json
import os
import stat as stat_module
import threading
import time
import urllib.parse

from .manifest import PART_SUFFIX, SCRIPT_VERSION

TYPE_CHECKING = False  # typing's own flag: the annotations are strings, and typing is 5 ms of every start
if TYPE_CHECKING:
    from typing import Any, Callable

    from .log import Counters, Log

STAMPS_FILE = "model-stamps.json"
HASH_BLOCK = 8 << 20  # 8 MiB reads: large enough that the per-call overhead vanishes


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


def fsync_dir(path: str) -> None:
    """Make a rename in `path` durable (best effort: some file systems refuse a directory's fsync)."""
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
