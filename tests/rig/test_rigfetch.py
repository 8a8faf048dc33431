"""rigfetch.py (the on-rig fetch/verify zipapp, built from rigup/rig/rigfetch) against the fake Hugging Face
endpoint, run as the rig runs it: a subprocess with a JSON manifest, secrets on stdin, counters on stdout."""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rigup.rig.onefile import RIGFETCH_PACKAGE
from rigup.rig.rigfetch.fleet_server import FAILPOINTS_FILE
from rigup.rig.rigfetch.log import Log
from rigup.rig.rigfetch.manifest import EXIT_DISK, ManifestError, encode_manifest, load_manifest, validate_manifest
from rigup_testbed import hfhub
from tests.support.artifacts import (
    GATED,
    QWEN,
    RIGFETCH,
    SHARD1,
    SHARD2,
    TOKEN,
    commit_files,
    hub_spec,
    manifest,
    model_entry,
    run_rigfetch,
    sha256_file,
)


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[hfhub.HfHub]:
    with hfhub.HfHub(tmp_path_factory.mktemp("hub"), spec=hub_spec()) as hub:
        yield hub


@pytest.fixture(autouse=True)
def clean_hub(hub: hfhub.HfHub) -> Iterator[None]:
    admin = hub.admin()
    admin.clear_faults()
    admin.configure(tokens=[], redirect_lfs=False)
    admin.reset_stats()
    yield
    admin.clear_faults()


def _qwen(hub: hfhub.HfHub, tmp_path: Path, index: int = -1) -> dict:
    return manifest(tmp_path / "state", model_entry(hub, QWEN, tmp_path / "models" / "qwen", index))


def _total(man: dict) -> int:
    return sum(f["size"] for m in man["models"] for f in m["files"])


def _report(lines: list[dict]) -> dict:
    return next(line for line in lines if "bytes_downloaded" in line)


def _file_stats(hub: hfhub.HfHub, repo: str, path: str) -> dict:
    return hub.admin().stats()["files"].get(f"{repo}/{path}", {"bytes": 0, "get": 0, "range_get": 0})


def test_fresh_fetch_lands_every_file_verified(hub: hfhub.HfHub, tmp_path: Path) -> None:
    man = _qwen(hub, tmp_path)
    code, lines, err = run_rigfetch(man)
    assert code == 0, err
    report = _report(lines)
    assert report["files_downloaded"] == len(man["models"][0]["files"]) == 9
    assert report["bytes_downloaded"] == _total(man) == hub.admin().stats()["total_bytes"]
    assert report["bytes_hashed"] == 0  # everything was hashed while it streamed in
    assert report["bytes_streamed_hashed"] == _total(man)
    dest = Path(man["models"][0]["dir"])
    for entry in man["models"][0]["files"]:  # configs and tokenizers too, not only *.safetensors
        assert sha256_file(dest / entry["path"]) == entry["sha256"]
    assert not list(dest.glob(".*rigfetch-part"))
    stamps = json.loads((tmp_path / "state" / "model-stamps.json").read_text())["files"]
    assert set(stamps) == {str(dest / f["path"]) for f in man["models"][0]["files"]}
    log = (tmp_path / "state" / "fetch.log").read_text()
    assert "downloaded and verified" in log and "progress:" in log


def test_rerun_reads_stamps_only_zero_bytes(hub: hfhub.HfHub, tmp_path: Path) -> None:
    man = _qwen(hub, tmp_path)
    assert run_rigfetch(man)[0] == 0
    hub.admin().reset_stats()

    code, lines, _ = run_rigfetch(man, "--check")
    assert code == 0
    assert lines[0]["work"] == [] and lines[0]["ok"] == 9 and lines[0]["download_bytes"] == 0

    code, lines, _ = run_rigfetch(man)
    report = _report(lines)
    assert code == 0
    assert (report["bytes_downloaded"], report["bytes_hashed"], report["files_stamped"]) == (0, 0, 9)
    assert hub.admin().stats()["requests"] == {}  # not even a HEAD request


def test_check_mode_writes_nothing(hub: hfhub.HfHub, tmp_path: Path) -> None:
    man = _qwen(hub, tmp_path)
    code, lines, _ = run_rigfetch(man, "--check")
    assert code == 0
    assert {w["action"] for w in lines[0]["work"]} == {"fetch"}
    assert lines[0]["download_bytes"] == _total(man)
    assert not (tmp_path / "state").exists() and not (tmp_path / "models").exists()


def test_interrupted_transfer_resumes_with_range(hub: hfhub.HfHub, tmp_path: Path) -> None:
    man = _qwen(hub, tmp_path)
    hub.admin().add_fault(kind="cut", file=SHARD1, after_bytes=1_000_000, times=2)
    code, lines, err = run_rigfetch(man)
    assert code == 0, err
    report = _report(lines)
    assert report["resumes"] == 2
    # Nothing was downloaded twice: the cut bytes were kept and the rest fetched with Range requests.
    assert report["bytes_downloaded"] == _total(man)
    shard = _file_stats(hub, QWEN, SHARD1)
    assert shard["range_get"] == 2
    assert sha256_file(Path(man["models"][0]["dir"]) / SHARD1) == next(
        f["sha256"] for f in man["models"][0]["files"] if f["path"] == SHARD1
    )


