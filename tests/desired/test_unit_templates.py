"""The systemd units and drop-ins rigup writes besides the variant's, rendered from templates/ with the values
the deploy passes, checked by `systemd-analyze verify` and read back section by section; and no unit text
left in rigup's Python (issue 40: every unit, drop-in and timer is a template).

verify runs with --root on a throwaway tree: the host's unit directory copied in, stand-ins for the
binaries the units name (verify checks that ExecStart= binaries exist) and for the packages' units the
drop-ins extend. Any message about our files, not only a non-zero exit, fails a test: verify only warns
("ignoring") on unknown keys and bad values.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from rigup import REPO_ROOT
from rigup.desired.cluster import FIREWALL_FILE, FIREWALL_TABLE, FIREWALL_UNIT, firewall_unit_text
from rigup.desired.dashboards import GRAFANA_PORT_DROPIN, port_dropin_text
from rigup.desired.image_mirror import (
    BINARY,
    CONFIG_FILE,
    DROPIN_FILE,
    KEEP_FILE,
    PRUNE_TIMER,
    PRUNE_UNIT,
    UNIT,
    dropin_text,
    prune_timer_text,
    prune_unit_text,
)
from rigup.layout import RigLayout

SECTION = re.compile(r"^\[(?P<name>[A-Za-z]+)\]$")
GRAFANA_UNIT = "grafana-server.service"


def sections(text: str) -> dict[str, list[tuple[str, str]]]:
    """A unit file's sections, each its (key, value) lines in order (keys repeat: ExecStart= resets the list).
    Comments and blank lines are skipped; any other line outside `key=value` fails the test."""
    parsed: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        header = SECTION.match(line)
        if header:
            assert header["name"] not in parsed, f"line {number}: section [{header['name']}] twice"
            current = parsed[header["name"]] = []
            continue
        assert current is not None and "=" in line, f"line {number}: {line!r} is neither a section nor key=value"
        key, value = line.split("=", 1)
        current.append((key, value))
    return parsed


def rendered_cleanly(text: str) -> None:
    """What the templates' Jinja comments and whitespace control must not leave behind."""
    assert "{#" not in text and "#}" not in text and "{{" not in text, text
    assert text.endswith("\n") and not text.endswith("\n\n"), repr(text[-20:])
    assert text.splitlines()[0].strip(), "a blank first line"


def executable(root: Path, path: str) -> None:
    stand_in = root / path.lstrip("/")
    stand_in.parent.mkdir(parents=True, exist_ok=True)
    stand_in.write_text("#!/bin/sh\nexit 0\n")
    stand_in.chmod(0o755)


def put(root: Path, path: str, text: str) -> None:
    target = root / path.lstrip("/")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)


@pytest.fixture()
def root(tmp_path: Path) -> Path:
    if shutil.which("systemd-analyze") is None:
        pytest.fail("systemd-analyze not installed (Debian package systemd; scripts/setup installs it)")
    tree = tmp_path / "root"
    shutil.copytree("/usr/lib/systemd/system", tree / "usr/lib/systemd/system", symlinks=True)
    (tree / "etc/systemd/system").mkdir(parents=True)
    return tree


def verify(root: Path, unit: str, *mentions: str) -> None:
    """systemd-analyze verify of `unit` (from /etc/systemd/system or the packages' directory, with its
    drop-ins): exit 0 and no message naming the unit or any of `mentions`."""
    proc = subprocess.run(["systemd-analyze", "verify", "--man=no", f"--root={root}", unit],
                          capture_output=True, text=True, timeout=60)
    output = proc.stdout + proc.stderr
    problems = [line for line in output.splitlines() if any(name in line for name in (unit, *mentions))]
    assert proc.returncode == 0 and not problems, output


def test_the_registry_drop_in_runs_rigups_config_and_verifies(root: Path) -> None:
    text = dropin_text()
    rendered_cleanly(text)
    # ExecStart= empty first: a drop-in's ExecStart adds to the package's unless the list is reset
    assert sections(text) == {"Service": [("ExecStart", ""), ("ExecStart", f"{BINARY} serve {CONFIG_FILE}"),
                                          ("Restart", "on-failure"), ("RestartSec", "2")]}
    # the package's unit as Debian ships it, in the packages' directory; the drop-in where the deploy puts it
    put(root, f"/usr/lib/systemd/system/{UNIT}",
        "[Unit]\nDescription=Docker registry\n\n[Service]\nExecStart=/usr/bin/docker-registry serve "
        "/etc/docker/registry/config.yml\n\n[Install]\nWantedBy=multi-user.target\n")
    executable(root, BINARY)
    assert DROPIN_FILE == f"/etc/systemd/system/{UNIT}.d/rigup.conf"
    put(root, DROPIN_FILE, text)
    verify(root, UNIT, "rigup.conf")


