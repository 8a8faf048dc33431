"""The deploy up to Docker (preflight, NVIDIA driver, Docker), as deploy.py runs it; tests/e2e/test_engine.py
converges a test-bed rig with it against the repository holding the real engine. Run from the repo root."""

from pyinfra import local

local.include("tasks/preflight.py")
local.include("tasks/nvidia_driver.py")
local.include("tasks/docker.py")
