"""The power cap a host's GPUs get at boot: the gpu_power_cap_watts knob, else the card model's entry
in gpu_power_cap_by_model (the seeds' 230 W for the RTX 3090), else none (each card keeps the limit
it boots with). One `nvidia-smi -pl` applies to every GPU, so cards that disagree get no cap."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rigup.desired.knobs import knob
from rigup.parsers.gpu_models import gpu_name_key
from rigup.parsers.nvidia_smi import Gpu

# Below this share of a card's default limit a cap is probably meant for another card (a 3090's
# 230 W on a 700 W H200): preflight warns and names both.
LOW_CAP_SHARE = 0.6


@dataclass(frozen=True)
class PowerCap:
    watts: int | None  # None: no cap, the cards keep their own limits
    reason: str  # where the value comes from, for preflight and the plan


def _by_model(table: Mapping[str, Any], name: str) -> int | None:
    wanted = gpu_name_key(name)
    for model, watts in table.items():
        if gpu_name_key(str(model)) == wanted:
            return None if watts is None else int(watts)
    return None


def power_cap(host_data: Any, gpus: Sequence[Gpu]) -> PowerCap:
    """The cap for these GPUs (nvidia-smi's view, or lspci's before a driver is loaded)."""
    explicit = knob(host_data, "gpu_power_cap_watts")
    if explicit is not None:
        return PowerCap(int(explicit), f"gpu_power_cap_watts is {explicit} W")
    table = knob(host_data, "gpu_power_cap_by_model") or {}
    names = sorted({g.name for g in gpus})
    if not names:
        return PowerCap(None, "no GPU seen: no power cap")
    caps = {name: _by_model(table, name) for name in names}
    values = set(caps.values())
    if len(values) == 1 and None not in values:
        watts = values.pop()
        return PowerCap(watts, f"{watts} W for {', '.join(names)} (gpu_power_cap_by_model)")
    if values == {None}:
        return PowerCap(None, f"{', '.join(names)}: not in gpu_power_cap_by_model, default limit kept")
    listed = ", ".join(f"{n} {caps[n] if caps[n] is not None else 'none'}" for n in names)
    return PowerCap(None, f"cards with different caps ({listed}): default limits kept; set gpu_power_cap_watts")
