"""Preflight checks, table-tested on host situations built from the captures."""

from __future__ import annotations

import dataclasses

import pytest

from rigup.checks.preflight import Check, failures, run_checks
from rigup.desired.recipe import resolve
from rigup.parsers.docker import parse_docker_info
from rigup.parsers.lspci import parse_lspci
from rigup.parsers.nvidia_smi import parse_gpu_query
from rigup.parsers.system import PendingReboot, parse_os_release
from tests.support.hostlayer import GB, converged_2x3090, disk, fresh_2x3090, fx, host_data, one_3090_on_550, prebuilt


def failing(facts, **data) -> dict[str, Check]:
    hd = host_data(**data)
    checks = run_checks(facts, resolve(hd), hd)
    return {c.name: c for c in failures(checks)}


CASES = [
    # (id, facts, host data changes, names of the checks that must fail)
    ("fresh-ubuntu-2x3090", fresh_2x3090(), {}, set()),
    ("converged", converged_2x3090(), {}, set()),
    ("debian-not-allowed", fresh_2x3090(os=parse_os_release(fx("os-release/debian-12.txt"))), {}, {"os"}),
    (
        "debian-allowed-on-test-bed",
        fresh_2x3090(os=parse_os_release(fx("os-release/debian-12.txt"))),
        {"preflight_os_allowed": ["debian 12"]},
        set(),
    ),
    ("one-gpu-for-tp2", one_3090_on_550(), {}, {"gpu-layout"}),
    ("gpu-count-knob-differs", fresh_2x3090(), {"gpu_count": 4}, {"gpu-count"}),
    ("disk-too-small", fresh_2x3090(disk=disk(40)), {}, {"disk"}),
    ("disk-margin", fresh_2x3090(disk=disk(55)), {"preflight_disk_margin_gb": 10}, {"disk"}),
    ("secure-boot-cuda-path", fresh_2x3090(secure_boot="enabled"), {"nvidia_driver_source": "cuda"}, {"secure-boot"}),
    ("secure-boot-no-signed-modules", fresh_2x3090(secure_boot="enabled", prebuilt=prebuilt(False)), {}, {"secure-boot"}),
    ("secure-boot-signed-modules", fresh_2x3090(secure_boot="enabled"), {}, set()),
    ("secure-boot-driver-already-fine", converged_2x3090(secure_boot="enabled", prebuilt=prebuilt(False)), {}, set()),
    ("snap-docker", fresh_2x3090(docker_snap=True), {}, {"docker-snap"}),
    ("power-cap-above-max", converged_2x3090(), {"gpu_power_cap_watts": 400}, {"power-cap"}),
    ("branch-too-old-for-image", fresh_2x3090(), {"nvidia_driver_branch": 550}, {"driver-cuda"}),
    ("bad-reboot-policy", fresh_2x3090(), {"driver_reboot": "sometimes"}, {"driver-reboot"}),
    ("bad-flavour", fresh_2x3090(), {"nvidia_driver_flavour": "closed"}, {"driver"}),
]


