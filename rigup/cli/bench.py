"""`rigup bench`: the seeds' bench.sh for every rig of the fleet, plus aggregate throughput under
concurrency, JSON results per host and run, and a PNG chart comparing hosts and variants.

Per prompt (narrative essay, 1000 tokens; quicksort code, 800 tokens): warm-up runs, then measured
runs, each a streamed chat completion with usage (temperature 0.6, top_p 0.95, thinking off):
  TTFT        send -> first streamed delta carrying content or reasoning (no such delta: TTFT = wall)
  wall_TPS    completion_tokens / wall
  decode_TPS  completion_tokens / (wall - TTFT)
summarised as mean, std (sample), CV %, min and max. `--concurrency 1,2,4,8` also sends that many
narrative streams at once and reports aggregate TPS = all their tokens / (last end - first start).
After the runs it records nvidia-smi's GPU state and the last SpecDecoding log lines over SSH.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import re
import statistics
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rigup.cli.runner import add_target_arguments, parallel, progress, service_log
from rigup.client.openai_client import ApiClient, StreamResult
from rigup.client.ssh import LazySsh, RemoteError
from rigup.client.targets import Target, api_targets

SCHEMA = 1
DEFAULT_RESULTS_DIR = Path("results") / "bench"


@dataclass(frozen=True)
class Prompt:
    text: str
    max_tokens: int


# The seeds' canonical prompts (bench.sh: PROMPT / MAX_TOKENS_NARR, code prompt / MAX_TOKENS_CODE).
PROMPTS = {
    "narr": Prompt("Write a detailed 800-word essay explaining transformer attention.", 1000),
    "code": Prompt("Write a Python implementation of quicksort with comments explaining each step.", 800),
}
GPU_QUERY = (
    "nvidia-smi --query-gpu=index,utilization.gpu,memory.used,memory.total,power.draw,temperature.gpu "
    "--format=csv,noheader,nounits"
)
GPU_FIELDS = ("index", "utilization_pct", "memory_used_mib", "memory_total_mib", "power_w", "temperature_c")
SPEC_LINE = r"SpecDecoding metrics"


class BenchError(RuntimeError):
    """A run that produced no measurement (HTTP error, broken stream, no usage)."""


@dataclass
class BenchSettings:
    prompts: tuple[str, ...] = ("narr", "code")
    warmups: int = 3
    runs: int = 5
    temperature: float = 0.6
    top_p: float = 0.95
    max_tokens: dict[str, int] = field(default_factory=lambda: {k: p.max_tokens for k, p in PROMPTS.items()})
    ignore_eos: bool = False  # forced length: every run generates exactly max_tokens
    timeout_s: float = 600.0
    concurrency: tuple[int, ...] = ()
    concurrency_runs: int = 3


@dataclass(frozen=True)
class RunSample:
    tokens: int
    wall_s: float
    ttft_s: float
    wall_tps: float
    decode_tps: float | None  # None when every token came with the first delta (wall == TTFT)


@dataclass(frozen=True)
class Stats:
    n: int
    mean: float
    std: float  # sample standard deviation (n - 1); 0 for a single value
    cv_pct: float  # std / mean * 100
    min: float
    max: float


# --------------------------------------------------------------------------------------------
# statistics (pure)


def sample_from(result: StreamResult) -> RunSample:
    """The seeds' per-run metrics from one streamed completion."""
    if not result.ok:
        raise BenchError(result.describe_failure())
    tokens = result.completion_tokens
    if not isinstance(tokens, int) or tokens <= 0:
        raise BenchError("the stream carried no usage with completion_tokens (stream_options.include_usage)")
    wall = result.elapsed
    ttft = result.ttft if result.ttft is not None else wall
    decode = wall - ttft
    return RunSample(
        tokens=tokens,
        wall_s=wall,
        ttft_s=ttft,
        wall_tps=tokens / wall,
        decode_tps=tokens / decode if decode > 0 else None,
    )


def summarize(values: Sequence[float]) -> Stats | None:
    """mean, sample std, CV %, min, max of the values; None for no values."""
    if not values:
        return None
    mean = statistics.fmean(values)
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return Stats(
        n=len(values),
        mean=mean,
        std=std,
        cv_pct=std / mean * 100 if mean else 0.0,
        min=min(values),
        max=max(values),
    )


