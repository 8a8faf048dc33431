"""Parsers on real captures (/work/shared/fixtures) and on captures written for rigup (tests/fixtures)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rigup.parsers.apt import AptPolicy, AptSource, parse_apt_cache_policy, parse_apt_source_files
from rigup.parsers.common import ParseError, split_lines
from rigup.parsers.docker import parse_docker_info
from rigup.parsers.dpkg import DriverPackage, driver_packages, package_branch, parse_dpkg_query, upstream_version
from rigup.parsers.gpu_models import known_gpu
from rigup.parsers.lspci import gpus_from_pci, parse_lspci
from rigup.parsers.nvidia_smi import GPU_QUERY_FIELDS, parse_gpu_query
from rigup.parsers.system import (
    LoadedModule,
    parse_dev_char,
    parse_df_sections,
    parse_nvidia_version_file,
    parse_os_release,
    parse_reboot_required,
    parse_sb_state,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
SHARED = Path("/work/shared/fixtures/nvidia-smi/ubuntu24.04-2xH200-580.159.04")
# The real capture's query: our field list without the trailing power.min_limit (its two power
# columns are 700.00 on an H200, where the current and the maximum limit are equal).
SHARED_FIELDS = GPU_QUERY_FIELDS[:10]


def fixture(rel: str) -> str:
    return (FIXTURES / rel).read_text()


needs_shared = pytest.mark.skipif(not SHARED.is_dir(), reason="shared captures not mounted")


@needs_shared
def test_real_h200_capture_parses_every_field():
    q = parse_gpu_query((SHARED / "query-gpu.csv").read_text(), SHARED_FIELDS)
    assert q.status == "ok"
    assert [g.index for g in q.gpus] == [0, 1]
    g0, g1 = q.gpus
    assert g0.name == "NVIDIA H200"
    assert g0.uuid == "GPU-6233fe39-51c5-7ad1-3573-49a321b0ef3a"
    assert g1.uuid == "GPU-e22d0e00-5ebd-9fbe-ec69-33d7d295396e"
    assert g0.driver_version == "580.159.04"
    assert g0.memory_mib == 143771
    assert g0.compute_capability == (9, 0)
    assert (g0.bus_id, g1.bus_id) == ("0000:00:06.0", "0000:00:07.0")
    assert g0.power_limit_w == 700.0 and g0.power_max_w == 700.0
    assert g0.persistence is True
    assert g0.power_min_w is None  # not in that query


@needs_shared
def test_real_capture_agrees_with_nvidia_smi_q():
    """The CSV and the -q capture of the same machine describe the same GPUs."""
    q = parse_gpu_query((SHARED / "query-gpu.csv").read_text(), SHARED_FIELDS)
    text = (SHARED / "nvidia-smi-q.txt").read_text()
    for gpu in q.gpus:
        assert f"GPU UUID                                           : {gpu.uuid}" in text
    assert "Driver Version                                         : 580.159.04" in text
    assert text.count("Product Name                                       : NVIDIA H200") == len(q.gpus)


@needs_shared
def test_real_capture_with_wrong_field_count_is_an_error():
    with pytest.raises(ParseError, match="expected 12 fields, got 10"):
        parse_gpu_query((SHARED / "query-gpu.csv").read_text())


def test_two_3090s_capped():
    q = parse_gpu_query(fixture("nvidia-smi/2x3090-580-capped.csv"))
    assert q.status == "ok" and len(q.gpus) == 2
    assert {g.name for g in q.gpus} == {"NVIDIA GeForce RTX 3090"}
    assert [g.bus_id for g in q.gpus] == ["0000:01:00.0", "0000:2d:00.0"]  # upper-case hex normalised
    assert all(g.power_limit_w == 230.0 and g.power_max_w == 350.0 and g.power_min_w == 100.0 for g in q.gpus)
    assert all(g.compute_capability == (8, 6) and g.memory_mib == 24576 for g in q.gpus)


def test_one_3090_old_driver():
    q = parse_gpu_query(fixture("nvidia-smi/1x3090-550.csv"))
    assert len(q.gpus) == 1
    assert q.gpus[0].driver_version == "550.120"
    assert q.gpus[0].persistence is False


@pytest.mark.parametrize(
    "name,status",
    [("no-driver.txt", "no-driver"), ("mismatch.txt", "mismatch"), ("no-devices.txt", "no-devices")],
)
def test_nvidia_smi_failures(name, status):
    q = parse_gpu_query(fixture(f"nvidia-smi/{name}"))
    assert q.status == status
    assert q.gpus == ()
    assert q.message


def test_mismatch_names_the_library_version():
    q = parse_gpu_query(fixture("nvidia-smi/mismatch.txt"))
    assert q.library_version == "580.95"


def test_not_supported_values_become_none():
    line = "0, NVIDIA GeForce RTX 3090, GPU-x, 580.95.05, 24576, 8.6, 00000000:01:00.0, [N/A], [Not Supported], [N/A], [N/A], [N/A]"
    g = parse_gpu_query(line).gpus[0]
    assert g.power_limit_w is None and g.power_max_w is None and g.persistence is None


def test_lspci_two_3090s_with_nouveau():
    devices = parse_lspci(fixture("lspci/2x3090-nouveau.txt"))
    assert len(devices) == 7
    gpus = gpus_from_pci(devices)
    assert [g.bus_id for g in gpus] == ["0000:01:00.0", "0000:2d:00.0"]  # audio functions excluded
    assert all(g.name == "NVIDIA GeForce RTX 3090" and g.source == "lspci" for g in gpus)
    assert all(g.compute_capability == (8, 6) and g.memory_mib == 24576 for g in gpus)
    vga = [d for d in devices if d.class_code == "0300"]
    assert {d.driver_in_use for d in vga} == {"nouveau"}


def test_lspci_without_k_and_3d_controllers():
    gpus = gpus_from_pci(parse_lspci(fixture("lspci/2xH200-no-k.txt")))
    assert len(gpus) == 2
    assert gpus[0].name == "NVIDIA H200" and gpus[0].compute_capability == (9, 0)


def test_lspci_unknown_card_keeps_its_bracket_name():
    line = "0000:05:00.0 VGA compatible controller [0300]: NVIDIA Corporation AD104 [GeForce RTX 4070 Ti] [10de:2782] (rev a1)"
    (gpu,) = gpus_from_pci(parse_lspci(line))
    assert gpu.name == "NVIDIA GeForce RTX 4070 Ti"
    assert gpu.compute_capability is None and gpu.memory_mib is None


def test_lspci_garbage_is_an_error():
    with pytest.raises(ParseError):
        parse_lspci("this is not lspci")


def test_known_gpu_by_name():
    assert known_gpu(name="GeForce RTX 3090").memory_mib == 24576  # type: ignore[union-attr]
    assert known_gpu(name="NVIDIA GeForce RTX 3090").compute_capability == (8, 6)  # type: ignore[union-attr]
    assert known_gpu(name="Radeon RX 7900") is None


def test_proc_version_open_and_proprietary():
    open_ = parse_nvidia_version_file(fixture("proc-nvidia-version/open-580.txt"))
    assert open_ == LoadedModule("580.95.05", "open", "gcc version 13.3.0 (Ubuntu 13.3.0-6ubuntu2~24.04)")
    assert open_.branch == 580
    prop = parse_nvidia_version_file(fixture("proc-nvidia-version/proprietary-550.txt"))
    assert (prop.version, prop.flavour) == ("550.120", "proprietary")  # type: ignore[union-attr]
    assert parse_nvidia_version_file("") is None


def test_proc_version_aarch64_open():
    line = "NVRM version: NVIDIA UNIX Open Kernel Module for aarch64  580.95.05  Release Build  (dvs-builder@x)  Tue"
    assert parse_nvidia_version_file(line).flavour == "open"  # type: ignore[union-attr]


def test_dpkg_held_580_open():
    pkgs = parse_dpkg_query(fixture("dpkg/580-open-held.txt"))
    byname = {p.name: p for p in pkgs}
    assert byname["libnvidia-compute-580"].held and byname["libnvidia-compute-580"].installed  # ":amd64" dropped
    assert not byname["nvidia-container-toolkit"].held
    (meta,) = driver_packages(pkgs)
    assert meta == DriverPackage("nvidia-driver-580-open", 580, "open", "ubuntu", "580.95.05", True)


def test_dpkg_550_with_removed_580_leftover():
    pkgs = parse_dpkg_query(fixture("dpkg/550-proprietary-held.txt"))
    metas = driver_packages(pkgs)
    # nvidia-driver-580-open is "rc" (config files only): not a driver that is installed
    assert [(m.name, m.branch, m.flavour) for m in metas] == [("nvidia-driver-550", 550, "proprietary")]
    assert metas[0].version == "550.120"


def test_dpkg_cuda_repo_metapackage():
    metas = driver_packages(parse_dpkg_query(fixture("dpkg/cuda-580-open.txt")))
    assert [(m.name, m.source) for m in metas] == [("nvidia-driver-580-open", "ubuntu"), ("nvidia-open-580", "cuda")]


def test_dpkg_fresh_has_no_driver():
    assert driver_packages(parse_dpkg_query(fixture("dpkg/fresh.txt"))) == ()


@pytest.mark.parametrize(
    "name,branch",
    [
        ("libnvidia-compute-580", 580),
        ("nvidia-firmware-580-580.95.05", 580),
        ("linux-modules-nvidia-550-open-6.8.0-45-generic", 550),
        ("cuda-drivers-580", 580),
        ("nvidia-container-toolkit", None),
        ("libnvidia-container1", None),
        ("nvidia-settings", None),
        ("linux-image-6.8.0-45-generic", None),
    ],
)
def test_package_branch(name, branch):
    assert package_branch(name) == branch


def test_upstream_version():
    assert upstream_version("580.95.05-0ubuntu1") == "580.95.05"
    assert upstream_version("1:580.95.05-1") == "580.95.05"
    assert upstream_version("580.95.05") == "580.95.05"


def test_apt_cache_policy():
    out = """linux-modules-nvidia-580-open-6.8.0-45-generic:
  Installed: (none)
  Candidate: 6.8.0-45.45+1
  Version table:
     6.8.0-45.45+1 500
        500 http://archive.ubuntu.com/ubuntu noble-updates/restricted amd64 Packages
