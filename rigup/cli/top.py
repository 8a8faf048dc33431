"""`rigup top`: a live view of the fleet in the terminal, redrawn every few seconds.

Per pod: requests running and waiting, generated and prompt tokens per second, time to first token
(p50, p95) and KV-cache use. Per gateway route (a pod behind the entrance's router of its model): its name,
its answers per second and its state now as the router says (vllm-router's vllm_router_worker_health and
vllm_router_cb_state on the entrance's /metrics/: healthy, out of rotation, circuit open or half-open). The
columns fit the terminal: short headers first, then the least useful columns go; host, pod and state always show.

Where it reads: the fleet's Prometheus (the first host of monitor_group, by default gateway_group's,
at prometheus_listen_address) through its HTTP API over TLS with the metrics login, or the one --prometheus
names. With --direct, or when the fleet has no monitor host, the targets themselves: each pod's /metrics,
each rig's GPU exporter (gpu_exporter_port, when metrics_exporters is on: TLS and the metrics login, as
the converge left them beside the fleet file) and each gateway's /metrics/ with the gateway key.
Read directly, rates and quantiles are the difference between two scrapes, so the first frame shows
"-" for them. When the fleet's Prometheus does not answer, the frame is read directly and the header
says why. A target that does not answer is a row saying so.

q or Ctrl-C quits (exit 0). --once prints one frame (direct: after two scrapes --interval apart) and exits
0 when every target answered, 1 when one did not; 2: the fleet file or --limit could not be used (one
line says why).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import select
import sys
import termios
import time
import tty
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from rigup.cli.runner import add_target_arguments, progress
from rigup.client.fleet_metrics import (
    OUT_OF_ROTATION,
    QUARANTINED,
    UP,
    Frame,
    GpuRow,
    PodRow,
    RouteRow,
    Source,
)
from rigup.client.ssh import RemoteError
from rigup.client.top_sources import fleet_source

EXIT_UNANSWERED = 1  # --once: a target (or the Prometheus the frame came from) did not answer
EXIT_BAD_FLEET = 2  # the fleet file or --limit could not be used
EXIT_INTERRUPTED = 130  # --once stopped by Ctrl-C before its frame (a live view's Ctrl-C is its way out: 0)
DEFAULT_INTERVAL_S = 2.0
BATCH_WIDTH = 160  # columns of a frame written to a file or pipe
WIDE_COLUMN = 40  # characters of a state, model, route or URL column (a longer one ends in ...)
MAX_TIMEOUT_S = 5.0  # a scrape or query waits at most this long (and never longer than the interval)

# --------------------------------------------------------------------------------------------------
# drawing


def _num(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def seconds_text(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"


def memory_text(used: float | None, free: float | None, unit: str = " GiB") -> str:
    if used is None:
        return "-"
    if free is None:
        return f"{used / 1024:.1f}{unit}"
    return f"{used / 1024:.1f}/{(used + free) / 1024:.1f}{unit}"


def _state_style(state: str, answered: bool) -> str:
    if not answered or state.startswith((OUT_OF_ROTATION, QUARANTINED)):
        return "bold red"
    if state in (UP, "healthy"):
        return "green"
    return "yellow"


def short_route(name: str) -> str:
    """rig-01/rigup-dual.service -> rig-01/dual: rigup names every unit rigup-<pod>.service."""
    host, _, unit = name.rpartition("/")
    short = unit.removeprefix("rigup-").removesuffix(".service")
    return f"{host}/{short}" if host else short


def short_gpu_name(name: str) -> str:
    """NVIDIA GeForce RTX 3090 -> RTX 3090."""
    for prefix in ("NVIDIA GeForce ", "NVIDIA "):
        if name.startswith(prefix):
            return name.removeprefix(prefix)
    return name


@dataclass(frozen=True)
class Column:
    header: str
    short: str  # its header when the terminal is narrow
    justify: str = "left"
    drop: int = 0  # 1: the first to go when the terminal is narrow, 2 the next, ...; 0: never (host, pod, state)


@dataclass(frozen=True)
class Cell:
    text: str
    short: str | None = None  # the value when the terminal is narrow (a shorter form of the same name)
    style: str | None = None

    def shown(self, narrow: bool) -> str:
        return self.short if narrow and self.short is not None else self.text


COLUMN_GAP = 2  # a table's columns are this far apart (show_edge off, paddings collapsed)


def table_width(columns: Sequence[Column], rows: Sequence[Sequence[Cell]], keep: Sequence[int], narrow: bool) -> int:
    from rich.cells import cell_len  # deferred with rich.console: see tests/test_layout.py DEFERRED_IMPORTS

    widths = [max([cell_len(columns[i].short if narrow else columns[i].header),
                   *(cell_len(row[i].shown(narrow)) for row in rows)]) for i in keep]
    return sum(widths) + COLUMN_GAP * (len(widths) - 1)


def fit_columns(columns: Sequence[Column], rows: Sequence[Sequence[Cell]], width: int) -> tuple[list[int], bool]:
    """Which columns to show in `width` characters, and whether in their short forms: every column at
    ease; else short headers and names; else without the least useful column, then the next. A column
    that never drops stays; when even they do not fit, those alone (the terminal wraps nothing: the
    state column folds)."""
    keep = list(range(len(columns)))
    if table_width(columns, rows, keep, False) <= width:
        return keep, False
    for column in sorted((c for c in columns if c.drop), key=lambda c: c.drop):
        if table_width(columns, rows, keep, True) <= width:
            break
        keep.remove(columns.index(column))
    return keep, True


def fitted_table(title: str, columns: Sequence[Column], rows: Sequence[Sequence[Cell]], width: int,
                 empty: str) -> Any:
    from rich import box  # deferred: see table_width()
    from rich.table import Table
    from rich.text import Text

    keep, narrow = fit_columns(columns, rows, width)
    hidden = len(columns) - len(keep)
    more = f" ({hidden} more column{'s' if hidden > 1 else ''} in a wider terminal)" if hidden else ""
    table = Table(title=title + more,
                  title_justify="left", title_style="bold", box=box.SIMPLE_HEAD, show_edge=False,
                  collapse_padding=True, pad_edge=False)
    for i in keep:
        column = columns[i]
        # a column that never drops folds rather than ends in "…": what is cut is lost to the reader
        table.add_column(column.short if narrow else column.header, justify=column.justify,  # type: ignore[arg-type]
                         no_wrap=bool(column.drop), overflow="ellipsis" if column.drop else "fold")
    for row in rows:
        table.add_row(*(Text(row[i].shown(narrow), style=row[i].style or "") for i in keep))
    if not rows:
        table.caption, table.caption_justify = empty, "left"
    return table


POD_COLUMNS = (
    Column("HOST", "HOST"), Column("POD", "POD"), Column("MODEL", "MODEL", drop=1), Column("STATE", "STATE"),
    Column("RUN", "RUN", "right", drop=8), Column("WAIT", "WAIT", "right", drop=6),
    Column("GEN TOK/S", "GEN/S", "right", drop=7), Column("PROMPT TOK/S", "PROMPT/S", "right", drop=2),
    Column("TTFT P50", "TTFT50", "right", drop=5), Column("TTFT P95", "TTFT95", "right", drop=3),
    Column("KV CACHE", "KV", "right", drop=4),
)
GPU_COLUMNS = (
    Column("HOST", "HOST"), Column("GPU", "GPU", "right", drop=6), Column("NAME", "NAME", drop=1),
    Column("STATE", "STATE"), Column("UTIL", "UTIL", "right", drop=5), Column("MEMORY", "MEMORY", "right", drop=4),
    Column("TEMP", "TEMP", "right", drop=3), Column("POWER", "POWER", "right", drop=2),
)
ROUTE_COLUMNS = (
    Column("GATEWAY", "GW", drop=3), Column("MODEL", "MODEL", drop=2), Column("ROUTE", "ROUTE"),
    Column("API BASE", "API BASE", drop=1), Column("STATE", "STATE"), Column("OK/S", "OK/S", "right"),
    Column("FAIL/S", "FAIL/S", "right"),
)


def pod_cells(p: PodRow) -> list[Cell]:
    return [Cell(p.host), Cell(p.pod), Cell(p.model or "-"), Cell(p.state, style=_state_style(p.state, p.answered)),
            Cell(_num(p.running, ".0f")), Cell(_num(p.waiting, ".0f")), Cell(_num(p.generation_tps, ".1f")),
            Cell(_num(p.prompt_tps, ".1f")), Cell(seconds_text(p.ttft_p50_s)), Cell(seconds_text(p.ttft_p95_s)),
            Cell(_num(None if p.kv_usage is None else p.kv_usage * 100, ".1f", "%"))]


def gpu_cells(g: GpuRow) -> list[Cell]:
    return [Cell(g.host), Cell(g.gpu or "-"), Cell(g.name or "-", short_gpu_name(g.name or "-")),
            Cell(g.state, style=_state_style(g.state, g.answered)), Cell(_num(g.util_pct, ".0f", "%")),
            Cell(memory_text(g.mem_used_mib, g.mem_free_mib), memory_text(g.mem_used_mib, g.mem_free_mib, "G")),
            Cell(_num(g.temp_c, ".0f", " C")), Cell(_num(g.power_w, ".0f", " W"))]


def route_cells(r: RouteRow) -> list[Cell]:
    return [Cell(r.gateway), Cell(r.model or "-"), Cell(r.route or "-", short_route(r.route) if r.route else None),
            Cell(r.api_base or "-"), Cell(r.state, style=_state_style(r.state, r.answered)),
            Cell(_num(r.success_rps, ".2f")), Cell(_num(r.failure_rps, ".2f"))]


def header_line(frame: Frame, interval: float, live: bool, width: int) -> tuple[Any, str | None]:
    """The frame's first line, as much as `width` holds (richest first), and the line that says why the
    source is what it is when the header has no room for it."""
    from rich.cells import cell_len  # deferred: see table_width()
    from rich.text import Text

    when = time.localtime(frame.taken_at)
    source, _, why = frame.source.partition(" (")
    why = f"({why}" if why else ""
    keys = "q or Ctrl-C quits" if live else ""
    every = f"every {interval:g} s" if live else ""
    variants = [
        (frame.source, time.strftime("%Y-%m-%d %H:%M:%S", when), ", ".join(p for p in (every, keys) if p), None),
        (frame.source, time.strftime("%H:%M:%S", when), keys, None),
        (source, time.strftime("%H:%M:%S", when), keys, why or None),
        (source, time.strftime("%H:%M:%S", when), "q quits" if live else "", why or None),
        (source, "", "", why or None),
    ]
    for text, at, tail, note in variants:  # the last one, cut to the width, when none fits
        if cell_len("  ".join(p for p in ("rigup top", text, at, tail) if p)) <= width:
            break
    header = Text.assemble(("rigup top", "bold"), *(f"  {p}" for p in (text, at) if p))
    if tail:
        header.append(f"  {tail}", style="dim")
    header.truncate(width, overflow="ellipsis")
    return header, note


def render(frame: Frame, interval: float, live: bool, width: int = BATCH_WIDTH) -> Any:
    """The frame as rich renderables `width` characters wide: a header line and the pods', GPUs' and
    routes' tables, each with the columns that fit (fit_columns)."""
    from rich.console import Group  # deferred: see table_width()
    from rich.text import Text

    header, why = header_line(frame, interval, live, width)
    parts: list[Any] = [header]
    if why:
        parts.append(Text(why, style="yellow"))
    if frame.first_scrape:
        parts.append(Text("rates and TTFT need a second scrape: \"-\" until the next frame", style="dim"))
    for note in frame.notes:
        parts.append(Text(note, style="yellow"))
    for title, columns, rows, what in (
        ("Pods", POD_COLUMNS, [pod_cells(p) for p in frame.pods], "pods"),
        ("GPUs", GPU_COLUMNS, [gpu_cells(g) for g in frame.gpus], "GPU exporters"),
        ("Gateway routes", ROUTE_COLUMNS, [route_cells(r) for r in frame.routes], "gateways"),
    ):
        parts += [Text(""), fitted_table(title, columns, rows, width, f"no {what} in the selection")]
    return Group(*parts)


