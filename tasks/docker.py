"""Docker: Docker CE and the compose v2 plugin from Docker's signed apt repository.

True afterwards: /etc/apt/sources.list.d/rigup-docker.list is the only enabled apt entry for
docker_apt_url (suite = the host's VERSION_CODENAME, signed-by /etc/apt/keyrings/rigup-docker.asc);
tasks/nvidia_driver.py disabled other entries for it before the run's first apt command, so apt never
sees conflicting Signed-By values.
Distribution packages that conflict with Docker CE (docker.io, podman-docker, containerd, runc...)
are removed, docker_packages are installed and docker.service is running and enabled. A snap
Docker fails the host in preflight.

docker_insecure_registries are merged into /etc/docker/daemon.json (other keys kept). When the host names
an image mirror (image_mirror_host) and the mirror proxies Docker Hub, the host's own registry on
127.0.0.1 (the mirror's, or its relay; plain HTTP, which Docker allows on loopback) is a registry-mirrors
entry.

Reads: docker_apt_url, docker_apt_key_url, docker_packages, docker_insecure_registries, image_mirror,
container_registry.
Restarts: docker.service, only when daemon.json changed while Docker was already running (starts it
when it is not running). apt-get update runs only when the key or the source file changed.
Not idempotent: none.
"""


from pyinfra import host
from pyinfra.facts.deb import DebArch
from pyinfra.facts.systemd import SystemdStatus
from pyinfra.operations import apt, systemd

from rigup.desired.image_mirror import daemon_settings
from rigup.facts.system import OsReleaseInfo
from rigup.operations.apt import DOCKER_KEYRING, DOCKER_LIST, os_packages, signed_repository
from rigup.operations.docker import docker_daemon_config
from rigup.runstate import note_change

PREREQUISITES = ["ca-certificates", "curl"]  # https apt sources; files.download fetches the key with curl
# Distribution packages Docker's own packages conflict with (Docker's install guide removes them).
CONFLICTING = ["docker.io", "docker-doc", "docker-compose", "docker-compose-v2", "podman-docker", "containerd", "runc"]

os_info = host.get_fact(OsReleaseInfo)  # preflight passed: an allowed Ubuntu release, with its codename
arch = host.get_fact(DebArch) or "amd64"
os_packages(name="Install apt transport prerequisites", packages=PREREQUISITES)

signed_repository(
    name="Add Docker's signed apt repository",
    key_url=host.data.docker_apt_key_url,
    keyring=DOCKER_KEYRING,
    source_list=DOCKER_LIST,
    uri=host.data.docker_apt_url,
    suite=os_info.codename,
    components="stable",
    arch=arch,
)

# Written before the packages, so a fresh Docker starts with it; a running one is restarted below.
docker_was_running = bool(host.get_fact(SystemdStatus, services=["docker.service"]).get("docker.service"))
insecure_registries, registry_mirrors = daemon_settings(host.data)
daemon = docker_daemon_config(
    name="Merge rigup's settings into Docker's daemon.json",
    insecure_registries=insecure_registries,
    registry_mirrors=registry_mirrors,
)

removed = apt.packages(
    name="Remove distribution packages that conflict with Docker CE",
    packages=CONFLICTING,
    present=False,
)
packages = apt.packages(name="Install Docker CE and the compose plugin", packages=list(host.data.docker_packages))
started = systemd.service(
    name="Ensure Docker is running and enabled",
    service="docker.service",
    running=True,
    enabled=True,
)
restarted = systemd.service(
    name="Restart Docker after a daemon.json change",
    service="docker.service",
    running=True,
    restarted=True,
    _if=[daemon.did_change, lambda: docker_was_running],
)
note_change(host, "docker", removed, packages, started, restarted)
