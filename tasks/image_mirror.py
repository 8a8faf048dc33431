"""Image mirror: on the host image_mirror_host names, the fleet's pull-through cache of container_registry.

True afterwards: the OS archive's docker-registry (the distribution registry) is installed and its unit
runs on /etc/rigup/image-mirror.yml (a drop-in names it; the package's config.yml is left alone): proxy
mode towards container_registry's registry (Docker Hub's API for docker.io), storage in
/var/lib/docker-registry, plain HTTP on image_mirror_port, answering /v2/. Every image the clients'
locks pin now (repository@digest) is in its cache, fetched through the mirror from here before any rig
pulls. /etc/rigup/image-mirror-keep.json lists those pins and the bound (image_mirror_max_gb);
{install_root}/bin/rigup-image-mirror (check, warm, prune) keeps the cache within it (now, when over, and daily from
rigup-image-mirror-prune.timer), dropping images no rig pins, least recently cached first.
Reads: image_mirror_port, image_mirror_max_gb, install_root, and each client's image_mirror,
container_registry, docker_insecure_registries and lock.
Restarts: docker-registry.service when its config or drop-in changed after it started; for a prune
over the bound, the registry stops during the garbage collection.
Not idempotent: "Wait for the image mirror to answer" runs only after such a restart.
Included by deploy.py on the mirror host after Docker (its apt sources are settled by then), before any
client pulls.
"""

from io import StringIO

from pyinfra import host
from pyinfra.facts.deb import DebPackages
from pyinfra.operations import apt, files, systemd

from rigup.desired.image_mirror import (
    CONFIG_FILE,
    DROPIN_FILE,
    KEEP_FILE,
    PACKAGE,
    PRUNE_TIMER,
    PRUNE_UNIT,
    UNIT,
    dropin_text,
    helper_path,
    mirror_role,
    prune_timer_text,
    prune_unit_text,
)
from rigup.desired.knobs import knob
from rigup.desired.plan import mirror_pins
from rigup.operations.docker import image_mirror_cached, image_mirror_pruned
from rigup.operations.units import answers_http, unit_runs_current_files
from rigup.rig import imagemirror
from rigup.runstate import note_change

fleet = [(other.name, other.data.dict()) for other in host.inventory]
pins = {name: mirror_pins(name, data) for name, data in fleet}
role = mirror_role(host.name, host.data.dict(), fleet, pins)
assert role is not None  # deploy.py includes this file on the mirror host only
script = helper_path(str(knob(host.data, "install_root")))

if PACKAGE not in (host.get_fact(DebPackages) or {}):  # only then are the lists refreshed
    apt.update(name="Update apt before installing the image mirror")
installed = apt.packages(name="Install the distribution registry (OS archive)", packages=[PACKAGE], no_recommends=True)
files.directory(name="Create /etc/rigup", path="/etc/rigup", mode="755")
files.put(name="Write the image mirror's config (pull-through of the upstream registry)",
          src=StringIO(role.config_text()), dest=CONFIG_FILE, mode="644")
files.directory(name="Create the registry unit's drop-in directory", path=DROPIN_FILE.rsplit("/", 1)[0], mode="755")
dropin = files.put(name="Run the registry on rigup's config (drop-in)", src=StringIO(dropin_text()), dest=DROPIN_FILE,
                   mode="644")
# The package's postinst loaded and started the unit before the drop-in existed: reload explicitly (on
# the bed's systemd 252, without it the restart below kept the package's config and its htpasswd auth)
systemd.daemon_reload(name="Reload systemd for the registry's drop-in", _if=dropin.did_change)
mirror = unit_runs_current_files(
    name="Run the image mirror on its current config (restart only on a change)",
    unit=UNIT,
    files=[CONFIG_FILE, DROPIN_FILE],
)
answers_http(
    name="Wait for the image mirror to answer",
    url=f"http://127.0.0.1:{role.port}/v2/",
    timeout_s=60,
    unit=UNIT,
    what="the image mirror",
    _if=mirror.did_change,
)

files.directory(name="Create rigup's bin directory", path=script.rsplit("/", 1)[0], mode="755")
files.put(name="Upload the image mirror's helper (cache check, warm, prune)", src=imagemirror.__file__, dest=script,
          mode="755")
files.put(name="Write the pins the mirror keeps and its bound", src=StringIO(role.keep_text()), dest=KEEP_FILE,
          mode="644")
cached = image_mirror_cached(name="Cache every pinned image in the mirror before the rigs pull", script=script,
                             keep_file=KEEP_FILE)
pruned = image_mirror_pruned(name="Keep the mirror's cache within image_mirror_max_gb", script=script,
                             keep_file=KEEP_FILE)
prune_unit = files.put(name="Write the daily prune's unit", src=StringIO(prune_unit_text(script)),
                       dest=f"/etc/systemd/system/{PRUNE_UNIT}", mode="644")
prune_timer = files.put(name="Write the daily prune's timer", src=StringIO(prune_timer_text()),
                        dest=f"/etc/systemd/system/{PRUNE_TIMER}", mode="644")
systemd.daemon_reload(name="Reload systemd for the prune's unit and timer",
                      _if=lambda: prune_unit.did_change() or prune_timer.did_change())
systemd.service(name="Run the daily prune's timer", service=PRUNE_TIMER, running=True, enabled=True)
note_change(host, "image mirror", installed, mirror, cached, pruned)
