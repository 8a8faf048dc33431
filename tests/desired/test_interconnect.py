"""nvidia-smi topo parsing, the NVLink/PCIe decision and the NCCL settings it renders.

Parsers run on the real 2x H200 capture (NV18, driver 580.159.04) and on captures written for rigup
(tests/fixtures/fit/README.md); rendered compose files are checked by the real Compose v2 binary.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from rigup.cli.render import add_parser
from rigup.desired.interconnect import Interconnect, choose, detect, effective, nccl_settings
from rigup.desired.knobs import load_defaults
from rigup.desired.plan import recipe_for
from rigup.desired.recipe import Recipe, RecipeError, resolve
from rigup.desired.render import render_variant
from rigup.parsers.topology import TopologyError, parse_topo_matrix, parse_topo_p2p, topology
from tests.desired.test_render import compose_config, write_tree

FIT = Path(__file__).resolve().parents[1] / "fixtures" / "fit"
SHARED = Path("/work/shared/fixtures/nvidia-smi/ubuntu24.04-2xH200-580.159.04")


def text(rel: str) -> str:
    return (FIT / rel).read_text()


def host(variant: str = "dual", **data: Any) -> dict[str, Any]:
    d = load_defaults()
    d.update(data, variant=variant)
    return d


def env_of(recipe: Recipe) -> dict[str, str]:
    return {e.name: e.value for e in recipe.environment}


# --- parsers ------------------------------------------------------------------------------------


@pytest.mark.skipif(not SHARED.is_dir(), reason="shared captures not mounted")
def test_h200_copy_is_the_real_capture() -> None:
    for name in ("topo.txt", "nvidia-smi.txt", "query-gpu.csv"):
        assert (FIT / "h200-nvlink" / name).read_bytes() == (SHARED / name).read_bytes()


def test_real_h200_nvlink_matrix() -> None:
    raw = text("h200-nvlink/topo.txt")
    assert "\x1b[4m" in raw  # the real tool underlines the header: the parser must cope
    assert parse_topo_matrix(raw) == {(0, 1): "NV18", (1, 0): "NV18"}
    topo = topology(raw)
    assert topo.gpus == (0, 1) and topo.p2p is None
    assert topo.nvlink_between([0, 1])
    found = detect(topo, 2)
    assert found == Interconnect(nvlink=True, p2p_ok=True, source="detected", detail="GPU0-GPU1 NV18")


def test_real_h200_p2p() -> None:
    raw = text("h200-nvlink/p2p.txt")
    assert "\x1b[4m" in raw
    assert parse_topo_p2p(raw) == {(0, 1): "OK", (1, 0): "OK"}
    topo = topology(text("h200-nvlink/topo.txt"), raw)
    assert topo.p2p_ok_between([0, 1])
    assert detect(topo, 2) == Interconnect(True, True, "detected", "GPU0-GPU1 NV18")


def test_3090_pcie_without_p2p() -> None:
    topo = topology(text("2x3090-pcie/topo.txt"), text("2x3090-pcie/p2p.txt"))
    assert topo.links == {(0, 1): "PHB", (1, 0): "PHB"}
    assert topo.p2p == {(0, 1): "NS", (1, 0): "NS"}
    assert detect(topo, 2) == Interconnect(False, False, "detected", "GPU0-GPU1 PHB; P2P not supported")


def test_3090_pcie_with_p2p() -> None:
    topo = topology(text("2x3090-pcie-p2p/topo.txt"), text("2x3090-pcie-p2p/p2p.txt"))
    assert detect(topo, 2) == Interconnect(False, True, "detected", "GPU0-GPU1 PIX; P2P OK")


def test_four_gpus_and_a_nic() -> None:
    topo = topology(text("4x3090-nic/topo.txt"), text("4x3090-nic/p2p.txt"))
    assert topo.gpus == (0, 1, 2, 3)
    assert len(topo.links) == 12  # 4 x 3 ordered GPU pairs; the NIC column and row are not GPUs
    assert (topo.link(0, 1), topo.link(0, 2), topo.link(3, 2)) == ("PIX", "SYS", "PIX")
    assert detect(topo, 2).p2p_ok  # GPUs 0 and 1 share a switch
    four = detect(topo, 4)
    assert not four.p2p_ok and not four.nvlink  # 0-2 crosses sockets: CNS


def test_single_gpu_matrix() -> None:
    out = "\tGPU0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\nGPU0\t X \t0-7\t0\t\tN/A\n\nLegend:\n"
    topo = topology(out)
    assert topo.gpus == (0,) and topo.links == {}
    assert choose("auto", topo, 1) is None


@pytest.mark.parametrize(
    ("output", "message"),
    [
        ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n", "no GPU0 column header"),
        ("\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \tNV4\t0-7\n\nLegend:\n", "2 GPU columns but 1 GPU rows"),
        ("\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \tNVX\t0-7\nGPU1\tNVX\t X \t0-7\n", "unknown link 'NVX'"),
        ("\tGPU0\tGPU1\tCPU Affinity\nGPU0\tPHB\tPHB\t0-7\nGPU1\tPHB\t X \t0-7\n", "diagonal"),
    ],
)
def test_bad_matrix_is_refused(output: str, message: str) -> None:
    with pytest.raises(TopologyError, match=message):
        parse_topo_matrix(output)


def test_bad_p2p_is_refused() -> None:
    with pytest.raises(TopologyError, match="no P2P status"):
        parse_topo_p2p(" \tGPU0\tGPU1\t\n GPU0\tX\tMAYBE\t\n GPU1\tOK\tX\t\n")


# --- decision -----------------------------------------------------------------------------------


def test_knob_modes() -> None:
    nv = detect(topology(text("h200-nvlink/topo.txt")), 2)
    pcie = detect(topology(text("2x3090-pcie/topo.txt")), 2)
    assert effective("auto", nv) is nv and effective("auto", None) is None
    off = effective("force_off", nv)
    assert off is not None and (off.nvlink, off.p2p_ok, off.source) == (False, False, "forced")
    assert "NV18" in off.detail  # NVLink present and unused is visible in the plan
    on = effective("force_on", pcie)
    assert on is not None and (on.nvlink, on.p2p_ok, on.source) == (True, True, "forced")
    assert effective("force_on", None) is not None
    with pytest.raises(ValueError, match="gpu_interconnect must be one of auto, force_on, force_off"):
        effective("on", nv)


def test_settings_per_interconnect() -> None:
    nv = nccl_settings(Interconnect(True, True, "detected", "GPU0-GPU1 NV4"), 2)
    assert nv is not None
    assert (dict(nv.set_env), set(nv.unset_env), nv.custom_all_reduce) == ({"NCCL_P2P_LEVEL": "NVL"}, {"NCCL_P2P_DISABLE"}, True)
    p2p = nccl_settings(Interconnect(False, True, "detected"), 2)
    assert p2p is not None
    assert (dict(p2p.set_env), set(p2p.unset_env), p2p.custom_all_reduce) == ({"NCCL_P2P_LEVEL": "PHB"}, {"NCCL_P2P_DISABLE"}, False)
    assert nccl_settings(Interconnect(False, False, "detected"), 2) is None
    assert nccl_settings(None, 2) is None
    assert nccl_settings(Interconnect(True, True, "forced"), 1) is None  # TP=1 has no collectives


def nvlink_host() -> Interconnect:
    return detect(topology(text("h200-nvlink/topo.txt")), 2)


def test_default_recipe_keeps_the_pcie_settings() -> None:
    r = resolve(host())
    assert r.interconnect is None and r.interconnect_note is None
    assert env_of(r)["NCCL_P2P_DISABLE"] == "1" and "NCCL_P2P_LEVEL" not in env_of(r)
    assert "--disable-custom-all-reduce" in r.vllm_args
    pcie = detect(topology(text("2x3090-pcie/topo.txt"), text("2x3090-pcie/p2p.txt")), 2)
    detected = resolve(host(), interconnect=pcie)
    assert detected.interconnect == pcie and detected.interconnect_note is None
    assert (detected.vllm_args, detected.environment) == (r.vllm_args, r.environment)


def test_nvlink_recipe() -> None:
    r = resolve(host(), interconnect=nvlink_host())
    env = env_of(r)
    assert env["NCCL_P2P_LEVEL"] == "NVL" and "NCCL_P2P_DISABLE" not in env
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"
    assert env["NCCL_CUMEM_ENABLE"] == "0"  # unrelated settings stay
    assert "--disable-custom-all-reduce" not in r.vllm_args
    assert r.interconnect is not None and r.interconnect.nvlink
    assert r.interconnect_note == "NVLink (detected: GPU0-GPU1 NV18): NCCL_P2P_LEVEL=NVL, custom all-reduce on"


def test_force_off_on_an_nvlink_host_is_the_pcie_recipe() -> None:
    off = resolve(host(gpu_interconnect="force_off"), interconnect=nvlink_host())
    base = resolve(host())
    assert (off.vllm_args, off.environment, off.interconnect_note) == (base.vllm_args, base.environment, None)
    assert off.upstream.path.endswith("docker-compose.dual.yml")  # no NVLINK_MODE in the spring layout
    assert off.interconnect is not None and off.interconnect.source == "forced"


def test_force_on_without_detection_and_p2p_over_pcie() -> None:
    on = resolve(host("dual", gpu_interconnect="force_on"))
    assert env_of(on)["NCCL_P2P_LEVEL"] == "NVL" and "--disable-custom-all-reduce" not in on.vllm_args
    # Layouts whose entrypoint sources detect_nvlink.sh get only NVLINK_MODE; the script sets NCCL.
    gemma = resolve(host("gemma-dual", gpu_interconnect="force_on"))
    assert env_of(gemma)["NVLINK_MODE"] == "force_on" and "NCCL_P2P_LEVEL" not in env_of(gemma)
    assert "custom all-reduce stays off" in (gemma.interconnect_note or "")  # May's compose-time "${_NVLINK_ENABLED:-0}"
    off = resolve(host("qwen-dual-autoround-int4-fp8-mtp", gpu_interconnect="force_off"))
    assert env_of(off)["NVLINK_MODE"] == "force_off"
    assert env_of(resolve(host("qwen-dual-autoround-int4-fp8-mtp")))["NVLINK_MODE"] == "auto"  # nothing known
    p2p = detect(topology(text("2x3090-pcie-p2p/topo.txt"), text("2x3090-pcie-p2p/p2p.txt")), 2)
    r = resolve(host(), interconnect=p2p)
    assert env_of(r)["NCCL_P2P_LEVEL"] == "PHB" and "NCCL_P2P_DISABLE" not in env_of(r)
    assert "--disable-custom-all-reduce" in r.vllm_args  # HEAD: PCIe P2P for NCCL only


def test_single_card_ignores_the_interconnect() -> None:
    r = resolve(host("single", gpu_interconnect="force_on"), interconnect=nvlink_host())
    assert r.interconnect is None and env_of(r)["NCCL_P2P_DISABLE"] == "1"
    assert r.vllm_args == resolve(host("single")).vllm_args


def test_bad_knob_value() -> None:
    with pytest.raises(RecipeError, match="gpu_interconnect must be one of"):
        resolve(host(gpu_interconnect="yes"))


@pytest.mark.parametrize("variant", ["dual", "dual-turbo", "multi4", "gemma-dual-int8"])
def test_nvlink_compose_validates(variant: str, tmp_path: Path) -> None:
    r = resolve(host(variant, gpu_interconnect="force_on"), interconnect=nvlink_host())
    files = render_variant(r)
    write_tree(tmp_path, r, files, {})
    config = compose_config(r, tmp_path)
    service = config["services"][r.service_name]
    compose_text = files[r.paths.compose_file.lstrip("/")].content
    assert "--disable-custom-all-reduce" not in service["command"]
    if "NVLINK_MODE" in service["environment"]:
        # entrypoints that source detect_nvlink.sh: rigup sets the mode it decided, the script the NCCL vars
        assert service["environment"]["NVLINK_MODE"] == "force_on"
        assert "# GPU interconnect: NVLINK_MODE=force_on" in compose_text
        return
    assert service["environment"]["NCCL_P2P_LEVEL"] == "NVL"
    assert "expandable_segments" not in service["environment"]["PYTORCH_CUDA_ALLOC_CONF"]
    assert "NCCL_P2P_DISABLE" not in service["environment"]
    assert "# GPU interconnect: NVLink (forced: gpu_interconnect: force_on; detected: GPU0-GPU1 NV18)" in compose_text


def test_force_off_compose_is_the_default_compose(tmp_path: Path) -> None:
    off = resolve(host(gpu_interconnect="force_off"), interconnect=nvlink_host())
    base = resolve(host())
    render = lambda r: {k: f.content for k, f in render_variant(r).items()}  # noqa: E731
    assert render(off) == render(base)
    write_tree(tmp_path, off, render_variant(off), {})
    service = compose_config(off, tmp_path)["services"][off.service_name]
    assert service["environment"]["NCCL_P2P_DISABLE"] == "1" and "--disable-custom-all-reduce" in service["command"]


def run_render(*args: str) -> int:
    parser = argparse.ArgumentParser(prog="rigup")
    add_parser(parser.add_subparsers(dest="command"))
    parsed = parser.parse_args(["render", *args])
    return int(parsed.func(parsed))


def test_render_cli_with_topology(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_render("dual", "--out", str(tmp_path), "--topo", str(FIT / "h200-nvlink/topo.txt")) == 0
    compose = (tmp_path / "opt/rigup/variants/dual/compose.yaml").read_text()
    assert "- NCCL_P2P_LEVEL=NVL\n" in compose and "--disable-custom-all-reduce" not in compose
    assert "- NCCL_P2P_DISABLE=1\n" not in compose
    assert run_render("dual", "--out", str(tmp_path / "pcie"), "--topo", str(FIT / "2x3090-pcie/topo.txt"),
                      "--p2p", str(FIT / "2x3090-pcie/p2p.txt")) == 0
    assert "- --disable-custom-all-reduce\n" in (tmp_path / "pcie/opt/rigup/variants/dual/compose.yaml").read_text()
    capsys.readouterr()
    assert run_render("dual", "--out", str(tmp_path / "x"), "--topo", str(FIT / "driver-575/version.txt")) == 2
    assert "no GPU0 column header" in capsys.readouterr().err


def test_recipe_for_looks_at_the_gpus_the_variant_uses() -> None:
    topo = topology(text("4x3090-nic/topo.txt"), text("4x3090-nic/p2p.txt"))
    dual = recipe_for(host(), topo)  # GPUs 0 and 1: one switch, P2P OK
    assert env_of(dual)["NCCL_P2P_LEVEL"] == "PHB" and dual.interconnect_note is not None
    four = recipe_for(host("multi4"), topo)  # 0-2 crosses sockets: no NVLink, no P2P
    assert four.interconnect is not None and not four.interconnect.p2p_ok
    # multi4's entrypoint sources detect_nvlink.sh: rigup pins its mode to what it found
    assert env_of(four)["NVLINK_MODE"] == "force_off" and env_of(resolve(host("multi4")))["NVLINK_MODE"] == "auto"
    assert recipe_for(host(), None) == resolve(host())
    assert recipe_for(host("single"), topo) == resolve(host("single"))


def test_fact_values_print_as_json() -> None:
    # `pyinfra @host fact rigup.facts.gpu.GpuTopology` / `GpuMemoryUse` print through
    # pyinfra_cli.util.json_encode, which falls back to the object's to_json(). (pyinfra_cli is not
    # imported here: importing it monkey-patches the interpreter with gevent.)
    import json

    from rigup.checks.fit import GpuState
    from rigup.parsers.topology import Topology

    topology = Topology(gpus=(0, 1), links={(0, 1): "NV18", (1, 0): "NV18"}, p2p=None)
    gpu = GpuState(0, "NVIDIA H200", 143771, 0, (9, 0), "GPU-1")
    printed = json.loads(json.dumps({"topo": topology, "gpus": [gpu]}, default=lambda obj: obj.to_json()))
    assert printed["topo"] == {"gpus": [0, 1], "links": {"0-1": "NV18", "1-0": "NV18"}, "p2p": None}
    assert printed["gpus"] == [{"index": 0, "name": "NVIDIA H200", "memory_total_mib": 143771,
                                "memory_used_mib": 0, "compute_cap": [9, 0], "uuid": "GPU-1"}]
