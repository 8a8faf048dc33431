"""vLLM's /metrics in the stand-in servers (standins/vllm_metrics.py): the families of vLLM 0.27.1's V1
engine (rigup_testbed/FACTS.md section 11) in prometheus_client's text format, parsed back with
prometheus_client's own parser, and values that move with the requests the servers answer."""

from __future__ import annotations

import http.client
import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import prometheus_client
import pytest
from prometheus_client.parser import text_string_to_metric_families

from rigup_testbed import RESPONDER_SCRIPT
from rigup_testbed.standin_modules import STANDINS, load_standin
from tests.support.responder import responder

vm = load_standin("vllm_metrics")

# vllm/v1/metrics/loggers.py, spec_decode/metrics.py and perf.py at v0.27.1 (FACTS.md section 11): what a
# default `vllm serve` registers, by name as prometheus_client's parser reports it (counters without
# _total), with its type and its label names besides model_name and engine
VLLM_0_27_1 = {
    "vllm:estimated_flops_per_gpu": ("counter", ()),
    "vllm:estimated_read_bytes_per_gpu": ("counter", ()),
    "vllm:estimated_write_bytes_per_gpu": ("counter", ()),
    "vllm:num_requests_running": ("gauge", ()),
    "vllm:num_requests_waiting": ("gauge", ()),
    "vllm:num_requests_waiting_by_reason": ("gauge", ("reason",)),
    "vllm:engine_sleep_state": ("gauge", ("sleep_state",)),
    "vllm:kv_cache_usage_perc": ("gauge", ()),
    "vllm:prefix_cache_queries": ("counter", ()),
    "vllm:prefix_cache_hits": ("counter", ()),
    "vllm:external_prefix_cache_queries": ("counter", ()),
    "vllm:external_prefix_cache_hits": ("counter", ()),
    "vllm:mm_cache_queries": ("counter", ()),
    "vllm:mm_cache_hits": ("counter", ()),
    "vllm:num_preemptions": ("counter", ()),
    "vllm:prompt_tokens": ("counter", ()),
    "vllm:prompt_tokens_by_source": ("counter", ("source",)),
    "vllm:prompt_tokens_cached": ("counter", ()),
    "vllm:generation_tokens": ("counter", ()),
    "vllm:request_success": ("counter", ("finished_reason",)),
    "vllm:request_prompt_tokens": ("histogram", ()),
    "vllm:request_generation_tokens": ("histogram", ()),
    "vllm:iteration_tokens_total": ("histogram", ()),
    "vllm:request_max_num_generation_tokens": ("histogram", ()),
    "vllm:request_params_n": ("histogram", ()),
    "vllm:request_params_max_tokens": ("histogram", ()),
    "vllm:time_to_first_token_seconds": ("histogram", ()),
    "vllm:inter_token_latency_seconds": ("histogram", ()),
    "vllm:request_time_per_output_token_seconds": ("histogram", ()),
    "vllm:e2e_request_latency_seconds": ("histogram", ()),
    "vllm:request_queue_time_seconds": ("histogram", ()),
    "vllm:request_inference_time_seconds": ("histogram", ()),
    "vllm:request_prefill_time_seconds": ("histogram", ()),
    "vllm:request_decode_time_seconds": ("histogram", ()),
    "vllm:request_prefill_kv_computed_tokens": ("histogram", ()),
}
SPEC_DECODE = {
    "vllm:spec_decode_num_drafts": ("counter", ()),
    "vllm:spec_decode_num_draft_tokens": ("counter", ()),
    "vllm:spec_decode_num_accepted_tokens": ("counter", ()),
    "vllm:spec_decode_num_accepted_tokens_per_pos": ("counter", ("position",)),
}
TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
        160.0, 640.0, 2560.0]
ITL = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
           1920.0, 7680.0]


