# Every knob rigup reads, declared once with its default. Groups and hosts override, never add:
# inventory.py rejects a key that is not declared here. Derived values (image names with the
# registry, per-release apt suites) are computed in rigup at the point of use, not here. A knob whose
# default follows another knob is None here and says so; rigup.desired.knobs.knob() derives it.

_sudo = True  # pyinfra global argument: run operations through sudo (the SSH user needs it)

# --- Variant -------------------------------------------------------------------------------
variant = "dual"  # catalog variant this host serves (list: .venv/bin/rigup render --list)
gpu_count = None  # int or None: GPUs this host must have; preflight fails on a different count
variant_overrides = {}  # per-host recipe overrides: max_model_len, gpu_memory_utilization, port, ...
cluster = None  # derived, never set by hand: the fleet file's `clusters` entry this host is a member of, with its rank (rigup.desired.cluster)
pods = []  # several endpoints on GPU subsets: [{name, variant, gpus: [0, 1] or a count, port, variant_overrides}]; replaces variant/variant_overrides; [] = one pod named after variant

# --- Paths on the rig ----------------------------------------------------------------------
install_root = "/opt/rigup"  # compose/env files, sources, state and provenance live under it
model_dir = None  # model and draft directories (mounted into the container); None: {install_root}/models

# --- Preflight ------------------------------------------------------------------------------
preflight_os_allowed = ["ubuntu 22.04", "ubuntu 24.04"]  # "<os-release ID> <VERSION_ID>" list
preflight_disk_margin_gb = 10.0  # GB free beyond model + image + sources before anything starts
preflight_vram_misfit = "fail"  # fail|warn: what a variant that does not fit the GPUs' VRAM does

# --- NVIDIA driver -------------------------------------------------------------------------
nvidia_driver_branch = 580  # wanted driver branch; an installed branch below it is replaced
nvidia_driver_flavour = "open"  # open|proprietary kernel modules (open needs Turing or newer)
nvidia_driver_source = "ubuntu"  # ubuntu (archive, Canonical-signed modules)|cuda (NVIDIA's repo)
nvidia_cuda_repo_url = "https://developer.download.nvidia.com/compute/cuda/repos"  # + /ubuntu2404/x86_64
nvidia_cuda_repo_key_url = "https://developer.download.nvidia.com/compute/cuda/repos/{distro}/x86_64/3bf863cc.pub"  # {distro}: ubuntu2404
driver_reboot = "auto"  # auto: reboot when the loaded module is not the wanted one|never: report only
driver_reboot_timeout_s = 900  # seconds to wait for a rig to come back after a reboot
gpu_persistence_enabled = True  # nvidia-smi -pm 1 at boot (oneshot unit)
gpu_power_cap_watts = None  # int: W per GPU at boot on every card; None: gpu_power_cap_by_model decides
gpu_power_cap_by_model = {"NVIDIA GeForce RTX 3090": 230}  # W at boot by card model (the seeds' 230 W for the 3090); other cards keep their own limit
gpu_interconnect = "auto"  # auto|force_on|force_off: NVLink NCCL settings (custom all-reduce) from nvidia-smi topo, or forced

# --- Docker --------------------------------------------------------------------------------
docker_apt_url = "https://download.docker.com/linux/ubuntu"  # apt repository (suite = release codename)
docker_apt_key_url = "https://download.docker.com/linux/ubuntu/gpg"  # ASCII-armoured signing key
docker_packages = ["docker-ce", "docker-ce-cli", "containerd.io", "docker-compose-plugin"]  # apt packages
docker_insecure_registries = []  # "host:port" registries Docker may pull from over plain HTTP (merged into daemon.json)

# --- NVIDIA container toolkit ---------------------------------------------------------------
nvidia_ctk_apt_url = "https://nvidia.github.io/libnvidia-container/stable/deb"  # + /$(ARCH)
nvidia_ctk_apt_key_url = "https://nvidia.github.io/libnvidia-container/gpgkey"  # signing key
nvidia_ctk_packages = ["nvidia-container-toolkit"]  # apt packages
gpu_smoke_image = "nvidia/cuda:12.6.0-base-ubuntu22.04"  # image whose nvidia-smi must see every GPU

