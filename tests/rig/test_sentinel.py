"""`rigup-servingctl sentinel` (issue 43): the gate's probes asked of each serving pod every round, against
the stand-in engine as a real process (a test double of a healthy model, and of club-3090 #922's "!!!!");
failed rounds in a row quarantine a pod with the evidence, passed rounds release it, a converge that changed
its release starts afresh; the results as a textfile the real promtool's linter accepts."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path
from typing import Any

from rigup.rig import servingctl as ctl
from rigup_testbed import debarchive
from tests.rig.test_servingctl_textfile import samples
from tests.support.responder import MODEL, responder


class ActiveUnits(ctl.Systemd):
    """systemd as the sentinel asks it: every unit active but those named inactive."""

    def __init__(self, inactive: tuple[str, ...] = ()) -> None:
        self.inactive = inactive

    def show(self, unit: str) -> dict[str, str]:
        return {"ActiveState": "inactive" if unit in self.inactive else "active"}


def write_release(root: Path, pod: str, url: str, generation: int = 1, **extra: Any) -> Path:
    variant_dir = root / "variants" / pod
    variant_dir.mkdir(parents=True, exist_ok=True)
    release = {"variant": "dual", "pod": pod, "state_dir": str(root / "state" / "pods" / pod),
               "unit": f"rigup-{pod}.service", "unit_file": f"/etc/systemd/system/rigup-{pod}.service",
               "variant_dir": str(variant_dir), "install_root": str(root), "health_url": f"{url}/v1/models",
               "served_model_name": MODEL, "env_file": str(variant_dir / ".env"), "files": {},
               "image": {"ref": "docker.io/vllm/vllm-openai:v0.27.1", "digest": "sha256:" + "ab" * 32},
               "sources": [{"name": "genesis", "commit": "c" * 40}],
               "models": [{"repo_id": "Qwen/Qwen3.6-27B", "revision": "r1", "files_sha256": "d" * 64}],
               "engine": {"tensor_parallel_size": 2}, "host_port": int(url.rsplit(":", 1)[1]), **extra}
    path = variant_dir / "release.json"
    path.write_text(json.dumps(release))
    write_provenance(root, pod, release, generation)
    return path


def write_provenance(root: Path, pod: str, release: dict[str, Any], generation: int) -> None:
    """The record of the pod's last passed gate (what it serves), as the gate writes it."""
    state = root / "state" / "pods" / pod
    state.mkdir(parents=True, exist_ok=True)
    text = json.dumps(release)
    (state / "provenance.json").write_text(json.dumps({
        "variant": release["variant"], "pod": pod, "generation": generation,
        "release_sha256": hashlib.sha256(text.encode()).hexdigest(), "gate": {"result": "passed"}}))


def record(root: Path, pod: str) -> dict[str, Any]:
    return json.loads((root / "state" / "pods" / pod / "sentinel.json").read_text())