linux-modules-nvidia-580-open-generic:
  Installed: 6.8.0-45.45+1
  Candidate: 6.8.0-45.45+1
  Version table:
 *** 6.8.0-45.45+1 500
"""
    pol = parse_apt_cache_policy(out)
    assert pol["linux-modules-nvidia-580-open-6.8.0-45-generic"] == AptPolicy(None, "6.8.0-45.45+1")
    assert pol["linux-modules-nvidia-580-open-generic"].installed == "6.8.0-45.45+1"


@pytest.mark.parametrize(
    "name,state",
    [
        ("enabled.txt", "enabled"),
        ("disabled-setup-mode.txt", "disabled"),
        ("bios.txt", "unsupported"),
        ("no-efivars.txt", "unsupported"),
    ],
)
def test_secure_boot(name, state):
    assert parse_sb_state(fixture(f"mokutil/{name}")) == state


def test_secure_boot_unknown_text_is_refused():
    with pytest.raises(ParseError, match="no known Secure Boot state"):
        parse_sb_state("mokutil: something odd")


def test_df_sections_on_two_filesystems():
    disk = parse_df_sections(fixture("df/split.txt"))
    assert disk["/opt/rigup"].existing == "/opt"
    assert disk["/opt/rigup"].mount == "/"
    assert disk["/opt/rigup"].avail_bytes == 353947340 * 1024
    assert disk["/opt/rigup/models"].mount == "/mnt/models"
    assert round(disk["/opt/rigup/models"].avail_gb, 1) == 24.6


def test_docker_info():
    with_nv = parse_docker_info(split_lines(fixture("docker-info/with-nvidia.json")))
    assert with_nv.running and with_nv.has_nvidia_runtime
    assert with_nv.runtimes == ("io.containerd.runc.v2", "nvidia", "runc")
    assert with_nv.cgroup_driver == "systemd"
    without = parse_docker_info(fixture("docker-info/without-nvidia.json"))
    assert without.running and not without.has_nvidia_runtime and without.root_dir == "/srv/docker"
    down = parse_docker_info(fixture("docker-info/daemon-down.txt"))
    assert not down.running and "Is the docker daemon running?" in down.errors[0]


def test_docker_info_stderr_after_json():
    out = '{"ServerVersion":"","Runtimes":null}\nCannot connect to the Docker daemon at unix:///var/run/docker.sock.'
    info = parse_docker_info(out)
    assert not info.running and info.errors == ("Cannot connect to the Docker daemon at unix:///var/run/docker.sock.",)


def test_apt_sources_one_line_and_deb822():
    entries = parse_apt_source_files(fixture("apt-sources/conflicting-docker.txt"))
    by_file: dict[str, list[AptSource]] = {}
    for e in entries:
        by_file.setdefault(e.file, []).append(e)
    main = by_file["/etc/apt/sources.list"]
    assert [e.line for e in main] == [2, 3]
    assert main[1].uris == ("https://download.docker.com/linux/ubuntu",) and main[1].signed_by is None
    assert main[1].suites == ("noble",) and main[1].components == ("stable",)  # trailing comment dropped
    (docker_list,) = by_file["/etc/apt/sources.list.d/docker.list"]
    assert docker_list.signed_by == "/etc/apt/keyrings/docker.asc" and docker_list.options["arch"] == "amd64"
    (ctk,) = by_file["/etc/apt/sources.list.d/nvidia-container-toolkit.list"]  # commented line ignored
    assert ctk.uris == ("https://nvidia.github.io/libnvidia-container/stable/deb/$(ARCH)",) and ctk.suites == ("/",)
    ubuntu = by_file["/etc/apt/sources.list.d/ubuntu.sources"]
    assert [e.line for e in ubuntu] == [1, 7] and ubuntu[0].stanzas_in_file == 2
    assert ubuntu[0].suites == ("noble", "noble-updates", "noble-backports")
    (d822,) = by_file["/etc/apt/sources.list.d/docker.sources"]
    assert d822.format == "deb822" and d822.line == 2 and d822.signed_by == "/etc/apt/keyrings/docker.asc"


def test_deb822_enabled_field_and_inline_key():
    text = """==> /etc/apt/sources.list.d/x.sources
