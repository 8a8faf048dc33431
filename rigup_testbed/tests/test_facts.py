"""What the test bed imitates, checked against cited real facts (rigup_testbed/FACTS.md has the table).

Each test names its source in a comment: a documentation page or a repository at a commit. Nothing here
boots a host: the apt tree is the one rigup_testbed/aptrepo.py builds (cached, as test_aptrepo.py uses it),
the git remotes are built in a temporary directory, and the HTTP services run in-process on loopback.

Facts that upstream has and the bed deliberately does not (Debian 12 playing Ubuntu, a Genesis main that
shares dev's root, ...) are written down in FACTS.md; where a test pins such a deviation, its name says so,
so that changing the bed also means changing FACTS.md.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import types
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rigup_testbed import aptrepo, gitremotes, hfhub, hubserve, pypi, registry
from rigup_testbed.gitremotes import Remotes, git, make_remotes
from rigup_testbed.hubserve import StaticHandler
from rigup_testbed.service import BackgroundServer
from rigup_testbed.standin_modules import load_standin

APT_TOOLS = all(shutil.which(t) for t in ("apt-ftparchive", "dpkg-deb", "gpg"))


# --------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------


def deb822(text: str) -> list[dict[str, str]]:
    """Stanzas of a Release or Packages file (continuation lines folded into the field)."""
    stanzas: list[dict[str, str]] = []
    current: dict[str, str] = {}
    key = ""
    for line in text.splitlines():
        if not line.strip():
            if current:
                stanzas.append(current)
            current, key = {}, ""
        elif line[0] in " \t" and key:
            current[key] += "\n" + line.strip()
        else:
            key, _, value = line.partition(":")
            current[key] = value.strip()
    if current:
        stanzas.append(current)
    return stanzas


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


def http(url: str, method: str = "GET") -> tuple[int, Any, bytes]:
    """(status, headers, body) without following redirects."""
    opener = urllib.request.build_opener(_NoRedirect)
    try:
        with opener.open(urllib.request.Request(url, method=method), timeout=10) as resp:
            return resp.status, resp.headers, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.headers, err.read()


# --------------------------------------------------------------------------------------------------
# Apt repositories (rigup_testbed/aptrepo.py)
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def repo() -> aptrepo.RepoInfo:
    if not APT_TOOLS:
        pytest.skip("needs apt-ftparchive, dpkg-deb and gpg")
    from rigup_testbed.image import cache_dir

    return aptrepo.build_repos(cache_dir() / "aptrepo")  # the same cached tree test_aptrepo.py checks


# Source: docker/docs@00ba4d322d759865bef479ee75c1ec98c8d65a86:content/manuals/engine/install/ubuntu.md
#   download-url-base https://download.docker.com/linux/ubuntu; key at <base>/gpg; "Suites: <codename>",
#   "Components: stable"; "Go to <base>/dists/, select your Ubuntu version, go to pool/stable/ and select
#   the architecture"; versions "5:<v>-1~ubuntu.24.04~noble". Real file names, e.g.
#   download.docker.com/linux/ubuntu/dists/noble/pool/stable/amd64/containerd.io_1.7.28-1~ubuntu.24.04~noble_amd64.deb
#   and docker-compose-plugin_2.40.3-1~ubuntu.24.04~noble_amd64.deb (public install scripts in the code index).
DOCKER_UBUNTU_SUITES = {"jammy": "ubuntu.22.04~jammy", "noble": "ubuntu.24.04~noble"}


@pytest.mark.parametrize("codename", sorted(DOCKER_UBUNTU_SUITES))
@pytest.mark.parametrize("path", ["docker/linux/ubuntu", "docker-engine/linux/ubuntu"])
def test_docker_repository_has_docker_s_suite_component_and_pool_layout(repo: aptrepo.RepoInfo, path: str,
                                                                         codename: str) -> None:
    root = repo.root / path
    assert (root / "gpg").read_text().startswith("-----BEGIN PGP PUBLIC KEY BLOCK-----")
    dist = root / "dists" / codename
    release = deb822((dist / "Release").read_text())[0]
    assert release["Suite"] == codename
    assert "stable" in release["Components"].split()
    assert "amd64" in release["Architectures"].split()
    # Origin/Label as apt-cache policy shows them for download.docker.com ("o=Docker,l=Docker CE"; see FACTS.md)
    assert (release["Origin"], release["Label"]) == ("Docker", "Docker CE")
    assert {"InRelease", "Release.gpg"} <= {p.name for p in dist.iterdir()}
    packages = deb822((dist / "stable/binary-amd64/Packages").read_text())
    assert {p["Package"] for p in packages} >= {"docker-ce", "docker-ce-cli", "containerd.io", "docker-compose-plugin"}
    suffix = DOCKER_UBUNTU_SUITES[codename]
    for p in packages:
        name, version = p["Package"], p["Version"]
        assert version.endswith(f"-1~{suffix}"), (name, version)
        if name in ("docker-ce", "docker-ce-cli"):
            assert version.startswith("5:"), version  # Docker's epoch
        # the pool under dists/<codename>/pool/stable/<arch>/, the file named <name>_<version without epoch>_<arch>.deb
        assert p["Filename"] == f"dists/{codename}/pool/stable/amd64/{name}_{version.split(':', 1)[-1]}_amd64.deb"
        assert (root / p["Filename"]).is_file()


def test_docker_versions_are_ones_docker_published(repo: aptrepo.RepoInfo) -> None:
    # Source: public install scripts pinning docker-ce=5:28.5.1-1~ubuntu.22.04~jammy / 5:28.5.2-1~ubuntu.24.04~noble,
    # containerd.io_1.7.28-1~ubuntu.24.04~noble and docker-compose-plugin_2.40.3-1~ubuntu.24.04~noble
    # (downloaded from download.docker.com/linux/ubuntu/dists/noble/pool/stable/amd64/); FACTS.md lists them.
    assert repo.versions("docker", "noble", "docker-ce") == ["5:28.5.1-1~ubuntu.24.04~noble", "5:28.5.2-1~ubuntu.24.04~noble"]
    assert repo.versions("docker", "jammy", "docker-ce") == ["5:28.5.1-1~ubuntu.22.04~jammy", "5:28.5.2-1~ubuntu.22.04~jammy"]
    assert repo.versions("docker", "noble", "containerd.io") == ["1.7.28-1~ubuntu.24.04~noble"]
    assert repo.versions("docker", "noble", "docker-compose-plugin") == ["2.40.3-1~ubuntu.24.04~noble"]


def test_deviation_bookworm_is_served_under_linux_ubuntu_with_docker_s_debian_versions(repo: aptrepo.RepoInfo) -> None:
    # Source: docker/docs@0048b0aa9e93249c97e900f9e08fc6c37c4607a0:content/manuals/engine/install/debian.md
    #   Docker serves Debian at https://download.docker.com/linux/debian with versions 5:<v>-1~debian.12~bookworm;
    #   ubuntu.md lists only Ubuntu releases for linux/ubuntu. The bed's rigs are Debian 12 playing Ubuntu hosts,
    #   so it serves a bookworm suite under linux/ubuntu (FACTS.md, "Debian 12 playing Ubuntu"): the version
    #   strings are Docker's Debian ones, the path is not.
    assert repo.versions("docker", "bookworm", "docker-ce") == ["5:28.5.1-1~debian.12~bookworm",
                                                                "5:28.5.2-1~debian.12~bookworm"]
    assert (repo.root / "docker/linux/ubuntu/dists/bookworm/Release").is_file()
    assert not (repo.root / "docker/linux/debian").exists()


def test_container_toolkit_repository_is_flat_per_architecture(repo: aptrepo.RepoInfo) -> None:
    # Source: NVIDIA/cloud-native-docs@01f0197c90e918c65883c6c2cb5d9cc3653ebde7:container-toolkit/install-guide.md
    #   key https://nvidia.github.io/libnvidia-container/gpgkey; the list file's line is
    #   "deb https://nvidia.github.io/libnvidia-container/stable/deb/$(ARCH) /" (flat: suite "/", no dists/);
    #   packages nvidia-container-toolkit, -base, libnvidia-container-tools, libnvidia-container1 at "${version}-1".
    assert repo.nvidia_ctk_apt_url == "libnvidia-container/stable/deb"
    assert repo.nvidia_ctk_apt_key_url == "libnvidia-container/gpgkey"
    flat = repo.root / repo.nvidia_ctk_apt_url / "amd64"  # $(ARCH) expanded as apt does on amd64
    assert {"InRelease", "Release", "Release.gpg", "Packages", "Packages.gz"} <= {p.name for p in flat.iterdir()}
    assert not (flat / "dists").exists()
    packages = deb822((flat / "Packages").read_text())
    names = {p["Package"] for p in packages}
    assert names == {"nvidia-container-toolkit", "nvidia-container-toolkit-base", "libnvidia-container-tools",
                     "libnvidia-container1"}
    for p in packages:
        assert re.fullmatch(r"\d+\.\d+\.\d+-1", p["Version"]), p
        assert p["Filename"].startswith("./") and (flat / p["Filename"]).is_file()
    # v1.17.8 (NVIDIA/nvidia-container-toolkit@007faf84913b940afc876e1843391429e2979575:CHANGELOG.md) and 1.18.0
    assert sorted(repo.versions("nvidia_ctk", "flat", "nvidia-container-toolkit")) == ["1.17.8-1", "1.18.0-1"]


def test_cuda_repository_is_flat_under_distro_and_nvidia_s_arch_name(repo: aptrepo.RepoInfo) -> None:
    # Source: docs.nvidia.com/cuda/cuda-installation-guide-linux/ (network repo:
    #   https://developer.download.nvidia.com/compute/cuda/repos/$distro/$arch/, e.g. ubuntu2404/x86_64, flat
    #   "deb <url> /"), the key 3bf863cc.pub in that directory; driver packages cuda-drivers-580_580.95.05-0ubuntu1
    #   and nvidia-driver-580 580.95.05-0ubuntu1 from the "cuda" origin (public apt listings, FACTS.md).
    for codename, distro in (("jammy", "ubuntu2204"), ("noble", "ubuntu2404")):
        assert repo.cuda_distros[codename] == distro
        flat = repo.root / repo.nvidia_cuda_repo_url / distro / "x86_64"
        assert (flat / "3bf863cc.pub").read_text().startswith("-----BEGIN PGP PUBLIC KEY BLOCK-----")
        assert {"InRelease", "Release.gpg", "Packages"} <= {p.name for p in flat.iterdir()}
        versions = {p["Package"]: p["Version"] for p in deb822((flat / "Packages").read_text())}
        assert versions["cuda-drivers-580"] == versions["nvidia-driver-580"] == "580.95.05-0ubuntu1"
        assert versions["nvidia-open"] == "580.95.05-0ubuntu1"
    assert repo.nvidia_cuda_repo_key_url == "compute/cuda/repos/{distro}/x86_64/3bf863cc.pub"


def test_ubuntu_archive_pool_follows_the_archive_s_source_layout(repo: aptrepo.RepoInfo) -> None:
    # Source: the Debian/Ubuntu archive layout pool/<component>/<first letter>/<source>/ (e.g.
    #   archive.ubuntu.com/ubuntu/pool/restricted/n/nvidia-graphics-drivers-580/), drivers in "restricted".
    #   The version revision and the pocket differ from the real archive (FACTS.md): Ubuntu 24.04 ships
    #   580.95.05-0ubuntu0.24.04.2 in noble-updates; the bed serves 580.95.05-0ubuntu1 in noble.
    restricted = deb822((repo.root / "ubuntu-archive/dists/noble/restricted/binary-amd64/Packages").read_text())
    for p in restricted:
        assert p["Filename"] == f"pool/restricted/n/{p['Source']}/{p['Package']}_{p['Version']}_amd64.deb"
    assert {"nvidia-driver-580-open", "nvidia-dkms-580-open", "nvidia-utils-580", "nvidia-kernel-common-580"} <= {
        p["Package"] for p in restricted}


# --------------------------------------------------------------------------------------------------
# Git remotes (rigup_testbed/gitremotes.py)
# --------------------------------------------------------------------------------------------------

# Upstream refs, read from GitHub snapshots (git for-each-ref; the snapshot's HEAD symbolic ref):
#   noonghunna/club-3090: HEAD -> refs/heads/master (4a29ab57d42a1d587de1042fa5dfd9535f94a063), no refs/heads/main
#   noonghunna/qwen36-dual-3090: HEAD -> refs/heads/master (bbb84da00ecb5186947e964e2a55f9f9aa9a7e12), its only branch
#   Sandermage/genesis-vllm-patches: HEAD -> refs/heads/main (dfffdad749e0b90c2388903c018c2a3a84099da2); branches
#     dev (f9576df6da55ad2b7ddb38b2f2d5da0a69072b7c), main, main-sync; tags below
UPSTREAM_DEFAULT_BRANCH = {
    gitremotes.CLUB_REPO: "master",
    gitremotes.QWEN_DUAL_REPO: "master",
    gitremotes.GENESIS_REPO: "main",
    gitremotes.VLLM_REPO: "main",  # a fork of vllm-project/vllm (default main); the fork itself is not readable here
}
# Sandermage/genesis-vllm-patches tags (name -> annotated?), same snapshot:
UPSTREAM_GENESIS_TAGS = {"v7.10.0": True, "v7.50-stable-2026-04-27": True, "v7.51-stable-2026-04-27": True,
                         "v12.0.0": False}
# Sandermage/genesis-vllm-patches@2db18df4bc3abd4eb58a9b2e0342082fa7012c64 (the catalog's Genesis pin, "fix(v7.69)",
# on dev, not an ancestor of main): among its files are these, and vllm/ holds only _genesis (no vllm/__init__.py).
UPSTREAM_GENESIS_2DB18DF_FILES = {"external_probe/patch_tolist_cudagraph.py", "vllm/_genesis/__init__.py",
                                  "vllm/_genesis/guards.py", "vllm/_genesis/patches/__init__.py",
                                  "vllm/_genesis/patches/apply_all.py"}


@pytest.fixture(scope="module")
def remotes(tmp_path_factory: pytest.TempPathFactory) -> Remotes:
    return make_remotes(tmp_path_factory.mktemp("remotes"))


def _repo_path(remotes: Remotes, name: str) -> Path:
    return Path(remotes.root) / f"{name}.git"


@pytest.mark.parametrize("name", sorted(UPSTREAM_DEFAULT_BRANCH))
def test_remote_default_branch_is_upstream_s(remotes: Remotes, name: str) -> None:
    path = _repo_path(remotes, name)
    assert git("symbolic-ref", "HEAD", cwd=path).strip() == f"refs/heads/{UPSTREAM_DEFAULT_BRANCH[name]}"


def test_recipe_remotes_have_master_and_no_main(remotes: Remotes) -> None:
    # Source: snapshots of noonghunna/club-3090 and noonghunna/qwen36-dual-3090 (no refs/heads/main in either);
    # the catalog's club3090 source says "ref: master  # upstream's default branch (club-3090 has no main)".
    for remote in (remotes.club3090, remotes.qwen_dual):
        heads = git("for-each-ref", "--format=%(refname)", "refs/heads", cwd=Path(remote.path)).split()
        assert heads == ["refs/heads/master"], remote.name


def test_genesis_branches_and_layout_match_upstream(remotes: Remotes) -> None:
    # Source: Sandermage/genesis-vllm-patches snapshot: main has no vllm/_genesis (main@dfffdad7 is the v12 layout),
    # 2db18df and release(v7.72.2) 7b9fd3194ee6efa1644973383cd44ee5604a5d85 are on dev and not ancestors of main.
    g = remotes.genesis
    path = Path(g.path)
    assert set(g.branches) == {"main", "dev"}  # upstream also has main-sync, which rigup never reads
    assert not [p for p in git("ls-tree", "-r", "--name-only", "main", cwd=path).split() if p.startswith("vllm/_genesis")]
    for sha in g.dev_commits:
        proc = subprocess.run(["git", "merge-base", "--is-ancestor", sha, "main"], cwd=path, capture_output=True,
                              env={**os.environ, **gitremotes.GIT_ENV})
        assert proc.returncode == 1, sha  # not reachable from main
    pinned = set(git("ls-tree", "-r", "--name-only", g.pin, cwd=path).split())
    # every file of the stand-in pin is at the same path upstream, but the stand-in's vllm/__init__.py (FACTS.md)
    assert pinned - {"README.md", "LICENSE", "vllm/__init__.py"} == UPSTREAM_GENESIS_2DB18DF_FILES


def _is_ancestor(path: Path, commit: str, of: str) -> bool:
    proc = subprocess.run(["git", "merge-base", "--is-ancestor", commit, of], cwd=path, capture_output=True,
                          env={**os.environ, **gitremotes.GIT_ENV})
    assert proc.returncode in (0, 1), proc.stderr
    return proc.returncode == 0


def test_genesis_tags_are_upstream_s_in_upstream_s_places(remotes: Remotes) -> None:
    # Source: Sandermage/genesis-vllm-patches snapshot (git for-each-ref refs/tags; merge-base --is-ancestor):
    # v7.10.0 (on 278b10e, dev's first commit), v7.50-stable-2026-04-27 (8fb2afb) and v7.51-stable-2026-04-27
    # (a8c202d) are annotated tags on dev, ancestors of the pin 2db18df, each with vllm/_genesis; v12.0.0 is a
    # lightweight tag on main (7aa66f9, an ancestor of main's head dfffdad, not its head), without vllm/_genesis.
    # "v7.69" and "v7.72.2" are release names in commit messages (2db18df4 "fix(v7.69)", 7b9fd319
    # "release(v7.72.2)"), not tags.
    g = remotes.genesis
    path = Path(g.path)
    kinds = dict(line.split() for line in git("for-each-ref", "refs/tags", "--format=%(refname:short) %(objecttype)",
                                              cwd=path).splitlines())
    assert kinds == {name: "tag" if annotated else "commit" for name, annotated in UPSTREAM_GENESIS_TAGS.items()}
    for name, annotated in UPSTREAM_GENESIS_TAGS.items():
        commit = g.tags[name]
        files = git("ls-tree", "-r", "--name-only", commit, cwd=path).split()
        if annotated:
            assert _is_ancestor(path, commit, g.pin) and commit != g.pin, name  # on dev, before the pin
            assert not _is_ancestor(path, commit, "main"), name
            assert "vllm/_genesis/patches/apply_all.py" in files, name
        else:
            assert _is_ancestor(path, commit, "main") and commit != g.main_head, name  # on main, before its head
            assert not _is_ancestor(path, commit, "dev"), name
            assert not [f for f in files if f.startswith("vllm/_genesis/")], name
    assert (g.tag, g.main_tag) == ("v7.51-stable-2026-04-27", "v12.0.0")


def test_genesis_source_ref_is_the_pin_s_sha_as_production_s(remotes: Remotes) -> None:
    # rigup/desired/catalog.yaml pins Genesis by SHA (ref: 2db18df4bc3abd4eb58a9b2e0342082fa7012c64, full_clone),
    # not by tag: the bed's source_refs point it at the stand-in pin's SHA, so the bed fetches a SHA as a rig
    # fetches upstream's.
    from rigup.desired.catalog import load_catalog

    assert re.fullmatch(r"[0-9a-f]{40}", load_catalog()["sources"]["genesis"]["ref"])
    assert remotes.source_refs()["genesis"] == remotes.genesis.pin == remotes.genesis.commits["pin"]
    assert gitremotes.source_refs_of(remotes.to_json()) == remotes.source_refs()


def test_remotes_allow_what_github_allows(remotes: Remotes) -> None:
    # Source: go-git/go-git#58 ("exact SHA1 refspecs ... may be only used on a server with AllowReachableSHA1InWant
    # or AllowTipSHA1InWant ... (GitHub supports it)"); GitHub serves partial clone filters (github.blog,
    # "Get up to speed with partial clone and shallow clone", 2020).
    for remote in (remotes.vllm, remotes.genesis, remotes.club3090, remotes.qwen_dual):
        path = Path(remote.path)
        assert git("config", "uploadpack.allowReachableSHA1InWant", cwd=path).strip() == "true"
        assert git("config", "uploadpack.allowFilter", cwd=path).strip() == "true"
        assert path.relative_to(remotes.root).as_posix() == f"{remote.name}.git"  # github.com/<owner>/<name>.git


def _hub_plan(workdir: Path) -> dict[str, Any]:
    """The hub's services as rigup_testbed/hub.py would start them (nothing started)."""
    from rigup_testbed.hub import Hub

    hub = Hub(workdir, "10.213.0.1")
    hub.repo_info = types.SimpleNamespace(root=workdir / "apt", urls=lambda url: {}, engine_urls=lambda url: {})
    return {svc.name: svc for svc in hub._plan()}


