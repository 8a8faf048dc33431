"""Resolving pins on the control machine: git ls-remote, the hub's file hashes, registry digests, and
the update of the lock file with its printed difference."""

from __future__ import annotations

import hashlib
import re
import ssl
import tempfile
import urllib.parse
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import requests

from rigup.desired.catalog import load_catalog
from rigup.desired.knobs import knob
from rigup.desired.lock import (
    DIGEST,
    MAX_HASHED_DOWNLOAD,
    SHA40,
    SHA256_HEX,
    SHORT_HEX,
    FilePin,
    GitNeed,
    GitPin,
    ImageNeed,
    ImagePin,
    LockError,
    LockFile,
    ModelNeed,
    ModelPin,
    Need,
    is_safe_relpath,
    need_problem,
)
from rigup.desired.trust import certificate_problem, client_environment, untrusted_message

# GitPython and huggingface_hub are imported in the methods that use them, not at the top: every rigup
# command imports this module (rigup.cli.lock, to build its parser), and they take about 40 ms and 145 ms
# to import, a third of the CLI's start-up, which only `rigup lock` needs.


def _git_env(ca_bundle: str | None = None) -> dict[str, str]:
    # Never hang on a credential prompt; a private remote must fail with a message instead. HTTPS checked
    # against the control machine's bundle (rigup.desired.trust: ca_bundle, else the system's store).
    return {"GIT_TERMINAL_PROMPT": "0", "GIT_ASKPASS": "/bin/true", **client_environment(ca_bundle)}


def _hf_client_factory(ca_bundle: str) -> Any:
    """huggingface_hub's client (its default factory's settings) checking HTTPS against `ca_bundle`, not
    certifi's bundle, which holds no private CA."""
    import httpx2  # huggingface_hub's HTTP client; here for the same reason as huggingface_hub
    from huggingface_hub.utils import _http

    def factory() -> Any:
        return httpx2.Client(event_hooks={"request": [_http.hf_request_event_hook]}, follow_redirects=True, timeout=None,
                             verify=ssl.create_default_context(cafile=ca_bundle))

    return factory


