"""Helpers shared by the end-to-end tests: commands on bed hosts, reboots, snapshots of what a deploy
could change, and runs of the real CLIs (pyinfra, `python -m rigup`) with a fleet file."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from rigup.desired.knobs import load_defaults
from rigup.desired.recipe import resolve
from rigup.runstate import remote_commands_in
from rigup_testbed.hosts import Host, wait_ready
from rigup_testbed.image import REPO_ROOT

PYINFRA = str(Path(sys.executable).with_name("pyinfra"))
HOSTLAYER_DEPLOY = "tests/e2e/hostlayer_deploy.py"  # the host-layer phases only (preflight .. toolkit)


def disk_needed_gb() -> float:
    data = load_defaults()
    return resolve(data).disk_needed_gb + float(data["preflight_disk_margin_gb"])


def skip_without_disk(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Skip when this machine's disk, which the bed's hosts share, is below what preflight wants."""
    free = shutil.disk_usage(tmp_path_factory.getbasetemp()).free / 1e9
    if free < disk_needed_gb() + 5:
        pytest.skip(f"the hosts share this machine's disk: {free:.0f} GB free, preflight wants {disk_needed_gb():.0f} GB")


def sh(host: Host, command: str, timeout: float = 300) -> str:
    """`command` over SSH on `host`; it must succeed. Its stdout."""
    proc = host.ssh(command, check=False, timeout=timeout)
    assert proc.returncode == 0, f"{host.name}: {command}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def reboot(host: Host) -> None:
    before = host.boots()
    host.ssh("sudo systemctl reboot", check=False, timeout=30)
    deadline = time.monotonic() + 120
    while host.boots() == before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert host.boots() > before, f"{host.name} did not reboot"
    wait_ready([host], timeout=180)


def snapshot(host: Host, *, install_root: bool = False) -> str:
    """What a deploy could change: packages (with holds), apt sources and config, modprobe and
    systemd config, daemon.json; with `install_root`, anything under /opt/rigup too."""
    command = (
        "dpkg-query -W -f='${Package} ${Version} ${db:Status-Abbrev}\\n' | sort; "
        "ls -l --time-style=+%s /etc/apt/sources.list.d /etc/modprobe.d /etc/systemd/system /etc/apt/apt.conf.d; "
        "sudo cat /etc/docker/daemon.json 2>/dev/null || true"
    )
    if install_root:
        command += "; sudo find /opt/rigup 2>/dev/null | sort || true"
    return sh(host, command)


