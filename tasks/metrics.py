"""Metrics: the rig exposes what the fleet's Prometheus scrapes, beside what vLLM serves itself.

True afterwards: prometheus-node-exporter (the OS package) runs on node_exporter_port, asking for TLS
with its fleet-CA certificate and basic auth (its web config under /etc/prometheus/rigup-web: the
certificate issued or renewed on the control machine by rigup.desired.fleet_ca, its key 0600 for the
prometheus user; rigup.desired.metrics_auth), with the systemd
collector over rigup's and Docker's units and the textfile collector reading
/var/lib/prometheus/node-exporter (flags in /etc/default/prometheus-node-exporter);
rigup-metrics.timer runs `rigup-servingctl textfile` every metrics_facts_interval_s (15 s), writing rigup.prom there: per pod the
release it serves, its generation, the last gate's result, whether the fleet still asks it for a
release that failed its gate, rollbacks, pinned commits and release drift, the driver branch loaded and wanted, the models' filesystem;
rigup-sentinel.timer runs `rigup-servingctl sentinel` every sentinel_interval_s, asking every serving pod
the gate's probes and writing rigup-sentinel.prom there (docs/sentinel.md); the GPU exporter image
(gpu_exporter_image, by its locked digest) is pulled and rigup-gpu-exporter.service runs it with every
GPU on gpu_exporter_port, at boot too, reading rigup's DCGM fields (files/monitoring/dcgm-counters.csv,
uploaded to {install_root}/metrics/) and asking for TLS and basic auth as node_exporter does (its own
certificate, key and web config under /etc/prometheus/rigup-web, mounted read-only into its container).
Reads: metrics_exporters, serves_variant, node_exporter_port, metrics_facts_interval_s, sentinel_interval_s,
sentinel_fail_after, sentinel_pass_after, gpu_exporter_image, gpu_exporter_port, install_root, model_dir,
nvidia_driver_branch, lock_file, docker_insecure_registries, fleet_ca_dir, fleet_ca_cert_file,
fleet_ca_key_file, fleet_ca_key_passphrase_file, fleet_cert_days, fleet_cert_renew_days,
metrics_password_file, model_fleet_address.
Restarts: prometheus-node-exporter when its flags, certificate, key or web config changed after it started; rigup-gpu-exporter when
its unit (the image digest, the port), its fields file, certificate, key or web config changed after it started. Nothing else.
Without the GPU exporter's pin in the lock: a --dry run warns and plans nothing here; a real run stops.
Included by deploy.py on hosts that passed preflight and serve a variant, after serving.
"""

import posixpath
from dataclasses import replace
from io import StringIO

from pyinfra import host
from pyinfra.operations import files, systemd
from pyinfra.operations.util import any_changed

from rigup.desired.knobs import knob
from rigup.desired.metrics_auth import GPU_EXPORTER_SERVICE, NODE_EXPORTER_SERVICE, node_exporter_web_flag
from rigup.desired.monitoring import (
    FACTS_TIMER,
    FACTS_UNIT,
    GPU_COUNTERS_FILE,
    GPU_EXPORTER_UNIT,
    NODE_EXPORTER_DEFAULTS_FILE,
    NODE_EXPORTER_UNIT,
    PROMETHEUS_USER,
    SENTINEL_TIMER,
    SENTINEL_UNIT,
    TEXTFILE_DIR,
)
from rigup.facts.system import OsReleaseInfo
from rigup.operations.apt import os_packages
from rigup.operations.fleet_certs import fleet_ca_of, service_web_files
from rigup.operations.planning_errors import rig_exporters_or_stop
from rigup.operations.serving import ctl_path, image_pulled
from rigup.operations.units import unit_runs_current_files

