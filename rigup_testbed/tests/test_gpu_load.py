"""The GPU stand-in under load: what an engine serves moves its GPUs' utilisation, power, temperature
and clock event reasons (standins/nvidia_smi.py `Gpu`, from the activity records responder.py writes
through common.activity_record), and an engine that stops serving lets them fall back to idle. The
figures are a real RTX 3090's (rigup_testbed/FACTS.md section 12, "under load")."""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from rigup_testbed import hardware
from rigup_testbed.standin_modules import STANDINS, load_standin

sys.path.insert(0, str(STANDINS.parent))  # openai_responder.py, shipped next to responder.py in the images
common = load_standin("common")
smi = load_standin("nvidia_smi")
responder = load_standin("responder")

HW = hardware.preset("2x3090", "rig-01").to_dict()
UUID = HW["gpus"][0]["uuid"]
POWER_LIMIT_W = HW["gpus"][0]["power_limit_w"]  # 350: the RTX 3090's board power


def gpu(activity: dict[str, Any] | None, engine: bool = True, **state: Any) -> Any:
    """GPU 0 as nvidia-smi sees it with one engine on it (or none) and this activity record."""
    procs = [{"pid": 4242, "name": "VLLM::EngineCore", "uuid": UUID, "used_mib": 21000, "activity": activity}]
    return smi.Gpu(HW["gpus"][0], {"gpus": {UUID: dict(state)}}, procs if engine else [], 0)


def busy_since(seconds: float) -> dict[str, Any]:
    """The record of an engine that went busy `seconds` ago, after a long idle."""
    return common.activity_record(common.activity_record(None, False, 0.0), True, time.time() - seconds)


def idle_since(seconds: float, busy_for: float = 600.0) -> dict[str, Any]:
    """The record of an engine that was busy for `busy_for` s and went idle `seconds` ago."""
    now = time.time()
    went_busy = common.activity_record(common.activity_record(None, False, 0.0), True, now - seconds - busy_for)
    return common.activity_record(went_busy, False, now - seconds)


def readings(g: Any) -> tuple[int, float, int, int]:
    return g.utilization, g.power_draw, g.temperature, g.clocks_event_reasons


def test_an_idle_card_and_a_loaded_idle_engine_keep_their_idle_readings() -> None:
    assert readings(gpu(None, engine=False)) == (0, 20.0, 35, smi.REASON_IDLE)
    assert readings(gpu(common.activity_record(None, False, time.time()))) == (0, 110.0, 45, smi.REASON_IDLE)


def test_sustained_load_runs_at_the_power_limit_and_warms_the_card_toward_its_steady_state() -> None:
    util, power, temp, reasons = readings(gpu(busy_since(600)))
    assert util == 100 and power == pytest.approx(POWER_LIMIT_W)
    # 45 C loaded-idle + 240 W above it at the default airflow: about 72 C, under the 83 C target
    assert temp == 72 and reasons == smi.REASON_SW_POWER_CAP
    # a power cap (nvidia-smi -pl 230, rigup's gpu_power_cap_watts) caps the draw and the heat
    capped = gpu(busy_since(600), power_limit_w=230)
    assert capped.power_draw == pytest.approx(230) and capped.temperature < temp


def test_utilisation_and_power_follow_the_load_at_once_and_the_temperature_lags() -> None:
    just_started = gpu(busy_since(3))
    assert just_started.utilization >= 90 and just_started.power_draw > 320
    assert 45 < just_started.temperature < 50  # a heatsink takes its time: THERMAL_TAU_S
    warmer = gpu(busy_since(30))
    assert just_started.temperature < warmer.temperature < 72


def test_an_engine_that_stops_serving_falls_back_to_idle() -> None:
    stopped = gpu(idle_since(5))
    assert stopped.utilization <= 1 and stopped.power_draw < 112
    assert stopped.clocks_event_reasons == smi.REASON_IDLE
    assert 55 < stopped.temperature < 72  # still warm, cooling
    assert readings(gpu(idle_since(600))) == (0, 110.0, 45, smi.REASON_IDLE)