def test_fleet_git_knobs_speak_smart_http_as_github(remotes: Remotes, tmp_path: Path) -> None:
    # GitHub turned off the unencrypted git:// protocol on 2022-03-15 ("If your Git remotes start with https://,
    # nothing in this post will affect you": https://github.blog/2021-09-01-improving-git-protocol-security-github/);
    # the product's *_git_url defaults are https://github.com/<owner>/<name>.git (group_data/all.py). The hub's git
    # service serves smart HTTP only, and every *_git_url knob it writes points there, at the same path.
    from rigup_testbed.hub import PORTS, url_knobs

    (tmp_path / "git").symlink_to(remotes.root)
    git_svc = _hub_plan(tmp_path)["git"]
    assert git_svc.args[git_svc.args.index("--port") + 1] == str(PORTS["git"])
    base = f"http://10.213.0.1:{PORTS['git']}"
    knobs = git_svc.knobs({"url": base, "remotes": remotes.to_json()})
    defaults = {k: v for k, v in url_knobs().items() if k.endswith("_git_url") and v}
    assert defaults and all(v.startswith("https://github.com/") for v in defaults.values())
    assert {k for k in knobs if k.endswith("_git_url")} == set(defaults)
    for knob, default in defaults.items():
        assert knobs[knob] == base + urllib.parse.urlsplit(default).path, knob
    assert knobs["source_refs"]["genesis"] == remotes.genesis.pin