class Resolver:
    """Turns needs into pins. Network access happens only here, over HTTPS checked against `ca_bundle` (a PEM
    file: rigup.desired.trust.control_ca_bundle; None: each client's own default)."""

    def __init__(self, hf_token: str | None = None, image_digests: bool = False, log: Any = None,
                 ca_bundle: str | None = None) -> None:
        self.hf_token = hf_token
        self.image_digests = image_digests
        self.log = log or (lambda message: None)
        self.ca_bundle = ca_bundle
        self._hf_factory_set = False

    @property
    def verify(self) -> str | bool:
        """requests' verify=: the bundle, else requests' default."""
        return self.ca_bundle or True

    def _untrusted(self, url: str, exc: BaseException) -> LockError | None:
        problem = certificate_problem(exc)
        return None if problem is None else LockError(untrusted_message(url, problem, self.ca_bundle))

    # -- git -----------------------------------------------------------------------------------
    def git(self, need: GitNeed) -> GitPin:
        import git as gitpython  # here, not at the top: see the note below the imports

        runner = gitpython.cmd.Git()
        env = _git_env(self.ca_bundle)
        if SHA40.match(need.ref):
            self._git_verify_commit(need, need.ref)
            return GitPin(need.name, need.url, need.ref, need.ref)
        try:
            with runner.custom_environment(**env):
                output = runner.ls_remote(need.url, need.ref, f"refs/tags/{need.ref}^{{}}")
        except gitpython.GitCommandError as exc:
            untrusted = self._untrusted(need.url, exc)
            raise (untrusted or LockError(f"{need.name}: git ls-remote {need.url} failed: {_git_stderr(exc)}")) from None
        refs: dict[str, str] = {}
        for line in output.splitlines():
            sha, _, ref = line.partition("\t")
            refs[ref.strip()] = sha.strip()
        for candidate in (
            f"refs/tags/{need.ref}^{{}}",  # annotated tag: the commit it points at
            f"refs/tags/{need.ref}",
            f"refs/heads/{need.ref}",
            need.ref,
        ):
            if candidate in refs and SHA40.match(refs[candidate]):
                return GitPin(need.name, need.url, need.ref, refs[candidate])
        if SHORT_HEX.match(need.ref):
            commit = self._git_expand_short(need)
            return GitPin(need.name, need.url, need.ref, commit)
        raise LockError(f"{need.name}: {need.url} has no branch or tag named {need.ref!r}")

    def _git_fetch_all(self, need: GitNeed, workdir: str) -> Any:
        import git as gitpython  # here, not at the top: see the note below the imports

        repo = gitpython.Repo.init(workdir, bare=True)
        with repo.git.custom_environment(**_git_env(self.ca_bundle)):
            repo.git.fetch("--quiet", "--filter=blob:none", need.url, "+refs/heads/*:refs/heads/*", "+refs/tags/*:refs/tags/*")
        return repo

    def _git_verify_commit(self, need: GitNeed, commit: str) -> None:
        import git as gitpython  # here, not at the top: see the note below the imports

        with tempfile.TemporaryDirectory(prefix="rigup-lock-") as workdir:
            repo = gitpython.Repo.init(workdir, bare=True)
            try:
                with repo.git.custom_environment(**_git_env(self.ca_bundle)):
                    # Most servers (GitHub, git daemon with protocol v2) hand out a reachable commit by sha.
                    repo.git.fetch("--quiet", "--depth=1", need.url, commit)
                return
            except gitpython.GitCommandError as exc:
                untrusted = self._untrusted(need.url, exc)
                if untrusted is not None:
                    raise untrusted from None
            try:
                repo = self._git_fetch_all(need, workdir)
                repo.git.cat_file("-e", f"{commit}^{{commit}}")
            except gitpython.GitCommandError as exc:
                raise self._untrusted(need.url, exc) or LockError(
                    f"{need.name}: commit {commit} is not reachable from any branch or tag of {need.url} "
                    f"(force-pushed or deleted?): {_git_stderr(exc)}"
                ) from None

    def _git_expand_short(self, need: GitNeed) -> str:
        import git as gitpython  # here, not at the top: see the note below the imports

        with tempfile.TemporaryDirectory(prefix="rigup-lock-") as workdir:
            try:
                repo = self._git_fetch_all(need, workdir)
                commit = repo.git.rev_parse("--verify", "--quiet", f"{need.ref}^{{commit}}").strip()
            except gitpython.GitCommandError as exc:
                raise LockError(f"{need.name}: {need.ref!r} is not a unique commit of {need.url}: {_git_stderr(exc)}") from None
        if not SHA40.match(commit):
            raise LockError(f"{need.name}: {need.ref!r} did not resolve to a commit of {need.url}")
        return commit

    # -- Hugging Face ----------------------------------------------------------------------
    def model(self, need: ModelNeed) -> ModelPin:
        # here, not at the top: see the note below the imports
        from huggingface_hub import HfApi
        from huggingface_hub.errors import HfHubHTTPError

        if self.ca_bundle and not self._hf_factory_set:
            from huggingface_hub import set_client_factory

            set_client_factory(_hf_client_factory(self.ca_bundle))
            self._hf_factory_set = True
        api = HfApi(endpoint=need.endpoint, token=self.hf_token or False)
        try:
            info = api.model_info(need.repo_id, revision=need.revision, files_metadata=True)
        except Exception as exc:
            if not isinstance(exc, HfHubHTTPError):
                untrusted = self._untrusted(need.endpoint, exc)
                if untrusted is None:
                    raise
                raise untrusted from None
            status = getattr(getattr(exc, "response", None), "status_code", None)
            hint = ""
            if status in (401, 403) or (need.gated and status == 404):
                hint = " (gated or private: set HF_TOKEN or hf_token_file to a token that accepted the licence)"
            raise LockError(f"{need.name}: {need.endpoint} answered {status or exc}{hint}") from None
        commit = str(info.sha or "")
        if not SHA40.match(commit):
            raise LockError(f"{need.name}: {need.endpoint} gave no commit for revision {need.revision!r}")
        files: list[FilePin] = []
        for sibling in info.siblings or ():
            files.append(self._file_pin(need, commit, sibling))
        if not files:
            raise LockError(f"{need.name}: {need.repo_id}@{commit} has no files")
        self.log(f"{need.name}: {need.revision} -> {commit} ({len(files)} files)")
        return ModelPin(need.name, need.repo_id, need.revision, commit, tuple(sorted(files, key=lambda f: f.path)))

    def _file_pin(self, need: ModelNeed, commit: str, sibling: Any) -> FilePin:
        path = sibling.rfilename
        if not is_safe_relpath(path):
            raise LockError(f"{need.name}: the hub lists an unsafe file path {path!r}")
        lfs = sibling.lfs
        if lfs is not None:
            digest = lfs["sha256"] if isinstance(lfs, Mapping) else lfs.sha256
            size = lfs["size"] if isinstance(lfs, Mapping) else lfs.size
            if not SHA256_HEX.match(str(digest)):
                raise LockError(f"{need.name}: the hub's sha256 for {path} is malformed: {digest!r}")
            return FilePin(path, int(size), str(digest))
        if sibling.size is None or sibling.blob_id is None:
            raise LockError(f"{need.name}: the hub gave no size/blob id for {path}")
        if sibling.size > MAX_HASHED_DOWNLOAD:
            raise LockError(f"{need.name}: {path} is a {sibling.size}-byte non-LFS file; refusing to hash it here")
        # No published SHA-256: download it and hash it, checking the bytes against the git blob id.
        data = self._download(need, commit, path)
        blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        if len(data) != sibling.size or blob != sibling.blob_id:
            raise LockError(
                f"{need.name}: {path} downloaded from {need.endpoint} does not match the hub's git blob "
                f"{sibling.blob_id} ({len(data)} bytes, blob {blob})"
            )
        return FilePin(path, len(data), hashlib.sha256(data).hexdigest())

    def _download(self, need: ModelNeed, commit: str, path: str) -> bytes:
        from huggingface_hub.utils import build_hf_headers  # here, not at the top: see the note below the imports

        url = f"{need.endpoint}/{need.repo_id}/resolve/{commit}/{urllib.parse.quote(path)}"
        headers = build_hf_headers(token=self.hf_token or False)
        try:
            response = requests.get(url, headers=headers, timeout=60, verify=self.verify)
        except requests.RequestException as exc:
            raise self._untrusted(url, exc) or LockError(f"{need.name}: cannot download {path}: {exc}") from None
        if response.status_code in (401, 403):
            raise LockError(
                f"{need.name}: {url} answered HTTP {response.status_code} (gated or private: set HF_TOKEN "
                "or hf_token_file to a token that accepted the licence)"
            )
        if response.status_code != 200:
            raise LockError(f"{need.name}: {url} answered HTTP {response.status_code}")
        return response.content

    # -- images ----------------------------------------------------------------------------
    def image(self, need: ImageNeed, previous: ImagePin | None) -> ImagePin:
        """The image's pin. An image the catalog pins by digest (upstream's pin: its tag moves) is locked at
        that digest, never at what the tag points to now; with image_digests the registry must have it.
        Otherwise: the tag's digest from the registry with image_digests, else the previous pin's digest
        (tag only when there is none)."""
        pinned = catalog_image_digest(need.repository, need.tag)
        if pinned is not None:
            if self.image_digests:
                registry_has_digest(need.registry, need.repository, pinned, need.plain_http, self.ca_bundle)
                self.log(f"{need.name}: {pinned} (the catalog's pin; {need.registry} has it)")
            return ImagePin(need.name, need.repository, need.tag, pinned)
        if not self.image_digests:
            digest = previous.digest if previous is not None else None
            return ImagePin(need.name, need.repository, need.tag, digest)
        digest = registry_digest(need.registry, need.repository, need.tag, need.plain_http, self.ca_bundle)
        self.log(f"{need.name}: {digest}")
        return ImagePin(need.name, need.repository, need.tag, digest)


