"""Behaviour of the stand-in tools, run from the built packages in a scratch root on this machine.

Each test extracts the .deb files it needs into tmp_path (like dpkg would unpack them) and runs the
tools with RIGUP_STANDIN_ROOT pointing there, so hardware.json, /run state, boot_id and
/proc/driver/nvidia/version are all private to the test. "Reboot" = new boot_id and empty /run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.client import HTTPConnection
from pathlib import Path
from typing import Any

import pytest

from rigup_testbed import aptrepo
from rigup_testbed.image import cache_dir

FIXTURES = Path(__file__).resolve().parents[3] / "shared/fixtures/nvidia-smi/ubuntu24.04-2xH200-580.159.04"
if not FIXTURES.is_dir():  # CI lays shared/ beside the clone
    FIXTURES = Path(__file__).resolve().parents[2] / "shared/fixtures/nvidia-smi/ubuntu24.04-2xH200-580.159.04"

pytestmark = pytest.mark.skipif(not shutil.which("dpkg-deb"), reason="needs dpkg-deb")

RTX3090 = {
    "name": "NVIDIA GeForce RTX 3090", "architecture": "Ampere", "memory_total_mib": 24576, "memory_used_mib": 1,
    "compute_cap": "8.6", "power_limit_w": 350, "power_default_w": 350, "power_min_w": 100, "power_max_w": 400,
}


def hardware(n: int = 2, **extra: Any) -> dict[str, Any]:
    gpus = [dict(RTX3090, index=i, uuid=f"GPU-0000000{i}-1111-2222-3333-444444444444",
                 pci_bus_id=f"00000000:0{i + 1}:00.0") for i in range(n)]
    return {"schema": 1, "preset": f"{n}x3090", "driver_cuda": None, "secure_boot": False,
            "topology": "PIX" if n > 1 else None, "gpus": gpus, **extra}


@pytest.fixture(scope="session")
def repo() -> aptrepo.RepoInfo:
    return aptrepo.build_repos(cache_dir() / "aptrepo")


class Root:
    """A scratch root with stand-in packages unpacked into it."""

    def __init__(self, path: Path, repo: aptrepo.RepoInfo):
        self.path = path
        self.repo = repo
        (path / "proc/sys/kernel/random").mkdir(parents=True)
        (path / "run").mkdir()
        (path / "var").mkdir()
        (path / "var/run").symlink_to("../run")
        self.boot = 0
        self.reboot()
        self.env = dict(os.environ, RIGUP_STANDIN_ROOT=str(path), LC_ALL="C")
        self.env.pop("DOCKER_HOST", None)

    def install(self, *patterns: str) -> None:
        for pattern in patterns:
            debs = sorted(self.repo.root.glob(pattern))
            assert debs, pattern
            for deb in debs:  # like dpkg --unpack of every matching file
                subprocess.run(["dpkg-deb", "-x", str(deb), str(self.path)], check=True)

    def hardware(self, data: dict[str, Any]) -> None:
        p = self.path / "etc/rigup-testbed/hardware.json"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(data))

    def write(self, rel: str, text: str) -> None:
        p = self.path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)

    def reboot(self) -> None:
        """What a reboot does to the simulated machine: new boot id, empty /run, no module loaded."""
        self.boot += 1
        (self.path / "proc/sys/kernel/random/boot_id").write_text(f"00000000-0000-0000-0000-{self.boot:012d}\n")
        shutil.rmtree(self.path / "run")
        (self.path / "run").mkdir()
        shutil.rmtree(self.path / "proc/driver", ignore_errors=True)

    def tool(self, cmd: str) -> Path:
        # The command's own path (often a relative symlink into /usr/lib/...): the tools dispatch on argv[0].
        return self.path / cmd.lstrip("/")

    def run(self, cmd: str, *args: str, check: bool = False, timeout: float = 60,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        tool = self.tool(cmd if cmd.startswith("/") else f"/usr/bin/{cmd}")
        proc = subprocess.run([sys.executable, str(tool), *args], env={**self.env, **(env or {})}, text=True,
                              capture_output=True, timeout=timeout)
        if check:
            assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc

    def calls(self, log: str) -> list[dict[str, Any]]:
        p = self.path / log.lstrip("/")
        return [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []


@pytest.fixture
def root(repo: aptrepo.RepoInfo) -> Iterator[Root]:
    # A short directory of its own, not tmp_path: the stand-ins' AF_UNIX sockets under this root must stay
    # within 107 bytes whatever pytest's temporary paths are (its workers add popen-gwN/ to them).
    base = Path(tempfile.mkdtemp(prefix="rigup-root-", dir="/tmp"))
    yield Root(base / "root", repo)
    shutil.rmtree(base, ignore_errors=True)


UA = "ubuntu-archive/pool"


def install_driver(root: Root, branch: str = "580", flavour: str = "-open") -> None:
    root.install(f"{UA}/restricted/n/nvidia-graphics-drivers-{branch}/nvidia-utils-{branch}_*.deb",
                 f"{UA}/restricted/n/nvidia-graphics-drivers-{branch}/nvidia-dkms-{branch}{flavour}_*.deb")
    root.run("/usr/lib/nvidia-standin/kmod/modload.py", "--install", check=True)  # the postinst


def boot_module(root: Root) -> subprocess.CompletedProcess[str]:
    return root.run("/usr/lib/nvidia-standin/kmod/modload.py", "--boot")  # the boot unit


# --- driver -------------------------------------------------------------------------------------


def test_nvidia_smi_fails_until_reboot_after_install(root: Root) -> None:
    root.hardware(hardware(2))
    install_driver(root)
    out = root.run("nvidia-smi")
    assert out.returncode == 9
    assert out.stdout.startswith("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.")
    assert boot_module(root).returncode == 1  # installed in this boot: nothing loads before a reboot
    assert root.run("nvidia-smi").returncode == 9
    root.reboot()
    assert boot_module(root).returncode == 0
    version = (root.path / "proc/driver/nvidia/version").read_text()
    assert version.startswith("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95.05  Release Build  (")
    assert "\nGCC version:  gcc version " in version
    out = root.run("nvidia-smi", check=True)
    assert "| NVIDIA-SMI 580.95.05              Driver Version: 580.95.05      CUDA Version: 13.0     |" in out.stdout
    assert out.stdout.count("NVIDIA GeForce RTX 3090") == 2
    assert root.run("nvidia-smi", "-L", check=True).stdout.splitlines() == [
        "GPU 0: NVIDIA GeForce RTX 3090 (UUID: GPU-00000000-1111-2222-3333-444444444444)",
        "GPU 1: NVIDIA GeForce RTX 3090 (UUID: GPU-00000001-1111-2222-3333-444444444444)",
    ]


def test_proprietary_module_and_branch_upgrade_mismatch(root: Root) -> None:
    root.hardware(hardware(1))
    install_driver(root, "550", "")
    root.reboot()
    assert boot_module(root).returncode == 0
    assert (root.path / "proc/driver/nvidia/version").read_text().startswith(
        "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.163.01  ")
    out = root.run("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", check=True)
    assert out.stdout == "550.163.01\n"
    assert "CUDA Version: 12.4" in root.run("nvidia-smi").stdout
    install_driver(root, "580", "-open")  # upgrade while 550 is loaded
    out = root.run("nvidia-smi")
    assert out.returncode == 18
    assert out.stdout == "Failed to initialize NVML: Driver/library version mismatch\nNVML library version: 580.95\n"
    root.reboot()
    boot_module(root)
    assert root.run("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader").stdout == "580.95.05\n"


def test_secure_boot_rejects_unsigned_module(root: Root) -> None:
    root.hardware(hardware(1, secure_boot=True))
    install_driver(root)
    root.reboot()
    out = boot_module(root)
    assert out.returncode == 1 and "Key was rejected by service" in out.stdout
    assert root.run("nvidia-smi").returncode == 9


def test_nvidia_smi_reproduces_real_capture(root: Root, tmp_path: Path) -> None:
    """Render the captured 2x H200 machine and compare with the real nvidia-smi output byte for byte."""
    root.install(f"{UA}/restricted/n/nvidia-graphics-drivers-580/nvidia-utils-580_*.deb")
    utils = root.path / "usr/lib/nvidia-standin/utils/userspace.json"
    utils.write_text(json.dumps({"version": "580.159.04", "branch": "580", "cuda": "13.0"}))
    root.write("proc/driver/nvidia/version", "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  "
               "Release Build  (dvs-builder@U22-I3-AE18-09-3)  Thu Nov  6 00:00:00 UTC 2025\n")
    h200 = dict(name="NVIDIA H200", architecture="Hopper", memory_total_mib=143771, memory_used_mib=0,
                compute_cap="9.0", power_limit_w=700, power_default_w=700, power_min_w=200, power_max_w=700,
                persistence_mode=True, pstate="P0", memory_reserved_mib=616)
    root.hardware({"schema": 1, "preset": "h200", "driver_cuda": "13.0", "secure_boot": False, "topology": "NV18",
                   "cpu_affinity": "0-31", "gpus": [
                       dict(h200, index=0, uuid="GPU-6233fe39-51c5-7ad1-3573-49a321b0ef3a", pci_bus_id="00000000:00:06.0",
                            temperature_c=41, power_draw_w=127),
                       dict(h200, index=1, uuid="GPU-e22d0e00-5ebd-9fbe-ec69-33d7d295396e", pci_bus_id="00000000:00:07.0",
                            temperature_c=39, power_draw_w=128)]})
    table = root.run("nvidia-smi", check=True).stdout.splitlines()
    real = (FIXTURES / "nvidia-smi.txt").read_text().splitlines()
    assert table[1:] == real[1:]  # line 0 is the clock
    assert len(table[0]) == len(real[0])
    fields = "index,name,uuid,driver_version,memory.total,compute_cap,pci.bus_id,power.limit,power.default_limit,persistence_mode"
    csv = root.run("nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits", check=True).stdout
    assert csv == (FIXTURES / "query-gpu.csv").read_text()
    topo = root.run("nvidia-smi", "topo", "-m", check=True).stdout
    assert topo.rstrip("\n") == (FIXTURES / "topo.txt").read_text().rstrip("\n")
    report = root.run("nvidia-smi", "-q", check=True).stdout.splitlines()
    real_q = (FIXTURES / "nvidia-smi-q.txt").read_text().splitlines()
    for line in ("Driver Version                                         : 580.159.04",
                 "    Product Name                                       : NVIDIA H200",
                 "        Current Power Limit                            : 700.00 W",
                 "        Free                                           : 143155 MiB"):
        assert line in report
    assert report[:3] == real_q[:3] and report[4:8] == real_q[4:8]


def test_query_fields_persistence_and_power_limits(root: Root) -> None:
    root.hardware(hardware(2))
    install_driver(root)
    root.reboot()
    boot_module(root)
    fields = ("index,name,uuid,driver_version,memory.total,memory.used,memory.free,compute_cap,pci.bus_id,power.limit,"
              "power.default_limit,power.min_limit,power.max_limit,persistence_mode,utilization.gpu,temperature.gpu,power.draw")
    out = root.run("nvidia-smi", f"--query-gpu={fields}", "--format=csv", check=True).stdout.splitlines()
    assert out[0] == ("index, name, uuid, driver_version, memory.total [MiB], memory.used [MiB], memory.free [MiB], "
                      "compute_cap, pci.bus_id, power.limit [W], power.default_limit [W], power.min_limit [W], "
                      "power.max_limit [W], persistence_mode, utilization.gpu [%], temperature.gpu, power.draw [W]")
    assert out[1] == ("0, NVIDIA GeForce RTX 3090, GPU-00000000-1111-2222-3333-444444444444, 580.95.05, 24576 MiB, 1 MiB, "
                      "24575 MiB, 8.6, 00000000:01:00.0, 350.00 W, 350.00 W, 100.00 W, 400.00 W, Disabled, 0 %, 35, 20.00 W")
    bad = root.run("nvidia-smi", "--query-gpu=index,bogus", "--format=csv")
    assert bad.returncode == 2 and 'Field "bogus" is not a valid field to query.' in bad.stderr
    assert root.run("nvidia-smi", "-pm", "1", check=True).stdout.splitlines() == [
        "Enabled persistence mode for GPU 00000000:01:00.0.", "Enabled persistence mode for GPU 00000000:02:00.0.",
        "All done."]
    assert "already Enabled" in root.run("nvidia-smi", "-pm", "1", check=True).stdout
    out = root.run("nvidia-smi", "-i", "1", "-pl", "230", check=True).stdout
    assert "Power limit for GPU 00000000:02:00.0 was set to 230.00 W from 350.00 W." in out
    out = root.run("nvidia-smi", "-i", "0", "-pl", "450")
    assert out.returncode == 2
    assert ("Provided power limit 450.00 W is not a valid power limit which should be between 100.00 W and 400.00 W "
            "for GPU 00000000:01:00.0") in out.stdout
    q = root.run("nvidia-smi", "--query-gpu=index,power.limit,persistence_mode", "--format=csv,noheader,nounits").stdout
    assert q == "0, 350.00, Enabled\n1, 230.00, Enabled\n"
    assert root.run("nvidia-smi", "-i", "7", "-L").returncode == 6
    root.reboot()  # limits and persistence are not persistent across boots
    boot_module(root)
    q = root.run("nvidia-smi", "--query-gpu=index,power.limit,persistence_mode", "--format=csv,noheader,nounits").stdout
    assert q == "0, 350.00, Disabled\n1, 350.00, Disabled\n"
    assert [c["argv"][:2] for c in root.calls("/var/log/nvidia-standin/calls.log") if c["tool"] == "nvidia-smi"][-1] == \
        ["--query-gpu=index,power.limit,persistence_mode", "--format=csv,noheader,nounits"]


def test_mokutil_and_lspci(root: Root) -> None:
    root.install(f"{UA}/main/m/mokutil/*.deb", f"{UA}/main/p/pciutils/*.deb")
    root.hardware(hardware(2, secure_boot=True))
    assert root.run("mokutil", "--sb-state", check=True).stdout == "SecureBoot enabled\n"
    root.hardware(hardware(2))
    assert root.run("mokutil", "--sb-state", check=True).stdout == "SecureBoot disabled\n"
    out = root.run("lspci", "-nn", "-d", "10de:", check=True).stdout.splitlines()
    assert out[0] == "01:00.0 VGA compatible controller [0300]: NVIDIA Corporation GA102 [GeForce RTX 3090] [10de:2204] (rev a1)"
    assert len([line for line in out if "VGA" in line]) == 2
    root.hardware(hardware(0))
    assert root.run("lspci", "-d", "10de:", check=True).stdout == ""


# --- container toolkit --------------------------------------------------------------------------

CTK = "libnvidia-container/stable/deb/amd64"


def test_nvidia_ctk_runtime_configure_merges_daemon_json(root: Root) -> None:
    root.install(f"{CTK}/nvidia-container-toolkit-base_1.18.0-1_amd64.deb")
    assert root.run("nvidia-ctk", "--version", check=True).stdout.startswith("NVIDIA Container Toolkit CLI version 1.18.0\n")
    daemon = root.path / "etc/docker/daemon.json"
    out = root.run("nvidia-ctk", "runtime", "configure", "--runtime=docker", check=True)
    assert "Config file does not exist; using empty config" in out.stderr
    assert "Wrote updated config to" in out.stderr and "It is recommended that docker daemon be restarted." in out.stderr
    assert daemon.read_text() == ('{\n    "runtimes": {\n        "nvidia": {\n            "args": [],\n'
                                  '            "path": "nvidia-container-runtime"\n        }\n    }\n}')
    daemon.write_text('{"registry-mirrors": ["http://10.77.0.1:5000"], "runtimes": {"crun": {"path": "/usr/bin/crun"}}}')
    root.run("nvidia-ctk", "runtime", "configure", "--runtime=docker", f"--config={daemon}", "--set-as-default", check=True)
    data = json.loads(daemon.read_text())
    assert data == {"default-runtime": "nvidia", "registry-mirrors": ["http://10.77.0.1:5000"],
                    "runtimes": {"crun": {"path": "/usr/bin/crun"},
                                 "nvidia": {"args": [], "path": "nvidia-container-runtime"}}}
    daemon.write_text("{not json")
    bad = root.run("nvidia-ctk", "runtime", "configure", "--runtime=docker")
    assert bad.returncode == 1 and "unable to load config" in bad.stderr
    assert daemon.read_text() == "{not json"


def test_container_cli_and_dev_char_symlinks_need_the_driver(root: Root) -> None:
    root.hardware(hardware(2))
    root.install(f"{CTK}/nvidia-container-toolkit-base_1.18.0-1_amd64.deb", f"{CTK}/libnvidia-container-tools_1.18.0-1_amd64.deb")
    out = root.run("nvidia-container-cli", "info")
    assert out.returncode == 1 and "nvml error: driver not loaded" in out.stderr
    assert root.run("nvidia-ctk", "system", "create-dev-char-symlinks", "--create-all").returncode == 1
    install_driver(root)
    root.reboot()
    boot_module(root)
    assert "NVRM version:   580.95.05" in root.run("nvidia-container-cli", "info", check=True).stdout
    root.run("nvidia-ctk", "system", "create-dev-char-symlinks", "--create-all", check=True)
    assert os.readlink(root.path / "dev/char/195:1") == "../nvidia1"
    assert os.readlink(root.path / "dev/char/195:255") == "../nvidiactl"


# --- docker ---------------------------------------------------------------------------------------

DOCKER = "docker/linux/ubuntu/dists/bookworm/pool/stable/amd64"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Daemon:
    def __init__(self, root: Root):
        self.root = root
        self.proc: subprocess.Popen[str] | None = None

    def start(self, expect_ok: bool = True) -> subprocess.Popen[str]:
        sock = self.root.path / "run/docker.sock"
        self.proc = subprocess.Popen([sys.executable, str(self.root.tool("/usr/bin/dockerd"))], env=self.root.env,
                                     text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        if not expect_ok:
            self.proc.wait(timeout=20)
            return self.proc
        deadline = time.monotonic() + 20
        while not sock.exists():
            assert self.proc.poll() is None, self.proc.stdout.read() if self.proc.stdout else ""
            assert time.monotonic() < deadline
            time.sleep(0.02)
        return self.proc

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=30)

    def restart(self) -> None:
        self.stop()
        (self.root.path / "run/docker.sock").unlink(missing_ok=True)
        self.start()


@pytest.fixture
def docker_root(root: Root) -> Iterator[tuple[Root, Daemon]]:
    root.hardware(hardware(2))
    root.install(f"{DOCKER}/containerd.io_*.deb", f"{DOCKER}/docker-ce_28.5.2*.deb", f"{DOCKER}/docker-ce-cli_28.5.2*.deb",
                 f"{DOCKER}/docker-compose-plugin_*.deb")
    daemon = Daemon(root)
    daemon.start()
    yield root, daemon
    daemon.stop()


def test_dockerd_refuses_invalid_daemon_json(root: Root) -> None:
    root.install(f"{DOCKER}/docker-ce_28.5.2*.deb")
    daemon = Daemon(root)
    cases = {
        '{"log-driver": "json-file",': "unable to configure the Docker daemon with file /etc/docker/daemon.json:",
        '{"bogus-key": 1}': "the following directives don't match any configuration option: bogus-key",
        '{"runtimes": {"nvidia": {"path": "nvidia-container-runtime"}}}':
            'runtime nvidia: exec: "nvidia-container-runtime": executable file not found in $PATH',
        '{"hosts": ["unix:///run/x.sock"]}': "specified both as a flag and in the configuration file",
    }
    for text, message in cases.items():
        root.write("etc/docker/daemon.json", text)
        args = ["-H", "unix:///run/docker.sock"] if "hosts" in text else []
        proc = subprocess.run([sys.executable, str(root.tool("/usr/bin/dockerd")), *args], env=root.env, text=True,
                              capture_output=True, timeout=20)
        assert proc.returncode == 1 and message in proc.stderr, (text, proc.stderr)
    del daemon


def test_compose_files_are_validated_by_the_real_compose_binary(root: Root, tmp_path: Path) -> None:
    root.install(f"{DOCKER}/docker-compose-plugin_*.deb")
    project = tmp_path / "p"
    project.mkdir()
    (project / "compose.yaml").write_text('services:\n  vllm:\n    image: x\n    ports: ["not-a-port"]\n')
    plugin = "/usr/libexec/docker/cli-plugins/docker-compose"
    bad = root.run(plugin, "compose", "-f", str(project / "compose.yaml"), "config")
    assert bad.returncode == 15 or bad.returncode == 1, bad
    assert "not-a-port" in bad.stderr
    (project / "compose.yaml").write_text("services:\n  vllm:\n    image: x\n    environment:\n      - A=${NEEDED:?say it}\n")
    bad = root.run(plugin, "compose", "-f", str(project / "compose.yaml"), "up", "-d")
    assert bad.returncode == 1 and "required variable NEEDED is missing a value: say it" in bad.stderr
    ok = root.run(plugin, "compose", "-f", str(project / "compose.yaml"), "config", "--services", env={"NEEDED": "1"})
    assert ok.stdout == "vllm\n"
    assert root.run(plugin, "compose", "version", check=True).stdout == "Docker Compose version v2.40.3\n"


def test_docker_cli_daemon_down_and_version(root: Root) -> None:
    root.install(f"{DOCKER}/docker-ce-cli_28.5.2*.deb")
    out = root.run("docker", "info", "--format", "{{json .Runtimes}}")
    assert out.returncode == 1
    assert "Cannot connect to the Docker daemon at unix:///var/run/docker.sock. Is the docker daemon running?" in out.stderr
    assert root.run("docker", "--version", check=True).stdout.startswith("Docker version 28.5.2, build ")
    assert root.run("docker", "compose", "version").returncode == 1  # plugin not installed


def test_gpu_containers_need_toolkit_configured_and_daemon_restarted(docker_root: tuple[Root, Daemon]) -> None:
    root, daemon = docker_root
    info = root.run("docker", "info", check=True).stdout
    assert " Runtimes: io.containerd.runc.v2 runc\n" in info and " Default Runtime: runc\n" in info
    assert "  compose: Docker Compose (Docker Inc.)\n    Version:  v2.40.3\n" in info
    pull = root.run("docker", "pull", "nvidia/cuda:12.6.0-base-ubuntu22.04", check=True).stdout.splitlines()
    assert pull[0] == "12.6.0-base-ubuntu22.04: Pulling from nvidia/cuda"
    assert pull[-2] == "Status: Downloaded newer image for nvidia/cuda:12.6.0-base-ubuntu22.04"
    assert pull[-1] == "docker.io/nvidia/cuda:12.6.0-base-ubuntu22.04"
    assert "Image is up to date" in root.run("docker", "pull", "nvidia/cuda:12.6.0-base-ubuntu22.04").stdout
    digest = root.run("docker", "image", "inspect", "--format", "{{index .RepoDigests 0}}",
                      "nvidia/cuda:12.6.0-base-ubuntu22.04", check=True).stdout.strip()
    assert digest.startswith("nvidia/cuda@sha256:") and len(digest) == len("nvidia/cuda@sha256:") + 64
    images = json.loads((root.path / "var/lib/docker-standin/images.json").read_text())["images"]
    assert [i["RepoTags"] for i in images.values()] == [["nvidia/cuda:12.6.0-base-ubuntu22.04"]]
    smoke = ["run", "--rm", "--gpus", "all", "nvidia/cuda:12.6.0-base-ubuntu22.04", "nvidia-smi", "-L"]
    out = root.run("docker", *smoke)
    assert out.returncode == 125
    assert 'could not select device driver "" with capabilities: [[gpu]]' in out.stderr
    root.install(f"{CTK}/*1.18.0-1_amd64.deb")
    root.run("nvidia-ctk", "runtime", "configure", "--runtime=docker", check=True)
    assert root.run("docker", "info", "--format", "{{json .Runtimes}}").stdout == \
        '{"io.containerd.runc.v2":{"path":"runc"},"runc":{"path":"runc"}}\n'  # not reloaded yet
    assert root.run("docker", *smoke).returncode == 125
    daemon.restart()
    assert root.run("docker", "info", "--format", "{{json .Runtimes}}").stdout == \
        '{"io.containerd.runc.v2":{"path":"runc"},"nvidia":{"path":"nvidia-container-runtime"},"runc":{"path":"runc"}}\n'
    assert " Runtimes: io.containerd.runc.v2 nvidia runc\n" in root.run("docker", "info").stdout
    out = root.run("docker", *smoke)  # toolkit ready, but no driver at all
    assert out.returncode == 125
    assert "nvidia-container-cli: initialization error: load library failed: libnvidia-ml.so.1" in out.stderr
    install_driver(root)
    out = root.run("docker", *smoke)  # driver installed, module not loaded before the reboot
    assert out.returncode == 125 and "nvidia-container-cli: initialization error: nvml error: driver not loaded" in out.stderr
    root.reboot()
    boot_module(root)
    daemon.restart()
    out = root.run("docker", *smoke, check=True)
    assert out.stdout.count("GPU ") == 2
    out = root.run("docker", "run", "--rm", "--gpus", '"device=1"', "nvidia/cuda:12.6.0-base-ubuntu22.04", "nvidia-smi",
                   "--query-gpu=index,uuid", "--format=csv,noheader", check=True)
    assert out.stdout == "0, GPU-00000001-1111-2222-3333-444444444444\n"
    assert root.run("docker", "ps", "-a", "-q", check=True).stdout == ""  # --rm removed them
    calls = [c["argv"] for c in root.calls("/var/log/docker-standin/calls.log") if c["tool"] == "docker"]
    assert ["pull", "nvidia/cuda:12.6.0-base-ubuntu22.04"] in calls and smoke in calls


COMPOSE = """\
name: rigup-dual
services:
  vllm:
    image: vllm/vllm-openai@sha256:{digest}
    container_name: rigup-dual
    ports: ["127.0.0.1:{port}:8000"]
    environment:
      VLLM_API_KEY: ${{VLLM_API_KEY:?missing}}
      NCCL_P2P_DISABLE: "1"
    command: ["--model", "/models/qwen", "--served-model-name", "qwen3.6-27b", "--tensor-parallel-size", "{tp}",
              "--max-model-len", "4096", "--gpu-memory-utilization", "0.9"]
    volumes: ["{models}:/models:ro"]
    restart: unless-stopped
    healthcheck:
      test: ["CMD", "curl", "-f", "http://localhost:8000/health"]
      interval: 1s
      start_period: 1s
      start_interval: 1s
    deploy:
      resources:
        reservations:
          devices: [{{driver: nvidia, count: all, capabilities: [gpu]}}]
