"""Serving: each of the host's pods runs as rigup-<pod>.service, answers, and is on record.

A host serves one variant (`variant:`; its one pod is named after it) or the pods it lists (`pods:`,
rigup.desired.pods), each a variant on GPUs of its own. For every pod:
True afterwards: {install_root}/variants/<pod>/ holds the rendered compose.yaml, .env (mode 0600, no secret
in it), secrets/ (0700: one 0600 root file per secret the pod carries, VLLM_API_KEY, HF_TOKEN, a cluster
member's RAY_AUTH_TOKEN, bound read-only into the container: the only place they are written; a secret no
longer configured is removed) and release.json (image, source
commits, model revisions and file manifests, engine settings, hashes of the rendered files);
/etc/systemd/system/rigup-<pod>.service runs `docker compose up` in the foreground, restarts on
failure and starts at boot after Docker; the container reserves exactly the pod's GPUs; no rigup
variant unit other than the pods' is enabled or running; the image is pulled; /v1/models lists the
served model and a short deterministic chat completion succeeds; the pod's provenance.json
({install_root}/state/, or state/pods/<pod>/ for a listed pod) records the release that passed, and
variants/<pod>/generations/<n>/ keep the files of the last serving_keep_generations releases that
passed.
Reads: variant, variant_overrides, pods, install_root, model_dir, container_registry, lock_file,
serving_bind_address, serving_api_key_file, serving_health_timeout_s, serving_keep_generations,
hf_token_file (or $HF_TOKEN on the control machine), gpu_interconnect (with the GPU topology: read
while planning, or, on a rig whose driver this run installs, when the files are written), and the driver
task's reboot decision.
Restarts: rigup-<pod>.service only when its compose.yaml, .env, a secret file, unit or release.json changed after
the service started (a new image, source commit, model revision or file manifest, engine setting or
secret), judged on the rig, so a run interrupted after writing them is finished by the next; a pod
whose files did not change keeps running. Reloads systemd only when systemd reports the unit file
changed (a reload can detach GPUs from running containers).
Stops: every other rigup variant unit (the pods own the GPUs), and on a host in no cluster the
firewall a cluster left (rigup-cluster-firewall.service, its rules file and table).
A failed gate the fleet no longer asks for: a pod whose record says a release failed its gate and was
rolled back, when this converge renders the release it serves (the fleet file reverted), has that
failure marked superseded (one command, once), so RigupGateFailed clears; a fleet still asking for the
failed release restarts it, gates it, fails and rolls back again, and the alert stays.
A rig that changed under a pod: when the rig's fingerprint (GPU UUIDs, PCI bus ids and topology, VBIOS,
driver, NVIDIA module, kernel, BIOS) differs from the one the pod's last passed gate recorded, the pod is
re-validated (one command): vLLM's P2P access cache removed, the pod restarted and gated with every probe
of its release (no rollback: the release did not change), and the account says "fingerprint changed:
<what> -> P2P cache removed (...), full probe set passed". A cluster member whose rig changed has its cache
removed and is restarted (one command, before its service), and its cluster's gate follows as after any
restart: the head asks every probe, and a pass records the new fingerprint on every member that gated.
Not idempotent: "Health-gate the (re)started variant" runs only after a (re)start, enable or
driver change and then reports a change; when it fails it restores the pod's previous good
generation, restarts it, gates it again, and fails the host saying it was rolled back. A cluster
member gates in two steps instead, on every member at once (rigup.operations.cluster_gate): wait
until the cluster serves, then record when every member passed, or roll every member back.
Skipped, with a warning, on a host whose driver needs a reboot under driver_reboot=never.
Without a usable lock: a real run stops (when sources or model did not already), saying
what the lock pins and how to make it; a --dry run warns so in one line and plans nothing here.
"""

import posixpath

from pyinfra import host, logger
from pyinfra.operations import files

