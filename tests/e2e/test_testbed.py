"""The test bed itself: hosts boot, SSH is strict, reboots are real, hosts are isolated, teardown is
complete (also after a crash)."""

from __future__ import annotations

import json
import os
import re
import ssl
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import certifi
import pytest

from rigup.desired.trust import origin_of
from rigup_testbed import hardware as hw
from rigup_testbed.fleet import Testbed
from rigup_testbed.hosts import Host, HostSpec
from rigup_testbed.hub import HOST_LAYER_PACKAGES
from rigup_testbed.image import CA_FILE_NAME, CA_STORE, REPO_ROOT
from rigup_testbed.state import CGROUP_TOP, TestbedError, cgroup_roots, is_same_process
from tests.e2e.conftest import PYINFRA, lock_instance, runs_dir

pytestmark = pytest.mark.e2e


def _two(testbed: Testbed) -> tuple[Host, Host]:
    if len(testbed.hosts) < 2:
        pytest.skip("needs a bed of at least two hosts (RIGUP_TESTBED_HOSTS)")
    return testbed.hosts[0], testbed.hosts[1]


def _wait_running(host: Host, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    state = ""
    while time.monotonic() < deadline:
        proc = host.ssh("systemctl is-system-running --wait", check=False, timeout=timeout)
        state = proc.stdout.strip()
        if proc.returncode != 255:  # 255: ssh itself failed (still booting)
            return state
        time.sleep(0.5)
    return state


def test_hosts_boot_as_debian_12_with_their_own_identity(testbed: Testbed) -> None:
    seen_machine_ids = set()
    for host in testbed.hosts:
        out = host.ssh(
            "id -un; sudo -n id -u; hostname; systemctl is-system-running; cat /etc/machine-id; "
            ". /etc/os-release; echo $ID $VERSION_ID; cat /etc/rigup-testbed/hardware.json"
        ).stdout.splitlines()
        user, sudo_uid, hostname, state, machine_id, os_id = out[:6]
        assert (user, sudo_uid, hostname, state, os_id) == ("rigup", "0", host.name, "running", "debian 12")
        seen_machine_ids.add(machine_id)
        written = hw.from_dict(json.loads("\n".join(out[6:])))
        assert written == host.hardware
        assert [g.memory_total_mib for g in written.gpus] == [24576, 24576]
    assert len(seen_machine_ids) == len(testbed.hosts)


def test_ssh_is_strict_about_host_keys(testbed: Testbed, tmp_path: Path) -> None:
    a, b = _two(testbed)
    lines = {ln.split()[0]: ln.split()[1:] for ln in a.known_hosts.read_text().splitlines()}
    assert lines[a.ip] != lines[b.ip], "hosts must not share a host key"

    def try_with(known_hosts: Path) -> subprocess.CompletedProcess[str]:
        argv = [x.replace(f"UserKnownHostsFile={a.known_hosts}", f"UserKnownHostsFile={known_hosts}") for x in a.ssh_argv()]
        return subprocess.run([*argv, "true"], text=True, capture_output=True, timeout=30)

    # b's key claimed for a's address: the client must refuse to talk to a.
    spoofed = tmp_path / "spoofed"
    spoofed.write_text(f"{a.ip} {' '.join(lines[b.ip])}\n")
    proc = try_with(spoofed)
    assert proc.returncode == 255 and "Host key verification failed" in proc.stderr
    # No entry at all: strict checking refuses instead of trusting on first use.
    empty = tmp_path / "empty"
    empty.write_text("")
    proc = try_with(empty)
    assert proc.returncode == 255 and "Host key verification failed" in proc.stderr
    assert try_with(a.known_hosts).returncode == 0


def test_pyinfra_reboot_is_confirmed_and_host_comes_back(testbed: Testbed, tmp_path: Path) -> None:
    host = testbed.hosts[-1]
    boot_id = host.ssh("cat /proc/sys/kernel/random/boot_id").stdout.strip()
    boots = host.boots()
    uptime_before = float(host.ssh("cut -d' ' -f1 /proc/uptime").stdout)
    # pyinfra only confirms a reboot when the uptime restarts, so an uptime below `delay` is ambiguous.
    if uptime_before < 3:
        time.sleep(3 - uptime_before)
    doc = testbed.fleet(require_all_urls=False)
    data = next(g["hosts"][host.name] for g in doc["groups"].values() if host.name in g["hosts"])
    (tmp_path / "inventory.py").write_text(f"hosts = [({host.name!r}, {data!r})]\n")
    (tmp_path / "reboot.py").write_text(
        textwrap.dedent(
            """
            from pyinfra.operations import server

            server.reboot(name="Reboot the test-bed host", delay=4, interval=1, reboot_timeout=60)
            """
        )
    )
    started = time.monotonic()
    proc = subprocess.run(
        [PYINFRA, "-y", "--data", "_sudo=true", "inventory.py", "reboot.py"],
        cwd=tmp_path,
        text=True,
        capture_output=True,
        timeout=180,
    )
    elapsed = time.monotonic() - started
    assert proc.returncode == 0, proc.stdout + proc.stderr
    output = proc.stdout + proc.stderr
    assert re.search(r"Reboot the test-bed host\s+1\s+1\s", output), output
    assert _wait_running(host) == "running"
    uptime_after = float(host.ssh("cut -d' ' -f1 /proc/uptime").stdout)
    assert uptime_after < elapsed + 5, f"uptime {uptime_after}s did not restart (reboot took {elapsed:.1f}s)"
    assert host.ssh("cat /proc/sys/kernel/random/boot_id").stdout.strip() != boot_id
    assert host.boots() == boots + 1
    assert host.running()


def test_hosts_do_not_break_each_others_units(testbed: Testbed) -> None:
    a, b = _two(testbed)
    unit = "rigup-testbed-probe"
    a.ssh(f"sudo systemd-run --unit={unit} --quiet sleep 600")
    try:
        assert a.ssh(f"systemctl is-active {unit}").stdout.strip() == "active"
        assert b.ssh(f"systemctl is-active {unit}", check=False).stdout.strip() == "inactive"
        # Same unit name on b, plus the things that rewrite a systemd's cgroup tree, must leave a alone.
        b.ssh(f"sudo systemd-run --unit={unit} --quiet sleep 600")
        b.ssh(f"sudo systemctl stop {unit}; sudo systemctl daemon-reexec; sudo systemctl restart systemd-journald systemd-logind")
        assert _wait_running(b) == "running"
        assert a.ssh(f"systemctl is-active {unit}").stdout.strip() == "active"
        assert a.ssh("systemctl is-system-running").stdout.strip() == "running"
    finally:
        a.ssh(f"sudo systemctl stop {unit}", check=False)


def _testbed_traces(instance: str, workdir: Path) -> dict[str, list[str]]:
    """Everything of `instance` visible on the machine: namespaces, links, mounts, cgroups, processes."""
    netns = [n for n in os.listdir("/run/netns") if n.startswith(f"{instance}-")] if os.path.isdir("/run/netns") else []
    links = [ln for ln in subprocess.run(["ip", "-o", "link"], text=True, capture_output=True).stdout.splitlines() if f" {instance}-" in ln]
    mounts = [ln.split()[4] for ln in Path("/proc/self/mountinfo").read_text().splitlines() if str(workdir) in ln.split()[4]]
    cgroups = [str(root / CGROUP_TOP / instance) for root in cgroup_roots() if (root / CGROUP_TOP / instance).exists()]
    procs = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if f"--machine={instance}-" in cmdline or str(workdir) in cmdline:
            procs.append(f"{pid} {cmdline}")
    propagate = Path("/run/systemd/nspawn/propagate")
    runtime = [str(p) for p in propagate.glob(f"{instance}-*")] if propagate.exists() else []
    return {"netns": netns, "links": links, "mounts": mounts, "cgroups": cgroups, "processes": procs, "nspawn_runtime": runtime}


def test_teardown_after_a_crashed_run_leaves_nothing(_testbed_session: None) -> None:
    instance = "rigtc"
    workdir = runs_dir() / instance
    lock = lock_instance(instance)  # raises if another session runs this very test
    # A run that brings a bed up and dies without tearing down (as a killed pytest would).
    script = textwrap.dedent(
        f"""
        import os
        from pathlib import Path
        from rigup_testbed.fleet import Testbed
        from rigup_testbed.hosts import HostSpec
        Testbed(Path({str(workdir)!r}), {instance!r}).up([HostSpec("rig-01", hardware="1x3090")])
        os._exit(0)
        """
    )
    try:
        proc = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, text=True, capture_output=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        traces = _testbed_traces(instance, workdir)
        assert all(traces[k] for k in ("netns", "links", "mounts", "cgroups", "processes")), traces
        state = json.loads((workdir / "state.json").read_text())
        recorded = [(r["pid"], r["starttime"]) for r in state["resources"] if r["kind"] == "process"]
        assert len(recorded) >= 2  # the host's supervisor and the hub services

        started = time.monotonic()
        Testbed(workdir, instance).down()
        took = time.monotonic() - started
        assert _testbed_traces(instance, workdir) == {
            "netns": [], "links": [], "mounts": [], "cgroups": [], "processes": [], "nspawn_runtime": []
        }  # fmt: skip
        assert not any(is_same_process(pid, start) for pid, start in recorded)
        assert not workdir.exists()
        assert took < 30
    finally:
        Testbed(workdir, instance).down()  # a no-op after a passing run; cleans up after a failing one
        lock.release()


def test_a_second_bed_of_a_live_instance_name_is_refused_naming_the_first(testbed: Testbed, tmp_path: Path) -> None:
    """Two checkouts on one machine with the same bed name (a killed run in another clone, say): the
    second is stopped before it makes anything, told which work dir holds the name, and the live bed is
    untouched."""
    other = Testbed(tmp_path / "other", testbed.instance, hub=False)
    with pytest.raises(TestbedError) as refused:
        other.up([])
    assert str(testbed.workdir) in str(refused.value) and f"{testbed.instance!r}" in str(refused.value)
    assert not (tmp_path / "other" / "state.json").exists()
    host = testbed.hosts[0]
    assert host.ssh("true", check=False).returncode == 0  # the first bed still answers


def test_fleet_file_drives_pyinfra_through_inventory(fleet_file: Path, testbed: Testbed, pyinfra_run: Callable[..., subprocess.CompletedProcess[str]]) -> None:
    proc = pyinfra_run(fleet_file, "exec", "--", "cat", "/etc/hostname", timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    output = proc.stdout + proc.stderr
    for host in testbed.hosts:
        assert re.search(rf"\[{host.name}\]\s+{host.name}\b", output), output


def test_hosts_reach_the_hub_services_and_nothing_else(testbed: Testbed) -> None:
    urls = testbed.urls
    host = testbed.hosts[0]
    checks = {
        # The archive stand-in is preconfigured and signed; apt must verify it (no [trusted=yes]).
        "apt": "sudo apt-get update -o APT::Update::Error-Mode=any >/dev/null && apt-cache policy pciutils | grep -q Installed:",
        "git": f"git ls-remote {urls['vllm_fork_git_url']} refs/heads/main | grep -q refs/heads/main",
        "hf": f"curl -sf {urls['hf_endpoint']}/api/models/{next(iter(_hf_repos(testbed)))} >/dev/null",
        "registry": f"curl -sfI https://{urls['container_registry']}/v2/vllm/vllm-openai/manifests/latest | grep -qi '^docker-content-digest: sha256:'",
        "docker_key": f"curl -sf {urls['docker_apt_key_url']} | grep -q 'BEGIN PGP PUBLIC KEY BLOCK'",
    }
    for name, command in checks.items():
        proc = host.ssh(command, check=False)
        assert proc.returncode == 0, f"{name}: {command}: {proc.stderr}"
    # No route and no name service beyond the test bed.
    assert host.ssh("curl -s -m 3 http://1.1.1.1/ >/dev/null", check=False).returncode != 0
    assert host.ssh("getent hosts deb.debian.org", check=False).returncode != 0
    assert host.ssh("ip route show default").stdout.split()[2] == testbed.ledger.info["hub_ip"]


def test_the_hub_speaks_https_with_the_beds_ca_which_the_rigs_trust_as_ubuntu_does(testbed: Testbed) -> None:
    """Every hub service is HTTPS (the world's URLs are), with a certificate from the bed's CA: the rigs trust
    it through their system store (/usr/local/share/ca-certificates + update-ca-certificates, what apt, git,
    curl and Docker read), the fleet file names it as ca_bundle for the control machine, and a client that
    does not hold it is refused."""
    urls = testbed.urls
    assert testbed.ca_cert is not None and testbed.ca_cert.is_file()
    knobs = {k: v for k, v in urls.items() if isinstance(v, str) and "://" in v}
    assert knobs and all(v.startswith("https://") for v in knobs.values()), knobs
    assert testbed.fleet(require_all_urls=False)["data"]["ca_bundle"] == str(testbed.ca_cert)
    assert testbed.fleet(require_all_urls=False)["data"]["docker_insecure_registries"] == []
    host = testbed.hosts[0]
    pem = testbed.ca_cert.read_text().strip()
    assert host.ssh(f"cat {CA_STORE}/{CA_FILE_NAME}").stdout.strip() == pem
    assert pem.splitlines()[1] in host.ssh("cat /etc/ssl/certs/ca-certificates.crt").stdout  # update-ca-certificates ran
    for origin in dict.fromkeys(origin_of(v) for v in knobs.values()):
        # the rig's python3 with its default context: the system store (what rigfetch and the image mirror use)
        probe = f"python3 -c 'import urllib.request,sys; urllib.request.urlopen(sys.argv[1], timeout=10)' {origin}/ 2>&1 || true"
        assert "CERTIFICATE_VERIFY_FAILED" not in host.ssh(probe).stdout, origin
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):  # certifi's bundle: refused
            urllib.request.urlopen(f"{origin}/", timeout=10, context=ssl.create_default_context(cafile=certifi.where()))
        try:
            urllib.request.urlopen(f"{origin}/", timeout=10, context=ssl.create_default_context(cafile=str(testbed.ca_cert)))
        except urllib.error.HTTPError:
            pass  # the handshake passed; "/" itself may be 404


def _hf_repos(testbed: Testbed) -> dict[str, object]:
    ready = json.loads((testbed.workdir / "hub" / "hf" / "ready.json").read_text())
    return ready["repos"]


def test_a_host_layer_bed_boots_its_rigs_with_the_driver_loaded_and_docker_installed(
        testbed_factory: Callable[..., Testbed]) -> None:
    """Testbed.up(host_layer=True), as the modules that test what comes after the host layer boot their beds: a
    host with GPUs boots once with rigup's host-layer packages installed (the driver's module loaded at that boot,
    Docker CE's engine running, the container toolkit), a host without GPUs with none of them."""
    bed = testbed_factory([HostSpec("rig-01"), HostSpec("gw-01", hardware="none", group="gateway")], host_layer=True)
    names = [name for _, packages in HOST_LAYER_PACKAGES for name in packages]
    query = f"dpkg-query -W -f='${{Package}} ${{Status}}\\n' {' '.join(names)} 2>/dev/null | grep -c ' ok installed$'"
    rig, box = bed.host("rig-01"), bed.host("gw-01")
    assert rig.ssh(query, check=False).stdout.strip() == str(len(names))
    assert "580.95.05" in rig.ssh("cat /proc/driver/nvidia/version").stdout
    assert rig.ssh("systemctl is-active docker.service").stdout.strip() == "active"
    assert rig.boots() == 1
    assert box.ssh(query, check=False).stdout.strip() == "0"
    assert box.ssh("systemctl is-system-running", check=False).stdout.strip() == "running"
