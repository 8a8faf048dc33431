"""The 8x3090 hardware preset: eight PCIe RTX 3090s without NVLink, the sandbox rig of the TP=8 recipes
(club-3090's multi8 composes). Pure: no scratch root, no stand-in packages (the 4x3090 counterpart that
boots the stand-in driver is test_container_shell.py's test_4x3090_preset_is_four_pcie_cards)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from rigup.checks.fit import assess
from rigup.desired.catalog import load_catalog
from rigup.desired.interconnect import detect, nccl_settings
from rigup.desired.knobs import load_defaults
from rigup.desired.recipe import nearest_layout, resolve
from rigup.parsers.topology import topology
from rigup_testbed import hardware as hw
from rigup_testbed.recipes import working_trees

STANDINS = Path(__file__).resolve().parents[1] / "standins"


def stand_in_nvidia_smi() -> Any:
    sys.path.insert(0, str(STANDINS))
    try:
        import nvidia_smi
    finally:
        sys.path.remove(str(STANDINS))
    return nvidia_smi


def test_8x3090_preset_is_eight_pcie_rtx_3090s() -> None:
    h = hw.preset("8x3090", "octo-01")
    assert h.preset == "8x3090" and len(h.gpus) == 8
    assert [g.index for g in h.gpus] == list(range(8))
    assert [g.name for g in h.gpus] == ["NVIDIA GeForce RTX 3090"] * 8
    assert {(g.memory_total_mib, g.compute_cap, g.architecture) for g in h.gpus} == {(24576, "8.6", "Ampere")}
    assert {(g.power_default_w, g.power_limit_w, g.power_min_w, g.power_max_w) for g in h.gpus} == {(350, 350, 100, 400)}
    assert [g.pci_bus_id for g in h.gpus] == [f"00000000:0{i}:00.0" for i in range(1, 9)]
    assert h.topology == "PIX" and (h.driver_cuda, h.secure_boot) == (None, False)
    assert len({g.uuid for g in h.gpus}) == 8
    assert not {g.uuid for g in h.gpus} & {g.uuid for g in hw.preset("8x3090", "octo-02").gpus}
    assert hw.from_dict(json.loads(h.to_json())) == h
    # the same cards as the 4x3090 preset, twice as many
    assert [g.memory_total_mib for g in hw.preset("4x3090", "octo-01").gpus] * 2 == [g.memory_total_mib for g in h.gpus]


def test_rigup_sees_eight_cards_on_pcie_without_p2p() -> None:
    """The stand-in nvidia-smi's topo -m / topo -p2p r for this preset, parsed by rigup: PCIe, NCCL stays PCIe-safe."""
    smi = stand_in_nvidia_smi()
    data = hw.preset("8x3090", "octo-01").to_dict()
    state: dict[str, Any] = {"gpus": {}}
    gpus = [smi.Gpu(g, state, [], i) for i, g in enumerate(data["gpus"])]
    matrix, p2p = smi.topo_matrix(data, gpus), smi.topo_p2p(data, gpus)
    assert "GPU7\tPIX\tPIX\tPIX\tPIX\tPIX\tPIX\tPIX\t X \t" in matrix
    topo = topology(matrix, p2p)
    assert topo.gpus == tuple(range(8)) and set(topo.links.values()) == {"PIX"}
    found = detect(topo, 8)
    assert (found.nvlink, found.p2p_ok, found.source) == (False, False, "detected")
    assert nccl_settings(found, 8) is None  # exactly the composes' PCIe-safe NCCL settings


def test_tp8_recipes_fit_the_8x3090_preset_and_not_the_4x3090() -> None:
    tp8 = [name for name, v in load_catalog()["variants"].items() if v["tensor_parallel_size"] == 8]
    assert len(tp8) >= 4  # club-3090's multi8 fp8 mtp/dflash2/dflash2-fp8 and autoround-int4 mtp at least
    eight, four = hw.preset("8x3090", "octo-01").gpus, hw.preset("4x3090", "quad-01").gpus
    assert nearest_layout(len(eight), [8]) == (8, 0) and nearest_layout(len(four), [8]) is None
    for name in tp8:
        host = load_defaults()
        host.update(variant=name)
        recipe = resolve(host, upstream=working_trees())  # the fixture trees, as the test bed's remotes serve them
        findings = assess(recipe, eight, "13.0")
        assert [f.name for f in findings if not f.ok] == [], (name, findings)
        assert {f.name for f in findings} >= {"cuda-compat", "gpu-layout", "vram-fit", "interconnect"}
        short = assess(recipe, four, "13.0")
        assert any(f.name == "gpu-layout" and not f.ok and f.severity == "fail" for f in short), (name, short)
