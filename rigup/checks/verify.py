"""What a serving rig's answers mean: the verdicts of `rigup verify`'s checks (the seeds' verify.sh,
verify-full.sh and verify-stress.sh), pure functions of the API's replies and the service log's lines.
rigup/cli/verify.py sends the prompts, reads the log and the GPU memory, and prints these verdicts."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from rigup.client.openai_client import ChatResult, ModelsResult, StreamResult

PASS, FAIL, SKIP, WARN = "pass", "fail", "skip", "warn"

# --- thresholds from the seeds (shared/reference/upstream-facts.md §3) ----------------------------
QUALITY_WORDS = 200
QUALITY_MIN_VARIETY = 0.30
QUALITY_MAX_REPEATS = 5
REASONING_MIN_TOKENS = 500
ACCEPTANCE = re.compile(r"mean[ _]acceptance[ _]length[\"']?\s*[:=]\s*([0-9]+(?:\.[0-9]+)?)", re.IGNORECASE)
PATCH_FAILED = re.compile(r"\[Genesis\] FAILED|\[FAILED\]")
PATCH_APPLIED = re.compile(r"\[OK\] Qwen3 tool_call fix|\[Genesis\] applied:|apply_all elapsed")


@dataclass
class CheckResult:
    check: str
    outcome: str  # pass | fail | skip | warn
    detail: str
    seconds: float = 0.0
    data: dict[str, Any] = field(default_factory=dict)


def quality_problems(text: str) -> list[str]:
    """What is wrong with a long answer: tool markup, a line stuck on repeat, a tiny vocabulary."""
    if not text.strip():
        return ["no content"]
    problems = []
    if "<tool_call>" in text:
        problems.append("<tool_call> markup in the content")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    longest, line_at = 0, ""
    run = 0
    for i, line in enumerate(lines):
        run = run + 1 if i and line == lines[i - 1] else 1
        if run > longest:
            longest, line_at = run, line
    if longest >= QUALITY_MAX_REPEATS:
        problems.append(f"the line {line_at[:60]!r} repeats {longest} times in a row")
    words = [w.strip(".,;:!?\"'()[]").lower() for w in text.split()[:QUALITY_WORDS]]
    words = [w for w in words if w]
    if words:
        variety = len(set(words)) / len(words)
        if variety < QUALITY_MIN_VARIETY:
            problems.append(f"lexical variety {variety:.2f} < {QUALITY_MIN_VARIETY} over the first {len(words)} words")
    return problems


def acceptance_length(lines: list[str]) -> float | None:
    """Mean acceptance length from the last SpecDecoding metrics line that states one."""
    for line in reversed(lines):
        match = ACCEPTANCE.search(line)
        if match:
            return float(match.group(1))
    return None


def needle_found(secret: str, reply: str) -> bool:
    reply = reply.lower()
    return all(part.lower() in reply for part in secret.split())


def tool_call_verdict(result: ChatResult, name: str) -> tuple[str, str]:
    """(outcome, detail) for a response that should call tool `name`."""
    for call in result.tool_calls:
        if call.name == name:
            if call.parsed_arguments() is None:
                return FAIL, f"{name} called with arguments that are not a JSON object: {call.arguments[:80]!r}"
            return PASS, f"{name}({call.arguments[:80]})"
    if "<tool_call>" in result.content:
        return FAIL, "tool call inlined in content as <tool_call> text (tool-call parser not applied)"
    if result.tool_calls:
        return FAIL, f"called {', '.join(c.name for c in result.tool_calls)}, not {name}"
    return FAIL, f"no tool call (finish_reason {result.finish_reason}; content {result.content[:60]!r})"


def long_failure(result: ChatResult) -> str:
    """Why a long-context or long-generation request failed, with the likely cause."""
    if result.status == 500:
        return f"HTTP 500 (out of memory on a long prompt?): {result.error}"[:200]
    if result.status == 0:
        return f"no response: timeout or server crash ({result.error})"
    return result.describe_failure()[:200]


# --------------------------------------------------------------------------------------------
# verdicts: one per check, from what the check's request brought back


def judge_models(result: ModelsResult, model: str) -> CheckResult:
    """`model` is served; data["max_model_len"]: the context length the server enforces (None: unstated)."""
    if not result.ok:
        return CheckResult("models", FAIL, f"GET /v1/models: {result.describe_failure()}")
    if model not in result.models:
        return CheckResult("models", FAIL, f"{model!r} not served; /v1/models lists {sorted(result.models)}")
    served_len = result.max_model_len(model)
    return CheckResult("models", PASS, f"{model} (max_model_len {served_len})", data={"max_model_len": served_len})


def judge_patches(lines: list[str]) -> CheckResult:
    """The runtime patches' markers in the service log since the unit started."""
    failed = [line for line in lines if PATCH_FAILED.search(line)]
    if failed:
        return CheckResult("patches", FAIL, f"patch failure in the log: {failed[-1].strip()[:120]}")
    applied = [line for line in lines if PATCH_APPLIED.search(line)]
    if applied:
        return CheckResult("patches", PASS, applied[-1].strip()[:120])
    return CheckResult("patches", WARN, "no patch markers in the service log since the unit started")


