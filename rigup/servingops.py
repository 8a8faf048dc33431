"""Facts and operations of the serving task (tasks/serving.py): secrets, the one-variant rule, the
image, and the health gate that runs on the rig through rigup-servingctl (rigup/servingctl.py).

Control-machine helpers for the API key (`load_api_key`; the HF token is rigup.lock.read_hf_token,
shared with the model task) and the gate's time budget (`health_timeout_s`) live here too, so the
task file stays a list of operations.
"""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pyinfra import host
from pyinfra.api import FactBase, FactProcessError, OperationValueError, QuoteString, StringCommand, operation
from pyinfra.api.hiddenvalue import HiddenValue

from rigup.recipe import Recipe

CTL_NAME = "rigup-servingctl"
# Gate budget when serving_health_timeout_s is None: a base for container start, CUDA init and
# graph capture, plus a load time per GB of weights (a cold page cache reads ~100-400 MB/s from
# SATA/NVMe on consumer rigs), plus the pip install a Genesis entrypoint runs on every start.
HEALTH_BASE_S = 300
HEALTH_PER_GB_S = 30
HEALTH_GENESIS_S = 120


class SecretError(ValueError):
    """A secret file on the control machine cannot be used (missing, empty, readable by others)."""


# --------------------------------------------------------------------------------------------
# control machine: secrets and budgets


def read_secret_file(path: str | os.PathLike[str], knob: str) -> str:
    """The one-line secret in `path` (stripped). Refuses files group or others can read."""
    file = Path(path).expanduser()
    try:
        info = file.stat()
    except FileNotFoundError:
        raise SecretError(f"{knob}: {file} does not exist") from None
    if not stat.S_ISREG(info.st_mode):
        raise SecretError(f"{knob}: {file} is not a regular file")
    if info.st_mode & 0o077:
        raise SecretError(
            f"{knob}: {file} is readable by group or others (mode {stat.S_IMODE(info.st_mode):04o}); chmod 600 it"
        )
    value = file.read_text(encoding="utf-8").strip()
    if not value or "\n" in value:
        raise SecretError(f"{knob}: {file} must hold exactly one non-empty line")
    return value


def load_api_key(host_data: Mapping[str, Any]) -> str | None:
    """The API key from `serving_api_key_file` on the control machine; None: the API is open."""
    path = host_data.get("serving_api_key_file")
    return None if path is None else read_secret_file(path, "serving_api_key_file")


def health_timeout_s(recipe: Recipe, override: float | int | None) -> int:
    """Seconds the gate waits for the model: the knob when set, else scaled with the weights' size."""
    if override is not None:
        if isinstance(override, bool) or not isinstance(override, (int, float)) or override <= 0:
            raise ValueError(f"serving_health_timeout_s must be a positive number, got {override!r}")
        return int(math.ceil(override))
    weights_gb = sum(m.approx_size_gb for m in recipe.models)
    return int(HEALTH_BASE_S + math.ceil(HEALTH_PER_GB_S * weights_gb) + (HEALTH_GENESIS_S if recipe.genesis else 0))


def ctl_path(install_root: str) -> str:
    return f"{install_root.rstrip('/')}/bin/{CTL_NAME}"