exporters = rig_exporters_or_stop(host)
if exporters is not None:
    os_info = host.get_fact(OsReleaseInfo)  # read by preflight: node_exporter's web-config flag follows the release
    exporters = replace(exporters, web_config_flag=node_exporter_web_flag(
        os_info.id if os_info else None, os_info.version_id if os_info else None))
    fleet_ca, metrics_login = fleet_ca_of(host)
    # without Recommends (prometheus-node-exporter-collectors' timers): rigup's textfile is the one it reads
    os_packages(name="Install prometheus-node-exporter", packages=["prometheus-node-exporter"], no_recommends=True)
    web_files = service_web_files(host, fleet_ca, metrics_login, NODE_EXPORTER_SERVICE, owner=PROMETHEUS_USER)
    files.put(
        name="Set node_exporter's flags (port, web config, textfile directory, systemd collector)",
        src=StringIO(exporters.defaults_text()),
        dest=NODE_EXPORTER_DEFAULTS_FILE,
        mode="644",
    )
    unit_runs_current_files(
        name="Run node_exporter on its current flags, certificate and web config",
        unit=NODE_EXPORTER_UNIT,
        files=[NODE_EXPORTER_DEFAULTS_FILE, *web_files],
    )
    files.directory(name="Create the textfile directory", path=TEXTFILE_DIR, mode="755")
    facts_unit = files.put(
        name="Write the unit that writes rigup's facts for node_exporter",
        src=StringIO(exporters.facts_unit_text(
            ctl_path(exporters.install_root), knob(host.data, "nvidia_driver_branch"), knob(host.data, "model_dir"))),
        dest=f"/etc/systemd/system/{FACTS_UNIT}",
        mode="644",
    )
    facts_timer = files.put(
        name="Write its timer (every metrics_facts_interval_s)",
        src=StringIO(exporters.facts_timer_text()),
        dest=f"/etc/systemd/system/{FACTS_TIMER}",
        mode="644",
    )
    ctl = ctl_path(exporters.install_root)
    sentinel_unit = files.put(
        name="Write the sentinel's unit (the gate's probes asked of every serving pod)",
        src=StringIO(exporters.sentinel_unit_text(ctl)),
        dest=f"/etc/systemd/system/{SENTINEL_UNIT}",
        mode="644",
    )
    sentinel_timer = files.put(
        name="Write the sentinel's timer (every sentinel_interval_s)",
        src=StringIO(exporters.sentinel_timer_text()),
        dest=f"/etc/systemd/system/{SENTINEL_TIMER}",
        mode="644",
    )
    systemd.daemon_reload(name="Reload systemd for the facts and sentinel units",
                          _if=any_changed(facts_unit, facts_timer, sentinel_unit, sentinel_timer))
    systemd.service(name="Run rigup's facts timer", service=FACTS_TIMER, running=True, enabled=True)
    systemd.service(name="Run rigup's sentinel timer", service=SENTINEL_TIMER, running=True, enabled=True)
    image_pulled(name="Pull the GPU exporter image", ref=exporters.image.ref)
    files.directory(name="Create the metrics directory", path=posixpath.dirname(exporters.counters_file), mode="755")
    files.put(
        name="Upload rigup's DCGM fields for the GPU exporter",
        src=str(GPU_COUNTERS_FILE),
        dest=exporters.counters_file,
        mode="644",
    )
    gpu_web_files = service_web_files(host, fleet_ca, metrics_login, GPU_EXPORTER_SERVICE, owner=PROMETHEUS_USER)
    files.put(
        name="Write the GPU exporter's systemd unit",
        src=StringIO(exporters.gpu_unit_text()),
        dest=f"/etc/systemd/system/{GPU_EXPORTER_UNIT}",
        mode="644",
    )
    unit_runs_current_files(
        name="Run the GPU exporter on its current unit, fields, certificate and web config",
        unit=GPU_EXPORTER_UNIT,
        files=[f"/etc/systemd/system/{GPU_EXPORTER_UNIT}", exporters.counters_file, *gpu_web_files],
    )