def summarize_samples(samples: Sequence[RunSample]) -> dict[str, Stats | None]:
    return {
        "wall_tps": summarize([s.wall_tps for s in samples]),
        "decode_tps": summarize([s.decode_tps for s in samples if s.decode_tps is not None]),
        "ttft_s": summarize([s.ttft_s for s in samples]),
        "tokens": summarize([float(s.tokens) for s in samples]),
    }


def aggregate(results: Sequence[StreamResult]) -> dict[str, Any]:
    """Aggregate throughput of concurrent streams: all tokens / (last end - first start)."""
    samples = [sample_from(r) for r in results]
    span = max(r.finished for r in results) - min(r.started for r in results)
    tokens = sum(s.tokens for s in samples)
    decode = summarize([s.decode_tps for s in samples if s.decode_tps is not None])
    return {
        "streams": len(results),
        "tokens": tokens,
        "seconds": span,
        "aggregate_tps": tokens / span,
        "mean_stream_decode_tps": decode.mean if decode else None,
        "mean_ttft_s": statistics.fmean([s.ttft_s for s in samples]),
    }


# --------------------------------------------------------------------------------------------
# running


def payload(model: str, prompt: str, settings: BenchSettings) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPTS[prompt].text}],
        "max_tokens": settings.max_tokens[prompt],
        "temperature": settings.temperature,
        "top_p": settings.top_p,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    if settings.ignore_eos:
        body["ignore_eos"] = True  # vLLM's extension: generate exactly max_tokens
    return body


def run_prompt(
    client: ApiClient, model: str, prompt: str, settings: BenchSettings, say: Callable[[str], None]
) -> dict[str, Any]:
    body = payload(model, prompt, settings)
    for i in range(settings.warmups):
        result = client.stream_chat(body, settings.timeout_s)
        say(f"{prompt} warm-up {i + 1}/{settings.warmups}: " + (_short(sample_from(result)) if result.ok else result.describe_failure()))
    samples: list[RunSample] = []
    failures: list[str] = []
    for i in range(settings.runs):
        result = client.stream_chat(body, settings.timeout_s)
        try:
            run = sample_from(result)
        except BenchError as exc:
            failures.append(str(exc))
            say(f"{prompt} run {i + 1}/{settings.runs}: FAILED {exc}")
            continue
        samples.append(run)
        say(f"{prompt} run {i + 1}/{settings.runs}: {_short(run)}")
    return {
        "prompt": PROMPTS[prompt].text,
        "max_tokens": settings.max_tokens[prompt],
        "runs": [asdict(s) for s in samples],
        "failures": failures,
        "summary": {k: (asdict(v) if v else None) for k, v in summarize_samples(samples).items()},
    }


def _short(run: RunSample) -> str:
    decode = f"{run.decode_tps:.1f}" if run.decode_tps is not None else "-"
    return f"{run.tokens} tokens, decode {decode} TPS, wall {run.wall_tps:.1f} TPS, TTFT {run.ttft_s:.3f} s"


def concurrent_round(
    base_url: str, api_key: str | None, body: dict[str, Any], streams: int, timeout_s: float, ca_file: str | None = None
) -> list[StreamResult]:
    """`streams` identical requests started together (a barrier), one client each (an https URL's certificate
    verified against `ca_file`, None: the system's trust store)."""
    barrier = threading.Barrier(streams)
    results: list[StreamResult | None] = [None] * streams

    def one(index: int) -> None:
        client = ApiClient(base_url, api_key, ca_file)
        try:
            barrier.wait()
            results[index] = client.stream_chat(body, timeout_s)
        finally:
            client.close()

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(streams)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [r for r in results if r is not None]


def run_concurrency(
    base_url: str, api_key: str | None, model: str, settings: BenchSettings, say: Callable[[str], None],
    ca_file: str | None = None,
) -> list[dict[str, Any]]:
    body = payload(model, "narr", settings)
    levels = []
    for streams in settings.concurrency:
        rounds: list[dict[str, Any]] = []
        failures: list[str] = []
        for i in range(settings.concurrency_runs):
            results = concurrent_round(base_url, api_key, body, streams, settings.timeout_s, ca_file)
            try:
                measured = aggregate(results)
            except BenchError as exc:
                failures.append(str(exc))
                say(f"{streams} streams round {i + 1}/{settings.concurrency_runs}: FAILED {exc}")
                continue
            rounds.append(measured)
            say(f"{streams} streams round {i + 1}/{settings.concurrency_runs}: aggregate {measured['aggregate_tps']:.1f} TPS")
        stats = summarize([r["aggregate_tps"] for r in rounds])
        levels.append(
            {"streams": streams, "rounds": rounds, "failures": failures, "aggregate_tps": asdict(stats) if stats else None}
        )
    return levels


