"""tasks/serving.py through the real pyinfra CLI on a @fake host (every command succeeds with empty
output, so the rig looks brand new): the commands it would run, in order, and no secret in them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rigup import REPO_ROOT
from rigup.desired.knobs import load_defaults
from rigup.desired.lock import FilePin, GitNeed, GitPin, ImagePin, LockFile, ModelNeed, ModelPin
from rigup.desired.needs import needs_for
from rigup.desired.recipe import resolve
from rigup.desired.upstream import TREES_ENV

API_KEY = "sk-task-test-5e1f0c2d9a"
PYINFRA = str(Path(sys.executable).with_name("pyinfra"))


def write_lock(path: Path, variant: str) -> None:
    data = load_defaults()
    data["variant"] = variant
    lock = LockFile()
    for need in needs_for(resolve(data), data):
        if isinstance(need, GitNeed):
            lock.git[need.name] = GitPin(need.name, need.url, need.ref, need.ref if len(need.ref) == 40 else "1" * 40)
        elif isinstance(need, ModelNeed):
            lock.models[need.name] = ModelPin(need.name, need.repo_id, need.revision, "2" * 40, (FilePin("config.json", 10, "3" * 64),))
        else:
            lock.images[need.name] = ImagePin(need.name, need.repository, need.tag, None)
    lock.save(path)


@pytest.fixture
def inventory(tmp_path: Path) -> Path:
    write_lock(tmp_path / "rigs.lock.yaml", "dual")
    key = tmp_path / "api.key"
    key.write_text(API_KEY + "\n")
    key.chmod(0o600)
    inv = tmp_path / "inventory.py"
    inv.write_text(
        "rigs = [('@fake/rig-01', {'fake_delay': 0, 'fake_delay_jitter': 0, 'variant': 'dual', "
        f"'lock_file': {str(tmp_path / 'rigs.lock.yaml')!r}, 'serving_api_key_file': {str(key)!r}, "
        "'serving_health_timeout_s': 60})]\n"
    )
    return inv


def test_serving_task_on_a_fresh_rig(inventory: Path):
    proc = subprocess.run(
        [PYINFRA, "-y", "-vv", str(inventory), "tasks/serving.py"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, env={"PATH": "/usr/bin:/bin", "HOME": "/root", TREES_ENV: os.environ[TREES_ENV]},
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    assert API_KEY not in output
    commands = [line.split(">>> ", 1)[1] for line in output.splitlines() if ">>> " in line]
    wanted = [
        "docker pull docker.io/vllm/vllm-openai:",
        "umask 077 && tmp=$(mktemp /opt/rigup/variants/dual/.env.XXXXXX)",
        "systemctl start rigup-dual.service",
        "systemctl enable rigup-dual.service",
        "python3 /opt/rigup/bin/rigup-servingctl gate --release /opt/rigup/variants/dual/release.json --timeout 60 --keep 2",
    ]
    positions = []
    for prefix in wanted:
        matches = [i for i, c in enumerate(commands) if c.startswith(prefix)]
        assert matches, f"no command starting with {prefix!r}"
        positions.append(matches[0])
    assert positions == sorted(positions), "pull, write .env, start, enable, gate: in that order"
    # A brand-new unit is started without a daemon-reload (systemd reported none needed), and the
    # image is pulled before any file of the release is written.
    assert not any(c.startswith(("systemctl daemon-reload", "systemctl reset-failed")) for c in commands)
    assert "Write the compose file" in output and "Ensure the variant serves its recorded release" in output
