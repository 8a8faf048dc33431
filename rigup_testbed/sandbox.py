"""`rigup sandbox up|down|status`: a local fleet of simulated rigs to run the real deploy on.

`up` boots N Debian 12 hosts (systemd-nspawn, each in its own network namespace, real SSH) and the
mirrors they use (apt repositories, a container registry, git remotes, a Hugging Face endpoint) in a hub
namespace, writes sandbox/rigs.yaml and returns, leaving everything running in the background. The rigs
install Docker's real engine and pull the hub's real registry's images; the GPU and vLLM are simulated.
Then, as root, from the checkout (`up` prints these steps with the paths of this install):

    export RIGUP_RIGS=sandbox/rigs.yaml
    .venv/bin/rigup lock --image-digests
    .venv/bin/pyinfra -y inventory.py deploy.py

`down` removes every trace (processes, mounts, namespaces, cgroups, sandbox/). Needs root, and the
Debian packages scripts/setup installs (debootstrap, systemd-container, iproute2, ...).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import sys
from pathlib import Path
from typing import Any

from rigup import DEPLOY_ROOT, WORK_DIR, command

SANDBOX_DIR = WORK_DIR / "sandbox"
FLEET_FILE = SANDBOX_DIR / "rigs.yaml"
# namespaces rigup-hub, rigup-rig-01, ...; another name lets a second sandbox run beside this one
INSTANCE = os.environ.get("RIGUP_SANDBOX_INSTANCE", "rigup")
PRESETS_HINT = "2x3090, 2x3090-nvlink, 1x3090, 2x3080-20gb, mixed-3090-3080, 1x2080ti"


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "sandbox",
        help="local fleet of simulated rigs (booted containers + mirrors) to run the deploy on",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="sandbox_command", required=True, metavar="up|down|status")
    up = commands.add_parser("up", help="boot the simulated rigs and mirrors, write sandbox/rigs.yaml")
    up.add_argument("--hosts", type=int, default=2, help="number of rigs (default 2)")
    up.add_argument(
        "--hardware",
        default="2x3090",
        help=f"GPU preset per rig, comma-separated and repeated over the rigs: {PRESETS_HINT} (default 2x3090)",
    )
    up.add_argument("--canary", type=int, default=1, help="rigs in group 'canary'; the rest are in 'rigs' (default 1)")
    up.add_argument("--gateway", type=int, default=1,
                    help="last rigs in group 'gateway': they serve too, and run the fleet's entrance (nginx + vllm-router) "
                         "(default 1, none for a single rig; its key: sandbox/gateway.key)")
    up.add_argument("--pods", type=int, default=0,
                    help="last rigs given four simulated RTX 3090s serving two dual pods, 'left' on GPUs 0-1 "
                         "(port 8010) and 'right' on GPUs 2-3 (port 8011) (default 0)")
    up.add_argument("--cluster", type=int, default=0, choices=(0, 2, 4),
                    help="the first N rigs (2x RTX 3090 each) serve one model together as cluster 'big' "
                         "(docs/clusters.md): 2 serve a 4-GPU variant as TP 2 x PP 2, 4 an 8-GPU one as TP 2 x PP 4 (default 0)")
    up.add_argument("--replace", action="store_true", help="tear down a running sandbox first")
    up.add_argument("-v", "--verbose", action="store_true",
                    help="relay every line of the builds' tools (pip's for the hub's PyPI mirror); by default one "
                         "summary line each, naming the log that holds the rest")
    up.add_argument("--json", action="store_true", help="print the result as JSON")
    down = commands.add_parser("down", help="stop and remove everything the sandbox created")
    down.add_argument("--json", action="store_true", help="print the result as JSON")
    status = commands.add_parser("status", help="list the sandbox's rigs")
    status.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.set_defaults(func=run)


# What a sandbox cluster serves (`sandbox up --cluster N`), by member count: catalog variants whose GPU
# count splits over N rigs of two GPUs with nothing vLLM refuses across hosts (MTP, no DFlash).
SANDBOX_CLUSTER_VARIANTS = {2: "qwen-multi4-autoround-int4-mtp", 4: "qwen38-multi8-autoround-int4-mtp"}

# What a sandbox rig of pods serves (`sandbox up --pods N`): two TP=2 endpoints of one model.
SANDBOX_PODS = (
    {"name": "left", "variant": "dual", "gpus": [0, 1], "port": 8010},
    {"name": "right", "variant": "dual", "gpus": [2, 3], "port": 8011},
)


def _testbed() -> Any:
    # here, not at the top: the test bed's modules take about 0.27 s to import, and every rigup command
    # imports this module (by name, rigup.cli.COMMAND_MODULES) to build its parser
    from rigup_testbed.fleet import Testbed

    return Testbed(SANDBOX_DIR, INSTANCE)


# Tools the test bed runs on this machine (scripts/setup installs their Debian packages).
PREREQUISITES = {
    "debootstrap": "debootstrap", "systemd-nspawn": "systemd-container", "ip": "iproute2", "unshare": "util-linux",
    "ssh": "openssh-client", "ssh-keygen": "openssh-client", "gpg": "gnupg", "git": "git", "dpkg-deb": "dpkg",
    "apt-ftparchive": "apt-utils", "tar": "tar", "mount": "mount",
}


def missing_prerequisites() -> list[str]:
    """`tool (package)` for each tool the test bed needs that is not on PATH."""
    return [f"{tool} ({pkg})" for tool, pkg in PREREQUISITES.items() if shutil.which(tool) is None]


def run(args: argparse.Namespace) -> int:
    if os.geteuid() != 0:
        print("rigup sandbox: needs root (network namespaces, mounts, cgroups)", file=sys.stderr)
        return 2
    missing = missing_prerequisites() if args.sandbox_command == "up" else []
    if missing:
        print(
            f"rigup sandbox: this machine lacks {', '.join(missing)}; run scripts/setup (as root) to install "
            "them, or apt-get install the packages named (an installed rigup: the packages named)",
            file=sys.stderr,
        )
        return 2
    return {"up": _up, "down": _down, "status": _status}[args.sandbox_command](args)


def _up(args: argparse.Namespace) -> int:
    # here, not at the top: as in _testbed
    from rigup_testbed.fleet import host_names
    from rigup_testbed.hardware import PRESETS
    from rigup_testbed.hosts import HostSpec
    from rigup_testbed.state import TestbedError

    presets = [p.strip() for p in args.hardware.split(",") if p.strip()]
    unknown = [p for p in presets if p not in PRESETS]
    if unknown or not presets:
        print(f"rigup sandbox: unknown --hardware {', '.join(unknown) or '(empty)'}; known: {', '.join(PRESETS)}", file=sys.stderr)
        return 2
    if not 1 <= args.hosts <= 64:
        print("rigup sandbox: --hosts must be between 1 and 64", file=sys.stderr)
        return 2
    if args.verbose:  # read by the test bed's builds (rigup_testbed.pypi.VERBOSE_ENV), here and in its services
        os.environ["RIGUP_VERBOSE"] = "1"
    bed = _testbed()
    if bed.created:
        if not args.replace:
            print(f"rigup sandbox: already up ({bed.ledger.path}); `sandbox down` first or pass --replace", file=sys.stderr)
            return 1
        bed.down()
        bed = _testbed()
    gateways = min(args.gateway, args.hosts - 1) if args.hosts > 1 else 0

    def group(i: int) -> str:
        return "canary" if i < args.canary else "gateway" if i >= args.hosts - gateways else "rigs"

    if not 0 <= args.pods <= args.hosts:
        print("rigup sandbox: --pods must be between 0 and --hosts", file=sys.stderr)
        return 2

    if args.cluster and (args.cluster > args.hosts - args.pods):
        print("rigup sandbox: --cluster N needs N rigs that are not rigs of pods (--hosts - --pods)", file=sys.stderr)
        return 2

    def spec(i: int, name: str) -> Any:
        if i < args.cluster:  # a cluster member: two GPUs, its share of the cluster (docs/clusters.md)
            return HostSpec(name, hardware="2x3090", group=group(i))
        if i >= args.hosts - args.pods:  # a rig of pods (docs/pods.md)
            return HostSpec(name, hardware="4x3090", group=group(i), data={"pods": [dict(p) for p in SANDBOX_PODS]})
        return HostSpec(name, hardware=presets[i % len(presets)], group=group(i))

    specs = [spec(i, name) for i, name in enumerate(host_names(args.hosts))]
    try:
        bed.up(specs)
        group_data = {"gateway": {"gateway_api_key_file": str(_gateway_key())}} if gateways else {}
        # The sandbox's lock file lives with it: its pins name the sandbox mirrors' commits and files.
        clusters = ([{"name": "big", "variant": SANDBOX_CLUSTER_VARIANTS[args.cluster],
                      "hosts": [spec.name for spec in specs[:args.cluster]]}] if args.cluster else [])
        fleet = bed.write_fleet(FLEET_FILE, data={"lock_file": str(SANDBOX_DIR / "rigs.lock.yaml")}, group_data=group_data,
                                real_engine=True, clusters=clusters)
    except TestbedError as exc:
        print(f"rigup sandbox: {exc}", file=sys.stderr)
        try:
            bed.down()
        except TestbedError as down_exc:
            print(f"rigup sandbox: cleanup after the failure: {down_exc}", file=sys.stderr)
        return 1
    result = {"fleet_file": str(fleet), "subnet": bed.ledger.info["subnet"], "hosts": bed.status(), "urls": bed.urls, "timings": bed.timings}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    _print_rows(bed.status())
    print(f"\nmirrors at {bed.ledger.info['hub_ip']} (namespace {INSTANCE}-hub); up in {bed.timings.get('up_s', 0):.1f}s")
    print(f"fleet file: {_rel(fleet)}\n\n{next_steps(fleet)}")
    return 0


def next_steps(fleet: Path) -> str:
    """What `up` tells the user to run next, each command as it runs from a fresh shell here (rigup.command:
    `.venv/bin/...` in a checkout; tests/test_readme.py runs them in a clean environment)."""
    deploy = " ".join(_rel(DEPLOY_ROOT / name) for name in ("inventory.py", "deploy.py"))
    steps = (
        (f"export RIGUP_RIGS={_rel(fleet)}", ""),
        (f"{command()} lock --image-digests", "pin sources, models and images (by digest)"),
        (f"{command('pyinfra')} -y {deploy}", "converge the sandbox's rigs"),
        (f"{command()} sandbox down", "when done: remove everything the sandbox made"),
    )
    width = max(len(step) for step, _ in steps)
    lines = [f"{step:<{width}}    # {why}" if why else step for step, why in steps]
    return "next:  " + "\n       ".join(lines)


def _down(args: argparse.Namespace) -> int:
    from rigup_testbed.state import TestbedError  # here, not at the top: as in _testbed

    bed = _testbed()
    had = bed.created
    try:
        bed.down()
    except TestbedError as exc:
        print(f"rigup sandbox: {exc}", file=sys.stderr)
        return 1
    # Whatever the user or the deploy put there (lock file, logs) goes too: nothing is mounted any more.
    if SANDBOX_DIR.exists():
        shutil.rmtree(SANDBOX_DIR)
    if args.json:
        print(json.dumps({"removed": had}))
    else:
        print("sandbox removed" if had else "no sandbox was up")
    return 0


def _status(args: argparse.Namespace) -> int:
    bed = _testbed()
    rows = bed.status() if bed.created else []
    if args.json:
        print(json.dumps({"up": bed.created, "fleet_file": str(FLEET_FILE) if FLEET_FILE.exists() else None, "hosts": rows}, indent=2))
        return 0
    if not bed.created:
        print(f"no sandbox is up ({command()} sandbox up --hosts N)")
        return 0
    _print_rows(rows)
    print(f"\nfleet file: {_rel(FLEET_FILE)}")
    return 0 if all(r["running"] for r in rows) else 1


def _print_rows(rows: list[dict[str, Any]]) -> None:
    header = ("HOST", "ADDRESS", "GROUP", "HARDWARE", "GPUS", "STATE", "BOOTS")
    table = [header] + [
        (r["name"], r["ip"], r["group"], r["hardware"], str(r["gpus"]), "running" if r["running"] else "stopped", str(r["boots"]))
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


def _gateway_key() -> Path:
    """sandbox/gateway.key (0600): the key the sandbox gateway's clients send, made once per sandbox."""
    path = SANDBOX_DIR / "gateway.key"
    if not path.exists():
        SANDBOX_DIR.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(f"sk-rigup-sandbox-{secrets.token_hex(16)}\n")
    return path


def _rel(path: Path) -> str:
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)
