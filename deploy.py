"""Provision a GPU rig into a pinned, verified vLLM server.

Phases, in order (each task file's docstring says what is true afterwards and what it restarts):
  preflight          facts only: OS, GPUs, VRAM, CUDA, disk, Secure Boot; fails before any change
  nvidia_driver      driver branch installed, loaded (reboot when allowed), held; power cap unit
  docker             Docker CE + compose plugin from Docker's signed repository
  container_toolkit  NVIDIA container toolkit wired into Docker; GPU smoke container
  sources            vLLM fork and Genesis checked out at the locked commits
  model              model (and draft) files verified against the locked SHA-256
  serving            compose/env/unit rendered; (re)started only on change; health gate
  gateway            on gateway_group hosts: LiteLLM proxy routing to what each rig serves now
  summary            no operation: a table of what the converge did on each host, at the end

Run: pyinfra inventory.py deploy.py [--limit GROUP] [--dry]
"""

from pyinfra import local

local.include("tasks/preflight.py")
local.include("tasks/nvidia_driver.py")
local.include("tasks/docker.py")
local.include("tasks/container_toolkit.py")
local.include("tasks/sources.py")
local.include("tasks/model.py")
local.include("tasks/serving.py")
local.include("tasks/gateway.py")
local.include("tasks/summary.py")
