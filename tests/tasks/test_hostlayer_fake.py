"""The four host-layer task files run through the real pyinfra CLI (in process) against @fake hosts
whose commands answer from the captures: one converged rig, one fresh rig with driver_reboot=never,
one rig with a single GPU given the TP=2 variant. Checks the prepare and execute wiring that unit
tests of single operations cannot: includes, templates, _if handlers, per-host failure, the
runstate hand-over between task files.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap

import pytest

from rigup import REPO_ROOT
from rigup.desired.knobs import load_defaults
from rigup.desired.recipe import resolve
from rigup.facts.system import HostCapabilities
from tests.support.fit_fake import fit_responses
from tests.support.hostlayer import fx

TASKS = ("preflight", "nvidia_driver", "docker", "container_toolkit")
ABSENT = "@rigup-absent"


def _df(avail_kib: int) -> list[str]:
    out = []
    for path, existing in (("/opt/rigup", "/opt"), ("/opt/rigup/models", "/opt"), ("/var/lib/docker", "/var/lib")):
        out += [
            f"==> {path} {existing}",
            "Filesystem     1024-blocks      Used Available Capacity Mounted on",
            f"/dev/nvme0n1p2   479596200 101234560 {avail_kib}      23% /",
        ]
    return out


def responses(kind: str) -> dict:
    recipe = resolve(load_defaults())
    sizes = [f"0\t{p}" for p in sorted({*(m.path for m in recipe.models), *(s.path for s in recipe.sources)})]
    converged = kind == "converged"
    one_gpu = kind == "one-gpu"
    if converged:
        smi = fx("nvidia-smi/2x3090-580-capped.csv").splitlines()
        proc = fx("proc-nvidia-version/open-580.txt").splitlines()
        dpkg = fx("dpkg/580-open-held.txt").splitlines()
        docker = fx("docker-info/with-nvidia.json").splitlines()
        lspci = fx("lspci/2x3090-nouveau.txt").replace("nouveau\n", "nvidia\n").splitlines()
        installed = ["ii  ca-certificates 20240203 all x", "ii  curl 8.5.0-2ubuntu10 amd64 x"] + [
            f"ii  {p} 1.0 amd64 x" for p in ("docker-ce", "docker-ce-cli", "containerd.io", "docker-compose-plugin", "nvidia-container-toolkit")
        ]
    else:
        smi = [ABSENT]
        proc = []
        dpkg = fx("dpkg/fresh.txt").splitlines() if not one_gpu else fx("dpkg/550-proprietary-held.txt").splitlines()
        docker = [ABSENT]
        lspci = fx("lspci/1x3090-nvidia.txt" if one_gpu else "lspci/2x3090-nouveau.txt").splitlines()
        installed = []
        if one_gpu:
            smi = fx("nvidia-smi/1x3090-550.csv").splitlines()
            proc = fx("proc-nvidia-version/proprietary-550.txt").splitlines()
    return {
        **fit_responses(kind),  # first: "nvidia-smi --query-gpu" below would match GpuMemoryUse too
        "cat /etc/os-release": fx("os-release/ubuntu-24.04.txt").splitlines(),
        "uname -s": "Linux",
        "dpkg --print-architecture": "amd64",
        "nvidia-smi --query-gpu": smi,
        "lspci -D -nn -k": lspci,
        "/proc/driver/nvidia/version": proc,
        "binary:Package": dpkg,
        "mokutil": "SecureBoot disabled",
        "docker info": docker,
        "docker image inspect": [] if not converged else "sha256:" + "b" * 64 + " 30000000000",
        "snap list docker": "none",
        "/etc/apt/sources.list.d/*.sources": fx("apt-sources/conflicting-docker.txt").splitlines() if kind == "fresh" else [],
        "df -Pk": _df(300_000_000),
        "du -sk": sizes,
        re.compile(r"^sh -c .*linux-modules-nvidia-"): [
            "kernel 6.8.0-45-generic",
            "meta generic",
            "linux-modules-nvidia-580-open-6.8.0-45-generic:",
            "  Installed: (none)",
            "  Candidate: 6.8.0-45.45+1",
            "linux-modules-nvidia-580-open-generic:",
            "  Installed: (none)",
            "  Candidate: 6.8.0-45.45+1",
        ],
        "apt-cache policy": ["nvidia-driver-580-open:", "  Installed: (none)", "  Candidate: 580.95.05-0ubuntu1"],
        "dpkg -l": installed,
        "/var/run/reboot-required": [],
        "/proc/sys/kernel/random/boot_id": "boot-1",
        # BoundaryView: the control machine's address as the rig's SSH session shows it, no peers
        "==> control": "==> control 192.0.2.10",
        "/dev/nvidia*": ["dev c3 0 /dev/nvidia0", "link 195:0 /dev/nvidia0"] if converged else [],
        # systemd facts: on the converged rig every unit rigup manages is running and enabled
        re.compile(r"systemctl show .*--property SubState"): (
            ["Id=docker.service", "SubState=running", "", "Id=rigup-dual.service", "SubState=running"] if converged else []
        ),
        re.compile(r"systemctl show .*--property UnitFileState"): (
            ["Id=docker.service", "UnitFileState=enabled", "", "Id=rigup-gpu-power.service", "UnitFileState=enabled"]
            if converged
            else []
        ),
    }


INVENTORY = """
from tests.tasks.test_hostlayer_fake import responses
rigs = [
    ("@fake/rig-converged", {"fake_delay": 0, "fake_delay_jitter": 0, "fake_responses": responses("converged")}),
    ("@fake/rig-fresh", {"fake_delay": 0, "fake_delay_jitter": 0, "fake_responses": responses("fresh"),
                         "driver_reboot": "never"}),
    ("@fake/rig-one-gpu", {"fake_delay": 0, "fake_delay_jitter": 0, "fake_responses": responses("one-gpu")}),
]
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory):
    tmp_path = tmp_path_factory.mktemp("fake-rigs")
    (tmp_path / "inventory.py").write_text(textwrap.dedent(INVENTORY))
    deploy = tmp_path / "deploy.py"
    # deploy.py's own head: the patches, the summary and the gate after preflight
    deploy.write_text(
        "from pyinfra import host, local, state\n"
        "from rigup.pyinfra_patches import enable_pyinfra_patches\n"
        "from rigup.runstate import print_summary_at_the_end, runs_rig_tasks\n"
        "enable_pyinfra_patches(state)\n"
        "print_summary_at_the_end(state)\n"
        f"local.include({str(REPO_ROOT / 'tasks' / 'preflight.py')!r})\n"
        "if runs_rig_tasks(host):\n"
        + "".join(f"    local.include({str(REPO_ROOT / 'tasks' / f'{t}.py')!r})\n" for t in TASKS if t != "preflight")
    )

    def invoke(*args: str) -> dict:
        out = tmp_path / "result.json"
        # cwd = repo root: group_data/, files/ and templates/ resolve from there
        subprocess.run(
            [sys.executable, "-m", "tests.support.fake_cli_runner", str(out), "-y", *args,
             str(tmp_path / "inventory.py"), str(deploy)],
            cwd=REPO_ROOT,
            check=True,
            timeout=120,
        )
        data = json.loads(out.read_text())
        assert data["exception"] is None, data["output"]
        return data

    return invoke