def families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(fams: dict[str, Any], sample: str, **labels: str) -> float:
    family = fams[max((name for name in fams if sample.startswith(name)), key=len)]
    found = [s.value for s in family.samples if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, (sample, labels, [s for s in family.samples if s.name == sample])
    return float(found[0])


def bucket_bounds(fams: dict[str, Any], name: str) -> list[float]:
    return [float(s.labels["le"]) for s in fams[name].samples if s.name == name + "_bucket"]


def test_the_metrics_are_vllm_0_27_1s_families_and_parse_with_prometheus_client() -> None:
    engine = vm.EngineStats("qwen", 4096, max_num_seqs=4, num_speculative_tokens=3)
    fams = families(engine.render())
    expected = {**SPEC_DECODE, **VLLM_0_27_1, "vllm:cache_config_info": ("gauge", None)}
    # vLLM's registration order; each counter and histogram followed by its _created gauge, as
    # prometheus_client's text format writes it
    assert [n for n in fams if not n.endswith("_created")] == list(expected)
    for name, (kind, _) in expected.items():
        assert (f"{name}_created" in fams) == (kind in ("counter", "histogram")), name
        if kind != "gauge":
            assert fams[f"{name}_created"].type == "gauge"
    for name, (kind, extra) in expected.items():
        assert fams[name].type == kind, name
        if extra is None:
            continue
        for sample in fams[name].samples:
            keys = set(sample.labels) - {"le"}
            assert keys == {"model_name", "engine", *extra}, (name, sample.labels)
            assert sample.labels["model_name"] == "qwen" and sample.labels["engine"] == "0"
    reasons = {s.labels["finished_reason"] for s in fams["vllm:request_success"].samples}
    assert reasons == {"stop", "length", "abort", "error", "repetition"}
    positions = {s.labels["position"] for s in fams["vllm:spec_decode_num_accepted_tokens_per_pos"].samples}
    assert positions == {"0", "1", "2"}
    assert bucket_bounds(fams, "vllm:time_to_first_token_seconds") == TTFT + [math.inf]
    assert bucket_bounds(fams, "vllm:inter_token_latency_seconds") == ITL + [math.inf]
    assert bucket_bounds(fams, "vllm:request_time_per_output_token_seconds") == ITL + [math.inf]
    for name in ("e2e_request_latency_seconds", "request_queue_time_seconds", "request_inference_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds"):
        assert bucket_bounds(fams, f"vllm:{name}") == LATENCY + [math.inf]
    tokens = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]  # 1-2-5 up to max_model_len 4096
    for name in ("request_prompt_tokens", "request_generation_tokens", "request_params_max_tokens",
                 "request_max_num_generation_tokens", "request_prefill_kv_computed_tokens"):
        assert bucket_bounds(fams, f"vllm:{name}") == tokens + [math.inf]
    assert bucket_bounds(fams, "vllm:request_params_n") == [1, 2, 5, 10, 20, math.inf]
    assert bucket_bounds(fams, "vllm:iteration_tokens_total") == [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096,
                                                                   8192, 16384, math.inf]
    info = fams["vllm:cache_config_info"].samples[0]
    assert info.value == 1 and info.labels["block_size"] == "16" and info.labels["engine"] == "0"
    assert info.labels["num_gpu_blocks"] == str(math.ceil(4096 * 4 / 16) + 1)
    # renamed before 0.27.1: the old names are gone
    assert not {"vllm:gpu_cache_usage_perc", "vllm:time_per_output_token_seconds", "vllm:gpu_prefix_cache_queries"} & set(fams)
    # without --speculative-config no spec-decode family
    assert not set(SPEC_DECODE) & set(families(vm.EngineStats("qwen", 4096).render()))


