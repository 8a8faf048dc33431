"""The test bed's Hugging Face endpoint, driven by the real huggingface_hub client and raw HTTP."""

from __future__ import annotations

import fnmatch
import hashlib
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from huggingface_hub import HfApi, hf_hub_download
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from rigup.desired.catalog import load_catalog
from rigup_testbed import hfhub
from rigup_testbed.gitremotes import git

REPO_ROOT = Path(__file__).resolve().parents[2]
QWEN = hfhub.SANDBOX_QWEN
SHARD1 = "model-00001-of-00002.safetensors"
SHARD2 = "model-00002-of-00002.safetensors"
TOKEN = "hf_rigup_testbed_token"
NESTED = "rigup-testbed/nested"
BIG_REPO = "rigup-testbed/big"
BIG_SIZE = 12_000_000


def _spec() -> dict[str, Any]:
    spec = hfhub.sandbox_spec(scale=0.01)  # shard 1: 1.2 MB, shard 2: 400 kB
    spec["repos"][NESTED] = {
        "commits": [
            {
                "message": "nested layout",
                "files": {
                    "config.json": {"json": {"a": 1}},
                    "sub/dir/weights.safetensors": {"size": 70_000, "seed": 9},
                    "sub/notes.txt": "plain text\n",
                    "sub/big.dat": {"size": 40_000, "seed": 10},  # over the test threshold: LFS by size
                    "sub/small.dat": {"size": 100, "seed": 11, "lfs": True},  # forced LFS
                },
            }
        ]
    }
    # huggingface_hub reads bodies in 10 MB pieces and resumes from the last whole piece: a resume test needs
    # a file past that size.
    spec["repos"][BIG_REPO] = {
        "commits": [
            {
                "message": "big file",
                "files": {"big.safetensors": {"size": BIG_SIZE, "seed": 12, "format": "safetensors"}},
            }
        ]
    }
    return spec


@pytest.fixture(scope="module")
def hub_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hfhub")


@pytest.fixture()
def hub(hub_root: Path) -> Iterator[hfhub.HfHub]:
    config = hfhub.HubConfig(lfs_threshold=32_768, tokens=(TOKEN,))
    server = hfhub.HfHub(hub_root, "127.0.0.1", 0, spec=_spec(), config=config)
    server.start()
    yield server
    server.stop()


@pytest.fixture()
def api(hub: hfhub.HfHub) -> HfApi:
    return HfApi(endpoint=hub.url, token=False)


def resolve_url(hub: hfhub.HfHub, path: str, rev: str = "main", repo: str = QWEN) -> str:
    return f"{hub.url}/{repo}/resolve/{rev}/{path}"


def published(api: HfApi, path: str, rev: str | None = None, repo: str = QWEN) -> Any:
    info = api.model_info(repo, revision=rev, files_metadata=True)
    return next(s for s in info.siblings if s.rfilename == path)


