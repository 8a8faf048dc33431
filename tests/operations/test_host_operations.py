"""rigup.operations (host layer) with scripted facts: the commands each situation yields, the no-op text
when converged, and what the FunctionCommands they yield decide."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import gevent
import pytest
from pyinfra.api import FunctionCommand
from pyinfra.facts.systemd import SystemdStatus

import rigup.operations.driver as driver_ops
from rigup.desired.catalog import rigup_container_names
from rigup.desired.image_mirror import image_ref
from rigup.desired.knobs import load_defaults
from rigup.facts.apt import AptPolicies, AptSourceEntries
from rigup.facts.docker import DockerDaemonJson, DockerEngineInfo, DockerImage, DockerSnap
from rigup.facts.driver import NvidiaDevChar, NvidiaKernelModule, NvidiaPackages, PrebuiltNvidiaModules
from rigup.facts.gpu import DriverCudaVersion, GpuMemoryUse, GpuTopology, NvidiaGpus, PciGpus
from rigup.facts.network import HttpsTrust
from rigup.facts.serving import RigupVariantUnits
from rigup.facts.system import FreeDisk, HostCapabilities, OsReleaseInfo, PathSizes, RebootPending, SecureBoot
from rigup.operations.apt import apt_source_exclusive, conflicting_entries
from rigup.operations.docker import docker_daemon_config, docker_nvidia_runtime, merged_daemon_config
from rigup.operations.driver import nvidia_driver, nvidia_driver_hold, reboot_and_wait
from rigup.operations.gpu import gpu_power_state, gpu_smoke_test, nvidia_dev_char_links
from rigup.operations.preflight import fleet_value, preflight_after_driver, preflight_checks, preflight_report
from rigup.parsers.apt import AptPolicy, parse_apt_source_files
from rigup.parsers.common import ParseError
from rigup.parsers.curl import TlsProbe
from rigup.parsers.docker import parse_daemon_json, parse_docker_info
from rigup.parsers.dpkg import DebPackage, parse_dpkg_query
from rigup.parsers.lspci import parse_lspci
from rigup.parsers.nvidia_smi import parse_gpu_query
from rigup.parsers.system import (
    DevCharState,
    LoadedModule,
    parse_capabilities,
    parse_dev_char,
    parse_nvidia_version_file,
)
from tests.support.fit_fake import offline_lock
from tests.support.hostlayer import GB, converged_2x3090, disk, fresh_2x3090, fx, one_3090_on_550
from tests.support.opharness import ScriptedHost, call_function, judge_preflight, raw_commands, run_op

DPKG = "DEBIAN_FRONTEND=noninteractive apt-get -y -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold"
DRIVER_ARGS = dict(branch=580, flavour="open", source="ubuntu", stop_units=["rigup-dual.service"])
REBOOT = [
    ("function", "capture"),
    "( sleep 1 && systemctl reboot ) </dev/null >/dev/null 2>&1 &",
    ("function", "wait"),
]


def pkgs(name: str) -> tuple[DebPackage, ...]:
    return parse_dpkg_query(fx(f"dpkg/{name}"))


def module(name: str) -> LoadedModule | None:
    return parse_nvidia_version_file(fx(f"proc-nvidia-version/{name}"))


def policy(candidate: str | None = "580.95.05-0ubuntu1"):
    return lambda packages: {p: AptPolicy(None, candidate) for p in packages}


def driver_host(packages="fresh.txt", loaded=None, serving=False, candidate="580.95.05-0ubuntu1") -> ScriptedHost:
    return ScriptedHost(
        {
            NvidiaPackages: pkgs(packages),
            NvidiaKernelModule: module(loaded) if loaded else None,
            SystemdStatus: lambda services: {s: serving for s in services},
            AptPolicies: policy(candidate),
        }
    )


# -- nvidia_driver ----------------------------------------------------------------------------


def test_driver_converged_is_a_noop():
    host = driver_host("580-open-held.txt", "open-580.txt")
    assert run_op(nvidia_driver, host, **DRIVER_ARGS) == []
    assert host.noops == ["nvidia-driver-580-open 580.95.05 installed and loaded"]


def test_driver_fresh_install_reboots_and_verifies():
    host = driver_host()
    cmds = run_op(nvidia_driver, host, packages=["nvidia-driver-580-open", "linux-modules-nvidia-580-open-generic"], **DRIVER_ARGS)
    assert cmds == [
        f"{DPKG} install nvidia-driver-580-open linux-modules-nvidia-580-open-generic",
        *REBOOT,
        ("function", "_verify_driver"),
    ]


def test_driver_refreshes_lists_when_apt_does_not_know_the_package():
    cmds = run_op(nvidia_driver, driver_host(candidate=None), **DRIVER_ARGS)
    assert cmds[:2] == ["DEBIAN_FRONTEND=noninteractive apt-get update", f"{DPKG} install nvidia-driver-580-open"]


def test_driver_upgrade_from_held_550_stops_serving_first():
    host = driver_host("550-proprietary-held.txt", "proprietary-550.txt", serving=True)
    cmds = run_op(nvidia_driver, host, **DRIVER_ARGS)
    assert cmds[:3] == [
        "systemctl stop rigup-dual.service",
        "apt-mark unhold libnvidia-compute-550 nvidia-dkms-550 nvidia-driver-550 nvidia-kernel-common-550",
        f"{DPKG} install nvidia-driver-580-open libnvidia-compute-550- nvidia-dkms-550- nvidia-driver-550- "
        "nvidia-kernel-common-550- nvidia-utils-550-",
    ]
    assert cmds[3:] == [*REBOOT, ("function", "_verify_driver")]


def test_driver_never_policy_installs_and_reports():
    cmds = run_op(nvidia_driver, driver_host(serving=True), reboot=False, **DRIVER_ARGS)
    assert cmds == [
        "systemctl stop rigup-dual.service",
        f"{DPKG} install nvidia-driver-580-open",
        ("function", "_report_reboot_required"),
    ]


def test_driver_never_policy_pending_reboot_only_reports():
    """Installed but not loaded, reboot not allowed: nothing is stopped, the report repeats every run."""
    host = driver_host("580-open-held.txt", "proprietary-550.txt", serving=True)
    cmds = raw_commands(nvidia_driver, host, reboot=False, **DRIVER_ARGS)
    assert [c.function.__name__ for c in cmds] == ["_report_reboot_required"]
    assert call_function(cmds[0], host) is True
    assert "REBOOT REQUIRED" in host.logs[0] and "loaded 550.120 (proprietary)" in host.logs[0]


def test_driver_pending_reboot_auto_stops_and_reboots():
    cmds = run_op(nvidia_driver, driver_host("580-open-held.txt", None, serving=True), **DRIVER_ARGS)
    assert cmds == ["systemctl stop rigup-dual.service", *REBOOT, ("function", "_verify_driver")]


def test_driver_cuda_source_metapackage():
    cmds = run_op(nvidia_driver, driver_host(), branch=580, flavour="proprietary", source="cuda", reboot=False)
    assert cmds[0] == f"{DPKG} install cuda-drivers-580"


def test_driver_bad_flavour_is_an_argument_error():
    with pytest.raises(Exception, match="flavour must be one of"):
        run_op(nvidia_driver, driver_host(), branch=580, flavour="closed")


def verify_command() -> FunctionCommand:
    cmds = raw_commands(nvidia_driver, driver_host(), **DRIVER_ARGS)
    return cmds[-1]


def test_verify_after_reboot_passes_when_the_module_matches():
    after = ScriptedHost(
        {
            NvidiaPackages: pkgs("580-open-held.txt"),
            NvidiaKernelModule: module("open-580.txt"),
            NvidiaGpus: parse_gpu_query(fx("nvidia-smi/2x3090-580-capped.csv")),
        }
    )
    assert call_function(verify_command(), after) is True
    assert "driver 580.95.05 (open) loaded; nvidia-smi sees 2 GPU(s)" in after.logs[0]


def test_verify_after_reboot_fails_the_host_on_old_module():
    after = ScriptedHost({NvidiaPackages: pkgs("580-open-held.txt"), NvidiaKernelModule: module("proprietary-550.txt")})
    assert call_function(verify_command(), after) is False
    assert after.logs[0] == "NVIDIA driver check after the reboot failed"


def test_verify_after_reboot_fails_when_nvidia_smi_fails():
    after = ScriptedHost(
        {
            NvidiaPackages: pkgs("580-open-held.txt"),
            NvidiaKernelModule: module("open-580.txt"),
            NvidiaGpus: parse_gpu_query(fx("nvidia-smi/no-devices.txt")),
        }
    )
    assert call_function(verify_command(), after) is False


class RebootingHost(ScriptedHost):
    """Answers boot_id reads: the old id until `boots_after` reads, then a new one."""

    def __init__(self, boots_after: int):
        super().__init__({})
        self.reads = 0
        self.boots_after = boots_after
        self.connected = False

    def run_shell_command(self, command, **_):
        self.reads += 1
        boot = "old-boot" if self.reads <= self.boots_after else "new-boot"
        return True, P_output([boot])

    def connect(self, **_):
        self.connected = True

    def disconnect(self):
        self.connected = False

    connector_data: dict = {}


class P_output:
    def __init__(self, lines):
        self.stdout_lines = lines


def test_reboot_waits_for_a_new_boot_id(monkeypatch):
    monkeypatch.setattr(driver_ops, "remove_any_sudo_askpass_file", lambda h: None)
    monkeypatch.setattr(driver_ops, "clear_askpass_cache", lambda h: None)
    monkeypatch.setattr(gevent, "sleep", lambda s: None)
    capture, _, wait = list(reboot_and_wait(reboot_timeout=60))
    host = RebootingHost(boots_after=3)
    assert call_function(capture, host) is True
    assert call_function(wait, host) is True
    assert host.reads == 4  # capture + two reads of the old id while rebooting + the new one


def test_reboot_times_out(monkeypatch):
    monkeypatch.setattr(driver_ops, "remove_any_sudo_askpass_file", lambda h: None)
    monkeypatch.setattr(driver_ops, "clear_askpass_cache", lambda h: None)
    monkeypatch.setattr(gevent, "sleep", lambda s: None)
    capture, _, wait = list(reboot_and_wait(reboot_timeout=0))
    host = RebootingHost(boots_after=10**6)
    call_function(capture, host)
    assert call_function(wait, host) is False
    assert host.logs == ["did not come back within 0s after the reboot"]


# -- nvidia_driver_hold -----------------------------------------------------------------------


def hold_host(packages: tuple[DebPackage, ...], loaded: str | None = "open-580.txt") -> ScriptedHost:
    return ScriptedHost({NvidiaPackages: packages, NvidiaKernelModule: module(loaded) if loaded else None})


def test_hold_noop_when_all_held():
    host = hold_host(pkgs("580-open-held.txt"))
    assert run_op(nvidia_driver_hold, host, branch=580) == []
    assert host.noops == ["7 packages of driver branch 580 are held"]


def test_hold_the_unheld_packages_of_the_branch():
    unheld = tuple(
        DebPackage(p.name, p.version, "install", p.status) if p.name.startswith("nvidia-utils") else p
        for p in pkgs("580-open-held.txt")
    )
    assert run_op(nvidia_driver_hold, hold_host(unheld), branch=580) == ["apt-mark hold nvidia-utils-580"]


def test_hold_before_install_names_the_wanted_packages():
    assert run_op(nvidia_driver_hold, hold_host(pkgs("fresh.txt"), None), branch=580) == [
        "apt-mark hold nvidia-driver-580-open"
    ]


# -- apt_source_exclusive ---------------------------------------------------------------------


def sources_host(text: str) -> ScriptedHost:
    return ScriptedHost({AptSourceEntries: parse_apt_source_files(text)})


def test_conflicting_docker_entries_are_disabled_in_place():
    host = sources_host(fx("apt-sources/conflicting-docker.txt"))
    cmds = run_op(
        apt_source_exclusive,
        host,
        uri="https://download.docker.com/linux/ubuntu",
        keep="/etc/apt/sources.list.d/rigup-docker.list",
    )
    note = "# disabled by rigup (duplicate of /etc/apt/sources.list.d/rigup-docker.list): "
    assert cmds == [
        f"sed -i -e '3s|^|{note}|' /etc/apt/sources.list",
        f"sed -i -e '1s|^|{note}|' /etc/apt/sources.list.d/docker.list",
        "sed -i -e '2i Enabled: no' /etc/apt/sources.list.d/docker.sources",
    ]


def test_toolkit_entry_matches_with_arch_expanded():
    host = sources_host(fx("apt-sources/conflicting-docker.txt"))
    cmds = run_op(
        apt_source_exclusive,
        host,
        uri="https://nvidia.github.io/libnvidia-container/stable/deb/$(ARCH)",
        keep="/etc/apt/sources.list.d/rigup-nvidia-container-toolkit.list",
    )
    assert cmds == [
        "sed -i -e '1s|^|# disabled by rigup (duplicate of /etc/apt/sources.list.d/rigup-nvidia-container-toolkit.list): |' "
        "/etc/apt/sources.list.d/nvidia-container-toolkit.list"
    ]


def test_explicit_enabled_field_is_rewritten():
    text = "==> /etc/apt/sources.list.d/d.sources\nTypes: deb\nURIs: https://download.docker.com/linux/ubuntu\nSuites: noble\nComponents: stable\nEnabled: yes\n"
    cmds = run_op(apt_source_exclusive, sources_host(text), uri="https://download.docker.com/linux/ubuntu/", keep="/x")
    assert cmds == ["sed -i -e '5s|.*|Enabled: no|' /etc/apt/sources.list.d/d.sources"]


def test_no_conflict_is_a_noop():
    host = sources_host("==> /etc/apt/sources.list.d/rigup-docker.list\ndeb [signed-by=/k] https://download.docker.com/linux/ubuntu noble stable\n")
    assert run_op(apt_source_exclusive, host, uri="https://download.docker.com/linux/ubuntu", keep="/etc/apt/sources.list.d/rigup-docker.list") == []
    assert host.noops == ["no other apt source entry points at https://download.docker.com/linux/ubuntu"]


def test_sed_edits_really_disable_the_entries(tmp_path: Path):
    """Run the generated sed commands on copies of the files, then parse them again."""
    root = tmp_path
    text = fx("apt-sources/conflicting-docker.txt")
    files: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("==> "):
            current = line[4:]
            files[current] = []
        elif current:
            files[current].append(line)
    for path, lines in files.items():
        target = root / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text("\n".join(lines) + "\n")
    keep = "/etc/apt/sources.list.d/rigup-docker.list"
    cmds = run_op(apt_source_exclusive, sources_host(text), uri="https://download.docker.com/linux/ubuntu", keep=keep)
    for cmd in cmds:
        path = cmd.rsplit(" ", 1)[1]
        subprocess.run(["sh", "-c", cmd.replace(path, str(root / path.lstrip("/")))], check=True)
    dump = "".join(f"==> {p}\n" + (root / p.lstrip("/")).read_text() for p in files)
    again = parse_apt_source_files(dump)
    left = conflicting_entries(again, "https://download.docker.com/linux/ubuntu", keep, "amd64")
    assert left == []
    assert any(e.file == keep and e.enabled for e in again)  # ours untouched
    ubuntu = [e for e in again if e.file.endswith("ubuntu.sources")]
    assert len(ubuntu) == 2 and all(e.enabled for e in ubuntu)  # unrelated entries untouched


# -- Docker runtime, /dev/char, power, smoke --------------------------------------------------


def test_runtime_configured_only_when_missing():
    with_nv = ScriptedHost({DockerEngineInfo: parse_docker_info(fx("docker-info/with-nvidia.json"))})
    assert run_op(docker_nvidia_runtime, with_nv) == []
    assert with_nv.noops == ["docker already lists the nvidia runtime"]
    without = ScriptedHost({DockerEngineInfo: parse_docker_info(fx("docker-info/without-nvidia.json"))})
    assert run_op(docker_nvidia_runtime, without) == ["nvidia-ctk runtime configure --runtime=docker"]
    not_installed = ScriptedHost({DockerEngineInfo: None})
    assert run_op(docker_nvidia_runtime, not_installed) == ["nvidia-ctk runtime configure --runtime=docker"]


def test_dev_char_links():
    partial = ScriptedHost({NvidiaDevChar: parse_dev_char(fx("dev-char/partial.txt"))})
    assert run_op(nvidia_dev_char_links, partial) == ["nvidia-ctk system create-dev-char-symlinks --create-all"]
    complete = ScriptedHost({NvidiaDevChar: DevCharState({"/dev/nvidia0": "195:0"}, {"195:0": "/dev/nvidia0"})})
    assert run_op(nvidia_dev_char_links, complete) == []
    assert complete.noops == ["/dev/char links exist for 1 NVIDIA devices"]
    none = ScriptedHost({NvidiaDevChar: DevCharState({}, {})})
    assert run_op(nvidia_dev_char_links, none) == []


def test_power_state_noop_when_applied():
    host = ScriptedHost({NvidiaGpus: parse_gpu_query(fx("nvidia-smi/2x3090-580-capped.csv"))})
    assert run_op(gpu_power_state, host, unit="rigup-gpu-power.service", power_cap_watts=230) == []
    assert host.noops == ["2 GPU(s) at the wanted power limit and persistence mode"]


def test_power_state_restarts_on_drift_and_verifies():
    drifted = ScriptedHost({NvidiaGpus: parse_gpu_query(fx("nvidia-smi/2x3090-580-default-power.csv"))})
    cmds = raw_commands(gpu_power_state, drifted, unit="rigup-gpu-power.service", power_cap_watts=230)
    assert [str(c) if not isinstance(c, FunctionCommand) else c.function.__name__ for c in cmds] == [
        "systemctl restart rigup-gpu-power.service",
        "_verify_power",
    ]
    # still at the default after the restart: the host fails with the drift listed
    assert call_function(cmds[1], drifted) is False
    assert drifted.logs[0] == "GPU settings did not apply"
    assert "  GPU 0 power limit 350.0 W != 230 W" in drifted.logs and "  GPU 1 persistence mode off" in drifted.logs


def test_power_state_changed_cap_is_drift():
    host = ScriptedHost({NvidiaGpus: parse_gpu_query(fx("nvidia-smi/2x3090-580-capped.csv"))})
    assert run_op(gpu_power_state, host, unit="u.service", power_cap_watts=250)[0] == "systemctl restart u.service"


def test_power_state_without_driver_waits_for_boot():
    host = ScriptedHost({NvidiaGpus: parse_gpu_query(fx("nvidia-smi/no-driver.txt"))})
    assert run_op(gpu_power_state, host, unit="u.service", power_cap_watts=230) == []
    assert "applies the settings at boot" in host.noops[0]


@pytest.mark.parametrize("host_gpus,container_gpus,ok", [(2, 2, True), (2, 1, False), (0, 0, False)])
def test_smoke_script(tmp_path: Path, host_gpus: int, container_gpus: int, ok: bool):
    """Run the generated script with stand-in nvidia-smi and docker executables."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    lines = lambda n: "".join(f"echo 'GPU {i}: NVIDIA GeForce RTX 3090 (UUID: GPU-{i})'\n" for i in range(n))  # noqa: E731
    (bindir / "nvidia-smi").write_text("#!/bin/sh\n" + lines(host_gpus))
    (bindir / "docker").write_text(
        "#!/bin/sh\n"
        '[ "$1 $2 $3 $4" = "run --rm --gpus all" ] || exit 9\n'
        '[ "$5" = "docker.io/nvidia/cuda:12.6.0-base-ubuntu22.04" ] || exit 8\n' + lines(container_gpus)
    )
    for f in bindir.iterdir():
        f.chmod(0o755)
    (cmd,) = run_op(gpu_smoke_test, ScriptedHost({}), image="docker.io/nvidia/cuda:12.6.0-base-ubuntu22.04")
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}"}
    result = subprocess.run(["sh", "-c", cmd], env=env, capture_output=True, text=True)
    assert (result.returncode == 0) is ok, result.stderr
    if not ok:
        assert f"the container sees {container_gpus} GPU(s), the host has {host_gpus}" in result.stderr