def test_killed_run_resumes_from_the_part_file(hub: hfhub.HfHub, tmp_path: Path) -> None:
    man = _qwen(hub, tmp_path)
    shard_size = next(f["size"] for f in man["models"][0]["files"] if f["path"] == SHARD1)
    hub.admin().add_fault(kind="slow", file=SHARD1, bytes_per_s=2_000_000, times=1)
    man_path = tmp_path / "manifest.json"
    man_path.write_text(json.dumps(man))
    proc = subprocess.Popen(
        [sys.executable, str(RIGFETCH), "--manifest", str(man_path), "--quiet", "--jobs", "1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    part = Path(man["models"][0]["dir"]) / f".{SHARD1}.rigfetch-part"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (not part.exists() or part.stat().st_size < 500_000):
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)  # a power cut, as far as the script can tell
    proc.wait()
    kept = part.stat().st_size
    assert 0 < kept < shard_size
    done_before = sum(
        f["size"] for f in man["models"][0]["files"] if (Path(man["models"][0]["dir"]) / f["path"]).exists()
    )

    code, lines, err = run_rigfetch(man)
    assert code == 0, err
    report = _report(lines)
    assert report["bytes_hashed"] >= kept  # the part file was hashed once, not downloaded again
    assert report["resumes"] >= 1
    # Across both runs the shard crossed the network once: the second run asked only for the rest.
    assert report["bytes_downloaded"] == _total(man) - kept - done_before
    dest = Path(man["models"][0]["dir"]) / SHARD1
    assert dest.stat().st_size == shard_size and not part.exists()


def test_corrupted_local_shard_is_refetched_alone(hub: hfhub.HfHub, tmp_path: Path) -> None:
    man = _qwen(hub, tmp_path)
    assert run_rigfetch(man)[0] == 0
    shard = Path(man["models"][0]["dir"]) / SHARD2
    size = shard.stat().st_size
    with open(shard, "r+b") as handle:  # flip bytes in place: same size, new mtime
        handle.seek(size // 2)
        handle.write(b"\x00" * 64)
    hub.admin().reset_stats()

    code, lines, _ = run_rigfetch(man, "--check")
    assert [(Path(w["path"]).name, w["action"]) for w in lines[0]["work"]] == [(SHARD2, "verify")]

    code, lines, err = run_rigfetch(man)
    assert code == 0, err
    report = _report(lines)
    assert report["bytes_hashed"] == size  # only the changed file was read
    assert report["bytes_downloaded"] == size  # and only it was downloaded
    assert (report["files_stamped"], report["files_downloaded"]) == (8, 1)
    assert list(hub.admin().stats()["files"]) == [f"{QWEN}/{SHARD2}"]
    assert sha256_file(shard) == next(f["sha256"] for f in man["models"][0]["files"] if f["path"] == SHARD2)


def test_wrong_bytes_fail_loudly_and_nothing_is_renamed(hub: hfhub.HfHub, tmp_path: Path) -> None:
    man = _qwen(hub, tmp_path)
    expected = next(f["sha256"] for f in man["models"][0]["files"] if f["path"] == SHARD2)
    hub.admin().add_fault(kind="corrupt", file=SHARD2, offset=100, length=10, times=None)
    code, lines, err = run_rigfetch(man, "--retries", "3")
    assert code == 1
    report = _report(lines)
    assert report["hash_mismatches"] == 3 and report["files_failed"] == 1
    failure = report["failures"][0]
    dest = Path(man["models"][0]["dir"]) / SHARD2
    assert str(dest) in failure and expected in failure
    got = failure.rsplit("got ", 1)[1]
    assert len(got) == 64 and got != expected
    assert "SHA-256 mismatch" in err
    assert not dest.exists()  # never renamed into place
    assert not (dest.parent / f".{SHARD2}.rigfetch-part").exists()  # and the bad bytes are gone
    assert _file_stats(hub, QWEN, SHARD2)["get"] == 3  # bounded retries
    # The other files are done and stamped; a later run only needs the bad one.
    assert report["files_downloaded"] == 8


def test_lock_upgrade_of_one_pin_changes_only_that_file(hub: hfhub.HfHub, tmp_path: Path) -> None:
    old = _qwen(hub, tmp_path, index=0)
    assert run_rigfetch(old)[0] == 0
    new = _qwen(hub, tmp_path, index=1)  # the hub's second commit re-quantized shard 2 only
    hub.admin().reset_stats()

    code, lines, _ = run_rigfetch(new, "--check")
    assert [Path(w["path"]).name for w in lines[0]["work"]] == [SHARD2]

    code, lines, err = run_rigfetch(new)
    assert code == 0, err
    report = _report(lines)
    shard2 = next(f for f in new["models"][0]["files"] if f["path"] == SHARD2)
    assert report["bytes_downloaded"] == shard2["size"] and report["files_downloaded"] == 1
    assert report["bytes_hashed"] == shard2["size"]  # same size as before: hashed, found different
    assert list(hub.admin().stats()["files"]) == [f"{QWEN}/{SHARD2}"]


def test_reverify_hashes_everything_and_downloads_nothing(hub: hfhub.HfHub, tmp_path: Path) -> None:
    man = _qwen(hub, tmp_path)
    assert run_rigfetch(man)[0] == 0
    code, lines, _ = run_rigfetch(man, "--reverify", "--check")
    assert {w["action"] for w in lines[0]["work"]} == {"verify"}
    code, lines, _ = run_rigfetch(man, "--reverify", "--hash-jobs", "4")
    report = _report(lines)
    assert code == 0
    assert (report["bytes_hashed"], report["bytes_downloaded"], report["files_verified"]) == (_total(man), 0, 9)


def test_preexisting_unstamped_files_are_hashed_not_downloaded(hub: hfhub.HfHub, tmp_path: Path) -> None:
    man = _qwen(hub, tmp_path)
    assert run_rigfetch(man)[0] == 0
    (tmp_path / "state" / "model-stamps.json").unlink()  # e.g. files left by upstream's setup.sh
    hub.admin().reset_stats()
    code, lines, _ = run_rigfetch(man)
    report = _report(lines)
    assert code == 0
    assert (report["bytes_hashed"], report["bytes_downloaded"]) == (_total(man), 0)


def test_files_dropped_from_the_lock_are_removed(hub: hfhub.HfHub, tmp_path: Path) -> None:
    man = _qwen(hub, tmp_path)
    assert run_rigfetch(man)[0] == 0
    dest = Path(man["models"][0]["dir"])
    stray = dest / "notes-of-the-user.txt"
    stray.write_text("mine")
    man["models"][0]["files"] = [f for f in man["models"][0]["files"] if f["path"] != "README.md"]
    code, lines, _ = run_rigfetch(man, "--check")
    assert lines[0]["prune"] == [str(dest / "README.md")]
    code, lines, _ = run_rigfetch(man)
    assert code == 0 and _report(lines)["files_pruned"] == 1
    assert not (dest / "README.md").exists()
    assert stray.read_text() == "mine"  # only what rigfetch itself put there is removed


def test_not_enough_disk_space_fails_before_downloading(hub: hfhub.HfHub, tmp_path: Path) -> None:
    man = _qwen(hub, tmp_path)
    man["reserve_bytes"] = 10**18
    code, lines, err = run_rigfetch(man)
    assert code == EXIT_DISK
    assert "not enough disk space" in err
    assert hub.admin().stats()["total_bytes"] == 0


def test_gated_repo_needs_the_token_and_never_logs_it(hub: hfhub.HfHub, tmp_path: Path) -> None:
    hub.admin().configure(tokens=[TOKEN])
    man = manifest(tmp_path / "state", model_entry(hub, GATED, tmp_path / "models" / "gated"))
    code, lines, err = run_rigfetch(man)
    assert code == 1 and "HTTP 401" in err and "HF_TOKEN" in err

    code, lines, err = run_rigfetch(man, secrets={"hf_token": TOKEN})
    assert code == 0, err
    assert _report(lines)["files_downloaded"] == 4
    for text in (err, json.dumps(lines), (tmp_path / "state" / "fetch.log").read_text()):
        assert TOKEN not in text


def test_token_is_not_sent_to_the_cdn_after_a_redirect(hub: hfhub.HfHub, tmp_path: Path) -> None:
    # The real hub redirects LFS files to a CDN on another origin (the fake hub's CDN listener: another port);
    # rigfetch sends the token to the hub only, and every byte crosses once, from the CDN.
    hub.admin().configure(redirect_lfs=True, tokens=[TOKEN])
    assert hub.cdn_url is not None and hub.cdn_url != hub.url
    man = manifest(tmp_path / "state", model_entry(hub, GATED, tmp_path / "models" / "gated"))
    code, lines, err = run_rigfetch(man, secrets={"hf_token": TOKEN})
    assert code == 0, err
    stats = hub.admin().stats()
    assert any(key.startswith("GET /_lfs/") for key in stats["requests"])
    assert stats["cdn_authorized_requests"] == 0
    assert _report(lines)["bytes_downloaded"] == _total(man) == stats["total_bytes"]
    lfs = [path for path, f in commit_files(hub, GATED)[1].items() if f["lfs"]]
    assert lfs and all(_file_stats(hub, GATED, path)["redirected"] == 1 for path in lfs)


def test_interrupted_transfer_resumes_through_the_cdn(hub: hfhub.HfHub, tmp_path: Path) -> None:
    # The Range header survives the redirect: the resumed GET reaches the CDN as a range request.
    hub.admin().configure(redirect_lfs=True)
    man = _qwen(hub, tmp_path)
    hub.admin().add_fault(kind="cut", file=SHARD1, after_bytes=1_000_000, times=1)
    code, lines, err = run_rigfetch(man)
    assert code == 0, err
    report = _report(lines)
    assert report["resumes"] == 1
    assert report["bytes_downloaded"] == _total(man) == hub.admin().stats()["total_bytes"]
    shard = _file_stats(hub, QWEN, SHARD1)
    assert (shard["redirected"], shard["get"], shard["range_get"]) == (2, 2, 1)


@contextlib.contextmanager
def _two_origins(handler: type[http.server.BaseHTTPRequestHandler]) -> Iterator[tuple[http.server.ThreadingHTTPServer, ...]]:
    """Two servers of `handler` on two ports of 127.0.0.1: two origins (a hub and its CDN)."""
    servers = tuple(http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) for _ in range(2))
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield servers
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()


class _Replies(http.server.BaseHTTPRequestHandler):
    """A quiet handler with one way to answer: status, headers, body."""

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - stdlib signature
        pass

    def _reply(self, status: int, headers: dict[str, str], body: bytes = b"") -> None:
        self.send_response(status)
        for key, value in {**headers, "Content-Length": str(len(body))}.items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)