def run(
    argv: Sequence[str], fleet: Path, timeout: float, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`argv` from the repo root with inventory.py reading `fleet` (RIGUP_RIGS), plus `env`."""
    return subprocess.run(
        list(argv),
        cwd=REPO_ROOT,
        env={**os.environ, "RIGUP_RIGS": str(fleet), **(env or {})},
        text=True,
        capture_output=True,
        timeout=timeout,
    )


def run_json(
    argv: Sequence[str], fleet: Path, timeout: float, env: Mapping[str, str] | None = None
) -> tuple[int, dict[str, Any], str]:
    """`run`, for a command printing JSON (after any other lines): exit code, the JSON, all output."""
    proc = run(argv, fleet, timeout, env)
    start = proc.stdout.find("{")
    assert start >= 0, f"no JSON on stdout\n{proc.stdout}\n{proc.stderr}"
    return proc.returncode, json.loads(proc.stdout[start:]), proc.stdout + proc.stderr


def converge_json(fleet: Path, what: str, deploy: str = HOSTLAYER_DEPLOY) -> tuple[int, dict[str, Any], str]:
    """`pyinfra -y --json inventory.py <deploy>` over the fleet; prints how long it took (shown with -s)."""
    started = time.monotonic()
    result = run_json([PYINFRA, "-y", "--json", "inventory.py", deploy], fleet, 1500)
    print(f"{what}: {time.monotonic() - started:.1f} s")
    return result


def op(results: dict[str, Any], suffix: str) -> dict[str, Any]:
    """The one operation in pyinfra's JSON results whose name ends with `suffix`."""
    (found,) = [o for o in results["results"]["operations"] if o["name"].endswith(suffix)]
    return found


def changed(results: dict[str, Any], host: str) -> list[str]:
    """Names of the operations that changed `host`."""
    return [o["name"] for o in results["results"]["operations"] if host in o["success"]]


def remote_commands(log: str) -> dict[str, int]:
    """The closing summary's REMOTE COMMANDS column (commands and file transfers the run sent), per host."""
    counts = remote_commands_in(log)
    assert counts is not None, "the converge printed no summary with a REMOTE COMMANDS column"
    return counts


def key_files(directory: Path, **keys: str) -> dict[str, Path]:
    """One 0600 file per key, as an operator keeps an API key: name -> path (<directory>/<name>.key)."""
    paths = {}
    for name, value in keys.items():
        path = directory / f"{name}.key"
        path.write_text(value + "\n")
        path.chmod(0o600)
        paths[name] = path
    return paths


ENTRANCE_PORT = 4000  # gateway_port's default


def entrance_url(address: str, port: int = ENTRANCE_PORT) -> str:
    """The fleet's entrance on a bed host: https by default (issue 44), its certificate from the fleet CA."""
    return f"https://{address}:{port}"


def fleet_ca_file(fleet: Path) -> str:
    """The fleet CA's certificate beside a bed's fleet file (fleet_ca_dir's default): what a client of the
    entrance trusts (requests' verify=, curl's --cacert)."""
    return str(fleet.parent / "fleet-ca" / "ca.crt")


def pod_key_of(fleet: Path, host: str, pod: str) -> str:
    """A pod's own API key as the converge made it beside a bed's fleet file (fleet_ca_dir's default; the simple
    form's pod is named after its variant): what every caller of the pod presents (rigup.desired.pod_keys)."""
    return (fleet.parent / "fleet-ca" / "pod-keys" / host / f"{pod}.key").read_text().strip()


def keyed_curl(key_file: str) -> str:
    """The start of a curl command run as root on a rig that presents the pod's own key, read from its 0600 key file
    (secrets/VLLM_API_KEY of the pod's directory, rigup.desired.render.secret_file), without putting it on any
    command line: the shell reads it and hands it to curl as a config file on stdin (`curl -K -`). Append curl's
    own arguments."""
    return (f"{{ read -r key < {key_file}; "
            "printf 'header = \"Authorization: Bearer %s\"\\n' \"$key\"; } | curl -K -")


# containerd's state of a running container, as docker's engine keeps it: the runtime bundle's config.json (the OCI
# spec, the container's environment among it) and the metadata database
CONTAINERD_BUNDLES = "/run/containerd/io.containerd.runtime.v2.task/moby"
CONTAINERD_META = "/var/lib/containerd/io.containerd.metadata.v1.bolt/meta.db"
CONTAINERD_STATE = "/run/containerd /var/lib/containerd"
# the bundle of every running container: its id is on its shim's command line (`containerd-shim-runc-v2 -namespace
# moby -id <id> ...`), which any local user reads
BUNDLE_CONFIGS = (r"$(ps -eo args | sed -n 's/.*containerd-shim.* -id \([0-9a-f]\{64\}\).*/\1/p' | sort -u"
                  f" | sed 's|^|{CONTAINERD_BUNDLES}/|; s|$|/config.json|')")


def secret_holders(host: Host, secret: str, where: str) -> dict[str, Any]:
    """Where `secret` shows on `host`: in a process's argv, in the journal, the files under `where` holding it
    (each as 'mode owner path'), and containerd's files a local user who is not root can read ('mode hits path'
    for each: the bundle's config.json of every container whose id the shims' command lines show, and the
    metadata database). The secret never goes on a command line here either: it is joined from two halves by
    printf into a pipe and grep reads it as a pattern file (sudo logs the command lines it runs)."""
    half = len(secret) // 2
    joined = f"printf '%s%s\\n' {secret[:half]} {secret[half:]} |"
    pattern = joined + " { exec 3<&0; "  # grep's pattern file on fd 3, its input the command's output
    argv = host.ssh(pattern + "ps -eo args | grep -cF -f /dev/fd/3; }", check=False).stdout.strip()
    journal = host.ssh(pattern + "sudo journalctl --no-pager -o cat | grep -cF -f /dev/fd/3; }", check=False).stdout.strip()
    # sudo closes descriptors past 2: the pattern on stdin there, in a 0600 file of root's for the command's length.
    # containerd's state: every bundle's config.json and the metadata database (not a container's rootfs under
    # the bundle, the image's files again, which the sweep of /var/lib/docker reads once)
    sweep = (f"grep -rlF --exclude-dir=containerd -f $p {where}; find {CONTAINERD_STATE} -maxdepth 4 "
             r"\( -name config.json -o -name meta.db \) -type f -exec grep -lF -f $p {} +")
    files = host.ssh(joined + f" sudo sh -c 'p=$(mktemp -p /root) && cat > $p; {{ {sweep}; }} 2>/dev/null"
                     " | xargs -r stat -c \"%a %U %n\"; rm -f $p'", check=False, timeout=180).stdout.splitlines()
    # as the bed's user, not root: the pattern in a 0600 file of its own for the length of the command
    local = host.ssh(
        joined + ' { p=$(mktemp) && cat > "$p"; '
        f'for f in {BUNDLE_CONFIGS} {CONTAINERD_META}; do '
        'if [ -r "$f" ]; then printf "%s %s %s\\n" "$(stat -c %a "$f")" "$(grep -caF -f "$p" "$f")" "$f"; fi; done; '
        'rm -f "$p"; }', check=False).stdout.splitlines()
    return {"argv": int(argv or 0), "journal": int(journal or 0), "files": files, "containerd": local}


def assert_secret_private(host: Host, secret: str, where: str = "/etc /opt/rigup /var/log /run /tmp /var/lib") -> list[str]:
    """`secret` on no process's argv, in no journal line, in no file under `where` that group or others can read
    (containerd's state included), and in none of containerd's files a local user reads; the files that hold it
    (their owner's alone)."""
    found = secret_holders(host, secret, where)
    assert found["argv"] == 0 and found["journal"] == 0, (host.name, found)
    assert [line for line in found["files"] if line.split()[0][1:] != "00"] == [], (host.name, found["files"])
    assert [line for line in found["containerd"] if line.split()[1] != "0"] == [], (host.name, found["containerd"])
    return found["files"]


def containerd_bundles_read(host: Host) -> list[str]:
    """The containerd files of `host` a local user who is not root reads ('mode path'): the runtime bundle's
    config.json of each container whose id the shims' command lines show, and the metadata database."""
    return host.ssh(f'for f in {BUNDLE_CONFIGS} {CONTAINERD_META}; '
                    'do [ -r "$f" ] && stat -c "%a %n" "$f"; done; true', check=False).stdout.splitlines()