def test_the_text_is_what_prometheus_client_renders_for_the_same_metrics() -> None:
    """Every family of the stand-in rebuilt with prometheus_client, fed the same values: the same text,
    line for line (the _created timestamps aside)."""
    engine = vm.EngineStats("qwen", 2048, max_num_seqs=2, num_speculative_tokens=2)
    registry = prometheus_client.CollectorRegistry()
    observations = [0.0004, 0.3, 7.0, 123456789.0]
    for family in engine.registry.families:
        cls = {"counter": prometheus_client.Counter, "gauge": prometheus_client.Gauge,
               "histogram": prometheus_client.Histogram}[family.kind]
        kwargs = {"buckets": family.buckets} if family.kind == "histogram" else {}
        metric = cls(family.name, family.doc, family.labelnames, registry=registry, **kwargs)
        for n, (values, series) in enumerate(family.children.items()):
            theirs = metric.labels(*values)
            if family.kind == "counter":
                series.inc(n + 0.5)
                theirs.inc(series.value)
            elif family.kind == "gauge":
                theirs.set(series.value)
            else:
                for x in observations:
                    series.observe(x)
                    theirs.observe(x)
    created = re.compile(r"^(\S+_created\{.*\}) \S+$", re.M)
    ours = created.sub(r"\1 T", engine.registry.render())
    assert ours == created.sub(r"\1 T", prometheus_client.generate_latest(registry).decode())


def test_go_floats_as_prometheus_client_prints_them() -> None:
    for x in (0.0, 1.0, 0.001, 2560.0, 1e6, 123456.5, 1796313177.139, 1e-05, 3.0e21, math.inf):
        assert vm.go_float(x) == prometheus_client.utils.floatToGoString(x), x


def test_the_scheduler_queues_beyond_max_num_seqs_and_kv_usage_follows_blocks() -> None:
    engine = vm.EngineStats("m", 256, max_num_seqs=1, block_size=16)
    first = engine.add_request(40, "a" * 160, 8)
    second = engine.add_request(20, "b" * 80, 8)
    fams = families(engine.render())
    assert value(fams, "vllm:num_requests_running") == 1 and value(fams, "vllm:num_requests_waiting") == 1
    assert value(fams, "vllm:num_requests_waiting_by_reason", reason="capacity") == 1
    pool = engine.num_gpu_blocks - 1  # 256 x 1 / 16 blocks + the null block
    assert value(fams, "vllm:kv_cache_usage_perc") == pytest.approx(3 / pool)  # 40 tokens: 3 blocks of 16
    first.wait_scheduled()
    first.emit(1)
    time.sleep(0.05)
    for _ in range(7):
        first.emit(1)
    first.finish("length")
    assert second.wait_scheduled(5) >= second.arrival + 0.05  # it waited for the slot
    second.emit(2)
    second.finish("stop")
    fams = families(engine.render())
    assert value(fams, "vllm:num_requests_running") == 0 and value(fams, "vllm:kv_cache_usage_perc") == 0
    assert value(fams, "vllm:request_success_total", finished_reason="length") == 1
    assert value(fams, "vllm:request_success_total", finished_reason="stop") == 1
    assert value(fams, "vllm:prompt_tokens_total") == 60 and value(fams, "vllm:generation_tokens_total") == 10
    assert value(fams, "vllm:request_queue_time_seconds_count") == 2
    assert value(fams, "vllm:request_queue_time_seconds_sum") >= 0.05
    assert value(fams, "vllm:time_to_first_token_seconds_count") == 2
    assert value(fams, "vllm:inter_token_latency_seconds_count") == 7 + 0  # second's one step gave two tokens at once
    assert value(fams, "vllm:inter_token_latency_seconds_sum") >= 0.05
    assert value(fams, "vllm:request_generation_tokens_sum") == 10
    assert value(fams, "vllm:request_params_max_tokens_count") == 2


def test_a_repeated_prompt_hits_the_prefix_cache() -> None:
    engine = vm.EngineStats("m", 4096, max_num_seqs=4)
    text = "The same system prompt, long enough to fill several blocks. " * 20
    for _ in range(2):
        with engine.add_request(300, text, 4) as req:
            req.emit(4)
            req.finish("stop")
    fams = families(engine.render())
    assert value(fams, "vllm:prefix_cache_queries_total") == 600
    # the second finds every full block before the last token cached: (300 - 1) // 16 blocks
    assert value(fams, "vllm:prefix_cache_hits_total") == 18 * 16
    assert value(fams, "vllm:prompt_tokens_cached_total") == 18 * 16
    assert value(fams, "vllm:prompt_tokens_by_source_total", source="local_compute") == 600 - 18 * 16
    assert value(fams, "vllm:request_prefill_kv_computed_tokens_sum") == 600 - 18 * 16