def gpu_snapshot(ssh: LazySsh) -> list[dict[str, float]] | str:
    """nvidia-smi's state after the runs, or why it could not be read."""
    try:
        result = ssh.run(GPU_QUERY, timeout=30)
    except RemoteError as exc:
        return str(exc)
    if result.rc != 0:
        return (result.stdout + result.stderr).strip()[:200] or f"nvidia-smi exited {result.rc}"
    rows = []
    for line in result.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != len(GPU_FIELDS):
            continue
        row: dict[str, float] = {}
        for name, value in zip(GPU_FIELDS, parts, strict=True):
            try:
                row[name] = float(value)
            except ValueError:
                row[name] = math.nan  # "[N/A]" on cards that do not report it
        rows.append(row)
    return rows


def bench_target(
    target: Target, settings: BenchSettings, log_file: str | None = None, model: str | None = None, quiet: bool = False
) -> dict[str, Any]:
    def say(line: str) -> None:
        if not quiet:
            progress(f"[{target.name}] {line}")

    document: dict[str, Any] = {
        "schema": SCHEMA,
        "host": target.name,
        "variant": target.variant,
        "url": target.api_url,
        "time": datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat(),
        "settings": asdict(settings),
        "model": None,
        "prompts": {},
        "concurrency": [],
        "gpus": None,
        "spec_decoding": None,
        "error": None,
    }
    if target.error is not None or target.api_url is None:
        document["error"] = target.error or "no API URL"
        return document
    if target.cluster_head is not None:
        document["skipped"] = f"a worker of its cluster: benchmarked as {target.cluster_head}, which serves it"
        return document
    client = ApiClient(target.api_url, target.api_key, target.ca_file)
    ssh = LazySsh(target.ssh)
    try:
        served = model or target.served_model
        listed = client.models(timeout=10.0)
        if not listed.ok:
            document["error"] = f"GET /v1/models: {listed.describe_failure()}"
            return document
        if served is None:
            served = next(iter(listed.models), None)
        if served not in listed.models:
            document["error"] = f"{served!r} not served; /v1/models lists {sorted(listed.models)}"
            return document
        document["model"] = served
        say(f"bench {served} at {target.api_url}: {settings.warmups} warm-ups + {settings.runs} runs per prompt")
        for prompt in settings.prompts:
            document["prompts"][prompt] = run_prompt(client, served, prompt, settings, say)
        if settings.concurrency:
            document["concurrency"] = run_concurrency(target.api_url, target.api_key, served, settings, say,
                                                      target.ca_file)
        log = service_log(target, ssh, log_file)
        if target.ssh is not None:
            document["gpus"] = gpu_snapshot(ssh)
        if log is not None:
            try:
                document["spec_decoding"] = [line.strip() for line in log.grep(SPEC_LINE, 3)]
            except RemoteError as exc:
                document["spec_decoding"] = str(exc)
    finally:
        ssh.close()
        client.close()
    return document


def failures(document: dict[str, Any]) -> int:
    count = 1 if document.get("error") else 0
    count += sum(len(p["failures"]) for p in document["prompts"].values())
    count += sum(len(level["failures"]) for level in document["concurrency"])
    return count


# --------------------------------------------------------------------------------------------
# results on disk and the chart


def safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "host"


def save(document: dict[str, Any], results_dir: Path) -> Path:
    stamp = datetime.datetime.fromisoformat(document["time"]).strftime("%Y%m%dT%H%M%SZ")
    directory = results_dir / safe_name(document["host"])
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{stamp}.json"
    number = 1
    while path.exists():  # two runs within one second
        path = directory / f"{stamp}-{number}.json"
        number += 1
    path.write_text(json.dumps(document, indent=2) + "\n")
    return path