from rigup.desired.cluster import MEMBER_SCRIPT, firewall_text
from rigup.desired.knobs import knob, knob_int
from rigup.desired.lock import LockError
from rigup.desired.recipe import RecipeError
from rigup.desired.release import release_path
from rigup.desired.render import SECRET_NAMES
from rigup.desired.render import secret_file as secret_file_path
from rigup.desired.secrets import SecretError
from rigup.facts.gpu import GpuTopology
from rigup.layout import RigLayout
from rigup.operations.apt import os_packages
from rigup.operations.cluster import cluster_firewall, cluster_firewall_absent, cluster_host_data, peer_routes
from rigup.operations.cluster_gate import cluster_gate_verdict, cluster_member_gate, member_gates_when
from rigup.operations.planning_errors import stop_the_run_on
from rigup.operations.serving import (
    health_gate,
    health_timeout_s,
    image_pulled,
    member_revalidated,
    secret_file,
    serving_verified,
    sole_variant,
    variant_service,
)
from rigup.operations.serving_plans import PodPlans, text_file
from rigup.rig import SERVINGCTL_SCRIPT
from rigup.runstate import driver_changed, pins_missing, serving_blocked

# The interconnect plan (NCCL / custom all-reduce / NVLINK_MODE) comes from the GPU topology, as preflight,
# status and doctor read it. On a host whose driver is installed in this same run it is unknown here (no
# nvidia-smi yet): the files take their text when they are written, planned again with the topology read
# then (PodPlans), so the first converge writes what the next one plans.
with stop_the_run_on(host, LockError, RecipeError, SecretError, ValueError):
    pod_plans = PodPlans(host, cluster_host_data(host), host.get_fact(GpuTopology), require_lock=False)
    plans = pod_plans.planned
    for plan in plans:  # refuses a secret that is not one line before anything changes
        for name in plan.secret_names:
            plan.secret_text(name)
    timeouts = [health_timeout_s(plan.recipe, knob(host.data, "serving_health_timeout_s")) for plan in plans]
    keep = knob_int(host.data, "serving_keep_generations", minimum=1)
# no release without pins: --dry warns, a real run fails
missing_pins = any([pins_missing(host, "serving", plan) for plan in plans])
blocked = serving_blocked(host)
if blocked is not None and not missing_pins:
    logger.warning(f"{host.print_prefix}SERVING SKIPPED: {blocked}")