def frame_document(frame: Frame) -> dict[str, Any]:
    def clean(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, list):
            return [clean(v) for v in value]
        return value

    document = clean(asdict(frame))
    document["unanswered"] = frame.unanswered
    return document


# --------------------------------------------------------------------------------------------------
# the command


def cmd_top(args: argparse.Namespace) -> int:
    interval = args.interval
    timeout = max(0.5, min(MAX_TIMEOUT_S, interval))
    try:
        source = fleet_source(args.fleet, args.limit, direct=args.direct, prometheus=args.prometheus, timeout=timeout)
    except (RemoteError, ValueError) as exc:
        print(f"rigup top: {exc}", file=sys.stderr)
        return EXIT_BAD_FLEET
    if args.once or args.json:
        try:
            return once(source, args)
        except KeyboardInterrupt:
            return EXIT_INTERRUPTED
    return watch(source, interval)


def once(source: Source, args: argparse.Namespace) -> int:
    frame = source.frame()
    if frame.first_scrape:
        if not (args.quiet or args.json):
            progress(f"rigup top: {frame.source}: scraping again in {args.interval:g} s for rates and quantiles ...")
        time.sleep(args.interval)
        frame = source.frame()
    if args.json:
        print(json.dumps(frame_document(frame), indent=2))
    else:
        console = make_console()
        console.print(render(frame, args.interval, live=False, width=console.width))
    return EXIT_UNANSWERED if frame.unanswered else 0


