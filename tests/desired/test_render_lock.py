"""`rigup render --lock FILE` renders the lock's pins (image digest, model revision, source commits)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import yaml

from rigup.cli.render import add_parser
from rigup.desired.knobs import load_defaults
from rigup.desired.lock import FilePin, GitPin, ImagePin, LockFile, ModelPin

TAG = "nightly-7a1eb8ac2ec4ea69338c51dc7afd4b15010abfa8"
DIGEST = "sha256:" + "ab" * 32
FORK = "1" * 40
REV = "2" * 40
SPRING = "2e934ad18ad70d98e2e314ca3a96759935393949"  # the catalog's club3090-spring snapshot


def run_render(*args: str) -> int:
    parser = argparse.ArgumentParser(prog="rigup")
    add_parser(parser.add_subparsers(dest="command"))
    parsed = parser.parse_args(["render", *args])
    return int(parsed.func(parsed))


def write_lock(path: Path, with_model: bool = True) -> Path:
    knobs = load_defaults()
    lock = LockFile()
    lock.images[f"image:vllm/vllm-openai:{TAG}"] = ImagePin(f"image:vllm/vllm-openai:{TAG}", "vllm/vllm-openai", TAG, DIGEST)
    lock.git["git:vllm-fork"] = GitPin("git:vllm-fork", knobs["vllm_fork_git_url"], "marlin-pad-sub-tile-n", FORK)
    # The recipe repository the variant's compose file is read from is pinned too.
    lock.git["git:club3090-spring"] = GitPin("git:club3090-spring", knobs["club3090_git_url"], SPRING, SPRING)
    if with_model:
        name = "model:Lorbus/Qwen3.6-27B-int4-AutoRound"
        lock.models[name] = ModelPin(name, "Lorbus/Qwen3.6-27B-int4-AutoRound", "main", REV,
                                     (FilePin("model.safetensors", 10, "c" * 64),))
    lock.save(path)
    return path


def test_render_shows_locked_pins(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lock = write_lock(tmp_path / "rigs.lock.yaml")
    assert run_render("dual", "--out", str(tmp_path / "out"), "--lock", str(lock)) == 0
    compose = (tmp_path / "out/opt/rigup/variants/dual/compose.yaml").read_text()
    (service,) = yaml.safe_load(compose)["services"].values()
    assert service["image"] == f"docker.io/vllm/vllm-openai:{TAG}@{DIGEST}"
    assert service["labels"]["rigup.image"] == service["image"]
    out, err = capsys.readouterr()
    assert "warning" not in err
    assert f"git:vllm-fork: {FORK}" in out and f"model:Lorbus/Qwen3.6-27B-int4-AutoRound: {REV}" in out
    assert f"image:vllm/vllm-openai:{TAG}: {DIGEST}" in out
    assert run_render("dual", "--out", str(tmp_path / "plain")) == 0
    assert "@sha256:" not in (tmp_path / "plain/opt/rigup/variants/dual/compose.yaml").read_text()


def test_render_warns_about_missing_entries(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lock = write_lock(tmp_path / "partial.lock.yaml", with_model=False)
    assert run_render("dual", "--out", str(tmp_path / "out"), "--lock", str(lock)) == 0
    out, err = capsys.readouterr()
    assert "model:Lorbus/Qwen3.6-27B-int4-AutoRound: no entry" in err
    assert "model:Lorbus/Qwen3.6-27B-int4-AutoRound: not locked" in out


def test_render_refuses_a_missing_or_broken_lock(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_render("dual", "--out", str(tmp_path / "out"), "--lock", str(tmp_path / "nope.yaml")) == 2
    assert "lock file not found" in capsys.readouterr().err
    (tmp_path / "bad.yaml").write_text("version: 7\n")
    assert run_render("dual", "--out", str(tmp_path / "out"), "--lock", str(tmp_path / "bad.yaml")) == 2
    assert "expected a mapping with version: 1" in capsys.readouterr().err
