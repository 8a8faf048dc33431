"""What rigfetch tells: progress lines to stderr and the log the user tails, its counters (the JSON report's),
and the periodic progress line of a download or a verify."""

from __future__ import annotations

import os
import sys
import threading
import time

TYPE_CHECKING = False  # typing's own flag: the annotations are strings, and typing is 5 ms of every start
if TYPE_CHECKING:
    from typing import Callable


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