# --------------------------------------------------------------------------------------------------
# Hugging Face Hub (rigup_testbed/hfhub.py)
# --------------------------------------------------------------------------------------------------

HF_REPO = "acme/facts"
HF_SPEC = {"repos": {HF_REPO: {"commits": [{"message": "upload", "files": {
    "config.json": {"json": {"a": 1}},
    "model.safetensors": {"size": 5000, "seed": 1, "format": "safetensors"},
}}]}}}


@pytest.fixture()
def hub(tmp_path: Path) -> Iterator[hfhub.HfHub]:
    # redirect_lfs, as the hub service runs it (rigup_testbed/hub.py): the real Hub answers an LFS resolve with a 302
    # (huggingface/huggingface_hub@d6e4163139574c7f130232c48c81583782171fbe:tests/test_file_download.py,
    # test_get_hf_file_metadata_from_a_lfs_file: metadata.location contains "cdn-lfs"; later versions of the test:
    # "xethub.hf.co"). The CDN is another origin, as xethub.hf.co is to huggingface.co: huggingface_hub follows a
    # redirect that stays on the Hub's origin (utils/_http.py _httpx2_follow_hub_redirects_with_backoff, installed
    # huggingface_hub 2.4.0) and stops at one that leaves it.
    with hfhub.HfHub(tmp_path, spec=HF_SPEC, config=hfhub.HubConfig(redirect_lfs=True)) as server:
        yield server


