"""`rigup-servingctl textfile`: rigup's facts for node_exporter's textfile collector, from the rig's
provenance records, release files and /proc (the captured /proc/driver/nvidia/version files), in a
format the real promtool's linter accepts."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from rigup.rig import servingctl as ctl
from rigup_testbed import debarchive

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "proc-nvidia-version"


def write_pod(root: Path, pod: str | None, variant: str, *, gate_at: str = "2026-12-01T10:00:00+00:00",
              rollback_at: str | None = None, rollbacks: int = 0, release_edit: str = "",
              superseded_at: str | None = None) -> None:
    """A pod's release.json and its provenance record, as the serving task and the gate leave them."""
    variant_dir = root / "variants" / (pod or variant)
    variant_dir.mkdir(parents=True)
    release = {"variant": variant, "served_model_name": f"model-{variant}", "variant_dir": str(variant_dir),
               "image": {"ref": "docker.io/vllm/vllm-openai:v0.27.1@sha256:" + "ab" * 32},
               "sources": [{"name": "genesis", "commit": "c" * 40}, {"name": "vllm-fork", "commit": None}]}
    text = json.dumps(release)
    (variant_dir / "release.json").write_text(text + release_edit)
    record: dict[str, Any] = {"variant": variant, "unit": f"rigup-{pod or variant}.service", "generation": 3,
                              "release_sha256": hashlib.sha256(text.encode()).hexdigest(), "release": release,
                              "gate": {"result": "passed", "at": gate_at}}
    if pod:
        record["pod"] = pod
    if rollback_at:
        record["last_rollback"] = {"at": rollback_at, "reason": "boot OOM", "outcome": "rolled back",
                                   "failed_release_sha256": "f" * 64}
        if superseded_at:  # a later converge asked for the release that serves (rigup-servingctl supersede)
            record["last_rollback"].update(superseded_at=superseded_at, superseded_by_release_sha256=record["release_sha256"])
    if rollbacks:
        record["rollbacks"] = rollbacks
    state = root / "state" / ("pods/" + pod if pod else "")
    state.mkdir(parents=True, exist_ok=True)
    (state / "provenance.json").write_text(json.dumps(record))


def samples(text: str) -> dict[str, float]:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if not line.startswith("#")}


def test_the_gate_times_are_read_as_the_gate_writes_them() -> None:
    written = ctl.now_iso()
    assert abs(ctl.epoch_seconds(written) - time.time()) < 5
    assert ctl.epoch_seconds("2026-12-02T08:00:00Z") == ctl.epoch_seconds("2026-12-02T08:00:00+00:00") == 1796198400
    assert ctl.epoch_seconds("yesterday") is None and ctl.epoch_seconds(None) is None


def test_pods_gates_rollbacks_pins_and_drift(tmp_path: Path) -> None:
    write_pod(tmp_path, "chat", "dual")
    # its last gate failed after the one that passed, and it was rolled back (the second time)
    write_pod(tmp_path, "code", "single", rollback_at="2026-12-02T08:00:00+00:00", rollbacks=2)
    # the converge wrote a new release that has not passed (yet)
    write_pod(tmp_path, "lab", "quad", release_edit="\n ")
    text = ctl.textfile_metrics(str(tmp_path), 580, str(tmp_path / "models"),
                                driver_version_file=str(FIXTURES / "open-580-host-provided.txt"), now=lambda: 1796000000.25)
    got = samples(text)
    image = "docker.io/vllm/vllm-openai:v0.27.1@sha256:" + "ab" * 32
    chat_release = next(k for k in got if k.startswith('rigup_release_info{pod="chat"'))
    assert chat_release.startswith(f'rigup_release_info{{pod="chat",variant="dual",unit="rigup-chat.service",model="model-dual",release="')
    assert chat_release.endswith(f'",image="{image}"}}') and got[chat_release] == 1
    assert got['rigup_gate_last_passed{pod="chat",variant="dual"}'] == 1
    assert got['rigup_gate_last_passed{pod="code",variant="single"}'] == 0
    assert got['rigup_gate_last_timestamp_seconds{pod="code"}'] == 1796198400  # the rollback, later than the pass
    # the fleet still asks "code" for the release that failed; "chat" never failed
    assert got['rigup_release_failed_gate{pod="code",variant="single"}'] == 1
    assert got['rigup_release_failed_gate{pod="chat",variant="dual"}'] == 0
    assert got['rigup_rollbacks_total{pod="code"}'] == 2 and got['rigup_rollbacks_total{pod="chat"}'] == 0
    assert got['rigup_generation{pod="chat"}'] == 3
    assert got[f'rigup_source_info{{pod="chat",source="genesis",commit="{"c" * 40}"}}'] == 1
    assert not any('source="vllm-fork"' in k for k in got)  # no commit: no series
    assert got['rigup_release_drift{pod="chat"}'] == 0 and got['rigup_release_drift{pod="lab"}'] == 1
    assert got["rigup_driver_loaded_branch"] == 580 and got["rigup_driver_wanted_branch"] == 580
    assert got["rigup_textfile_timestamp_seconds"] == 1796000000.25
    assert got[f'rigup_model_filesystem{{mountpoint="{ctl.mountpoint_of(str(tmp_path))}",path="{tmp_path / "models"}"}}'] == 1
    # the real linter accepts it (names, HELP/TYPE, counter suffix)
    lint = subprocess.run([str(debarchive.promtool()), "check", "metrics"], input=text, capture_output=True, text=True,
                          timeout=60)
    assert lint.returncode == 0, lint.stdout + lint.stderr


