"""Real Debian packages for the test bed (rigup_testbed/debarchive.py): the dependency closure the stand-in
Ubuntu archive's universe serves, checked on made-up indexes, against dpkg, and against Debian bookworm's
real index and the built image; and the real programs the control machine gets from the same .debs."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from rigup_testbed import debarchive
from rigup_testbed.debarchive import ArchiveDeb, ArchiveError, DebianArchive, Index
from rigup_testbed.image import ImageSpec, cache_dir

needs_apt = pytest.mark.skipif(not all(shutil.which(t) for t in ("apt-get", "dpkg-deb")), reason="needs apt-get and dpkg-deb")


def index(*stanzas: str) -> Index:
    return Index(debarchive.parse_control("\n\n".join(stanzas)))


def pkg(name: str, version: str = "1.0", **fields: str) -> str:
    return f"Package: {name}\nVersion: {version}\n" + "".join(f"{k.replace('_', '-')}: {v}\n" for k, v in fields.items())


# --- versions and relations ----------------------------------------------------------------------

VERSION_PAIRS = [
    ("1.0", "1.0"), ("1.0", "1.1"), ("1.0~rc1", "1.0"), ("1:0.9", "2.0"), ("2.36-9+deb12u10", "2.36-9+deb12u4"),
    ("2.42.0+ds-5+deb12u1", "2.42.0+ds-5"), ("1.54~", "1.65.2"), ("1.0-1", "1.0-1.1"), ("1.0a", "1.0+"),
    ("0~20130707+git2d51e3a9+dfsg-2.1", "0.1"), ("3.6.1+dfsg+~3.5.14-1", "3.5.1~"), ("1.0", "1.0-0"), ("10", "9"),
    ("1.0.0", "1.0"), ("1:1.0", "1.0"), ("1.0-2~bpo1", "1.0-2"), ("1.0.1a", "1.0.1"), ("1.2~~", "1.2~"),
]


@pytest.mark.skipif(shutil.which("dpkg") is None, reason="needs dpkg")
@pytest.mark.parametrize(("a", "b"), VERSION_PAIRS)
def test_version_order_is_dpkg_s(a: str, b: str) -> None:
    def dpkg(op: str) -> bool:
        return subprocess.run(["dpkg", "--compare-versions", a, op, b]).returncode == 0

    c = debarchive.compare_versions(a, b)
    assert (c < 0, c == 0, c > 0) == (dpkg("lt"), dpkg("eq"), dpkg("gt"))


def test_relations_parse_groups_alternatives_versions_and_arch_qualifiers() -> None:
    assert debarchive.parse_relations("libc6 (>= 2.34), debconf (>= 0.5) | debconf-2.0, python3:any, x [amd64]") == [
        [("libc6", ">=", "2.34")], [("debconf", ">=", "0.5"), ("debconf-2.0", "", "")], [("python3", "", "")],
        [("x", "", "")]]
    assert debarchive.parse_relations("") == []
    with pytest.raises(ArchiveError):
        debarchive.parse_relations("Bad Name")


# --- the closure -----------------------------------------------------------------------------------


def test_closure_follows_depends_and_pre_depends_but_not_recommends() -> None:
    idx = index(pkg("app", Depends="liba", Pre_Depends="helper (>= 2)", Recommends="extra", Suggests="more"),
                pkg("liba", Depends="libb"), pkg("libb"), pkg("helper", "2.1"), pkg("extra"), pkg("more"))
    assert debarchive.closure(idx, ["app"], {}) == ["app", "helper", "liba", "libb"]


def test_closure_leaves_out_what_is_installed_unless_too_old() -> None:
    idx = index(pkg("app", Depends="libc6 (>= 2.34), adduser, init (>= 1.54~)"),
                pkg("libc6", "2.36-9"), pkg("adduser", "3.134"), pkg("init", "1.65.2"))
    assert debarchive.closure(idx, ["app"], {"libc6": "2.36-9", "adduser": "3.134", "init": "1.60"}) == ["app"]
    # an installed package older than the relation asks is upgraded from the archive: it is served
    assert debarchive.closure(idx, ["app"], {"libc6": "2.31-13", "adduser": "3.134", "init": "1.60"}) == ["app", "libc6"]


def test_closure_takes_the_first_alternative_it_can_satisfy() -> None:
    idx = index(pkg("app", Depends="gone | second | third, older (>= 3) | newer"),
                pkg("second"), pkg("third"), pkg("older", "2"), pkg("newer"))
    assert debarchive.closure(idx, ["app"], {}) == ["app", "newer", "second"]
    # an installed later alternative already satisfies the group: nothing added for it
    assert debarchive.closure(idx, ["app"], {"third": "1.0"}) == ["app", "newer"]


def test_closure_resolves_virtual_packages_through_providers() -> None:
    idx = index(pkg("app", Depends="debconf-2.0, mail-transport-agent"),
                pkg("debconf", Provides="debconf-2.0"), pkg("postfix", Provides="mail-transport-agent"),
                pkg("exim4", Provides="mail-transport-agent"))
    # debconf (installed) provides debconf-2.0; the MTA is one provider, chosen by name
    assert debarchive.closure(idx, ["app"], {"debconf": "1.0"}) == ["app", "exim4"]
    versioned = index(pkg("app", Depends="virt (>= 2)"), pkg("p1", Provides="virt"), pkg("p2", Provides="virt (= 2.5)"))
    assert debarchive.closure(versioned, ["app"], {}) == ["app", "p2"]


def test_closure_names_what_cannot_be_satisfied() -> None:
    with pytest.raises(ArchiveError, match="nothing in the archive satisfies"):
        debarchive.closure(index(pkg("app", Depends="missing | also-missing")), ["app"], {})
    with pytest.raises(ArchiveError, match="not in the archive"):
        debarchive.closure(index(pkg("app")), ["nope"], {})


def test_image_set_is_what_debootstrap_minbase_selects() -> None:
    idx = index(pkg("base-files", Priority="required", Depends="awk"), pkg("awk"),
                pkg("dpkg", Priority="required", Pre_Depends="tar"), pkg("tar"),
                pkg("apt", Priority="important", Depends="libapt, gpgv | gpgv2"), pkg("libapt"), pkg("gpgv"), pkg("gpgv2"),
                pkg("curl", Depends="virtual-only | libcurl"), pkg("libcurl"), pkg("vim", Priority="optional"),
                pkg("usr-is-merged", Priority="optional"), pkg("init", Priority="required", Depends="usrmerge | usr-is-merged"),
                pkg("usrmerge"), pkg("real-of-virtual", Provides="virtual-only"))
    got = debarchive.image_package_set(idx, ImageSpec(packages=("curl",), mirror="http://x/debian"))
    # required + usr-is-merged (bookworm) + apt + the includes; first alternatives only (gpgv, not gpgv2); a
    # virtual first alternative is dropped, as debootstrap's resolve_deps does; usrmerge is excluded
    assert sorted(got) == ["apt", "awk", "base-files", "curl", "dpkg", "gpgv", "init", "libapt", "tar", "usr-is-merged"]


def test_missing_in_image_names_unmet_relations() -> None:
    status = ("Package: libc6\nStatus: install ok installed\nVersion: 2.36-9\n\n"
              "Package: mawk\nStatus: install ok installed\nVersion: 1.3.4\nProvides: awk\n\n"
              "Package: gone\nStatus: deinstall ok config-files\nVersion: 1.0\n")
    deb = ArchiveDeb("app", "1.0", "amd64", "app", "pool/main/a/app/app_1.0_amd64.deb", "0" * 64, 1,
                     depends="libc6 (>= 2.34), awk, gone, lib2 (>= 2)", pre_depends="")
    lib2 = ArchiveDeb("lib2", "2.1", "amd64", "lib2", "pool/main/l/lib2/lib2_2.1_amd64.deb", "0" * 64, 1)
    assert debarchive.missing_in_image([deb, lib2], status) == ["app: gone"]
    assert debarchive.installed_from_status(status) == {"libc6": "2.36-9", "mawk": "1.3.4"}


# --- Debian bookworm's real index (fetched once into the test-bed cache) -------------------------


@pytest.fixture(scope="module")
def archive() -> DebianArchive:
    return DebianArchive()


@needs_apt
def test_universe_is_prometheus_and_what_it_needs_beyond_the_image(archive: DebianArchive) -> None:
    manifest = {d.name: d for d in archive.manifest()}
    assert set(debarchive.ROOTS) <= set(manifest)
    idx = archive.index()
    image = debarchive.image_package_set(idx, archive.spec)
    assert not set(manifest) & set(image), "nothing the image already has is served again"
    # Recommends are left out (node_exporter recommends dbus and the collectors package)
    assert "prometheus-node-exporter-collectors" not in manifest
    # installable on the image: every relation is met by the image or the manifest itself
    status = "\n".join(f"Package: {n}\nStatus: install ok installed\nVersion: {v}\n"
                       + (f"Provides: {idx.packages[n]['Provides']}\n" if "Provides" in idx.packages[n] else "")
                       for n, v in image.items())
    assert debarchive.missing_in_image(manifest.values(), status) == []
    for d in manifest.values():  # what is served is the index's (hashes included)
        assert (d.version, d.sha256) == (idx.packages[d.name]["Version"], idx.packages[d.name]["SHA256"])
        assert d.filename.startswith("pool/main/")


@needs_apt
def test_the_computed_image_set_is_the_built_image_s(archive: DebianArchive) -> None:
    spec = ImageSpec()
    status = cache_dir() / "images" / spec.key / "root/var/lib/dpkg/status"
    if not status.is_file():
        pytest.skip("no test-bed image built yet (python -m rigup_testbed.image; the e2e tests build it)")
    text = status.read_text()
    idx = archive.index()
    assert debarchive.image_package_set(idx, spec) == debarchive.installed_from_status(text)
    assert debarchive.missing_in_image(archive.manifest(), text) == []


@needs_apt
def test_downloads_are_cached_and_match_the_index(archive: DebianArchive) -> None:
    files = archive.debs()
    manifest = archive.manifest()
    assert [f.name for f in files] == [d.basename for d in manifest]
    assert all(f.parent == archive.debs_dir for f in files)
    before = {f: f.stat().st_mtime_ns for f in files}
    assert archive.debs() == files and {f: f.stat().st_mtime_ns for f in files} == before
    control = subprocess.run(["dpkg-deb", "-f", str(files[[d.name for d in manifest].index("prometheus")]),
                              "Package", "Version"], capture_output=True, text=True, check=True).stdout
    assert control == f"Package: prometheus\nVersion: {next(d.version for d in manifest if d.name == 'prometheus')}\n"


def test_an_unreachable_archive_fails_with_a_clear_message(tmp_path: Path) -> None:
    if shutil.which("apt-get") is None or not debarchive.KEYRING.is_file():
        pytest.skip("needs apt-get and debian-archive-keyring")
    bad = DebianArchive(tmp_path, ImageSpec(mirror="http://127.0.0.1:9/debian"))
    with pytest.raises(ArchiveError, match=r"cannot reach Debian's archive http://127.0.0.1:9/debian .*RIGUP_TESTBED_DEBIAN_MIRROR"):
        bad.manifest()


# --- real programs on the control machine ---------------------------------------------------------


@needs_apt
def test_promtool_is_bookworm_s_and_checks_the_packaged_config(archive: DebianArchive) -> None:
    promtool = debarchive.promtool()
    version = next(d.version for d in archive.manifest() if d.name == "prometheus")
    out = subprocess.run([str(promtool), "--version"], capture_output=True, text=True, check=True)
    upstream = version.split("+")[0]
    assert f"promtool, version {upstream}" in out.stdout + out.stderr
    assert promtool.is_relative_to(archive.base / "programs")
    config = promtool.parents[2] / "etc/prometheus/prometheus.yml"  # the package's own default config
    check = subprocess.run([str(promtool), "check", "config", str(config)], capture_output=True, text=True)
    assert check.returncode == 0 and "SUCCESS" in check.stdout + check.stderr, check.stdout + check.stderr
    assert debarchive.promtool() == promtool  # extracted once


@needs_apt
def test_prometheus_and_node_exporter_binaries_run_here() -> None:
    prom = subprocess.run([str(debarchive.prometheus()), "--version"], capture_output=True, text=True, check=True)
    assert "prometheus, version 2." in prom.stdout + prom.stderr
    ne = subprocess.run([str(debarchive.node_exporter()), "--version"], capture_output=True, text=True, check=True)
    assert "node_exporter, version 1." in ne.stdout + ne.stderr