def test_a_request_that_cannot_grow_is_preempted_and_resumes() -> None:
    engine = vm.EngineStats("m", 64, max_num_seqs=4, num_gpu_blocks_override=5)  # 4 usable blocks of 16 tokens
    a = engine.add_request(30, "", 8)
    b = engine.add_request(30, "", 8)
    assert value(families(engine.render()), "vllm:kv_cache_usage_perc") == 1.0
    a.emit(2)  # 32 tokens: still two blocks
    done = threading.Event()

    def grow() -> None:
        a.emit(1)  # 33 tokens need a third block: none is free, so `a` is preempted until `b` ends
        done.set()

    thread = threading.Thread(target=grow)
    thread.start()
    time.sleep(0.2)
    fams = families(engine.render())
    assert not done.is_set() and value(fams, "vllm:num_preemptions_total") == 1
    assert value(fams, "vllm:num_requests_waiting") == 1 and value(fams, "vllm:num_requests_running") == 1
    b.emit(1)
    b.finish("stop")
    thread.join(5)
    assert done.is_set()
    a.finish("stop")
    fams = families(engine.render())
    assert value(fams, "vllm:request_success_total", finished_reason="stop") == 2
    assert value(fams, "vllm:num_requests_running") == 0


def test_an_unfinished_request_counts_as_aborted() -> None:
    engine = vm.EngineStats("m", 512)
    with pytest.raises(ConnectionResetError):
        with engine.add_request(10, "x", None) as req:
            req.emit(1)
            raise ConnectionResetError
    assert value(families(engine.render()), "vllm:request_success_total", finished_reason="abort") == 1


def test_spec_decode_counters_spread_accepted_tokens_over_positions() -> None:
    engine = vm.EngineStats("m", 512, num_speculative_tokens=3)
    engine.record_spec_decoding(drafts=10, draft_tokens=30, accepted=24)
    fams = families(engine.render())
    assert value(fams, "vllm:spec_decode_num_drafts_total") == 10
    assert value(fams, "vllm:spec_decode_num_draft_tokens_total") == 30
    assert value(fams, "vllm:spec_decode_num_accepted_tokens_total") == 24
    per_pos = [value(fams, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(p)) for p in range(3)]
    assert per_pos == [10, 10, 4] and sum(per_pos) == 24


def test_engine_for_reads_the_serve_command_line() -> None:
    container = load_standin("container")
    args = container.vllm_args(["vllm", "serve", "m", "--max-num-seqs", "2", "--block-size", "32",
                                "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2}',
                                "--no-enable-prefix-caching", "--kv-cache-dtype", "fp8"])
    engine = vm.engine_for(args, "m", 8192, [{"memory_total_mib": 24576, "name": "NVIDIA GeForce RTX 3090"}], 0.9)
    assert (engine.max_num_seqs, engine.block_size, engine.num_speculative_tokens) == (2, 32, 2)
    assert not engine.prefix_caching
    info = families(engine.render())["vllm:cache_config_info"].samples[0].labels
    assert info["cache_dtype"] == "fp8" and info["enable_prefix_caching"] == "False"
    # vLLM's default max_num_seqs: 256, and 1024 on a GPU of 70 GiB or more that is not an A100
    assert vm.engine_for({}, "m", 8192, [{"memory_total_mib": 24576, "name": "NVIDIA GeForce RTX 3090"}]).max_num_seqs == 256
    assert vm.engine_for({}, "m", 8192, [{"memory_total_mib": 143771, "name": "NVIDIA H200"}]).max_num_seqs == 1024
    assert vm.engine_for({}, "m", 8192, [{"memory_total_mib": 81920, "name": "NVIDIA A100-SXM4-80GB"}]).max_num_seqs == 256


