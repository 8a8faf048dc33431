"""Start rigup_testbed/openai_responder.py as a real process on loopback for the client, verify and
bench tests (a separate process, so its timings are not disturbed by the test's own threads)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from rigup_testbed import RESPONDER_SCRIPT

RESPONDER = RESPONDER_SCRIPT
MODEL = "qwen3.6-27b-autoround"


@dataclass(frozen=True)
class Responder:
    url: str
    log_file: Path
    process: subprocess.Popen[str]


@contextmanager
def responder(tmp_path: Path, *flags: str, model: str = MODEL) -> Iterator[Responder]:
    log_file = tmp_path / f"responder-{time.monotonic_ns()}.log"
    process = subprocess.Popen(
        [sys.executable, str(RESPONDER), "--port", "0", "--model", model, "--log-file", str(log_file), *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()  # "listening on http://127.0.0.1:PORT", printed once bound
        if not line.startswith("listening on "):
            process.kill()
            raise RuntimeError(f"responder did not start: {line!r} {process.stderr.read() if process.stderr else ''}")
        yield Responder(line.split()[-1], log_file, process)
    finally:
        process.terminate()
        process.wait(timeout=10)
