"""Prometheus' text exposition format (version 0.0.4, `Content-Type: text/plain; version=0.0.4`), read
strictly, and the arithmetic `rigup top` does on two scrapes of it.

What the format allows, and nothing more: `# HELP name text` (escapes \\\\ and \\n) and `# TYPE name type`
at most once per metric, TYPE before its samples; other `#` lines are comments; a sample is
`name{label="value",...} value [timestamp_ms]`, tokens separated by blanks or tabs, label values with
the escapes \\\\, \\" and \\n only, values Go float syntax or NaN/+Inf/-Inf, every line ending with a line
feed. A histogram `x` is its `x_bucket{le="..."}` series (cumulative, with a `+Inf` bucket equal to
`x_count`), `x_sum` and `x_count`; a summary `x` is `x{quantile="..."}`, `x_sum` and `x_count`. A
series (name and label set) appears once. Anything else is a ParseError naming the line.

Then: histogram_quantile over cumulative buckets, as PromQL's histogram_quantile computes it
(promql/quantile.go: linear inside the bucket, the lowest bucket starting at 0, the +Inf bucket
answering the highest finite bound), and counter increases between two scrapes, a decrease being a
restart of the target (the counter started again from 0), as PromQL's rate() takes it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from rigup.parsers.common import ParseError

TYPES = ("counter", "gauge", "histogram", "summary", "untyped")
METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
# Go's strconv.ParseFloat, decimal form (what every exporter prints), plus its Inf and NaN spellings
FLOAT = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
SPECIAL_FLOATS = {"nan": math.nan, "+inf": math.inf, "inf": math.inf, "-inf": -math.inf,
                  "+infinity": math.inf, "infinity": math.inf, "-infinity": -math.inf}
TIMESTAMP = re.compile(r"-?[0-9]+")
BLANKS = " \t"
LABEL_ESCAPES = {"\\": "\\", '"': '"', "n": "\n"}

Labels = tuple[tuple[str, str], ...]  # sorted by name: a series' identity


@dataclass(frozen=True)
class Sample:
    name: str
    labels: Labels  # sorted by label name
    value: float
    timestamp_ms: int | None = None

    def label(self, name: str, default: str | None = None) -> str | None:
        for key, value in self.labels:
            if key == name:
                return value
        return default

    @property
    def label_map(self) -> dict[str, str]:
        return dict(self.labels)


@dataclass
class Family:
    """One metric: its declared type (untyped when no TYPE line) and help, and its samples in order."""

    name: str
    type: str = "untyped"
    help: str | None = None
    samples: list[Sample] = field(default_factory=list)
    typed: bool = False  # a TYPE line named it (`untyped` included)


@dataclass(frozen=True)
class Histogram:
    """One histogram series: (upper bound, cumulative count) sorted by bound, the last one +Inf."""

    buckets: tuple[tuple[float, float], ...]
    sum: float | None = None
    count: float | None = None

    def quantile(self, q: float) -> float:
        return histogram_quantile(q, self.buckets)


@dataclass
class Exposition:
    """A parsed scrape: the metric families by name, in the order they appeared."""

    families: dict[str, Family] = field(default_factory=dict)
    _by_name: dict[str, list[Sample]] | None = field(default=None, init=False, repr=False, compare=False)

    def samples(self, name: str, **match: str) -> list[Sample]:
        """Every sample named `name` (a sample name: `x_bucket`, `x_total`), with these label values."""
        if self._by_name is None:  # indexed on first use, once the parse is complete
            self._by_name = {}
            for family in self.families.values():
                for sample in family.samples:
                    self._by_name.setdefault(sample.name, []).append(sample)
        return [s for s in self._by_name.get(name, ()) if all(s.label(k) == v for k, v in match.items())]

    def histograms(self, name: str, **match: str) -> dict[Labels, Histogram]:
        """The series of histogram `name` (the family name, without _bucket), by their labels other than le."""
        return histograms_of(name, self.samples(f"{name}_bucket", **match), self.samples(f"{name}_sum", **match),
                             self.samples(f"{name}_count", **match))


# --------------------------------------------------------------------------------------------------
# parsing


def parse_exposition(text: str) -> Exposition:
    """The samples, HELP and TYPE of one scrape in the text format 0.0.4 (ParseError: line N: why)."""
    if text and not text.endswith("\n"):
        raise ParseError(f"line {text.count(chr(10)) + 1}: the last line does not end with a line feed")
    out = Exposition()
    seen: set[tuple[str, Labels]] = set()
    for number, line in enumerate(text.split("\n")[:-1] if text else [], start=1):
        try:
            _parse_line(line, out, seen)
        except ParseError as exc:
            raise ParseError(f"line {number}: {exc}") from None
    for family in out.families.values():
        _check_family(family)
    return out


def _parse_line(line: str, out: Exposition, seen: set[tuple[str, Labels]]) -> None:
    stripped = line.lstrip(BLANKS)
    if not stripped:
        return
    if stripped.startswith("#"):
        _parse_comment(stripped[1:], out)
        return
    sample = parse_sample(stripped)
    key = (sample.name, sample.labels)
    if key in seen:
        raise ParseError(f"a second sample of the series {format_series(sample.name, sample.labels)}")
    seen.add(key)
    _family_for(sample.name, out).samples.append(sample)


def _parse_comment(rest: str, out: Exposition) -> None:
    tokens = rest.lstrip(BLANKS)
    keyword, _, rest = _split_token(tokens)
    if keyword not in ("HELP", "TYPE"):
        return  # a comment
    name, _, text = _split_token(rest.lstrip(BLANKS))
    if not METRIC_NAME.fullmatch(name):
        raise ParseError(f"# {keyword}: invalid metric name {name!r}")
    family = out.families.get(name)
    if keyword == "HELP":
        if family is not None and family.help is not None:
            raise ParseError(f"a second HELP line for {name}")
        family = family or out.families.setdefault(name, Family(name))
        family.help = _unescape_help(text.lstrip(BLANKS))
        return
    kind = text.strip(BLANKS)
    if kind not in TYPES:
        raise ParseError(f"# TYPE {name}: unknown type {kind!r} (one of {', '.join(TYPES)})")
    if family is not None and family.samples:
        raise ParseError(f"TYPE line for {name} after its samples")
    if family is not None and family.typed:
        raise ParseError(f"a second TYPE line for {name}")
    family = family or out.families.setdefault(name, Family(name))
    family.type, family.typed = kind, True


def _split_token(text: str) -> tuple[str, str, str]:
    for index, char in enumerate(text):
        if char in BLANKS:
            return text[:index], char, text[index + 1:]
    return text, "", ""


def _unescape_help(text: str) -> str:
    out, index = [], 0
    while index < len(text):
        char = text[index]
        if char == "\\" and index + 1 < len(text) and text[index + 1] in "\\n":
            out.append("\n" if text[index + 1] == "n" else "\\")
            index += 2
            continue
        out.append(char)  # any other backslash stands for itself in HELP
        index += 1
    return "".join(out)


def parse_sample(line: str) -> Sample:
    """One sample line (without its line feed): name, labels, value and optional timestamp."""
    match = METRIC_NAME.match(line)
    if not match:
        raise ParseError(f"expected a metric name, got {line[:40]!r}")
    name, index = match.group(), match.end()
    labels: list[tuple[str, str]] = []
    brace = _skip_blanks(line, index)
    if brace < len(line) and line[brace] == "{":
        labels, index = _parse_labels(line, brace + 1)
    rest = line[index:]
    if rest and rest[0] not in BLANKS:
        raise ParseError(f"{name}: unexpected {rest[:20]!r} after the metric name or labels")
    tokens = rest.split()
    if not tokens:
        raise ParseError(f"{name}: no value")
    if len(tokens) > 2:
        raise ParseError(f"{name}: unexpected {' '.join(tokens[2:])[:40]!r} after the value and timestamp")
    value = parse_float(tokens[0])
    if value is None:
        raise ParseError(f"{name}: invalid value {tokens[0]!r}")
    timestamp = None
    if len(tokens) == 2:
        if not TIMESTAMP.fullmatch(tokens[1]):
            raise ParseError(f"{name}: invalid timestamp {tokens[1]!r} (milliseconds since the epoch)")
        timestamp = int(tokens[1])
    names = [key for key, _ in labels]
    duplicated = sorted({key for key in names if names.count(key) > 1})
    if duplicated:
        raise ParseError(f"{name}: label {duplicated[0]!r} given twice")
    return Sample(name, tuple(sorted(labels)), value, timestamp)


def _skip_blanks(line: str, index: int) -> int:
    while index < len(line) and line[index] in BLANKS:
        index += 1
    return index


def _parse_labels(line: str, index: int) -> tuple[list[tuple[str, str]], int]:
    """The label pairs after `{` up to and past `}`."""
    labels: list[tuple[str, str]] = []
    while True:
        index = _skip_blanks(line, index)
        if index < len(line) and line[index] == "}":
            return labels, index + 1
        match = LABEL_NAME.match(line, index)
        if not match:
            raise ParseError(f"expected a label name or '}}' at column {index + 1}, got {line[index:index + 20]!r}")
        key = match.group()
        index = _skip_blanks(line, match.end())
        if index >= len(line) or line[index] != "=":
            raise ParseError(f"label {key}: expected '=' at column {index + 1}")
        index = _skip_blanks(line, index + 1)
        if index >= len(line) or line[index] != '"':
            raise ParseError(f"label {key}: expected '\"' at column {index + 1}")
        value, index = _label_value(line, index + 1, key)
        labels.append((key, value))
        index = _skip_blanks(line, index)
        if index < len(line) and line[index] == ",":
            index += 1
        elif index < len(line) and line[index] == "}":
            return labels, index + 1
        else:
            raise ParseError(f"label {key}: expected ',' or '}}' at column {index + 1}")


def _label_value(line: str, index: int, key: str) -> tuple[str, int]:
    out: list[str] = []
    while index < len(line):
        char = line[index]
        if char == '"':
            return "".join(out), index + 1
        if char == "\\":
            escaped = line[index + 1:index + 2]
            if escaped not in LABEL_ESCAPES:
                raise ParseError(f"label {key}: invalid escape sequence '\\{escaped}'")
            out.append(LABEL_ESCAPES[escaped])
            index += 2
            continue
        out.append(char)
        index += 1
    raise ParseError(f"label {key}: the value has no closing '\"'")


def parse_float(text: str) -> float | None:
    """A sample value as Go's ParseFloat reads it (decimal, Inf, NaN); None when it is not one."""
    special = SPECIAL_FLOATS.get(text.lower())
    if special is not None:
        return special
    return float(text) if FLOAT.fullmatch(text) else None