def latest_results(results_dir: Path) -> list[dict[str, Any]]:
    """The newest saved result of every (host, variant) under results_dir that measured something."""
    newest: dict[tuple[str, str | None], dict[str, Any]] = {}
    for path in sorted(results_dir.glob("*/*.json")):
        try:
            document = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(document, dict) or document.get("schema") != SCHEMA or document.get("error"):
            continue
        key = (document["host"], document.get("variant"))
        if key not in newest or document["time"] >= newest[key]["time"]:
            newest[key] = document
    return [newest[key] for key in sorted(newest, key=lambda k: (k[0], k[1] or ""))]


def plot(documents: Sequence[dict[str, Any]], path: Path) -> Path | None:
    """Bar chart of decode and wall TPS per (host, variant) and prompt, with std error bars; a
    second panel of aggregate TPS against concurrent streams when measured."""
    documents = [d for d in documents if any(p["summary"]["decode_tps"] for p in d["prompts"].values())]
    if not documents:
        return None
    # here, not at the top: matplotlib (about 0.55 s to import) serves --plot only, and every rigup command
    # imports this module to build its parser; pyplot comes after use("Agg")
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    with_concurrency = [d for d in documents if any(level["aggregate_tps"] for level in d["concurrency"])]
    panels = 2 if with_concurrency else 1
    figure, axes = plt.subplots(1, panels, figsize=(7 * panels, 4.8), squeeze=False)
    bars = axes[0][0]
    prompts = sorted({p for d in documents for p in d["prompts"]}, key=lambda p: list(PROMPTS).index(p))
    labels = [f"{d['host']}\n{d.get('variant') or ''}" for d in documents]
    series = [(p, m) for p in prompts for m in ("decode_tps", "wall_tps")]
    width = 0.8 / len(series)
    for i, (prompt, metric) in enumerate(series):
        means, errors = [], []
        for d in documents:
            stats = (d["prompts"].get(prompt) or {}).get("summary", {}).get(metric)
            means.append(stats["mean"] if stats else 0.0)
            errors.append(stats["std"] if stats else 0.0)
        positions = [x + (i - (len(series) - 1) / 2) * width for x in range(len(documents))]
        drawn = bars.bar(positions, means, width, yerr=errors, capsize=3, label=f"{prompt} {metric.replace('_tps', '')}")
        bars.bar_label(drawn, fmt="%.0f", fontsize=7, padding=2)
    bars.set_xticks(range(len(documents)), labels, fontsize=8)
    bars.set_ylabel("tokens / s (single stream)")
    bars.set_title("Single-stream throughput (mean ± std)")
    bars.set_ylim(0, bars.get_ylim()[1] * 1.25)  # room for the legend above the bars
    bars.legend(fontsize=8, ncols=len(series), loc="upper center")
    bars.grid(axis="y", alpha=0.3)
    if with_concurrency:
        lines = axes[0][1]
        for d in with_concurrency:
            levels = [level for level in d["concurrency"] if level["aggregate_tps"]]
            lines.errorbar(
                [level["streams"] for level in levels],
                [level["aggregate_tps"]["mean"] for level in levels],
                yerr=[level["aggregate_tps"]["std"] for level in levels],
                marker="o",
                capsize=3,
                label=f"{d['host']} {d.get('variant') or ''}",
            )
        lines.set_xticks(sorted({level["streams"] for d in with_concurrency for level in d["concurrency"]}))
        lines.set_xlabel("concurrent streams")
        lines.set_ylabel("aggregate tokens / s")
        lines.set_title("Aggregate throughput under concurrency")
        lines.legend(fontsize=8)
        lines.grid(alpha=0.3)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def render_table(documents: Sequence[dict[str, Any]]) -> str:
    lines = [f"{'HOST':<14} {'VARIANT':<18} {'PROMPT':<6} {'DECODE TPS':<24} {'WALL TPS':<10} {'TTFT s':<8} RUNS"]
    for d in documents:
        if d.get("error"):
            lines.append(f"{d['host']:<14} {d.get('variant') or '-':<18} ERROR  {d['error']}")
            continue
        if d.get("skipped"):
            lines.append(f"{d['host']:<14} {d.get('variant') or '-':<18} -      {d['skipped']}")
            continue
        for prompt, p in d["prompts"].items():
            s = p["summary"]
            decode, wall, ttft = s["decode_tps"], s["wall_tps"], s["ttft_s"]
            decode_text = (
                f"{decode['mean']:.1f} ±{decode['std']:.1f} ({decode['cv_pct']:.1f}%)" if decode else "-"
            )
            wall_text = f"{wall['mean']:.1f}" if wall else "-"
            ttft_text = f"{ttft['mean']:.3f}" if ttft else "-"
            lines.append(
                f"{d['host']:<14} {d.get('variant') or '-':<18} {prompt:<6} {decode_text:<24} "
                f"{wall_text:<10} {ttft_text:<8} {len(p['runs'])}/{len(p['runs']) + len(p['failures'])}"
            )
        for level in d["concurrency"]:
            agg = level["aggregate_tps"]
            text = f"{agg['mean']:.1f} ±{agg['std']:.1f}" if agg else "FAILED"
            lines.append(f"{d['host']:<14} {d.get('variant') or '-':<18} x{level['streams']:<5} aggregate {text}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# CLI


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def cmd_bench(args: argparse.Namespace) -> int:
    settings = BenchSettings(
        prompts=(args.only,) if args.only else tuple(PROMPTS),
        warmups=args.warmups,
        runs=args.runs,
        temperature=args.temperature,
        max_tokens={"narr": args.max_tokens_narr, "code": args.max_tokens_code},
        ignore_eos=args.ignore_eos,
        timeout_s=args.timeout,
        concurrency=args.concurrency or (),
        concurrency_runs=args.concurrency_runs,
    )
    try:
        targets = api_targets(args.url, args.api_key_file, args.limit, args.ca_file)
    except (RemoteError, ValueError) as exc:
        print(f"rigup bench: {exc}", file=sys.stderr)
        return 2
    quiet = args.quiet
    documents = parallel(targets, lambda t: bench_target(t, settings, args.log_file, args.model, quiet))
    results_dir = Path(args.results_dir)
    saved = [save(d, results_dir) for d in documents if not args.no_save]
    chart = None
    if not args.no_chart:
        chart_path = Path(args.chart) if args.chart else results_dir / f"chart-{saved[0].stem if saved else 'latest'}.png"
        chart = plot(latest_results(results_dir) if saved else documents, chart_path)
    if args.json:
        print(json.dumps({"results": documents, "saved": [str(p) for p in saved], "chart": str(chart) if chart else None}, indent=2))
    else:
        print(render_table(documents))
        for path in saved:
            print(f"saved {path}")
        if chart is not None:
            print(f"chart {chart}")
    return 1 if any(failures(d) for d in documents) else 0


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "bench",
        help="measure single-stream and concurrent throughput of every rig (bench.sh)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_target_arguments(parser, url_help="bench this API base URL instead of the fleet", json_help="print the results as JSON")
    parser.add_argument("--model", help="served model name (default: the recipe's, or the first /v1/models lists)")
    parser.add_argument("--log-file", help="read SpecDecoding lines from this local file instead of journalctl")
    parser.add_argument("--only", choices=tuple(PROMPTS), help="one prompt only (ONLY=narr|code)")
    parser.add_argument("--warmups", type=int, default=3, help="warm-up runs per prompt (default 3)")
    parser.add_argument("--runs", type=int, default=5, help="measured runs per prompt (default 5)")
    parser.add_argument("--temperature", type=float, default=0.6, help="sampling temperature (default 0.6)")
    parser.add_argument("--max-tokens-narr", type=int, default=PROMPTS["narr"].max_tokens, help="default 1000")
    parser.add_argument("--max-tokens-code", type=int, default=PROMPTS["code"].max_tokens, help="default 800")
    parser.add_argument("--ignore-eos", action="store_true", help="forced length: always generate max_tokens")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request (default 600)")
    parser.add_argument("--concurrency", type=_int_list, metavar="N,N,...", help="aggregate TPS at these stream counts")
    parser.add_argument("--concurrency-runs", type=int, default=3, help="rounds per stream count (default 3)")
    parser.add_argument("--results-dir", default=str(DEFAULT_RESULTS_DIR), help="where results are saved (default results/bench)")
    parser.add_argument("--chart", help="PNG path (default <results-dir>/chart-<time>.png)")
    parser.add_argument("--no-save", action="store_true", help="do not write JSON results")
    parser.add_argument("--no-chart", action="store_true", help="do not draw the chart")
    parser.set_defaults(func=cmd_bench)
    return parser
