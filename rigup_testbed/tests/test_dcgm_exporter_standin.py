"""The DCGM exporter stand-in (standins/dcgm_exporter.py) and its image (registry.dcgm_exporter_image),
against NVIDIA/dcgm-exporter's facts (rigup_testbed/FACTS.md section 12).

The exporter runs as a process in a scratch root laid out as the container toolkit's hook leaves a GPU
container: the driver's nvidia-smi (the GPU stand-in's module, its directory beside it), the loaded
module's /proc/driver/nvidia/version, the container's hardware file, and the driver's /run state."""

from __future__ import annotations

import base64
import gzip
import io
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import bcrypt
import pytest
from prometheus_client.parser import text_string_to_metric_families

from rigup_testbed import hardware, registry
from rigup_testbed.image import cache_dir
from rigup_testbed.standin_modules import STANDINS, load_standin

dcgm = load_standin("dcgm_exporter")
EXPORTER = STANDINS / "dcgm_exporter.py"

# NVIDIA/dcgm-exporter@691c92762eb551313c825f6efe4ceeee20982801 (4.5.3-4.8.2) etc/default-counters.csv:
# its enabled lines, in order, with their Prometheus types
DEFAULT_COUNTERS = [
    ("DCGM_FI_DEV_SM_CLOCK", "gauge"), ("DCGM_FI_DEV_MEM_CLOCK", "gauge"), ("DCGM_FI_DEV_MEMORY_TEMP", "gauge"),
    ("DCGM_FI_DEV_GPU_TEMP", "gauge"), ("DCGM_FI_DEV_POWER_USAGE", "gauge"),
    ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "counter"), ("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "counter"),
    ("DCGM_FI_DEV_GPU_UTIL", "gauge"), ("DCGM_FI_DEV_MEM_COPY_UTIL", "gauge"), ("DCGM_FI_DEV_ENC_UTIL", "gauge"),
    ("DCGM_FI_DEV_DEC_UTIL", "gauge"), ("DCGM_FI_DEV_XID_ERRORS", "gauge"), ("DCGM_FI_DEV_FB_FREE", "gauge"),
    ("DCGM_FI_DEV_FB_USED", "gauge"), ("DCGM_FI_DEV_FB_RESERVED", "gauge"),
    ("DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", "counter"), ("DCGM_FI_DEV_VGPU_LICENSE_STATUS", "gauge"),
    ("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "counter"), ("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "counter"),
    ("DCGM_FI_DEV_ROW_REMAP_FAILURE", "gauge"), ("DCGM_FI_DRIVER_VERSION", "label"),
    ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "gauge"), ("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "gauge"),
    ("DCGM_FI_PROF_DRAM_ACTIVE", "gauge"), ("DCGM_FI_PROF_PCIE_TX_BYTES", "gauge"), ("DCGM_FI_PROF_PCIE_RX_BYTES", "gauge"),
]
DRIVER = "580.95.05"
LEADING_LABELS = ["gpu", "UUID", "pci_bus_id", "device", "modelName", "Hostname"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class GpuContainer:
    """A scratch root as a GPU container's is after the toolkit's hook ran (or, with driver=False, as one
    started without GPUs)."""

    def __init__(self, path: Path, preset: str = "2x3090", driver: bool = True):
        self.path = path
        self.hw = hardware.preset(preset, "rig-01")
        (path / "proc/sys/kernel/random").mkdir(parents=True)
        (path / "proc/sys/kernel/random/boot_id").write_text("00000000-0000-0000-0000-000000000001\n")
        (path / "run/nvidia-standin/procs").mkdir(parents=True)
        (path / "etc/dcgm-exporter").mkdir(parents=True)
        self.counters = path / "etc/dcgm-exporter/default-counters.csv"
        self.counters.write_text(dcgm.default_counters_csv())
        if driver:
            utils = path / "usr/lib/nvidia-standin/utils"
            utils.mkdir(parents=True)
            for module in ("nvidia_smi.py", "common.py"):
                shutil.copy(STANDINS / module, utils / module)
            (utils / "userspace.json").write_text(json.dumps({"version": DRIVER, "branch": "580", "cuda": "13.0"}))
            (path / "usr/bin").mkdir(parents=True)
            (path / "usr/bin/nvidia-smi").symlink_to("../lib/nvidia-standin/utils/nvidia_smi.py")
            (path / "proc/driver/nvidia").mkdir(parents=True)
            (path / "proc/driver/nvidia/version").write_text(
                f"NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  {DRIVER}  Release Build\n")
            (path / "etc/rigup-testbed").mkdir(parents=True)
            (path / "etc/rigup-testbed/hardware.json").write_text(self.hw.to_json())
        self.env = {**os.environ, "RIGUP_STANDIN_ROOT": str(path), "NODE_NAME": "rig-01"}

    def set_gpu_state(self, index: int, **values: Any) -> None:
        """What a test does to a GPU on a rig (nvidia_smi.set_gpu_state), in this root."""
        code = ("import sys, json; sys.path.insert(0, sys.argv[1]); import nvidia_smi; "
                "nvidia_smi.set_gpu_state(sys.argv[2], **json.loads(sys.argv[3]))")
        subprocess.run([sys.executable, "-c", code, str(self.path / "usr/lib/nvidia-standin/utils"),
                        self.hw.gpus[index].uuid, json.dumps(values)], env=self.env, check=True)

    def start(self, *args: str) -> tuple[subprocess.Popen[str], str]:
        port = _free_port()
        proc = subprocess.Popen([sys.executable, str(EXPORTER), "-f", str(self.counters), "-a", f"127.0.0.1:{port}",
                                 *args], env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 15
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2).read()
                return proc, url
            except (urllib.error.URLError, ConnectionError):
                if proc.poll() is not None or time.monotonic() > deadline:
                    proc.kill()
                    raise AssertionError(proc.communicate()[1]) from None
                time.sleep(0.05)


@pytest.fixture
def container(tmp_path: Path) -> GpuContainer:
    return GpuContainer(tmp_path / "root")


@pytest.fixture
def exporter(container: GpuContainer) -> Iterator[tuple[GpuContainer, str, subprocess.Popen[str]]]:
    proc, url = container.start()
    try:
        yield container, url, proc
    finally:
        proc.terminate()
        proc.wait(10)


def scrape(url: str) -> tuple[str, dict[str, Any], dict[str, str]]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
        return text, {f.name: f for f in text_string_to_metric_families(text)}, dict(response.headers)


def per_gpu(fams: dict[str, Any], name: str) -> dict[str, Any]:
    return {s.labels["gpu"]: s for s in fams[name].samples}


def test_the_default_counters_file_has_upstreams_fields_types_and_order() -> None:
    lines = [line for line in dcgm.default_counters_csv().splitlines() if line and not line.startswith("#")]
    records = [[part.strip() for part in line.split(",")] for line in lines]
    assert all(len(r) == 3 for r in records)  # no comma in a help text: the exporter reads three fields a record
    assert [(r[0], r[1]) for r in records] == DEFAULT_COUNTERS


def test_the_metrics_are_the_exporters_format_with_every_gpus_labels(exporter: tuple[GpuContainer, str, Any]) -> None:
    container, url, _ = exporter
    text, fams, headers = scrape(url)
    assert headers["Content-Type"] == "text/plain; charset=utf-8"
    temps = per_gpu(fams, "DCGM_FI_DEV_GPU_TEMP")
    assert set(temps) == {"0", "1"}
    for gpu in container.hw.gpus:
        labels = temps[str(gpu.index)].labels
        assert labels == {"gpu": str(gpu.index), "UUID": gpu.uuid, "pci_bus_id": gpu.pci_bus_id,
                          "device": f"nvidia{gpu.index}", "modelName": "NVIDIA GeForce RTX 3090", "Hostname": "rig-01",
                          "DCGM_FI_DRIVER_VERSION": DRIVER}
    assert temps["0"].value == 35  # idle: what the GPU stand-in's nvidia-smi reports
    line = next(line for line in text.splitlines() if line.startswith("DCGM_FI_DEV_GPU_TEMP{"))
    # the exporter's template: fixed leading labels in its order, no spaces, integers printed as integers
    assert [part.split("=")[0] for part in line.split("{", 1)[1].split("}")[0].split(",")] == \
        LEADING_LABELS + ["DCGM_FI_DRIVER_VERSION"]
    assert line.endswith("} 35")
    power = next(line for line in text.splitlines() if line.startswith("DCGM_FI_DEV_POWER_USAGE{"))
    assert power.endswith("} 20.000000")  # a DCGM double: six decimals
    assert "# HELP DCGM_FI_DEV_GPU_TEMP " in text and "# TYPE DCGM_FI_DEV_GPU_TEMP gauge" in text
    assert fams["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"].type == "counter"
    xid = per_gpu(fams, "DCGM_FI_DEV_XID_ERRORS")
    assert xid["0"].value == 0 and xid["0"].labels["err_code"] == "0" and xid["0"].labels["err_msg"] == "No Error"
    # GeForce: no memory temperature, no row remapping, no profiling (DCGM's profiling module does not load)
    assert not {n for n in fams if n.startswith("DCGM_FI_PROF_")}
    assert "DCGM_FI_DEV_MEMORY_TEMP" not in fams and "DCGM_FI_DEV_ROW_REMAP_FAILURE" not in fams
    assert fams["DCGM_FI_DEV_FB_USED"].samples[0].value == 1
    with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
        assert response.read() == b"OK"
    with pytest.raises(urllib.error.HTTPError) as missing:
        urllib.request.urlopen(f"{url}/nope", timeout=5)
    assert missing.value.code == 404


def test_a_hot_gpu_an_xid_and_a_gpu_process_show_at_the_next_scrape(exporter: tuple[GpuContainer, str, Any]) -> None:
    container, url, _ = exporter
    container.set_gpu_state(1, temperature_c=91, xid=79)
    procs = container.path / "run/nvidia-standin/procs"
    (procs / "vllm.json").write_text(json.dumps({"pid": os.getpid(), "pidns": "", "name": "VLLM::EngineCore",
                                                 "gpus": [container.hw.gpus[0].uuid], "used_mib": 21000}))
    _, fams, _ = scrape(url)
    temps = per_gpu(fams, "DCGM_FI_DEV_GPU_TEMP")
    assert temps["1"].value == 91 and temps["0"].value == 45  # GPU 0 runs a process now: warmer
    xid = per_gpu(fams, "DCGM_FI_DEV_XID_ERRORS")["1"]
    assert xid.value == 79 and xid.labels["err_code"] == "79" and xid.labels["err_msg"] == "GPU has fallen off the bus"
    used = per_gpu(fams, "DCGM_FI_DEV_FB_USED")
    assert used["0"].value == 21001 and used["1"].value == 1
    assert per_gpu(fams, "DCGM_FI_DEV_FB_FREE")["0"].value == 24576 - 21001
    assert per_gpu(fams, "DCGM_FI_DEV_SM_CLOCK")["0"].value > per_gpu(fams, "DCGM_FI_DEV_SM_CLOCK")["1"].value
    container.set_gpu_state(1, temperature_c=None, xid=None)
    _, fams, _ = scrape(url)
    assert per_gpu(fams, "DCGM_FI_DEV_GPU_TEMP")["1"].value == 35 and per_gpu(fams, "DCGM_FI_DEV_XID_ERRORS")["1"].value == 0



def test_an_engine_serving_moves_utilisation_power_and_temperature_at_the_next_scrape(
        exporter: tuple[GpuContainer, str, Any]) -> None:
    """What an engine serves shows in DCGM's fields (the GPU stand-in under load, tests/test_gpu_load.py):
    an engine busy for ten minutes on a badly ventilated GPU 0 runs it at 100 %, held at the 83 C
    target with less than its power limit; GPU 1, idle, stays idle; the engine idle again cools down."""
    container, url, _ = exporter
    container.set_gpu_state(0, thermal_c_per_w=0.2)
    procs = container.path / "run/nvidia-standin/procs"
    now = time.time()
    busy = {"busy": 1, "at": now - 600, "fast": 0.0, "slow": 0.0}
    entry = {"pid": os.getpid(), "pidns": "", "name": "VLLM::EngineCore", "gpus": [container.hw.gpus[0].uuid],
             "used_mib": 21000, "activity": busy}
    (procs / "vllm.json").write_text(json.dumps(entry))
    _, fams, _ = scrape(url)
    assert per_gpu(fams, "DCGM_FI_DEV_GPU_UTIL")["0"].value == 100 and per_gpu(fams, "DCGM_FI_DEV_GPU_UTIL")["1"].value == 0
    assert per_gpu(fams, "DCGM_FI_DEV_GPU_TEMP")["0"].value == 83 and per_gpu(fams, "DCGM_FI_DEV_GPU_TEMP")["1"].value == 35
    assert per_gpu(fams, "DCGM_FI_DEV_POWER_USAGE")["0"].value == 300  # what holds 83 C, under the 350 W limit
    idle = {"busy": 0, "at": now - 600, "fast": 1.0, "slow": 1.0}
    (procs / "vllm.json").write_text(json.dumps({**entry, "activity": idle}))
    _, fams, _ = scrape(url)
    assert per_gpu(fams, "DCGM_FI_DEV_GPU_UTIL")["0"].value == 0 and per_gpu(fams, "DCGM_FI_DEV_GPU_TEMP")["0"].value == 45

def test_geforce_profiling_fields_are_skipped_with_the_exporters_warnings(exporter: tuple[GpuContainer, str, Any]) -> None:
    _, _, proc = exporter
    proc.terminate()
    _, err = proc.communicate(timeout=10)
    assert 'msg="Not collecting DCP metrics: This request is serviced by a module of DCGM that is not currently loaded"' in err
    # the record numbers count the file's records from 0, as the exporter's loop does
    assert "level=WARN msg=\"Skipping line 21 ('DCGM_FI_PROF_GR_ENGINE_ACTIVE'): metric not enabled\"" in err
    assert "Skipping line 25 ('DCGM_FI_PROF_PCIE_RX_BYTES')" in err
    assert 'level=INFO msg="Starting dcgm-exporter" Version=4.5.3-4.8.2' in err


def test_a_datacenter_gpu_has_profiling_fields_and_memory_temperature(tmp_path: Path) -> None:
    container = GpuContainer(tmp_path / "root", preset="1xh200")
    proc, url = container.start("--no-hostname")
    try:
        _, fams, _ = scrape(url)
    finally:
        proc.terminate()
        proc.wait(10)
    for name in ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "DCGM_FI_PROF_DRAM_ACTIVE",
                 "DCGM_FI_PROF_PCIE_TX_BYTES", "DCGM_FI_PROF_PCIE_RX_BYTES", "DCGM_FI_DEV_MEMORY_TEMP",
                 "DCGM_FI_DEV_ROW_REMAP_FAILURE"):
        assert name in fams, name
    sample = fams["DCGM_FI_DEV_GPU_TEMP"].samples[0]
    assert sample.labels["modelName"] == "NVIDIA H200" and "Hostname" not in sample.labels  # -n: no hostname
    assert per_gpu(fams, "DCGM_FI_DEV_SM_CLOCK")["0"].value == 345  # an idle H200's, as nvidia-smi read on one


