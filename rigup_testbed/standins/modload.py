#!/usr/bin/python3
"""Stand-in for the NVIDIA kernel module (package nvidia-dkms-<branch>[-open]).

A container cannot load kernel modules, so "loaded" is simulated the way every tool observes it:
/proc/driver/nvidia/version. Real hosts only get a newly installed module after a reboot (nouveau or
the old module holds the device), so:

  modload.py --install   postinst: records the boot in which this module version was installed
  modload.py --boot      boot unit (nvidia-standin-modload.service): "loads" the installed module,
                         i.e. writes the version file and bind-mounts it over /proc/driver, unless the
                         module was installed in this very boot, Secure Boot rejects it, or there is
                         no NVIDIA GPU. /proc mounts and /run vanish at reboot like a loaded module.
  modload.py --status    prints installed and loaded versions

With RIGUP_STANDIN_ROOT set, files go under that root and nothing is mounted.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import common

INSTALLED = "/var/lib/nvidia-standin/installed.json"
LOADED = "/run/nvidia-standin/loaded.json"
PROC_SHADOW = "/run/nvidia-standin/proc-driver"
LOG = "/var/log/nvidia-standin/calls.log"


def module() -> dict[str, Any]:
    data = common.read_json(Path(__file__).resolve().parent / "module.json")
    if not isinstance(data, dict):
        common.fail("nvidia module stand-in: module.json missing next to the script", 1)
    return data


def version_text(mod: dict[str, Any]) -> str:
    """/proc/driver/nvidia/version exactly as the real open / proprietary modules write it."""
    gcc = mod.get("gcc", "gcc version 12.2.0 (Debian 12.2.0-14+deb12u1) ")
    if mod["flavour"] == "open":
        head = (
            f"NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  {mod['version']}  Release Build  "
            f"({mod.get('builder', 'dvs-builder@U22-I3-AE18-09-3')})  {mod['build_date']}"
        )
    else:
        head = f"NVRM version: NVIDIA UNIX x86_64 Kernel Module  {mod['version']}  {mod['build_date']}"
    return f"{head}\nGCC version:  {gcc}\n"


def gpu_information(gpu: dict[str, Any], minor: int) -> str:
    bus = gpu["pci_bus_id"][4:].lower()  # 00000000:01:00.0 -> 0000:01:00.0
    return (
        f"Model: \t\t {gpu['name']}\nIRQ:   \t\t {120 + minor}\nGPU UUID: \t {gpu['uuid']}\n"
        f"Video BIOS: \t ??.??.??.??.??\nBus Type: \t PCIe\nDMA Size: \t 47 bits\nDMA Mask: \t 0x7fffffffffff\n"
        f"Bus Location: \t {bus}\nDevice Minor: \t {minor}\nGPU Firmware: \t N/A\nGPU Excluded:\t No\n"
    )


def install() -> int:
    mod = module()
    p = common.path(INSTALLED)
    with common.locked(p.with_suffix(".lock")):
        data = common.read_json(p, {})
        data = data if isinstance(data, dict) else {}
        data[mod["version"]] = {"flavour": mod["flavour"], "boot_id": common.boot_id()}
        common.write_json_atomic(p, data)
    print(f"nvidia/{mod['version']} ({mod['flavour']} kernel module, rigup stand-in): installed; "
          "it is loaded at the next boot")
    return 0


def _mount_over_proc(shadow: Path) -> None:
    target = "/proc/driver"
    if not Path(target).is_dir():
        raise RuntimeError(f"{target} does not exist in this procfs")
    if subprocess.run(["mountpoint", "-q", target]).returncode != 0:
        subprocess.run(["mount", "--bind", str(shadow), target], check=True)
        subprocess.run(["mount", "-o", "remount,bind,ro", target], check=False)


def boot() -> int:
    mod = module()
    hw = common.hardware()
    installed = common.read_json(common.path(INSTALLED), {}) or {}
    record = installed.get(mod["version"], {}) if isinstance(installed, dict) else {}
    if record.get("boot_id") == common.boot_id():
        print(f"modprobe: ERROR: could not insert 'nvidia': Device or resource busy "
              f"(nvidia/{mod['version']} was installed in this boot; reboot to load it)")
        return 1
    if hw.get("secure_boot") and not hw.get("mok_enrolled"):
        # DKMS-built modules are signed with a MOK that nobody enrolled: the kernel refuses them.
        print("modprobe: ERROR: could not insert 'nvidia': Key was rejected by service")
        return 1
    gpus = hw.get("gpus") or []
    if not gpus:
        print("modprobe: ERROR: could not insert 'nvidia': No such device")
        return 1
    if common.test_mode():
        base = common.path("/proc/driver")
    else:
        base = Path(PROC_SHADOW)
    (base / "nvidia" / "gpus").mkdir(parents=True, exist_ok=True)
    common.write_text_atomic(base / "nvidia" / "version", version_text(mod), 0o444)
    for minor, gpu in enumerate(gpus):
        d = base / "nvidia" / "gpus" / gpu["pci_bus_id"][4:].lower()
        d.mkdir(parents=True, exist_ok=True)
        common.write_text_atomic(d / "information", gpu_information(gpu, minor), 0o444)
    if not common.test_mode():
        _mount_over_proc(base)
    common.write_json_atomic(common.path(LOADED), {"version": mod["version"], "flavour": mod["flavour"],
                                                   "boot_id": common.boot_id()})
    print(f"nvidia/{mod['version']} ({mod['flavour']}) loaded")
    return 0


def status() -> int:
    mod = module()
    try:
        loaded = common.path("/proc/driver/nvidia/version").read_text().splitlines()[0]
    except OSError:
        loaded = "not loaded"
    print(f"installed: {mod['version']} ({mod['flavour']})\nloaded: {loaded}")
    return 0


def main(argv: list[str]) -> int:
    common.log_call(LOG, "modload", argv)
    actions = {"--install": install, "--boot": boot, "--status": status}
    if len(argv) != 1 or argv[0] not in actions:
        common.fail("usage: modload.py --install|--boot|--status", 2)
    return actions[argv[0]]()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