def test_image_ref():
    assert image_ref("docker.io", "nvidia/cuda:12.6.0-base-ubuntu22.04") == "docker.io/nvidia/cuda:12.6.0-base-ubuntu22.04"
    assert image_ref("10.77.0.1:5000/", "nvidia/cuda:x") == "10.77.0.1:5000/nvidia/cuda:x"
    assert image_ref("docker.io", "ghcr.io/org/img:1") == "ghcr.io/org/img:1"


# -- preflight_checks -------------------------------------------------------------------------


def preflight_host(facts, lock_dir: Path | None = None, **data) -> ScriptedHost:
    """A host answering with `facts`; with `lock_dir`, a lock file there pins its variant."""
    values = load_defaults()
    values.update(data)
    if lock_dir is not None:
        values["lock_file"] = str(offline_lock(values, lock_dir / "rigs.lock.yaml"))
    else:
        values["lock_file"] = "/nonexistent/rigs.lock.yaml"
    scripted = {
        HostCapabilities: lambda _sudo: parse_capabilities(fx("capabilities/booted-sudo-user.txt")),
        OsReleaseInfo: facts.os,
        NvidiaGpus: facts.smi,
        PciGpus: facts.pci,
        NvidiaKernelModule: facts.loaded,
        NvidiaPackages: facts.packages,
        SecureBoot: facts.secure_boot,
        PrebuiltNvidiaModules: lambda branch_flavour: facts.prebuilt,
        DockerEngineInfo: facts.docker,
        DockerSnap: facts.docker_snap,
        RebootPending: facts.pending_reboot,
        FreeDisk: lambda paths: {p: facts.disk[p] for p in paths},
        PathSizes: lambda paths: {p: 0 for p in paths},
        DockerImage: lambda ref: None,
        GpuMemoryUse: lambda container_names: facts.gpu_memory,
        DriverCudaVersion: facts.driver_cuda,
        GpuTopology: facts.topology,
        RigupVariantUnits: lambda install_root: {},
        HttpsTrust: lambda origins: {o: TlsProbe(o, 0) for o in origins},  # every server trusted
    }
    return ScriptedHost(scripted, values, name="rig-07")