"""


def http(url: str, key: str | None = None, body: dict[str, Any] | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=json.dumps(body).encode() if body is not None else None)
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def http_status(url: str) -> int:
    """HTTP status of GET url, 0 when the connection fails (refused, reset by a publishing proxy, ...)."""
    try:
        return http(url)[0]
    except OSError:
        return 0


def wait_for(predicate: Any, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.fixture
def serving_root(docker_root: tuple[Root, Daemon], tmp_path: Path) -> Iterator[tuple[Root, Daemon, Path, int]]:
    root, daemon = docker_root
    root.install(f"{CTK}/*1.18.0-1_amd64.deb")
    root.run("nvidia-ctk", "runtime", "configure", "--runtime=docker", check=True)
    install_driver(root)
    root.reboot()
    boot_module(root)
    daemon.restart()
    models = tmp_path / "models/qwen"
    models.mkdir(parents=True)
    (models / "config.json").write_text("{}")
    port = free_port()
    project = tmp_path / "variant"
    project.mkdir()
    (project / "compose.yaml").write_text(COMPOSE.format(digest="a" * 64, port=port, tp=2, models=models.parent))
    (project / ".env").write_text("VLLM_API_KEY=sekrit-key\n")
    yield root, daemon, project, port


def compose(root: Root, project: Path, *args: str, check: bool = False) -> subprocess.CompletedProcess[str]:
    return root.run("/usr/libexec/docker/cli-plugins/docker-compose", "compose", "--project-directory", str(project),
                    "-f", str(project / "compose.yaml"), *args, check=check)


def test_compose_up_serves_openai_api_and_down_stops_it(serving_root: tuple[Root, Daemon, Path, int]) -> None:
    root, daemon, project, port = serving_root
    up = compose(root, project, "up", "-d", check=True)
    assert " Container rigup-dual  Started" in up.stderr and " vllm Pulled" in up.stderr
    base = f"http://127.0.0.1:{port}"
    wait_for(lambda: http_status(f"{base}/health") == 200)
    assert http(f"{base}/v1/models")[0] == 401
    status, body = http(f"{base}/v1/models", "sekrit-key")
    assert status == 200 and [m["id"] for m in json.loads(body)["data"]] == ["qwen3.6-27b"]
    status, body = http(f"{base}/v1/chat/completions", "sekrit-key",
                        {"model": "qwen3.6-27b", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 8})
    reply = json.loads(body)
    assert status == 200 and 0 < reply["usage"]["completion_tokens"] <= 8
    assert reply["choices"][0]["finish_reason"] in ("length", "stop")
    status, body = http(f"{base}/v1/chat/completions", "sekrit-key",
                        {"model": "qwen3.6-27b", "stream": True, "stream_options": {"include_usage": True},
                         "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]})
    events = [line[6:] for line in body.decode().splitlines() if line.startswith("data: ")]
    assert status == 200 and events[-1] == "[DONE]"
    usage = [json.loads(e)["usage"] for e in events[:-1] if json.loads(e).get("usage")]
    assert usage and 0 < usage[-1]["completion_tokens"] <= 16
    assert http(f"{base}/v1/chat/completions", "sekrit-key", {"model": "other", "messages": [{"role": "user", "content": "x"}]})[0] == 404
    if aptrepo.RICH_RESPONDER.is_file():  # the container serves openai_responder.py, with vLLM's log lines
        assert '"POST /v1/chat/completions HTTP/1.1" 200 OK' in root.run("docker", "logs", "rigup-dual").stdout
    # vLLM holds ~90% of every GPU it was given, visible to nvidia-smi.
    used = root.run("nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits").stdout.split()
    assert used == [str(1 + int(0.9 * 24576))] * 2
    ps = [json.loads(line) for line in compose(root, project, "ps", "--format", "json", check=True).stdout.splitlines()]
    assert [(p["Name"], p["Service"], p["State"]) for p in ps] == [("rigup-dual", "vllm", "running")]
    assert ps[0]["Publishers"] == [{"URL": "127.0.0.1", "TargetPort": 8000, "PublishedPort": port, "Protocol": "tcp"}]
    wait_for(lambda: root.run("docker", "inspect", "--format", "{{.State.Health.Status}}", "rigup-dual").stdout == "healthy\n")
    # Unchanged config: no recreate. Secrets never reach a command line.
    assert " Container rigup-dual  Running" in compose(root, project, "up", "-d", check=True).stderr
    assert all("sekrit-key" not in json.dumps(c) for c in root.calls("/var/log/docker-standin/calls.log"))
    # The daemon restarts an unless-stopped container when it comes back.
    daemon.restart()
    wait_for(lambda: http_status(f"{base}/health") == 200)
    down = compose(root, project, "down", check=True)
    assert " Container rigup-dual  Removed" in down.stderr
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"{base}/health", timeout=2)
    assert root.run("nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits").stdout.split() == ["1", "1"]


def test_compose_foreground_up_stays_until_sigterm(serving_root: tuple[Root, Daemon, Path, int]) -> None:
    root, _, project, port = serving_root
    tool = root.tool("/usr/libexec/docker/cli-plugins/docker-compose")
    proc = subprocess.Popen([sys.executable, str(tool), "compose", "--project-directory", str(project), "-f",
                             str(project / "compose.yaml"), "up"], env=root.env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    wait_for(lambda: proc.poll() is not None or http_status(f"http://127.0.0.1:{port}/health") == 200)
    assert proc.poll() is None
    time.sleep(0.5)
    assert proc.poll() is None  # still attached
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert "Attaching to rigup-dual" in out and "rigup-dual  | INFO" in out and "Application startup complete." in out
    assert "Gracefully stopping..." in err and " Container rigup-dual  Stopped" in err
    state = root.run("docker", "inspect", "--format", "{{.State.Status}}", "rigup-dual", check=True).stdout
    assert state == "exited\n"


def test_several_served_names_answer_on_one_kept_alive_connection(serving_root: tuple[Root, Daemon, Path, int]) -> None:
    """Each served name reaches the model, and the connection stays open between requests, as vLLM's does
    (a client such as requests reuses it: one closed unannounced drops its next request)."""
    root, _, project, port = serving_root
    text = (project / "compose.yaml").read_text()
    (project / "compose.yaml").write_text(text.replace('"qwen3.6-27b",', '"qwen3.6-27b", "qwen3.6-27b-autoround",'))
    compose(root, project, "up", "-d", check=True)
    wait_for(lambda: http_status(f"http://127.0.0.1:{port}/health") == 200)
    conn = HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.connect()
        first = conn.sock
        for name in ("qwen3.6-27b-autoround", "qwen3.6-27b", "qwen3.6-27b-autoround"):
            body = json.dumps({"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
            conn.request("POST", "/v1/chat/completions", body,
                         {"Authorization": "Bearer sekrit-key", "Content-Type": "application/json"})
            response = conn.getresponse()
            reply = json.loads(response.read())
            assert response.status == 200 and reply["model"] == "qwen3.6-27b"
            assert response.getheader("Connection") != "close" and conn.sock is first  # the same connection
    finally:
        conn.close()
    compose(root, project, "down", check=True)


def test_responder_faults_and_startup_checks(serving_root: tuple[Root, Daemon, Path, int], tmp_path: Path) -> None:
    root, _, project, port = serving_root
    base = f"http://127.0.0.1:{port}"
    root.write("etc/rigup-testbed/responder.json", json.dumps({"mode": "crash"}))
    compose(root, project, "up", "-d", check=True)
    wait_for(lambda: "EngineCore failed to start" in root.run("docker", "logs", "rigup-dual").stdout)
    waited = compose(root, project, "up", "-d", "--wait", "--wait-timeout", "20")
    assert waited.returncode == 1
    root.write("etc/rigup-testbed/responder.json", json.dumps({"mode": "fail"}))
    compose(root, project, "up", "-d", "--force-recreate", check=True)
    wait_for(lambda: http_status(f"{base}/health") == 500)
    status, _ = http(f"{base}/v1/chat/completions", "sekrit-key",
                     {"model": "qwen3.6-27b", "messages": [{"role": "user", "content": "x"}]})
    assert status == 500
    root.write("etc/rigup-testbed/responder.json", json.dumps({"mode": "ok"}))
    assert http_status(f"{base}/health") == 200
    compose(root, project, "down", check=True)
    # A model directory without config.json and a TP larger than the GPUs both fail like vLLM.
    (tmp_path / "models/qwen/config.json").unlink()
    compose(root, project, "up", "-d", check=True)
    wait_for(lambda: "Incorrect path_or_model_id: '/models/qwen'" in root.run("docker", "logs", "rigup-dual").stdout)
    compose(root, project, "down", check=True)
    (tmp_path / "models/qwen/config.json").write_text("{}")
    (project / "compose.yaml").write_text(COMPOSE.format(digest="a" * 64, port=port, tp=4, models=tmp_path / "models"))
    compose(root, project, "up", "-d", check=True)
    wait_for(lambda: "tensor_parallel_size=4, available=2" in root.run("docker", "logs", "rigup-dual").stdout)
    compose(root, project, "down", check=True)


def test_the_engine_answers_the_gate_probes_and_922s_garbage_when_told(serving_root: tuple[Root, Daemon, Path, int]) -> None:
    """openai_responder answers rigup's gate probes as a working model; responder.json makes it answer
    club-3090 #922's "!!!!" (mode garbage, or p2p_corrupts_custom_all_reduce under custom all-reduce)."""
    from rigup.rig import servingctl

    root, _, project, port = serving_root
    base = f"http://127.0.0.1:{port}"

    def failures() -> dict[str, str | None]:
        judged = {}
        for name, probe in servingctl.PROBES.items():
            answer = servingctl.chat_completion(base, "qwen3.6-27b", "sekrit-key", 10, messages=probe.messages,
                                                max_tokens=servingctl.PROBE_MAX_TOKENS, fields=probe.fields)
            judged[name] = servingctl.judge_probe(probe, answer)
        return judged

    # TP 2 without --disable-custom-all-reduce: vLLM runs its custom all-reduce
    root.write("etc/rigup-testbed/responder.json", json.dumps({"p2p_corrupts_custom_all_reduce": True}))
    compose(root, project, "up", "-d", check=True)
    wait_for(lambda: http_status(f"{base}/health") == 200)
    garbage = failures()
    assert all(reason is not None and "answered '!!!!" in reason and "(finish_reason=length, 48 tokens)" in reason
               for reason in garbage.values()), garbage
    root.write("etc/rigup-testbed/responder.json", json.dumps({"mode": "ok"}))
    assert failures() == dict.fromkeys(servingctl.PROBE_NAMES)  # every answer right
    compose(root, project, "down", check=True)
    # the same rig fault under an engine with the flag: custom all-reduce is off, the answers are right
    text = (project / "compose.yaml").read_text()
    (project / "compose.yaml").write_text(text.replace('"--gpu-memory-utilization", "0.9"]',
                                                       '"--gpu-memory-utilization", "0.9", "--disable-custom-all-reduce"]'))
    root.write("etc/rigup-testbed/responder.json", json.dumps({"p2p_corrupts_custom_all_reduce": True}))
    compose(root, project, "up", "-d", check=True)
    wait_for(lambda: http_status(f"{base}/health") == 200)
    assert failures() == dict.fromkeys(servingctl.PROBE_NAMES)
    root.write("etc/rigup-testbed/responder.json", json.dumps({"mode": "garbage"}))  # whatever the command line

    def ended_at_their_limit() -> float:  # what RigupPodLengthFinishSurge counts: vLLM's own finish reasons
        text = urllib.request.urlopen(f"{base}/metrics", timeout=10).read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("vllm:request_success_total{") and 'finished_reason="length"' in line)

    before = ended_at_their_limit()
    assert all(reason is not None for reason in failures().values())
    assert ended_at_their_limit() - before == len(servingctl.PROBES)  # every garbage answer ended at its limit
    compose(root, project, "down", check=True)


