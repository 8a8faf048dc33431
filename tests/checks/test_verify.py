"""rigup.checks.verify: the verdicts of `rigup verify`'s checks, from replies and log lines built here
(tests/cli/test_verify.py runs the same checks against a responder)."""

from __future__ import annotations

from rigup.checks.verify import (
    FAIL,
    PASS,
    SKIP,
    WARN,
    acceptance_length,
    judge_ceiling_rung,
    judge_models,
    judge_needle,
    judge_patches,
    needle_found,
    quality_problems,
)
from rigup.client.openai_client import ChatResult, ModelsResult


def test_quality_flags_markup_repeated_lines_and_small_vocabulary() -> None:
    fluent = " ".join(f"word{i}" for i in range(300))
    assert quality_problems(fluent) == []
    assert quality_problems("") == ["no content"]
    assert "<tool_call> markup" in quality_problems(fluent + " <tool_call>{}</tool_call>")[0]
    looping = fluent[:200] + "\n" + "\n\n".join(["The same line again."] * 5)
    assert any("repeats 5 times in a row" in p for p in quality_problems(looping))
    four = fluent + "\n" + "\n".join(["Again."] * 4)
    assert quality_problems(four) == []  # 4 repeats are allowed, 5 are not
    narrow = " ".join(["alpha", "beta", "gamma", "delta", "eps"] * 40)
    assert "lexical variety 0.03" in quality_problems(narrow)[0]


def test_acceptance_length_is_read_from_the_last_metrics_line() -> None:
    lines = [
        "INFO 11-30 04:00:00 [metrics.py:96] SpecDecoding metrics: Mean acceptance length: 1.90, Accepted: 9 tokens",
        "INFO:     127.0.0.1:1 - \"POST /v1/chat/completions HTTP/1.1\" 200 OK",
        "(APIServer pid=1) INFO 11-30 04:00:10 [metrics.py:96] SpecDecoding metrics: Mean acceptance length: 3.42, "
        "Accepted throughput: 40.1 tokens/s",
    ]
    assert acceptance_length(lines) == 3.42
    assert acceptance_length(lines[:2]) == 1.90
    assert acceptance_length(["SpecDecoding metrics: Draft acceptance rate: 0.686"]) is None
    assert acceptance_length(['{"mean_acceptance_length": 2.5}']) == 2.5


def test_needle_found_ignores_case_and_punctuation_around_the_words() -> None:
    assert needle_found("blue otter 42", "The passphrase: Blue Otter 42.")
    assert not needle_found("blue otter 42", "blue otter 24")


def test_models_verdict_reports_the_served_context_length() -> None:
    served = ModelsResult(200, 0.1, models={"qwen": {"max_model_len": 65536}})
    verdict = judge_models(served, "qwen")
    assert (verdict.outcome, verdict.data) == (PASS, {"max_model_len": 65536})
    assert judge_models(served, "other").outcome == FAIL
    assert judge_models(ModelsResult(0, 5.0, "connection refused"), "qwen").outcome == FAIL


def test_patch_markers_fail_pass_or_warn() -> None:
    assert judge_patches(["[Genesis] applied: 12 patches", "[Genesis] FAILED: p7"]).outcome == FAIL
    assert judge_patches(["[OK] Qwen3 tool_call fix"]).outcome == PASS
    assert judge_patches([]).outcome == WARN


def test_needle_over_the_context_length_is_skipped_not_failed() -> None:
    over = ChatResult(400, 0.2, "This model's maximum context length is 32768 tokens")
    assert judge_needle("needle-60k", "red tiger 12", over, 32768).outcome == SKIP
    found = ChatResult(200, 3.0, content="red tiger 12", usage={"prompt_tokens": 30100})
    verdict = judge_needle("needle-30k", "red tiger 12", found, 32768)
    assert (verdict.outcome, verdict.data["prompt_tokens"]) == (PASS, 30100)
    assert judge_needle("needle-30k", "red tiger 12", ChatResult(200, 3.0, content="blue"), None).outcome == FAIL


def test_ceiling_rung_warns_below_the_vram_margin_and_keeps_the_probe_record() -> None:
    recalled = ChatResult(200, 9.0, content="amber heron 55", usage={"prompt_tokens": 95012})
    record = {"target_tokens": 95000, "vram_before_mib": [(20000, 24576)], "vram_after_mib": [(23900, 24576)]}
    verdict = judge_ceiling_rung("ceiling-95k", "amber heron 55", recalled, 9.5, record, 1024)
    assert verdict.outcome == WARN and "676 MiB free on the fullest GPU (< 1024 MiB margin)" in verdict.detail
    assert verdict.data == {**record, "prompt_tokens": 95012, "min_free_mib": 676} and verdict.seconds == 9.5
    assert "prompt_tokens" not in record  # the probe's own record is left as it was
    assert judge_ceiling_rung("ceiling-95k", "amber heron 55", recalled, 9.5, record, 512).outcome == PASS
    crashed = ChatResult(0, 900.0, "read timed out")
    assert judge_ceiling_rung("ceiling-125k", "x", crashed, 900.0, record, 1024).outcome == FAIL