def _family_for(sample_name: str, out: Exposition) -> Family:
    """The family a sample belongs to: a histogram's or summary's for their suffixed series, else its own."""
    for suffix, kinds in (("_bucket", ("histogram",)), ("_sum", ("histogram", "summary")),
                          ("_count", ("histogram", "summary"))):
        base = sample_name.removesuffix(suffix)
        if base != sample_name and base in out.families and out.families[base].type in kinds:
            return out.families[base]
    family = out.families.get(sample_name)
    if family is None:
        family = out.families.setdefault(sample_name, Family(sample_name))
    return family


def _check_family(family: Family) -> None:
    if family.type == "histogram":
        histograms_of(family.name, *(
            [s for s in family.samples if s.name == f"{family.name}{suffix}"] for suffix in ("_bucket", "_sum", "_count")
        ))
        stray = [s.name for s in family.samples if s.name == family.name]
        if stray:
            raise ParseError(f"histogram {family.name}: a sample named {family.name} (its series are _bucket, _sum, _count)")
    elif family.type == "summary":
        for sample in family.samples:
            if sample.name == family.name:
                quantile = sample.label("quantile")
                if quantile is None or parse_float(quantile) is None:
                    raise ParseError(f"summary {family.name}: a sample without a valid quantile label")


def histograms_of(
    name: str, buckets: Iterable[Sample], sums: Iterable[Sample] = (), counts: Iterable[Sample] = ()
) -> dict[Labels, Histogram]:
    """Histogram `name`'s series: its _bucket samples grouped by their labels other than le, with the
    matching _sum and _count; each must have a +Inf bucket, cumulative counts and a _count equal to the
    +Inf bucket (ParseError)."""
    grouped: dict[Labels, list[tuple[float, float]]] = {}
    for sample in buckets:
        le = sample.label("le")
        bound = parse_float(le) if le is not None else None
        if bound is None:
            raise ParseError(f"{format_series(sample.name, sample.labels)}: a bucket without a valid le label")
        rest = tuple(pair for pair in sample.labels if pair[0] != "le")
        grouped.setdefault(rest, []).append((bound, sample.value))
    sum_of = {s.labels: s.value for s in sums}
    count_of = {s.labels: s.value for s in counts}
    out: dict[Labels, Histogram] = {}
    for labels, pairs in grouped.items():
        pairs.sort(key=lambda pair: pair[0])
        where = f"histogram {format_series(name, labels)}"
        if pairs[-1][0] != math.inf:
            raise ParseError(f"{where}: no +Inf bucket")
        counts_in_order = [count for _, count in pairs]
        if any(later < earlier for earlier, later in zip(counts_in_order, counts_in_order[1:])):
            raise ParseError(f"{where}: bucket counts are not cumulative")
        count = count_of.get(labels)
        if count is not None and count != pairs[-1][1]:
            raise ParseError(f"{where}: _count {count:g} differs from the +Inf bucket {pairs[-1][1]:g}")
        out[labels] = Histogram(tuple(pairs), sum_of.get(labels), count)
    return out