# --------------------------------------------------------------------------------------------
# facts


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
                           "release_sha256": "4f1c...", "gate_result": "passed"},
        }

    ``{"release_present": False, "serving": False}`` before the first deploy.
    """

    default = dict

    def command(self, ctl: str, release: str) -> StringCommand:
        return StringCommand(
            "if [ -f", QuoteString(ctl), "]; then python3", QuoteString(ctl), "probe --release", QuoteString(release),
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

        {"rigup-dual.service": {"enabled": True, "active": True, "state": "active"}}
    """

    default = dict

    def command(self, install_root: str, unit_dir: str = "/etc/systemd/system") -> StringCommand:
        return StringCommand(
            "for f in", StringCommand(QuoteString(unit_dir.rstrip("/") + "/"), "rigup-*.service;", _separator=""), "do",
            '[ -f "$f" ] || continue;',
            'u=${f##*/}; v=${u#rigup-}; v=${v%.service};',
            "[ -d", StringCommand(QuoteString(install_root.rstrip("/") + "/variants/"), '"$v"', _separator=""), "] || continue;",
            'printf "%s %s %s\\n" "$u" "$(systemctl is-enabled "$u" 2>/dev/null || true)"'
            ' "$(systemctl is-active "$u" 2>/dev/null || true)";',
            "done",
        )

    def process(self, output: list[str]) -> dict[str, dict[str, Any]]:
        units: dict[str, dict[str, Any]] = {}
        for line in output:
            parts = line.split()
            if not parts:
                continue
            if len(parts) != 3:
                raise FactProcessError(f"unexpected unit line: {line!r}")
            unit, enabled, active = parts
            units[unit] = {
                "enabled": enabled in ("enabled", "enabled-runtime"),
                "active": active in ("active", "activating", "reloading", "deactivating"),
                "state": active,
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


class DockerImageId(FactBase[str | None]):
    """Local id of an image reference (``sha256:...``), or None when it is not pulled."""

    def requires_command(self, *args: Any, **kwargs: Any) -> str:
        return "docker"

    def command(self, ref: str) -> StringCommand:
        return StringCommand("docker image inspect --format '{{.Id}}'", QuoteString(ref), "2>/dev/null || true")

    def process(self, output: list[str]) -> str | None:
        lines = [line.strip() for line in output if line.strip()]
        return lines[0] if lines else None


# --------------------------------------------------------------------------------------------
# operations


@operation()
def secret_file(path: str, content: HiddenValue | str, mode: str = "600"):
    """
    Write a file holding secrets, owned by root, readable by root only.

    + path: file on the rig
    + content: full text (a ``HiddenValue`` keeps it out of pyinfra's output); must end in a newline
    + mode: octal mode, ``600`` by default

    The text travels on the command's stdin into a temporary file created under ``umask 077`` in
    the target's directory, then is renamed over ``path``: unlike ``files.put`` it never sits in
    /tmp or at ``path`` with a wider mode, and ``--diff`` never prints it.

    **Example:**

    .. code:: python

        secret_file(
            name="Write the variant's environment file",
            path="/opt/rigup/variants/dual/.env",
            content=HiddenValue(env_text),
        )
    """
    import hashlib

    text = content.unmask() if isinstance(content, HiddenValue) else content
    if not text.endswith("\n"):
        raise OperationValueError("secret_file content must end with a newline")
    if not mode.isdigit() or len(mode.lstrip("0")) > 3:
        raise OperationValueError(f"mode must be octal digits like 600, got {mode!r}")
    wanted_mode = mode.lstrip("0") or "0"
    wanted_sha = hashlib.sha256(text.encode()).hexdigest()
    current = host.get_fact(SecretFileState, path=path)
    if current is not None and current["sha256"] == wanted_sha and current["mode"] == wanted_mode and current["owner"] == "root:root":
        host.noop(f"secret file {path} is up to date")
        return
    if current is not None and current["sha256"] == wanted_sha:
        yield StringCommand("chown root:root", QuoteString(path), "&& chmod", wanted_mode, QuoteString(path))
        return
    yield StringCommand(
        "umask 077 && tmp=$(mktemp", StringCommand(QuoteString(path), ".XXXXXX)", _separator=""),
        '&& cat > "$tmp" && chown root:root "$tmp" && chmod', wanted_mode, '"$tmp" && mv -f "$tmp"', QuoteString(path),
        _stdin=text,
    )


@operation()
def sole_variant(unit: str, install_root: str):
    """
    Stop and disable every rigup variant unit other than ``unit``: one variant owns the GPUs.

    + unit: the variant unit that stays, e.g. ``rigup-dual.service``
    + install_root: rigup's directory on the rig (variant units have a directory under it)

    **Example:**

    .. code:: python

        sole_variant(
            name="Stop other rigup variants",
            unit="rigup-dual.service",
            install_root="/opt/rigup",
        )
    """
    units = host.get_fact(RigupVariantUnits, install_root=install_root)
    others = [u for u, s in sorted(units.items()) if u != unit and (s["enabled"] or s["active"])]
    if not others:
        host.noop(f"no rigup variant other than {unit} is enabled or running")
        return
    for other in others:
        yield StringCommand("systemctl disable --now", QuoteString(other))


@operation()
def image_pulled(ref: str):
    """
    Pull a container image unless it is already present, so a restart does not wait for a pull.

    + ref: full reference, ``registry/repository:tag[@sha256:digest]``

    **Example:**

    .. code:: python

        image_pulled(name="Pull the vLLM image", ref="docker.io/vllm/vllm-openai:v0.21.0")
    """
    image_id = host.get_fact(DockerImageId, ref=ref)
    if image_id is not None:
        host.noop(f"image {ref} is present ({image_id[:19]})")
        return
    yield StringCommand("docker pull --quiet", QuoteString(ref))


@operation()
def variant_service(ctl: str, release: str, unit: str):
    """
    Run the variant's unit on the files on disk: started, enabled, restarted only when stale.

    + ctl: path of rigup-servingctl on the rig
    + release: the variant's release.json on the rig
    + unit: the variant's unit, e.g. ``rigup-dual.service``

    Decisions come from the rig, not from what this run uploaded, so a run interrupted between
    writing the files and restarting is finished by the next one:

    + ``systemctl daemon-reload`` only when systemd reports the unit file changed on disk
      (NeedDaemonReload) or has never loaded it; a reload can detach GPUs from running containers
      (NVIDIA/nvidia-container-toolkit#48), so it is never done otherwise
    + ``systemctl restart`` only when compose.yaml, .env, release.json or the unit changed after
      the service's main process started; ``start`` when it is not running (both after
      ``reset-failed``: earlier crash loops must not leave a deliberate start refused by the
      unit's start limit)
    + ``systemctl enable`` when it is not enabled at boot

    **Example:**

    .. code:: python

        variant_service(
            name="Run the variant on its current files",
            ctl="/opt/rigup/bin/rigup-servingctl",
            release="/opt/rigup/variants/dual/release.json",
            unit="rigup-dual.service",
        )
    """
    status = host.get_fact(ServingStatus, ctl=ctl, release=release)
    if status.get("release_present") and status.get("unit") != unit:
        raise OperationValueError(f"{release} is for {status.get('unit')}, not {unit}")
    changed = False
    if status.get("need_daemon_reload"):
        yield StringCommand("systemctl daemon-reload")
        changed = True
    active = status.get("active")
    running = active in ("active", "activating", "reloading")
    if not running or status.get("stale"):
        if running or active == "failed":
            # Earlier crash loops (a failed upgrade, its rollback) count against the unit's start
            # limit (StartLimitBurst); a deliberate (re)start must not be refused for them. Only a
            # loaded unit has a counter: inactive units are unloaded, and reset-failed fails on those.
            yield StringCommand("systemctl reset-failed", QuoteString(unit))
        yield StringCommand("systemctl", "restart" if running else "start", QuoteString(unit))
        changed = True
    if status.get("enabled") not in ("enabled", "enabled-runtime"):
        yield StringCommand("systemctl enable", QuoteString(unit))
        changed = True
    if not changed:
        host.noop(f"{unit} is {active}, enabled, and started after its files last changed")


def _gate_command(ctl: str, release: str, timeout_s: int, keep: int, rollback: bool) -> StringCommand:
    parts: list[Any] = [
        "python3", QuoteString(ctl), "gate", "--release", QuoteString(release),
        "--timeout", str(int(timeout_s)), "--keep", str(int(keep)),
    ]
    if not rollback:
        parts.append("--no-rollback")
    return StringCommand(*parts)


def _check_gate_args(timeout_s: int, keep: int) -> None:
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int) or timeout_s <= 0:
        raise OperationValueError(f"timeout_s must be a positive integer, got {timeout_s!r}")
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise OperationValueError(f"keep must be at least 1, got {keep!r}")


