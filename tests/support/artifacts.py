"""Shared helpers for the artifact tests (rigfetch, lock, git and model operations): a small fake hub and
manifests built from what it serves."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from rigup.rig.onefile import write_rigfetch
from rigup_testbed import hfhub

REPO_ROOT = Path(__file__).resolve().parents[2]
RIGFETCH = write_rigfetch()  # the zipapp the tasks upload
QWEN = hfhub.SANDBOX_QWEN
DFLASH = hfhub.SANDBOX_QWEN_DFLASH
GATED = hfhub.SANDBOX_GATED
SHARD1 = "model-00001-of-00002.safetensors"
SHARD2 = "model-00002-of-00002.safetensors"
TOKEN = "hf_rigup_artifacts_token"


def hub_spec() -> dict[str, Any]:
    # Shard 1: 2.4 MB, shard 2: 0.8 MB, DFlash draft: 0.6 MB: big enough for several 1 MiB reads.
    return hfhub.sandbox_spec(scale=0.02)


def commit_files(hub: hfhub.HfHub, repo: str, index: int = -1) -> tuple[str, dict[str, dict[str, Any]]]:
    """(commit sha, {path: {size, sha256, lfs, oid}}) of one commit of a hub repo."""
    info = hub.admin().repos()[repo]["commits"][index]
    return info["sha"], info["files"]


def model_entry(hub: hfhub.HfHub, repo: str, dest: Path, index: int = -1, name: str | None = None) -> dict[str, Any]:
    sha, files = commit_files(hub, repo, index)
    return {
        "name": name or dest.name,
        "dir": str(dest),
        "hub_url": f"{hub.url}/{repo}/resolve/{sha}/",
        "files": [{"path": p, "size": f["size"], "sha256": f["sha256"]} for p, f in sorted(files.items())],
    }


def manifest(state_dir: Path, *models: dict[str, Any], reserve_bytes: int = 0) -> dict[str, Any]:
    return {"version": 1, "state_dir": str(state_dir), "reserve_bytes": reserve_bytes, "models": list(models)}


def run_rigfetch(
    man: dict[str, Any],
    *args: str,
    secrets: dict[str, str] | None = None,
    timeout: float = 60,
    path: Path | None = None,
) -> tuple[int, list[dict[str, Any]], str]:
    """Run the real script as the rig would; returns (exit code, JSON lines from stdout, stderr)."""
    man_path = path or Path(man["state_dir"]).parent / "manifest.json"
    man_path.parent.mkdir(parents=True, exist_ok=True)
    man_path.write_text(json.dumps(man))
    cmd = [sys.executable, str(RIGFETCH), "--manifest", str(man_path), "--retry-delay", "0.05", "--quiet", *args]
    stdin = None
    if secrets is not None:
        cmd.append("--secrets-stdin")
        stdin = json.dumps(secrets) + "\n"
    proc = subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=timeout, env={**os.environ})
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return proc.returncode, lines, proc.stderr


def sha256_file(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()
