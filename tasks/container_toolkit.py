"""NVIDIA container toolkit: installed from NVIDIA's repository and wired into Docker.

True afterwards: /etc/apt/sources.list.d/rigup-nvidia-container-toolkit.list is the only enabled apt
entry for nvidia_ctk_apt_url (others were disabled by tasks/nvidia_driver.py before any apt command); nvidia_ctk_packages are installed; `docker info` lists the nvidia
runtime (added with `nvidia-ctk runtime configure`, which merges into /etc/docker/daemon.json and keeps
the user's keys); /dev/char links exist for the NVIDIA device nodes and a udev rule recreates them, so
a systemd daemon-reload does not take GPUs away from running containers (toolkit#48). When the
driver, Docker or the toolkit changed in this run, a container of gpu_smoke_image (with
container_registry, or the host's registry on 127.0.0.1 when image_mirror_host names a mirror) must see as many GPUs
as the host.

Reads: nvidia_ctk_apt_url, nvidia_ctk_apt_key_url, nvidia_ctk_packages, gpu_smoke_image,
container_registry, image_mirror.
Restarts: docker.service, only when the nvidia runtime was just configured.
Not idempotent: the smoke test (runs only after a change; skipped when the driver waits for a reboot).
"""


from pyinfra import host
from pyinfra.operations import apt, files, systemd

from rigup.desired.image_mirror import image_ref, pull_registry
from rigup.operations.apt import CTK_KEYRING, CTK_LIST, ctk_repo_uri, signed_repository
from rigup.operations.docker import docker_nvidia_runtime
from rigup.operations.gpu import gpu_smoke_test, nvidia_dev_char_links
from rigup.runstate import changed, serving_blocked

signed_repository(
    name="Add NVIDIA's container toolkit signed apt repository",
    key_url=host.data.nvidia_ctk_apt_key_url,
    keyring=CTK_KEYRING,
    source_list=CTK_LIST,
    uri=ctk_repo_uri(host.data.nvidia_ctk_apt_url),
)
toolkit = apt.packages(name="Install the NVIDIA container toolkit", packages=list(host.data.nvidia_ctk_packages))

runtime = docker_nvidia_runtime(name="Register the nvidia runtime with Docker")
systemd.service(
    name="Restart Docker after the runtime configuration changed",
    service="docker.service",
    running=True,
    restarted=True,
    _if=runtime.did_change,
)

files.put(
    name="Install the udev rule that keeps /dev/char links for NVIDIA devices",
    src="files/71-nvidia-dev-char.rules",
    dest="/etc/udev/rules.d/71-nvidia-dev-char.rules",
    mode="644",
)
nvidia_dev_char_links(name="Create /dev/char links for NVIDIA devices")

blocked = serving_blocked(host)
gpu_smoke_test(
    name="Check a CUDA container sees every GPU (after a driver, Docker or toolkit change)",
    image=image_ref(pull_registry(host.data), host.data.gpu_smoke_image),
    _if=[
        lambda: blocked is None,
        lambda: toolkit.did_change() or runtime.did_change() or changed(host, "driver", "docker"),
    ],
)
