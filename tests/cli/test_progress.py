"""Progress lines of hosts worked on at once never share a line (rigup.cli.runner.progress, which
status, verify and bench print theirs through)."""

from __future__ import annotations

import re
import sys
import threading
import time

import pytest

from rigup.cli.runner import parallel, progress


class SlowStream:
    """A stderr that gives other threads a chance at every write, as a terminal under load does."""

    def __init__(self) -> None:
        self.chunks: list[str] = []

    def write(self, text: str) -> int:
        time.sleep(0.0001)
        self.chunks.append(text)
        return len(text)

    def flush(self) -> None:
        time.sleep(0.0001)


def test_lines_of_hosts_in_parallel_each_end_before_the_next_begins(monkeypatch: pytest.MonkeyPatch) -> None:
    # Was: print() wrote each line's text and its newline apart, and the 16 hosts' lines ran together
    # ("TTFT 0.013 s[rig-03/left] narr run 3/5").
    stream = SlowStream()
    monkeypatch.setattr(sys, "stderr", stream)
    hosts = [f"rig-{i:02d}" for i in range(16)]
    start = threading.Barrier(len(hosts))

    def work(host: str) -> None:
        start.wait()
        for run in range(40):
            progress(f"[{host}] narr run {run}/40: TTFT 0.013 s")

    parallel(hosts, work)
    lines = "".join(stream.chunks).split("\n")
    assert lines[-1] == ""
    bad = [line for line in lines[:-1] if not re.fullmatch(r"\[rig-\d\d\] narr run \d+/40: TTFT 0\.013 s", line)]
    assert not bad, bad[:5]
    assert len(lines) - 1 == 16 * 40


def test_a_line_ends_once_even_when_given_its_newline() -> None:
    stream = SlowStream()
    original, sys.stderr = sys.stderr, stream
    try:
        progress("[rig-01] done\n")
    finally:
        sys.stderr = original
    assert "".join(stream.chunks) == "[rig-01] done\n"
