"""The fetch: every file of the manifest made to match the lock, hashed where it lies, downloaded where it
does not (from the nearest live upstream, else the hub), hashed as it streams, each piece checked before it
is forwarded, and stamped once its whole-file SHA-256 matches. Imported only by a run that fetches."""

from __future__ import annotations

import concurrent.futures
import errno
import http.client
import json
import os
import sys
import threading
import time
import urllib.error

from .disk import Stamps, fsync_dir, hash_file, plan
from .log import Counters, Progress, human_bytes
from .manifest import EXIT_DISK, EXIT_FAILED, EXIT_OK, PIECE_SIZE, SCRIPT_VERSION
from .peers import Upstreams
from .pieces import NoAuthority, NotYet, Partial, PieceMismatch, Track
from .registry_auth import RegistryTokens
from .web import Reauthorized, SourceRefused, TransientError, content_range, open_url, request

TYPE_CHECKING = False  # typing's own flag: the annotations are strings, and typing is 5 ms of every start
if TYPE_CHECKING:
    import argparse
    from typing import Any

    from .disk import Item
    from .log import Log

REPORT_FILE = "fetch-report.json"
NET_BLOCK = 1 << 20


class FetchError(Exception):
    """A file could not be fetched; the message is meant for the user."""


class MismatchError(Exception):
    """The bytes a source sent are not the locked bytes (hash, size or length mismatch)."""


class Fetcher:
    """One run over a manifest: its plan, counters, stamps and failures, and this rig's tracks (what its
    fleet server may forward)."""

    def __init__(self, manifest: dict, args: argparse.Namespace, secrets: dict, log: Log) -> None:
        self.manifest = manifest
        self.args = args
        self.log = log
        self.hf_token = secrets.get("hf_token") or None
        self.registry = RegistryTokens(args.timeout, log)
        self.counters = Counters()
        self.stamps = Stamps(manifest["state_dir"], log)
        self.piece_size = int(manifest.get("piece_size", PIECE_SIZE))
        self.upstreams = Upstreams(secrets.get("fleet_token") or None, self.piece_size, args.peer_wait, args.timeout, log,
                                   self.counters)
        self.failures: list = []
        self.failures_lock = threading.Lock()
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
            self.upstreams.tell_done(with_work)
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