def _commit_and_files(hub: hfhub.HfHub) -> tuple[str, dict[str, hfhub.HubFile]]:
    assert hub.state is not None
    commit = hub.state.repos[HF_REPO].commits[-1]
    return commit.sha, commit.files


def test_hf_resolve_headers_of_a_regular_file(hub: hfhub.HfHub) -> None:
    # Source: huggingface_hub 2.4.0 (PyPI; rigup's client) src/huggingface_hub/constants.py
    #   (HUGGINGFACE_CO_URL_TEMPLATE "{endpoint}/{repo_id}/resolve/{revision}/{filename}", X-Repo-Commit);
    #   tests/test_file_download.py@d6e41631: a regular file's etag is its blob id (info[file].blob_id), no redirect.
    sha, files = _commit_and_files(hub)
    status, headers, body = http(f"{hub.url}/{HF_REPO}/resolve/main/config.json", "HEAD")
    assert status == 200 and body == b""
    assert headers["X-Repo-Commit"] == sha
    assert headers["ETag"] == f'"{files["config.json"].oid}"'
    assert files["config.json"].oid == hashlib.sha1(b"blob 13\0" + b'{\n  "a": 1\n}\n').hexdigest()  # git's blob id
    assert "X-Linked-Etag" not in headers and "X-Linked-Size" not in headers
    assert int(headers["Content-Length"]) == files["config.json"].size