def make_console() -> Any:
    """The terminal; a file or pipe gets lines of at least BATCH_WIDTH (rich would assume 80)."""
    from rich.console import Console  # deferred: see table_width()

    console = Console()
    return console if console.is_terminal else Console(width=max(console.width, BATCH_WIDTH))


QUIT_KEYS = frozenset("qQ")
KEY_POLL_S = 0.2  # how soon a key or a resized terminal is seen between frames


class Keys:
    """The terminal's keys as they are typed (cbreak mode: no Enter needed; Ctrl-C still interrupts),
    the terminal's settings restored on the way out."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.saved: list[Any] | None = None
        self.closed = False

    def __enter__(self) -> Keys:
        self.saved = termios.tcgetattr(self.fd)
        tty.setcbreak(self.fd, termios.TCSANOW)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.saved is not None:
            termios.tcsetattr(self.fd, termios.TCSADRAIN, self.saved)

    def read(self, timeout: float) -> str:
        """What was typed within `timeout` seconds ("" for nothing)."""
        if self.closed:
            time.sleep(timeout)
            return ""
        ready, _, _ = select.select([self.fd], [], [], max(0.0, timeout))
        if not ready:
            return ""
        typed = os.read(self.fd, 64)
        self.closed = not typed  # the end of input: wait out the interval from now on
        return typed.decode(errors="replace")


def watch(source: Source, interval: float) -> int:
    """Redraw until q or Ctrl-C; on a terminal in its alternate screen (as top does), laid out again when
    the terminal is resized; else frame after frame."""
    from rich.live import Live  # deferred: see table_width()
    from rich.text import Text

    console = make_console()
    try:
        if not console.is_terminal:
            while True:
                started = time.monotonic()
                console.print(render(source.frame(), interval, live=True, width=console.width))
                time.sleep(max(0.0, interval - (time.monotonic() - started)))
        keys = Keys(sys.stdin.fileno()) if sys.stdin.isatty() else None
        with keys or contextlib.nullcontext(), Live(Text(f"rigup top: reading {source.description} ..."),
                                                    console=console, screen=True, auto_refresh=False) as live:
            while True:
                started = time.monotonic()
                frame = source.frame()
                size = console.size
                live.update(render(frame, interval, live=True, width=size.width), refresh=True)
                while (left := interval - (time.monotonic() - started)) > 0:
                    typed = keys.read(min(left, KEY_POLL_S)) if keys else ""
                    if keys is None:
                        time.sleep(min(left, KEY_POLL_S))
                    if QUIT_KEYS & set(typed):
                        return 0
                    if console.size != size:  # resized: this frame laid out again at once
                        size = console.size
                        live.update(render(frame, interval, live=True, width=size.width), refresh=True)
    except KeyboardInterrupt:
        return 0


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not math.isfinite(value) or value < 0.2:
        raise argparse.ArgumentTypeError(f"expected at least 0.2 seconds, got {text!r}")
    return value


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `top [--fleet FILE] [--limit HOST ...] [--interval S] [--once] [--direct | --prometheus URL] [--json]`."""
    parser = subparsers.add_parser(
        "top",
        help="a live view of the fleet: pods' requests, tokens/s, TTFT and KV cache, GPUs, gateway routes",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--fleet", metavar="FILE", help="fleet file (default: $RIGUP_RIGS, else rigs.yaml)")
    add_target_arguments(parser, json_help="print one frame as JSON (implies --once)")
    parser.add_argument("--interval", type=positive_seconds, default=DEFAULT_INTERVAL_S, metavar="S",
                        help=f"seconds between frames (default {DEFAULT_INTERVAL_S:g})")
    parser.add_argument("--once", action="store_true",
                        help="print one frame and exit (exit 1 when a target did not answer)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--direct", action="store_true", help="scrape the targets' /metrics, not the fleet's Prometheus")
    where.add_argument("--prometheus", metavar="URL", help="read this Prometheus (e.g. http://10.0.0.5:9090)")
    parser.set_defaults(func=cmd_top)
    return parser

