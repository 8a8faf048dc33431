"""NVIDIA driver: branch >= nvidia_driver_branch installed, loaded, held; GPU power settings at boot.

True afterwards: the driver metapackage for nvidia_driver_branch / _flavour / _source is installed
(Ubuntu archive: nvidia-driver-<branch>[-open] plus Canonical-signed linux-modules-nvidia when the
archive has them for the running kernel; CUDA repo: nvidia-open-<branch> / cuda-drivers-<branch>),
its module is the one loaded (verified after the reboot), its packages are held and excluded from
unattended-upgrades, nouveau is blacklisted (none of this for a driver the host provides: a loaded
module no apt package installed is left alone), and rigup-gpu-power.service sets persistence mode and
the power cap (gpu_power_cap_watts, else gpu_power_cap_by_model for the card) at every boot (re-applied now only when nvidia-smi shows drift). After a
driver change and its reboot every preflight check runs again with nvidia-smi answering (VRAM,
driver CUDA, compute capability, power limits) and fails the host before Docker and the model.

Also disables hand-made apt entries for Docker's and the toolkit's repositories first (they would
break every apt update once rigup adds its own; tasks/docker.py and container_toolkit.py add those).

Reads: nvidia_driver_branch, nvidia_driver_flavour, nvidia_driver_source, nvidia_cuda_repo_url,
nvidia_cuda_repo_key_url, docker_apt_url, nvidia_ctk_apt_url, driver_reboot, driver_reboot_timeout_s, gpu_persistence_enabled,
gpu_power_cap_watts, rollout_batch, install_root; after a driver change also every key tasks/preflight.py reads.
Stops: every rigup variant unit installed on the host (rigup-<pod>.service: each pod's, and any an
earlier layout left) and the GPU exporter (rigup-gpu-exporter.service) that are running, before the
driver changes (tasks/metrics.py starts the exporter again). Reboots: when the installed driver is not
the loaded one and driver_reboot is auto, at most rollout_batch hosts at a time (the smallest value
in the inventory). With driver_reboot: never it reports REBOOT REQUIRED and rigup.checks.driver_plan marks
the host so later tasks do not start GPU containers.
Not idempotent: none (the reboot only happens while the driver is not converged).
"""


from pyinfra import host, inventory
from pyinfra.facts.deb import DebArch
from pyinfra.facts.files import File
from pyinfra.facts.server import Which
from pyinfra.operations import files, server, systemd

from rigup.checks.driver_plan import DriverWant, plan_driver, wanted_packages
from rigup.desired.gpu_power import power_cap as power_cap_for
from rigup.desired.knobs import knob
from rigup.desired.monitoring import GPU_EXPORTER_UNIT
from rigup.facts.driver import NvidiaKernelModule, NvidiaPackages, PrebuiltNvidiaModules
from rigup.facts.gpu import NvidiaGpus, PciGpus
from rigup.facts.serving import RigupVariantUnits
from rigup.facts.system import OsReleaseInfo
from rigup.operations.apt import (
    CTK_LIST,
    CUDA_KEYRING,
    CUDA_LIST,
    DOCKER_LIST,
    apt_source_exclusive,
    ctk_repo_uri,
    cuda_repo_uri,
    signed_repository,
)
from rigup.operations.driver import nvidia_driver, nvidia_driver_hold
from rigup.operations.gpu import gpu_power_state
from rigup.operations.preflight import fleet_value, preflight_after_driver
from rigup.parsers.lspci import visible_gpus
from rigup.runstate import HostDriverState, note_change, record

POWER_UNIT = "rigup-gpu-power.service"
POWER_UNIT_FILE = f"/etc/systemd/system/{POWER_UNIT}"

want = DriverWant.from_data(host.data)  # preflight passed: the driver knobs are valid
arch = host.get_fact(DebArch) or "amd64"
os_info = host.get_fact(OsReleaseInfo)
reboot = knob(host.data, "driver_reboot") == "auto"

# A hand-made entry for Docker's or the toolkit's repository next to the one rigup adds makes
# apt refuse every update ("Conflicting values set for option Signed-By"), the driver install's
# included: disable them before the first apt command of the run.
apt_source_exclusive(
    name="Disable other apt entries for Docker's repository",
    uri=host.data.docker_apt_url,
    keep=DOCKER_LIST,
    arch=arch,
)
apt_source_exclusive(
    name="Disable other apt entries for NVIDIA's container toolkit repository",
    uri=ctk_repo_uri(host.data.nvidia_ctk_apt_url),
    keep=CTK_LIST,
    arch=arch,
)

