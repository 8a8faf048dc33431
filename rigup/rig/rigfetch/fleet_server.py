"""This rig's fleet server: while it fetches, it serves its files to the rigs after it in each chain (their
fleet token required), each byte only once verified here, and the digests of the pieces it vouches for.
Imported only by a rig that serves (http.server and hmac are not needed otherwise)."""

from __future__ import annotations

import hashlib
import hmac
import http.server
import json
import os
import re
import threading
import time
import urllib.parse

from .log import human_bytes
from .manifest import PIECE_SIZE

TYPE_CHECKING = False  # typing's own flag: the annotations are strings, and typing is 5 ms of every start
if TYPE_CHECKING:
    import argparse
    from typing import Any

    from .fetcher import Fetcher
    from .log import Log

FAILPOINTS_FILE = "rigfetch-failpoints.json"


class FleetServer(http.server.ThreadingHTTPServer):
    """Serves a fetcher's files to the rigs below this one in their chains: whole once verified, and the
    verified pieces of those still arriving; with the piece digests this rig vouches for."""

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
        self.failpoints = failpoints(fetcher.manifest["state_dir"], log)
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
    """One peer's request: a file (or a range of it), its piece digests, a ping, or its "done"."""

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
        except (OSError, Abandon) as exc:  # the peer went away, or this rig's copy started over
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
                            raise Abandon("this rig's copy failed")
                        if generation is not None and track.generation != generation:
                            # The part file was replaced (even if the new one is done): the open
                            # handle holds the old bytes.
                            raise Abandon("this rig's copy started over")
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
                # Test-only failpoint (see failpoints): flip one byte of this piece on its way out.
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


class Abandon(Exception):
    """A transfer this rig can no longer continue (its own copy failed or started over)."""


def failpoints(state_dir: str, log: Log) -> dict:
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
        server = FleetServer((host or "0.0.0.0", int(port)), fetcher, token, log, args.expect_peers)
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
