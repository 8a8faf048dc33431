"""The stand-in apt repositories: layout, signatures and dependency resolution checked with real apt.

apt runs against a scratch configuration (APT_CONFIG pointing at a private Dir tree and a fake dpkg
status), fetching over HTTP from a loopback server like a test-bed host fetches from the hub.
"""

from __future__ import annotations

import functools
import http.server
import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rigup_testbed import aptrepo, debarchive
from rigup_testbed.hub import host_layer_debs
from rigup_testbed.image import cache_dir

pytestmark = pytest.mark.skipif(
    not all(shutil.which(t) for t in ("apt-get", "apt-ftparchive", "dpkg-deb", "gpg")),
    reason="needs apt-get, apt-ftparchive, dpkg-deb and gpg",
)

# What a Debian 12 test host already has that the stand-ins depend on.
BASE_STATUS = {"python3": "3.11.2-1+b1", "libc6": "2.36-9+deb12u10"}


@pytest.fixture(scope="session")
def repo() -> aptrepo.RepoInfo:
    return aptrepo.build_repos(cache_dir() / "aptrepo")


@pytest.fixture(scope="session")
def base_url(repo: aptrepo.RepoInfo) -> Iterator[str]:
    handler = functools.partial(QuietHandler, directory=str(repo.root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass


class Apt:
    """apt-get/apt-cache confined to a scratch directory."""

    def __init__(self, root: Path, installed: dict[str, dict[str, str]] | None = None):
        self.root = root
        for d in ("etc/apt/sources.list.d", "etc/apt/apt.conf.d", "etc/apt/preferences.d", "etc/apt/keyrings",
                  "var/lib/apt/lists/partial", "var/cache/apt/archives/partial", "var/lib/dpkg"):
            (root / d).mkdir(parents=True, exist_ok=True)
        (root / "etc/apt/sources.list").write_text("")
        stanzas = [{"Package": n, "Version": v} for n, v in BASE_STATUS.items()]
        for name, fields in (installed or {}).items():
            stanzas.append({"Package": name, **fields})
        (root / "var/lib/dpkg/status").write_text("\n".join(
            f"Package: {s['Package']}\nStatus: install ok installed\nVersion: {s['Version']}\nArchitecture: amd64\n"
            "Maintainer: test\n" + "".join(f"{k}: {v}\n" for k, v in s.items() if k not in ("Package", "Version"))
            + "Description: test\n" for s in stanzas))
        (root / "apt.conf").write_text(
            f'Dir "{root}/";\nDir::State::status "{root}/var/lib/dpkg/status";\nAPT::Architecture "amd64";\n'
            'APT::Architectures { "amd64"; };\nAPT::Sandbox::User "root";\nDebug::NoLocking "true";\n'
            'Acquire::Languages "none";\nAcquire::http::Proxy "DIRECT";\n')

    def key(self, name: str, content: bytes) -> Path:
        p = self.root / "etc/apt/keyrings" / name
        p.write_bytes(content)
        return p

    def source(self, name: str, line: str) -> None:
        (self.root / "etc/apt/sources.list.d" / f"{name}.list").write_text(line + "\n")

    def __call__(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        env = dict(os.environ, APT_CONFIG=str(self.root / "apt.conf"), LC_ALL="C")
        env.pop("http_proxy", None)
        cmd = ["apt-cache", *args[1:]] if args[0] == "apt-cache" else ["apt-get", *args]
        proc = subprocess.run(cmd, env=env, text=True, capture_output=True)
        if check and proc.returncode != 0:
            raise AssertionError(f"{cmd} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        return proc


def fetch(url: str) -> bytes:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read()


def configure_all(apt: Apt, repo: aptrepo.RepoInfo, base: str, codename: str) -> None:
    urls = repo.urls(base)
    distro = repo.cuda_distros[codename]
    docker_key = apt.key("docker.asc", fetch(urls["docker_apt_key_url"]))
    ctk_key = apt.key("nvidia-container-toolkit.asc", fetch(urls["nvidia_ctk_apt_key_url"]))
    ua_key = apt.key("ubuntu-archive.asc", fetch(urls["ubuntu_archive_key_url"]))
    cuda_key = apt.key("cuda.asc", fetch(urls["nvidia_cuda_repo_key_url"].format(distro=distro)))
    apt.source("docker", f"deb [arch=amd64 signed-by={docker_key}] {urls['docker_apt_url']} {codename} stable")
    apt.source("nvidia-container-toolkit", f"deb [signed-by={ctk_key}] {urls['nvidia_ctk_apt_url']}/$(ARCH) /")
    apt.source("ubuntu-archive", f"deb [signed-by={ua_key}] {urls['ubuntu_archive_url']} {codename} "
               f"{' '.join(repo.ubuntu_archive_components)}")
    apt.source("cuda", f"deb [signed-by={cuda_key}] {urls['nvidia_cuda_repo_url']}/{distro}/x86_64 /")


def installs(out: str) -> dict[str, str]:
    return dict(re.findall(r"^Inst (\S+) \((\S+) ", out, re.M))


def removals(out: str) -> set[str]:
    return set(re.findall(r"^Remv (\S+)", out, re.M))


def test_layout_matches_production_urls(repo: aptrepo.RepoInfo) -> None:
    root = repo.root
    for c in repo.codenames:
        assert (root / f"docker/linux/ubuntu/dists/{c}/stable/binary-amd64/Packages").is_file()
        for f in ("InRelease", "Release", "Release.gpg"):
            assert (root / f"docker/linux/ubuntu/dists/{c}/{f}").is_file()
            assert (root / f"ubuntu-archive/dists/{c}/{f}").is_file()
        assert (root / f"ubuntu-archive/dists/{c}/restricted/binary-amd64/Packages.gz").is_file()
        flat = root / f"compute/cuda/repos/{repo.cuda_distros[c]}/x86_64"
        assert {"Packages", "InRelease", "Release.gpg", "3bf863cc.pub"} <= {p.name for p in flat.iterdir()}
    assert (root / "libnvidia-container/stable/deb/amd64/InRelease").is_file()
    for key in ("docker/linux/ubuntu/gpg", "libnvidia-container/gpgkey", "ubuntu-archive/ubuntu-archive-keyring.asc",
                "compute/cuda/repos/ubuntu2404/x86_64/3bf863cc.pub"):
        assert (root / key).read_text().startswith("-----BEGIN PGP PUBLIC KEY BLOCK-----")
    assert repo.urls("http://10.77.0.1:8080/")["docker_apt_url"] == "http://10.77.0.1:8080/docker/linux/ubuntu"
    # Every repository signs with its own key.
    assert len(set(repo.fingerprints.values())) == 4


def test_build_is_cached_by_content_hash(repo: aptrepo.RepoInfo) -> None:
    marker = repo.root / "docker/linux/ubuntu/dists/noble/InRelease"
    before = marker.stat().st_mtime_ns
    started = time.monotonic()
    again = aptrepo.build_repos(repo.root.parent)
    assert time.monotonic() - started < 1.0
    assert again.content_hash == repo.content_hash and again.root == repo.root
    assert marker.stat().st_mtime_ns == before


def test_another_content_hash_builds_beside_the_tree_a_bed_serves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkout whose stand-ins differ (another content hash) must not replace, with new keys, the tree
    a running bed's hosts trust: each hash has its own directory; only long-unused ones are removed."""
    served = tmp_path / "aptrepo" / "aaaa"
    served.mkdir(parents=True)
    (served / "repo-info.json").write_text("{}")
    (served / aptrepo.USED_STAMP).touch()
    stale = tmp_path / "aptrepo" / "bbbb"
    stale.mkdir()
    (stale / aptrepo.USED_STAMP).touch()
    old = time.time() - aptrepo.STALE_AFTER_S - 60
    os.utime(stale / aptrepo.USED_STAMP, (old, old))
    removed = aptrepo._remove_stale(tmp_path / "aptrepo", keep="cccc")
    assert removed == ["bbbb"] and served.exists() and (served / "repo-info.json").exists()


@pytest.mark.parametrize("codename", ["noble", "jammy", "bookworm"])
def test_signed_repos_resolve_every_rigup_package(repo: aptrepo.RepoInfo, base_url: str, tmp_path: Path,
                                                  codename: str) -> None:
    apt = Apt(tmp_path)
    configure_all(apt, repo, base_url, codename)
    out = apt("update")
    assert not re.search(r"^(W|E):", out.stdout + out.stderr, re.M), out.stdout + out.stderr
    sim = apt("install", "-s", "docker-ce", "docker-ce-cli", "containerd.io", "docker-compose-plugin",
              "nvidia-container-toolkit", "nvidia-driver-580-open", "mokutil", "pciutils").stdout
    got = installs(sim)
    tag = aptrepo.DOCKER_SUITE_TAG[codename]
    assert got["docker-ce"] == f"5:28.5.2-1~{tag}"
    assert got["docker-compose-plugin"] == f"2.40.3-1~{tag}"
    assert got["containerd.io"] == f"1.7.28-1~{tag}"
    assert got["nvidia-container-toolkit"] == got["nvidia-container-toolkit-base"] == "1.18.0-1"
    assert got["libnvidia-container-tools"] == "1.18.0-1"
    assert got["nvidia-driver-580-open"] == got["nvidia-dkms-580-open"] == got["nvidia-utils-580"] == "580.95.05-0ubuntu1"
    assert "nvidia-dkms-580" not in got
    # Pins select older versions like on the real repositories.
    pinned = installs(apt("install", "-s", f"docker-ce=5:28.5.1-1~{tag}", f"docker-ce-cli=5:28.5.1-1~{tag}",
                          "nvidia-container-toolkit=1.17.8-1", "nvidia-container-toolkit-base=1.17.8-1").stdout)
    assert pinned["docker-ce"] == f"5:28.5.1-1~{tag}"
    assert pinned["nvidia-container-toolkit"] == "1.17.8-1"


def test_repository_signed_by_another_key_is_rejected(repo: aptrepo.RepoInfo, base_url: str, tmp_path: Path) -> None:
    apt = Apt(tmp_path)
    wrong = apt.key("wrong.asc", fetch(repo.urls(base_url)["nvidia_ctk_apt_key_url"]))
    apt.source("docker", f"deb [signed-by={wrong}] {base_url}/{repo.docker_apt_url} noble stable")
    out = apt("update", check=False)
    text = out.stdout + out.stderr
    assert "NO_PUBKEY" in text and "is not signed" in text
    assert "docker-ce" not in apt("apt-cache", "pkgnames", check=False).stdout


def _installed(names_versions: dict[str, str], repo: aptrepo.RepoInfo) -> dict[str, dict[str, str]]:
    """dpkg status stanzas for installed driver packages, with their real relationships."""
    control = {}
    for name, version in names_versions.items():
        deb = next(repo.root.glob(f"ubuntu-archive/pool/**/{name}_{version}_amd64.deb"))
        fields = subprocess.run(["dpkg-deb", "-f", str(deb), "Depends", "Provides", "Conflicts", "Replaces"],
                                capture_output=True, text=True, check=True).stdout
        stanza = {"Version": version}
        for line in fields.splitlines():
            k, _, v = line.partition(": ")
            stanza[k] = v
        control[name] = stanza
    return control


def test_driver_branch_upgrade_replaces_old_branch(repo: aptrepo.RepoInfo, base_url: str, tmp_path: Path) -> None:
    old = "550.163.01-0ubuntu1"
    apt = Apt(tmp_path, _installed({"nvidia-driver-550": old, "nvidia-utils-550": old, "nvidia-dkms-550": old,
                                    "nvidia-kernel-common-550": old}, repo))
    configure_all(apt, repo, base_url, "noble")
    apt("update")
    out = apt("install", "-s", "nvidia-driver-580-open").stdout
    assert removals(out) == {"nvidia-driver-550", "nvidia-utils-550", "nvidia-dkms-550", "nvidia-kernel-common-550"}
    assert installs(out)["nvidia-driver-580-open"] == "580.95.05-0ubuntu1"


def test_flavour_switch_swaps_kernel_module_package(repo: aptrepo.RepoInfo, base_url: str, tmp_path: Path) -> None:
    v = "580.95.05-0ubuntu1"
    apt = Apt(tmp_path, _installed({"nvidia-driver-580-open": v, "nvidia-utils-580": v, "nvidia-dkms-580-open": v,
                                    "nvidia-kernel-common-580": v}, repo))
    configure_all(apt, repo, base_url, "noble")
    apt("update")
    out = apt("install", "-s", "nvidia-driver-580").stdout
    assert removals(out) == {"nvidia-driver-580-open", "nvidia-dkms-580-open"}
    assert set(installs(out)) == {"nvidia-driver-580", "nvidia-dkms-580"}


def test_cuda_repo_metapackages_pick_the_flavour(repo: aptrepo.RepoInfo, base_url: str, tmp_path: Path) -> None:
    apt = Apt(tmp_path)
    urls = repo.urls(base_url)
    key = apt.key("cuda.asc", fetch(urls["nvidia_cuda_repo_key_url"].format(distro="ubuntu2404")))
    apt.source("cuda", f"deb [signed-by={key}] {urls['nvidia_cuda_repo_url']}/ubuntu2404/x86_64 /")
    apt("update")
    assert "nvidia-dkms-580-open" in installs(apt("install", "-s", "nvidia-open-580").stdout)
    assert "nvidia-dkms-580" in installs(apt("install", "-s", "cuda-drivers-580").stdout)
    assert installs(apt("install", "-s", "nvidia-open").stdout)["nvidia-driver-580-open"] == "580.95.05-0ubuntu1"
    assert "nvidia-dkms-550-open" in installs(apt("install", "-s", "nvidia-open-550").stdout)


def _deb(repo: aptrepo.RepoInfo, pattern: str) -> Path:
    return sorted(repo.root.glob(pattern))[-1]


def _control(deb: Path, member: str) -> str:
    with __import__("tempfile").TemporaryDirectory() as d:
        subprocess.run(["dpkg-deb", "-e", str(deb), d], check=True)
        p = Path(d) / member
        return p.read_text() if p.exists() else ""


def test_packages_carry_conffiles_units_and_maintainer_scripts(repo: aptrepo.RepoInfo) -> None:
    pool = "docker/linux/ubuntu/dists/noble/pool/stable/amd64"
    engine = _deb(repo, f"{pool}/docker-ce_28.5.2*.deb")
    assert _control(engine, "conffiles").split() == ["/etc/default/docker"]
    postinst = _control(engine, "postinst")
    assert "groupadd --system docker" in postinst and "deb-systemd-invoke $_dh_action 'docker.socket' 'docker.service'" in postinst
    listing = subprocess.run(["dpkg-deb", "-c", str(engine)], capture_output=True, text=True, check=True).stdout
    assert "./lib/systemd/system/docker.service" in listing and "./usr/bin/dockerd -> " in listing
    assert _control(_deb(repo, f"{pool}/containerd.io_*.deb"), "conffiles").split() == ["/etc/containerd/config.toml"]
    base = _deb(repo, "libnvidia-container/stable/deb/amd64/nvidia-container-toolkit-base_1.18.0-1_amd64.deb")
    assert _control(base, "conffiles").split() == ["/etc/nvidia-container-runtime/config.toml"]
    dkms = _deb(repo, "ubuntu-archive/pool/restricted/n/nvidia-graphics-drivers-580/nvidia-dkms-580-open_*.deb")
    assert "modload.py --install" in _control(dkms, "postinst")
    listing = subprocess.run(["dpkg-deb", "-c", str(dkms)], capture_output=True, text=True, check=True).stdout
    assert "nvidia-standin-modload.service" in listing
    compose = _deb(repo, f"{pool}/docker-compose-plugin_*.deb")
    listing = subprocess.run(["dpkg-deb", "-c", str(compose)], capture_output=True, text=True, check=True).stdout
    # the command is a launcher beside the module (imported, so Python keeps its bytecode)
    assert "./usr/libexec/docker/cli-plugins/docker-compose -> ../../../lib/docker-standin/compose/run-compose_plugin" in listing
    assert "./usr/lib/docker-standin/compose/compose_plugin.py" in listing
    assert "./usr/lib/docker-standin/compose/docker-compose-real" in listing
    # Driver bytes are identical in the archive and the CUDA repo (apt would warn otherwise).
    a = _deb(repo, "ubuntu-archive/pool/restricted/n/nvidia-graphics-drivers-580/nvidia-utils-580_*.deb")
    b = _deb(repo, "compute/cuda/repos/ubuntu2404/x86_64/nvidia-utils-580_*.deb")
    assert a.read_bytes() == b.read_bytes()


def test_the_engine_repository_holds_the_real_programs_under_docker_ces_names(repo: aptrepo.RepoInfo, tmp_path: Path) -> None:
    """docker-engine/linux/ubuntu: the same package names, units and scripts as Docker CE's, with Debian's
    dockerd, containerd, runc and the real Compose v2 binary inside, byte for byte."""
    pool = "docker-engine/linux/ubuntu/dists/noble/pool/stable/amd64"
    engine_version = aptrepo.upstream_version(aptrepo.engine_versions()["docker.io"])
    engine = _deb(repo, f"{pool}/docker-ce_{engine_version}-1~*.deb")
    control = _control(engine, "control")
    assert "Depends: containerd.io (>= 1.6), docker-ce-cli, iptables" in control and "the real engine" in control
    assert "groupadd --system docker" in _control(engine, "postinst")
    for name, programs in aptrepo.ENGINE_FILES.items():
        deb = _deb(repo, f"{pool}/{name}_*.deb")
        out = tmp_path / name
        subprocess.run(["dpkg-deb", "-x", str(deb), str(out)], check=True)
        for dest, (_, source) in programs.items():
            assert (out / dest.lstrip("/")).read_bytes() == Path(source).read_bytes(), dest
    assert (out.parent / "docker-ce/lib/systemd/system/docker.service").read_text() == aptrepo.DOCKER_SERVICE
    compose = tmp_path / "compose"
    subprocess.run(["dpkg-deb", "-x", str(_deb(repo, f"{pool}/docker-compose-plugin_*.deb")), str(compose)], check=True)
    plugin = compose / "usr/libexec/docker/cli-plugins/docker-compose"
    assert plugin.read_bytes() == aptrepo.compose_binary().read_bytes()
    assert "Docker Compose version v2.40.3" in subprocess.run([str(plugin), "version"], capture_output=True, text=True).stdout
    assert repo.urls("http://hub", real_engine=True)["docker_apt_url"] == "http://hub/docker-engine/linux/ubuntu"


def test_universe_serves_debian_s_real_prometheus_packages(repo: aptrepo.RepoInfo) -> None:
    """universe: the real .debs of debarchive's manifest, at Debian's pool paths under pool/universe/, in
    every suite's index, byte for byte what Debian's archive serves (its index's sha256)."""
    manifest = {d.name: d for d in debarchive.universe_manifest()}
    assert repo.ubuntu_archive_components == ("main", "restricted", "universe")
    for c in repo.codenames:
        release = (repo.root / f"ubuntu-archive/dists/{c}/Release").read_text()
        assert "Components: main restricted universe\n" in release and "universe/binary-amd64/Packages" in release
        index = debarchive.parse_control((repo.root / f"ubuntu-archive/dists/{c}/universe/binary-amd64/Packages").read_text())
        served = {p["Package"]: p for p in index}
        assert set(served) == set(manifest)
        for name, d in manifest.items():
            assert (served[name]["Version"], served[name]["SHA256"]) == (d.version, d.sha256)
            assert served[name]["Filename"] == "pool/universe/" + d.filename.split("/", 2)[2]
        assert repo.versions("ubuntu_archive", c, "prometheus") == [manifest["prometheus"].version]
    node = next(repo.root.glob("ubuntu-archive/pool/universe/p/prometheus-node-exporter/prometheus-node-exporter_*.deb"))
    assert "Maintainer: Debian Go Packaging Team" in _control(node, "control")
    assert "prometheus-node-exporter.service" in _control(node, "postinst")


def test_apt_installs_prometheus_from_universe_on_the_image(repo: aptrepo.RepoInfo, base_url: str, tmp_path: Path) -> None:
    """Real apt, the hub's signed archive alone, a dpkg status holding what the image has of the relations:
    installing the three packages takes exactly the served set, nothing the archive lacks."""
    manifest = debarchive.universe_manifest()
    names = {d.name for d in manifest}
    archive = debarchive.DebianArchive()
    image = debarchive.image_package_set(archive.index(), archive.spec)
    provided = {rel[0] for d in manifest for group in debarchive.parse_relations(d.provides) for rel in group}
    needed = {rel[0] for d in manifest for group in debarchive.parse_relations(d.pre_depends + ", " + d.depends)
              for rel in group} - names - provided
    # a virtual name (debconf-2.0) is met by the real package of its alternative group, also needed
    apt = Apt(tmp_path, {n: {"Version": image[n]} for n in needed if n not in BASE_STATUS and n in image})
    urls = repo.urls(base_url)
    key = apt.key("ubuntu-archive.asc", fetch(urls["ubuntu_archive_key_url"]))
    apt.source("ubuntu-archive", f"deb [signed-by={key}] {urls['ubuntu_archive_url']} noble main restricted universe")
    out = apt("update")
    assert not re.search(r"^(W|E):", out.stdout + out.stderr, re.M), out.stdout + out.stderr
    got = installs(apt("install", "-s", *debarchive.ROOTS).stdout)
    assert got == {d.name: d.version for d in manifest}


def test_the_host_layer_a_bed_may_preinstall_is_what_a_converge_installs_on_a_debian_12_rig(repo: aptrepo.RepoInfo) -> None:
    """rigup_testbed.hub.host_layer_debs (Testbed.up(host_layer=True)): the newest of each host-layer package, from the
    repositories a bed's rig installs them from (the archive's driver, the real engine, the toolkit), as dpkg listed
    them on a sandbox rig after `pyinfra inventory.py deploy.py` (2026-12-07)."""
    assert sorted(deb.name for deb in host_layer_debs(repo.root)) == [
        "containerd.io_1.6.20-1~debian.12~bookworm_amd64.deb",
        "docker-ce-cli_20.10.24-1~debian.12~bookworm_amd64.deb",
        "docker-ce_20.10.24-1~debian.12~bookworm_amd64.deb",
        "docker-compose-plugin_2.40.3-1~debian.12~bookworm_amd64.deb",
        "libnvidia-container-tools_1.18.0-1_amd64.deb",
        "libnvidia-container1_1.18.0-1_amd64.deb",
        "nvidia-container-toolkit-base_1.18.0-1_amd64.deb",
        "nvidia-container-toolkit_1.18.0-1_amd64.deb",
        "nvidia-dkms-580-open_580.95.05-0ubuntu1_amd64.deb",
        "nvidia-driver-580-open_580.95.05-0ubuntu1_amd64.deb",
        "nvidia-kernel-common-580_580.95.05-0ubuntu1_amd64.deb",
        "nvidia-utils-580_580.95.05-0ubuntu1_amd64.deb",
    ]
