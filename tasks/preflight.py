"""Preflight: fail a host before anything changes on it.

True afterwards: every host still in the run can run rigup (read first, without sudo: root or
passwordless sudo, systemd as the running init, apt, Docker present or installable; a login that
cannot act as root is judged from these alone), runs an allowed OS, has enough GPUs of a supported
compute capability for its variant (gpu-layout: a valid tensor-parallel size), GPUs whose memory
(free of other processes) fits one of the variant's measured VRAM envelopes (vram-fit; rigup.checks.fit),
a loaded driver that supports the image's CUDA runtime unless this run replaces it (cuda-compat;
driver-cuda checks the planned branch), enough free disk for the model, image and sources
(+ preflight_disk_margin_gb), no Secure Boot conflict with the driver path that would be
installed, and no snap Docker. A host that fails is dropped from the run with one line per failed
check naming the host, the key and the fix (`python -m rigup doctor` prints the same checks without
deploying). Before a driver is loaded the GPUs are known from lspci only: where the PCI id does not
tell the memory size, VRAM is a warning here and tasks/nvidia_driver.py runs every check again
after the driver's reboot. The recipe checked is the one the later phases build
(rigup.desired.plan.host_plan with the GPU topology); without a usable lock the catalog's refs stand in
and a warning says so.

Reads: variant, variant_overrides, gpu_count, gpu_interconnect, preflight_os_allowed,
preflight_disk_margin_gb, preflight_vram_misfit, nvidia_driver_branch, nvidia_driver_flavour,
nvidia_driver_source, driver_reboot, gpu_power_cap_watts, gpu_power_cap_by_model, _sudo, install_root, model_dir,
container_registry, lock_file.
A gateway-only host (serves_variant: false) is checked for root or passwordless sudo, systemd, apt,
its OS and room for the gateway's venv only.
Changes: nothing. Restarts: nothing.
From here on every fact is read once per run per host (rigup.facts.once): re-read only after
something ran on the host, and the facts the last run asked for come back in one round trip, sent as
this file starts loading; and
pyinfra orders operations from call stacks read without source lines (rigup.operations.call_order).
"""

from pyinfra import state

from rigup.facts.once import read_facts_once

read_facts_once(state)  # first: the host's recorded facts are read while the rest of the deploy loads

from rigup.operations.call_order import lean_call_order  # noqa: E402
from rigup.operations.preflight import preflight_checks  # noqa: E402

lean_call_order()

preflight_checks(name="Run preflight checks (a failed check fails this host)")