def catalog_image_digest(repository: str, tag: str) -> str | None:
    """The digest the catalog pins repository:tag at (an `images` entry with `digest`), or None."""
    pinned = {
        str(spec["digest"])
        for spec in load_catalog()["images"].values()
        if spec.get("digest") and spec["repository"] == repository and str(spec["tag"]) == tag
    }
    if len(pinned) > 1:
        raise LockError(f"image {repository}:{tag}: the catalog pins it at {', '.join(sorted(pinned))}; "
                        f"the lock holds one digest per image name")
    return pinned.pop() if pinned else None


def _git_stderr(exc: Any) -> str:
    text = str(getattr(exc, "stderr", "") or exc).strip()
    return " ".join(text.split())[:400]


MANIFEST_TYPES = ", ".join(
    (
        "application/vnd.oci.image.index.v1+json",
        "application/vnd.docker.distribution.manifest.list.v2+json",
        "application/vnd.oci.image.manifest.v1+json",
        "application/vnd.docker.distribution.manifest.v2+json",
    )
)


def _manifest_head(registry: str, repository: str, reference: str, plain_http: bool = False,
                   ca_bundle: str | None = None) -> tuple[str, Any]:
    """(registry host, response) of HEAD /v2/<repository>/manifests/<tag or digest> (anonymous token).
    Over plain HTTP for loopback and for a registry the fleet lists as insecure, as Docker pulls from it;
    else HTTPS checked against `ca_bundle` (None: requests' default)."""
    host = "registry-1.docker.io" if registry in ("docker.io", "index.docker.io") else registry
    if registry in ("docker.io", "index.docker.io") and "/" not in repository:
        repository = f"library/{repository}"
    local = host.split(":")[0] in ("localhost", "127.0.0.1", "[::1]")
    url = f"{'http' if local or plain_http else 'https'}://{host}/v2/{repository}/manifests/{reference}"
    headers = {"Accept": MANIFEST_TYPES}
    what = f"{repository}@{reference}" if reference.startswith("sha256:") else f"{repository}:{reference}"
    verify = ca_bundle or True
    try:
        response = requests.head(url, headers=headers, timeout=30, verify=verify)
        if response.status_code == 401:
            token = _registry_token(response.headers.get("WWW-Authenticate", ""), verify)
            if token:
                headers["Authorization"] = f"Bearer {token}"
                response = requests.head(url, headers=headers, timeout=30, verify=verify)
    except requests.RequestException as exc:
        problem = certificate_problem(exc)
        if problem is not None:
            raise LockError(f"image {what}: {untrusted_message(url.split('/v2/')[0], problem, ca_bundle)}") from None
        raise LockError(f"image {what}: cannot reach {host}: {exc}") from None
    return host, response