def test_hf_resolve_headers_of_an_lfs_file(hub: hfhub.HfHub) -> None:
    # Source: huggingface_hub 2.4.0 constants.py (X-Linked-Etag, X-Linked-Size) and file_download.py
    #   get_hf_file_metadata (reads X-Linked-Etag before ETag, X-Linked-Size before Content-Length);
    #   huggingface/huggingface_hub@d6e41631:tests/test_file_download.py: an LFS file's etag is lfs.sha256, it redirects.
    sha, files = _commit_and_files(hub)
    lfs = files["model.safetensors"]
    status, headers, _ = http(f"{hub.url}/{HF_REPO}/resolve/main/model.safetensors", "HEAD")
    assert status == 302 and headers["Location"]
    assert headers["X-Repo-Commit"] == sha
    assert headers["X-Linked-Etag"] == f'"{lfs.sha256}"' and headers["X-Linked-Size"] == str(lfs.size)


def test_hf_client_reads_the_bed_s_headers_as_the_hub_s(hub: hfhub.HfHub) -> None:
    # The real client is the judge of the header semantics (huggingface_hub's get_hf_file_metadata).
    from huggingface_hub import HfApi, get_hf_file_metadata, hf_hub_url

    sha, files = _commit_and_files(hub)
    regular = get_hf_file_metadata(hf_hub_url(HF_REPO, "config.json", endpoint=hub.url))
    assert (regular.commit_hash, regular.etag, regular.size) == (sha, files["config.json"].oid, files["config.json"].size)
    lfs = get_hf_file_metadata(hf_hub_url(HF_REPO, "model.safetensors", endpoint=hub.url))
    f = files["model.safetensors"]
    assert (lfs.commit_hash, lfs.etag, lfs.size) == (sha, f.sha256, f.size)
    assert hub.cdn_url is not None and lfs.location.startswith(f"{hub.cdn_url}/_lfs/")
    # GET /api/models/{repo_id}/revision/{revision}?blobs=true (hf_api.py model_info): siblings with blobId and lfs
    info = HfApi(endpoint=hub.url, token=False).model_info(HF_REPO, revision="main", files_metadata=True)
    sib = {s.rfilename: s for s in info.siblings}
    assert info.sha == sha
    assert sib["config.json"].blob_id == files["config.json"].oid and sib["config.json"].lfs is None
    assert sib["model.safetensors"].lfs is not None
    assert (sib["model.safetensors"].lfs.sha256, sib["model.safetensors"].lfs.size) == (f.sha256, f.size)