def test_a_garbage_pod_is_quarantined_after_fail_after_rounds_with_the_evidence_and_a_healthy_one_is_not(tmp_path):
    root, out = tmp_path / "opt-rigup", tmp_path / "textfile" / "rigup-sentinel.prom"
    lines: list[str] = []
    with responder(tmp_path) as healthy, responder(tmp_path, "--garbage") as garbage:
        write_release(root, "good", healthy.url)
        write_release(root, "bad", garbage.url)
        write_release(root, "off", garbage.url.rsplit(":", 1)[0] + ":9")  # inactive: never asked
        for expected_failures in (1, 2):
            assert ctl.sentinel(str(root), str(out), 3, 2, ActiveUnits(("rigup-off.service",)), out=lines.append) == 0
            assert record(root, "bad")["consecutive_failures"] == expected_failures
            assert record(root, "bad")["quarantined"] is None
        ctl.sentinel(str(root), str(out), 3, 2, ActiveUnits(("rigup-off.service",)), out=lines.append)
    bad, good = record(root, "bad"), record(root, "good")
    assert bad["quarantined"]["probe"] == "arithmetic"
    assert bad["quarantined"]["answer"].startswith("'!!!!!!!!")
    assert bad["quarantined"]["expected"].startswith("lexical variety 0.00")
    assert bad["quarantined"]["finish_reason"] == "length"
    assert good["quarantined"] is None and good["consecutive_passes"] == 3 and good["rounds"] == 3
    assert not (root / "state" / "pods" / "off" / "sentinel.json").exists()
    assert any("bad QUARANTINED: probe arithmetic" in line for line in lines)
    metrics = samples(out.read_text())
    assert metrics['rigup_sentinel_probe_passed{pod="good",variant="dual",probe="json-shape"}'] == 1
    assert metrics['rigup_sentinel_probe_passed{pod="bad",variant="dual",probe="recall"}'] == 0
    assert metrics['rigup_sentinel_consecutive_failures{pod="bad",variant="dual"}'] == 3
    quarantined = [k for k, v in metrics.items() if k.startswith('rigup_sentinel_quarantined{pod="bad"') and v == 1]
    assert len(quarantined) == 1 and 'probe="arithmetic"' in quarantined[0]
    # labelled with the served model: the alert asks whether the model's other pods are quarantined too
    assert metrics[f'rigup_sentinel_quarantined{{pod="good",variant="dual",model="{MODEL}",probe="",answer="",expected=""}}'] == 0
    assert metrics['rigup_sentinel_probe_tokens_total{pod="good"}'] == good["tokens"] > 0
    # the two pods share a release identity, so the monitor compares their answers' hashes
    answers = {k: v for k, v in metrics.items() if k.startswith("rigup_sentinel_answer_info")}
    identities = {k.split('identity="')[1].split('"')[0] for k in answers}
    assert len(identities) == 1 and len(answers) == 8
    lint = subprocess.run([str(debarchive.promtool()), "check", "metrics"], input=out.read_text(), text=True,
                          capture_output=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr


def test_a_pod_that_does_not_answer_skips_the_round_and_counts_nothing(tmp_path):
    root, out = tmp_path / "root", tmp_path / "out.prom"
    write_release(root, "loading", "http://127.0.0.1:9")  # nothing listens: a pod restarting or loading
    ctl.sentinel(str(root), str(out), 1, 1, ActiveUnits(), out=lambda line: None)
    rec = record(root, "loading")
    assert rec["last_round"]["skipped"] is True
    assert rec["consecutive_failures"] == 0 and rec["quarantined"] is None and rec["rounds"] == 0


def outcome(passed: bool) -> dict[str, Any]:
    return {"passed": passed, "why": None if passed else "expected 391", "answer": "'390'", "answer_sha256": "0" * 64,
            "seconds": 0.1, "tokens": 30, "finish_reason": "stop"}


def test_passed_rounds_in_a_row_release_a_quarantine_and_a_changed_release_starts_afresh(tmp_path):
    release = ctl.Release.load(str(write_release(tmp_path, "p", "http://127.0.0.1:8000")))
    rec: dict[str, Any] = {}
    for _ in range(2):
        rec = ctl.sentinel_round(release, rec, {"arithmetic": outcome(False)}, 2, 3, "t")
    assert rec["quarantined"]["expected"] == "expected 391" and rec["quarantined"]["answer"] == "'390'"
    rec = ctl.sentinel_round(release, rec, None, 2, 3, "t")  # no answer: still quarantined, nothing counted
    for passes in (1, 2):
        rec = ctl.sentinel_round(release, rec, {"arithmetic": outcome(True)}, 2, 3, "t")
        assert rec["quarantined"] is not None and rec["consecutive_passes"] == passes
    rec = ctl.sentinel_round(release, rec, {"arithmetic": outcome(False)}, 2, 3, "t")  # a failure resets the passes
    rec = ctl.sentinel_round(release, rec, {"arithmetic": outcome(True)}, 2, 3, "t")
    assert rec["quarantined"] is not None and rec["consecutive_passes"] == 1
    for _ in range(2):
        rec = ctl.sentinel_round(release, rec, {"arithmetic": outcome(True)}, 2, 3, "t")
    assert rec["quarantined"] is None and rec["released"]["after_passes"] == 3
    rec = ctl.sentinel_round(release, rec, {"arithmetic": outcome(False)}, 2, 3, "t")
    rec = ctl.sentinel_round(release, rec, {"arithmetic": outcome(False)}, 2, 3, "t")
    assert rec["quarantined"] is not None
    path = tmp_path / "variants" / "p" / "release.json"
    path.write_text(path.read_text() + " ")  # edited by hand (RigupReleaseDrift): the pod serves what it served
    rec = ctl.sentinel_round(ctl.Release.load(str(path)), rec, None, 2, 3, "t")
    assert rec["quarantined"] is not None
    changed = ctl.Release.load(str(write_release(tmp_path, "p", "http://127.0.0.1:8000", generation=2,
                                                 engine={"tensor_parallel_size": 1})))
    rec = ctl.sentinel_round(changed, rec, None, 2, 3, "t")  # a converge changed the pod and its gate passed
    assert rec["quarantined"] is None and rec["consecutive_failures"] == 0 and rec["serves"].endswith(":2")


def test_replicas_share_an_identity_that_pod_fields_do_not_change_and_pins_do(tmp_path):
    a = json.loads(write_release(tmp_path / "a", "a", "http://127.0.0.1:8000").read_text())
    b = json.loads(write_release(tmp_path / "b", "b", "http://127.0.0.1:8001").read_text())
    assert ctl.release_identity(a) == ctl.release_identity(b)
    for key, value in (("engine", {"tensor_parallel_size": 1}), ("sources", [{"name": "genesis", "commit": "e" * 40}]),
                       ("image", {"digest": "sha256:" + "cd" * 32}), ("variant", "other")):
        assert ctl.release_identity({**a, key: value}) != ctl.release_identity(a), key
