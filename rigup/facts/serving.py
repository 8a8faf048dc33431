"""Facts of the serving task: rigup's variant units as systemd sees them, the serving state the rig
reports through rigup-servingctl, the state of secret files (never their content), and what a rig
serves now (its provenance records and running rigup units: the gateway's routes and the monitor's
pod targets come from it), and the rig's fingerprint (what a passed gate records, to re-validate on change)."""

from __future__ import annotations

import json
from typing import Any

from pyinfra.api import FactBase, FactProcessError, QuoteString, StringCommand

from rigup.facts.util import python_script
from rigup.layout import RigLayout
from rigup.rig.servingctl import FINGERPRINT_SCRIPT, parse_fingerprint

UNITS_MARK = "--rigup-active-units--"
RECORD_MARK = "--rigup-provenance-record--"


class ServingStatus(FactBase[dict[str, Any]]):
    """
    One quick look at a variant, from ``rigup-servingctl probe`` (no waiting):

    .. code:: python

        {
            "release_present": True,
            "release_sha256": "4f1c...",
            "unit": "rigup-dual.service",
            "active": "active",
            "enabled": "enabled",
            "models": ["qwen3.6-27b-autoround"],
            "serving": True,
            "error": None,
            "provenance": {"variant": "dual", "generation": 3,
                           "release_sha256": "4f1c...", "gate_result": "passed",
                           "failed_release_sha256": None},
        }

    ``{"release_present": False, "serving": False}`` before the first deploy. ``failed_release_sha256``:
    the release whose failed gate (rolled back) still stands, None when none does.
    """

    default = dict

    def command(self, ctl: str, release: str) -> StringCommand:
        return StringCommand(
            "if [ -f", QuoteString(ctl), "]; then", *python_script(QuoteString(ctl), "probe", "--release", QuoteString(release)),
            "; else echo '{\"release_present\": false, \"serving\": false}'; fi",
        )

    def process(self, output: list[str]) -> dict[str, Any]:
        try:
            value = json.loads("\n".join(output))
        except ValueError:
            raise FactProcessError(f"rigup-servingctl probe printed no JSON: {output[-3:]}") from None
        if not isinstance(value, dict):
            raise FactProcessError("rigup-servingctl probe printed something other than an object")
        return value


class RigupVariantUnits(FactBase[dict[str, dict[str, Any]]]):
    """
    Installed rigup variant units (``{unit_dir}/rigup-<variant>.service`` with a
    ``{install_root}/variants/<variant>`` directory; other rigup-* units are not variants):

    .. code:: python

        {"rigup-dual.service": {"enabled": True, "active": True, "state": "active", "restarts": 0,
                                "result": "success"}}

    ``restarts``: how often systemd restarted the unit after a failure since it was last started by hand
    (NRestarts); ``result``: why it last stopped (``exit-code`` after a crash; systemd 252 keeps it at the
    start limit, where it refuses further starts).
    """

    default = dict

    def command(self, install_root: str, unit_dir: str = "/etc/systemd/system") -> StringCommand:
        return StringCommand(
            "for f in", StringCommand(QuoteString(unit_dir.rstrip("/") + "/"), "rigup-*.service;", _separator=""), "do",
            '[ -f "$f" ] || continue;',
            'u=${f##*/}; v=${u#rigup-}; v=${v%.service};',
            "[ -d", StringCommand(QuoteString(RigLayout(install_root).variants_dir + "/"), '"$v"', _separator=""), "] || continue;",
            'printf "%s %s %s %s\\n" "$u" "$(systemctl is-enabled "$u" 2>/dev/null || true)"'
            ' "$(systemctl is-active "$u" 2>/dev/null || true)"'
            ' "$(systemctl show -p NRestarts -p Result "$u" 2>/dev/null | tr \'\\n\' \' \')";',
            "done",
        )

    def process(self, output: list[str]) -> dict[str, dict[str, Any]]:
        units: dict[str, dict[str, Any]] = {}
        for line in output:
            parts = line.split()
            if not parts:
                continue
            # systemctl show prints the properties in an order of its own: read them by name
            props = dict(p.split("=", 1) for p in parts[3:] if "=" in p)
            if len(parts) < 3 or len(props) != len(parts) - 3 or not props.get("NRestarts", "0").isdigit():
                raise FactProcessError(f"unexpected unit line: {line!r}")
            unit, enabled, active = parts[:3]
            units[unit] = {
                "enabled": enabled in ("enabled", "enabled-runtime"),
                "active": active in ("active", "activating", "reloading", "deactivating"),
                "state": active,
                # an old systemd without these properties prints nothing for them
                "restarts": int(props.get("NRestarts") or 0),
                "result": props.get("Result", ""),
            }
        return units