def test_a_failed_gate_stands_until_a_gate_passes_or_a_converge_asks_for_another_release(tmp_path: Path) -> None:
    # rolled back, and the fleet still asks for the failed release: the alert's gauge is 1
    write_pod(tmp_path, "asked", "dual", rollback_at="2026-12-02T08:00:00+00:00")
    # rolled back, then a converge found the fleet asks for the release that serves (reverted): no gate ran
    write_pod(tmp_path, "reverted", "dual", rollback_at="2026-12-02T08:00:00+00:00",
              superseded_at="2026-12-02T08:05:00+00:00")
    # rolled back, then a gate passed (a fixed release)
    write_pod(tmp_path, "fixed", "dual", rollback_at="2026-12-02T08:00:00+00:00", gate_at="2026-12-02T08:10:00+00:00")
    got = samples(ctl.textfile_metrics(str(tmp_path), 580, str(tmp_path / "models")))
    failed = {pod: got[f'rigup_release_failed_gate{{pod="{pod}",variant="dual"}}'] for pod in ("asked", "reverted", "fixed")}
    assert failed == {"asked": 1, "reverted": 0, "fixed": 0}
    # the last gate's own result is unchanged by a supersede: it did fail
    last = {pod: got[f'rigup_gate_last_passed{{pod="{pod}",variant="dual"}}'] for pod in ("asked", "reverted", "fixed")}
    assert last == {"asked": 0, "reverted": 0, "fixed": 1}


def test_no_driver_loaded_reads_zero_and_a_missing_root_gives_host_facts_only(tmp_path: Path) -> None:
    text = ctl.textfile_metrics(str(tmp_path / "absent"), 580, "/opt/rigup/models",
                                driver_version_file=str(tmp_path / "no-such-file"))
    got = samples(text)
    assert got["rigup_driver_loaded_branch"] == 0
    assert not any(k.startswith("rigup_release_info") for k in got)
    assert ctl.loaded_driver_branch(str(FIXTURES / "proprietary-550.txt")) == 550


def test_label_values_are_escaped(tmp_path: Path) -> None:
    write_pod(tmp_path, None, 'we"ird\\name')
    text = ctl.textfile_metrics(str(tmp_path), 580, "/opt/rigup/models")
    assert 'variant="we\\"ird\\\\name"' in text


def test_the_command_writes_the_file_atomically_world_readable(tmp_path: Path) -> None:
    write_pod(tmp_path, None, "dual")
    out = tmp_path / "textfile" / "rigup.prom"
    code = ctl.main(["textfile", "--install-root", str(tmp_path), "--out", str(out), "--wanted-driver-branch", "580",
                     "--model-dir", str(tmp_path / "models")])
    assert code == 0 and "rigup_release_info" in out.read_text()
    assert oct(os.stat(out).st_mode & 0o777) == "0o644"
    assert [p.name for p in out.parent.iterdir()] == ["rigup.prom"]  # no temporary left beside it
