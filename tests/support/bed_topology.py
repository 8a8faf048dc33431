"""The GPU topology a test-bed rig reports (`nvidia-smi topo -m` and `topo -p2p r` of the stand-in nvidia-smi,
rigup_testbed/standins/nvidia_smi.py, on a hardware preset), as the GpuTopology fact's command prints it."""

from __future__ import annotations

from rigup.facts.util import SECTION_MARKER
from rigup_testbed.hardware import preset
from rigup_testbed.standin_modules import load_standin


def bed_topology_output(hardware: str = "2x3090", host: str = "rig-a") -> str:
    """What GpuTopology's command prints on a bed host of `hardware` (rigup_testbed.hardware.PRESETS) once
    its driver is loaded: the matrix, the section marker, the P2P table."""
    smi = load_standin("nvidia_smi")
    hw = preset(hardware, host).to_dict()
    gpus = [smi.Gpu(g, {"gpus": {}}, [], minor) for minor, g in enumerate(hw["gpus"])]
    return f"{smi.topo_matrix(hw, gpus)}{SECTION_MARKER}\n{smi.topo_p2p(hw, gpus)}"
