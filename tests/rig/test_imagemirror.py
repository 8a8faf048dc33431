"""The image mirror on the real distribution registry (Debian's docker-registry 2.8, as on the mirror host):
rigup's config in proxy mode in front of an upstream registry, and rigup-image-mirror's check, warm and
prune against its real storage. The upstream's access log counts the bytes it served."""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from rigup.desired.image_mirror import MirrorRole
from rigup.rig import imagemirror
from rigup_testbed.registry import build_image, config_text, push, served_blob_bytes

pytestmark = pytest.mark.skipif(not Path("/usr/bin/docker-registry").exists(), reason="needs Debian's docker-registry")
SCRIPT = Path(imagemirror.__file__)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Registry:
    def __init__(self, root: Path, text: str, port: int) -> None:
        self.root, self.port = root, port
        self.config = root / "config.yml"
        self.log = root / "registry.log"
        root.mkdir(parents=True, exist_ok=True)
        self.config.write_text(text)
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        with self.log.open("a") as log:
            self.proc = subprocess.Popen(["/usr/bin/docker-registry", "serve", str(self.config)], stdout=log, stderr=log)
        deadline = time.monotonic() + 20
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v2/", timeout=2).read()
                return
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"registry on {self.port} did not start: {self.log.read_text()[-800:]}") from None
                time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.proc = None

    def blob_bytes_served(self) -> int:
        return served_blob_bytes(self.log)


def image(name: str, seed: int, size: int):
    noise = os.urandom(size)  # incompressible, so the gzip'd layer is about `size` bytes
    return build_image(name, "v1", {"/data.bin": (noise, 0o644), "/seed": (str(seed).encode(), 0o644)}, {}, {"Cmd": ["sh"]})


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[dict]:
    up_port, mirror_port = free_port(), free_port()
    # the bed hub's own config: info level, so its log counts the bytes it served
    upstream = Registry(tmp_path / "upstream", config_text(tmp_path / "upstream" / "data", "127.0.0.1", up_port), up_port)
    upstream.start()
    pinned, other = image("vllm/vllm-openai", 1, 3_000_000), image("vllm/vllm-omni", 2, 2_000_000)
    for built in (pinned, other):
        push(f"127.0.0.1:{up_port}", built)
    role = MirrorRole(upstream=f"http://127.0.0.1:{up_port}", port=mirror_port, max_bytes=10**12, clients=("rig-01",),
                      keep=(f"vllm/vllm-openai@{pinned.digest}",), storage=str(tmp_path / "mirror" / "data"))
    mirror = Registry(tmp_path / "mirror", role.config_text(), mirror_port)
    mirror.start()
    keep = tmp_path / "keep.json"
    doc = json.loads(role.keep_text())
    doc.update(config=str(mirror.config), unit=None, binary="/usr/bin/docker-registry")
    keep.write_text(json.dumps(doc))
    try:
        yield {"upstream": upstream, "mirror": mirror, "keep": keep, "pinned": pinned, "other": other}
    finally:
        mirror.stop()
        upstream.stop()


