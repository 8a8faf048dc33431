"""Preflight: fail a host before anything changes on it.

True afterwards: every host still in the run runs an allowed OS, has enough GPUs of a supported
compute capability and VRAM for its variant (a valid tensor-parallel size), enough free disk for
the model, image and sources (+ preflight_disk_margin_gb), no Secure Boot conflict with the driver
path that would be installed, and no snap Docker. A host that fails is dropped from the run with
one line per failed check naming the host, the key and the fix (`python -m rigup doctor` prints the
same checks without deploying).

Reads: variant, variant_overrides, gpu_count, preflight_os_allowed, preflight_disk_margin_gb,
preflight_vram_misfit, nvidia_driver_branch, nvidia_driver_flavour, nvidia_driver_source,
driver_reboot, gpu_power_cap_watts, install_root, model_dir, container_registry.
Changes: nothing. Restarts: nothing.
"""

from rigup import hostops

hostops.preflight_checks(name="Run preflight checks (a failed check fails this host)")