def test_gotemplate_subset() -> None:
    sys.path.insert(0, str(aptrepo.STANDINS))
    try:
        import gotemplate
    finally:
        sys.path.pop(0)
    info = {"Runtimes": {"runc": {"path": "runc"}, "nvidia": {"path": "nvidia-container-runtime"}},
            "Server": {"Version": "28.5.2"}, "RepoDigests": ["a@sha256:1", "b@sha256:2"], "Labels": {"k": "v"}}
    assert gotemplate.render("{{json .Runtimes}}", info) == \
        '{"nvidia":{"path":"nvidia-container-runtime"},"runc":{"path":"runc"}}'
    assert gotemplate.render("{{.Server.Version}}", info) == "28.5.2"
    assert gotemplate.render("{{index .RepoDigests 1}}", info) == "b@sha256:2"
    assert gotemplate.render('{{range .RepoDigests}}{{.}};{{end}}', info) == "a@sha256:1;b@sha256:2;"
    assert gotemplate.render('{{if .Labels}}yes{{else}}no{{end}} {{index .Labels "k"}}', info) == "yes v"
    with pytest.raises(gotemplate.TemplateError, match="can't evaluate field Nope"):
        gotemplate.render("{{.Nope}}", info, "system.Info")


def test_pulls_from_a_private_registry_ask_it(docker_root: tuple[Root, Daemon], tmp_path: Path) -> None:
    root, _ = docker_root
    port = free_port()
    ready = tmp_path / "registry-ready.json"
    config = tmp_path / "registry.json"
    config.write_text(json.dumps({"missing": ["vllm/vllm-openai:gone"]}))
    hub = subprocess.Popen([sys.executable, "-m", "rigup_testbed.hubserve", "registry", "--bind", "127.0.0.1", "--port",
                            str(port), "--ready-file", str(ready), "--config", str(config)],
                           cwd=Path(__file__).resolve().parents[2], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(ready.exists)
        image = f"127.0.0.1:{port}/vllm/vllm-openai:v0.11.0"
        out = root.run("docker", "pull", image, check=True).stdout.splitlines()
        sys.path.insert(0, str(aptrepo.STANDINS))
        try:
            import dockerclient
        finally:
            sys.path.pop(0)
        assert out[-3] == f"Digest: {dockerclient.fake_digest(image)}" and out[-1] == image
        gone = root.run("docker", "pull", f"127.0.0.1:{port}/vllm/vllm-openai:gone")
        assert gone.returncode == 1 and "manifest unknown" in gone.stderr
        # a registry not listed insecure (and not loopback's 127.0.0.0/8) is asked over HTTPS, as by the real engine:
        # this one speaks plain HTTP (0.0.0.0 reaches it on this machine)
        https_only = root.run("docker", "pull", f"0.0.0.0:{port}/vllm/vllm-openai:v0.11.0")
        assert f'Get "https://0.0.0.0:{port}/v2/": http: server gave HTTP response to HTTPS client' in https_only.stderr
    finally:
        hub.terminate()
        hub.wait(timeout=10)
    down = root.run("docker", "pull", f"127.0.0.1:{port}/vllm/vllm-openai:v0.11.0")
    assert "Image is up to date" not in down.stdout and "connect:" in down.stderr  # the registry is asked every time


def test_the_hub_registry_serves_the_catalogs_digest_pinned_image(docker_root: tuple[Root, Daemon], tmp_path: Path) -> None:
    """A recipe pulls lmcache/vllm-openai by the digest upstream pins (the catalog's); the hub's registry holds
    exactly that image (rigup_testbed.hub.catalog_pinned_images), so the pull finds it and gets LMCache's image
    config, while another digest of that repository is unknown there as on Docker Hub."""
    from rigup_testbed.hub import catalog_pinned_images

    root, _ = docker_root
    port = free_port()
    ready, config, images = tmp_path / "ready.json", tmp_path / "registry.json", tmp_path / "images.json"
    config.write_text("{}")
    images.write_text(json.dumps(catalog_pinned_images()))
    (name, digest), = catalog_pinned_images().items()
    hub = subprocess.Popen([sys.executable, "-m", "rigup_testbed.hubserve", "registry", "--bind", "127.0.0.1", "--port",
                            str(port), "--ready-file", str(ready), "--config", str(config), "--images", str(images)],
                           cwd=Path(__file__).resolve().parents[2], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(ready.exists)
        image = f"127.0.0.1:{port}/{name}@{digest}"  # what the recipe's compose names (registry/repo:tag@digest)
        out = root.run("docker", "pull", image)
        assert out.returncode == 0, out
        assert f"Digest: {digest}" in out.stdout.splitlines()
        inspect = json.loads(root.run("docker", "image", "inspect", image, check=True).stdout)[0]
        assert inspect["Config"]["Entrypoint"] == ["/opt/venv/bin/vllm", "serve"]
        other = root.run("docker", "pull", f"127.0.0.1:{port}/{name.split(':')[0]}@sha256:{'e' * 64}")
        assert other.returncode == 1 and "manifest unknown" in other.stderr, other
    finally:
        hub.terminate()
        hub.wait(timeout=10)


def test_docker_ps_reads_the_age_only_for_a_format_that_prints_it(monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    # `docker ps --format '{{.Names}}'` runs in every converged rig's fact batch: its rows leave out the
    # container's age, whose date parsing is most of the call; every format that prints it still has it.
    standins = str(aptrepo.STANDINS)
    sys.path.insert(0, standins)
    try:
        import docker_cli
    finally:
        sys.path.remove(standins)
    created = time.strftime("%Y-%m-%dT%H:%M:%S.000000000Z", time.gmtime(time.time() - 90))
    item = {"Id": "a" * 64, "Image": "vllm/vllm-openai:v0.11", "Command": "python3 -m vllm.entrypoints",
            "Created": created, "Ports": [], "State": "running", "Status": "Up About a minute",
            "Names": ["/rigup-dual"], "Labels": {}}
    monkeypatch.setattr(docker_cli.dc, "rpc", lambda *args, **kwargs: [item])
    ages: list[str] = []
    real_age = docker_cli.age
    monkeypatch.setattr(docker_cli, "age", lambda iso: ages.append(iso) or real_age(iso))

    def ps(*args: str) -> str:
        capsys.readouterr()
        assert docker_cli.cmd_ps(list(args)) == 0
        return capsys.readouterr().out

    assert ps("--format", "{{.Names}}") == "rigup-dual\n" and ps("-q") == "a" * 12 + "\n"
    assert ages == []
    assert ps("--format", "{{.Names}} {{.RunningFor}}") == "rigup-dual About a minute ago\n"
    assert json.loads(ps("--format", "{{json .}}"))["RunningFor"] == "About a minute ago"
    assert "About a minute ago" in ps()  # the default table
    assert len(ages) == 3


def test_a_drifting_replica_answers_right_in_other_bytes_and_spec_decode_acceptance_can_drop_to_zero() -> None:
    """responder.json's diverge_after_requests and spec_decode_acceptance_zero (issue 43): after N chat requests
    the answers are still right by every gate probe's judge but differ from a healthy replica's; with the
    acceptance fault the engine's draft tokens are all rejected, as vLLM's spec-decode counters would show."""
    from types import SimpleNamespace

    from rigup.rig import servingctl
    from rigup_testbed import openai_responder as rich

    sys.path.insert(0, str(aptrepo.STANDINS))
    try:
        import responder
    finally:
        sys.path.pop(0)
    server = SimpleNamespace(config=rich.Config(model="m"))
    fault = {"diverge_after_requests": 2}
    assert [responder.drifts(fault, server, "/v1/chat/completions") for _ in range(3)] == [False, False, True]
    assert responder.drifts(fault, server, "/v1/models") and not responder.drifts({}, server, "/v1/chat/completions")
    healthy, drifting = rich.Config(model="m"), rich.Config(model="m", diverge=True)
    for name, probe in servingctl.PROBES.items():
        request = {"model": "m", "messages": probe.messages, "max_tokens": servingctl.PROBE_MAX_TOKENS, "seed": 0,
                   "chat_template_kwargs": {"enable_thinking": False}, **probe.fields}
        answers = []
        for config in (healthy, drifting):
            planned = rich.plan(request, config, servingctl.PROBE_MAX_TOKENS)
            text = "".join(planned.content)
            calls = [{"function": {"name": c["name"], "arguments": c["arguments"]}} for c in planned.tool_calls]
            assert servingctl.probe_fault(probe, text, calls) is None, (name, text)
            answers.append(text)
        assert (answers[0] != answers[1]) == (name != "tool-call"), (name, answers)  # a tool call has no text
    assert responder.spec_acceptance_length({"spec_decode_acceptance_zero": True}, server) == 1.0
    assert responder.spec_acceptance_length({}, server) == 3.40  # healed: the engine's configured length again
    engine = rich.Responder.__new__(rich.Responder)
    engine.config = rich.Config(model="m", acceptance_length=1.0)
    drafts, drafted, accepted = engine.spec_decoding(48)
    assert (drafts, drafted, accepted) == (48, 144, 0)
    without = SimpleNamespace(config=rich.Config(model="m", acceptance_length=None))
    assert responder.spec_acceptance_length({"spec_decode_acceptance_zero": True}, without) is None
