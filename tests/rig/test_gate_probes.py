"""The health gate's probes (rigup/rig/servingctl.py, issue 43): each probe's judge and each of club-3090's
degenerate-output rules (scripts/verify-full.sh@4a29ab57, check_output_quality), pass and fail."""

from __future__ import annotations

import json
from typing import Any

import pytest

from rigup.rig import servingctl as ctl

GARBAGE_922 = "!" * 60  # club-3090 #922: 60 of 60 tokens, finish_reason=length


def completion(text: str = "", calls: list[dict[str, Any]] | None = None, finish: str = "stop",
               tokens: int = 5) -> dict[str, Any]:
    return {"full_text": text, "tool_calls": calls or [], "finish_reason": finish, "completion_tokens": tokens}


def call(name: str, arguments: Any) -> dict[str, Any]:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": "chatcmpl-tool-1", "type": "function", "function": {"name": name, "arguments": text}}


# --------------------------------------------------------------------------------------------
# club-3090's degenerate-output rules


def test_an_empty_completion_is_degenerate():
    assert ctl.degenerate("") == "empty completion"
    assert ctl.degenerate(" \n\n ") == "empty completion"


def test_a_line_repeated_five_times_in_a_row_is_degenerate_four_is_not():
    line = "The attention layer repeats the attention layer."
    five = "Intro sentence here.\n" + "\n".join([line] * 5) + "\nThe end of it all."
    four = "Intro sentence here.\n" + "\n".join([line] * 4) + "\nThe end of it all."
    assert ctl.degenerate(five) == "a line repeats 5 times in a row (verify-full fails >= 5)"
    assert ctl.degenerate(four) is None
    # verify-full counts runs of the same stripped line, blank lines skipped; not repeats far apart
    assert ctl.degenerate("\n\n".join([f"  {line}  "] * 5)).startswith("a line repeats 5 times")
    apart = "\n".join(f"{line}\nAnother different sentence number {n}." for n in range(6))
    assert ctl._line_repeats(apart) == 0


def test_low_lexical_variety_over_the_first_200_words_is_degenerate():
    assert ctl.degenerate("the " * 40) == ("lexical variety 0.03 over the first 200 words (verify-full fails < 0.30)")
    # 3 distinct words in 10 is 0.30, which passes; in 11 it is 0.27, which fails
    assert ctl.degenerate("red red red red red red red red blue green") is None
    assert ctl.degenerate("red red red red red red red red red blue green") == (
        "lexical variety 0.27 over the first 200 words (verify-full fails < 0.30)"
    )
    # only the first 200 words count: varied text after 200 repeated words does not rescue it
    repeated_then_varied = "same " * 200 + " ".join(f"word{chr(97 + i % 26)}{chr(97 + i // 26)}" for i in range(300))
    assert ctl._lexical_variety(repeated_then_varied) == pytest.approx(1 / 200)


def test_punctuation_spam_has_no_words_and_variety_zero_as_verify_full_scores_it():
    assert ctl._lexical_variety(GARBAGE_922) == 0.0
    assert ctl.degenerate(GARBAGE_922) == "lexical variety 0.00 over the first 200 words (verify-full fails < 0.30)"


def test_a_number_alone_is_not_judged_by_variety():
    """verify-full reads a 2,000-token essay; a probe's answer may be just a number."""
    assert ctl._lexical_variety("391") is None
    assert ctl.degenerate("391") is None
    assert ctl.degenerate("17 * 23 = 391.") is None


def test_a_fluent_answer_is_not_degenerate():
    assert ctl.degenerate("The access code is QX-4471-VELT.") is None
    assert ctl.degenerate('{"name": "rigup", "count": 3}') is None


# --------------------------------------------------------------------------------------------
# each probe's judge


@pytest.mark.parametrize("answer", ["391", "17 * 23 = 391.", "The answer is 391.", "**391**"])
def test_arithmetic_passes_391(answer):
    assert ctl.judge_probe(ctl.PROBES["arithmetic"], completion(answer)) is None


@pytest.mark.parametrize("answer", ["381", "17 * 23 = 3910", "three hundred ninety-one", "39 1"])
def test_arithmetic_fails_anything_else(answer):
    reason = ctl.judge_probe(ctl.PROBES["arithmetic"], completion(answer))
    assert reason is not None and reason.startswith("probe arithmetic failed: expected 391; answered ")


