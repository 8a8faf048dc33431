"""scripts/check-fact-batch on this machine: the facts a converge reads, batched, equal each read alone
(the device's GPU host runs the same script against real nvidia-smi)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "check-fact-batch"


def test_batched_facts_equal_facts_read_alone_here() -> None:
    env = {k: v for k, v in os.environ.items() if k != "RIGUP_FACT_RECORDS"}
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[-1] == "RESULT ok"
    assert not [line for line in lines if line.startswith("DIFFERENT")]
    # every fact of the list came back from the one batch of the second run
    assert "0 read alone, 1 commands" in lines[-3], lines[-3]