# --- Container images ----------------------------------------------------------------------
container_registry = "docker.io"  # registry prefix for every image (point at a mirror)
image_mirror_host = None  # str or None: fleet host that runs a pull-through mirror (the distribution registry) of container_registry; every other rig naming it runs a relay of it on 127.0.0.1, filled along the fleet's chain (model_fleet_*), and pulls rigup's images from there. None: rigs pull from container_registry
image_mirror_port = 5000  # TCP port the mirror serves plain HTTP on (every address), and a rig's relay on 127.0.0.1
image_mirror_max_gb = 200  # bound of the mirror's cache on disk; above it, images no rig pins now are pruned, least recently cached first
image_mirror = None  # derived, never set by hand: {host, address, port} of the mirror this host pulls through (rigup.desired.image_mirror)

# --- Sources (git) --------------------------------------------------------------------------
vllm_fork_git_url = "https://github.com/noonghunna/vllm.git"  # patched vLLM fork (Marlin files)
genesis_git_url = "https://github.com/Sandermage/genesis-vllm-patches.git"  # Genesis patch tree
club3090_git_url = "https://github.com/noonghunna/club-3090.git"  # the recipes (compose files) and what they mount
qwen36_dual_3090_git_url = "https://github.com/noonghunna/qwen36-dual-3090.git"  # the frozen dual-card recipes
source_refs = {}  # catalog source name (see rigup/desired/catalog.yaml) -> branch, tag or commit replacing its pin

# --- Models (Hugging Face) -----------------------------------------------------------------
hf_endpoint = "https://huggingface.co"  # Hugging Face endpoint or mirror (HF_ENDPOINT)
hf_token_file = None  # control-machine path of a 0600 file holding HF_TOKEN; env HF_TOKEN wins
lock_file = "rigs.lock.yaml"  # lock file on the control machine (relative to the inventory)
ca_bundle = None  # control-machine path of a PEM bundle (relative: to the fleet file's directory) the control machine's HTTPS clients (rigup lock: git, the Hugging Face API, registries) check servers against: your mirror's or TLS-intercepting proxy's CA; None: the system's trust store. Rigs use their own system store (docs/security.md)
model_reverify = False  # True: re-hash every model file instead of trusting verified stamps
model_download_retries = 3  # attempts per file before the host fails on a hash mismatch
model_fleet_source = "auto"  # auto: the rigs holding a model (or an image, with image_mirror_host) form a chain: one reads the hub (the mirror), each other forwards verified pieces to the next|off
model_fleet_port = 8765  # TCP port a rig serves its chain peers verified model (and image) pieces on (token-protected, only while a peer needs files)
model_fleet_address = None  # str or None: address peers use to reach this rig's file server; None: its ssh_hostname

# --- Serving -------------------------------------------------------------------------------
serving_bind_address = "0.0.0.0"  # host address the API port is published on
container_network_at_start = True  # the serving container may reach PyPI at start (some recipes pip-install)
serving_api_key_file = None  # control-machine path of a 0600 file holding your API key for every pod of the host; None: each pod its own key, made on the control machine (fleet_ca_dir/pod-keys)
serving_health_timeout_s = None  # seconds for the health gate; None scales with model size
serving_keep_generations = 2  # rendered generations kept for rollback (current + previous)

# --- Clusters: one variant across several rigs (the fleet file's `clusters`), vLLM's Ray backend ---
cluster_ray_port = 6379  # Ray's GCS on the head, what workers join (vLLM's examples/online_serving/run_cluster.sh: --port=6379)
cluster_ray_node_manager_port = 6380  # each member's raylet (Ray picks a random one unless pinned: pinned for the firewall)
cluster_ray_object_manager_port = 6381  # each member's object manager
cluster_ray_agent_port = 52365  # the first of 4 consecutive ports of each member's Ray agents: dashboard agent gRPC and HTTP, runtime-env agent, metrics export
cluster_ray_worker_ports = [10002, 10100]  # first and last port of each member's Ray worker processes (Ray's range starts at 10002)