def format_series(name: str, labels: Labels) -> str:
    inner = ",".join(f'{k}="{v}"' for k, v in labels)
    return f"{name}{{{inner}}}" if labels else name


# --------------------------------------------------------------------------------------------------
# arithmetic over scrapes


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float:
    """The q-quantile (0..1) of cumulative buckets (upper bound, count), as PromQL's histogram_quantile:
    NaN without observations, with fewer than two buckets or without a +Inf bucket; linear inside the
    bucket the rank falls in (the lowest from 0, or its bound when that is <= 0); the highest finite
    bound when it falls in +Inf. Buckets need not be sorted; equal bounds add up; a count below an
    earlier one is raised to it (Prometheus' ensureMonotonic)."""
    if math.isnan(q):
        return math.nan
    if q < 0:
        return -math.inf
    if q > 1:
        return math.inf
    ordered: list[list[float]] = []
    for bound, count in sorted(buckets, key=lambda pair: pair[0]):
        if ordered and ordered[-1][0] == bound:
            ordered[-1][1] += count
        else:
            ordered.append([float(bound), float(count)])
    if not ordered or ordered[-1][0] != math.inf:
        return math.nan
    highest = ordered[0][1]
    for pair in ordered[1:]:
        highest = pair[1] = max(highest, pair[1])
    if len(ordered) < 2:
        return math.nan
    observations = ordered[-1][1]
    if observations == 0:
        return math.nan
    rank = q * observations
    # the first bucket below +Inf holding the rank, else +Inf's (Go's sort.Search over len-1)
    index = next((i for i, (_, count) in enumerate(ordered[:-1]) if count >= rank), len(ordered) - 1)
    if index == len(ordered) - 1:
        return ordered[-2][0]
    if index == 0 and ordered[0][0] <= 0:
        return ordered[0][0]
    start, end, count = 0.0, ordered[index][0], ordered[index][1]
    if index > 0:
        start = ordered[index - 1][0]
        count -= ordered[index - 1][1]
        rank -= ordered[index - 1][1]
    return start + (end - start) * (rank / count)