def registry_digest(registry: str, repository: str, tag: str, plain_http: bool = False, ca_bundle: str | None = None) -> str:
    """The digest a registry serves for repository:tag (Registry HTTP API v2, anonymous token)."""
    host, response = _manifest_head(registry, repository, tag, plain_http, ca_bundle)
    if response.status_code == 404:
        raise LockError(f"image {repository}:{tag}: not found on {host} (tag purged or renamed?)")
    if response.status_code != 200:
        raise LockError(f"image {repository}:{tag}: {host} answered HTTP {response.status_code}")
    digest = response.headers.get("Docker-Content-Digest", "")
    if not DIGEST.match(digest):
        raise LockError(f"image {repository}:{tag}: {host} gave no usable digest ({digest!r})")
    return digest


def registry_has_digest(registry: str, repository: str, digest: str, plain_http: bool = False,
                        ca_bundle: str | None = None) -> None:
    """Raise LockError unless the registry serves repository@digest (a manifest by its digest)."""
    host, response = _manifest_head(registry, repository, digest, plain_http, ca_bundle)
    if response.status_code == 404:
        raise LockError(f"image {repository}@{digest}: {host} does not have this digest (the catalog pins the "
                        f"image by it: was it deleted upstream, or does this registry mirror another image?)")
    if response.status_code != 200:
        raise LockError(f"image {repository}@{digest}: {host} answered HTTP {response.status_code}")
    served = response.headers.get("Docker-Content-Digest")
    if served and served != digest:
        raise LockError(f"image {repository}@{digest}: {host} answered with another manifest ({served})")