Types: deb
URIs: https://example.org/repo
Suites: /
Enabled: yes
Signed-By:
 -----BEGIN PGP PUBLIC KEY BLOCK-----
 .
 abc
 -----END PGP PUBLIC KEY BLOCK-----
"""
    (e,) = parse_apt_source_files(text)
    assert e.enabled and e.enabled_line == 4
    assert e.signed_by is not None and e.signed_by.startswith("\n-----BEGIN PGP")
    (off,) = parse_apt_source_files(text.replace("Enabled: yes", "Enabled: no"))
    assert not off.enabled


def test_bad_source_line_is_an_error():
    with pytest.raises(ParseError, match="x.list:1"):
        parse_apt_source_files("==> /etc/apt/sources.list.d/x.list\nnonsense here\n")


def test_dev_char_missing_links():
    state = parse_dev_char(fixture("dev-char/partial.txt"))
    assert state.devices["/dev/nvidia-uvm"] == "511:0"
    assert state.missing == ("/dev/nvidia-uvm", "/dev/nvidia1")


def test_os_release():
    u = parse_os_release(fixture("os-release/ubuntu-24.04.txt"))
    assert (u.key, u.codename, u.cuda_repo_distro) == ("ubuntu 24.04", "noble", "ubuntu2404")
    d = parse_os_release(fixture("os-release/debian-12.txt"))
    assert (d.key, d.codename, d.cuda_repo_distro) == ("debian 12", "bookworm", "debian12")


def test_reboot_required():
    r = parse_reboot_required(["reboot-required", "pkg linux-image-6.8.0-50-generic", "pkg linux-base"])
    assert r.required and r.packages == ("linux-image-6.8.0-50-generic", "linux-base")
    assert not parse_reboot_required([]).required


def test_dataclasses_serialise_for_pyinfra_cli():
    q = parse_gpu_query(fixture("nvidia-smi/2x3090-580-capped.csv"))
    data = q.to_json()
    assert data["status"] == "ok" and data["gpus"][1]["bus_id"] == "0000:2d:00.0"


def test_memory_used_rows_for_the_vram_margin() -> None:
    from rigup.parsers.nvidia_smi import parse_memory_used

    assert parse_memory_used("0, 23456, 24576\n1, 120, 24576\n") == [(23456, 24576), (120, 24576)]
    assert parse_memory_used("No devices were found\n") == []  # the caller says nvidia-smi printed no rows