def test_preflight_passes_quietly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    host = preflight_host(converged_2x3090(), tmp_path)
    judged = judge_preflight(host, monkeypatch)
    assert judged.passed and judged.failed_now == [] and host.logs == []
    assert run_op(preflight_checks, host, **judged.reported) == []
    assert host.noops == ["preflight: 19 of 19 checks passed, 0 warned, none failed"]  # https-trust among them
    # memory of every rigup variant's container is free: the deploy replaces or stops them
    (names,) = [kw["container_names"] for fact, kw in host.fact_calls if fact == "GpuMemoryUse"]
    assert set(names) == set(rigup_container_names())
    assert {"rigup-dual", "rigup-dual-turbo", "rigup-gemma-dual"} <= set(names)


def test_preflight_without_a_lock_warns_and_checks_the_catalog_refs(monkeypatch: pytest.MonkeyPatch):
    host = preflight_host(converged_2x3090())
    judged = judge_preflight(host, monkeypatch)
    assert judged.passed
    assert run_op(preflight_checks, host, **judged.reported) == []
    assert host.noops == ["preflight: 19 of 20 checks passed, 1 warned, none failed"]
    assert host.logs[0].startswith("preflight warning: rig-07: lock: checked against the catalog's refs: /nonexistent")


def test_preflight_fails_the_host_not_the_run_while_the_deploy_is_planned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    host = preflight_host(one_3090_on_550(), tmp_path)
    judged = judge_preflight(host, monkeypatch)
    assert not judged.passed and judged.failed_now == [host]  # this host, now: nothing after preflight is planned
    # the warning, then why it failed: one line per check, with the key and the fix
    assert host.logs[0].startswith("preflight warning: rig-07: driver: will install: nvidia-driver-550 550.120")
    assert host.logs[1] == "preflight failed (1 checks)"
    assert host.logs[2].startswith("  rig-07: gpu-layout: variant 'dual' runs tensor parallel 2; this host has 1 GPU(s)")
    assert "-> fix: use tensor parallel 1: variant single" in host.logs[2]
    assert len(host.logs) == 3
    # the operation it adds shows the failure in pyinfra's results (as an error: it never runs)
    (cmd,) = raw_commands(preflight_checks, host, **judged.reported)
    assert isinstance(cmd, FunctionCommand)
    host.logs.clear()
    assert call_function(cmd, host) is False
    assert host.logs[0] == "preflight failed (1 checks)" and len(host.logs) == 2


