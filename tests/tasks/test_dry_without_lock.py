"""The whole deploy.py through the real pyinfra CLI (in a subprocess) on @fake rigs, one without a lock
file (rig-nolock) beside one with a lock (rig-locked):

  --dry   plans every phase that needs no pins on both rigs, and for sources, model and serving says
          once per phase, for the rig without a lock, that it is skipped, what the lock pins and the
          command that makes it; the rig with a lock is planned to the end, fleet plan included.
  a real run stops at sources of the rig without a lock with the same explanation (DeployError),
          before any operation runs on any rig.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rigup import REPO_ROOT
from rigup.desired.knobs import load_defaults
from rigup.pyinfra_patches.fact_batching import is_fact_batch
from tests.support.fit_fake import offline_lock

# What the deploy (run in REPO_ROOT by this venv's pyinfra) prints as the command that writes the lock.
LOCK_COMMAND = f"{os.path.relpath(Path(sys.executable).with_name('rigup'), REPO_ROOT)} lock"

NOLOCK, LOCKED = "@fake/rig-nolock", "@fake/rig-locked"

INVENTORY = """
from tests.tasks.test_hostlayer_fake import responses
base = {{"fake_delay": 0, "fake_delay_jitter": 0, "variant": "dual"}}
# BoundaryView: each rig resolves the other (the model chain's server admits its peers)
boundary = {{"==> control": ["==> control 192.0.2.10", "==> peer {nolock} 192.0.2.11", "==> peer {locked} 192.0.2.12"]}}
locked = {{
    **responses("converged"),
    **boundary,
    "echo state=absent": ["state=absent"],  # GitCheckout: no checkout yet
    "--check --manifest-b64": ['{{"script": "stale"}}'],  # ModelFiles: rigfetch not uploaded yet
}}
rigs = [
    ("{nolock}", {{**base, "fake_responses": {{**responses("converged"), **boundary}}, "lock_file": {missing!r}}}),
    ("{locked}", {{**base, "fake_responses": locked, "lock_file": {lock!r}}}),
]
"""

# commands that change a rig (not the capability probe, which names apt-get as a tool it looks for)
CHANGING = r"apt-get (-y|-q|install|update|remove|purge)|apt-mark (un)?hold|sed -i|systemctl (start|stop|restart|enable)"
EARLIER = ("tasks/preflight.py", "tasks/nvidia_driver.py", "tasks/docker.py", "tasks/container_toolkit.py")
PINNED = ("tasks/sources.py", "tasks/model.py", "tasks/serving.py")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory):
    tmp_path = tmp_path_factory.mktemp("dry-no-lock")
    lock = offline_lock({**load_defaults(), "variant": "dual"}, tmp_path / "rigs.lock.yaml")
    missing = tmp_path / "elsewhere" / "rigs.lock.yaml"
    (tmp_path / "inventory.py").write_text(
        textwrap.dedent(INVENTORY.format(nolock=NOLOCK, locked=LOCKED, missing=str(missing), lock=str(lock)))
    )

    def invoke(*args: str) -> dict:
        out = tmp_path / "result.json"
        subprocess.run(
            [sys.executable, "-m", "tests.support.fake_cli_runner", str(out), *args,
             str(tmp_path / "inventory.py"), str(REPO_ROOT / "deploy.py")],
            cwd=REPO_ROOT,  # group_data/, files/, templates/ and deploy.py's includes resolve from there
            check=True,
            timeout=180,
        )
        result = json.loads(out.read_text())
        result["missing"] = str(missing)
        return result

    return invoke


def _planned(output: str, task: str, host: str) -> list[str]:
    """Rows of pyinfra's "Detected changes" table for `task` that name `host`."""
    return [line for line in output.splitlines() if line.strip().startswith(f"{task} | ") and host in line]


def test_dry_run_without_a_lock_plans_what_needs_no_pins_and_says_what_the_lock_is_for(run) -> None:
    result = run("--dry")
    output = result["output"]
    assert result["exit_code"] == 0 and result["exception"] is None, output[-4000:]
    assert result["failed_hosts"] == []
    assert "Traceback" not in output

    warnings = [line.strip() for line in output.splitlines() if "SKIPPED in this dry run" in line]
    assert len(warnings) == 3, warnings  # one per phase that needs pins, none for the rig with a lock
    sources, model, serving = warnings
    for line, phase in zip(warnings, ("SOURCES", "MODEL", "SERVING")):
        assert line.startswith(f"[{NOLOCK}] {phase} SKIPPED in this dry run"), line
        assert f"{result['missing']}: lock file not found" in line
        assert f"`{LOCK_COMMAND}`" in line
    assert "the git commits of vllm-fork (marlin-pad-sub-tile-n) that variant dual checks out" in sources
    assert "the model revisions of Lorbus/Qwen3.6-27B-int4-AutoRound and the SHA-256 of every file" in model
    assert re.search(r"the image digest of vllm/vllm-openai:\S+ and the release", serving), serving

    # The phases before sources were planned on both rigs ...
    assert {name.split(" | ")[0] for name in result["op_parallel"]} >= set(EARLIER)
    for task in EARLIER[1:]:  # preflight's one operation changes nothing, so the table names no host
        assert _planned(output, task, NOLOCK) and _planned(output, task, LOCKED), task
    # ... and the phases that need pins only on the rig with a lock.
    for task in PINNED:
        assert _planned(output, task, LOCKED), task
        assert not _planned(output, task, NOLOCK), task
    # A dry run runs facts only (a batch of them included: rigup.pyinfra_patches.fact_batching).
    for commands in result["commands"].values():
        assert not [c for c in commands if not is_fact_batch(c) and re.search(r"apt-get (-y .*)?install|git clone|docker pull|systemctl (start|restart)", c)]


def test_real_run_without_a_lock_stops_at_sources_with_the_explanation(run) -> None:
    result = run("-y")
    output = result["output"]
    assert result["exit_code"] == 1
    assert result["exception"] is not None and "DeployError" in result["exception"], result["exception"]
    message = result["exception"]
    assert f"{NOLOCK}: sources cannot run: it needs the lock, which pins the git commits of vllm-fork" in message
    assert f"{result['missing']}: lock file not found" in message and f"`{LOCK_COMMAND}`" in message
    assert "SKIPPED in this dry run" not in output
    assert "Beginning operation run" not in output  # nothing ran on any rig
    for commands in result["commands"].values():
        assert not [c for c in commands if not is_fact_batch(c) and re.search(CHANGING, c)]
