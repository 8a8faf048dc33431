"""The boot power cap per card model: the seeds' 230 W for the RTX 3090, none for cards the table
does not list, an explicit knob for every card, and preflight's warning for a cap meant for another
card (on the real 1xH200 capture)."""

from __future__ import annotations

from pathlib import Path

from rigup.checks.preflight import check_power_cap
from rigup.desired.gpu_power import power_cap
from rigup.desired.knobs import load_defaults
from rigup.parsers.lspci import gpus_from_pci, parse_lspci
from rigup.parsers.nvidia_smi import parse_gpu_query
from tests.support.hostlayer import fresh_2x3090, fx

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "nvidia-smi"
H200 = parse_gpu_query((FIXTURES / "1xH200-580.159.04-device.csv").read_text())
RTX3090 = parse_gpu_query((FIXTURES / "2x3090-580-default-power.csv").read_text())


def data(**knobs: object) -> dict[str, object]:
    return {**load_defaults(), **knobs}


def test_a_3090_gets_the_seeds_230_w_by_default() -> None:
    cap = power_cap(data(), RTX3090.gpus)
    assert cap.watts == 230
    assert "NVIDIA GeForce RTX 3090" in cap.reason and "gpu_power_cap_by_model" in cap.reason


def test_before_a_driver_lspci_names_the_card_and_the_table_applies() -> None:
    gpus = gpus_from_pci(parse_lspci(fx("lspci/2x3090-nouveau.txt")))
    assert [g.source for g in gpus] == ["lspci", "lspci"]
    assert power_cap(data(), gpus).watts == 230


def test_a_card_the_table_does_not_list_keeps_its_own_limit() -> None:
    cap = power_cap(data(), H200.gpus)
    assert cap.watts is None
    assert cap.reason == "NVIDIA H200: not in gpu_power_cap_by_model, default limit kept"


def test_the_knob_sets_every_card_and_the_table_can_be_emptied() -> None:
    assert power_cap(data(gpu_power_cap_watts=300), H200.gpus).watts == 300
    assert power_cap(data(gpu_power_cap_by_model={}), RTX3090.gpus).watts is None
    assert power_cap(data(gpu_power_cap_by_model={"GeForce RTX 3090": 250}), RTX3090.gpus).watts == 250  # names as lspci or nvidia-smi print them


def test_cards_that_disagree_get_no_cap() -> None:
    mixed = RTX3090.gpus[:1] + H200.gpus
    cap = power_cap(data(gpu_power_cap_by_model={"NVIDIA GeForce RTX 3090": 230, "NVIDIA H200": 600}), mixed)
    assert cap.watts is None and "different caps" in cap.reason and "set gpu_power_cap_watts" in cap.reason


def test_preflight_warns_when_a_cap_is_far_below_the_cards_default() -> None:
    facts = fresh_2x3090(smi=H200)
    check = check_power_cap(facts, data(gpu_power_cap_watts=230))
    assert check is not None and not check.ok and check.severity == "warning" and not check.failed
    assert check.message == "gpu_power_cap_watts is 230 W: below 60% of GPU 0's (NVIDIA H200) default limit 700 W"
    assert check.key == "gpu_power_cap_watts"
    ok = check_power_cap(facts, data())
    assert ok is not None and ok.ok and "default limit kept" in ok.message


def test_preflight_accepts_the_3090_default_and_refuses_a_cap_out_of_range() -> None:
    facts = fresh_2x3090(smi=RTX3090)
    ok = check_power_cap(facts, data())
    assert ok is not None and ok.ok and ok.message.startswith("230 W for NVIDIA GeForce RTX 3090")
    bad = check_power_cap(facts, data(gpu_power_cap_watts=90))
    assert bad is not None and bad.failed and "range 100-350 W" in bad.message
