"""Provision a GPU rig into a pinned, verified vLLM server.

Phases, in order (each task file's docstring says what is true afterwards and what it restarts):
  preflight          facts only: OS, GPUs, VRAM, CUDA, disk, Secure Boot; fails before any change,
                     and a host it fails gets nothing more planned (a --dry run exits 1 for it)
  boundary           default deny: rigup's nftables table, holes from the fleet's roles (firewall)
  nvidia_driver      driver branch installed, loaded (reboot when allowed), held; power cap unit
  docker             Docker CE + compose plugin from Docker's signed repository
  image_mirror       on the host image_mirror_host names: the fleet's pull-through registry; on each rig
                     naming it, a relay on 127.0.0.1; every pinned image staged along the fleet's chain
                     and in each registry before any rig pulls; caches pruned to their bounds
  container_toolkit  NVIDIA container toolkit wired into Docker; GPU smoke container
  sources            vLLM fork and Genesis checked out at the locked commits
  model              model (and draft) files verified against the locked SHA-256
  serving            compose/env/unit rendered; (re)started only on change; health gate
  metrics            node_exporter with rigup's facts, the GPU exporter container (metrics_exporters)
  gateway            on gateway_group hosts: the entrance (nginx front, a vllm-router per model) over what each rig serves now
  quarantine_routes  on gateway_group hosts: a pod its rig's sentinel quarantined leaves its model's router within a second
  prometheus         on monitor_group hosts: Prometheus over every pod, GPU, node and gateway; alert rules
  alertmanager       on monitor_group hosts with alertmanager_webhook_url_file: every alert to that webhook
  grafana            on monitor_group hosts with grafana: True: rigup's and vLLM's dashboards
When the run ends, a table of what the converge did on each host.

Run: .venv/bin/pyinfra inventory.py deploy.py [--limit GROUP] [--dry]
"""

from pyinfra import host, local, state

from rigup.operations.units import every_rig_done
from rigup.pyinfra_patches import enable_pyinfra_patches
from rigup.runstate import (
    passed_preflight,
    print_summary_at_the_end,
    runs_gateway_task,
    runs_image_mirror_task,
    runs_monitor_task,
    runs_rig_tasks,
)

enable_pyinfra_patches(state)  # first: facts read once, this host's batch sent while the rest loads
print_summary_at_the_end(state)

local.include("tasks/preflight.py")
if passed_preflight(host):  # default deny before anything listens (firewall: false takes it away)
    local.include("tasks/boundary.py")
if runs_rig_tasks(host):  # passed preflight and serves a variant
    local.include("tasks/nvidia_driver.py")
    local.include("tasks/docker.py")
if runs_image_mirror_task(host):  # passed preflight and is the mirror, or a rig naming one (its relay)
    local.include("tasks/image_mirror.py")
if runs_rig_tasks(host):
    local.include("tasks/container_toolkit.py")
    local.include("tasks/sources.py")
    local.include("tasks/model.py")
    local.include("tasks/serving.py")
    local.include("tasks/metrics.py")
# One operation every host shares: what follows reads what every rig serves now, after their phases.
every_rig_done(name="Wait until every rig of this run has served")
if runs_gateway_task(host):  # passed preflight and is in gateway_group
    local.include("tasks/gateway.py")
    local.include("tasks/quarantine_routes.py")
if runs_monitor_task(host):  # passed preflight and is in monitor_group
    local.include("tasks/prometheus.py")
    local.include("tasks/alertmanager.py")
    local.include("tasks/grafana.py")
