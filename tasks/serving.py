"""Serving: the host's variant runs as rigup-<variant>.service, answers, and is on record.

True afterwards: {install_root}/variants/<variant>/ holds the rendered compose.yaml, .env (mode 0600,
the only place the secrets HF_TOKEN and VLLM_API_KEY are written) and release.json (image, source
commits, model revisions and file manifests, engine settings, hashes of the rendered files);
/etc/systemd/system/rigup-<variant>.service runs `docker compose up` in the foreground, restarts on
failure and starts at boot after Docker; no other rigup variant unit is enabled or running; the
image is pulled; /v1/models lists the served model and a short deterministic chat completion
succeeds; {install_root}/state/provenance.json records the release that passed, and
variants/<variant>/generations/<n>/ keep the files of the last serving_keep_generations releases
that passed.
Reads: variant, variant_overrides, install_root, model_dir, container_registry, lock_file,
serving_bind_address, serving_api_key_file, serving_health_timeout_s, serving_keep_generations,
hf_token_file (or $HF_TOKEN on the control machine), gpu_interconnect (with the GPU topology read
now), and the driver task's reboot decision.
Restarts: rigup-<variant>.service only when compose.yaml, .env, the unit or release.json changed
after the service started (a new image, source commit, model revision or file manifest, engine
setting or secret), judged on the rig, so a run interrupted after writing them is finished by the
next. Reloads systemd only when systemd reports the unit file changed (a reload can detach GPUs
from running containers).
Stops: every other rigup variant unit (one variant owns the GPUs).
Not idempotent: "Health-gate the (re)started variant" runs only after a (re)start, enable or
driver change and then reports a change; when it fails it restores the previous good generation, restarts
it, gates it again, and fails the host saying it was rolled back.
Skipped, with a warning, on a host whose driver needs a reboot under driver_reboot=never.
Without a usable lock: a real run stops (when sources or model did not already), saying
what the lock pins and how to make it; a --dry run warns so in one line and plans nothing here.
A gateway-only host (serves_variant: false): nothing.
"""

import posixpath
from io import StringIO

from pyinfra import host, logger
from pyinfra.api.exceptions import DeployError
from pyinfra.api.hiddenvalue import HiddenValue
from pyinfra.operations import apt, files

from rigup.desired.knobs import knob, knob_int
from rigup.desired.lock import LockError
from rigup.desired.plan import host_plan
from rigup.desired.release import release_path
from rigup.desired.secrets import SecretError
from rigup.facts.gpu import GpuTopology
from rigup.operations.serving import (
    ctl_path,
    health_gate,
    health_timeout_s,
    image_pulled,
    secret_file,
    serving_verified,
    sole_variant,
    variant_service,
)
from rigup.rig import SERVINGCTL_SCRIPT
from rigup.runstate import driver_changed, pins_missing, serving_blocked

if knob(host.data, "serves_variant"):  # a gateway-only host runs no variant
    # The interconnect plan (NCCL / custom all-reduce) comes from the GPU topology read now, as preflight,
    # status and doctor read it. On a host whose driver is installed in this same run it is unknown here
    # (no nvidia-smi yet): the gpu_interconnect knob decides, and the next run applies what is detected.
    topology = host.get_fact(GpuTopology)
    try:
        plan = host_plan(host.data.dict(), host.name, topology, require_lock=False)
        env_text = plan.env_text()  # refuses quotes/newlines that would break the .env
        timeout_s = health_timeout_s(plan.recipe, knob(host.data, "serving_health_timeout_s"))
        keep = knob_int(host.data, "serving_keep_generations", minimum=1)
    except (LockError, SecretError, ValueError) as exc:
        raise DeployError(f"{host.name}: {exc}") from None
    missing_pins = pins_missing(host, "serving", plan)  # no release without pins: --dry warns, a real run fails
    blocked = serving_blocked(host)
    if blocked is not None and not missing_pins:
        logger.warning(f"{host.print_prefix}SERVING SKIPPED: {blocked}")
    if blocked is None and not missing_pins:
        recipe = plan.recipe
        paths = recipe.paths
        ctl = ctl_path(paths.install_root)

        apt.packages(name="Install python3 for rigup-servingctl", packages=["python3"])
        files.directory(name="Create the rigup bin directory", path=posixpath.dirname(ctl), mode="755")
        files.directory(name="Create the variant directory", path=paths.variant_dir, mode="755")
        files.directory(name="Create the state directory", path=paths.state_dir, mode="755")
        for cache_dir in host.loop(recipe.host_dirs):
            files.directory(name="Create the variant's cache directories", path=cache_dir, mode="755")
        files.put(
            name="Upload rigup-servingctl (health gate, generations, rollback)",
            src=str(SERVINGCTL_SCRIPT),
            dest=ctl,
            mode="755",
        )

        # Pull before any file changes: the old release keeps serving during the download, and a failed
        # pull leaves the rig as it was.
        image_pulled(name="Pull the container image", ref=recipe.image.ref)
        files.put(
            name="Write the compose file",
            src=StringIO(plan.compose.content),
            dest=paths.compose_file,
            mode="644",
        )
        secret_file(
            name="Write the environment file (0600: the only place secrets go)",
            path=paths.env_file,
            content=HiddenValue(env_text),
            mode=plan.env.mode,
        )
        files.put(
            name="Write the systemd unit",
            src=StringIO(plan.unit.content),
            dest=paths.unit_file,
            mode="644",
        )
        files.put(
            name="Write the release file (pins and file hashes)",
            src=StringIO(plan.release_text),
            dest=release_path(recipe),
            mode="644",
        )
        # handlers: GPUs free, then (re)start from what is on disk, then the gate
        sole_variant(
            name="Stop and disable other rigup variants", unit=paths.unit_name, install_root=paths.install_root
        )
        service = variant_service(
            name="Run the variant on its current files (restart only if they changed since it started)",
            ctl=ctl,
            release=release_path(recipe),
            unit=paths.unit_name,
        )
        health_gate(
            name="Health-gate the (re)started variant; roll back on failure",
            ctl=ctl,
            release=release_path(recipe),
            timeout_s=timeout_s,
            keep=keep,
            _if=lambda: service.did_change() or driver_changed(host),
        )
        serving_verified(
            name="Ensure the variant serves its recorded release",
            ctl=ctl,
            release=release_path(recipe),
            timeout_s=timeout_s,
            keep=keep,
        )