def test_poor_airflow_under_load_holds_the_card_at_its_target_temperature_with_thermal_slowdown() -> None:
    # 0.2 C per W would take the card to 93 C at 350 W: GPU Boost holds 83 C by drawing less
    hot = gpu(busy_since(600), thermal_c_per_w=0.2)
    assert hot.temperature == smi.TARGET_TEMP_C == 83
    assert hot.clocks_event_reasons == smi.REASON_SW_THERMAL
    assert hot.power_draw == pytest.approx(110 + (83 - 45) / 0.2)  # 300 W, under the 350 W limit
    assert gpu(idle_since(600), thermal_c_per_w=0.2).temperature == 45


def test_a_state_a_test_sets_still_wins_over_the_load() -> None:
    assert gpu(busy_since(600), temperature_c=91).temperature == 91
    assert gpu(busy_since(600), clocks_event_reasons=0x40).clocks_event_reasons == 0x40


def started_engine(root: Path) -> Any:
    """responder.py's App on a scratch root, past its startup checks: its engine registered on GPU 0."""
    (root / "etc/rigup-testbed").mkdir(parents=True)
    (root / "etc/rigup-testbed/hardware.json").write_text(json.dumps(HW))
    app = responder.App({"args": {"model": "qwen", "served_model_names": ["qwen"]}, "kind": "vllm", "gpus": [UUID],
                         "status_file": str(root / "status.json")})
    app.startup_checks({})
    return app


def seen() -> Any:
    """GPU 0 as nvidia-smi reads it now, with the engines registered on it."""
    procs = smi.processes(HW["gpus"])
    assert [p["pid"] for p in procs] == [os.getpid()]
    return smi.Gpu(HW["gpus"][0], {"gpus": {}}, procs, 0)


def test_the_engine_records_its_activity_in_its_gpu_registration_as_it_serves(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """responder.py's engine on a scratch root: its registration in /run/nvidia-standin/procs flips to busy
    when a request runs and back when it finishes, and nvidia-smi's view of the GPU moves with it."""
    monkeypatch.setenv(common.ROOT_ENV, str(tmp_path))
    app = started_engine(tmp_path)
    (registration,) = app.procs_files
    assert json.loads(registration.read_text())["activity"]["busy"] == 0
    assert seen().utilization == 0
    with app.engine.add_request(12, "Say hello.", 16) as run:
        run.wait_scheduled()
        assert json.loads(registration.read_text())["activity"]["busy"] == 1
        time.sleep(1.5)
        during = seen()
        assert during.utilization > 60 and during.power_draw > 250 and during.temperature > 45
        run.emit(16)
        run.finish("stop")
    assert json.loads(registration.read_text())["activity"]["busy"] == 0
    time.sleep(1.5)
    assert seen().utilization < during.utilization


def test_paced_requests_through_the_api_keep_the_gpu_busy_and_it_idles_after(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The served API (openai_responder under responder.py) with a decode rate from responder.json: a
    request takes the time its tokens take, the GPU reads busy meanwhile and idle after."""
    assert responder.rich is not None
    monkeypatch.setenv(common.ROOT_ENV, str(tmp_path))
    app = started_engine(tmp_path)
    (tmp_path / "etc/rigup-testbed/responder.json").write_text(json.dumps({"mode": "ok", "tokens_per_s": 20}))
    sock = socket.create_server(("127.0.0.1", 0))
    server = responder.tcp_server(sock, app)
    responder.serve(server, app)
    body = json.dumps({"model": "qwen", "max_tokens": 40, "messages": [{"role": "user", "content": "Count."}]}).encode()
    took: list[float] = []

    def ask() -> None:
        started = time.monotonic()
        request = urllib.request.Request(f"http://127.0.0.1:{sock.getsockname()[1]}/v1/chat/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as reply:
            assert reply.status == 200
        took.append(time.monotonic() - started)

    client = threading.Thread(target=ask)
    client.start()
    try:
        time.sleep(1.2)
        during = seen()
        assert during.utilization > 60 and during.power_draw > 250
    finally:
        client.join(timeout=30)
        server.shutdown()
    assert took and took[0] >= 1.5  # 40 tokens at 20 per second
    time.sleep(1.5)
    after = seen()
    assert after.utilization < 30 and after.power_draw < during.power_draw