def test_token_follows_a_redirect_on_the_hub_s_origin_only(tmp_path: Path) -> None:
    """The Hub redirects a renamed repository's /resolve/ on its own origin, where a gated repository still
    needs the token (huggingface/huggingface_hub@f7c9b7df:src/huggingface_hub/file_download.py follows same-origin
    redirects "to follow a redirection to a renamed repository without following redirection to a CDN"),
    and an LFS file to a CDN on another origin, which must not see it (signed URLs). rigfetch keeps the Authorization header on the first and drops it on the second, as
    huggingface_hub and curl do."""
    data = b"rigfetch weights\n" * 4096
    seen: list[tuple[str, str | None]] = []

    class Handler(_Replies):
        def do_GET(self) -> None:  # noqa: N802 - stdlib naming
            auth = self.headers.get("Authorization")
            seen.append((self.path.split("/", 2)[1], auth))
            if self.path.startswith("/old/"):  # renamed: same origin, relative Location
                self._reply(307, {"Location": self.path.replace("/old/", "/new/", 1)})
            elif self.path.startswith("/new/") and auth != f"Bearer {TOKEN}":
                self._reply(401, {"X-Error-Code": "GatedRepo"})
            elif self.path.startswith("/new/"):
                self._reply(302, {"Location": f"http://127.0.0.1:{cdn.server_address[1]}/cdn/blob?X-Amz-Signature=x"})
            else:
                self._reply(200, {"Content-Type": "application/octet-stream"}, data)

    with _two_origins(Handler) as (hub, cdn):
        entry = {
            "name": "renamed",
            "dir": str(tmp_path / "models" / "renamed"),
            "hub_url": f"http://127.0.0.1:{hub.server_address[1]}/old/resolve/{'a' * 40}/",
            "files": [{"path": "model.safetensors", "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}],
        }
        code, lines, err = run_rigfetch(manifest(tmp_path / "state", entry), secrets={"hf_token": TOKEN})
    assert code == 0, err
    assert seen == [("old", f"Bearer {TOKEN}"), ("new", f"Bearer {TOKEN}"), ("cdn", None)]
    assert (tmp_path / "models" / "renamed" / "model.safetensors").read_bytes() == data


def test_a_registry_hub_is_read_with_its_own_anonymous_token_renewed_on_expiry(tmp_path: Path) -> None:
    """hub_auth "registry": the hub is a registry's blob endpoint, read as Docker reads Docker Hub. A 401
    carries `WWW-Authenticate: Bearer realm=...,service=...,scope=...` (distribution's docs/spec/auth/token.md);
    rigfetch gets an anonymous token there, never sends the HF token, and follows the blob's redirect to a
    CDN without the token (Docker Hub's blobs answer 307 to one). A token that expires mid-run (Docker Hub's
    last 300 s) is asked for again; the interrupted transfer resumes where it stopped."""
    data = bytes(range(256)) * 8192  # 2 MiB: two files, the second asks after the first token expired
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    issued: list[dict[str, list[str]]] = []
    seen: list[tuple[str, str | None]] = []
    valid: set[str] = set()

    class Handler(_Replies):
        def do_GET(self) -> None:  # noqa: N802 - stdlib naming
            import urllib.parse

            path, _, query = self.path.partition("?")
            auth = self.headers.get("Authorization")
            seen.append((path.split("/")[1], auth))
            if path == "/token":
                issued.append(urllib.parse.parse_qs(query))
                token = f"t{len(issued)}"
                valid.clear()
                valid.add(token)
                self._reply(200, {"Content-Type": "application/json"}, json.dumps({"token": token}).encode())
            elif path.startswith("/v2/") and auth not in {f"Bearer {t}" for t in valid}:
                realm = f"http://127.0.0.1:{registry.server_address[1]}/token"
                self._reply(401, {"WWW-Authenticate": f'Bearer realm="{realm}",service="registry.test",'
                                                      'scope="repository:library/vllm:pull"'})
            elif path.startswith("/v2/"):
                valid.clear()  # each token serves one blob: the next blob finds it expired
                self._reply(307, {"Location": f"http://127.0.0.1:{cdn.server_address[1]}/cdn/{path[-8:]}?sig=x"})
            else:
                self._reply(200, {"Content-Type": "application/octet-stream"}, data)

    with _two_origins(Handler) as (registry, cdn):
        entries = [{"name": name, "dir": str(tmp_path / "images" / name), "hub_auth": "registry",
                    "hub_url": f"http://127.0.0.1:{registry.server_address[1]}/v2/library/vllm/blobs/",
                    "files": [{"path": digest, "size": len(data), "sha256": digest[7:]}]} for name in ("a", "b")]
        man = manifest(tmp_path / "state", *entries)
        code, lines, err = run_rigfetch(man, "--jobs", "1", secrets={"hf_token": TOKEN})
    assert code == 0, err
    assert all((tmp_path / "images" / name / digest).read_bytes() == data for name in ("a", "b"))
    assert [q["scope"] for q in issued] == [["repository:library/vllm:pull"]] * 2  # renewed once, for file b
    assert all(q["service"] == ["registry.test"] for q in issued)
    assert all(auth is None for where, auth in seen if where in ("cdn", "token"))  # never past the registry
    assert all(auth != f"Bearer {TOKEN}" for _, auth in seen)  # the HF token never leaves for a registry
    assert [auth for where, auth in seen if where == "v2"] == [None, "Bearer t1", "Bearer t1", "Bearer t2"]


def test_a_registry_hub_that_refuses_its_own_fresh_token_fails_the_file(tmp_path: Path) -> None:
    challenges = 0

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - stdlib signature
            pass

        def do_GET(self) -> None:  # noqa: N802 - stdlib naming
            nonlocal challenges
            body = b'{"token": "anon"}' if self.path.startswith("/token") else b""
            self.send_response(200 if body else 401)
            if not body:
                challenges += 1
                self.send_header("WWW-Authenticate", f'Bearer realm="http://127.0.0.1:{server.server_address[1]}/token"')
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        entry = {"name": "private", "dir": str(tmp_path / "images"), "hub_auth": "registry",
                 "hub_url": f"http://127.0.0.1:{server.server_address[1]}/v2/acme/private/blobs/",
                 "files": [{"path": "sha256:" + "1" * 64, "size": 10, "sha256": "1" * 64}]}
        code, _, err = run_rigfetch(manifest(tmp_path / "state", entry))
    finally:
        server.shutdown()
        server.server_close()
    assert code != 0 and challenges == 2  # asked once, then refused with the fresh token: no loop
    assert "refuses anonymous pulls" in err


def test_size_mismatch_is_refused_without_downloading_the_body(hub: hfhub.HfHub, tmp_path: Path) -> None:
    man = _qwen(hub, tmp_path)
    entry = next(f for f in man["models"][0]["files"] if f["path"] == SHARD1)
    entry["size"] += 1  # the lock says one byte more than the hub has
    code, lines, _ = run_rigfetch(man, "--retries", "2")
    assert code == 1
    report = _report(lines)
    assert "mismatch" in report["failures"][0]
    # Refused on Content-Length: not one body byte of the wrong-sized file was read or written.
    assert report["bytes_from_hub"] == _total(man) - entry["size"]
    assert not (Path(man["models"][0]["dir"]) / f".{SHARD1}.rigfetch-part").exists()


# ------------------------------------------------------------------------------------------
# fleet chain: the head reads the hub, every other rig its nearest live upstream, piece by verified piece

PIECE = 64 << 10  # small pieces, so the 2.4 MB shard is 37 of them


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Chain:
    """Rigs 0..n-1 as rigfetch processes on loopback, each with its own dirs and port; rig i's upstreams
    are rigs 0..i-1 (head first) and it serves the rigs after it, as the model operation lays it out."""

    def __init__(self, hub: hfhub.HfHub, root: Path, n: int, token: str = "fleet-token-for-this-run") -> None:
        self.hub, self.root, self.n, self.token = hub, root, n, token
        self.ports = [_free_port() for _ in range(n)]
        self.procs: list[subprocess.Popen | None] = [None] * n

    def base(self, i: int) -> str:
        return f"http://127.0.0.1:{self.ports[i]}/"

    def manifest(self, i: int) -> dict:
        entry = model_entry(self.hub, QWEN, self.root / f"rig{i}" / "models" / "qwen")
        entry["upstreams"] = [self.base(j) for j in range(i)]
        return {**manifest(self.root / f"rig{i}" / "state", entry), "piece_size": PIECE}

    def dir(self, i: int) -> Path:
        return self.root / f"rig{i}" / "models" / "qwen"

    def start(self, i: int, *extra: str, token: str | None = None) -> subprocess.Popen:
        path = self.root / f"rig{i}" / "manifest.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.manifest(i)))
        proc = subprocess.Popen(
            [sys.executable, str(RIGFETCH), "--manifest", str(path), "--quiet", "--retry-delay", "0.05",
             "--peer-wait", "10", "--idle-timeout", "5", "--listen", f"127.0.0.1:{self.ports[i]}",
             "--expect-peers", str(self.n - 1 - i), "--secrets-stdin", *extra],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert proc.stdin is not None
        proc.stdin.write(json.dumps({"fleet_token": token or self.token}) + "\n")
        proc.stdin.close()
        proc.stdin = None  # communicate() must not touch it again
        self.procs[i] = proc
        return proc

    def finish(self, i: int, timeout: float = 60) -> tuple[int, dict, dict]:
        """(exit code, fetch report, serve report) of rig i."""
        proc = self.procs[i]
        assert proc is not None
        out, err = proc.communicate(timeout=timeout)
        lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        fetch = next((line for line in lines if "bytes_downloaded" in line), {})
        serve = next((line["serve"] for line in lines if "serve" in line), {})
        assert fetch, err
        return proc.returncode, fetch, serve

    def stop(self) -> None:
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.communicate()

    def intact(self, i: int) -> bool:
        files = self.manifest(i)["models"][0]["files"]
        return all(sha256_file(self.dir(i) / f["path"]) == f["sha256"] for f in files)


@pytest.fixture
def chain(hub: hfhub.HfHub, tmp_path: Path) -> Iterator[Chain]:
    made: list[Chain] = []

    def make(n: int) -> Chain:
        made.append(Chain(hub, tmp_path, n))
        return made[-1]

    yield make  # type: ignore[misc]
    for c in made:
        c.stop()


def _hub_bytes(hub: hfhub.HfHub) -> int:
    return hub.admin().stats()["total_bytes"]


def test_a_chain_reads_the_hub_once_and_forwards_pieces_before_the_head_has_the_file(
    chain, hub: hfhub.HfHub, tmp_path: Path
) -> None:  # noqa: ANN001
    c = chain(3)
    total = _total(c.manifest(0))
    # The head's read of shard 1 breaks after 1 MB and resumes 3 s later: in that pause the rigs below
    # it must already hold the verified pieces it has (a chain that waited for whole files would not).
    hub.admin().add_fault(kind="cut", file=SHARD1, after_bytes=1_000_000, times=1)
    c.start(0, "--retry-delay", "3")
    c.start(1)
    c.start(2)
    part = c.dir(2) / f".{SHARD1}.rigfetch-part"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not (part.exists() and part.stat().st_size >= 8 * PIECE):
        time.sleep(0.05)
    assert part.exists() and part.stat().st_size >= 8 * PIECE, "the last rig got no piece while the head paused"
    assert not (c.dir(0) / SHARD1).exists()  # the head is still in its pause
    assert part.stat().st_size <= 1_000_000 // PIECE * PIECE  # never more than the head had verified
    reports = [c.finish(i) for i in range(3)]
    for i, (code, fetch, _) in enumerate(reports):
        assert code == 0 and c.intact(i)
    head, second, third = (r[1] for r in reports)
    assert head["bytes_from_hub"] == total and head["bytes_from_peer"] == 0
    assert second["bytes_from_peer"] == total and second["bytes_from_hub"] == 0
    assert third["bytes_from_peer"] == total and third["bytes_from_hub"] == 0
    assert _hub_bytes(hub) == total  # the hub served one copy to the fleet
    assert reports[0][2]["bytes_served"] == total and reports[1][2]["bytes_served"] == total  # each link once
    assert reports[0][2]["peers_done"] == 2 and "expected peers finished" in reports[0][2]["reason"]


def test_a_peer_that_corrupts_a_piece_is_dropped_and_no_rig_stamps_a_bad_file(chain, hub: hfhub.HfHub) -> None:  # noqa: ANN001
    c = chain(3)
    total = _total(c.manifest(0))
    state = c.root / "rig1" / "state"
    state.mkdir(parents=True)
    (state / FAILPOINTS_FILE).write_text(
        json.dumps({"corrupt_served_piece": {"file": f"qwen/{SHARD1}", "piece": 5, "piece_size": PIECE}})
    )
    for i in range(3):
        c.start(i)
    reports = [c.finish(i) for i in range(3)]
    assert all(code == 0 for code, _, _ in reports)
    assert all(c.intact(i) for i in range(3))
    third = reports[2][1]
    assert third["pieces_rejected"] == 1 and third["peers_dropped"] == 1 and third["hash_mismatches"] == 0
    # The third rig took the rest from the head, not the hub: the hub still served one copy.
    assert third["bytes_from_hub"] == 0 and _hub_bytes(hub) == total
    log = (c.root / "rig2" / "state" / "fetch.log").read_text()
    assert f"fleet peer {c.base(1)} dropped (piece 5 of qwen/{SHARD1} failed its hash)" in log


def test_a_peer_killed_mid_transfer_is_routed_around(chain, hub: hfhub.HfHub) -> None:  # noqa: ANN001
    c = chain(3)
    total = _total(c.manifest(0))
    hub.admin().add_fault(kind="slow", file=SHARD1, bytes_per_s=1_000_000, times=1)  # 2.4 s for shard 1
    for i in range(3):
        c.start(i)
    # Kill rig 1 once rig 2 is receiving shard 1 from it (rig 2's part file grows only from its nearest peer).
    parts = [c.dir(i) / f".{SHARD1}.rigfetch-part" for i in (1, 2)]
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not all(p.exists() and p.stat().st_size >= PIECE for p in parts):
        time.sleep(0.02)
    assert all(p.exists() and p.stat().st_size >= PIECE for p in parts)
    assert not (c.dir(1) / SHARD1).exists()
    c.procs[1].send_signal(signal.SIGKILL)  # type: ignore[union-attr]
    c.procs[1].communicate()  # type: ignore[union-attr]
    code0, head, served0 = c.finish(0)
    code2, third, _ = c.finish(2)
    assert code0 == 0 and code2 == 0 and c.intact(0) and c.intact(2)
    assert third["peers_dropped"] >= 1 and third["bytes_from_hub"] == 0 and third["bytes_from_peer"] >= total
    assert _hub_bytes(hub) == total  # the dead rig's share came from the head, not the hub


def test_a_rig_resumes_a_chain_transfer_from_its_verified_pieces(chain, hub: hfhub.HfHub) -> None:  # noqa: ANN001
    c = chain(2)
    total = _total(c.manifest(0))
    c.start(0)
    assert c.finish(0)[0] == 0
    # A part file from an earlier, interrupted run: 5 good pieces, then a piece with one bad byte.
    data = (c.dir(0) / SHARD1).read_bytes()
    c.dir(1).mkdir(parents=True)
    bad = bytearray(data[: 6 * PIECE + 100])
    bad[5 * PIECE + 7] ^= 0xFF
    (c.dir(1) / f".{SHARD1}.rigfetch-part").write_bytes(bytes(bad))
    c.procs = [None, None]
    c.start(0)  # serves its verified files (hashing them into pieces when asked)
    c.start(1)
    code, fetch, _ = c.finish(1)
    assert code == 0 and c.intact(1)
    assert fetch["bytes_from_peer"] == total - 5 * PIECE  # kept the 5 pieces the head vouched for
    assert c.finish(0)[0] == 0
    assert _hub_bytes(hub) == total


def test_piece_digests_are_prefix_hashes_ending_in_the_locked_one(chain, hub: hfhub.HfHub) -> None:  # noqa: ANN001
    import urllib.request

    c = chain(2)
    c.start(0)
    assert c.finish(0)[0] == 0
    c.procs = [None, None]
    c.start(0)  # holds every file verified; serves until its one peer is done or idle
    data = (c.dir(0) / SHARD1).read_bytes()
    url = f"{c.base(0)}_rigfetch/pieces/qwen/{SHARD1}?from=0&size={PIECE}"
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {c.token}"})
    deadline = time.monotonic() + 10
    while True:
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                digests = json.loads(response.read())["digests"]
            break
        except OSError:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    pieces = (len(data) + PIECE - 1) // PIECE
    assert len(digests) == pieces
    assert digests[0] == hashlib.sha256(data[:PIECE]).hexdigest()
    assert digests[3] == hashlib.sha256(data[: 4 * PIECE]).hexdigest()
    assert digests[-1] == hashlib.sha256(data).hexdigest()  # the whole file's: the locked SHA-256
    unauthorized = urllib.request.Request(url, headers={"Authorization": "Bearer wrong"})
    with pytest.raises(urllib.error.HTTPError, match="401"):
        urllib.request.urlopen(unauthorized, timeout=5)


def test_an_upstream_that_verified_its_files_on_disk_vouches_for_their_pieces(chain, hub: hfhub.HfHub) -> None:  # noqa: ANN001
    c = chain(2)
    c.start(0)
    assert c.finish(0)[0] == 0
    # The head's files are right but unstamped: this run hashes them on disk instead of receiving them,
    # and it must still give their piece digests to the rig below, or that rig falls back to the hub.
    (c.root / "rig0" / "state" / "model-stamps.json").write_text('{"version": 1, "files": {}}')
    hub.admin().reset_stats()
    c.procs = [None, None]
    c.start(0)
    c.start(1)
    (code0, head, _), (code1, second, _) = c.finish(0), c.finish(1)
    assert code0 == 0 and code1 == 0 and c.intact(1)
    assert head["files_verified"] == len(c.manifest(0)["models"][0]["files"])
    assert second["bytes_from_peer"] == _total(c.manifest(1)) and second["bytes_from_hub"] == 0
    assert _hub_bytes(hub) == 0


def test_bad_bytes_from_the_hub_are_caught_by_every_rig_and_no_one_stamps_them(chain, hub: hfhub.HfHub) -> None:  # noqa: ANN001
    c = chain(2)
    # The head's first read of shard 1 has a flipped byte: its digests describe bad bytes, and rig 1's
    # pieces match them; the lock's SHA-256 at the end catches it on both, and both read it again.
    hub.admin().add_fault(kind="corrupt", file=SHARD1, offset=300_000, length=1, times=1)
    c.start(0)
    c.start(1)
    (code0, head, _), (code1, second, _) = c.finish(0), c.finish(1)
    assert code0 == 0 and code1 == 0 and c.intact(0) and c.intact(1)
    assert head["hash_mismatches"] == 1
    assert second["hash_mismatches"] <= 1  # caught at its end unless the head's restart cut it short first


def test_a_peer_with_the_wrong_token_is_not_used(chain, hub: hfhub.HfHub) -> None:  # noqa: ANN001
    c = chain(2)
    c.start(0)
    c.start(1, "--peer-wait", "1", token="wrong")
    code, fetch, _ = c.finish(1)
    assert code == 0 and c.intact(1)
    assert fetch["bytes_from_peer"] == 0 and fetch["bytes_from_hub"] == _total(c.manifest(1))


def test_a_rig_whose_upstreams_never_answer_reads_the_hub(chain, hub: hfhub.HfHub) -> None:  # noqa: ANN001
    c = chain(3)
    c.start(2, "--peer-wait", "1")  # rigs 0 and 1 never start
    code, fetch, _ = c.finish(2)
    assert code == 0 and c.intact(2)
    assert fetch["bytes_from_hub"] == _total(c.manifest(2))


def _rotten_second_rig(c: Chain, hub: hfhub.HfHub) -> int:
    """Rigs 0 and 1 fetched; then rig 1's shard rots on disk and its stamps are lost, so it must hash it, find it
    wrong and fetch it again before it serves a byte of it. The hub's counts start over; returns the model's bytes."""
    total = _total(c.manifest(0))
    for i in (0, 1):
        c.start(i)
        assert c.finish(i)[0] == 0
    shard = c.dir(1) / SHARD1
    rotten = bytearray(shard.read_bytes())
    rotten[12345] ^= 0xFF
    shard.write_bytes(bytes(rotten))
    (c.root / "rig1" / "state" / "model-stamps.json").write_text('{"version": 1, "files": {}}')
    hub.admin().reset_stats()
    c.procs = [None, None, None]
    return total


def test_an_upstream_never_forwards_bytes_it_has_not_verified(chain, hub: hfhub.HfHub) -> None:  # noqa: ANN001
    c = chain(3)
    total = _rotten_second_rig(c, hub)
    for i in range(3):
        c.start(i)
    reports = [c.finish(i) for i in range(3)]
    assert all(code == 0 for code, _, _ in reports) and all(c.intact(i) for i in range(3))
    assert reports[1][1]["files_verified"] == len(c.manifest(1)["models"][0]["files"]) - 1
    # the rig below gets only verified bytes
    assert reports[2][1]["pieces_rejected"] == 0 and reports[2][1]["bytes_from_peer"] == total
    assert _hub_bytes(hub) == 0  # rig 1 re-fetched its bad shard from the head


def test_a_head_that_starts_late_still_vouches_for_the_pieces_below_it(chain, hub: hfhub.HfHub) -> None:  # noqa: ANN001
    # pyinfra starts every rig's rigfetch in one operation, in no set order: a rig whose only authority
    # for a piece is the head must give the head its grace before reading the hub (seen under load).
    c = chain(3)
    total = _rotten_second_rig(c, hub)
    c.start(2)
    c.start(1)
    time.sleep(1.5)
    c.start(0)
    reports = [c.finish(i) for i in range(3)]
    assert all(code == 0 for code, _, _ in reports) and all(c.intact(i) for i in range(3))
    assert reports[2][1]["bytes_from_peer"] == total and reports[2][1]["bytes_from_hub"] == 0
    assert _hub_bytes(hub) == 0


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda m: m["models"][0]["files"][0].update(path="../etc/passwd"), "unsafe file path"),
        (lambda m: m["models"][0]["files"][0].update(path="/abs"), "unsafe file path"),
        (lambda m: m["models"][0]["files"][0].update(sha256="ABC"), "sha256"),
        (lambda m: m["models"][0]["files"][0].update(size=-1), "size"),
        (lambda m: m["models"][0].update(dir="relative/dir"), "absolute"),
        (lambda m: m.update(version=2), "version 1"),
        (lambda m: m["models"][0].update(hub_url="ftp://x/"), "hub_url"),
        (lambda m: m["models"][0].update(upstreams=["http://rig-a:8765"]), "upstreams"),
        (lambda m: m.update(piece_size=100), "piece_size"),
        (lambda m: m["models"][0].update(hub_auth="basic"), "hub_auth"),
    ],
)
def test_bad_manifests_are_refused(mutate, message: str, tmp_path: Path) -> None:  # noqa: ANN001
    man = manifest(
        tmp_path / "state",
        {"name": "m", "dir": str(tmp_path / "m"), "hub_url": "http://h/r/", "upstreams": [],
         "files": [{"path": "a.bin", "size": 1, "sha256": "0" * 64}]},
    )  # fmt: skip
    mutate(man)
    with pytest.raises(ManifestError, match=message):
        validate_manifest(man)


