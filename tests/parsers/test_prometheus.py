"""The text exposition format parser on real scrapes (tests/fixtures/prometheus), its strictness line by
line, and the arithmetic `rigup top` does on two scrapes: histogram_quantile (checked against what
Prometheus 2.42 itself answered for the same buckets) and counter increases across a restart."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from rigup.parsers.common import ParseError
from rigup.parsers.prometheus import (
    Histogram,
    counter_increase,
    counter_rate,
    histogram_increase,
    histogram_quantile,
    merge_histograms,
    parse_exposition,
    parse_sample,
    series_increase,
)
from tests.support.exporters import Gpu, Route, VllmPod, dcgm_text, litellm_text

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "prometheus"
INF = math.inf


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


# -- real scrapes ---------------------------------------------------------------------------------


def test_node_exporter_scrape() -> None:
    scrape = parse_exposition(fixture("node_exporter-1.5.0.prom"))
    assert len(scrape.families) == 107
    assert sum(len(f.samples) for f in scrape.families.values()) == 142
    gc = scrape.families["go_gc_duration_seconds"]
    assert gc.type == "summary" and gc.help == "A summary of the pause duration of garbage collection cycles."
    assert [s.label("quantile") for s in gc.samples if s.name == gc.name] == ["0", "0.25", "0.5", "0.75", "1"]
    assert {s.name for s in gc.samples} == {"go_gc_duration_seconds", "go_gc_duration_seconds_sum", "go_gc_duration_seconds_count"}
    (root,) = scrape.samples("node_filesystem_size_bytes", mountpoint="/")
    assert root.label("fstype") == "ext4" and root.value > 1e9
    cpu = scrape.families["node_cpu_seconds_total"]
    assert cpu.type == "counter" and {s.label("mode") for s in cpu.samples} >= {"idle", "user", "system"}


def test_prometheus_own_scrape_with_histograms() -> None:
    scrape = parse_exposition(fixture("prometheus-2.42.0.prom"))
    durations = scrape.histograms("prometheus_http_request_duration_seconds")
    assert durations, "Prometheus reports its HTTP handlers' latency as a histogram"
    for labels, histogram in durations.items():
        assert dict(labels).keys() == {"handler"}
        assert histogram.buckets[-1][0] == INF and histogram.count == histogram.buckets[-1][1]
        assert histogram.sum is not None and histogram.sum >= 0
    assert scrape.families["prometheus_http_request_duration_seconds"].type == "histogram"


def test_vllm_scrape_of_two_engines() -> None:
    """vLLM V1 with data parallelism: each engine its own series (prometheus_client's output)."""
    scrape = parse_exposition(fixture("vllm-v1-dp2.prom"))
    running = scrape.samples("vllm:num_requests_running")
    assert [(s.label("engine"), s.value) for s in running] == [("0", 5.0), ("1", 4.0)]
    assert {s.label("model_name") for s in running} == {"qwen3.6-27b-autoround"}
    assert scrape.families["vllm:prompt_tokens_total"].type == "counter"
    assert scrape.families["vllm:prompt_tokens_created"].type == "gauge"  # prometheus_client's extra series
    ttft = scrape.histograms("vllm:time_to_first_token_seconds")
    assert {dict(k)["engine"]: h.count for k, h in ttft.items()} == {"0": 5.0, "1": 3.0}
    merged = merge_histograms(ttft.values())
    assert merged is not None and merged.count == 8.0
    assert merged.quantile(0.5) == pytest.approx(0.08)  # 4 of 8 first tokens at or below 80 ms
    success = scrape.samples("vllm:request_success_total", engine="0")
    assert {s.label("finished_reason"): s.value for s in success} == {"stop": 310.0, "length": 12.0, "abort": 1.0}


def test_the_fake_exporters_text_parses() -> None:
    """The tests' fakes (tests/support/exporters.py) are in the real format too."""
    pod = parse_exposition(VllmPod("m", started=0).text(10))
    assert pod.samples("vllm:generation_tokens_total")[0].value == 8500.0
    gpus = parse_exposition(dcgm_text("rig-1", [Gpu(0), Gpu(1, temp_c=71)]))
    assert [s.value for s in gpus.samples("DCGM_FI_DEV_GPU_TEMP")] == [66.0, 71.0]
    assert gpus.samples("DCGM_FI_DEV_POWER_USAGE", gpu="1")[0].label("modelName") == "NVIDIA GeForce RTX 3090"
    gateway = parse_exposition(litellm_text([Route("m", "rig-1/rigup-dual.service", "http://h:8000/v1", failure_per_s=1)], 0, 5))
    (state,) = gateway.samples("litellm_deployment_state")
    assert state.label_map == {"api_base": "http://h:8000/v1", "api_provider": "hosted_vllm",
                               "litellm_model_name": "hosted_vllm/m", "model_id": "rig-1/rigup-dual.service"}
    assert gateway.samples("litellm_deployment_failure_responses_total")[0].label("exception_status") == "500"


# -- the format, piece by piece -------------------------------------------------------------------


def test_label_values_with_escapes_and_loose_whitespace() -> None:
    text = (
        '# HELP msg A message with a \\\\ and a\\nsecond line.\n'
        "# TYPE msg gauge\n"
        'msg{path="C:\\\\models\\\\",quote="say \\"hi\\"",text="one\\ntwo",plain="a}b,c=d"} 1\n'
        '  msg { path = "x" , } \t2 1700000000000\n'
        "msg{} 3\n"
    )
    scrape = parse_exposition(text)
    family = scrape.families["msg"]
    assert family.help == "A message with a \\ and a\nsecond line."
    first, second, third = family.samples
    assert first.label_map == {"path": "C:\\models\\", "quote": 'say "hi"', "text": "one\ntwo", "plain": "a}b,c=d"}
    assert (second.label_map, second.value, second.timestamp_ms) == ({"path": "x"}, 2.0, 1700000000000)
    assert (third.labels, third.value) == ((), 3.0)


@pytest.mark.parametrize("text, value", [
    ("1", 1.0), ("-0.5", -0.5), ("1.5e+09", 1.5e9), ("2E-3", 0.002), (".5", 0.5), ("5.", 5.0),
    ("+Inf", INF), ("-Inf", -INF), ("Inf", INF),
])
def test_values(text: str, value: float) -> None:
    assert parse_sample(f"x {text}").value == value


def test_nan_value() -> None:
    assert math.isnan(parse_sample("x NaN").value)


def test_comments_and_blank_lines_are_skipped() -> None:
    scrape = parse_exposition("# a comment\n#\n\n# HELPER is not HELP\nx 1\n")
    assert list(scrape.families) == ["x"] and scrape.families["x"].type == "untyped"


@pytest.mark.parametrize("text, message", [
    ("x 1", "line 1: the last line does not end with a line feed"),
    ("1x 1\n", "line 1: expected a metric name"),
    ("x\n", "line 1: x: no value"),
    ("x one\n", "line 1: x: invalid value 'one'"),
    ("x 1_000\n", "invalid value '1_000'"),
    ("x 1 2 3\n", "unexpected '3' after the value and timestamp"),
    ("x 1 1.5\n", "invalid timestamp '1.5'"),
    ('x{a="1"\n', "line 1: label a: expected ',' or '}'"),
    ('x{a="1} 1\n', "label a: the value has no closing"),
    ('x{a="\\t"} 1\n', "label a: invalid escape sequence '\\t'"),
    ("x{a=1} 1\n", "label a: expected '\"'"),
    ('x{1a="1"} 1\n', "expected a label name"),
    ('x{a="1",a="2"} 1\n', "x: label 'a' given twice"),
    ('x{a="1"}1\n', "unexpected '1' after the metric name or labels"),
    ('x{a="1"} 1\nx{a="1"} 2\n', 'line 2: a second sample of the series x{a="1"}'),
    ("x 1\n# TYPE x gauge\n", "line 2: TYPE line for x after its samples"),
    ("# TYPE x gauge\n# TYPE x counter\n", "line 2: a second TYPE line for x"),
    ("# HELP x a\n# HELP x b\n", "line 2: a second HELP line for x"),
    ("# TYPE x gaug\n", "line 1: # TYPE x: unknown type 'gaug'"),
    ("# TYPE 1x gauge\n", "invalid metric name '1x'"),
])
def test_strictness(text: str, message: str) -> None:
    with pytest.raises(ParseError) as error:
        parse_exposition(text)
    assert message in str(error.value)


HISTOGRAM = "# TYPE h histogram\n"


@pytest.mark.parametrize("body, message", [
    ('h_bucket{le="1"} 1\nh_count 1\n', "histogram h: no +Inf bucket"),
    ('h_bucket{le="1"} 2\nh_bucket{le="+Inf"} 1\n', "histogram h: bucket counts are not cumulative"),
    ('h_bucket{le="1"} 1\nh_bucket{le="+Inf"} 2\nh_count 3\n', "histogram h: _count 3 differs from the +Inf bucket 2"),
    ('h_bucket{le="fast"} 1\n', 'h_bucket{le="fast"}: a bucket without a valid le label'),
    ("h_bucket 1\n", "h_bucket: a bucket without a valid le label"),
    ("h 1\n", "histogram h: a sample named h"),
])
def test_histogram_strictness(body: str, message: str) -> None:
    with pytest.raises(ParseError) as error:
        parse_exposition(HISTOGRAM + body)
    assert message in str(error.value)


def test_summary_needs_quantile_labels() -> None:
    with pytest.raises(ParseError, match="summary s: a sample without a valid quantile label"):
        parse_exposition("# TYPE s summary\ns 1\n")
    ok = parse_exposition('# TYPE s summary\ns{quantile="0.5"} 1\ns_sum 2\ns_count 3\n')
    assert [x.name for x in ok.families["s"].samples] == ["s", "s_sum", "s_count"]


def test_histograms_by_their_other_labels() -> None:
    scrape = parse_exposition(
        HISTOGRAM
        + 'h_bucket{pod="a",le="0.1"} 1\nh_bucket{pod="a",le="+Inf"} 4\nh_sum{pod="a"} 2.5\nh_count{pod="a"} 4\n'
        + 'h_bucket{pod="b",le="0.1"} 0\nh_bucket{pod="b",le="+Inf"} 0\nh_sum{pod="b"} 0\nh_count{pod="b"} 0\n'
    )
    series = scrape.histograms("h")
    assert series[(("pod", "a"),)] == Histogram(((0.1, 1.0), (INF, 4.0)), 2.5, 4.0)
    assert math.isnan(series[(("pod", "b"),)].quantile(0.5))  # no observations
    assert set(scrape.histograms("h", pod="a")) == {(("pod", "a"),)}


# -- arithmetic -----------------------------------------------------------------------------------

BUCKETS = [(0.1, 50.0), (0.2, 70.0), (1.0, 150.0), (INF, 200.0)]


@pytest.mark.parametrize("q, buckets, expected", [
    # each expected value is what Prometheus 2.42 answered for histogram_quantile over the same buckets
    (0.5, BUCKETS, 0.5),
    (0.95, BUCKETS, 1.0),  # in the +Inf bucket: the highest finite bound
    (0.0, BUCKETS, 0.0),
    (0.1, BUCKETS, 0.04),  # the lowest bucket starts at 0
    (0.3, BUCKETS, 0.15),
    (0.25, [(0.1, 10.0), (0.2, 10.0), (0.3, 20.0), (INF, 20.0)], 0.05),
    (0.5, [(0.1, 10.0), (0.2, 10.0), (0.3, 20.0), (INF, 20.0)], 0.1),
    (0.1, [(-1.0, 5.0), (0.0, 10.0), (1.0, 20.0), (INF, 20.0)], -1.0),  # a lowest bound <= 0 is the answer
    (0.5, [(0.1, 30.0), (0.2, 20.0), (0.5, 40.0), (INF, 40.0)], 0.1 / 1.5),  # forced monotonic
    (-0.1, BUCKETS, -INF),
    (1.5, BUCKETS, INF),
])
def test_histogram_quantile_as_prometheus(q: float, buckets: list[tuple[float, float]], expected: float) -> None:
    assert histogram_quantile(q, buckets) == pytest.approx(expected)
    assert histogram_quantile(q, list(reversed(buckets))) == pytest.approx(expected)  # order does not matter


@pytest.mark.parametrize("buckets", [
    [(0.1, 0.0), (INF, 0.0)],  # no observations
    [(INF, 10.0)],  # one bucket
    [(0.1, 5.0), (0.2, 5.0)],  # no +Inf bucket
    [],
])
def test_histogram_quantile_undefined(buckets: list[tuple[float, float]]) -> None:
    assert math.isnan(histogram_quantile(0.5, buckets))


def test_equal_bounds_add_up() -> None:
    assert histogram_quantile(0.5, [(0.1, 5.0), (0.1, 5.0), (INF, 20.0)]) == pytest.approx(0.1)


def test_counter_increase_and_rate_across_a_restart() -> None:
    assert counter_increase(100.0, 160.0) == 60.0
    assert counter_increase(100.0, 30.0) == 30.0  # restarted: it counted 30 since
    assert counter_rate(100.0, 160.0, 2.0) == 30.0
    assert counter_rate(100.0, 30.0, 3.0) == 10.0
    assert counter_rate(1.0, 2.0, 0.0) is None


def test_series_increase_matches_series_by_labels() -> None:
    before = parse_exposition('c_total{engine="0"} 10\nc_total{engine="1"} 5\n').samples("c_total")
    after = parse_exposition('c_total{engine="0"} 16\nc_total{engine="1"} 2\nc_total{engine="2"} 99\n').samples("c_total")
    assert series_increase(before, after) == 6 + 2  # engine 1 restarted; engine 2 is new (no earlier sample)
    assert series_increase([], after) is None


def test_histogram_increase_between_scrapes() -> None:
    before = Histogram(((0.1, 10.0), (0.5, 20.0), (INF, 22.0)), 5.0, 22.0)
    after = Histogram(((0.1, 12.0), (0.5, 30.0), (INF, 33.0)), 9.0, 33.0)
    window = histogram_increase(before, after)
    assert window == Histogram(((0.1, 2.0), (0.5, 10.0), (INF, 11.0)), 4.0, 11.0)
    assert window.quantile(0.5) == pytest.approx(0.1 + 0.4 * (5.5 - 2) / 8)
    restarted = Histogram(((0.1, 1.0), (0.5, 2.0), (INF, 2.0)), 0.3, 2.0)
    assert histogram_increase(before, restarted) == restarted  # counted since the restart
    rebucketed = Histogram(((1.0, 40.0), (INF, 40.0)), 10.0, 40.0)
    assert histogram_increase(before, rebucketed) == rebucketed
