#!/usr/bin/env python3
"""rigup's helper beside a registry of the fleet (standard library only): the image mirror's, and each
rig's relay (a registry on 127.0.0.1 proxying the mirror). Which pinned images the cache lacks, putting
them into it, and keeping it under its bound.

    rigup-image-mirror check KEEP_FILE   JSON on stdout: {"missing": [ref...], "bytes": N, "max_bytes": M,
                                         "unpinned": K, "pins": {ref: {"repository", "digest", "blobs"}}}
    rigup-image-mirror warm KEEP_FILE    put every missing pinned image into the cache
    rigup-image-mirror stage KEEP_FILE   before the chain: drop staging of pins gone, and link blobs the
                                         cache already holds into the staging (rigfetch hashes, not fetches)
    rigup-image-mirror prune KEEP_FILE   when the cache is over max_bytes, drop images no rig pins now

KEEP_FILE (written by rigup, rigup.desired.image_mirror.MirrorRole.keep_text) names the registry's storage
directory, its config, unit, port and upstream, the bound, the pins to keep ("repository@sha256:..."),
and the staging directory rigfetch's chain fills. A relay's says pins_only: it keeps nothing else.

check lists each pin's blobs (config and layers, digest and size), read from the cache when it holds the
pin, else from upstream's manifests: what the fleet's chain (rigfetch, hub_auth "registry") moves, each
blob once over every link, into {staging}/<name>/sha256:<hex>. warm then hard-links staged blobs into the
storage (same file system: no copy) and reads from upstream only what is not staged: the manifests, and
any blob the chain did not bring.

The cache is the distribution registry's filesystem storage (registry/storage/paths.go):
  docker/registry/v2/blobs/sha256/<2>/<hex>/data                       every blob, manifests included
  docker/registry/v2/repositories/<name>/_manifests/revisions/sha256/<hex>/link
  docker/registry/v2/repositories/<name>/_manifests/tags/<tag>/{current/link,index/sha256/<hex>/link}
  docker/registry/v2/repositories/<name>/_layers/sha256/<hex>/link

Why warm writes the cache itself: distribution 2.8 (the OS package) answers a cache miss by reading the
blob from upstream twice, once for its own storage and once for the client, and every concurrent miss of
the same blob reads it again (registry/proxy/proxyblobstore.go ServeBlob at v2.8.3). warm reads each blob
of a pinned image from upstream once, checks its digest, and puts it where the registry's storage keeps it
(data first, then the links; owned by the storage's owner), so the upstream serves the fleet one copy and
every rig's pull is a cache hit. It speaks the Registry API as a client does: anonymous bearer tokens
(Docker Hub's) and blob redirects to another origin, followed without the token. What warm stored carries
no proxy expiry (the registry expires only what it fetched itself, after 7 days); prune bounds it.

prune: drops the manifests no rig pins, least recently cached first (by their link's mtime), until the
blobs the rest reference fit the bound; the registry is stopped, `docker-registry garbage-collect`
deletes the blobs nothing references any more, and it starts again. Pins alone over the bound are
kept (a warning says so): a bound never breaks a rig's next pull.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

V2 = Path("docker/registry/v2")
INDEX_TYPES = frozenset({"application/vnd.docker.distribution.manifest.list.v2+json",
                         "application/vnd.oci.image.index.v1+json"})
ACCEPT = ", ".join(["application/vnd.docker.distribution.manifest.v2+json",
                    "application/vnd.oci.image.manifest.v1+json", *sorted(INDEX_TYPES)])
PLATFORM = {"os": "linux", "architecture": "amd64"}
CHUNK = 1 << 20


class HelperError(Exception):
    """What the helper cannot do; main prints it and exits 1."""


def die(message: str) -> NoReturn:
    raise HelperError(message)


class Storage:
    def __init__(self, root: Path) -> None:
        self.root = root / V2

    def blob(self, digest: str) -> Path:
        algorithm, hexa = digest.split(":", 1)
        return self.root / "blobs" / algorithm / hexa[:2] / hexa / "data"

    def revision(self, repository: str, digest: str) -> Path:
        algorithm, hexa = digest.split(":", 1)
        return self.root / "repositories" / repository / "_manifests" / "revisions" / algorithm / hexa / "link"

    def layer_link(self, repository: str, digest: str) -> Path:
        algorithm, hexa = digest.split(":", 1)
        return self.root / "repositories" / repository / "_layers" / algorithm / hexa / "link"

    def manifest(self, digest: str) -> dict | None:
        try:
            return json.loads(self.blob(digest).read_bytes())
        except (OSError, ValueError):
            return None

    def revisions(self) -> list[tuple[str, str, float]]:
        """(repository, digest, mtime of its link) of every cached manifest."""
        found = []
        repos = self.root / "repositories"
        for link in repos.glob("**/_manifests/revisions/*/*/link") if repos.is_dir() else ():
            repository = str(link.parent.parent.parent.parent.parent.relative_to(repos))
            found.append((repository, f"{link.parent.parent.name}:{link.parent.name}", link.stat().st_mtime))
        return found

    def used_bytes(self) -> int:
        total = 0
        for directory, _, names in os.walk(self.root):
            for name in names:
                try:
                    total += os.lstat(os.path.join(directory, name)).st_size
                except OSError:
                    pass
        return total


def children(manifest: dict) -> list[str]:
    """The platform manifest(s) an index leads a linux/amd64 pull to (Docker pulls only its platform's)."""
    entries = manifest.get("manifests") or []
    chosen = [m["digest"] for m in entries if all((m.get("platform") or {}).get(k) == v for k, v in PLATFORM.items())]
    return chosen[:1]


def blobs_of(manifest: dict) -> list[tuple[str, int]]:
    return [(d["digest"], int(d.get("size") or 0)) for d in [manifest.get("config") or {}, *(manifest.get("layers") or [])]
            if d.get("digest")]


def missing_parts(store: Storage, repository: str, digest: str) -> bool:
    """Whether the cache lacks anything a pull of repository@digest reads."""
    if not store.revision(repository, digest).is_file():
        return True
    manifest = store.manifest(digest)
    if manifest is None:
        return True
    if manifest.get("mediaType") in INDEX_TYPES or "manifests" in manifest:
        picked = children(manifest)
        return not picked or any(missing_parts(store, repository, child) for child in picked)
    return any(not store.blob(d).is_file() or not store.layer_link(repository, d).is_file() for d, _ in blobs_of(manifest))


def pin_name(ref: str) -> str:
    """The staging directory (and the chain's model name) of a pin: {staging}/<this>/sha256:<hex>."""
    return "image-" + hashlib.sha256(ref.encode()).hexdigest()[:16]


def stale_staging(keep: dict) -> list[str]:
    """Staging directories of no current pin (left by an earlier lock)."""
    staging = Path(keep.get("staging") or "/nonexistent")
    wanted = {pin_name(ref) for ref in keep["keep"]}
    return sorted(p.name for p in staging.iterdir() if p.name not in wanted) if staging.is_dir() else []


def split_ref(ref: str) -> tuple[str, str]:
    """(repository, sha256:digest or tag) of a pin, `repository@sha256:...` or `repository:tag`."""
    repository, _, digest = ref.partition("@")
    if digest:
        if not repository or not re.fullmatch(r"sha256:[0-9a-f]{64}", digest):
            die(f"not a repository@sha256:digest or repository:tag pin: {ref!r}")
        return repository, digest
    repository, _, tag = ref.rpartition(":")
    if not repository or not tag or "/" in tag:
        die(f"not a repository@sha256:digest or repository:tag pin: {ref!r}")
    return repository, tag


def tag_link(store: Storage, repository: str, tag: str) -> Path:
    return store.root / "repositories" / repository / "_manifests" / "tags" / tag / "current" / "link"


def resolved(store: Storage, repository: str, reference: str) -> str | None:
    """The digest a pin stands for in the cache: itself, or what the cached tag points to (None: not cached).
    A tag that moved upstream since is the registry's to notice when a rig pulls it."""
    if reference.startswith("sha256:"):
        return reference
    try:
        return tag_link(store, repository, reference).read_text().strip() or None
    except OSError:
        return None


def pinned_revisions(store: Storage, keep: dict) -> set[tuple[str, str]]:
    """(repository, digest) of every cached manifest a pin needs: the pinned one (a tag pin's, as cached)
    and the platform manifest an index leads to."""
    pinned: set[tuple[str, str]] = set()
    for ref in keep["keep"]:
        repository, reference = split_ref(ref)
        digest = resolved(store, repository, reference)
        if digest is not None:
            pinned.add((repository, digest))
            pinned.update((repository, child) for child in children(store.manifest(digest) or {}))
    return pinned


def check(keep: dict) -> dict:
    """The pins the cache lacks, its bytes and bound, how many cached manifests no pin needs (what a prune
    could drop), and each pin's blobs: from the cache, or for a missing pin from upstream (an upstream that
    fails leaves the pin's entry with an "error" instead)."""
    store = Storage(Path(keep["storage"]))
    missing = []
    pins: dict[str, dict] = {}
    upstream = None
    for ref in keep["keep"]:
        repository, reference = split_ref(ref)
        digest = resolved(store, repository, reference)
        if digest is None or missing_parts(store, repository, digest):
            missing.append(ref)
            upstream = upstream or Upstream(keep["upstream"])
            try:
                digest, blobs = upstream_blobs(upstream, repository, reference)
            except HelperError as exc:
                pins[ref] = {"repository": repository, "error": str(exc)}
                continue
        else:
            blobs = cached_blobs(store, digest)
        pins[ref] = {"repository": repository, "digest": digest, "blobs": [[d, size] for d, size in blobs]}
    pinned = pinned_revisions(store, keep)
    unpinned = sum(1 for repository, digest, _ in store.revisions() if (repository, digest) not in pinned)
    return {"missing": missing, "bytes": store.used_bytes(), "max_bytes": int(keep["max_bytes"]), "unpinned": unpinned,
            "pins_only": bool(keep.get("pins_only")), "pins": pins, "stale_staging": stale_staging(keep)}


def cached_blobs(store: Storage, digest: str) -> list[tuple[str, int]]:
    """The config and layers a cached manifest (an index: its platform manifest) leads a pull to."""
    manifest = store.manifest(digest) or {}
    if manifest.get("mediaType") in INDEX_TYPES or "manifests" in manifest:
        return [blob for child in children(manifest) for blob in cached_blobs(store, child)]
    return blobs_of(manifest)


def upstream_blobs(upstream: Upstream, repository: str, reference: str) -> tuple[str, list[tuple[str, int]]]:
    """(the pin's digest, the config and layers a pull of it reads), from upstream's manifests."""
    top, blobs = None, []
    for current, manifest, _ in upstream_manifests(upstream, repository, reference):
        top = top or current
        blobs.extend(blobs_of(manifest))
    return str(top), blobs


def upstream_manifests(upstream: Upstream, repository: str, reference: str) -> Iterator[tuple[str, dict, bytes]]:
    """(digest, manifest, its bytes) of the pin's manifest and, for an index, of its platform manifest:
    each checked against its digest (a tag's is the digest of what upstream served for it)."""
    manifests = [reference]
    while manifests:
        current = manifests.pop()
        with upstream.open(f"/v2/{repository}/manifests/{current}", repository, ACCEPT) as response:
            body = response.read()
        digest = "sha256:" + hashlib.sha256(body).hexdigest()
        if not current.startswith("sha256:"):
            current = digest
        elif digest != current:
            die(f"{repository}@{current}: upstream served a manifest of another digest")
        try:
            manifest = json.loads(body)
        except ValueError:
            die(f"{repository}@{current}: upstream served a manifest that is not JSON")
        if manifest.get("mediaType") in INDEX_TYPES or "manifests" in manifest:
            picked = children(manifest)
            if not picked:
                die(f"{repository}@{current}: the index has no linux/amd64 image")
            manifests.extend(picked)
        yield current, manifest, body


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001 - urllib's signature
        return None  # a 3xx comes back as an HTTPError: Upstream follows it without the token


class Upstream:
    """The registry the mirror proxies, read as `docker pull` reads it: an anonymous bearer token when it
    challenges for one (distribution's token spec: `WWW-Authenticate: Bearer realm=...,service=...,scope=...`,
    as Docker Hub does), and a blob's redirect to another origin followed without that token."""

    def __init__(self, base: str) -> None:
        self.base = base.rstrip("/")
        self.opener = urllib.request.build_opener(_NoRedirect)
        self.tokens: dict[str, str] = {}

    def open(self, path: str, repository: str, accept: str | None = None):
        url = f"{self.base}{path}"
        for _ in range(2):
            headers = {"Accept": accept} if accept else {}
            if repository in self.tokens:
                headers["Authorization"] = f"Bearer {self.tokens[repository]}"
            try:
                return self.opener.open(urllib.request.Request(url, headers=headers), timeout=60)
            except urllib.error.HTTPError as exc:
                if exc.code == 401 and repository not in self.tokens:
                    self.tokens[repository] = self._token(exc.headers.get("WWW-Authenticate", ""), url)
                    continue
                if exc.code in (301, 302, 303, 307, 308) and exc.headers.get("Location"):
                    target = urllib.parse.urljoin(url, exc.headers["Location"])
                    try:
                        return urllib.request.urlopen(target, timeout=60)
                    except (urllib.error.HTTPError, OSError) as err:
                        die(f"{url}: its redirect to {target.split('?')[0]} failed: {err}")
                die(f"{url}: HTTP {exc.code}: {exc.read(300).decode(errors='replace')}")
            except OSError as exc:
                die(f"{url}: {exc}")
        die(f"{url}: refused with a token")

    @staticmethod
    def _token(challenge: str, url: str) -> str:
        scheme, _, rest = challenge.partition(" ")
        params = dict(re.findall(r'(\w+)="([^"]*)"', rest))
        realm = params.pop("realm", None)
        if scheme.lower() != "bearer" or not realm:
            die(f"{url}: HTTP 401 without a bearer challenge ({challenge!r}); the mirror pulls anonymously")
        try:
            with urllib.request.urlopen(f"{realm}?{urllib.parse.urlencode(params)}", timeout=60) as response:
                body = json.loads(response.read())
        except (OSError, ValueError) as exc:
            die(f"{realm}: no token: {exc}")
        token = body.get("token") or body.get("access_token")
        if not token:
            die(f"{realm}: the answer holds no token")
        return str(token)


class Writer:
    """Puts verified blobs and links into the registry's storage, as the storage's owner."""

    def __init__(self, store: Storage) -> None:
        self.store = store
        self.store.root.mkdir(parents=True, exist_ok=True)
        self.top = self.store.root.parents[2]  # the rootdirectory: the package made it the registry user's
        self.owner = (self.top.stat().st_uid, self.top.stat().st_gid)

    def _own(self, path: Path) -> None:
        while path != self.top and self.top in path.parents:
            os.chown(path, *self.owner)
            path = path.parent

    def blob(self, digest: str, response, label: str) -> int:
        path = self.store.blob(digest)
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".data.{os.getpid()}")
        algorithm, want = digest.split(":", 1)
        hasher = hashlib.new(algorithm)
        size = int(response.headers.get("Content-Length") or 0)
        done, shown = 0, 0
        with response, open(temporary, "wb") as out:
            while chunk := response.read(CHUNK):
                hasher.update(chunk)
                out.write(chunk)
                done += len(chunk)
                if size and done * 10 // size > shown:
                    shown = done * 10 // size
                    print(f"  {label}: {done / 1e6:.0f}/{size / 1e6:.0f} MB", flush=True)
            out.flush()
            os.fsync(out.fileno())
        if hasher.hexdigest() != want:
            temporary.unlink()
            die(f"blob {digest}: upstream sent bytes of another digest (sha256:{hasher.hexdigest()})")
        os.replace(temporary, path)
        self._own(path)
        return done

    def staged(self, digest: str, source: Path) -> None:
        """Hard-link a blob the chain staged (verified by rigfetch against its digest) into the storage."""
        path = self.store.blob(digest)
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".data.{os.getpid()}")
        temporary.unlink(missing_ok=True)
        try:
            os.link(source, temporary)
        except OSError:  # another file system (a staging directory moved elsewhere): a copy
            shutil.copyfile(source, temporary)
        os.replace(temporary, path)
        self._own(path)

    def link(self, path: Path, digest: str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(digest)
        self._own(path)


def staged_blob(keep: dict, digest: str, size: int) -> Path | None:
    """The chain's verified copy of a blob ({staging}/<name>/sha256:<hex>, only ever renamed into place
    after its SHA-256 matched), when it is there with the right size."""
    staging = keep.get("staging")
    for path in Path(staging).glob(f"*/{digest}") if staging and Path(staging).is_dir() else ():
        try:
            if path.stat().st_size == size:
                return path
        except OSError:
            continue
    return None


def warm(keep: dict) -> None:
    store = Storage(Path(keep["storage"]))
    upstream, writer = Upstream(keep["upstream"]), Writer(store)
    started, total, linked = time.monotonic(), 0, 0
    for ref in keep["keep"]:
        repository, reference = split_ref(ref)
        cached = resolved(store, repository, reference)
        if cached is not None and not missing_parts(store, repository, cached):
            continue
        print(f"rigup-image-mirror: caching {ref} from {upstream.base}", flush=True)
        tag = None if reference.startswith("sha256:") else reference
        top = None  # the digest the pin stands for: the tag's, read from the manifest upstream serves for it
        # the platform manifest (popped first) before the index: a revision the registry finds has every
        # blob and manifest it names
        for current, manifest, body in reversed(list(upstream_manifests(upstream, repository, reference))):
            top = current
            for blob, size in blobs_of(manifest):
                if not store.blob(blob).is_file():
                    staged = staged_blob(keep, blob, size)
                    if staged is not None:
                        writer.staged(blob, staged)
                        linked += size
                    else:
                        response = upstream.open(f"/v2/{repository}/blobs/{blob}", repository)
                        total += writer.blob(blob, response, blob[7:19])
                writer.link(store.layer_link(repository, blob), blob)
            if not store.blob(current).is_file():
                writer.blob(current, _Body(body), current[7:19])
            writer.link(store.revision(repository, current), current)
        if tag is not None and top is not None:  # the registry's tag files (registry/storage/paths.go)
            algorithm, hexa = top.split(":", 1)
            writer.link(tag_link(store, repository, tag).parent.parent / "index" / algorithm / hexa / "link", top)
            writer.link(tag_link(store, repository, tag), top)
    elapsed = time.monotonic() - started
    print(f"rigup-image-mirror: cached {total / 1e9:.2f} GB from {upstream.base} and {linked / 1e9:.2f} GB the "
          f"fleet's chain staged, in {elapsed:.0f} s", flush=True)


def stage(keep: dict) -> None:
    """Make the staging match the pins before the chain runs: directories of pins gone are removed, and
    each blob of a pin the cache holds is linked into the pin's staging directory when it is not there
    (a cache filled before the chain existed, or by the proxy itself). rigfetch then hashes it in place
    instead of fetching it; its stamp makes it a source for the chain."""
    staging = keep.get("staging")
    if not staging:
        die("the keep file names no staging directory")
    for name in stale_staging(keep):
        shutil.rmtree(Path(staging) / name, ignore_errors=True)
        print(f"rigup-image-mirror: removed the staging of a pin gone ({name})")
    store, linked = Storage(Path(keep["storage"])), 0
    for ref in keep["keep"]:
        repository, reference = split_ref(ref)
        digest = resolved(store, repository, reference)
        if digest is None:
            continue
        directory = Path(staging) / pin_name(ref)
        for blob, size in cached_blobs(store, digest):
            target, source = directory / blob, store.blob(blob)
            if target.exists() or not source.is_file() or source.stat().st_size != size:
                continue
            directory.mkdir(parents=True, exist_ok=True)
            try:
                os.link(source, target)
            except OSError:
                continue  # another file system: the chain fetches it
            linked += size
    if linked:
        print(f"rigup-image-mirror: linked {linked / 1e9:.2f} GB the cache holds into the staging (to be hashed)")


class _Body:
    """A manifest already read, as Writer.blob reads a response."""

    def __init__(self, body: bytes) -> None:
        self.stream = io.BytesIO(body)
        self.headers = {"Content-Length": str(len(body))}

    def read(self, size: int = -1) -> bytes:
        return self.stream.read(size)

    def __enter__(self) -> _Body:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stream.close()


def needed_blobs(store: Storage, digest: str) -> dict[str, int]:
    """Blob digest -> size of what a cached manifest needs: itself, its config and its layers."""
    path = store.blob(digest)
    return {digest: path.stat().st_size if path.is_file() else 0, **dict(blobs_of(store.manifest(digest) or {}))}


def prune(keep: dict) -> None:
    store = Storage(Path(keep["storage"]))
    bound = int(keep["max_bytes"])
    used = store.used_bytes()
    if keep.get("pins_only"):  # a relay: nothing but what its rig pins now
        bound = 0
    elif used <= bound:
        print(f"rigup-image-mirror: the cache holds {used / 1e9:.2f} GB, within its bound of {bound / 1e9:.2f} GB")
        return
    pinned = pinned_revisions(store, keep)
    revisions = store.revisions()
    needs = {(r, d): needed_blobs(store, d) for r, d, _ in revisions}  # each manifest read once
    kept = list(needs)
    dropped = []
    for repository, digest, _ in sorted((x for x in revisions if (x[0], x[1]) not in pinned), key=lambda x: x[2]):
        if sum({blob: size for k in kept for blob, size in needs[k].items()}.values()) <= bound:
            break
        kept.remove((repository, digest))
        dropped.append((repository, digest))
    if not dropped and keep.get("pins_only"):
        print("rigup-image-mirror: the cache holds only what its rig pins now")
        return
    if not dropped:  # pins alone: nothing to drop, and no reason to stop the registry
        print(f"rigup-image-mirror: warning: the images rigs pin now take {used / 1e9:.2f} GB, over the bound "
              f"of {bound / 1e9:.2f} GB; raise image_mirror_max_gb", file=sys.stderr)
        return
    if keep.get("unit"):
        subprocess.run(["systemctl", "stop", keep["unit"]], check=True)
    try:
        for repository, digest in dropped:
            shutil.rmtree(store.revision(repository, digest).parent, ignore_errors=True)
            tags = store.root / "repositories" / repository / "_manifests" / "tags"
            for current in tags.glob("*/current/link") if tags.is_dir() else ():
                if current.read_text().strip() == digest:
                    shutil.rmtree(current.parent.parent, ignore_errors=True)
        gc = subprocess.run([keep.get("binary") or "docker-registry", "garbage-collect", keep["config"]],
                            capture_output=True, text=True)
        if gc.returncode != 0:
            die(f"docker-registry garbage-collect failed: {gc.stderr[-800:]}")
        # layer links of blobs garbage-collect deleted would send the registry to a missing file; so would
        # one a registry stopped mid-write left empty
        repos = store.root / "repositories"
        for link in repos.glob("**/_layers/*/*/link") if repos.is_dir() else ():
            target = link.read_text().strip()
            if not target.startswith("sha256:") or not store.blob(target).is_file():
                shutil.rmtree(link.parent, ignore_errors=True)
    finally:
        if keep.get("unit"):
            subprocess.run(["systemctl", "start", keep["unit"]], check=True)
    after = store.used_bytes()
    names = ", ".join(f"{r}@{d[:19]}" for r, d in dropped) or "nothing"
    print(f"rigup-image-mirror: pruned {names}: {used / 1e9:.2f} GB -> {after / 1e9:.2f} GB (bound {bound / 1e9:.2f} GB)")
    if after > bound and not keep.get("pins_only"):
        print(f"rigup-image-mirror: warning: the images rigs pin now take {after / 1e9:.2f} GB, over the bound; "
              "raise image_mirror_max_gb", file=sys.stderr)


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("check", "warm", "stage", "prune"):
        print(__doc__, file=sys.stderr)
        return 2
    try:
        try:
            keep = json.loads(Path(argv[1]).read_text())
        except (OSError, ValueError) as exc:
            die(f"cannot read {argv[1]}: {exc}")
        if argv[0] == "check":
            print(json.dumps(check(keep)))
        elif argv[0] == "warm":
            warm(keep)
        elif argv[0] == "stage":
            stage(keep)
        else:
            prune(keep)
    except HelperError as exc:
        print(f"rigup-image-mirror: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