def test_the_prune_unit_and_timer_run_the_helper_daily_and_verify(root: Path) -> None:
    script = RigLayout("/opt/rigup").image_mirror_helper
    unit, timer = prune_unit_text(script), prune_timer_text()
    for text in (unit, timer):
        rendered_cleanly(text)
    assert sections(unit) == {
        "Unit": [("Description", "rigup: keep the image mirror's cache under its bound")],
        "Service": [("Type", "oneshot"), ("ExecStart", f"/usr/bin/python3 {script} prune {KEEP_FILE}")],
    }
    assert sections(timer) == {
        "Unit": [("Description", "rigup: prune the image mirror's cache daily")],
        "Timer": [("OnBootSec", "15min"), ("OnUnitActiveSec", "1d"), ("RandomizedDelaySec", "1h")],
        "Install": [("WantedBy", "timers.target")],
    }
    executable(root, "/usr/bin/python3")
    put(root, f"/etc/systemd/system/{PRUNE_UNIT}", unit)
    put(root, f"/etc/systemd/system/{PRUNE_TIMER}", timer)
    verify(root, f"/etc/systemd/system/{PRUNE_TIMER}", PRUNE_UNIT)
    verify(root, f"/etc/systemd/system/{PRUNE_UNIT}", PRUNE_TIMER)


def test_the_cluster_firewall_unit_loads_and_drops_rigups_table_and_verifies(root: Path) -> None:
    text = firewall_unit_text()
    rendered_cleanly(text)
    assert sections(text) == {
        "Unit": [("Description", "rigup: admit only the cluster's members to Ray's and NCCL's ports"),
                 ("Wants", "network-pre.target"), ("Before", "network-pre.target docker.service")],
        "Service": [("Type", "oneshot"), ("RemainAfterExit", "yes"), ("ExecStart", f"/usr/sbin/nft -f {FIREWALL_FILE}"),
                    ("ExecStop", f"/usr/sbin/nft delete table inet {FIREWALL_TABLE}")],
        "Install": [("WantedBy", "multi-user.target")],
    }
    executable(root, "/usr/sbin/nft")
    put(root, f"/etc/systemd/system/{FIREWALL_UNIT}", text)
    verify(root, f"/etc/systemd/system/{FIREWALL_UNIT}")


@pytest.mark.parametrize("port", [3000, 3001])
def test_the_grafana_drop_in_sets_its_port_and_verifies(root: Path, port: int) -> None:
    text = port_dropin_text(port)
    rendered_cleanly(text)
    assert sections(text) == {"Service": [("Environment", f"GF_SERVER_HTTP_PORT={port}")]}
    put(root, f"/usr/lib/systemd/system/{GRAFANA_UNIT}",
        "[Unit]\nDescription=Grafana instance\n\n[Service]\nExecStart=/usr/sbin/grafana-server\n\n"
        "[Install]\nWantedBy=multi-user.target\n")
    executable(root, "/usr/sbin/grafana-server")
    assert GRAFANA_PORT_DROPIN == f"/etc/systemd/system/{GRAFANA_UNIT}.d/rigup-port.conf"
    put(root, GRAFANA_PORT_DROPIN, text)
    verify(root, GRAFANA_UNIT, "rigup-port.conf")


# A unit file's section header where a string spells it (after a quote or a \n escape, or alone on a line of a
# triple-quoted string; `list[Path]` is Python), or the key every service names.
UNIT_TEXT = re.compile(r"""(["']|\\n|^\s*)\[(Unit|Service|Timer|Install|Socket|Path|Mount|Slice)\]|ExecStart=""")


def test_no_unit_text_is_spelled_in_rigups_python() -> None:
    """Every unit, drop-in and timer rigup writes is a template in templates/ (the test bed, rigup_testbed/,
    builds its own hosts and is not scanned)."""
    sources = sorted(p for top in ("rigup", "tasks") for p in (REPO_ROOT / top).rglob("*.py"))
    assert len(sources) > 50  # the scan reads the package and the task files, not an empty directory
    spelled = [f"{path.relative_to(REPO_ROOT)}:{number}: {line.strip()}"
               for path in sources
               for number, line in enumerate(path.read_text().splitlines(), 1) if UNIT_TEXT.search(line)]
    assert spelled == [], "unit text in Python; make it a template in templates/:\n" + "\n".join(spelled)