def helper(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


def image_bytes(built) -> int:
    return sum(len(layer) for layer in built.layers) + len(built.config)


def pull(port: int, built) -> None:
    """What `docker pull` reads: the manifest, then the config and every layer, each checked by digest."""
    base = f"http://127.0.0.1:{port}/v2/{built.repository}"
    accept = {"Accept": "application/vnd.docker.distribution.manifest.v2+json"}
    body = urllib.request.urlopen(urllib.request.Request(f"{base}/manifests/{built.digest}", headers=accept)).read()
    assert body == built.manifest
    for blob in (*built.layers, built.config):
        digest = "sha256:" + hashlib.sha256(blob).hexdigest()
        assert urllib.request.urlopen(f"{base}/blobs/{digest}").read() == blob


def test_warm_caches_the_pin_and_the_rigs_then_read_only_the_mirror(fleet: dict) -> None:
    ref = f"vllm/vllm-openai@{fleet['pinned'].digest}"
    before = json.loads(helper("check", str(fleet["keep"])).stdout)
    assert before["missing"] == [ref]

    warmed = helper("warm", str(fleet["keep"]))
    assert warmed.returncode == 0, warmed.stderr
    assert "cached" in warmed.stdout
    after = json.loads(helper("check", str(fleet["keep"])).stdout)
    assert after["missing"] == [] and after["bytes"] >= image_bytes(fleet["pinned"])
    # warm read each blob from upstream once and wrote it into the mirror's storage itself
    warm_bytes = fleet["upstream"].blob_bytes_served()
    assert warm_bytes == image_bytes(fleet["pinned"])

    with ThreadPoolExecutor(4) as pool:  # four rigs pulling at once, from the mirror's disk
        list(pool.map(lambda _: pull(fleet["mirror"].port, fleet["pinned"]), range(4)))
    assert fleet["upstream"].blob_bytes_served() == warm_bytes
    again = helper("warm", str(fleet["keep"])).stdout.strip()
    assert "cached 0.00 GB from" in again and "and 0.00 GB the fleet's chain staged" in again


def blobs(built) -> list[list]:
    """[digest, size] of a pull's blobs as the manifest lists them: the config, then the layers."""
    return [["sha256:" + hashlib.sha256(b).hexdigest(), len(b)] for b in (built.config, *built.layers)]


def test_check_lists_each_pins_blobs_from_upstream_then_from_the_cache(fleet: dict) -> None:
    """What the fleet's chain moves: each pin's config and layers, asked of upstream while the cache lacks
    the pin (a tag resolved to its digest there), read from the cache once it holds it."""
    doc = dict(json.loads(fleet["keep"].read_text()))
    doc["keep"] = [*doc["keep"], "vllm/vllm-omni:v1", "vllm/vllm-omni:v9"]
    fleet["keep"].write_text(json.dumps(doc))
    before = json.loads(helper("check", str(fleet["keep"])).stdout)
    pinned, other = fleet["pinned"], fleet["other"]
    assert before["pins"][doc["keep"][0]] == {"repository": "vllm/vllm-openai", "digest": pinned.digest,
                                              "blobs": blobs(pinned)}
    assert before["pins"]["vllm/vllm-omni:v1"]["digest"] == other.digest
    assert "HTTP 404" in before["pins"]["vllm/vllm-omni:v9"]["error"]  # upstream lacks it: said, not raised
    assert fleet["upstream"].blob_bytes_served() == 0  # manifests only
    doc["keep"] = doc["keep"][:2]
    fleet["keep"].write_text(json.dumps(doc))
    assert helper("warm", str(fleet["keep"])).returncode == 0
    fleet["upstream"].stop()  # a cached pin's blobs come from the cache alone
    try:
        after = json.loads(helper("check", str(fleet["keep"])).stdout)
    finally:
        fleet["upstream"].start()
    assert after["missing"] == [] and after["pins"] == {ref: before["pins"][ref] for ref in doc["keep"]}


def test_warm_links_the_blobs_the_chain_staged_and_reads_upstream_for_the_rest(fleet: dict, tmp_path: Path) -> None:
    """The chain (rigfetch) leaves each verified blob at {staging}/<name>/sha256:<hex>, on the storage's
    file system: warm hard-links it into the registry's storage (no copy, no upstream byte) and reads only
    the manifests and any blob not staged from upstream. The registry then serves the pull from disk."""
    pinned = fleet["pinned"]
    staging = Path(json.loads(fleet["keep"].read_text())["storage"]).parent / "staging"
    (staging / "image-a").mkdir(parents=True)
    layer = "sha256:" + hashlib.sha256(pinned.layers[0]).hexdigest()
    (staging / "image-a" / layer).write_bytes(pinned.layers[0])  # the layer staged; the config is not
    (staging / "image-a" / ("sha256:" + "e" * 64)).write_bytes(b"x")  # a blob of no pin: left alone
    doc = dict(json.loads(fleet["keep"].read_text()), staging=str(staging))
    fleet["keep"].write_text(json.dumps(doc))
    warmed = helper("warm", str(fleet["keep"]))
    assert warmed.returncode == 0, warmed.stderr
    assert fleet["upstream"].blob_bytes_served() == len(pinned.config)  # the layer came from the staging
    store = imagemirror.Storage(Path(doc["storage"]))
    assert store.blob(layer).stat().st_ino == (staging / "image-a" / layer).stat().st_ino  # a link, not a copy
    assert store.blob(layer).stat().st_uid == store.root.parents[2].stat().st_uid
    pull(fleet["mirror"].port, pinned)
    assert fleet["upstream"].blob_bytes_served() == len(pinned.config)


def test_a_relays_prune_keeps_only_its_pins_without_a_bound(fleet: dict) -> None:
    """A rig's relay (pins_only) keeps what its rig pins now and nothing else, whatever the bytes."""
    assert helper("warm", str(fleet["keep"])).returncode == 0
    pull(fleet["mirror"].port, fleet["other"])  # cached by the proxy itself: unpinned
    storage = imagemirror.Storage(Path(json.loads(fleet["keep"].read_text())["storage"]))
    deadline = time.monotonic() + 30
    while imagemirror.missing_parts(storage, "vllm/vllm-omni", fleet["other"].digest) and time.monotonic() < deadline:
        time.sleep(0.2)
    relay = fleet["keep"].parent / "relay.json"
    relay.write_text(json.dumps(dict(json.loads(fleet["keep"].read_text()), max_bytes=0, pins_only=True)))
    fleet["mirror"].stop()
    try:
        pruned = helper("prune", str(relay))
        again = helper("prune", str(relay))
    finally:
        fleet["mirror"].start()
    assert pruned.returncode == 0 and "pruned vllm/vllm-omni@" in pruned.stdout, pruned.stderr
    assert "warning" not in pruned.stderr + again.stderr and "holds only what its rig pins" in again.stdout
    check = json.loads(helper("check", str(relay)).stdout)
    assert check["missing"] == [] and check["unpinned"] == 0 and check["pins_only"] is True


def write_answer(port: int, method: str, path: str, body: bytes = b"") -> tuple[int, str | None, bytes]:
    """(status, Allow header, body) of one write request to the registry on `port`."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body or None, method=method,
                                     headers={"Content-Type": "application/vnd.docker.distribution.manifest.v2+json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, reply.headers.get("Allow"), reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("Allow"), exc.read()


def test_the_mirror_takes_no_push_or_delete_and_still_serves_pulls_and_rigups_fill(fleet: dict) -> None:
    """Read-only (rigup.desired.image_mirror.READ_ONLY): the real registry has no write route at all: a push's
    upload, a manifest's PUT, a manifest's or a blob's DELETE are answered 405 by the router, which lists only GET
    and HEAD (Allow), not by proxy mode's deeper refusal (a JSON UNSUPPORTED error, no Allow). rigup's fill
    (warm, through the storage) and a rig's pull still work, and nothing a write tried is in the storage."""
    pinned, port = fleet["pinned"], fleet["mirror"].port
    warmed = helper("warm", str(fleet["keep"]))
    assert warmed.returncode == 0, warmed.stderr
    layer = "sha256:" + hashlib.sha256(pinned.layers[0]).hexdigest()
    writes = [("POST", "/v2/vllm/vllm-openai/blobs/uploads/", b""),
              ("POST", "/v2/rigup-probe/blobs/uploads/", b""),
              ("PUT", "/v2/vllm/vllm-openai/manifests/v2", pinned.manifest),
              ("DELETE", f"/v2/vllm/vllm-openai/manifests/{pinned.digest}", b""),
              ("DELETE", f"/v2/vllm/vllm-openai/blobs/{layer}", b"")]
    for method, path, body in writes:
        status, allow, text = write_answer(port, method, path, body)
        assert status == 405 and b"UNSUPPORTED" not in text, (method, path, status, text)
        assert allow is not None and set(allow.replace(" ", "").split(",")) <= {"GET", "HEAD"}, (method, path, allow)
    pull(port, pinned)
    assert json.loads(helper("check", str(fleet["keep"])).stdout)["missing"] == []
    storage = Path(json.loads(fleet["keep"].read_text())["storage"])
    assert not (storage / "docker/registry/v2/repositories/rigup-probe").exists()
    assert not list(storage.glob("docker/registry/v2/repositories/*/_uploads/*"))


def test_a_tag_pin_is_cached_with_its_tag_and_pulled_by_it_from_the_mirror(fleet: dict) -> None:
    """A lock without image digests pins tags: warm resolves the tag upstream once and writes the registry's
    tag files; a rig's pull by tag then costs the upstream a manifest look-up, no blob."""
    doc = dict(json.loads(fleet["keep"].read_text()), keep=["vllm/vllm-omni:v1"])
    fleet["keep"].write_text(json.dumps(doc))
    assert json.loads(helper("check", str(fleet["keep"])).stdout)["missing"] == ["vllm/vllm-omni:v1"]
    warmed = helper("warm", str(fleet["keep"]))
    assert warmed.returncode == 0, warmed.stderr
    assert json.loads(helper("check", str(fleet["keep"])).stdout)["missing"] == []
    assert fleet["upstream"].blob_bytes_served() == image_bytes(fleet["other"])
    accept = {"Accept": "application/vnd.docker.distribution.manifest.v2+json"}
    url = f"http://127.0.0.1:{fleet['mirror'].port}/v2/vllm/vllm-omni/manifests/v1"
    assert urllib.request.urlopen(urllib.request.Request(url, headers=accept)).read() == fleet["other"].manifest
    pull(fleet["mirror"].port, fleet["other"])
    assert fleet["upstream"].blob_bytes_served() == image_bytes(fleet["other"])


def test_a_cold_mirror_reads_upstream_again_for_each_concurrent_miss(fleet: dict) -> None:
    """Why rigup fills the mirror's cache before the rigs pull: distribution 2.8 reads a missed blob from
    upstream for its storage and again for each client missing it at the same time."""
    with ThreadPoolExecutor(3) as pool:
        list(pool.map(lambda _: pull(fleet["mirror"].port, fleet["other"]), range(3)))
    assert fleet["upstream"].blob_bytes_served() >= 3 * image_bytes(fleet["other"])


@pytest.mark.parametrize("by", ["digest", "tag"])
def test_prune_drops_what_no_rig_pins_and_keeps_the_pin(fleet: dict, by: str) -> None:
    if by == "tag":  # a lock without image digests pins the tag: its cached manifest is what is kept
        fleet["keep"].write_text(json.dumps(dict(json.loads(fleet["keep"].read_text()), keep=["vllm/vllm-openai:v1"])))
    assert helper("warm", str(fleet["keep"])).returncode == 0
    pull(fleet["mirror"].port, fleet["other"])  # an image no rig pins any more, cached earlier
    keep_path = fleet["keep"]
    storage = imagemirror.Storage(Path(json.loads(keep_path.read_text())["storage"]))
    other_layer = "sha256:" + hashlib.sha256(fleet["other"].layers[0]).hexdigest()
    deadline = time.monotonic() + 30  # the registry commits missed blobs and their links after serving them
    while imagemirror.missing_parts(storage, "vllm/vllm-omni", fleet["other"].digest) and time.monotonic() < deadline:
        time.sleep(0.2)
    fleet["mirror"].stop()  # the unit's stop and start are systemd's; here the test does them
    try:
        used = storage.used_bytes()  # once the registry is stopped: nothing is being written any more
        assert json.loads(helper("check", str(keep_path)).stdout)["unpinned"] == 1
        doc = json.loads(keep_path.read_text())
        (keep_path.parent / "within.json").write_text(json.dumps(dict(doc, max_bytes=used + 1)))
        unchanged = helper("prune", str(keep_path.parent / "within.json"))
        assert unchanged.returncode == 0 and "within its bound" in unchanged.stdout
        doc["max_bytes"] = used - image_bytes(fleet["other"]) // 2  # over by part of the unpinned image
        keep_path.write_text(json.dumps(doc))
        torn = storage.layer_link("vllm/vllm-omni", "sha256:" + "f" * 64)  # a registry stopped mid-write
        torn.parent.mkdir(parents=True)
        torn.write_text("")
        pruned = helper("prune", str(keep_path))
    finally:
        fleet["mirror"].start()
    assert pruned.returncode == 0, pruned.stderr
    assert "pruned vllm/vllm-omni@" in pruned.stdout and "vllm/vllm-openai" not in pruned.stdout
    assert not storage.blob(other_layer).is_file() and not torn.exists()
    assert json.loads(helper("check", str(keep_path)).stdout)["unpinned"] == 0
    assert storage.used_bytes() <= doc["max_bytes"]
    assert json.loads(helper("check", str(keep_path)).stdout)["missing"] == []
    served = fleet["upstream"].blob_bytes_served()
    pull(fleet["mirror"].port, fleet["pinned"])  # the pin still comes from the mirror's disk
    assert fleet["upstream"].blob_bytes_served() == served


def test_pins_alone_over_the_bound_are_kept_with_a_warning(fleet: dict) -> None:
    assert helper("warm", str(fleet["keep"])).returncode == 0
    doc = dict(json.loads(fleet["keep"].read_text()), max_bytes=1000)
    tight = fleet["keep"].parent / "tight.json"
    tight.write_text(json.dumps(doc))
    fleet["mirror"].stop()
    try:
        result = helper("prune", str(tight))
    finally:
        fleet["mirror"].start()
    assert result.returncode == 0, result.stderr
    assert "raise image_mirror_max_gb" in result.stderr and "pruned" not in result.stdout
    assert json.loads(helper("check", str(tight)).stdout)["missing"] == []


def test_check_names_a_bad_pin_and_a_missing_keep_file(tmp_path: Path) -> None:
    keep = tmp_path / "keep.json"
    keep.write_text(json.dumps({"storage": str(tmp_path), "max_bytes": 1, "keep": ["vllm/vllm-openai@sha256:abc"]}))
    bad = helper("check", str(keep))
    assert bad.returncode == 1 and "not a repository@sha256:digest or repository:tag pin" in bad.stderr
    gone = helper("check", str(tmp_path / "nope.json"))
    assert gone.returncode == 1 and "cannot read" in gone.stderr
    shutil.rmtree(tmp_path)


@contextlib.contextmanager
def docker_hub_like(built, corrupt: str | None = None) -> Iterator[tuple[int, list[dict]]]:
    """Docker Hub's shape (distribution's token spec; api.md: a blob GET may redirect to another origin):
    /v2/ paths answer 401 with a Bearer challenge, the realm hands out an anonymous token for the scope,
    and a blob answers 307 to a CDN origin that refuses a request carrying the registry's token. Yields
    (port, the token requests); `corrupt` names a blob the CDN sends with one byte flipped."""
    blobs = {"sha256:" + hashlib.sha256(b).hexdigest(): b for b in (*built.layers, built.config)}
    token_asks: list[dict] = []
    cdn_port, hub_port = free_port(), free_port()
    scope = f"repository:{built.repository}:pull"

    class Hub(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:  # noqa: N802 - stdlib naming
            url = urllib.parse.urlsplit(self.path)
            if url.path == "/token":
                token_asks.append(dict(urllib.parse.parse_qsl(url.query)))
                return self.answer(200, json.dumps({"token": "anon-t0k"}).encode())
            if self.headers.get("Authorization") != "Bearer anon-t0k":
                self.send_response(401)
                self.send_header("WWW-Authenticate", f'Bearer realm="http://127.0.0.1:{hub_port}/token",'
                                 f'service="registry.docker.io",scope="{scope}"')
                self.send_header("Content-Length", "0")
                return self.end_headers()
            if url.path.endswith(f"/manifests/{built.digest}"):
                return self.answer(200, built.manifest)
            digest = url.path.rsplit("/", 1)[-1]
            if digest in blobs:
                self.send_response(307)
                self.send_header("Location", f"http://127.0.0.1:{cdn_port}/cdn/{digest}?signed=1")
                self.send_header("Content-Length", "0")
                return self.end_headers()
            return self.answer(404, b"{}")

        def answer(self, code: int, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    class Cdn(Hub):
        def do_GET(self) -> None:  # noqa: N802 - stdlib naming
            if "Authorization" in self.headers:  # S3-style: one auth mechanism only
                return self.answer(400, b"Only one auth mechanism allowed")
            digest = urllib.parse.urlsplit(self.path).path.rsplit("/", 1)[-1]
            body = blobs[digest]
            if digest == corrupt:
                body = bytes([body[0] ^ 0xFF]) + body[1:]
            return self.answer(200, body)

    servers = [http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)
               for port, handler in ((hub_port, Hub), (cdn_port, Cdn))]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield hub_port, token_asks
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()


def hub_keep(tmp_path: Path, port: int, built) -> Path:
    keep = tmp_path / "keep.json"
    keep.write_text(json.dumps({"storage": str(tmp_path / "data"), "upstream": f"http://127.0.0.1:{port}",
                                "max_bytes": 10**9, "keep": [f"{built.repository}@{built.digest}"]}))
    return keep


def test_warm_takes_an_anonymous_token_and_follows_blob_redirects_without_it(tmp_path: Path) -> None:
    built = image("library/busybox", 3, 300_000)
    with docker_hub_like(built) as (port, token_asks):
        keep = hub_keep(tmp_path, port, built)
        warmed = helper("warm", str(keep))
        assert warmed.returncode == 0, warmed.stderr
    assert json.loads(helper("check", str(keep)).stdout)["missing"] == []
    assert token_asks == [{"service": "registry.docker.io", "scope": "repository:library/busybox:pull"}]
    store = imagemirror.Storage(tmp_path / "data")
    for blob in (*built.layers, built.config):
        digest = "sha256:" + hashlib.sha256(blob).hexdigest()
        assert store.blob(digest).read_bytes() == blob
        assert store.layer_link("library/busybox", digest).read_text() == digest
    assert store.blob(built.digest).read_bytes() == built.manifest
    assert store.revision("library/busybox", built.digest).read_text() == built.digest


def test_warm_keeps_no_byte_of_a_blob_that_fails_its_digest(tmp_path: Path) -> None:
    built = image("library/busybox", 4, 300_000)
    layer = "sha256:" + hashlib.sha256(built.layers[0]).hexdigest()
    with docker_hub_like(built, corrupt=layer) as (port, _):
        keep = hub_keep(tmp_path, port, built)
        result = helper("warm", str(keep))
    assert result.returncode == 1 and f"blob {layer}: upstream sent bytes of another digest" in result.stderr
    store = imagemirror.Storage(tmp_path / "data")
    assert not store.blob(layer).exists() and not list(store.blob(layer).parent.glob(".data.*"))
    assert not store.revision("library/busybox", built.digest).exists()
    assert json.loads(helper("check", str(keep)).stdout)["missing"] == [f"library/busybox@{built.digest}"]


def test_warm_stops_on_a_pin_the_upstream_lacks(fleet: dict) -> None:
    doc = json.loads(fleet["keep"].read_text())
    other = fleet["other"]
    # a pin naming the unpinned image's manifest under the pinned repository: the upstream has no such
    # manifest there, and warm stops naming the URL instead of caching anything
    doc["keep"] = [f"vllm/vllm-openai@{other.digest}"]
    fleet["keep"].write_text(json.dumps(doc))
    result = helper("warm", str(fleet["keep"]))
    assert result.returncode == 1 and "HTTP 404" in result.stderr
    assert json.loads(helper("check", str(fleet["keep"])).stdout)["missing"] == doc["keep"]
