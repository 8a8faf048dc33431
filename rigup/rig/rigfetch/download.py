"""One file's download: from the nearest live upstream, else the hub, appended to its part file and hashed
as it streams, each piece checked (a peer's against the authority) before the verified mark moves past it,
rewound to the last verified piece when a source fails, and installed once its SHA-256 is the lock's."""

from __future__ import annotations

import errno
import http.client
import os
import time
import urllib.error

from .disk import fsync_dir
from .log import human_bytes
from .pieces import NoAuthority, NotYet, Partial, PieceMismatch
from .web import Reauthorized, SourceRefused, TransientError, content_range, open_url, request

TYPE_CHECKING = False  # typing's own flag: the annotations are strings, and typing is 5 ms of every start
if TYPE_CHECKING:
    import argparse
    from typing import Any, Callable

    from .disk import Item, Stamps
    from .log import Counters, Log, Progress
    from .peers import Upstreams
    from .pieces import Track
    from .registry_auth import RegistryTokens

NET_BLOCK = 1 << 20


class FetchError(Exception):
    """A file could not be fetched; the message is meant for the user."""


class MismatchError(Exception):
    """The bytes a source sent are not the locked bytes (hash, size or length mismatch)."""


class Download:
    """Downloads the files of one run, each by `fetch` in a thread of its own, into the run's counters,
    progress and stamps, from its upstreams or the hub with its tokens."""

    def __init__(self, args: argparse.Namespace, log: Log, counters: Counters, progress: Progress, stamps: Stamps,
                 track_of: Callable[[Item], Track], upstreams: Upstreams, registry: RegistryTokens,
                 hf_token: str | None, piece_size: int) -> None:
        self.args = args  # retries, retry_delay, timeout
        self.log = log
        self.counters = counters
        self.progress = progress
        self.stamps = stamps
        self.track_of = track_of  # the Track of a file this run fetches: what its fleet server may forward
        self.upstreams = upstreams
        self.registry = registry
        self.hf_token = hf_token
        self.piece_size = piece_size

    def _source(self, item: Item, track: Track) -> tuple:
        """(kind, url, peer base) to read the file from now: the nearest live upstream, else the hub."""
        if not track.hub_reader:
            base = self.upstreams.live(item.upstreams)
            if base is not None:
                return "peer", base + item.key, base
            with track.cond:
                track.hub_reader = True
            self.log("%s: no fleet peer can send it: reading the hub" % item.label)
        return "hub", item.url_hub, None


    def _request(self, url: str, kind: str, offset: int, item: Item) -> Any:
        """A request for `item`'s file from its source: a peer gets the fleet token, a registry hub its own
        (never the HF token), the Hugging Face hub the HF token."""
        if kind == "peer":
            token = self.upstreams.token
        elif item.hub_auth == "registry":
            token = self.registry.token(item)
        else:
            token = self.hf_token
        return request(url, token, offset=offset)

    def fetch(self, item: Item) -> None:
        """Make `item`'s file whole and verified from its sources (the nearest live upstream, else the hub),
        resuming from its part file; FetchError when it cannot."""
        os.makedirs(os.path.dirname(item.dest), exist_ok=True)
        track = self.track_of(item)
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
                self.upstreams.drop(base, "piece %s of %s failed its hash" % (exc.args[0], item.label))
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
                    self.upstreams.drop(base, str(exc))
                    continue
                raise FetchError("%s: %s refused: %s" % (item.dest, url, exc))
            except TransientError as exc:
                progressed = len(exc.args) > 1 and exc.args[-1] == "progress"
                if kind == "peer":
                    self._rewind(item, partial)  # the next source may be another: start at a verified piece
                    peer_stalls = 0 if progressed else peer_stalls + 1
                    if peer_stalls >= 2:
                        self.upstreams.drop(base, exc.args[0])
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
                    if not track.hub_reader and self.upstreams.authority_digest(item, track, index) != digest:
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
        if partial.have:
            self.counters.add("resumes")
        req = self._request(url, kind, partial.have, item)
        try:
            response = open_url(req, timeout=self.args.timeout)
        except urllib.error.HTTPError as exc:
            exc.close()
            if exc.code == 503 and kind == "peer":
                raise NotYet()
            if exc.code == 401 and kind == "hub" and item.hub_auth == "registry":
                self.registry.renew(item, exc.headers.get("WWW-Authenticate") or "")
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
            self.registry.took(item)
        with response:
            mode = "ab"
            if partial.have and response.status == 206:
                start, total = content_range(response.headers.get("Content-Range"))
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
                    want = self.upstreams.authority_digest(item, track, index)
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
        fsync_dir(os.path.dirname(item.dest))
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
