"""`rigup verify`: the seeds' verify.sh, verify-full.sh and verify-stress.sh checks, run from the
control machine against every rig of the fleet (or one API URL).

Suites:
  (default)  verify.sh: model listed, patch markers, completion, tool call
  --full     verify-full.sh (HEAD): + streaming, streaming tool call with thinking on, thinking,
             needle ladder 10K/30K/60K/90K (over-length = skipped), tool-response prefill,
             output quality (cascade detection), MTP acceptance length from the service log
  --stress   verify-stress.sh: small needles, tool prefill, IDE-agent one-shot, multi-turn agent,
             LCB-coding shape, reasoning-heavy, large needles, ceiling ladder (VRAM per rung)

Every check ends as pass, fail, skip or warn (the verdicts are rigup/checks/verify.py's); the exit
code is the number of failures (at most 125).
The service log (patch markers, SpecDecoding metrics) and GPU memory are read over SSH with the
fleet's settings (journalctl -u rigup-<variant>, nvidia-smi); a rig that cannot be reached over
SSH skips those parts and still gets every API check.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from rigup.checks.verify import (
    FAIL,
    PASS,
    SKIP,
    WARN,
    CheckResult,
    judge_ceiling_rung,
    judge_completion,
    judge_long_answer,
    judge_models,
    judge_mtp,
    judge_needle,
    judge_output_quality,
    judge_patches,
    judge_reasoning_heavy,
    judge_streaming,
    judge_streaming_tool_call,
    judge_thinking,
    judge_tool_call,
    judge_tool_prefill,
)
from rigup.cli.runner import add_target_arguments, progress, run_fleet_command, service_log
from rigup.client.openai_client import ApiClient
from rigup.client.ssh import LazySsh, RemoteError, ServiceLog, gpu_memory
from rigup.client.targets import Target, api_targets

MAX_EXIT = 125  # exit codes wrap at 256; 126+ mean "could not run" to shells

# --- prompts from the seeds (shared/reference/upstream-facts.md §3) ----------------------------
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. Paris"},
                "units": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "Temperature units"},
            },
            "required": ["city"],
        },
    },
}
WEATHER_PROMPT = "What is the weather like in Paris right now? Use the tool."
NEWS_TOOL = {
    "type": "function",
    "function": {
        "name": "fetch_news",
        "description": "Fetch the latest news articles on a topic.",
        "parameters": {
            "type": "object",
            "properties": {"topic": {"type": "string", "description": "Topic to search for"}},
            "required": ["topic"],
        },
    },
}
# One filler repeat is ~67 tokens, so the seeds' scales 150/450/900/1400 are ~10K/30K/60K/90K tokens.
NEEDLE_FILLER = (
    "The quarterly report covered routine matters: shipping schedules, warehouse inventory counts, staff "
    "rotations and the maintenance plan for the loading docks. Nothing in it was unusual, and every figure "
    "matched the previous quarter within the expected seasonal margins. "
)
NEEDLE_SCALES = {"10k": 150, "30k": 450, "60k": 900, "90k": 1400}
NEEDLE_SMALL, NEEDLE_LARGE = ("10k", "30k"), ("60k", "90k")
COLORS = ("red", "blue", "green", "amber", "violet", "silver", "orange", "teal", "crimson", "golden")
ANIMALS = ("tiger", "falcon", "otter", "badger", "heron", "lynx", "walrus", "gecko", "bison", "marten")
NEWS_FILLER = (
    "GPU makers announced new consumer cards this week, with reviewers noting higher memory bandwidth, "
    "lower idle power and improved drivers for machine-learning workloads. Analysts expect prices to "
    "settle after the launch window as supply catches up with demand from hobbyists and small labs. "
)
ESSAY_PROMPT = (
    "Write a 1500-word essay explaining how the attention mechanism in transformer models works, "
    "covering queries, keys and values, multi-head attention, and why it scales with context length."
)
# What the service log is grepped for: spec-decode metrics, and the runtime patches' markers.
SPEC_LINE = r"SpecDecoding|acceptance length|spec_decode"
PATCH_MARKERS = r"\[Genesis\]|apply_all elapsed|\[OK\] Qwen3 tool_call fix|\[FAILED\]"

IDE_TOOLS = [
    ("read_file", "Read a file of the workspace.", {"path": "string"}),
    ("write_file", "Write a whole file of the workspace.", {"path": "string", "content": "string"}),
    ("edit_file", "Replace a span of text in a file.", {"path": "string", "old": "string", "new": "string"}),
    ("list_directory", "List the entries of a directory.", {"path": "string"}),
    ("search_files", "Search the workspace for a regular expression.", {"pattern": "string"}),
    ("run_command", "Run a shell command in the workspace.", {"command": "string"}),
    ("git_status", "Show the working tree status.", {}),
    ("git_diff", "Show unstaged changes of a path.", {"path": "string"}),
    ("git_log", "Show recent commits.", {"count": "integer"}),
    ("git_commit", "Commit staged changes with a message.", {"message": "string"}),
]
IDE_RULES = (
    "You are an AI coding assistant working inside the user's IDE. Follow these rules. Read files before "
    "changing them. Keep edits minimal and focused on the request. Explain what you change and why. Never "
    "invent file contents or command output. Prefer the project's existing helpers over new code. Run the "
    "tests after a change when the project has them. Ask before deleting files. Keep secrets out of code. "
)
MOCK_FILE = '''import json


def parse_config(text):
    data = json.loads(text)
    if "name" not in data:
        raise ValueError("name missing")
    return data


def parse_config_file(path):
    with open(path) as handle:
        data = json.loads(handle.read())
    if "name" not in data:
        raise ValueError("name missing")
    return data
'''
LCB_PROMPT = (
    "Given an integer array nums and an integer k, return the total number of contiguous subarrays whose "
    "sum equals k.\nConstraints: 1 <= nums.length <= 2 * 10^4, -1000 <= nums[i] <= 1000, "
    "-10^7 <= k <= 10^7.\nExample: nums = [1,1,1], k = 2 -> 2.\nWrite a Python 3 solution as "
    "class Solution with method subarraySum(self, nums: List[int], k: int) -> int, then explain its complexity."
)
REASONING_PROMPT = (
    "How many positive integers n below 1000 make n^2 + 1 divisible by 13 while the sum of the decimal "
    "digits of n is a prime number? Reason carefully step by step, check your work, then give the count."
)


@dataclass
class VerifyOptions:
    suite: str = "basic"  # basic | full | stress
    skip: frozenset[str] = frozenset()
    timeout_s: float = 120.0  # short checks
    long_timeout_s: float = 900.0  # long-context and long-generation checks (VERIFY_LONG_TIMEOUT)
    prefill_chars: int = 100_000  # PREFILL_TARGET_CHARS
    mtp_min: float = 2.0  # MTP_ACCEPT_MIN
    mtp_wait_s: float = 15.0  # vLLM logs spec-decode metrics every ~10 s
    ceiling_start: int = 95_000  # CEILING_START_TOKENS
    ceiling_step: int = 30_000  # CEILING_STEP_TOKENS
    ceiling_fraction: float = 0.92  # CEILING_FRACTION of max_model_len
    vram_margin_mib: int = 1024  # VRAM_MARGIN_MB
    seed: int | None = None  # needle secrets; None: random


@dataclass
class Context:
    client: ApiClient
    model: str
    max_model_len: int | None
    log: ServiceLog | None  # None: no way to read the service log
    gpus: Callable[[], list[tuple[int, int]]] | None  # (used, total) MiB per GPU; raises RemoteError
    options: VerifyOptions
    rng: random.Random
    expects_patches: bool | None = None  # recipe.genesis; None: unknown (bare URL)
    speculative: str | None | bool = True  # recipe.speculative_method; True: unknown (bare URL)
    say: Callable[[str], None] = lambda line: None
    # recipe.chat_request: fields every chat request to this server must carry (vLLM-Omni's modalities);
    # empty for a bare URL
    chat_request: Mapping[str, Any] = field(default_factory=dict)

    def payload(self, messages: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
        return {**self.chat_request, "model": self.model, "messages": messages, **fields}


# --------------------------------------------------------------------------------------------
# the requests' parts


def needle_prompt(scale: int, secret: str) -> str:
    """Filler with the secret at 50% depth, then the question."""
    half = scale // 2
    return (
        NEEDLE_FILLER * half
        + f"\nThe secret passphrase is: {secret}.\n"
        + NEEDLE_FILLER * (scale - half)
        + "\n\nWhat is the secret passphrase? Answer with the passphrase only."
    )


def tool_schemas(specs: list[tuple[str, str, dict[str, str]]]) -> list[dict[str, Any]]:
    return [
        {
            "type": "function",
            "function": {
                "name": name,
                "description": description,
                "parameters": {
                    "type": "object",
                    "properties": {key: {"type": kind} for key, kind in params.items()},
                    "required": list(params),
                },
            },
        }
        for name, description, params in specs
    ]


def no_thinking() -> dict[str, Any]:
    return {"chat_template_kwargs": {"enable_thinking": False}}


def thinking() -> dict[str, Any]:
    return {"chat_template_kwargs": {"enable_thinking": True}}


# --------------------------------------------------------------------------------------------
# checks: each sends its request or reads the log, and returns the verdict of rigup.checks.verify
# (a ladder returns several)


def check_models(ctx: Context) -> CheckResult:
    verdict = judge_models(ctx.client.models(timeout=5.0), ctx.model)
    served_len = verdict.data.get("max_model_len")
    if served_len is not None:
        ctx.max_model_len = served_len  # what the server enforces beats what the recipe says
    elif verdict.outcome == PASS:
        # A gateway's /v1/models (LiteLLM's) lists the model without vLLM's max_model_len: say where the
        # length the long checks use comes from instead of printing "max_model_len None".
        used = (f"the recipe's {ctx.max_model_len} is used" if ctx.max_model_len is not None
                else "the context-ceiling ladder is skipped")
        verdict = replace(verdict, detail=f"{ctx.model} (/v1/models states no max_model_len; {used})")
    return verdict


def check_patches(ctx: Context) -> CheckResult:
    if ctx.expects_patches is False:
        return CheckResult("patches", SKIP, "the variant applies no runtime patches")
    if ctx.log is None:
        return CheckResult("patches", SKIP, "no access to the service log")
    try:
        lines = ctx.log.grep(PATCH_MARKERS, 200)
    except RemoteError as exc:
        return CheckResult("patches", SKIP, f"service log unreadable: {exc}")
    return judge_patches(lines)


def check_completion(ctx: Context) -> CheckResult:
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    result = ctx.client.chat(ctx.payload(messages, max_tokens=30, temperature=0.6, **no_thinking()), ctx.options.timeout_s)
    return judge_completion(result)


def check_tool_call(ctx: Context) -> CheckResult:
    messages = [{"role": "user", "content": WEATHER_PROMPT}]
    payload = ctx.payload(
        messages, tools=[WEATHER_TOOL], tool_choice="auto", max_tokens=200, temperature=0.3, **no_thinking()
    )
    return judge_tool_call(ctx.client.chat(payload, ctx.options.timeout_s), "get_weather")


def check_streaming(ctx: Context) -> CheckResult:
    messages = [{"role": "user", "content": "Write a haiku about graphics cards."}]
    payload = ctx.payload(messages, max_tokens=120, **no_thinking())
    return judge_streaming(ctx.client.stream_chat(payload, ctx.options.timeout_s))


def check_streaming_tool_call(ctx: Context) -> CheckResult:
    messages = [{"role": "user", "content": WEATHER_PROMPT}]
    payload = ctx.payload(messages, tools=[WEATHER_TOOL], tool_choice="auto", max_tokens=2000, temperature=0.3, **thinking())
    return judge_streaming_tool_call(ctx.client.stream_chat(payload, ctx.options.timeout_s), "get_weather")


def check_thinking(ctx: Context) -> CheckResult:
    messages = [{"role": "user", "content": "What is 2+2?"}]
    result = ctx.client.chat(ctx.payload(messages, max_tokens=4000, temperature=0.3, **thinking()), ctx.options.long_timeout_s)
    return judge_thinking(result)


def check_needle(ctx: Context, rung: str) -> CheckResult:
    secret = f"{ctx.rng.choice(COLORS)} {ctx.rng.choice(ANIMALS)} {ctx.rng.randint(10, 99)}"
    messages = [{"role": "user", "content": needle_prompt(NEEDLE_SCALES[rung], secret)}]
    result = ctx.client.chat(ctx.payload(messages, max_tokens=30, temperature=0, **no_thinking()), ctx.options.long_timeout_s)
    return judge_needle(f"needle-{rung}", secret, result, ctx.max_model_len)


def tool_call_turn(call_id: str, function: str, arguments: dict[str, Any], output: str) -> list[dict[str, Any]]:
    """The assistant's tool call and the tool's answer, as two chat messages."""
    call = {"id": call_id, "type": "function", "function": {"name": function, "arguments": json.dumps(arguments)}}
    return [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": output},
    ]


def check_tool_prefill(ctx: Context) -> CheckResult:
    filler = (NEWS_FILLER * (ctx.options.prefill_chars // len(NEWS_FILLER) + 1))[: ctx.options.prefill_chars]
    messages = [
        {"role": "user", "content": "What is new with graphics cards? Fetch the news."},
        *tool_call_turn("call_news_1", "fetch_news", {"topic": "graphics cards"}, filler),
        {"role": "user", "content": "Summarize the news above in three sentences."},
    ]
    payload = ctx.payload(messages, tools=[NEWS_TOOL], tool_choice="auto", max_tokens=500, **no_thinking())
    return judge_tool_prefill(ctx.client.chat(payload, ctx.options.long_timeout_s))


def check_output_quality(ctx: Context) -> CheckResult:
    messages = [{"role": "user", "content": ESSAY_PROMPT}]
    result = ctx.client.chat(ctx.payload(messages, max_tokens=2000, temperature=0.6, **no_thinking()), ctx.options.long_timeout_s)
    return judge_output_quality(result)


def check_mtp(ctx: Context) -> CheckResult:
    if ctx.speculative is None:
        return CheckResult("mtp", SKIP, "the variant runs no speculative decoding")
    if ctx.log is None:
        return CheckResult("mtp", SKIP, "no access to the service log")
    try:
        before = ctx.log.grep(SPEC_LINE, 1)
    except RemoteError as exc:
        return CheckResult("mtp", SKIP, f"service log unreadable: {exc}")
    messages = [{"role": "user", "content": "Count from 1 to 80, separated by commas."}]
    result = ctx.client.chat(ctx.payload(messages, max_tokens=500, temperature=0, **no_thinking()), ctx.options.timeout_s)
    if not result.ok:
        return CheckResult("mtp", FAIL, result.describe_failure())
    # vLLM logs the metrics every few seconds: wait for a line newer than the one seen before.
    deadline = time.monotonic() + ctx.options.mtp_wait_s
    lines: list[str] = []
    while True:
        try:
            lines = ctx.log.grep(SPEC_LINE, 5)
        except RemoteError as exc:
            return CheckResult("mtp", SKIP, f"service log unreadable: {exc}")
        if lines and lines[-1:] != before:
            break
        if time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    return judge_mtp(lines, ctx.options.mtp_min)


def check_ide_agent(ctx: Context) -> CheckResult:
    system = (IDE_RULES * (5000 // len(IDE_RULES) + 1))[:5000]
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": "Explain how this repository's build works and what you would check first."},
    ]
    payload = ctx.payload(messages, tools=tool_schemas(IDE_TOOLS), tool_choice="none", max_tokens=2000, temperature=0)
    return judge_long_answer("ide-agent", ctx.client.chat(payload, ctx.options.long_timeout_s), "Cliff 1 mech B")


def check_multi_turn_agent(ctx: Context) -> CheckResult:
    messages = [
        {"role": "system", "content": IDE_RULES},
        {"role": "user", "content": "Refactor utils.py: the two parse functions duplicate each other."},
        *tool_call_turn("call_read_1", "read_file", {"path": "utils.py"}, MOCK_FILE),
        {"role": "user", "content": "Now refactor it so parse_config_file reuses parse_config; show the new file."},
    ]
    payload = ctx.payload(messages, tools=tool_schemas(IDE_TOOLS), tool_choice="auto", max_tokens=1500, temperature=0.6)
    result = ctx.client.chat(payload, ctx.options.long_timeout_s)
    return judge_long_answer("multi-turn-agent", result, "multi-turn tool flow")


def check_lcb_coding(ctx: Context) -> CheckResult:
    messages = [{"role": "user", "content": LCB_PROMPT}]
    payload = ctx.payload(messages, max_tokens=4096, temperature=0)
    return judge_long_answer("lcb-coding", ctx.client.chat(payload, ctx.options.long_timeout_s), "long code generation")


def check_reasoning_heavy(ctx: Context) -> CheckResult:
    messages = [{"role": "user", "content": REASONING_PROMPT}]
    payload = ctx.payload(messages, max_tokens=8192, temperature=0, **thinking())
    return judge_reasoning_heavy(ctx.client.chat(payload, max(600.0, ctx.options.long_timeout_s)))


def ceiling_rungs(max_model_len: int, start: int, step: int, fraction: float) -> list[int]:
    """Prompt sizes (tokens) of the ceiling ladder: start, start+step, ... up to fraction*n_ctx."""
    top = int(max_model_len * fraction)
    return list(range(start, top + 1, step)) if step > 0 else []


def check_ceiling(ctx: Context) -> list[CheckResult]:
    if ctx.max_model_len is None:
        return [CheckResult("ceiling", SKIP, "max_model_len unknown")]
    o = ctx.options
    rungs = ceiling_rungs(ctx.max_model_len, o.ceiling_start, o.ceiling_step, o.ceiling_fraction)
    if not rungs:
        return [CheckResult("ceiling", SKIP, f"max_model_len {ctx.max_model_len} is below the ladder's start {o.ceiling_start}")]
    results = []
    tokens_per_repeat = len(NEEDLE_FILLER) / 4
    for tokens in rungs:
        name = f"ceiling-{tokens // 1000}k"
        ctx.say(f"{name} ...")
        vram_before = _vram(ctx)
        secret = f"{ctx.rng.choice(COLORS)} {ctx.rng.choice(ANIMALS)} {ctx.rng.randint(10, 99)}"
        started = time.monotonic()
        messages = [{"role": "user", "content": needle_prompt(int(tokens / tokens_per_repeat), secret)}]
        result = ctx.client.chat(ctx.payload(messages, max_tokens=30, temperature=0, **no_thinking()), o.long_timeout_s)
        vram_after = _vram(ctx)
        data: dict[str, Any] = {"target_tokens": tokens, "vram_before_mib": vram_before, "vram_after_mib": vram_after}
        verdict = judge_ceiling_rung(name, secret, result, time.monotonic() - started, data, o.vram_margin_mib)
        results.append(verdict)
        if verdict.outcome in (SKIP, FAIL):
            break  # the seeds stop at the first failing rung: the next is bigger still
    return results


def _vram(ctx: Context) -> list[tuple[int, int]] | None:
    if ctx.gpus is None:
        return None
    try:
        return ctx.gpus()
    except RemoteError:
        return None


# --------------------------------------------------------------------------------------------
# suites


Step = tuple[str, Callable[[Context], CheckResult | list[CheckResult]]]


def _needles(rungs: tuple[str, ...]) -> list[Step]:
    return [(f"needle-{rung}", lambda ctx, rung=rung: check_needle(ctx, rung)) for rung in rungs]


def suite_steps(suite: str) -> list[Step]:
    basic: list[Step] = [
        ("models", check_models),
        ("patches", check_patches),
        ("completion", check_completion),
        ("tool-call", check_tool_call),
    ]
    if suite == "basic":
        return basic
    if suite == "full":
        return [
            *basic,
            ("streaming", check_streaming),
            ("streaming-tool-call", check_streaming_tool_call),
            ("thinking", check_thinking),
            *_needles(NEEDLE_SMALL + NEEDLE_LARGE),
            ("tool-prefill", check_tool_prefill),
            ("output-quality", check_output_quality),
            ("mtp", check_mtp),
        ]
    if suite == "stress":
        return [
            ("models", check_models),
            *_needles(NEEDLE_SMALL),
            ("tool-prefill", check_tool_prefill),
            ("ide-agent", check_ide_agent),
            ("multi-turn-agent", check_multi_turn_agent),
            ("lcb-coding", check_lcb_coding),
            ("reasoning-heavy", check_reasoning_heavy),
            *_needles(NEEDLE_LARGE),  # last but one: the large rungs can crash a single 24 GB card
            ("ceiling", check_ceiling),
        ]
    raise ValueError(f"unknown suite {suite!r}")


# --skip names: a check's name, its family ("needle" for every rung), or a seed's SKIP_* name.
SKIP_ALIASES = {
    "tools": ("tool-call", "streaming-tool-call"),
    "longctx": ("needle",),
    "tool_prefill": ("tool-prefill",),
}


def skipped(name: str, skip: frozenset[str]) -> bool:
    names = set(skip)
    for alias in skip & SKIP_ALIASES.keys():
        names.update(SKIP_ALIASES[alias])
    return name in names or re.sub(r"-\d+k$", "", name) in names


# Checks that take long enough to announce before they start.
SLOW_CHECKS = frozenset(
    {"thinking", "tool-prefill", "output-quality", "mtp", "ide-agent", "multi-turn-agent", "lcb-coding", "reasoning-heavy"}
)


def run_checks(ctx: Context, on_result: Callable[[CheckResult], None] | None = None) -> list[CheckResult]:
    """Run the context's suite; every check runs (the count of failures is the verdict), except
    that nothing runs past a server that does not answer /v1/models."""
    results: list[CheckResult] = []
    for name, step in suite_steps(ctx.options.suite):
        if skipped(name, ctx.options.skip):
            produced: list[CheckResult] = [CheckResult(name, SKIP, "skipped (--skip)")]
        elif results and results[0].check == "models" and results[0].outcome == FAIL:
            produced = [CheckResult(name, SKIP, "the API did not answer /v1/models")]
        else:
            if name in SLOW_CHECKS or name.startswith("needle-"):
                ctx.say(f"{name} ...")
            started = time.monotonic()
            try:
                outcome = step(ctx)
            except Exception as exc:  # a check's own bug must not hide the other checks' results
                outcome = CheckResult(name, FAIL, f"check crashed: {type(exc).__name__}: {exc}")
            produced = outcome if isinstance(outcome, list) else [outcome]
            if not isinstance(outcome, list):
                outcome.seconds = time.monotonic() - started
        for result in produced:
            results.append(result)
            if on_result is not None:
                on_result(result)
    return results


# --------------------------------------------------------------------------------------------
# per host


@dataclass
class HostReport:
    host: str
    url: str | None
    variant: str | None
    model: str | None
    results: list[CheckResult]

    @property
    def failed(self) -> int:
        return sum(1 for r in self.results if r.outcome == FAIL)


def verify_target(
    target: Target, options: VerifyOptions, log_file: str | None = None, model: str | None = None, quiet: bool = False
) -> HostReport:
    def say(line: str) -> None:
        if not quiet:
            progress(f"[{target.name}] {line}")

    if target.error is not None or target.api_url is None:
        return HostReport(target.name, target.api_url, target.variant, target.served_model,
                          [CheckResult("setup", FAIL, target.error or "no API URL")])
    if target.cluster_head is not None:
        return HostReport(target.name, target.api_url, target.variant, target.served_model,
                          [CheckResult("cluster", SKIP, f"a worker of its cluster: verified as {target.cluster_head}, "
                                                        "which serves it")])
    client = ApiClient(target.api_url, target.api_key, target.ca_file)
    if target.api_url.startswith("https://"):  # a certificate not trusted is one line, not every check failing
        listed = client.models(timeout=10.0)
        if listed.status == 0 and (listed.error or "").startswith("TLS refused"):
            client.close()
            return HostReport(target.name, target.api_url, target.variant, target.served_model,
                              [CheckResult("tls", FAIL, f"{listed.error} ({target.api_url})")])
    ssh = LazySsh(target.ssh)
    try:
        log = service_log(target, ssh, log_file)
        gpus = (lambda: gpu_memory(ssh)) if target.ssh is not None else None
        served = model or target.served_model
        if served is None:
            listed = client.models(timeout=5.0)
            served = next(iter(listed.models), None) if listed.ok else None
        ctx = Context(
            client=client,
            model=served or "",
            max_model_len=target.recipe.max_model_len if target.recipe is not None else None,
            log=log,
            gpus=gpus,
            options=options,
            rng=random.Random(options.seed),
            expects_patches=target.recipe.genesis if target.recipe is not None else None,
            speculative=target.recipe.speculative_method if target.recipe is not None else True,
            say=say,
            chat_request=dict(target.recipe.chat_request) if target.recipe is not None else {},
        )

        def on_result(result: CheckResult) -> None:
            say(f"{result.check:<20} {result.outcome.upper():<5} {result.seconds:6.1f}s  {result.detail}")

        say(f"verify {options.suite} against {target.api_url} (model {served})")
        results = run_checks(ctx, on_result)
    finally:
        ssh.close()
        client.close()
    return HostReport(target.name, target.api_url, target.variant, served, results)


def render_table(reports: list[HostReport]) -> str:
    lines = []
    for report in reports:
        counts = {o: sum(1 for r in report.results if r.outcome == o) for o in (PASS, FAIL, WARN, SKIP)}
        where = report.host if report.url == report.host else f"{report.host}  variant {report.variant or '-'}  {report.url or '-'}"
        lines.append(
            f"{where}  model {report.model or '-'}  "
            f"({counts[PASS]} passed, {counts[FAIL]} failed, {counts[WARN]} warned, {counts[SKIP]} skipped)"
        )
        width = max([len(r.check) for r in report.results] + [5])
        lines.append(f"  {'CHECK':<{width}}  RESULT  TIME     DETAIL")
        for r in report.results:
            lines.append(f"  {r.check:<{width}}  {r.outcome.upper():<6}  {r.seconds:6.1f}s  {r.detail}")
        lines.append("")
    total = sum(r.failed for r in reports)
    lines.append(f"{total} check(s) failed on {sum(1 for r in reports if r.failed)} of {len(reports)} host(s)")
    return "\n".join(lines)


def reports_json(reports: list[HostReport]) -> dict[str, Any]:
    return {
        "failed": sum(r.failed for r in reports),
        "hosts": [
            {
                "host": r.host,
                "url": r.url,
                "variant": r.variant,
                "model": r.model,
                "failed": r.failed,
                "results": [asdict(result) for result in r.results],
            }
            for r in reports
        ],
    }


# --------------------------------------------------------------------------------------------
# CLI


def cmd_verify(args: argparse.Namespace) -> int:
    suite = "full" if args.full else "stress" if args.stress else "basic"
    options = VerifyOptions(
        suite=suite,
        skip=frozenset(s.strip() for item in args.skip for s in item.split(",") if s.strip()),
        timeout_s=args.timeout,
        long_timeout_s=args.long_timeout,
        prefill_chars=args.prefill_chars,
        mtp_min=args.mtp_min,
        seed=args.seed,
    )
    code, _ = run_fleet_command(
        "verify",
        lambda: api_targets(args.url, args.api_key_file, args.limit, args.ca_file),
        lambda t: verify_target(t, options, args.log_file, args.model, quiet=args.quiet or args.json),
        as_json=args.json,
        document=reports_json,
        table=render_table,
        exit_code=lambda reports: min(MAX_EXIT, sum(r.failed for r in reports)),
    )
    return code


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "verify",
        help="check every rig's API like the seeds' verify scripts, counting the checks that fail",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--full", action="store_true", help="verify-full.sh's checks")
    which.add_argument("--stress", action="store_true", help="verify-stress.sh's probes")
    add_target_arguments(
        parser,
        url_help="check this API base URL instead of the fleet (e.g. http://127.0.0.1:8010)",
        json_help="print JSON instead of the table (no progress)",
    )
    parser.add_argument("--model", help="served model name (default: the recipe's, or the first /v1/models lists)")
    parser.add_argument("--log-file", help="read the service log from this local file instead of journalctl over SSH")
    parser.add_argument(
        "--skip", action="append", default=[], metavar="CHECK",
        help="skip checks by name or family (needle, ceiling) or seed name (tools, longctx, tool_prefill); repeatable",
    )
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds for short checks (default 120)")
    parser.add_argument("--long-timeout", type=float, default=900.0, help="seconds for long checks (default 900)")
    parser.add_argument("--prefill-chars", type=int, default=100_000, help="tool-response size (default 100000)")
    parser.add_argument("--mtp-min", type=float, default=2.0, help="minimum mean acceptance length (default 2.0)")
    parser.add_argument("--seed", type=int, help="seed for the needle secrets (default random)")
    parser.set_defaults(func=cmd_verify)
    return parser
