"""Operations of the serving task (tasks/serving.py): the 0600 secret file, the one-variant rule, the
image pull, and the health gate that runs on the rig through rigup-servingctl (rigup/rig/servingctl.py)."""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

from pyinfra import host
from pyinfra.api import OperationValueError, QuoteString, StringCommand, operation
from pyinfra.api.exceptions import PyinfraError
from pyinfra.api.hiddenvalue import HiddenValue

from rigup.desired.recipe import Recipe
from rigup.facts.docker import DockerImage
from rigup.facts.serving import RigFingerprint, RigupVariantUnits, SecretFileState, ServedRecord, ServingStatus
from rigup.layout import RigLayout
from rigup.operations.live_output import streamed
from rigup.rig.servingctl import REVALIDATED_MARKER
from rigup.runstate import account

# Gate budget when serving_health_timeout_s is None: a base for container start, CUDA init and
# graph capture, plus a load time per GB of weights (a cold page cache reads ~100-400 MB/s from
# SATA/NVMe on consumer rigs), plus the pip install a Genesis entrypoint runs on every start.
HEALTH_BASE_S = 300
HEALTH_PER_GB_S = 30


HEALTH_GENESIS_S = 120


def health_timeout_s(recipe: Recipe, override: float | int | None) -> int:
    """Seconds the gate waits for the model: the knob when set, else scaled with the weights' size."""
    if override is not None:
        if isinstance(override, bool) or not isinstance(override, (int, float)) or override <= 0:
            raise ValueError(f"serving_health_timeout_s must be a positive number, got {override!r}")
        return int(math.ceil(override))
    weights_gb = sum(m.approx_size_gb for m in recipe.models)
    return int(HEALTH_BASE_S + math.ceil(HEALTH_PER_GB_S * weights_gb) + (HEALTH_GENESIS_S if recipe.genesis else 0))


def ctl_path(install_root: str) -> str:
    """Where rigup-servingctl is on the rig (rigup.layout.RigLayout.servingctl; the metrics task asks here)."""
    return RigLayout(install_root).servingctl


