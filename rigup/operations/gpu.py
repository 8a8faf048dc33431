"""GPU operations: /dev/char links, the persistence and power-cap state, and the GPU smoke container."""

from __future__ import annotations

from typing import Any

from pyinfra import host
from pyinfra.api import FunctionCommand, QuoteString, StringCommand, operation

from rigup.facts.driver import NvidiaDevChar
from rigup.facts.gpu import NvidiaGpus
from rigup.operations.preflight import fail_host_with_reasons


@operation()
def nvidia_dev_char_links():
    """
    Create the ``/dev/char/MAJOR:MINOR`` links for NVIDIA's device nodes. Without them, a
    ``systemctl daemon-reload`` makes runc drop GPU access from running containers
    (nvidia-container-toolkit#48); the udev rule from files/ keeps them after reboots.

    **Example:**

    .. code:: python

        gpu.nvidia_dev_char_links(name="Create /dev/char links for NVIDIA devices")
    """
    dev = host.get_fact(NvidiaDevChar)
    if not dev.devices:
        host.noop("no NVIDIA character devices (driver not loaded); the udev rule creates the links at load")
        return
    if not dev.missing:
        host.noop(f"/dev/char links exist for {len(dev.devices)} NVIDIA devices")
        return
    yield StringCommand("nvidia-ctk", "system", "create-dev-char-symlinks", "--create-all")


def _uncapped_drift(smi: Any) -> list[Any]:
    """GPUs whose limit is not their default although rigup caps none (a cap an earlier converge set)."""
    return [
        g for g in smi.gpus
        if g.power_default_w is not None and g.power_limit_w is not None and abs(g.power_limit_w - g.power_default_w) > 0.5
    ]


def _power_drift(smi: Any, power_cap_watts: int | None, persistence: bool) -> list[str]:
    drift: list[str] = []
    for g in smi.gpus:
        if power_cap_watts is not None and (g.power_limit_w is None or abs(g.power_limit_w - power_cap_watts) > 0.5):
            drift.append(f"GPU {g.index} power limit {g.power_limit_w} W != {power_cap_watts} W")
        if persistence and g.persistence is not True:
            drift.append(f"GPU {g.index} persistence mode off")
    return drift


def _verify_power(state: Any, host: Any, power_cap_watts: int | None, persistence: bool) -> bool:
    smi = host.get_fact(NvidiaGpus)
    if smi is None or smi.status != "ok":
        return fail_host_with_reasons(state, host, "nvidia-smi does not answer after applying GPU settings", [])
    drift = _power_drift(smi, power_cap_watts, persistence)
    if power_cap_watts is None:
        drift += [f"GPU {g.index} power limit {g.power_limit_w:g} W != its default {g.power_default_w:g} W" for g in _uncapped_drift(smi)]
    if drift:
        return fail_host_with_reasons(state, host, "GPU settings did not apply", drift)
    return True


@operation()
def gpu_power_state(unit: str, power_cap_watts: int | None = None, persistence: bool = True):
    """
    Make every GPU's power limit and persistence mode what ``unit`` (a oneshot that runs
    ``nvidia-smi -pm 1`` / ``-pl W`` at boot) sets; restart the unit only when nvidia-smi shows drift,
    then check again.

    + unit: the oneshot systemd unit that applies the settings
    + power_cap_watts: wanted per-GPU power limit (None: each card's default limit; a limit an
      earlier cap left is set back to the default with ``nvidia-smi -i N -pl DEFAULT``)
    + persistence: whether persistence mode must be on

    **Example:**

    .. code:: python

        gpu.gpu_power_state(name="Apply GPU power cap and persistence",
                                unit="rigup-gpu-power.service", power_cap_watts=230)
    """
    smi = host.get_fact(NvidiaGpus)
    if smi is None or smi.status != "ok":
        host.noop(f"nvidia-smi does not answer (driver not loaded); {unit} applies the settings at boot")
        return
    drift = _power_drift(smi, power_cap_watts, persistence)
    reset = _uncapped_drift(smi) if power_cap_watts is None else []
    if not drift and not reset:
        host.noop(f"{len(smi.gpus)} GPU(s) at the wanted power limit and persistence mode")
        return
    for g in reset:
        yield StringCommand("nvidia-smi", "-i", str(g.index), "-pl", f"{g.power_default_w:g}")
    if drift:
        yield StringCommand("systemctl", "restart", QuoteString(unit))
    yield FunctionCommand(_verify_power, (power_cap_watts, persistence), {})


@operation(is_idempotent=False, idempotent_notice="Runs a container every time; gate it with _if.")
def gpu_smoke_test(image: str):
    """
    Run ``nvidia-smi -L`` in ``image`` with ``--gpus all`` and fail unless the container sees as
    many GPUs as the host does.

    + image: fully qualified CUDA base image (registry/repository:tag)

    **Example:**

    .. code:: python

        gpu.gpu_smoke_test(name="Check containers see every GPU",
                               image="docker.io/nvidia/cuda:12.6.0-base-ubuntu22.04",
                               _if=toolkit.did_change)
    """
    ref = QuoteString(image)
    script = StringCommand(
        "host_gpus=$(nvidia-smi -L | grep -c '^GPU ' || true);",
        "out=$(docker run --rm --gpus all",
        ref,
        "nvidia-smi -L 2>&1) || { echo \"rigup: GPU smoke container failed: $out\" >&2; exit 1; };",
        "seen=$(printf '%s\\n' \"$out\" | grep -c '^GPU ' || true);",
        'if [ "$seen" -ne "$host_gpus" ] || [ "$seen" -eq 0 ]; then',
        'echo "rigup: GPU smoke test: the container sees $seen GPU(s), the host has $host_gpus" >&2; exit 1; fi;',
        'echo "GPU smoke test: $seen GPU(s) visible in the container"',
    )
    yield StringCommand("sh", "-c", QuoteString(script))