@pytest.fixture(scope="module")
def default_run(run) -> dict:
    return run()


def commands(result: dict, name: str) -> list[str]:
    return result["commands"][f"@fake/{name}"]


def test_host_layer_on_fake_rigs(default_run):
    result = default_run
    assert result["failed_hosts"] == ["@fake/rig-one-gpu"], result["output"]

    one = commands(result, "rig-one-gpu")
    # preflight stopped it before any change: only read-only fact commands ran
    probe = HostCapabilities.command  # read-only: it only asks `command -v apt-get` and friends
    assert not [
        c for c in one
        if c != probe and re.search(r"apt-get|apt-mark|systemctl (start|stop|restart|enable|reboot)|sed -i|nvidia-ctk", c)
    ]

    fresh = commands(result, "rig-fresh")
    assert any(re.search(r"apt-get -y .* install nvidia-driver-580-open linux-modules-nvidia-580-open-generic$", c) for c in fresh)
    assert any(c.startswith("apt-mark hold nvidia-driver-580-open") for c in fresh)
    assert not [c for c in fresh if "systemctl reboot" in c]  # driver_reboot: never
    assert any("nvidia-ctk runtime configure --runtime=docker" in c for c in fresh)
    # the handler fired (the fake never reports Docker as running, so pyinfra starts instead of restarting)
    assert fresh.count("systemctl start docker.service") == 2
    assert not [c for c in fresh if "--gpus all" in c]  # smoke test skipped: driver not loaded until reboot
    # the hand-made Docker entries are disabled before the first apt update of the new repo
    disable = next(i for i, c in enumerate(fresh) if c.startswith("sed -i") and "/etc/apt/sources.list" in c)
    update = next(i for i, c in enumerate(fresh) if c.endswith("apt-get update") and i > disable)
    assert disable < update

    conv = commands(result, "rig-converged")
    changing = [
        c
        for c in conv
        if re.search(r"apt-get (-y .*)?install|apt-mark|nvidia-ctk|systemctl (restart|start|stop|reboot)|--gpus|sed -i", c)
    ]
    assert changing == []
    assert "REBOOT REQUIRED" in result["output"]
    assert "rig-one-gpu: gpu-layout: variant 'dual' runs tensor parallel 2; this host has 1 GPU(s)" in result["output"]
    assert result["exit_code"] == 1  # a failed host makes the run fail


def test_reboot_batch_is_the_fleet_minimum(run, default_run):
    name = "tasks/nvidia_driver.py | Install and load the NVIDIA driver (stop serving, install, reboot, verify)"
    assert default_run["op_parallel"][name] == 1
    assert run("--data", "rollout_batch=2")["op_parallel"][name] == 2