def test_without_a_gpu_it_fails_as_dcgm_does(tmp_path: Path) -> None:
    container = GpuContainer(tmp_path / "root", driver=False)
    proc = subprocess.run([sys.executable, str(EXPORTER), "-f", str(container.counters)], env=container.env,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 1
    assert proc.stderr.splitlines()[-1].endswith('level=ERROR msg="error starting nv-hostengine: DCGM initialization error"')


def test_flags_environment_and_version(container: GpuContainer) -> None:
    run = subprocess.run([sys.executable, str(EXPORTER), "--version"], env=container.env, capture_output=True, text=True)
    assert run.stdout == "DCGM Exporter version 4.5.3-4.8.2\n"
    run = subprocess.run([sys.executable, str(EXPORTER), "--bogus"], env=container.env, capture_output=True, text=True)
    assert run.returncode == 1 and "flag provided but not defined: -bogus" in run.stderr
    port = _free_port()
    env = {**container.env, "DCGM_EXPORTER_LISTEN": f"127.0.0.1:{port}", "DCGM_EXPORTER_COLLECTORS": str(container.counters)}
    proc = subprocess.Popen([sys.executable, str(EXPORTER)], env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                _, fams, _ = scrape(f"http://127.0.0.1:{port}")
                break
            except (urllib.error.URLError, ConnectionError):
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.05)
        assert "DCGM_FI_DEV_GPU_TEMP" in fams
    finally:
        proc.terminate()
        proc.wait(10)
    missing = subprocess.run([sys.executable, str(EXPORTER), "-f", "/nonexistent.csv", "-a", "127.0.0.1:0"],
                             env=container.env, capture_output=True, text=True, timeout=30)
    assert missing.returncode == 1
    assert "Could not read metrics file '/nonexistent.csv'; err: open /nonexistent.csv: no such file or directory" in missing.stderr


def test_a_counters_file_of_ones_own_adds_fields(container: GpuContainer) -> None:
    container.counters.write_text("DCGM_FI_DEV_GPU_TEMP, gauge, t\nDCGM_FI_DEV_CLOCKS_EVENT_REASONS, gauge, r\n"
                                  "DCGM_FI_DEV_POWER_MGMT_LIMIT, gauge, l\n")
    proc, url = container.start()
    try:
        _, fams, _ = scrape(url)
    finally:
        proc.terminate()
        proc.wait(10)
    assert set(fams) == {"DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_CLOCKS_EVENT_REASONS", "DCGM_FI_DEV_POWER_MGMT_LIMIT"}
    assert per_gpu(fams, "DCGM_FI_DEV_CLOCKS_EVENT_REASONS")["0"].value == 1  # DCGM_CLOCKS_EVENT_REASON_GPU_IDLE
    assert per_gpu(fams, "DCGM_FI_DEV_POWER_MGMT_LIMIT")["0"].value == 350
    # no label field in the file: no DCGM_FI_DRIVER_VERSION label
    assert "DCGM_FI_DRIVER_VERSION" not in fams["DCGM_FI_DEV_GPU_TEMP"].samples[0].labels


def test_the_dcgm_exporter_image_is_built_like_nvidias() -> None:
    roots = sorted((cache_dir() / "images").glob("*/root"))
    if not roots or not Path(registry.BUSYBOX).exists():
        pytest.skip("no test-bed root image built yet (the e2e tests build it)")
    image = registry.dcgm_exporter_image(registry.python_runtime(roots[0]), registry.DCGM_EXPORTER_TAG)
    assert (image.repository, image.tag) == ("nvidia/k8s/dcgm-exporter", "4.5.3-4.8.2-ubuntu22.04")
    config = json.loads(image.config)["config"]
    assert config["Entrypoint"] == ["/usr/local/dcgm/dcgm-exporter-entrypoint.sh"] and "Cmd" not in config
    assert {"NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_DISABLE_REQUIRE=true",
            "NVIDIA_DRIVER_CAPABILITIES=compute,utility,compat32"} <= set(config["Env"])
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(image.layer))) as tar:
        members = {m.name: m for m in tar.getmembers()}
        entry = tar.extractfile("usr/local/dcgm/dcgm-exporter-entrypoint.sh")
        counters = tar.extractfile("etc/dcgm-exporter/default-counters.csv")
        assert entry is not None and counters is not None
        assert entry.read().decode().endswith('exec /usr/bin/dcgm-exporter "$@"\n')
        assert counters.read().decode() == dcgm.default_counters_csv()
    assert members["usr/bin/dcgm-exporter"].linkname == "/usr/lib/rigup-standin/dcgm_exporter.py"
    assert members["usr/bin/python3.11"].isfile() and "usr/bin/nvidia-smi" not in members  # the hook brings it
    assert registry.DCGM_EXPORTER_TAG in registry.dcgm_exporter_tags()


