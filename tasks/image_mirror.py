"""Image mirror: on the host image_mirror_host names, the fleet's pull-through cache of container_registry;
on every rig that names it, a relay of the mirror that the rig pulls from.

True afterwards: the OS archive's docker-registry (the distribution registry) is installed and its unit
runs on /etc/rigup/image-mirror.yml (a drop-in names it; the package's config.yml is left alone), storage
in /var/lib/docker-registry, plain HTTP on image_mirror_port, answering /v2/:
  * on the mirror host, on every address, in proxy mode towards container_registry's registry (Docker
    Hub's API for docker.io);
  * on a relay, on 127.0.0.1, in proxy mode towards the mirror.
Every image the host's registry keeps (the mirror: every client's pins; a relay: its rig's) is in its
cache before any rig pulls. The blobs came along the fleet's image chain (rigfetch, as model files do):
upstream read once by the chain's head, verified pieces forwarded from host to host while they arrive,
into /var/lib/docker-registry/rigup-staging, then linked into the registry by
{install_root}/bin/rigup-image-mirror (check, stage, warm, prune), which reads only the manifests from
upstream. /etc/rigup/image-mirror-keep.json lists the pins and the bound: the mirror keeps within
image_mirror_max_gb (now, when over, and daily from rigup-image-mirror-prune.timer), dropping images no rig
pins, least recently cached first; a relay keeps its rig's pins only.
Reads: image_mirror_port, image_mirror_max_gb, install_root, model_fleet_source, model_fleet_port,
model_fleet_address, model_download_retries, preflight_disk_margin_gb, and each client's image_mirror,
container_registry, docker_insecure_registries and lock.
Restarts: docker-registry.service when its config or drop-in changed after it started; for a prune
(over the mirror's bound, or anything unpinned on a relay), the registry stops during the garbage collection.
Not idempotent: "Wait for the image registry to answer" runs only after such a restart.
Included by deploy.py after Docker (its apt sources are settled by then), before any pull.
"""

from io import StringIO

from pyinfra import host, state
from pyinfra.operations import files, systemd

from rigup.desired.image_mirror import (
    CONFIG_FILE,
    DROPIN_FILE,
    KEEP_FILE,
    PACKAGE,
    PRUNE_TIMER,
    PRUNE_UNIT,
    UNIT,
    dropin_text,
    prune_timer_text,
    prune_unit_text,
)
from rigup.desired.knobs import knob
from rigup.layout import RigLayout
from rigup.operations.apt import os_packages
from rigup.operations.docker import image_mirror_cached, image_mirror_pruned
from rigup.operations.image_chain import image_blobs_staged, image_chain_members
from rigup.operations.model import rigfetch_upload
from rigup.operations.units import answers_http, unit_runs_current_files
from rigup.rig import imagemirror
from rigup.runstate import fleet_plan, note_change

fleet = fleet_plan(state)  # every host's pins planned once per run
role = fleet.host(host.name).registry
assert role is not None  # deploy.py includes this file on the mirror host and its clients only
layout = RigLayout(str(knob(host.data, "install_root")))
members = image_chain_members(fleet, KEEP_FILE)  # the op keeps those in the run

installed = os_packages(name="Install the distribution registry (OS archive), and python3 for its helpers",
                        packages=[PACKAGE, "python3"], no_recommends=True)
files.directory(name="Create /etc/rigup", path="/etc/rigup", mode="755")
files.put(name="Write the registry's config (the mirror: pull-through of upstream; a relay: of the mirror)",
          src=StringIO(role.config_text()), dest=CONFIG_FILE, mode="644")
files.directory(name="Create the registry unit's drop-in directory", path=DROPIN_FILE.rsplit("/", 1)[0], mode="755")
dropin = files.put(name="Run the registry on rigup's config (drop-in)", src=StringIO(dropin_text()), dest=DROPIN_FILE,
                   mode="644")
# The package's postinst loaded and started the unit before the drop-in existed: reload explicitly (on
# the bed's systemd 252, without it the restart below kept the package's config and its htpasswd auth)
systemd.daemon_reload(name="Reload systemd for the registry's drop-in", _if=dropin.did_change)
mirror = unit_runs_current_files(
    name="Run the image registry on its current config (restart only on a change)",
    unit=UNIT,
    files=[CONFIG_FILE, DROPIN_FILE],
)
answers_http(
    name="Wait for the image registry to answer",
    url=f"http://127.0.0.1:{role.port}/v2/",
    timeout_s=60,
    unit=UNIT,
    what="the image registry",
    _if=mirror.did_change,
)

files.directory(name="Create rigup's bin directory", path=layout.bin_dir, mode="755")
files.put(name="Upload the image registry's helper (cache check, stage, warm, prune)", src=imagemirror.__file__,
          dest=layout.image_mirror_helper, mode="755")
files.put(name="Upload rigfetch (the image chain's fetch and verify helper)", src=rigfetch_upload(),
          dest=layout.rigfetch, mode="755")
files.put(name="Write the pins the registry keeps and its bound", src=StringIO(role.keep_text()), dest=KEEP_FILE,
          mode="644")
staged = image_blobs_staged(
    name="Stage every pinned image's blobs along the fleet's chain (the head reads upstream, each host forwards)",
    members=members,
    listen_port=int(knob(host.data, "model_fleet_port")),
    retries=knob(host.data, "model_download_retries"),
)
# the mirror's cache first (a separate operation): a relay's warm reads the manifests from it
if not role.is_relay:
    cached = image_mirror_cached(name="Cache every pinned image in the mirror (staged blobs linked, manifests read)",
                                 script=layout.image_mirror_helper, keep_file=KEEP_FILE)
if role.is_relay:
    cached = image_mirror_cached(name="Cache every pinned image in this rig's relay (staged blobs linked)",
                                 script=layout.image_mirror_helper, keep_file=KEEP_FILE)
pruned = image_mirror_pruned(name="Keep the registry's cache within its bound (a relay: its rig's pins only)",
                             script=layout.image_mirror_helper, keep_file=KEEP_FILE)
if not role.is_relay:  # the daily prune is the mirror's: a relay's cache changes only at a converge
    prune_unit = files.put(name="Write the daily prune's unit", src=StringIO(prune_unit_text(layout.image_mirror_helper)),
                           dest=f"/etc/systemd/system/{PRUNE_UNIT}", mode="644")
    prune_timer = files.put(name="Write the daily prune's timer", src=StringIO(prune_timer_text()),
                            dest=f"/etc/systemd/system/{PRUNE_TIMER}", mode="644")
    systemd.daemon_reload(name="Reload systemd for the prune's unit and timer",
                          _if=lambda: prune_unit.did_change() or prune_timer.did_change())
    systemd.service(name="Run the daily prune's timer", service=PRUNE_TIMER, running=True, enabled=True)
note_change(host, "image relay" if role.is_relay else "image mirror", installed, mirror, staged, cached, pruned)