# --- Gateway: the fleet's entrance (nginx front, one vllm-router per model; routes from what each rig serves) ---
gateway_group = "gateway"  # inventory group whose hosts run the gateway (a rig, or a host with serves_variant: False)
serves_variant = True  # False: a gateway-only host (no GPU, driver, Docker, sources, model or variant)
gateway_bind_address = "0.0.0.0"  # address the gateway listens on
gateway_port = 4000  # the gateway's TCP port
gateway_api_key_file = None  # control-machine path of a 0600 file holding a key clients send (client "default"); this or gateway_clients is required on a gateway host
gateway_clients = []  # the entrance's clients, each {name: lowercase name, key_file: control-machine path of its 0600 key file (made with a new key if absent)}; a client removed here is refused at the next converge
gateway_tls_cert_file = None  # control-machine path of the front's certificate (PEM, its chain after it); None: one the fleet CA issues at converge for the gateway host's names (docs/gateway.md)
gateway_tls_key_file = None  # control-machine path of that certificate's private key, a 0600 file; set with gateway_tls_cert_file
gateway_tls_ca_file = None  # control-machine path of the CA certificate (PEM) that issued gateway_tls_cert_file: what rigup verify/bench/top/status and the monitor trust for the front; None: the system's trust store (a publicly issued certificate)
gateway_plain_http = False  # True: the front speaks plain HTTP, no TLS (the clients' keys cross the network in the clear): only behind a TLS terminator of your own; False: TLS, with gateway_tls_cert_file or the fleet CA's certificate
gateway_pip_index_url = None  # PEP 503 index the hash-pinned router (files/router/requirements.txt) installs from; None: pip's own config as root on the gateway host (pip.conf, PIP_INDEX_URL), else PyPI
gateway_health_check_interval_s = 10  # seconds between the gateway's checks of each route; a failing route leaves rotation
gateway_num_retries = 2  # a failed request is retried this many times, on another rig serving the same model
gateway_ready_timeout_s = 180  # seconds a (re)started gateway has to answer before the host fails
gateway_score_sample_rate = 0.05  # share of the pods' completions (chat and text, whole or streamed) the entrance's hop scores for degenerate text by club-3090's verify-full rules, counting verdicts per pod and model, never keeping text (RigupPodDegenerateAnswers; docs/sentinel.md); 0: none
gateway_quarantine_removes_last_route = False  # a pod its rig's sentinel quarantined leaves its model's routes within a second; when every pod of a model is quarantined, False keeps them routed (the model answers, wrongly, and RigupPodQuarantined says so), True takes them out too (the model answers 503) (docs/sentinel.md)

# --- Fleet CA: one CA on the control machine issues each host's service certificates at converge (docs/security.md) ---
fleet_ca_dir = "fleet-ca"  # control-machine directory (0700; a .gitignore of * in it) of rigup's CA (ca.key 0600, ca.crt) and the certificates it issued; relative: to the fleet file's directory, like lock_file
fleet_ca_cert_file = None  # control-machine path of your own CA's certificate (PEM); None: rigup's CA in fleet_ca_dir, made on first use
fleet_ca_key_file = None  # control-machine path of your own CA's private key, a 0600 file; set with fleet_ca_cert_file
fleet_ca_key_passphrase_file = None  # control-machine path of a 0600 file holding that key's passphrase (openssl reads it from the file); None: the key is not encrypted
fleet_cert_days = 365  # days a certificate issued at converge is valid
fleet_cert_renew_days = 30  # a certificate with this many days left or fewer is issued anew at the next converge
metrics_password_file = None  # control-machine path of a 0600 file holding the metrics login's password: node_exporter, the DCGM exporter, Prometheus and Alertmanager ask it (bcrypt basic auth), Prometheus, Grafana and rigup top present it; None: one made once in fleet_ca_dir (metrics.password, 0600)

