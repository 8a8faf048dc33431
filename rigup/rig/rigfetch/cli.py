"""rigfetch's command line: `--check` (stamps only, no writes) or a fetch, one rig at a time (a lock in the
state dir), serving fleet peers while it runs when asked to; its report as JSON lines on stdout."""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import sys

from .disk import Stamps, check_report, plan
from .log import Log
from .manifest import EXIT_OK, EXIT_USAGE, ManifestError, load_manifest

LOG_FILE = "fetch.log"
LOCK_FILE = "fetch.lock"


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
    # here, not at the top: a fetch's modules (HTTP, threads) are most of a start-up that `--check`, run on
    # every converged re-run, does not need
    from .fetcher import Fetcher

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
            server = None
            if args.expect_peers > 0:
                # here, not at the top: only a rig that serves needs http.server and hmac
                from . import fleet_server

                # Serve from the start: files this rig has whole, and the verified pieces of those still arriving.
                server = fleet_server.start_server(fetcher, args, secrets.get("fleet_token"), log)
            fetcher.served = server
            try:
                return fetcher.run()
            finally:
                if server is not None:
                    _emit({"serve": fleet_server.wait_server(server, args, log)})
    finally:
        log.close()


def _emit(report: dict) -> None:
    sys.stdout.write(json.dumps(report, sort_keys=True) + "\n")
    sys.stdout.flush()