if want.source == "cuda" and os_info is not None:
    distro = os_info.cuda_repo_distro
    signed_repository(
        name="Add NVIDIA's CUDA signed apt repository",
        key_url=host.data.nvidia_cuda_repo_key_url.format(distro=distro),
        keyring=CUDA_KEYRING,
        source_list=CUDA_LIST,
        uri=cuda_repo_uri(host.data.nvidia_cuda_repo_url, distro, arch),
        exclusive_arch=arch,
    )

# A driver the host provides (runfile, hypervisor) is left alone: apt does not manage it, so the
# nouveau blacklist and the unattended-upgrades exclusion would only leave files behind.
plan = plan_driver(want, host.get_fact(NvidiaPackages), host.get_fact(NvidiaKernelModule))
if not plan.external:
    blacklist = files.put(
        name="Blacklist nouveau",
        src="files/blacklist-nouveau.conf",
        dest="/etc/modprobe.d/blacklist-nouveau.conf",
        mode="644",
    )
    if host.get_fact(Which, command="update-initramfs"):
        server.shell(
            name="Rebuild the initramfs after the nouveau blacklist changed",
            commands=["update-initramfs -u"],
            _if=blacklist.did_change,
        )
    files.put(
        name="Keep unattended-upgrades away from the NVIDIA driver",
        src="files/52rigup-nvidia-driver",
        dest="/etc/apt/apt.conf.d/52rigup-nvidia-driver",
        mode="644",
    )

persistence = bool(knob(host.data, "gpu_persistence_enabled"))
power_cap = power_cap_for(host.data, visible_gpus(host.get_fact(NvidiaGpus), host.get_fact(PciGpus))).watts
if persistence or power_cap is not None:
    power_unit = files.template(
        name="Render the GPU power unit",
        src="templates/rigup-gpu-power.service.j2",
        dest=POWER_UNIT_FILE,
        mode="644",
        persistence=persistence,
        power_cap_watts=power_cap,
        # Where the host has it (a runfile or host-provided driver lives outside /usr/bin);
        # before any driver, where the driver packages install it.
        nvidia_smi=host.get_fact(Which, command="nvidia-smi") or "/usr/bin/nvidia-smi",
    )
    # Only on change: every daemon-reload risks GPU loss in running containers (toolkit#48).
    systemd.daemon_reload(name="Reload systemd after the GPU power unit changed", _if=power_unit.did_change)
    systemd.service(name="Enable the GPU power unit at boot", service=POWER_UNIT, running=None, enabled=True)
elif host.get_fact(File, path=POWER_UNIT_FILE):
    server.shell(
        name="Remove the GPU power unit (no power cap or persistence wanted)",
        commands=[f"systemctl disable {POWER_UNIT}", f"rm -f {POWER_UNIT_FILE}", "systemctl daemon-reload"],
    )

prebuilt = (
    host.get_fact(PrebuiltNvidiaModules, branch_flavour=want.branch_flavour) if want.source == "ubuntu" else None
)
driver = nvidia_driver(
    name="Install and load the NVIDIA driver (stop serving, install, reboot, verify)",
    branch=want.branch,
    flavour=want.flavour,
    source=want.source,
    packages=list(wanted_packages(want, prebuilt.packages if prebuilt is not None else ())),
    # every variant unit installed here, each pod's and any left from an earlier layout, and the GPU
    # exporter (DCGM holds every GPU open): all hold GPUs
    stop_units=[*sorted(host.get_fact(RigupVariantUnits, install_root=str(knob(host.data, "install_root")))),
                GPU_EXPORTER_UNIT],
    reboot=reboot,
    reboot_timeout=int(knob(host.data, "driver_reboot_timeout_s")),
    _parallel=fleet_value("rollout_batch", inventory),
)
nvidia_driver_hold(
    name="Hold the NVIDIA driver packages",
    branch=want.branch,
    flavour=want.flavour,
    source=want.source,
)
if reboot:
    # Preflight saw the GPUs through lspci only (or an old driver): VRAM, CUDA and power limits
    # are checked again with the new driver before anything else is set up on this host.
    preflight_after_driver(
        name="Re-run the preflight checks with the new driver loaded (VRAM, CUDA, GPUs)",
        _if=driver.did_change,
    )
# Always: without a cap, a limit an earlier cap left is set back to the card's default.
gpu_power_state(
    name="Apply GPU persistence mode and power cap where nvidia-smi shows drift",
    unit=POWER_UNIT,
    power_cap_watts=power_cap,
    persistence=persistence,
)

# The decision later task files read: prepare-time facts decide it, nothing earlier in the run
# changes the loaded module.
record(
    host,
    HostDriverState(
        plan=plan,
        reboot_policy="auto" if reboot else "never",
        changed=driver.did_change,
    ),
)
note_change(host, "driver", driver)