@pytest.mark.parametrize("facts,data,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_failing_checks(facts, data, expected):
    assert set(failing(facts, **data)) == expected


def test_messages_name_key_and_fix():
    (check,) = failing(one_3090_on_550()).values()
    assert check.key == "variant"
    assert "runs tensor parallel 2" in check.message and "this host has 1 GPU(s)" in check.message
    assert check.fix and check.fix.startswith("use tensor parallel 1: variant single")
    assert check.describe("rig-07").startswith("rig-07: gpu-layout: variant 'dual' runs tensor parallel 2")
    assert "[key: variant]" in check.describe("rig-07")


def test_pre_turing_card_with_open_modules():
    pascal = parse_lspci(
        "0000:01:00.0 VGA compatible controller [0300]: NVIDIA Corporation GP102 [GeForce GTX 1080 Ti] [10de:1b06] (rev a1)\n"
        "0000:02:00.0 VGA compatible controller [0300]: NVIDIA Corporation GP102 [GeForce GTX 1080 Ti] [10de:1b06] (rev a1)\n"
    )
    bad = failing(fresh_2x3090(pci=pascal))
    assert set(bad) == {"open-modules", "compute-capability", "vram-fit"}  # 11264 MiB: every board of 10de:1b06
    assert bad["open-modules"].fix == "set nvidia_driver_flavour: proprietary"
    assert "6.1" in bad["compute-capability"].message


def test_vram_misfit_warn_only_warns():
    pascal = parse_lspci(
        "0000:01:00.0 VGA compatible controller [0300]: NVIDIA Corporation GP102 [GeForce GTX 1080 Ti] [10de:1b06] (rev a1)\n"
        "0000:02:00.0 VGA compatible controller [0300]: NVIDIA Corporation GP102 [GeForce GTX 1080 Ti] [10de:1b06] (rev a1)\n"
    )
    data = {"nvidia_driver_flavour": "proprietary", "variant_overrides": {}}
    bad = failing(fresh_2x3090(pci=pascal), **data)
    assert set(bad) == {"compute-capability", "vram-fit"}
    assert bad["vram-fit"].message.startswith("no driver yet, memory from the PCI ids: variant 'dual'")
    assert set(failing(fresh_2x3090(pci=pascal), preflight_vram_misfit="warn", **data)) == {"compute-capability"}


def test_disk_counts_what_is_already_there():
    hd = host_data()
    recipe = resolve(hd)
    have = {m.path: int(m.approx_size_gb * GB) for m in recipe.models}
    have |= {s.path: int(s.approx_size_gb * GB) for s in recipe.sources}
    have[recipe.image.ref] = int(recipe.image.approx_size_gb * GB)
    tight = converged_2x3090(disk=disk(12), present_bytes=have)
    assert failing(tight) == {}  # only the margin is needed on a converged rig
    assert set(failing(converged_2x3090(disk=disk(12)))) == {"disk"}


def test_disk_split_filesystems_are_checked_separately():
    split = {
        **disk(300, mount="/", paths=("/opt/rigup", "/var/lib/docker")),
        **disk(20, mount="/mnt/models", filesystem="/dev/sda1", paths=("/opt/rigup/models",)),
    }
    bad = failing(fresh_2x3090(disk=split))
    assert set(bad) == {"disk"}
    assert bad["disk"].message.startswith("/mnt/models has 20.0 GB free; needs 27.5 GB")


def test_docker_root_dir_from_docker_info():
    info = parse_docker_info(fx("docker-info/without-nvidia.json"))  # DockerRootDir /srv/docker
    split = {
        **disk(300, paths=("/opt/rigup", "/opt/rigup/models")),
        **disk(5, mount="/srv", filesystem="/dev/sdb1", paths=("/srv/docker",)),
    }
    bad = failing(fresh_2x3090(docker=info, disk=split))
    assert "image vllm/vllm-openai 30.0 GB" in bad["disk"].message


def test_mismatch_uses_lspci_and_plans_a_reboot():
    facts = converged_2x3090(smi=parse_gpu_query(fx("nvidia-smi/mismatch.txt")), loaded=None)
    hd = host_data()
    checks = {c.name: c for c in run_checks(facts, resolve(hd), hd)}
    assert checks["gpus"].ok and "via lspci" in checks["gpus"].message
    assert checks["driver"].severity == "warning" and checks["driver"].message.startswith("will reboot")
    assert not failures(list(checks.values()))


def test_unknown_recipe_is_a_failed_check():
    hd = host_data(variant="nope")
    checks = run_checks(fresh_2x3090(), None, hd, "RecipeError: unknown variant 'nope'")
    assert {c.name for c in failures(checks)} == {"recipe"}


def test_no_gpus_and_no_lspci():
    bad = failing(fresh_2x3090(pci=None))
    assert "lspci is not installed" in bad["gpus"].message and bad["gpus"].fix == "apt-get install pciutils (or load the driver)"


def test_pending_kernel_reboot_is_a_warning():
    facts = fresh_2x3090(pending_reboot=PendingReboot(True, ("linux-image-6.8.0-50-generic",)))
    hd = host_data()
    checks = {c.name: c for c in run_checks(facts, resolve(hd), hd)}
    assert checks["pending-reboot"].severity == "warning" and not checks["pending-reboot"].ok
    assert not failures(list(checks.values()))


def test_check_json():
    (check,) = failing(fresh_2x3090(docker_snap=True)).values()
    assert check.to_json() == dataclasses.asdict(check)