def test_preflight_builds_the_recipe_with_the_host_topology(tmp_path: Path):
    from rigup.parsers.topology import Topology

    nvlink = Topology((0, 1), {(0, 1): "NV4", (1, 0): "NV4"})
    host = preflight_host(converged_2x3090(topology=nvlink), tmp_path)
    report = {c.name: c for c in preflight_report(host)}
    assert report["interconnect"].message.startswith("NVLink (detected: GPU0-GPU1 NV4)")
    assert [name for name, _ in host.fact_calls].count("GpuTopology") == 1  # read once, for recipe and facts


def test_preflight_counts_memory_of_rigups_units_it_will_stop_as_free(tmp_path: Path):
    """A pod renamed or dropped still runs rigup-<old name> until the serving task stops it: its GPU
    memory is named to GpuMemoryUse as rigup's own (free for the new layout)."""
    host = preflight_host(converged_2x3090(), tmp_path)
    host.facts[RigupVariantUnits] = lambda install_root: {"rigup-oldpod.service": {"enabled": True, "active": True}}
    preflight_report(host)
    (names,) = [kw["container_names"] for name, kw in host.fact_calls if name == "GpuMemoryUse"]
    assert "rigup-oldpod" in names and "rigup-dual" in names


def test_preflight_after_driver_rechecks_with_the_loaded_driver(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Preflight let a fresh 2x RTX 3080 pass (10 GB and 20 GB boards share the PCI id); once the
    driver reports 20480 MiB cards, the re-check fails the host before Docker and the model."""
    from rigup.parsers.nvidia_smi import parse_memory_query

    before = fresh_2x3090(pci=parse_lspci(
        "0000:01:00.0 VGA compatible controller [0300]: NVIDIA Corporation GA102 [GeForce RTX 3080] [10de:2206] (rev a1)\n"
        "0000:02:00.0 VGA compatible controller [0300]: NVIDIA Corporation GA102 [GeForce RTX 3080] [10de:2206] (rev a1)\n"
    ))
    host = preflight_host(before, tmp_path)
    assert judge_preflight(host, monkeypatch).passed  # a warning, not a failure
    assert any("vram-fit: VRAM unknown until the driver loads" in line and "re-checked after the driver's reboot" in line
               for line in host.logs)

    memory = parse_memory_query((Path(__file__).parents[1] / "fixtures/fit/2x3080-20g/memory.csv").read_text())
    after = converged_2x3090(gpu_memory=memory)
    host = preflight_host(after, tmp_path)
    (cmd,) = raw_commands(preflight_after_driver, host)
    host.logs.clear()
    assert call_function(cmd, host) is False
    assert host.logs[0] == "preflight failed with the driver loaded (1 checks)"
    assert host.logs[1].startswith("  rig-07: vram-fit: variant 'dual' (max_model_len 262144, gpu_memory_utilization 0.92) does not fit")
    assert "20480 MiB" in host.logs[1] and "[key: preflight_vram_misfit]" in host.logs[1]

    host = preflight_host(converged_2x3090(), tmp_path)
    (cmd,) = raw_commands(preflight_after_driver, host)
    assert call_function(cmd, host) is True
    assert host.logs[-1] == "preflight with the driver loaded: 19 checks passed"


def test_preflight_reads_disk_where_docker_keeps_images(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    facts = converged_2x3090(
        docker=parse_docker_info(fx("docker-info/without-nvidia.json")),
        disk={**disk(300, paths=("/opt/rigup", "/opt/rigup/models")), **disk(1, mount="/srv", paths=("/srv/docker",))},
    )
    host = preflight_host(facts, tmp_path)
    assert not judge_preflight(host, monkeypatch).passed
    assert any("/srv has 1.0 GB free" in line for line in host.logs)
    asked = [kw for name, kw in host.fact_calls if name == "FreeDisk"]
    assert asked == [{"paths": ["/opt/rigup", "/opt/rigup/models", "/srv/docker"]}]
    assert int(300 * GB) == facts.disk["/opt/rigup"].avail_bytes


def test_fleet_value_is_the_smallest_valid_setting():
    class H:
        def __init__(self, value):
            self.data = {"rollout_batch": value}

    assert fleet_value("rollout_batch", [H(3), H(2), H(5)]) == 2
    assert fleet_value("rollout_batch", [H(None), H(True), H(0)]) == 1  # invalid values ignored
    assert fleet_value("rollout_batch", []) == 1


# -- docker_daemon_config ---------------------------------------------------------------------


def test_daemon_config_merges_and_keeps_user_keys():
    user = {"log-driver": "json-file", "insecure-registries": ["a:5000"], "runtimes": {"nvidia": {"path": "x"}}}
    merged = merged_daemon_config(user, ["a:5000", "10.0.0.5:5000"])
    assert merged == {**user, "insecure-registries": ["a:5000", "10.0.0.5:5000"]}
    assert merged_daemon_config(user, ["a:5000"]) is None
    assert merged_daemon_config(None, []) is None
    assert merged_daemon_config(None, ["r:1"]) == {"insecure-registries": ["r:1"]}


def test_daemon_config_noop_and_upload():
    from pyinfra.api.command import FileUploadCommand

    done = ScriptedHost({DockerDaemonJson: {"insecure-registries": ["r:1"]}})
    assert run_op(docker_daemon_config, done, insecure_registries=["r:1"]) == []
    assert done.noops == ["/etc/docker/daemon.json has every wanted setting"]

    host = ScriptedHost({DockerDaemonJson: {"log-opts": {"max-size": "10m"}}})
    mkdir, upload, chmod = raw_commands(docker_daemon_config, host, insecure_registries=["r:1"])
    assert (str(mkdir), str(chmod)) == ("mkdir -p /etc/docker", "chmod 644 /etc/docker/daemon.json")
    assert isinstance(upload, FileUploadCommand) and upload.dest == "/etc/docker/daemon.json"
    upload.src.seek(0)
    assert json.loads(upload.src.read()) == {"insecure-registries": ["r:1"], "log-opts": {"max-size": "10m"}}


def test_invalid_daemon_json_is_a_parse_error():
    with pytest.raises(ParseError, match="not valid JSON"):
        parse_daemon_json('{"a": ')
    assert parse_daemon_json("") is None


def test_a_scripted_operation_that_raises_leaves_pyinfras_context_as_it_was() -> None:
    """pyinfra's own ctx_host.use() restores the host only on a normal exit: tests/facts/test_file_reads.py
    then met a scripted host left behind by an earlier module in the same worker (a clean-clone run of a899ea8)."""
    from pyinfra.context import ctx_host, ctx_state

    from tests.support.opharness import ScriptedHost, scripted

    before = (ctx_host.get(), ctx_state.get())
    with pytest.raises(RuntimeError), scripted(ScriptedHost({}), True):
        assert ctx_host.get() is not before[0]
        raise RuntimeError("the operation failed")
    assert (ctx_host.get(), ctx_state.get()) == before