@operation()
def secret_file(path: str, content: HiddenValue | str | Callable[[], str], mode: str = "600", owner: str = "root"):
    """
    Write a file holding secrets, readable by its owner only (root by default).

    + path: file on the rig
    + content: full text (a ``HiddenValue`` keeps it out of pyinfra's output), or a function giving it when
      the operation runs (rigup.operations.serving_plans.PodPlans.text); must end in a newline
    + mode: octal mode, ``600`` by default
    + owner: the user owning it (and its group of that name), e.g. ``prometheus`` for a key it reads

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
    text = content.unmask() if isinstance(content, HiddenValue) else content() if callable(content) else content
    if not text.endswith("\n"):
        raise OperationValueError("secret_file content must end with a newline")
    if not mode.isdigit() or len(mode.lstrip("0")) > 3:
        raise OperationValueError(f"mode must be octal digits like 600, got {mode!r}")
    wanted_mode = mode.lstrip("0") or "0"
    wanted_sha = hashlib.sha256(text.encode()).hexdigest()
    current = host.get_fact(SecretFileState, path=path)
    if not re.fullmatch(r"[a-z_][a-z0-9_-]*", owner):
        raise OperationValueError(f"owner must be a user name, got {owner!r}")
    ownership = f"{owner}:{owner}"
    if current is not None and current["sha256"] == wanted_sha and current["mode"] == wanted_mode and current["owner"] == ownership:
        host.noop(f"secret file {path} is up to date")
        return
    if current is not None and current["sha256"] == wanted_sha:
        yield StringCommand("chown", ownership, QuoteString(path), "&& chmod", wanted_mode, QuoteString(path))
        return
    yield StringCommand(
        "umask 077 && tmp=$(mktemp", StringCommand(QuoteString(path), ".XXXXXX)", _separator=""),
        '&& cat > "$tmp" && chown', ownership, '"$tmp" && chmod', wanted_mode, '"$tmp" && mv -f "$tmp"', QuoteString(path),
        _stdin=text,
    )


@operation()
def sole_variant(unit: str | Sequence[str], install_root: str):
    """
    Stop and disable every rigup variant unit other than ``unit``: the host's pods own the GPUs.

    + unit: the unit that stays, e.g. ``rigup-dual.service``, or the list of them (one per pod)
    + install_root: rigup's directory on the rig (variant units have a directory under it)

    **Example:**

    .. code:: python

        sole_variant(
            name="Stop other rigup variants",
            unit=["rigup-left.service", "rigup-right.service"],
            install_root="/opt/rigup",
        )
    """
    keep = {unit} if isinstance(unit, str) else set(unit)
    units = host.get_fact(RigupVariantUnits, install_root=install_root)
    others = [u for u, s in sorted(units.items()) if u not in keep and (s["enabled"] or s["active"])]
    if not others:
        host.noop(f"no rigup variant other than {', '.join(sorted(keep))} is enabled or running")
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
    image = host.get_fact(DockerImage, ref=ref)
    if image is not None:
        host.noop(f"image {ref} is present ({image.id[:19]})")
        return
    # streamed: docker's per-layer lines while it pulls (tens of GB on a fresh rig)
    yield streamed(
        StringCommand("docker pull", QuoteString(ref)),
        lambda h, ok, output, s: account(h, f"image pulled in {s:.0f} s" if ok else f"image pull failed after {s:.0f} s"),
    )


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
        yield streamed(
            StringCommand("systemctl", "restart" if running else "start", QuoteString(unit)),
            lambda h, ok, output, s: account(
                h, f"{unit} {'restarted' if running else 'started'}" if ok else f"{unit} failed to {'restart' if running else 'start'}"
            ),
        )
        changed = True
    if status.get("enabled") not in ("enabled", "enabled-runtime"):
        yield StringCommand("systemctl enable", QuoteString(unit))
        changed = True
    if not changed:
        host.noop(f"{unit} is {active}, enabled, and started after its files last changed")


def account_gate(host: Any, ok: bool, output: Any, seconds: float) -> None:
    account(host, f"health gate passed in {seconds:.0f} s" if ok else f"health gate FAILED after {seconds:.0f} s")


def gate_command(ctl: str, release: str, timeout_s: int, keep: int, rollback: bool) -> StringCommand:
    parts: list[Any] = [
        "python3", QuoteString(ctl), "gate", "--release", QuoteString(release),
        "--timeout", str(int(timeout_s)), "--keep", str(int(keep)),
    ]
    if not rollback:
        parts.append("--no-rollback")
    # streamed: servingctl's lines while it waits for the model to load (minutes on a real rig)
    return streamed(StringCommand(*parts), account_gate)


def check_gate_args(timeout_s: int, keep: int) -> None:
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
    check_gate_args(timeout_s, keep)
    yield gate_command(ctl, release, timeout_s, keep, rollback)


def account_revalidation(host: Any, ok: bool, output: Any, seconds: float) -> None:
    """The converge's account of `rigup-servingctl revalidate`: its last line says what it did."""
    said = [line.split(REVALIDATED_MARKER, 1)[1].strip() for line in getattr(output, "stdout_lines", [])
            if REVALIDATED_MARKER in line]
    account(host, said[-1] if said else f"re-validation FAILED after {seconds:.0f} s")


def revalidate_command(ctl: str, release: str, timeout_s: int, keep: int, member: bool = False) -> StringCommand:
    return streamed(StringCommand("python3", QuoteString(ctl), "revalidate", "--release", QuoteString(release),
                                  "--timeout", str(int(timeout_s)), "--keep", str(int(keep)),
                                  *(("--member",) if member else ())), account_revalidation)


@operation()
def member_revalidated(ctl: str, release: str, timeout_s: int, keep: int = 2):
    """
    A cluster member whose rig changed under it: vLLM's P2P access cache removed and the member restarted,
    so that the cluster's gate, which runs after a member (re)started (rigup.operations.cluster_gate), asks
    the full probe set through the head and records the new fingerprint when every member passed.

    + ctl: path of rigup-servingctl on the rig
    + release: the member's release.json on the rig
    + timeout_s, keep: as the gate's (the command's arguments)

    Runs ``rigup-servingctl revalidate --member`` when the member's last passed gate recorded a fingerprint
    (GPU UUIDs, PCI bus ids and topology, VBIOS, driver, module, kernel, BIOS: the RigFingerprint fact) and the
    rig's differs; otherwise nothing. The account says what changed. A member is never gated alone: its
    cluster passes or rolls back as one, and a failed cluster gate keeps the old fingerprint, so the next
    converge re-validates again. Put it after the member's files are written and before its service: when
    this converge rolls out another release, the cache is removed first and the new release's restart and
    gate follow.

    **Example:**

    .. code:: python

        reval = member_revalidated(
            name="Re-validate the member if its rig changed",
            ctl="/opt/rigup/bin/rigup-servingctl",
            release="/opt/rigup/variants/big/release.json",
            timeout_s=900,
        )
    """
    check_gate_args(timeout_s, keep)
    status = host.get_fact(ServingStatus, ctl=ctl, release=release)
    recorded = (status.get("provenance") or {})
    fingerprint = recorded.get("fingerprint")
    if recorded.get("gate_result") != "passed" or not isinstance(fingerprint, dict):
        host.noop("no fingerprint recorded by a passed gate (the member's next passed gate records it)")
        return
    current = host.get_fact(RigFingerprint)
    if not current or current == fingerprint:
        host.noop("the rig's fingerprint is the one the last passed gate recorded")
        return
    yield revalidate_command(ctl, release, timeout_s, keep, member=True)