def judge_completion(result: ChatResult) -> CheckResult:
    """The answer to "What is the capital of France?" names Paris."""
    if not result.ok:
        return CheckResult("completion", FAIL, result.describe_failure())
    if "paris" not in result.content.lower():
        return CheckResult("completion", FAIL, f"answer lacks 'Paris': {result.content[:80]!r}")
    return CheckResult("completion", PASS, result.content.strip()[:80])


def judge_tool_call(result: ChatResult, tool: str) -> CheckResult:
    if not result.ok:
        return CheckResult("tool-call", FAIL, result.describe_failure())
    outcome, detail = tool_call_verdict(result, tool)
    return CheckResult("tool-call", outcome, detail)


def judge_streaming(result: StreamResult) -> CheckResult:
    if not result.ok:
        return CheckResult("streaming", FAIL, result.describe_failure())
    detail = f"{result.content_chunks} content chunks, {len(result.content)} chars"
    if result.content_chunks < 5 or len(result.content) < 20:
        return CheckResult("streaming", FAIL, f"{detail} (need >= 5 chunks and >= 20 chars)")
    return CheckResult("streaming", PASS, detail, data={"ttft_s": result.ttft})


def judge_streaming_tool_call(result: StreamResult, tool: str) -> CheckResult:
    if not result.ok:
        return CheckResult("streaming-tool-call", FAIL, result.describe_failure())
    outcome, detail = tool_call_verdict(result, tool)
    return CheckResult("streaming-tool-call", outcome, f"{detail}; {len(result.reasoning)} reasoning chars")


def judge_thinking(result: ChatResult) -> CheckResult:
    if not result.ok:
        return CheckResult("thinking", FAIL, result.describe_failure())
    detail = f"{len(result.reasoning)} reasoning chars, content {result.content.strip()[:40]!r}"
    if len(result.reasoning) < 50:
        return CheckResult("thinking", FAIL, f"{detail}: reasoning missing or under 50 chars (reasoning parser off?)")
    if not result.content.strip() and result.finish_reason != "length":
        return CheckResult("thinking", FAIL, f"{detail}: no answer after the reasoning")
    return CheckResult("thinking", PASS, detail)


def judge_needle(name: str, secret: str, result: ChatResult, max_model_len: int | None) -> CheckResult:
    """The reply to a needle prompt recalls `secret`; a prompt over max_model_len (HTTP 400) is skipped."""
    if result.status == 400:
        return CheckResult(name, SKIP, f"over max_model_len ({max_model_len}): {result.error}"[:160])
    if not result.ok:
        return CheckResult(name, FAIL, long_failure(result))
    usage = result.usage or {}
    data = {"prompt_tokens": usage.get("prompt_tokens"), "seconds": round(result.elapsed, 2)}
    if not needle_found(secret, result.content):
        return CheckResult(name, FAIL, f"secret {secret!r} not in reply {result.content.strip()[:60]!r}", data=data)
    return CheckResult(name, PASS, f"found {secret!r} in {usage.get('prompt_tokens')} prompt tokens", data=data)


