"""The stand-in engine's prefix cache (issue 44): vLLM's automatic prefix caching as the bed imitates it.
A conversation that grows finds its earlier blocks cached, a pool at capacity evicts the least recently used
blocks, and a prompt's first token waits for its uncached tokens at the prefill rate, so a cached prompt
starts sooner. Through a real responder process, as the entrance bench uses it."""

from __future__ import annotations

import http.client
import json
import time
from pathlib import Path
from typing import Any

from rigup_testbed.openai_responder import Config, Responder
from rigup_testbed.standins import vllm_metrics as vm
from tests.support.responder import MODEL, responder

SYSTEM = "You are a careful agent. Follow the house rules. " * 40  # 1,960 characters: 490 tokens at 4 per token


def chat(url: str, messages: list[dict[str, str]], *, stream: bool = False) -> tuple[float, dict[str, Any]]:
    """(seconds to the first byte of the answer, its usage) of one chat completion."""
    conn = http.client.HTTPConnection(url.removeprefix("http://"), timeout=30)
    body = {"model": MODEL, "messages": messages, "max_tokens": 4, "stream": stream, "temperature": 0,
            "stream_options": {"include_usage": True}, "chat_template_kwargs": {"enable_thinking": False}}
    started = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    first = response.read(1)
    ttft = time.perf_counter() - started
    raw = first + response.read()
    conn.close()
    assert response.status == 200, raw[:200]
    if stream:
        events = [json.loads(line[len(b"data: "):]) for line in raw.split(b"\n")
                  if line.startswith(b"data: {")]
        return ttft, events[-1]["usage"]
    return ttft, json.loads(raw)["usage"]


def counters(url: str) -> tuple[float, float]:
    """(vllm:prefix_cache_queries_total, vllm:prefix_cache_hits_total) from the pod's /metrics."""
    conn = http.client.HTTPConnection(url.removeprefix("http://"), timeout=10)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    values = {}
    for line in text.splitlines():
        for name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
            if line.startswith(name + "{"):
                values[name] = float(line.rsplit(" ", 1)[1])
    return values["vllm:prefix_cache_queries_total"], values["vllm:prefix_cache_hits_total"]


def test_a_growing_conversation_hits_its_earlier_turns_blocks(tmp_path: Path):
    with responder(tmp_path, "--enable-prompt-tokens-details") as pod:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "First question?"}]
        _, first = chat(pod.url, messages)
        assert first["prompt_tokens_details"] == {"cached_tokens": 0}
        messages += [{"role": "assistant", "content": "An answer."}, {"role": "user", "content": "And then?"}]
        _, second = chat(pod.url, messages, stream=True)
        # every full 16-token block of the first turn's prompt is found: the second prompt extends it
        assert second["prompt_tokens_details"]["cached_tokens"] == first["prompt_tokens"] // 16 * 16
        queries, hits = counters(pod.url)
        assert queries == first["prompt_tokens"] + second["prompt_tokens"]
        assert hits == first["prompt_tokens"] // 16 * 16


def test_a_full_pool_evicts_the_least_recently_used_blocks(tmp_path: Path):
    # 64 blocks of 16 tokens; each prompt below fills 31 of them, so a third distinct prompt evicts the first
    with responder(tmp_path, "--num-gpu-blocks-override", "65", "--enable-prompt-tokens-details") as pod:
        prompts = [[{"role": "user", "content": f"{name}: " + "Read this report closely. " * 76}]
                   for name in ("alpha", "bravo", "charlie")]
        for messages in prompts:
            assert chat(pod.url, messages)[1]["prompt_tokens_details"]["cached_tokens"] == 0
        _, again_second = chat(pod.url, prompts[1])  # the more recent of the first two stayed
        assert again_second["prompt_tokens_details"]["cached_tokens"] > 400
        _, again_first = chat(pod.url, prompts[0])  # the least recent was evicted
        assert again_first["prompt_tokens_details"]["cached_tokens"] == 0


def test_a_cached_prompt_starts_sooner_by_its_uncached_tokens_at_the_prefill_rate(tmp_path: Path):
    # 2,000 tokens/s: a ~500-token prompt takes ~0.25 s to prefill; cached, only its last block is computed
    with responder(tmp_path, "--prefill-tokens-per-s", "2000", "--enable-prompt-tokens-details") as pod:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "A question?"}]
        cold, usage = chat(pod.url, messages)
        warm, again = chat(pod.url, messages)
        assert usage["prompt_tokens"] > 490 and again["prompt_tokens_details"]["cached_tokens"] >= 480
        assert cold >= usage["prompt_tokens"] / 2000
        assert warm < cold / 3


def test_prefills_on_one_engine_take_turns():
    lane = Responder(("127.0.0.1", 0), Config(model="m", prefill_tokens_per_s=1000.0))
    try:
        assert lane.prefill_done(10.0, 500) == 10.5
        assert lane.prefill_done(10.1, 500) == 11.0  # waits for the first prefill, then its own 0.5 s
        assert lane.prefill_done(20.0, 0) == 20.0  # a fully cached prompt on an idle lane starts at once
    finally:
        lane.server_close()


def test_blocks_of_fixed_width_keep_a_growing_prompts_hashes():
    engine = vm.EngineStats("m", 4096, chars_per_token=4)
    short = vm.Request(engine, 40, "x" * 160, None)  # 2 full blocks of 64 characters
    longer = vm.Request(engine, 100, "x" * 160 + "y" * 240, None)
    assert engine._prefix_hashes(longer)[:2] == engine._prefix_hashes(short)
    assert len(engine._prefix_hashes(longer)) == 6