def test_manifest_b64_round_trip(hub: hfhub.HfHub, tmp_path: Path) -> None:
    man = _qwen(hub, tmp_path)
    assert load_manifest(None, encode_manifest(man)) == man


def test_script_is_stdlib_only() -> None:
    # The rigs run Ubuntu's python3 without pip packages: every import must be in the standard library.
    import ast

    stdlib = set(sys.stdlib_module_names)
    trees = [ast.parse(path.read_text()) for path in RIGFETCH_PACKAGE.glob("*.py")]
    imported = {
        (alias.name if isinstance(node, ast.Import) else node.module or "").split(".")[0]
        for tree in trees
        for node in ast.walk(tree)
        if isinstance(node, ast.Import) or (isinstance(node, ast.ImportFrom) and node.level == 0)  # not its own modules
        for alias in node.names
    }
    assert imported - {"__future__"} <= stdlib, imported - stdlib


def test_hub_commits_used_by_the_tests_differ_in_one_file(hub: hfhub.HfHub) -> None:
    _, first = commit_files(hub, QWEN, 0)
    _, second = commit_files(hub, QWEN, 1)
    assert [p for p in first if first[p]["sha256"] != second[p]["sha256"]] == [SHARD2]


def test_terse_shows_the_plan_progress_and_end_and_logs_everything(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log_file = tmp_path / "fetch.log"
    log = Log(str(log_file), terse=True)
    for line in ("9 files: 0 stamped, 0 to hash, 9 to download", "downloading 9 files (160.0 MB) with 4 connections",
                 "a/b.safetensors downloaded and verified (40.0 MB)", 'serve: 10.0.0.2 "GET /a HTTP/1.1" 200 -',
                 "progress: downloaded 1.0 GB / 2.0 GB (50%) at 100.0 MB/s, ETA 10s", "done: 9 files ok"):
        log(line)
    log.close()
    shown = [line.removeprefix("rigfetch: ") for line in capsys.readouterr().err.splitlines()]
    assert shown == ["9 files: 0 stamped, 0 to hash, 9 to download", "downloading 9 files (160.0 MB) with 4 connections",
                     "progress: downloaded 1.0 GB / 2.0 GB (50%) at 100.0 MB/s, ETA 10s", "done: 9 files ok"]
    assert len(log_file.read_text().splitlines()) == 6  # the log keeps every line