@operation()
def serving_verified(ctl: str, release: str, release_text: Callable[[], str], timeout_s: int, keep: int = 2,
                     rollback: bool = True, revalidate: bool = True, member: bool = False):
    """
    Make sure the variant serves the release it was last gated with; gate it when it does not.

    + ctl: path of rigup-servingctl on the rig
    + release: the variant's release.json on the rig
    + release_text: the release file's text as this converge renders it (PodPlans.text), called when
      the operation is planned and when it runs
    + timeout_s: seconds the gate waits for the served model
    + keep: generations to keep for rollback
    + rollback: roll back when the gate fails
    + revalidate: compare the rig's fingerprint with the one the last passed gate recorded
    + member: a cluster member, whose members pass or roll back as one: a changed fingerprint is
      ``member_revalidated``'s (before the cluster's gate), here only a record without one gets today's

    Converged means: the unit is active, ``/v1/models`` lists the served model, provenance.json
    records this exact release as having passed the gate, and the rig's fingerprint (GPU UUIDs, PCI bus
    ids and topology, VBIOS, driver, module, kernel, BIOS: the RigFingerprint fact) is the one that gate
    recorded. Anything else (a crashed service, a deploy interrupted between restart and gate) runs the
    full gate. A pod serving as recorded on a rig whose fingerprint changed is re-validated
    (``rigup-servingctl revalidate``): vLLM's P2P access cache removed, the pod restarted and gated with
    every probe of its release, no rollback; the account says what changed. A record without a
    fingerprint (a gate before it was recorded) gets today's, without a restart.

    A pod that serves as recorded while its record says a release's gate failed (rolled back), when
    this converge renders neither that release nor anything but the one that serves (the fleet file
    was reverted), has that failure marked superseded (``rigup-servingctl supersede``, once): the fleet
    no longer asks for a release that failed, so RigupGateFailed clears without a gate. A fleet that
    still asks for the failed release renders it again: it restarts, is gated, fails and rolls back.

    **Example:**

    .. code:: python

        serving_verified(
            name="Ensure the variant serves its recorded release",
            ctl="/opt/rigup/bin/rigup-servingctl",
            release="/opt/rigup/variants/dual/release.json",
            release_text=pod_plans.text(0, "release"),
            timeout_s=900,
        )
    """
    check_gate_args(timeout_s, keep)
    status = host.get_fact(ServingStatus, ctl=ctl, release=release)
    recorded = status.get("provenance") or {}
    if (
        status.get("serving")
        and recorded.get("gate_result") == "passed"
        and recorded.get("release_sha256") == status.get("release_sha256")
    ):
        current = host.get_fact(RigFingerprint) if revalidate else None
        if current and recorded.get("fingerprint") != current and (not member or recorded.get("fingerprint") is None):
            yield revalidate_command(ctl, release, timeout_s, keep, member=member)
            return
        failed = recorded.get("failed_release_sha256")
        if failed and failed != hashlib.sha256(release_text().encode()).hexdigest() == status.get("release_sha256"):
            yield streamed(
                StringCommand("python3", QuoteString(ctl), "supersede", "--release", QuoteString(release)),
                lambda h, ok, output, s: account(
                    h, f"gate failure of release {failed[:12]} superseded (asked for the one that serves)"
                    if ok else "superseding a gate failure failed"),
            )
            return
        host.noop(
            f"{status.get('unit')} serves {status.get('models')} as recorded (generation {recorded.get('generation')})"
        )
        return
    yield gate_command(ctl, release, timeout_s, keep, rollback)


def served_now(rig_host: Any, install_root: str) -> dict[str, Any] | None:
    """A rig's ServedRecord, connecting to it first when it is not in this run (--limit, a rollout
    step); None when it cannot be reached or read (the gateway keeps its routes, the monitor its targets)."""
    if rig_host is None:
        return None
    if not rig_host.connected:
        rig_host.connect(reason="to read what it serves (gateway routes, monitor targets)", show_errors=False)
        if not rig_host.connected:
            return None
    try:
        served = rig_host.get_fact(ServedRecord, install_root=install_root)
    except PyinfraError:
        return None
    return served if "records" in served else None  # {}: the read failed
