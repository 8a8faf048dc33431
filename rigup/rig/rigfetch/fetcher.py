"""The fetch: every file of the manifest made to match the lock: stamped ones trusted, those on disk hashed
(one thread per core), the rest downloaded (download.py), stale ones pruned; the run's counters, failures
and report. Imported only by a run that fetches."""

from __future__ import annotations

import concurrent.futures
import json
import os
import sys
import threading
import time

from .disk import Stamps, hash_file, plan
from .download import Download, FetchError
from .log import Counters, Progress, human_bytes
from .manifest import EXIT_DISK, EXIT_FAILED, EXIT_OK, PIECE_SIZE, SCRIPT_VERSION
from .peers import Upstreams
from .pieces import Track
from .registry_auth import RegistryTokens

TYPE_CHECKING = False  # typing's own flag: the annotations are strings, and typing is 5 ms of every start
if TYPE_CHECKING:
    import argparse

    from .disk import Item
    from .log import Log

REPORT_FILE = "fetch-report.json"


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
                download = Download(self.args, self.log, self.counters, self.progress, self.stamps, self.track,
                                    self.upstreams, self.registry, self.hf_token, self.piece_size)
                futures = {pool.submit(download.fetch, item): item for item in items}
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