@operation(is_idempotent=False, idempotent_notice="Gate it with _if on the operations that restart the service.")
def health_gate(ctl: str, release: str, timeout_s: int, keep: int = 2, rollback: bool = True):
    """
    Wait for the served model, run one deterministic chat completion, record the generation.

    + ctl: path of rigup-servingctl on the rig
    + release: the variant's release.json on the rig
    + timeout_s: seconds to wait for ``/v1/models`` to list the served model
    + keep: generations to keep for rollback (current + previous = 2)
    + rollback: on failure, restore the last good generation, restart and gate it again

    Fails the host when the gate fails, with the unit's last 40 log lines, and says whether the
    last good generation was restored ("FAILED and ROLLED BACK") or could not be.

    **Example:**

    .. code:: python

        health_gate(
            name="Health-gate the restarted service",
            ctl="/opt/rigup/bin/rigup-servingctl",
            release="/opt/rigup/variants/dual/release.json",
            timeout_s=900,
            _if=restart.did_change,
        )
    """
    _check_gate_args(timeout_s, keep)
    yield _gate_command(ctl, release, timeout_s, keep, rollback)


@operation()
def serving_verified(ctl: str, release: str, timeout_s: int, keep: int = 2, rollback: bool = True):
    """
    Make sure the variant serves the release it was last gated with; gate it when it does not.

    + ctl: path of rigup-servingctl on the rig
    + release: the variant's release.json on the rig
    + timeout_s: seconds the gate waits for the served model
    + keep: generations to keep for rollback
    + rollback: roll back when the gate fails

    Converged means: the unit is active, ``/v1/models`` lists the served model, and provenance.json
    records this exact release as having passed the gate. Anything else (a crashed service, a
    deploy interrupted between restart and gate) runs the full gate.

    **Example:**

    .. code:: python

        serving_verified(
            name="Ensure the variant serves its recorded release",
            ctl="/opt/rigup/bin/rigup-servingctl",
            release="/opt/rigup/variants/dual/release.json",
            timeout_s=900,
        )
    """
    _check_gate_args(timeout_s, keep)
    status = host.get_fact(ServingStatus, ctl=ctl, release=release)
    recorded = status.get("provenance") or {}
    if (
        status.get("serving")
        and recorded.get("gate_result") == "passed"
        and recorded.get("release_sha256") == status.get("release_sha256")
    ):
        host.noop(
            f"{status.get('unit')} serves {status.get('models')} as recorded (generation {recorded.get('generation')})"
        )
        return
    yield _gate_command(ctl, release, timeout_s, keep, rollback)