# --- the servers ---------------------------------------------------------------------------------------


def scrape(url: str) -> tuple[dict[str, Any], str]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        return families(response.read().decode()), response.headers["Content-Type"]


def chat(url: str, key: str | None, body: dict[str, Any]) -> tuple[int, bytes]:
    request = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json",
                                              **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


QUESTION = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 64}


def test_openai_responders_metrics_move_with_served_requests_and_need_no_key(tmp_path: Path) -> None:
    with responder(tmp_path, "--api-key", "sekret", "--ttft-ms", "100", "--tokens-per-s", "400",
                   "--tokens-per-chunk", "2") as server:
        before, ctype = scrape(server.url)  # no key: vLLM's key guards /v1 only
        assert ctype == "text/plain; version=0.0.4; charset=utf-8"
        assert value(before, "vllm:prompt_tokens_total") == 0
        assert chat(server.url, None, QUESTION)[0] == 401  # /v1 still needs it
        status, body = chat(server.url, "sekret", QUESTION)
        assert status == 200
        usage = json.loads(body)["usage"]
        status, streamed = chat(server.url, "sekret", {**QUESTION, "stream": True, "stream_options": {"include_usage": True}})
        assert status == 200 and streamed.rstrip().endswith(b"data: [DONE]")
        after, _ = scrape(server.url)
    assert value(after, "vllm:prompt_tokens_total") == 2 * usage["prompt_tokens"]
    assert value(after, "vllm:generation_tokens_total") == 2 * usage["completion_tokens"]
    assert value(after, "vllm:request_success_total", finished_reason="length") == 2  # thinking ran out of 64 tokens
    assert value(after, "vllm:time_to_first_token_seconds_count") == 2
    assert value(after, "vllm:time_to_first_token_seconds_sum") >= 2 * 0.1  # the measured --ttft-ms
    chunks = math.ceil(usage["completion_tokens"] / 2)
    assert value(after, "vllm:inter_token_latency_seconds_count") == 2 * (chunks - 1)  # one gap per engine step
    assert value(after, "vllm:e2e_request_latency_seconds_sum") >= 2 * (0.1 + (usage["completion_tokens"] - 2) / 400)
    assert value(after, "vllm:num_requests_running") == 0
    assert value(after, "vllm:spec_decode_num_drafts_total") > 0  # the responder's default acceptance length 3.40


def test_openai_responder_queues_requests_beyond_max_num_seqs(tmp_path: Path) -> None:
    with responder(tmp_path, "--ttft-ms", "400", "--max-num-seqs", "1", "--acceptance-length", "0") as server:
        results: list[int] = []
        threads = [threading.Thread(target=lambda: results.append(chat(server.url, None, QUESTION)[0])) for _ in range(2)]
        for thread in threads:
            thread.start()
        time.sleep(0.2)
        during, _ = scrape(server.url)
        for thread in threads:
            thread.join(30)
        after, _ = scrape(server.url)
    assert results == [200, 200]
    assert value(during, "vllm:num_requests_running") == 1 and value(during, "vllm:num_requests_waiting") == 1
    assert value(during, "vllm:kv_cache_usage_perc") > 0
    assert value(after, "vllm:request_queue_time_seconds_sum") >= 0.3  # the second waited for the first
    assert value(after, "vllm:time_to_first_token_seconds_sum") >= 0.4 + 0.7  # and its first token came later
    assert "vllm:spec_decode_num_drafts" not in after


