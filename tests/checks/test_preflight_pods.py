"""Preflight of a host that lists pods: the host's checks once, the pods side by side, each pod's fit
on its own GPUs, and the disk for all of them."""

from __future__ import annotations

import dataclasses
from typing import Any

from rigup.checks.preflight import HostFacts, failures, host_recipes, pod_facts, run_host_checks
from rigup.parsers.nvidia_smi import GpuState
from rigup.parsers.topology import topology
from tests.support.hostlayer import FIXTURES, converged_2x3090, disk, fresh_2x3090, host_data

QUAD = [{"name": "left", "variant": "dual", "gpus": [0, 1], "port": 8030},
        {"name": "right", "variant": "dual", "gpus": [2, 3], "port": 8031}]


def four_3090(used_mib: tuple[int, ...] = (1, 1, 1, 1), **changes: Any) -> HostFacts:
    """converged_2x3090 with four cards (the 4x3090-nic topology): GPUs 2 and 3 copy 0 and 1."""
    two = converged_2x3090()
    gpus = tuple(dataclasses.replace(g, index=g.index + shift, uuid=f"{g.uuid}-{shift}", bus_id=f"0000:{0x41 + g.index + shift:02x}:00.0")
                 for shift in (0, 2) for g in two.smi.gpus)
    memory = tuple(GpuState(g.index, g.name, 24576, used_mib[g.index], (8, 6), g.uuid) for g in gpus)
    fit = FIXTURES / "fit" / "4x3090-nic"
    facts = dataclasses.replace(two, smi=dataclasses.replace(two.smi, gpus=gpus), gpu_memory=memory,
                                topology=topology((fit / "topo.txt").read_text(), (fit / "p2p.txt").read_text()))
    return dataclasses.replace(facts, **changes)


def checks(facts: HostFacts, pods: list[dict[str, Any]], **data: Any) -> dict[str, Any]:
    hd = host_data(pods=pods, **data)
    built = host_recipes(hd, "quad", facts.topology)
    return {c.name: c for c in run_host_checks(facts, built, hd)}


def test_two_dual_pods_on_four_cards_pass_with_each_pods_checks_named() -> None:
    result = checks(four_3090(), QUAD)
    assert not failures(list(result.values())), [c.describe("quad") for c in failures(list(result.values()))]
    for pod in ("left", "right"):
        assert result[f"vram-fit ({pod})"].ok
        assert "tensor parallel 2" in result[f"gpu-layout ({pod})"].message
        assert f"gpu-layout ({pod})" in result and f"recipe ({pod})" in result
    assert result["pods"].message == ("pod left (dual) on GPU(s) 0, 1, port 8030; pod right (dual) on GPU(s) 2, 3, "
                                      "port 8031")
    assert "os" in result and "gpus" in result and "disk" in result
    assert "vram-fit" not in result  # no host-wide fit: each pod's is on its own cards


def test_a_pod_is_fit_on_its_own_cards_only() -> None:
    # GPU 3 is nearly full (another process): the right pod does not fit, the left one does
    result = checks(four_3090(used_mib=(1, 1, 1, 20000)), QUAD)
    failed = {c.name for c in failures(list(result.values()))}
    assert failed == {"vram-fit (right)"}, failed
    assert "GPU 3 (NVIDIA GeForce RTX 3090): 24576 MiB, 20000 MiB in use" in result["vram-fit (right)"].message


def test_pod_facts_keep_only_the_pods_gpus() -> None:
    narrowed = pod_facts(four_3090(), (2, 3))
    assert [g.index for g in narrowed.gpus] == [2, 3]
    assert [g.index for g in narrowed.gpu_memory] == [2, 3]


def test_a_port_two_pods_publish_fails_naming_both() -> None:
    # neither pod names a port: both get the one upstream's dual file publishes (8010)
    clash = [{k: v for k, v in pod.items() if k != "port"} for pod in QUAD]
    result = checks(four_3090(), clash)
    assert [c.name for c in failures(list(result.values()))] == ["pods"]
    check = result["pods"]
    assert check.message == "port 8010 is published by both pod left (dual) and pod right (dual)"
    assert check.key == "pods" and "[key: pods]" in check.describe("quad")


def test_a_gpu_the_host_lacks_fails() -> None:
    result = checks(converged_2x3090(), QUAD)  # two cards: the right pod's 2 and 3 are not there
    failed = {c.name: c for c in failures(list(result.values()))}
    assert "pods" in failed
    assert failed["pods"].message == "pod right (dual) owns GPU(s) 2, 3; this host has GPU(s) 0, 1"


def test_a_pod_whose_recipe_fails_is_named_and_the_others_still_checked() -> None:
    bad = [QUAD[0], {"name": "right", "variant": "dual", "gpus": [2]}]
    result = checks(four_3090(), bad)
    failed = {c.name for c in failures(list(result.values()))}
    assert failed == {"recipe (right)"}
    assert "pod right owns 1 GPU(s) (2) but variant dual uses 2" in result["recipe (right)"].message
    assert result["vram-fit (left)"].ok


def test_disk_counts_a_shared_model_and_image_once() -> None:
    # two pods of one variant: one model and one image to fetch (about 50 GB), not two
    result = checks(four_3090(disk=disk(70)), QUAD, preflight_disk_margin_gb=10)
    assert result["disk"].ok, result["disk"].message
    assert result["disk"].message.count("model ") == 1


def four_3090_before_the_driver() -> HostFacts:
    """fresh_2x3090 (lspci only, nouveau) with four cards: 2 and 3 copy 0 and 1 on other buses."""
    fresh = fresh_2x3090()
    extra = tuple(dataclasses.replace(d, bus_id=f"0000:{0x81 + i:02x}:00.0") for i, d in enumerate(fresh.pci))
    return dataclasses.replace(fresh, pci=fresh.pci + extra)


def test_before_the_driver_a_pod_is_judged_on_its_own_cards_under_their_host_indices() -> None:
    facts = four_3090_before_the_driver()
    assert [g.index for g in facts.gpus] == [0, 1, 2, 3]
    assert [g.index for g in pod_facts(facts, (2, 3)).gpus] == [2, 3]
    result = checks(facts, QUAD)
    assert not failures(list(result.values())), [c.describe("quad") for c in failures(list(result.values()))]
    assert result["vram-fit (right)"].message.startswith("no driver yet, memory from the PCI ids")
    # a card too old for the variant is named by its host index, in the pod that owns it
    old = dataclasses.replace(facts.pci[3], device_id="1b06", description="NVIDIA Corporation GP102 [GeForce GTX 1080 Ti]")
    result = checks(dataclasses.replace(facts, pci=facts.pci[:3] + (old,)), QUAD)
    failed = {c.name: c for c in failures(list(result.values()))}
    assert "compute-capability (right)" in failed and "compute-capability (left)" not in failed
    assert failed["compute-capability (right)"].message.startswith("GPU 3 (")