if blocked is None and not missing_pins:
    paths = plans[0].recipe.paths  # the host's paths (install root, state) are every pod's
    layout = RigLayout(paths.install_root)
    ctl = layout.servingctl
    pods = list(zip(plans, timeouts))

    os_packages(name="Install python3 for rigup-servingctl", packages=["python3"])
    files.directory(name="Create the rigup bin directory", path=layout.bin_dir, mode="755")
    files.directory(name="Create the state directory", path=paths.state_dir, mode="755")
    files.put(
        name="Upload rigup-servingctl (health gate, generations, rollback)",
        src=str(SERVINGCTL_SCRIPT),
        dest=ctl,
        mode="755",
    )
    member = plans[0].recipe.cluster  # a cluster member serves its share only (one pod)
    if member is not None:
        os_packages(name="Install nftables (the cluster's firewall)", packages=["nftables"])
        files.directory(name="Create the cluster directory", path=posixpath.dirname(member.script), mode="755")
        files.put(name="Upload rigup's cluster member script (Ray head or worker)", src=str(MEMBER_SCRIPT),
                  dest=member.script, mode="755")
        read = peer_routes(host)
        cluster_firewall(
            name=f"Run the firewall of cluster {member.cluster.name} on its current rules (members only to Ray's and NCCL's ports)",
            rules=firewall_text(member.cluster, {host.name: member.net.address, **dict(read.addresses)},
                                member.ports, read.local_ports, plans[0].recipe.host_port),
        )
    else:
        cluster_firewall_absent(name="Remove the firewall of a cluster this host has left")

    # Pull before any file changes: the old release keeps serving during the download, and a failed
    # pull leaves the rig as it was.
    for ref in host.loop(dict.fromkeys(plan.recipe.image.ref for plan in plans)):
        image_pulled(name="Pull the container image", ref=ref)

    for index, (plan, _) in host.loop(enumerate(pods)):
        pod, recipe = plan.pod_suffix, plan.recipe
        files.directory(name=f"Create the variant directory{pod}", path=recipe.paths.variant_dir, mode="755")
        for cache_dir in host.loop(recipe.host_dirs):
            files.directory(name=f"Create the variant's cache directories{pod}", path=cache_dir, mode="755")
        text_file(
            name=f"Write the compose file{pod}",
            text=pod_plans.text(index, "compose"),
            dest=recipe.paths.compose_file,
            mode="644",
        )
        secret_file(
            name=f"Write the environment file (0600; no secret in it){pod}",
            path=recipe.paths.env_file,
            content=pod_plans.text(index, "env"),
            mode=plan.env.mode,
        )
        files.directory(name=f"Create the pod's secrets directory (0700){pod}", path=recipe.paths.secrets_dir,
                        mode="700")
        for name in host.loop(SECRET_NAMES):
            if name in plan.secret_names:
                secret_file(
                    name=f"Write the secret file {name} (0600: the only place it goes){pod}",
                    path=plan.secret_files[name],
                    content=pod_plans.secret(index, name),  # called when it runs: never in pyinfra's output
                )
            else:
                files.file(name=f"Remove the secret file {name} (not configured){pod}",
                           path=secret_file_path(recipe, name), present=False)
        text_file(
            name=f"Write the systemd unit{pod}",
            text=pod_plans.text(index, "unit"),
            dest=recipe.paths.unit_file,
            mode="644",
        )
        text_file(
            name=f"Write the release file (pins and file hashes){pod}",
            text=pod_plans.text(index, "release"),
            dest=release_path(recipe),
            mode="644",
        )

    # handlers: GPUs free, then (re)start each pod from what is on disk, then its gate. A pod whose
    # files did not change is not restarted: changing one pod never restarts another.
    sole_variant(
        name="Stop and disable other rigup variants",
        unit=[plan.recipe.paths.unit_name for plan in plans],
        install_root=paths.install_root,
    )
    for index, (plan, timeout_s) in host.loop(enumerate(pods)):
        pod, recipe = plan.pod_suffix, plan.recipe
        revalidated = None if member is None else member_revalidated(
            name=f"Re-validate the member if its rig changed: vLLM's P2P cache removed, restarted for the cluster's gate{pod}",
            ctl=ctl,
            release=release_path(recipe),
            timeout_s=timeout_s,
            keep=keep,
        )
        service = variant_service(
            name=f"Run the variant on its current files (restart only if they changed since it started){pod}",
            ctl=ctl,
            release=release_path(recipe),
            unit=recipe.paths.unit_name,
        )

        def restarted(service=service, revalidated=revalidated) -> bool:  # execute time: gate after a (re)start,
            # a member's re-validation or a driver change
            return service.did_change() or (revalidated is not None and revalidated.did_change()) or driver_changed(host)

        if member is None:
            health_gate(
                name=f"Health-gate the (re)started variant; roll back on failure{pod}",
                ctl=ctl,
                release=release_path(recipe),
                timeout_s=timeout_s,
                keep=keep,
                _if=restarted,
            )
        else:  # the members pass as one or roll back as one (rigup.operations.cluster_gate)
            cluster = member.cluster
            cluster_member_gate(
                name=f"Wait until cluster {cluster.name} serves (every member joined; nothing recorded yet)",
                ctl=ctl,
                release=release_path(recipe),
                timeout_s=timeout_s,
                cluster=cluster.name,
                head=cluster.head,
                members=list(cluster.hosts),
                _if=member_gates_when(host, cluster.name, restarted),
            )
            cluster_gate_verdict(
                name=f"Record cluster {cluster.name}'s release when every member passed; else roll every member back",
                ctl=ctl,
                release=release_path(recipe),
                timeout_s=timeout_s,
                keep=keep,
                cluster=cluster.name,
                members=list(cluster.hosts),
                _if=restarted,
            )
        serving_verified(
            name=f"Ensure the variant serves its recorded release{pod}",
            ctl=ctl,
            release=release_path(recipe),
            release_text=pod_plans.text(index, "release"),
            timeout_s=timeout_s,
            keep=keep,
            member=member is not None,  # a changed member's rig is member_revalidated's, above
        )