class SecretFileState(FactBase[dict[str, str] | None]):
    """
    Mode, owner and SHA-256 of a file, or None when it does not exist:

    .. code:: python

        {"mode": "600", "owner": "root:root", "sha256": "9f86d0..."}
    """

    def command(self, path: str) -> StringCommand:
        return StringCommand(
            "if [ -f", QuoteString(path), "]; then stat -c '%a %U:%G'", QuoteString(path),
            "&& sha256sum", QuoteString(path), "; fi",
        )

    def process(self, output: list[str]) -> dict[str, str] | None:
        if len(output) != 2:
            raise FactProcessError(f"unexpected output: {len(output)} lines")
        mode, owner = output[0].split()
        return {"mode": mode, "owner": owner, "sha256": output[1].split()[0]}


class ServedRecord(FactBase[dict[str, Any]]):
    """
    What a rig serves: the provenance record of each of its pods (``{install_root}/state/provenance.json``
    for a host without pods, ``state/pods/<pod>/provenance.json`` for each pod a host lists; none before
    a release passed the gate) and the rigup units systemd runs now:

    .. code:: python

        {"records": [{"variant": "dual", "unit": "rigup-dual.service", "gate": {"result": "passed"}, ...}],
         "active_units": ["rigup-dual.service"]}
    """

    default = dict

    def command(self, install_root: str) -> StringCommand:
        layout = RigLayout(install_root)
        return StringCommand(
            "for f in", QuoteString(layout.provenance), StringCommand(QuoteString(layout.pods_state_dir + "/"),
                                                                                 "*/provenance.json;", _separator=""),
            'do [ -f "$f" ] || continue; echo', RECORD_MARK, '; cat "$f"; echo; done; echo', UNITS_MARK,
            "; systemctl list-units --type=service --state=active --no-legend --plain 'rigup-*.service' 2>/dev/null"
            " | awk '{print $1}'",
        )  # fmt: skip

    def process(self, output: list[str]) -> dict[str, Any]:
        mark = output.index(UNITS_MARK) if UNITS_MARK in output else len(output)
        records: list[dict[str, Any]] = []
        chunks: list[list[str]] = []
        for line in output[:mark]:
            if line == RECORD_MARK:
                chunks.append([])
            elif chunks:
                chunks[-1].append(line)
        for chunk in chunks:
            try:
                record = json.loads("\n".join(chunk))
            except ValueError:
                continue  # a torn or foreign file: no route from it
            if isinstance(record, dict):
                records.append(record)
        return {
            "records": records,
            "active_units": [line.strip() for line in output[mark + 1 :] if line.strip().endswith(".service")],
        }


class RigFingerprint(FactBase[dict[str, Any]]):
    """
    The rig's fingerprint now, as rigup-servingctl's gate records it with a release that passed (the same
    script and parser, rigup.rig.servingctl.FINGERPRINT_SCRIPT): the GPUs' UUIDs, PCI bus ids and VBIOS,
    the driver, nvidia-smi's GPU link and P2P matrices, the loaded NVIDIA module's line, the kernel and
    the BIOS version; None where the rig gave nothing. The serving task compares it with each pod's record.

    .. code:: python

        {"driver": "580.95.05", "gpu0.uuid": "GPU-1b6f...", "gpu0.pci": "00000000:01:00.0",
         "gpu0.vbios": "94.02.42.00.A9", "topology": "GPU0 X PIX; GPU1 PIX X", "p2p": "GPU0 X NS; GPU1 NS X",
         "module": "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64 580.95.05 ...",
         "kernel": "6.8.0-45-generic", "bios": "F20"}
    """

    default = dict
    command = FINGERPRINT_SCRIPT

    def process(self, output: list[str]) -> dict[str, Any]:
        return dict(parse_fingerprint(output))
