"""Preflight: fail a host before anything changes on it.

True afterwards: every host still in the run can run rigup (read first, without sudo: root or
passwordless sudo, systemd as the running init, apt, Docker present or installable; a login that
cannot act as root is judged from these alone), runs an allowed OS, has enough GPUs of a supported
compute capability for its variant (gpu-layout: a valid tensor-parallel size), GPUs whose memory
(free of other processes) fits one of the variant's measured VRAM envelopes (vram-fit; rigup.checks.fit),
a loaded driver that supports the image's CUDA runtime unless this run replaces it (cuda-compat;
driver-cuda checks the planned branch), enough free disk for the model, image and sources
(+ preflight_disk_margin_gb), no Secure Boot conflict with the driver path that would be
installed, no snap Docker, and a trusted certificate on every https server the fleet file names for it
(https-trust: curl's handshake with the system's store, rigup.desired.trust). A host that fails is dropped from the run with one line per failed
check naming the host, the key and the fix (`python -m rigup doctor` prints the same checks without
deploying). Before a driver is loaded the GPUs are known from lspci only: where the PCI id does not
tell the memory size, VRAM is a warning here and tasks/nvidia_driver.py runs every check again
after the driver's reboot. The recipe checked is the one the later phases build
(rigup.desired.plan.host_plan with the GPU topology); without a usable lock the catalog's refs stand in
and a warning says so.

Reads: variant, variant_overrides, gpu_count, gpu_interconnect, preflight_os_allowed,
preflight_disk_margin_gb, preflight_vram_misfit, nvidia_driver_branch, nvidia_driver_flavour,
nvidia_driver_source, driver_reboot, gpu_power_cap_watts, gpu_power_cap_by_model, _sudo, install_root, model_dir,
container_registry, lock_file, the *_url knobs, hf_endpoint, docker_insecure_registries and grafana (which
https servers the host reaches).
A gateway-only host (serves_variant: false) is checked for root or passwordless sudo, systemd, apt,
its OS, room for the gateway's venv and its pip index's certificate only.
Changes: nothing. Restarts: nothing.
Judged while pyinfra plans the deploy (with -y and --dry too): a host that fails is failed then, and
deploy.py plans nothing after preflight for it, so a --dry run says what a real run would do and
exits 1.
"""

from rigup.operations.preflight import preflight_gate

preflight_gate(name="Run preflight checks (a failed check fails this host)")