# --- responder.py, the server in the vLLM images, on both of its servers --------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(params=["rich", "built-in"])
def served(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """responder.py as the vLLM image runs it (vllm_entry.py's spec), with openai_responder.py beside it
    ("rich") or without ("built-in"), on simulated hardware under RIGUP_STANDIN_ROOT."""
    lib = tmp_path / "lib"
    lib.mkdir()
    for module in ("responder.py", "common.py", "container.py", "vllm_metrics.py"):
        shutil.copy(STANDINS / module, lib / module)
    if request.param == "rich":
        shutil.copy(RESPONDER_SCRIPT, lib / "openai_responder.py")
    root = tmp_path / "root"
    (root / "etc/rigup-testbed").mkdir(parents=True)
    uuid = "GPU-00000000-1111-2222-3333-444444444444"
    (root / "etc/rigup-testbed/hardware.json").write_text(json.dumps({"schema": 1, "gpus": [{
        "index": 0, "name": "NVIDIA GeForce RTX 3090", "uuid": uuid, "pci_bus_id": "00000000:01:00.0",
        "memory_total_mib": 24576, "memory_used_mib": 1}]}))
    port = _free_port()
    args = {"model": "Qwen/Qwen3-8B", "served_model_names": ["qwen", "qwen-alias"], "max_model_len": "8192",
            "api_key": "sekret", "host": "127.0.0.1", "port": str(port), "max_num_seqs": "4",
            "speculative_config": '{"method": "mtp", "num_speculative_tokens": 2}'}
    spec = {"kind": "vllm", "image": "vllm", "args": args, "gpus": [uuid], "network_mode": "host", "listen": [],
            "binds": [{"Destination": "/", "Source": "/"}], "status_file": str(tmp_path / "status.json"),
            "ctr_socket": str(tmp_path / "ctr.sock")}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    proc = subprocess.Popen([sys.executable, str(lib / "responder.py"), str(tmp_path / "spec.json")],
                            env={**os.environ, "RIGUP_STANDIN_ROOT": str(root)}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "Application startup complete" in line:
                break
        else:
            raise AssertionError("".join(lines))
        yield f"http://127.0.0.1:{port}", tmp_path / "ctr.sock"
    finally:
        proc.terminate()
        proc.wait(10)


def test_the_vllm_images_server_serves_metrics_of_what_it_answered(served: tuple[str, Path]) -> None:
    url, _ = served
    before, _ = scrape(url)
    assert value(before, "vllm:generation_tokens_total") == 0
    status, body = chat(url, "sekret", {**QUESTION, "model": "qwen-alias"})
    assert status == 200
    usage = json.loads(body)["usage"]
    status, _ = chat(url, "sekret", {**QUESTION, "stream": True})
    assert status == 200
    after, _ = scrape(url)
    assert value(after, "vllm:generation_tokens_total") == 2 * usage["completion_tokens"]
    assert value(after, "vllm:prompt_tokens_total") == 2 * usage["prompt_tokens"]
    successes = sum(s.value for s in after["vllm:request_success"].samples if s.name == "vllm:request_success_total")
    assert successes == 2 and value(after, "vllm:e2e_request_latency_seconds_count") == 2
    # labelled with the first served name, as vLLM's model_config.served_model_name
    assert {s.labels["model_name"] for s in after["vllm:generation_tokens"].samples} == {"qwen"}
    info = after["vllm:cache_config_info"].samples[0].labels
    assert info["num_gpu_blocks"] == str(math.ceil(8192 * 4 / 16) + 1)
    positions = {s.labels["position"] for s in after["vllm:spec_decode_num_accepted_tokens_per_pos"].samples}
    assert positions == {"0", "1"}  # --speculative-config's num_speculative_tokens


def test_the_container_socket_serves_the_same_metrics(served: tuple[str, Path]) -> None:
    url, ctr = served
    assert chat(url, "sekret", QUESTION)[0] == 200

    class UnixConnection(http.client.HTTPConnection):
        def connect(self) -> None:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.connect(str(ctr))

    conn = UnixConnection("container")
    conn.request("GET", "/metrics")
    inside = families(conn.getresponse().read().decode())
    conn.close()
    assert value(inside, "vllm:e2e_request_latency_seconds_count") == 1
