"""The host layer alone (preflight, NVIDIA driver, Docker, the image mirror, container toolkit), as deploy.py runs it;
tests/e2e/test_hostlayer.py converges test-bed hosts with it. Run from the repo root."""

from pyinfra import host, local, state

from rigup.pyinfra_patches import enable_pyinfra_patches
from rigup.runstate import print_summary_at_the_end, runs_image_mirror_task, runs_rig_tasks

enable_pyinfra_patches(state)
print_summary_at_the_end(state)

local.include("tasks/preflight.py")
if runs_rig_tasks(host):
    local.include("tasks/nvidia_driver.py")
    local.include("tasks/docker.py")
if runs_image_mirror_task(host):
    local.include("tasks/image_mirror.py")
if runs_rig_tasks(host):
    local.include("tasks/container_toolkit.py")