def _registry_token(challenge: str, verify: str | bool = True) -> str | None:
    if not challenge.lower().startswith("bearer "):
        return None
    params = dict(re.findall(r'(\w+)="([^"]*)"', challenge))
    realm = params.pop("realm", None)
    if realm is None:
        return None
    response = requests.get(realm, params=params, timeout=30, verify=verify)
    if response.status_code != 200:
        return None
    body = response.json()
    return body.get("token") or body.get("access_token")


@dataclass
class Change:
    name: str
    kind: str  # added | upgraded | fixed (stale) | kept (at the newest pin) | unused (kept) | pruned
    lines: list[str] = field(default_factory=list)


def fleet_lock_file(fleet: Any) -> str:
    """The fleet's lock_file knob (one value for the whole fleet)."""
    files = {str(knob(fleet.resolved_data(h.name), "lock_file")) for h in fleet.hosts}
    if len(files) > 1:
        raise LockError(f"hosts disagree on lock_file ({sorted(files)}); set it once for the fleet")
    return files.pop() if files else "rigs.lock.yaml"


def merged_needs(hosts_needs: Iterable[tuple[str, Iterable[Need]]]) -> dict[str, Need]:
    """Every host's needs (host name, its needs), by lock name; LockError when two hosts need different
    things under one name (the lock holds one pin per name). The fleet's are collected by its FleetPlan
    (rigup.desired.fleet_plan.FleetPlan.lock_needs)."""
    needs: dict[str, Need] = {}
    owners: dict[str, str] = {}
    for name, host_needs in hosts_needs:
        for need in host_needs:
            known = needs.get(need.name)
            if known is not None and _need_key(known) != _need_key(need):
                raise LockError(
                    f"hosts {owners[need.name]} and {name} need different things under {need.name} "
                    f"({_need_key(known)} vs {_need_key(need)}); the lock holds one pin per name"
                )
            needs.setdefault(need.name, need)
            owners.setdefault(need.name, name)
    return needs


def _need_key(need: Need) -> tuple[Any, ...]:
    if isinstance(need, GitNeed):
        return (need.url, need.ref)
    if isinstance(need, ModelNeed):
        return (need.repo_id, need.revision)
    return (need.repository, need.tag)


def _matches(name: str, wanted: Iterable[str]) -> bool:
    bare = name.split(":", 1)[1]
    return any(w in (name, bare) for w in wanted)