def test_hf_client_keeps_its_token_off_the_cdn(hub: hfhub.HfHub, tmp_path: Path) -> None:
    # huggingface_hub 2.4.0 file_download.py _get_metadata_or_catch_error: "If the final location is on a Hub host
    # ... keep auth. Otherwise it's a signed CDN url => don't send auth" (headers.pop("authorization")). The bed's
    # CDN counts requests that carry an Authorization header; the bytes cross the hub's counters once.
    from huggingface_hub import hf_hub_download

    got = hf_hub_download(HF_REPO, "model.safetensors", cache_dir=tmp_path, endpoint=hub.url, token="hf_facts_token")
    _, files = _commit_and_files(hub)
    f = files["model.safetensors"]
    assert hashlib.sha256(Path(got).read_bytes()).hexdigest() == f.sha256
    stats = hub.admin().stats()
    assert stats["cdn_authorized_requests"] == 0
    assert stats["total_bytes"] == stats["files"][f"{HF_REPO}/model.safetensors"]["bytes"] == f.size
    assert stats["files"][f"{HF_REPO}/model.safetensors"]["redirected"] >= 1


def test_hub_service_redirects_lfs_to_a_cdn_on_another_origin(tmp_path: Path) -> None:
    # The real Hub redirects every LFS file to another origin (cdn-lfs / xethub.hf.co, test_file_download.py above):
    # the hub service runs hfhub with redirects on and its CDN on another port of the hub's address.
    from rigup_testbed.hub import PORTS

    args = _hub_plan(tmp_path)["hf"].args
    assert "--redirect-lfs" in args
    assert args[args.index("--cdn-port") + 1] == str(PORTS["hf_cdn"]) != args[args.index("--port") + 1]