def test_a_web_config_asks_for_tls_and_basic_auth_as_exporter_toolkit_does(container: GpuContainer, tmp_path: Path) -> None:
    """--web-config-file (the real one's exporter-toolkit web config, pkg/cmd/app.go and internal/pkg/server/server.go
    at 4.5.3-4.8.2): TLS from its certificate and key, a bcrypt-hashed user asked of every request (401 without,
    or with a wrong password), plain HTTP answered 400; a key the web config does not know stops it."""
    key, cert = tmp_path / "gpu.key", tmp_path / "gpu.crt"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                    "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", "/CN=gpu-exporter",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    hashed = bcrypt.hashpw(b"pw-of-the-fleet", bcrypt.gensalt(10)).decode()
    web = tmp_path / "web.yml"
    web.write_text(f"# a comment\ntls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n"
                   f"basic_auth_users:\n  rigup-prometheus: {hashed}\n")
    proc = subprocess.Popen([sys.executable, str(EXPORTER), "-f", str(container.counters), "-a", f"127.0.0.1:{(port := _free_port())}",
                             "--web-config-file", str(web)], env=container.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    trusting = ssl.create_default_context(cafile=str(cert))

    def status(url: str, password: str | None = None, context: ssl.SSLContext | None = trusting) -> int:
        request = urllib.request.Request(url)
        if password is not None:
            request.add_header("Authorization", "Basic " + base64.b64encode(f"rigup-prometheus:{password}".encode()).decode())
        try:
            with urllib.request.urlopen(request, timeout=5, context=context) as reply:
                return reply.status
        except urllib.error.HTTPError as exc:
            return exc.code

    try:
        deadline = time.monotonic() + 15
        while True:
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.stderr else ""
            time.sleep(0.05)
        url = f"https://127.0.0.1:{port}/metrics"
        assert status(url) == 401 and status(url, "wrong") == 401
        assert status(url, "pw-of-the-fleet") == 200
        with pytest.raises(urllib.error.HTTPError, match="400"):  # plain HTTP on the TLS port, as Go answers it
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)
    finally:
        proc.terminate()
        proc.wait(10)
    web.write_text(web.read_text() + "tls_config:\n  cert_file: x\n")  # exporter-toolkit's web.Config has no such field
    bad = subprocess.run([sys.executable, str(EXPORTER), "-f", str(container.counters), "-a", "127.0.0.1:0",
                          "--web-config-file", str(web)], env=container.env, capture_output=True, text=True, timeout=30)
    assert bad.returncode == 1 and "field tls_config not found in type web.Config" in bad.stderr