def judge_tool_prefill(result: ChatResult) -> CheckResult:
    """A long tool response was read and answered (a summary of 50+ characters or another tool call)."""
    if result.status == 400:
        return CheckResult("tool-prefill", SKIP, f"over max_model_len: {result.error}"[:160])
    if not result.ok:
        return CheckResult("tool-prefill", FAIL, long_failure(result))
    if len(result.content.strip()) >= 50 or result.tool_calls:
        prompt = (result.usage or {}).get("prompt_tokens")
        return CheckResult("tool-prefill", PASS, f"{prompt} prompt tokens answered in {result.elapsed:.1f} s")
    return CheckResult("tool-prefill", FAIL, f"answer too short: {result.content.strip()[:60]!r}")


def judge_output_quality(result: ChatResult) -> CheckResult:
    if not result.ok:
        return CheckResult("output-quality", FAIL, result.describe_failure())
    problems = quality_problems(result.content)
    if problems:
        return CheckResult("output-quality", FAIL, "; ".join(problems))
    return CheckResult("output-quality", PASS, f"{len(result.content.split())} words, no repetition")


def judge_mtp(lines: list[str], mtp_min: float) -> CheckResult:
    """The mean acceptance length of speculative decoding, from the service log's metrics lines."""
    value = acceptance_length(lines)
    if value is None:
        return CheckResult("mtp", SKIP, "no SpecDecoding metrics with a mean acceptance length in the log")
    data = {"acceptance_length": value, "line": lines[-1].strip()[:300]}
    if value < mtp_min:
        return CheckResult("mtp", FAIL, f"mean acceptance length {value:.2f} < {mtp_min}", data=data)
    return CheckResult("mtp", PASS, f"mean acceptance length {value:.2f} >= {mtp_min}", data=data)


def judge_long_answer(name: str, result: ChatResult, what: str) -> CheckResult:
    """A long request (`what`) answered with HTTP 200; one over max_model_len (HTTP 400) is skipped."""
    if result.status == 400:
        return CheckResult(name, SKIP, f"over max_model_len: {result.error}"[:160])
    if result.ok:
        tokens = result.completion_tokens
        return CheckResult(name, PASS, f"HTTP 200, {tokens} completion tokens in {result.elapsed:.1f} s")
    if result.status == 500:
        return CheckResult(name, FAIL, f"HTTP 500 ({what}): {result.error}"[:200])
    return CheckResult(name, FAIL, long_failure(result))


def judge_reasoning_heavy(result: ChatResult) -> CheckResult:
    if not result.ok:
        return CheckResult("reasoning-heavy", FAIL, long_failure(result))
    tokens = result.completion_tokens
    if tokens is None or tokens < REASONING_MIN_TOKENS:
        return CheckResult("reasoning-heavy", FAIL, f"only {tokens} completion tokens (< {REASONING_MIN_TOKENS})")
    return CheckResult("reasoning-heavy", PASS, f"{tokens} completion tokens in {result.elapsed:.1f} s")


def judge_ceiling_rung(
    name: str, secret: str, result: ChatResult, seconds: float, data: dict[str, Any], vram_margin_mib: int
) -> CheckResult:
    """One rung of the ceiling ladder: `secret` recalled, and at least vram_margin_mib left on the
    fullest GPU. `data`: the rung's record (target_tokens, vram_before_mib, vram_after_mib: (used,
    total) MiB per GPU, None when unread), returned with what the verdict adds."""
    data = dict(data)
    if result.status == 400:
        return CheckResult(name, SKIP, f"over max_model_len: {result.error}"[:160], seconds, data)
    if not result.ok:
        return CheckResult(name, FAIL, long_failure(result), seconds, data)
    if not needle_found(secret, result.content):
        return CheckResult(name, FAIL, f"secret {secret!r} not recalled", seconds, data)
    data["prompt_tokens"] = (result.usage or {}).get("prompt_tokens")
    outcome, detail = PASS, f"recalled at {data['prompt_tokens']} prompt tokens"
    vram_after = data.get("vram_after_mib")
    if vram_after:
        free = min(total - used for used, total in vram_after)
        data["min_free_mib"] = free
        detail += f", {free} MiB free on the fullest GPU"
        if free < vram_margin_mib:
            outcome, detail = WARN, detail + f" (< {vram_margin_mib} MiB margin)"
    return CheckResult(name, outcome, detail, seconds, data)