def update_lock(
    old: LockFile,
    needs: Mapping[str, Need],
    resolver: Resolver,
    upgrade: list[str] | None,
    prune: bool = False,
) -> tuple[LockFile, list[Change]]:
    """New lock for these needs: keep good pins, resolve missing/stale ones and those to upgrade.

    + upgrade: None = upgrade nothing; [] = upgrade everything; names = only those (with or
      without the "git:"/"model:"/"image:" prefix)
    + prune: drop the pins no need names any more (a Change "pruned" each); False keeps them
      as they are, unresolved (a Change "unused" each): a host may go back to its variant
    """
    if upgrade:
        unknown = [w for w in upgrade if not any(_matches(n, [w]) for n in needs)]
        if unknown:
            raise LockError(f"--upgrade: the fleet needs nothing named {', '.join(unknown)} (known: {', '.join(sorted(needs))})")
    new = LockFile(path=old.path)
    changes: list[Change] = []
    for name in sorted(needs):
        need = needs[name]
        current = old.entry(name)
        problem = need_problem(need, old) or _pinned_digest_problem(need, current)
        wanted = upgrade is not None and (not upgrade or _matches(name, upgrade))
        if current is not None and problem is None and not wanted:
            _store(new, current)
            continue
        if isinstance(need, GitNeed):
            pin: GitPin | ModelPin | ImagePin = resolver.git(need)
        elif isinstance(need, ModelNeed):
            pin = resolver.model(need)
        else:
            pin = resolver.image(need, old.images.get(name))
        _store(new, pin)
        if current is None:
            changes.append(Change(name, "added", _describe(pin)))
        elif problem is not None:
            changes.append(Change(name, "fixed", [f"was stale: {problem}", *_diff(current, pin)]))
        elif _diff(current, pin):
            changes.append(Change(name, "upgraded", _diff(current, pin)))
        else:
            changes.append(Change(name, "kept", ["already at the newest pin"]))
    for name in old.names():
        if name in needs:
            continue
        if prune:
            changes.append(Change(name, "pruned", ["no host's variant needs it any more"]))
        else:
            _store(new, old.entry(name))  # type: ignore[arg-type]
            changes.append(Change(name, "unused", ["no host's variant needs it; kept (--prune removes it)"]))
    return new, changes


def _pinned_digest_problem(need: Need, current: Any) -> str | None:
    """A locked image digest that is not the catalog's pin for that image (the recipe refuses it)."""
    if not isinstance(need, ImageNeed) or not isinstance(current, ImagePin):
        return None
    pinned = catalog_image_digest(need.repository, need.tag)
    if pinned is None or current.digest == pinned:
        return None
    return f"{need.name}: locked digest {current.digest or 'none (tag only)'}, but the catalog pins {pinned}"


def _store(lock: LockFile, pin: GitPin | ModelPin | ImagePin) -> None:
    if isinstance(pin, GitPin):
        lock.git[pin.name] = pin
    elif isinstance(pin, ModelPin):
        lock.models[pin.name] = pin
    else:
        lock.images[pin.name] = pin


def _describe(pin: GitPin | ModelPin | ImagePin) -> list[str]:
    if isinstance(pin, GitPin):
        return [f"{pin.ref} -> {pin.commit} ({pin.url})"]
    if isinstance(pin, ModelPin):
        return [f"{pin.revision} -> {pin.commit}: {len(pin.files)} files, {pin.total_size / 1e9:.2f} GB"]
    return [f"{pin.repository}:{pin.tag} digest {pin.digest or 'not pinned (tag only)'}"]


def _diff(old: GitPin | ModelPin | ImagePin, new: GitPin | ModelPin | ImagePin) -> list[str]:
    lines: list[str] = []
    if isinstance(old, GitPin) and isinstance(new, GitPin):
        for attr in ("url", "ref", "commit"):
            if getattr(old, attr) != getattr(new, attr):
                lines.append(f"{attr}: {getattr(old, attr)} -> {getattr(new, attr)}")
    elif isinstance(old, ModelPin) and isinstance(new, ModelPin):
        for attr in ("revision", "commit"):
            if getattr(old, attr) != getattr(new, attr):
                lines.append(f"{attr}: {getattr(old, attr)} -> {getattr(new, attr)}")
        before = {f.path: f for f in old.files}
        after = {f.path: f for f in new.files}
        for path in sorted(set(before) | set(after)):
            a, b = before.get(path), after.get(path)
            if a is None:
                lines.append(f"+ {path} ({b.size} bytes, sha256 {b.sha256[:16]}...)")  # type: ignore[union-attr]
            elif b is None:
                lines.append(f"- {path}")
            elif a != b:
                lines.append(f"~ {path}: sha256 {a.sha256[:16]}... -> {b.sha256[:16]}... ({a.size} -> {b.size} bytes)")
    elif isinstance(old, ImagePin) and isinstance(new, ImagePin):
        if old.digest != new.digest:
            lines.append(f"digest: {old.digest or 'none'} -> {new.digest or 'none'}")
    return lines