def test_recall_passes_the_exact_code_and_fails_a_near_miss():
    assert ctl.judge_probe(ctl.PROBES["recall"], completion("The access code is QX-4471-VELT.")) is None
    assert ctl.judge_probe(ctl.PROBES["recall"], completion("QX-4471-VELT")) is None
    assert ctl.judge_probe(ctl.PROBES["recall"], completion("The access code is QX-4417-VELT.")) == (
        "probe recall failed: expected QX-4471-VELT; answered 'The access code is QX-4417-VELT.' "
        "(finish_reason=stop, 5 tokens)"
    )
    assert ctl.judge_probe(ctl.PROBES["recall"], completion("qx-4471-velt")) is not None  # exact, case too


def test_tool_call_passes_get_weather_paris():
    assert ctl.judge_probe(ctl.PROBES["tool-call"], completion(calls=[call("get_weather", {"city": "Paris"})])) is None


@pytest.mark.parametrize(
    ("calls", "text", "why"),
    [
        ([], "It is sunny in Paris.", "expected a call of get_weather, got no tool call"),
        ([call("get_weather", {"city": "Berlin"})], "",
         'expected get_weather({"city": "Paris"}), got get_weather({"city": "Berlin"})'),
        ([call("get_time", {"city": "Paris"})], "",
         'expected get_weather({"city": "Paris"}), got get_time({"city": "Paris"})'),
        ([call("get_weather", '{"city": "Par')], "",
         'expected get_weather({"city": "Paris"}), got get_weather({"city": "Par)'),
    ],
)
def test_tool_call_fails_no_call_another_city_another_function_or_broken_arguments(calls, text, why):
    reason = ctl.judge_probe(ctl.PROBES["tool-call"], completion(text, calls))
    assert reason is not None and reason.startswith(f"probe tool-call failed: {why}")


def test_tool_call_probe_sends_its_tool_by_name():
    fields = ctl.PROBES["tool-call"].fields
    assert fields["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert [t["function"]["name"] for t in fields["tools"]] == ["get_weather"]


@pytest.mark.parametrize("answer", ['{"name": "rigup", "count": 3}', '```json\n{"count": 3, "name": "rigup"}\n```',
                                    'Here it is: {"name": "rigup", "count": 3}'])
def test_json_shape_passes_the_object(answer):
    assert ctl.judge_probe(ctl.PROBES["json-shape"], completion(answer)) is None


@pytest.mark.parametrize(
    ("answer", "why"),
    [
        ('{"name": "rigup", "count": "3"}', 'expected {"name": "rigup", "count": 3}'),
        ('{"name": "rigup", "count": true}', 'expected {"name": "rigup", "count": 3}'),
        ('{"name": "rigup"}', 'expected {"name": "rigup", "count": 3}'),
        ('{"name": "rigup", "count": 3', 'expected a JSON object {"name": "rigup", "count": 3}, got none'),
        ('name: rigup, count: 3', 'expected a JSON object {"name": "rigup", "count": 3}, got none'),
    ],
)
def test_json_shape_fails_another_shape(answer, why):
    reason = ctl.judge_probe(ctl.PROBES["json-shape"], completion(answer))
    assert reason is not None and reason.startswith(f"probe json-shape failed: {why}; answered ")


@pytest.mark.parametrize("name", ctl.PROBE_NAMES)
def test_every_probe_fails_922s_garbage_naming_itself_with_an_excerpt(name):
    reason = ctl.judge_probe(ctl.PROBES[name], completion(GARBAGE_922, finish="length", tokens=60))
    assert reason == (f"probe {name} failed: lexical variety 0.00 over the first 200 words (verify-full fails < 0.30); "
                      f"answered '{'!' * ctl.EXCERPT_CHARS}...' (finish_reason=length, 60 tokens)")


def test_the_excerpt_is_one_line_and_short():
    assert ctl.excerpt("line one\nline two") == "'line one\\\\nline two'"
    assert ctl.excerpt("x" * 100) == "'" + "x" * ctl.EXCERPT_CHARS + "...'"