@pytest.mark.parametrize(("path", "code"), [
    (f"{HF_REPO}/resolve/main/missing.bin", "EntryNotFound"),
    (f"{HF_REPO}/resolve/no-such-branch/config.json", "RevisionNotFound"),
    ("nobody/nothing/resolve/main/config.json", "RepoNotFound"),
])
def test_hf_errors_carry_the_hub_s_error_codes(hub: hfhub.HfHub, path: str, code: str) -> None:
    # Source: huggingface_hub 2.4.0 src/huggingface_hub/utils/_http.py: hf_raise_for_status maps X-Error-Code
    #   EntryNotFound / RevisionNotFound / RepoNotFound (and GatedRepo) to its error classes.
    status, headers, _ = http(f"{hub.url}/{path}", "HEAD")
    assert status == 404 and headers["X-Error-Code"] == code


# --------------------------------------------------------------------------------------------------
# Container registries (rigup_testbed/hubserve.py, rigup_testbed/registry.py)
# --------------------------------------------------------------------------------------------------

# Source: distribution/distribution@01b4555d59222ec9698cb1173b980cbbb1fb5289:docs/content/spec/api.md and
# @b911020c1f93704e5a7ff0d25258b1c3d8e2f547:docs/content/spec/manifest-v2-2.md
V2_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
V2_CONFIG = "application/vnd.docker.container.image.v1+json"
V2_LAYER = "application/vnd.docker.image.rootfs.diff.tar.gzip"


@pytest.fixture()
def standin_registry(tmp_path: Path) -> Iterator[str]:
    config = tmp_path / "registry.json"
    config.write_text(json.dumps({"missing": ["gone/image:1"]}))
    handler = type("H", (hubserve.RegistryHandler,), {"config_file": config, "dockerclient": load_standin("dockerclient")})
    server = BackgroundServer("127.0.0.1", 0, handler, "facts-registry")
    handler.host_port = f"127.0.0.1:{server.port}"
    server.start()
    try:
        yield f"http://127.0.0.1:{server.port}"
    finally:
        server.stop()


def test_standin_registry_answers_the_v2_api_shape(standin_registry: str) -> None:
    # api.md: "GET /v2/" 200 with "Docker-Distribution-API-Version: registry/2.0"; "HEAD /v2/<name>/manifests/<reference>"
    # answers 200 with Content-Length and Docker-Content-Digest, 404 when unknown; errors are
    # {"errors": [{"code", "message", ...}]}, MANIFEST_UNKNOWN for an unknown manifest.
    status, headers, _ = http(f"{standin_registry}/v2/")
    assert status == 200 and headers["Docker-Distribution-Api-Version"] == "registry/2.0"
    status, headers, _ = http(f"{standin_registry}/v2/vllm/vllm-openai/manifests/v0.11.0", "HEAD")
    assert status == 200 and headers["Content-Type"] == V2_MANIFEST
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", headers["Docker-Content-Digest"]) and int(headers["Content-Length"]) > 0
    status, _, body = http(f"{standin_registry}/v2/gone/image/manifests/1")
    assert status == 404 and json.loads(body)["errors"][0]["code"] == "MANIFEST_UNKNOWN"