# --- The fleet's boundary: default deny on every host, holes from the fleet's roles (docs/security.md's port table) ---
firewall = True  # rigup-boundary.service loads rigup's nftables table: SSH, the entrance, and each internal service from the members that use it; False: no table (preflight warns)
firewall_allow = []  # your own networks the boundary admits too: "NETWORK" (every port) or "NETWORK PORT[-PORT]", e.g. ["192.168.1.0/24", "10.8.0.5 8000-8100"]

# --- Monitoring: Prometheus over every pod, GPU, node and the gateway, with rigup's alert rules ---
metrics_exporters = True  # rigs run prometheus-node-exporter (OS archive, rigup's facts as a textfile) and the GPU exporter container
node_exporter_port = 9100  # node_exporter's TCP port on each rig (the package's own default)
gpu_exporter_image = "nvcr.io/nvidia/k8s/dcgm-exporter:4.5.3-4.8.2-ubuntu22.04"  # NVIDIA's DCGM exporter, registry/repository:tag; its digest is pinned in the lock like a variant's image
gpu_exporter_port = 9400  # the GPU exporter's TCP port on each rig (its own default)
monitor_group = None  # inventory group whose hosts run Prometheus over the fleet; None: gateway_group's hosts
prometheus_listen_address = "0.0.0.0:9090"  # Prometheus' web and API address on the monitor host
prometheus_retention = "15d"  # how long Prometheus keeps samples (its --storage.tsdb.retention.time)
prometheus_scrape_interval_s = 15  # seconds between scrapes of every target
metrics_facts_interval_s = 15  # seconds between refreshes of rigup's facts for node_exporter (rigup-metrics.timer: releases, gates, drift, the driver, the models' filesystem); each run is a Python start on the rig
sentinel_interval_s = 30  # seconds between the sentinel's rounds on each rig: every serving pod asked the gate's probes directly (docs/sentinel.md)
sentinel_fail_after = 2  # rounds in a row with a wrong answer that quarantine a pod (RigupPodQuarantined); 2 catches a pod within 2 intervals while one odd answer does not
sentinel_pass_after = 3  # rounds in a row with every answer right that release a quarantined pod (a converge that changes it releases it too)
alert_ttft_p95_s = 10.0  # seconds: time to first token p95 over 5 min above this, for 10 min, alerts
alert_gpu_temp_c = 83  # degrees C: a GPU at or above this for 5 min alerts (the RTX 3090's slowdown is ~83-88 C)
alert_disk_free_ratio = 0.10  # the model directory's filesystem with less than this fraction free alerts
alert_for_s = {}  # alert name -> seconds its condition must hold before it fires (Prometheus' for:), over rigup's (docs/monitoring.md), e.g. {RigupReleaseDrift: 1800}
alertmanager_webhook_url_file = None  # control-machine path of a 0600 file holding a webhook URL; set: Alertmanager (OS archive) sends every alert there
alertmanager_port = 9093  # Alertmanager's TCP port on the monitor host (its own default)
grafana = False  # True: Grafana on the monitor host with rigup's datasource and dashboards (from grafana_apt_url)
grafana_apt_url = "https://apt.grafana.com"  # Grafana's signed apt repository (suite stable, component main)
grafana_apt_key_url = "https://apt.grafana.com/gpg.key"  # its signing key
grafana_port = 3000  # Grafana's TCP port on the monitor host (its own default)
vllm_git_url = "https://github.com/vllm-project/vllm.git"  # vLLM's repository: with grafana, its official dashboards at the vLLM version of each image the fleet serves (pinned by `rigup lock`)
vllm_dashboards_path = "examples/observability/dashboards/grafana"  # where that repository keeps them (its README there, at 0b9faa41)

# --- Rollout -------------------------------------------------------------------------------
rollout_canary_group = "canary"  # inventory group converged and gated before the rest
rollout_batch = 1  # hosts rebooted or restarted at a time during a rollout
rollout_max_failures = 0  # failed hosts tolerated before the rollout stops
