"""The host layer alone (preflight, NVIDIA driver, Docker, container toolkit), as deploy.py runs it;
tests/e2e/test_hostlayer.py converges test-bed hosts with it. Run from the repo root."""

from pyinfra import local

local.include("tasks/preflight.py")
local.include("tasks/nvidia_driver.py")
local.include("tasks/docker.py")
local.include("tasks/container_toolkit.py")