def counter_increase(previous: float, current: float) -> float:
    """How much a counter grew between two scrapes; a lower value means the target restarted and the
    counter began again from 0, so all of `current` is new (PromQL's rate() does the same)."""
    return current - previous if current >= previous else current


def counter_rate(previous: float, current: float, seconds: float) -> float | None:
    """Per-second increase between two scrapes `seconds` apart (None when they are not apart)."""
    if seconds <= 0:
        return None
    return counter_increase(previous, current) / seconds


def series_increase(previous: Iterable[Sample], current: Iterable[Sample]) -> float | None:
    """The summed increase of the series present in both scrapes (matched by labels); None when none is."""
    before = {s.labels: s.value for s in previous}
    total, matched = 0.0, False
    for sample in current:
        if sample.labels in before:
            total += counter_increase(before[sample.labels], sample.value)
            matched = True
    return total if matched else None


def histogram_increase(previous: Histogram, current: Histogram) -> Histogram:
    """The observations between two scrapes of one histogram series: per-bucket differences, or all of
    `current` when it restarted (any count went down) or its buckets changed."""
    bounds_before = [bound for bound, _ in previous.buckets]
    bounds_now = [bound for bound, _ in current.buckets]
    restarted = bounds_before != bounds_now or any(
        now < before for (_, before), (_, now) in zip(previous.buckets, current.buckets)
    )
    if restarted:
        return current
    buckets = tuple((bound, now - before) for (bound, before), (_, now) in zip(previous.buckets, current.buckets))
    total_sum = current.sum - previous.sum if current.sum is not None and previous.sum is not None else None
    count = current.count - previous.count if current.count is not None and previous.count is not None else None
    return Histogram(buckets, total_sum, count)


def merge_histograms(parts: Iterable[Histogram]) -> Histogram | None:
    """Histograms with the same buckets added up (PromQL's `sum by (le)`); None for none. Buckets of
    different bounds are added where the bounds match (histogram_quantile coalesces the rest)."""
    totals: dict[float, float] = {}
    total_sum: float | None = 0.0
    total_count: float | None = 0.0
    seen = False
    for part in parts:
        seen = True
        for bound, count in part.buckets:
            totals[bound] = totals.get(bound, 0.0) + count
        total_sum = total_sum + part.sum if total_sum is not None and part.sum is not None else None
        total_count = total_count + part.count if total_count is not None and part.count is not None else None
    if not seen:
        return None
    return Histogram(tuple(sorted(totals.items())), total_sum, total_count)


def labels_without(labels: Labels, names: Iterable[str]) -> Labels:
    drop = set(names)
    return tuple(pair for pair in labels if pair[0] not in drop)


def label_items(mapping: Mapping[str, str]) -> Labels:
    return tuple(sorted(mapping.items()))