def test_deviation_standin_registry_digest_is_not_the_manifest_s_hash(standin_registry: str) -> None:
    # api.md ("Digest Header"): for manifests the digest is of the manifest body. The manifest-only stand-in
    # serves a digest it is told (or derives from the name) over a placeholder body (hubserve.py docstring;
    # FACTS.md): nothing may verify a manifest body against it. The real registry (registry.py) is exact.
    status, headers, body = http(f"{standin_registry}/v2/vllm/vllm-openai/manifests/v0.11.0")
    assert status == 200
    assert headers["Docker-Content-Digest"] != "sha256:" + hashlib.sha256(body).hexdigest()


def test_engine_registry_images_are_schema2_with_content_digests() -> None:
    # manifest-v2-2.md: schemaVersion 2, mediaType V2_MANIFEST; config {mediaType V2_CONFIG, size, digest};
    # layers [{mediaType V2_LAYER, size, digest}]; api.md: digests are sha256 over the bytes.
    layer = b"\x1f\x8b" + b"rigup facts layer"
    image = registry._assemble("rigup-testbed/facts", "1", layer, "sha256:" + "0" * 64, {"Cmd": ["sh"]})
    manifest = json.loads(image.manifest)
    assert (manifest["schemaVersion"], manifest["mediaType"]) == (2, V2_MANIFEST)
    assert manifest["config"] == {"mediaType": V2_CONFIG, "size": len(image.config),
                                  "digest": "sha256:" + hashlib.sha256(image.config).hexdigest()}
    assert manifest["layers"] == [{"mediaType": V2_LAYER, "size": len(layer),
                                   "digest": "sha256:" + hashlib.sha256(layer).hexdigest()}]
    assert image.digest == "sha256:" + hashlib.sha256(image.manifest).hexdigest()
    assert registry.MANIFEST_TYPE == V2_MANIFEST and registry.CONFIG_TYPE == V2_CONFIG and registry.LAYER_TYPE == V2_LAYER


# --------------------------------------------------------------------------------------------------
# PyPI simple index (rigup_testbed/pypi.py)
# --------------------------------------------------------------------------------------------------


def test_simple_index_pages_have_pep_503_shape(tmp_path: Path) -> None:
    # Source: python/peps@024252ccfc7bf299d6f66e0164fde967187ab01a:peps/pep-0503.rst (root: one anchor per project,
    #   text = project name; project URL /<normalized name>/; file anchors whose text is the final path component of
    #   the href, which SHOULD carry #<hashname>=<hex>; HTML URLs end in "/" and SHOULD redirect without it) and
    #   python/peps@77b488df2b5ce7f780f98f1197849eedafa5ed38:peps/pep-0629.rst (<meta name="pypi:repository-version">).
    files: list[dict[str, str | int]] = [
        {"name": "zope-interface", "filename": "zope.interface-7.2-cp311-cp311-manylinux_2_17_x86_64.whl",
         "sha256": "ab" * 32},
        {"name": "six", "filename": "six-1.17.0-py2.py3-none-any.whl", "sha256": "cd" * 32},
    ]
    pypi._write_simple_index(tmp_path, files)
    root = (tmp_path / "simple/index.html").read_text()
    assert '<meta name="pypi:repository-version" content="1.0">' in root
    assert re.findall(r'<a href="([^"]+)">([^<]+)</a>', root) == [("six/", "six"), ("zope-interface/", "zope-interface")]
    for entry in files:
        name = str(entry["name"])
        assert name == re.sub(r"[-_.]+", "-", name).lower()  # PEP 503 normalize()
        page = (tmp_path / "simple" / name / "index.html").read_text()
        ((href, text),) = re.findall(r'<a href="([^"]+)">([^<]+)</a>', page)
        url, _, fragment = href.partition("#")
        assert text == urllib.parse.unquote(url.rsplit("/", 1)[-1]) == entry["filename"]
        assert fragment == f"sha256={entry['sha256']}"
        assert (tmp_path / "simple" / name / url).resolve() == (tmp_path / "packages" / str(entry["filename"])).resolve()
    # served as the hub serves it (hubserve's static server): a project URL without "/" redirects to add it
    server = BackgroundServer("127.0.0.1", 0, functools.partial(StaticHandler, directory=str(tmp_path)), "facts-pypi")
    server.start()
    try:
        status, headers, _ = http(f"http://127.0.0.1:{server.port}/simple/six")
        assert status == 301 and headers["Location"].endswith("/simple/six/")
    finally:
        server.stop()
