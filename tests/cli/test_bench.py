"""rigup bench: the statistics on hand-computed values, and the measurements on a responder whose
token rate and TTFT are known, so every reported number can be predicted."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from rigup.cli import bench as B
from rigup.client.openai_client import ApiClient, StreamResult
from rigup.client.targets import Target
from tests.support.responder import MODEL, responder

# Long enough that a few ms of scheduling jitter on a loaded 2-CPU machine stay within the tolerances,
# with a TTFT large enough that decode and wall TPS differ by far more than those tolerances.
RATE = 400.0  # tokens/s the responder streams at
TTFT = 0.2  # s before its first token
TOKENS = 200


def expected(tokens: int = TOKENS, rate: float = RATE, ttft: float = TTFT) -> tuple[float, float]:
    """(decode_tps, wall_tps) for a stream whose first token comes at ttft, then one every 1/rate."""
    decode_s = (tokens - 1) / rate
    return tokens / decode_s, tokens / (ttft + decode_s)


def test_summarize_matches_hand_computed_values() -> None:
    stats = B.summarize([1.0, 2.0, 3.0, 4.0])
    assert stats is not None
    assert (stats.n, stats.mean, stats.min, stats.max) == (4, 2.5, 1.0, 4.0)
    assert stats.std == pytest.approx(math.sqrt(5 / 3))  # sample std: sum of squares 5 over n-1
    assert stats.cv_pct == pytest.approx(math.sqrt(5 / 3) / 2.5 * 100)
    single = B.summarize([7.0])
    assert single is not None and (single.std, single.cv_pct) == (0.0, 0.0)
    assert B.summarize([]) is None


def stream(started: float, ttft: float | None, finished: float, tokens: int | None, status: int = 200) -> StreamResult:
    result = StreamResult(status=status, elapsed=finished - started)
    result.started, result.finished = started, finished
    result.first_token_at = None if ttft is None else started + ttft
    result.usage = None if tokens is None else {"completion_tokens": tokens}
    return result


def test_run_metrics_follow_the_seed_formulas() -> None:
    run = B.sample_from(stream(10.0, 0.5, 12.5, 100))
    assert (run.wall_s, run.ttft_s, run.wall_tps, run.decode_tps) == (2.5, 0.5, 40.0, 50.0)
    whole = B.sample_from(stream(0.0, None, 2.0, 10))  # no text delta: TTFT = wall, decode undefined
    assert whole.ttft_s == 2.0 and whole.decode_tps is None
    with pytest.raises(B.BenchError, match="usage"):
        B.sample_from(stream(0.0, 0.1, 1.0, None))
    with pytest.raises(B.BenchError, match="HTTP 500"):
        B.sample_from(stream(0.0, 0.1, 1.0, 10, status=500))


def test_aggregate_spans_first_start_to_last_end() -> None:
    results = [stream(0.0, 0.1, 2.0, 100), stream(0.5, 0.1, 3.0, 100), stream(0.2, 0.1, 2.5, 100)]
    measured = B.aggregate(results)
    assert measured["tokens"] == 300 and measured["seconds"] == 3.0 and measured["aggregate_tps"] == 100.0


def test_measurements_on_known_timings(tmp_path: Path) -> None:
    settings = B.BenchSettings(prompts=("narr",), warmups=1, runs=2, max_tokens={"narr": TOKENS, "code": TOKENS})
    with responder(tmp_path, "--tokens-per-s", str(RATE), "--ttft-ms", str(TTFT * 1000)) as server:
        document = B.bench_target(Target("local", server.url), settings, quiet=True)
    assert document["error"] is None and document["model"] == MODEL
    narr = document["prompts"]["narr"]
    assert len(narr["runs"]) == 2 and narr["failures"] == []  # the warm-up is not measured
    decode, wall = expected()
    summary = narr["summary"]
    # The client's share is far below these tolerances (bench/client_overhead.py measures it).
    assert summary["decode_tps"]["mean"] == pytest.approx(decode, rel=0.04)
    ttft = summary["ttft_s"]["mean"]
    assert TTFT <= ttft < TTFT + 0.05  # + connection set-up and a thread start on a busy CI machine
    assert summary["wall_tps"]["mean"] == pytest.approx(expected(ttft=ttft)[1], rel=0.04)
    assert summary["wall_tps"]["mean"] == pytest.approx(wall, rel=0.08)
    assert wall / decode < 0.75  # the two really are different measures here
    assert summary["tokens"]["mean"] == TOKENS and summary["decode_tps"]["cv_pct"] < 5


def test_aggregate_under_concurrency_on_known_timings(tmp_path: Path) -> None:
    tokens, rate = 100, 200.0  # with TTFT 0.2 s: one stream takes ~0.7 s
    settings = B.BenchSettings(prompts=(), max_tokens={"narr": tokens, "code": tokens}, concurrency=(4,), concurrency_runs=1)
    with responder(tmp_path, "--tokens-per-s", str(rate), "--ttft-ms", str(TTFT * 1000)) as server:
        document = B.bench_target(Target("local", server.url), settings, quiet=True)
    (level,) = document["concurrency"]
    (measured,) = level["rounds"]
    assert level["streams"] == 4 and measured["tokens"] == 4 * tokens
    assert measured["aggregate_tps"] == measured["tokens"] / measured["seconds"] == level["aggregate_tps"]["mean"]
    # Streams are independent in the responder: 4 at once take one stream's time (no sooner than its
    # schedule allows; the upper bound leaves room for a loaded 2-CPU CI machine), so 4x the tokens/s.
    one_stream_s = TTFT + (tokens - 1) / rate
    assert one_stream_s <= measured["seconds"] < 1.3 * one_stream_s
    assert measured["aggregate_tps"] == pytest.approx(4 * expected(tokens, rate)[1], rel=0.2)
    assert measured["mean_stream_decode_tps"] == pytest.approx(expected(tokens, rate)[0], rel=0.03)


def test_ignore_eos_forces_the_length(tmp_path: Path) -> None:
    settings = B.BenchSettings(prompts=("code",), warmups=0, runs=1, ignore_eos=True, max_tokens={"narr": 50, "code": 50})
    body = B.payload(MODEL, "code", settings)
    assert body["ignore_eos"] is True and body["chat_template_kwargs"] == {"enable_thinking": False}
    assert body["temperature"] == 0.6 and body["top_p"] == 0.95 and body["max_tokens"] == 50


def test_failures_are_counted_not_averaged(tmp_path: Path) -> None:
    settings = B.BenchSettings(prompts=("narr",), warmups=0, runs=2)
    with responder(tmp_path, "--fail-status", "500") as server:
        document = B.bench_target(Target("local", server.url), settings, quiet=True)
    narr = document["prompts"]["narr"]
    assert narr["runs"] == [] and len(narr["failures"]) == 2 and narr["summary"]["decode_tps"] is None
    assert B.failures(document) == 2
    with responder(tmp_path) as server:
        url = server.url
    down = B.bench_target(Target("gone", url), settings, quiet=True)
    assert "connection refused" in down["error"] and B.failures(down) == 1


def test_cli_saves_results_per_host_and_draws_the_chart(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from rigup.cli import main

    results = tmp_path / "results"
    with responder(tmp_path, "--tokens-per-s", "2000") as server:
        argv = ["bench", "--url", server.url, "--warmups", "0", "--runs", "2", "--max-tokens-narr", "40",
                "--max-tokens-code", "30", "--concurrency", "1,2", "--concurrency-runs", "1",
                "--results-dir", str(results), "--log-file", str(server.log_file), "--json"]
        assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    saved = sorted(results.glob("*/*.json"))
    assert [str(p) for p in saved] == out["saved"] and saved[0].parent.name == B.safe_name(server.url)
    document = json.loads(saved[0].read_text())
    assert document == out["results"][0]
    assert set(document["prompts"]) == {"narr", "code"} and [c["streams"] for c in document["concurrency"]] == [1, 2]
    assert isinstance(document["spec_decoding"], list) and "Mean acceptance length: 3.40" in document["spec_decoding"][-1]
    charts = sorted(results.glob("chart-*.png"))
    assert [str(c) for c in charts] == [out["chart"]] and charts[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = B.render_table([document])
    assert "narr" in table and "code" in table and "x2     aggregate" in table and "2/2" in table


def test_chart_compares_the_newest_result_of_each_host_and_variant(tmp_path: Path) -> None:
    def document(host: str, variant: str, time: str, decode: float) -> dict:
        stats = {"n": 1, "mean": decode, "std": 1.0, "cv_pct": 1.0, "min": decode, "max": decode}
        summary = {"decode_tps": stats, "wall_tps": stats, "ttft_s": stats, "tokens": stats}
        return {"schema": B.SCHEMA, "host": host, "variant": variant, "time": time, "error": None,
                "prompts": {"narr": {"summary": summary, "runs": [], "failures": []}}, "concurrency": []}

    for doc in (document("rig-01", "dual", "2026-01-01T00:00:00+00:00", 60.0),
                document("rig-01", "dual", "2026-01-02T00:00:00+00:00", 70.0),
                document("rig-01", "dual-dflash", "2026-01-03T00:00:00+00:00", 80.0),
                document("rig-02", "dual", "2026-01-01T00:00:00+00:00", 65.0)):
        B.save(doc, tmp_path)
    latest = B.latest_results(tmp_path)
    assert [(d["host"], d["variant"], d["prompts"]["narr"]["summary"]["decode_tps"]["mean"]) for d in latest] == [
        ("rig-01", "dual", 70.0), ("rig-01", "dual-dflash", 80.0), ("rig-02", "dual", 65.0)]
    chart = B.plot(latest, tmp_path / "chart.png")
    assert chart is not None and chart.stat().st_size > 10_000
    assert B.plot([], tmp_path / "none.png") is None


def test_client_for_each_concurrent_stream(tmp_path: Path) -> None:
    with responder(tmp_path) as server:
        body = B.payload(MODEL, "narr", B.BenchSettings(max_tokens={"narr": 20, "code": 20}))
        results = B.concurrent_round(server.url, None, body, 3, 10)
    assert len(results) == 3 and all(r.ok and r.completion_tokens == 20 for r in results)
    assert ApiClient  # the module under test creates one client per stream (requests sessions are per thread)