def sha256_file(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


# --------------------------------------------------------------------------------------------------
# Metadata
# --------------------------------------------------------------------------------------------------


def test_model_info_publishes_sha256_for_lfs_only(api: HfApi, hub: hfhub.HfHub) -> None:
    info = api.model_info(QWEN, files_metadata=True)
    assert info.id == QWEN
    assert info.sha is not None and len(info.sha) == 40
    assert info.gated is False and info.private is False
    siblings = {s.rfilename: s for s in info.siblings}
    assert set(siblings) == {
        ".gitattributes", "README.md", "config.json", "generation_config.json", "tokenizer.json",
        "tokenizer_config.json", "model.safetensors.index.json", SHARD1, SHARD2,
    }  # fmt: skip
    assert siblings[SHARD1].size == 1_200_000 and siblings[SHARD2].size == 400_000
    for name in (SHARD1, SHARD2):
        lfs = siblings[name].lfs
        body = requests.get(resolve_url(hub, name), timeout=10).content
        assert lfs is not None and lfs.sha256 == hashlib.sha256(body).hexdigest() and lfs.size == len(body)
        # Git stores the pointer; its blob id is what the Hub publishes as blobId.
        assert siblings[name].blob_id == hfhub.git_blob_sha1(hfhub.lfs_pointer(lfs.sha256, lfs.size))
    config = siblings["config.json"]
    assert config.lfs is None
    body = requests.get(resolve_url(hub, "config.json"), timeout=10).content
    assert config.blob_id == hfhub.git_blob_sha1(body)
    # without blobs=true the Hub lists names only
    assert api.model_info(QWEN).siblings[0].size is None


def test_shard_is_valid_safetensors_and_index_matches(hub: hfhub.HfHub) -> None:
    body = requests.get(resolve_url(hub, SHARD1), timeout=10).content
    n = int.from_bytes(body[:8], "little")
    header = json.loads(body[8 : 8 + n])
    (name,) = [k for k in header if k != "__metadata__"]
    start, end = header[name]["data_offsets"]
    assert 8 + n + end == len(body) and start == 0
    index = requests.get(resolve_url(hub, "model.safetensors.index.json"), timeout=10).json()
    assert index["weight_map"][name] == SHARD1
    assert index["metadata"]["total_size"] == 1_600_000


def test_list_repo_tree_recursive_and_paths_info(api: HfApi) -> None:
    entries = {e.path: e for e in api.list_repo_tree(NESTED, recursive=True)}
    assert set(entries) == {
        "config.json", "sub", "sub/dir", "sub/dir/weights.safetensors", "sub/notes.txt", "sub/big.dat", "sub/small.dat",
    }  # fmt: skip
    assert type(entries["sub"]).__name__ == "RepoFolder" and len(entries["sub"].tree_id) == 40
    assert entries["sub/dir/weights.safetensors"].lfs is not None  # by pattern
    assert entries["sub/big.dat"].lfs is not None and entries["sub/big.dat"].size == 40_000  # by size
    assert entries["sub/small.dat"].lfs is not None  # forced
    assert entries["sub/notes.txt"].lfs is None and entries["sub/notes.txt"].blob_id == hfhub.git_blob_sha1(b"plain text\n")
    top = {e.path for e in api.list_repo_tree(NESTED)}
    assert top == {"config.json", "sub"}
    under = {e.path for e in api.list_repo_tree(NESTED, path_in_repo="sub")}
    assert under == {"sub/dir", "sub/notes.txt", "sub/big.dat", "sub/small.dat"}
    expanded = next(e for e in api.list_repo_tree(NESTED, recursive=True, expand=True) if e.path == "config.json")
    assert expanded.last_commit is not None and expanded.last_commit.title == "nested layout"
    info = api.get_paths_info(NESTED, ["sub/big.dat", "sub", "missing.txt"])
    assert [p.path for p in info] == ["sub/big.dat", "sub"]
    assert info[0].lfs.sha256 == entries["sub/big.dat"].lfs.sha256


def test_commit_and_tree_ids_are_what_git_computes(api: HfApi, hub: hfhub.HfHub, tmp_path: Path) -> None:
    # Rebuild the nested repo with real git (LFS files as pointers) and compare ids.
    commit = api.model_info(NESTED).sha
    repo = tmp_path / "r"
    git("init", "--quiet", str(repo))
    for e in api.list_repo_tree(NESTED, recursive=True):
        if type(e).__name__ != "RepoFile":
            continue
        body = requests.get(resolve_url(hub, e.path, repo=NESTED), timeout=10).content
        stored = hfhub.lfs_pointer(e.lfs.sha256, e.lfs.size) if e.lfs is not None else body
        (repo / e.path).parent.mkdir(parents=True, exist_ok=True)
        (repo / e.path).write_bytes(stored)
    git("add", "-A", cwd=repo)
    stamp = "2026-04-20T00:00:00+00:00"
    ident: dict[str, str] = {}
    for role in ("AUTHOR", "COMMITTER"):
        ident |= {f"GIT_{role}_NAME": "rigup testbed", f"GIT_{role}_EMAIL": "testbed@rigup.invalid", f"GIT_{role}_DATE": stamp}
    git("commit", "--quiet", "-m", "nested layout", cwd=repo, env=ident)
    assert git("rev-parse", "HEAD", cwd=repo).strip() == commit
    sub = next(e for e in api.list_repo_tree(NESTED) if e.path == "sub")
    assert git("rev-parse", "HEAD:sub", cwd=repo).strip() == sub.tree_id


def test_refs_commits_and_revisions(api: HfApi, hub: hfhub.HfHub) -> None:
    commits = [c.commit_id for c in api.list_repo_commits(QWEN)]
    assert len(commits) == 2
    new, old = commits
    assert api.model_info(QWEN).sha == new
    assert [b.target_commit for b in api.list_repo_refs(QWEN).branches] == [new]
    old_files = {s.rfilename: s for s in api.model_info(QWEN, revision=old, files_metadata=True).siblings}
    new_files = {s.rfilename: s for s in api.model_info(QWEN, revision=new, files_metadata=True).siblings}
    changed = {name for name in new_files if new_files[name].blob_id != old_files[name].blob_id}
    assert changed == {SHARD2}  # the second commit changes one file
    assert api.model_info(QWEN, revision="refs/heads/main").sha == new
    # main can be moved back (e.g. to take a lock at the old commit) and forward again
    hub.admin().set_ref(QWEN, 0)
    assert api.model_info(QWEN).sha == old
    hub.admin().set_ref(QWEN, new)
    assert api.model_info(QWEN).sha == new


# --------------------------------------------------------------------------------------------------
# Downloads
# --------------------------------------------------------------------------------------------------


def test_hf_hub_download_matches_published_sha256(api: HfApi, hub: hfhub.HfHub, tmp_path: Path) -> None:
    for rev in (None, api.model_info(QWEN).sha):
        path = hf_hub_download(QWEN, SHARD1, revision=rev, cache_dir=tmp_path / str(rev), endpoint=hub.url, token=False)
        assert sha256_file(path) == published(api, SHARD1).lfs.sha256
    old = [c.commit_id for c in api.list_repo_commits(QWEN)][-1]
    path = hf_hub_download(QWEN, SHARD2, revision=old, cache_dir=tmp_path / "old", endpoint=hub.url, token=False)
    assert sha256_file(path) == published(api, SHARD2, old).lfs.sha256 != published(api, SHARD2).lfs.sha256


def test_resolve_headers(api: HfApi, hub: hfhub.HfHub) -> None:
    info = api.model_info(QWEN, files_metadata=True)
    shard = next(s for s in info.siblings if s.rfilename == SHARD1)
    r = requests.head(resolve_url(hub, SHARD1), timeout=10, allow_redirects=False)
    assert r.status_code == 200
    assert r.headers["X-Repo-Commit"] == info.sha
    assert r.headers["ETag"] == f'"{shard.lfs.sha256}"'
    assert r.headers["X-Linked-Etag"] == f'"{shard.lfs.sha256}"'
    assert r.headers["X-Linked-Size"] == r.headers["Content-Length"] == "1200000"
    assert r.headers["Accept-Ranges"] == "bytes"
    small = requests.head(resolve_url(hub, "config.json"), timeout=10)
    config = next(s for s in info.siblings if s.rfilename == "config.json")
    assert small.headers["ETag"] == f'"{config.blob_id}"' and "X-Linked-Etag" not in small.headers


def test_range_requests_and_resume(api: HfApi, hub: hfhub.HfHub) -> None:
    url = resolve_url(hub, SHARD2)
    full = requests.get(url, timeout=10).content
    r = requests.get(url, headers={"Range": "bytes=100-199"}, timeout=10)
    assert r.status_code == 206 and r.headers["Content-Range"] == "bytes 100-199/400000" and r.content == full[100:200]
    assert requests.get(url, headers={"Range": "bytes=-10"}, timeout=10).content == full[-10:]
    bad = requests.get(url, headers={"Range": "bytes=400000-"}, timeout=10)
    assert bad.status_code == 416 and bad.headers["Content-Range"] == "bytes */400000"
    # resume: first part, then the rest from where it stopped
    first = requests.get(url, headers={"Range": "bytes=0-123456"}, timeout=10).content
    rest = requests.get(url, headers={"Range": f"bytes={len(first)}-"}, timeout=10)
    assert rest.status_code == 206
    assert hashlib.sha256(first + rest.content).hexdigest() == published(api, SHARD2).lfs.sha256


def test_not_found_errors(api: HfApi, hub: hfhub.HfHub, tmp_path: Path) -> None:
    with pytest.raises(RemoteEntryNotFoundError):
        hf_hub_download(QWEN, "nope.bin", cache_dir=tmp_path, endpoint=hub.url, token=False)
    with pytest.raises(RevisionNotFoundError):
        api.model_info(QWEN, revision="no-such-branch")
    with pytest.raises(RevisionNotFoundError):
        hf_hub_download(QWEN, "config.json", revision="0" * 40, cache_dir=tmp_path, endpoint=hub.url, token=False)
    with pytest.raises(RepositoryNotFoundError):
        api.model_info("nobody/nothing")
    r = requests.get(resolve_url(hub, "nope.bin"), timeout=10)
    assert r.status_code == 404 and r.headers["X-Error-Code"] == "EntryNotFound"
    assert r.headers["X-Repo-Commit"] == api.model_info(QWEN).sha and "error" in r.json()
    assert requests.get(resolve_url(hub, "x", repo="nobody/nothing"), timeout=10).headers["X-Error-Code"] == "RepoNotFound"


def test_gated_repo_needs_token(api: HfApi, hub: hfhub.HfHub, tmp_path: Path) -> None:
    gated = hfhub.SANDBOX_GATED
    assert api.model_info(gated).gated == "auto"  # metadata stays public, like the Hub
    with pytest.raises(GatedRepoError):
        hf_hub_download(gated, "model.safetensors", cache_dir=tmp_path, endpoint=hub.url, token=False)
    r = requests.get(resolve_url(hub, "model.safetensors", repo=gated), timeout=10)
    assert r.status_code == 401 and r.headers["X-Error-Code"] == "GatedRepo"
    with pytest.raises(HfHubHTTPError) as wrong:
        hf_hub_download(gated, "model.safetensors", cache_dir=tmp_path, endpoint=hub.url, token="hf_wrong")
    assert wrong.value.response.status_code == 401
    path = hf_hub_download(gated, "model.safetensors", cache_dir=tmp_path, endpoint=hub.url, token=TOKEN)
    assert sha256_file(path) == published(api, "model.safetensors", repo=gated).lfs.sha256
    # any repo can be gated at runtime
    hub.admin().set_repo(QWEN, gated=True)
    assert requests.head(resolve_url(hub, "config.json"), timeout=10).status_code == 401
    hub.admin().set_repo(QWEN, gated=False)
    assert requests.head(resolve_url(hub, "config.json"), timeout=10).status_code == 200


def test_concurrent_downloads(api: HfApi, hub: hfhub.HfHub) -> None:
    want = published(api, SHARD1).lfs.sha256
    results: list[str] = []
    errors: list[BaseException] = []

    def fetch() -> None:
        try:
            with requests.get(resolve_url(hub, SHARD1), stream=True, timeout=30) as r:
                h = hashlib.sha256()
                for chunk in r.iter_content(65536):
                    h.update(chunk)
                results.append(h.hexdigest())
        except BaseException as exc:  # noqa: BLE001 - reported by the assert below
            errors.append(exc)

    hub.admin().reset_stats()
    threads = [threading.Thread(target=fetch) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and results == [want] * 8
    stats = hub.admin().stats()
    assert stats["total_bytes"] == 8 * 1_200_000
    assert stats["files"][f"{QWEN}/{SHARD1}"]["complete"] == 8


# --------------------------------------------------------------------------------------------------
# Faults and stats
# --------------------------------------------------------------------------------------------------


def _received(url: str, headers: dict[str, str] | None = None) -> tuple[bytes, bool]:
    """Body bytes received and whether the transfer completed."""
    got = bytearray()
    try:
        with requests.get(url, headers=headers or {}, stream=True, timeout=10) as r:
            for chunk in r.raw.stream(65536, decode_content=False):
                got += chunk
        return bytes(got), True
    except requests.RequestException:
        return bytes(got), False
    except Exception as exc:  # urllib3 ProtocolError surfaces unwrapped from raw.stream
        if "IncompleteRead" in repr(exc) or "Connection broken" in repr(exc):
            return bytes(got), False
        raise


def test_fault_cut_once_then_every_time(hub: hfhub.HfHub) -> None:
    admin = hub.admin()
    url = resolve_url(hub, SHARD2)
    admin.set_faults({"kind": "cut", "repo": QWEN, "file": SHARD2, "after_bytes": 100_000, "times": 1})
    body, complete = _received(url)
    assert not complete and len(body) == 100_000
    body, complete = _received(url)
    assert complete and len(body) == 400_000
    admin.set_faults({"kind": "cut", "file": "model-*", "after_bytes": 50_000, "times": None})
    for _ in range(2):
        body, complete = _received(url)
        assert not complete and len(body) == 50_000
    # a range shorter than the cut point goes through
    body, complete = _received(url, {"Range": "bytes=0-999"})
    assert complete and len(body) == 1000
    assert [f["fired"] for f in admin.faults()] == [2]
    assert admin.stats()["files"][f"{QWEN}/{SHARD2}"]["cut"] == 3


def test_fault_cut_is_resumed_by_hf_hub_download(api: HfApi, hub: hfhub.HfHub, tmp_path: Path) -> None:
    hub.admin().set_faults({"kind": "cut", "repo": BIG_REPO, "after_bytes": 11_000_000, "times": 1})
    hub.admin().reset_stats()
    path = hf_hub_download(BIG_REPO, "big.safetensors", cache_dir=tmp_path, endpoint=hub.url, token=False)
    assert sha256_file(path) == published(api, "big.safetensors", repo=BIG_REPO).lfs.sha256
    st = hub.admin().stats()["files"][f"{BIG_REPO}/big.safetensors"]
    # first GET cut at 11 MB (the client kept its first 10 MB piece), second GET resumed with Range
    assert st["cut"] == 1 and st["get"] == 2 and st["range_get"] == 1
    assert st["bytes"] == 11_000_000 + (BIG_SIZE - 10 * 1024 * 1024)


def test_fault_corrupt(api: HfApi, hub: hfhub.HfHub, tmp_path: Path) -> None:
    want = published(api, SHARD2).lfs.sha256
    hub.admin().set_faults({"kind": "corrupt", "file": SHARD2, "times": 1})
    path = hf_hub_download(QWEN, SHARD2, cache_dir=tmp_path, endpoint=hub.url, token=False)
    assert Path(path).stat().st_size == 400_000 and sha256_file(path) != want
    path = hf_hub_download(QWEN, SHARD2, cache_dir=tmp_path, endpoint=hub.url, token=False, force_download=True)
    assert sha256_file(path) == want  # fired once only
    # one flipped byte at a chosen offset
    good = requests.get(resolve_url(hub, SHARD2), timeout=10).content
    hub.admin().set_faults({"kind": "corrupt", "file": SHARD2, "offset": 12345, "length": 1, "times": None})
    bad = requests.get(resolve_url(hub, SHARD2), timeout=10).content
    assert [i for i in range(len(good)) if good[i] != bad[i]] == [12345]
    assert requests.get(resolve_url(hub, SHARD2), headers={"Range": "bytes=0-999"}, timeout=10).content == good[:1000]
    assert hub.admin().stats()["files"][f"{QWEN}/{SHARD2}"]["corrupted"] == 2


def test_fault_slow(hub: hfhub.HfHub) -> None:
    url = resolve_url(hub, SHARD2)
    headers = {"Range": "bytes=0-99999"}
    t0 = time.monotonic()
    requests.get(url, headers=headers, timeout=10)
    fast = time.monotonic() - t0
    hub.admin().set_faults({"kind": "slow", "bytes_per_s": 400_000, "times": None})
    t0 = time.monotonic()
    r = requests.get(url, headers=headers, timeout=10)
    slow = time.monotonic() - t0
    assert len(r.content) == 100_000
    assert slow >= 0.24 and fast < 0.1  # 100 kB at 400 kB/s ~ 0.25 s
    assert hub.admin().stats()["files"][f"{QWEN}/{SHARD2}"]["throttled"] == 1


def test_fault_error_n_times(api: HfApi, hub: hfhub.HfHub) -> None:
    url = resolve_url(hub, "config.json")
    hub.admin().set_faults({"kind": "error", "status": 503, "file": "config.json", "times": 2})
    assert [requests.get(url, timeout=10).status_code for _ in range(3)] == [503, 503, 200]
    # a fault without a file glob hits the API too
    hub.admin().set_faults({"kind": "error", "status": 500, "repo": QWEN, "times": 1})
    with pytest.raises(HfHubHTTPError) as err:
        api.model_info(QWEN)
    assert err.value.response.status_code == 500
    assert api.model_info(QWEN).id == QWEN
    # client filter: faults can target one rig's address only
    hub.admin().set_faults({"kind": "error", "client": "10.0.0.*", "times": None})
    assert requests.get(url, timeout=10).status_code == 200


def test_stats_count_and_reset(hub: hfhub.HfHub) -> None:
    admin = hub.admin()
    admin.reset_stats()
    requests.head(resolve_url(hub, SHARD2), timeout=10)
    requests.get(resolve_url(hub, SHARD2), timeout=10)
    requests.get(resolve_url(hub, SHARD2), headers={"Range": "bytes=0-9"}, timeout=10)
    requests.get(resolve_url(hub, "config.json"), timeout=10)
    config_len = len(requests.get(resolve_url(hub, "config.json"), timeout=10).content)
    # the server adds a body's bytes once its handler has written them, which can be just after the
    # client has read them: wait (briefly) for the counts to settle
    deadline = time.monotonic() + 10
    st = admin.stats()
    while st["total_bytes"] < 400_010 + 2 * config_len and time.monotonic() < deadline:
        time.sleep(0.05)
        st = admin.stats()
    shard = st["files"][f"{QWEN}/{SHARD2}"]
    assert (shard["head"], shard["get"], shard["range_get"], shard["complete"], shard["bytes"]) == (1, 2, 1, 1, 400_010)
    assert st["total_bytes"] == 400_010 + 2 * config_len  # config.json was fetched twice
    assert st["requests"][f"GET /{QWEN}/resolve/main/{SHARD2}"] == 2
    assert st["clients"]["127.0.0.1"]["bytes"] == st["total_bytes"]
    admin.reset_stats()
    assert admin.stats()["total_bytes"] == 0 and admin.stats()["files"] == {}


def test_bad_admin_input_is_rejected(hub: hfhub.HfHub) -> None:
    with pytest.raises(RuntimeError, match="HTTP 400"):
        hub.admin().set_faults({"kind": "explode"})
    with pytest.raises(RuntimeError, match="HTTP 400"):
        hub.admin().set_faults({"kind": "cut", "afterbytes": 3})
    with pytest.raises(RuntimeError, match="HTTP 400"):
        hub.admin().set_ref(QWEN, "f" * 40)


def test_lfs_redirect_mode_like_the_real_hub(api: HfApi, hub: hfhub.HfHub, tmp_path: Path) -> None:
    # The hub's CDN listener is another origin (another port), so the client does not follow the HEAD redirect.
    hub.admin().configure(redirect_lfs=True)
    assert hub.cdn_url is not None and hub.cdn_url != hub.url
    want = published(api, SHARD1).lfs.sha256
    r = requests.head(resolve_url(hub, SHARD1), timeout=10, allow_redirects=False)
    assert r.status_code == 302 and r.headers["Location"].startswith(f"{hub.cdn_url}/_lfs/{want}")
    assert r.headers["X-Linked-Etag"] == f'"{want}"' and r.headers["X-Linked-Size"] == "1200000"
    followed = requests.head(resolve_url(hub, SHARD1), timeout=10, allow_redirects=True)
    assert followed.status_code == 200 and "X-Linked-Etag" not in followed.headers  # club-3090#857's trap
    hub.admin().reset_stats()
    path = hf_hub_download(QWEN, SHARD1, cache_dir=tmp_path, endpoint=hub.url, token=TOKEN)
    assert sha256_file(path) == want
    stats = hub.admin().stats()
    # the bytes crossed once (from the CDN), the 302 is counted apart, and the token stayed on the hub
    assert stats["total_bytes"] == stats["files"][f"{QWEN}/{SHARD1}"]["bytes"] == 1_200_000
    assert stats["files"][f"{QWEN}/{SHARD1}"]["redirected"] >= 1 and stats["cdn_authorized_requests"] == 0
    # each origin serves its own paths only
    assert requests.get(f"{hub.url}/_lfs/{want}", timeout=10).status_code == 404
    assert requests.get(f"{hub.cdn_url}/api/models/{QWEN}", timeout=10).status_code == 404
    assert requests.get(f"{hub.cdn_url}/_admin/stats", timeout=10).status_code == 404
    # small files are still served directly
    assert requests.head(resolve_url(hub, "config.json"), timeout=10, allow_redirects=False).status_code == 200
    # cdn_url names another CDN
    hub.admin().configure(cdn_url="http://cdn.invalid:8000")
    r = requests.head(resolve_url(hub, SHARD1), timeout=10, allow_redirects=False)
    assert r.status_code == 302 and r.headers["Location"].startswith(f"http://cdn.invalid:8000/_lfs/{want}")


# --------------------------------------------------------------------------------------------------
# Content, sizes and the standalone process
# --------------------------------------------------------------------------------------------------


def test_generated_content_is_deterministic_and_random_access() -> None:
    a = hfhub.GeneratedContent(3 * hfhub.BLOCK + 17, seed=5, fmt="safetensors", tensor="t")
    b = hfhub.GeneratedContent(3 * hfhub.BLOCK + 17, seed=5, fmt="safetensors", tensor="t")
    whole = a.read(0, a.size)
    assert len(whole) == a.size and whole == b.read(0, b.size)
    for start, n in ((0, 10), (hfhub.BLOCK - 3, 9), (2 * hfhub.BLOCK + 100, hfhub.BLOCK), (a.size - 5, 50)):
        assert a.read(start, n) == whole[start : start + n]
    other = hfhub.GeneratedContent(a.size, seed=6, fmt="safetensors", tensor="t").read(0, a.size)
    assert hashlib.sha256(other).digest() != hashlib.sha256(whole).digest()
    blocks = {whole[i : i + 4096] for i in range(1024, a.size - 4096, hfhub.BLOCK)}
    assert len(blocks) == 3  # blocks differ from each other


def test_sandbox_default_sizes_and_hash_cache(tmp_path: Path) -> None:
    spec = hfhub.sandbox_spec()
    qwen = spec["repos"][QWEN]["commits"][0]["files"]
    assert qwen[SHARD1]["size"] == 120_000_000 and qwen[SHARD2]["size"] == 40_000_000
    assert spec["repos"][hfhub.SANDBOX_QWEN_DFLASH]["commits"][0]["files"]["model.safetensors"]["size"] == 30_000_000
    assert set(spec["repos"]) == {
        QWEN, hfhub.SANDBOX_QWEN_DFLASH, hfhub.SANDBOX_GEMMA, hfhub.SANDBOX_GEMMA_ASSISTANT, hfhub.SANDBOX_GEMMA_DFLASH,
        hfhub.SANDBOX_CARNICE, hfhub.SANDBOX_GATED, *hfhub.catalog_standins(),
    }  # fmt: skip
    small = hfhub.sandbox_spec(scale=0.001)
    cache = hfhub.HashCache(tmp_path / "cache.json")
    repos = hfhub.build_repos(small, hfhub.HubConfig(), cache)
    assert (tmp_path / "cache.json").exists()
    again = hfhub.build_repos(small, hfhub.HubConfig(), hfhub.HashCache(tmp_path / "cache.json"))
    def shas(built: dict[str, hfhub.HubRepo]) -> dict[str, list[str]]:
        return {r: [c.sha for c in v.commits] for r, v in built.items()}

    assert shas(repos) == shas(again)


def test_sandbox_covers_every_catalog_model(tmp_path: Path) -> None:
    catalog = load_catalog()
    repos = hfhub.build_repos(hfhub.sandbox_spec(scale=0.001), hfhub.HubConfig(), hfhub.HashCache(None))
    assert catalog["models"], "catalog has no models"
    for name, model in catalog["models"].items():
        repo = repos.get(model["repo_id"])
        assert repo is not None, f"catalog model {name}: {model['repo_id']} missing from the sandbox"
        assert repo.gated == bool(model.get("gated")), f"{model['repo_id']}: gating differs from the catalog"
        files = repo.commits[-1].files
        verified = [f for p, f in files.items() if fnmatch.fnmatch(p, model.get("verify_glob", "*.safetensors"))]
        assert verified and all(f.lfs for f in verified), f"{model['repo_id']}: no LFS file matches verify_glob"
        assert "config.json" in files


def test_subprocess_mode(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    ready = tmp_path / "ready.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "rigup_testbed.hfhub", "--root", str(tmp_path / "root"), "--bind", "127.0.0.1", "--port", "0",
         "--scale", "0.001", "--token-file", str(token_file), "--redirect-lfs", "--cdn-port", "0",
         "--ready-file", str(ready)],  # fmt: skip
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        info = json.loads(ready.read_text())
        assert info["url"] == url and info["pid"] == proc.pid
        assert info["repos"][QWEN]["branches"]["main"] == info["repos"][QWEN]["commits"][-1]
        gated = f"{url}/{hfhub.SANDBOX_GATED}/resolve/main/model.safetensors"
        assert info["cdn_url"].startswith("http://127.0.0.1:") and info["cdn_url"] != url
        assert requests.head(gated, timeout=10).status_code == 401
        r = requests.head(gated, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
        assert r.status_code == 302 and r.headers["Location"].startswith(f"{info['cdn_url']}/_lfs/")
        assert requests.get(r.headers["Location"], timeout=10).status_code == 200  # the CDN's URL needs no token
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        assert not ready.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
