"""Replica consensus and the known-answer probes from the stand-in engine to the alert rule (issue 43),
without a bed: three stand-in pods of one release identity and a fourth, single-replica model of its own,
each a real openai_responder server on loopback behind the stand-in's own fault switches
(rigup_testbed/standins/responder.py: diverge_after_requests, garbage); rigup-servingctl's `sentinel` asks
them round after round as rigup-sentinel.timer does; the textfile of every round becomes the node series
the monitor scrapes (one round a minute), and promtool evaluates rigup's own RigupPodOutvoted over them.

No bed has three pods of one identity and a Prometheus (test_pods.py: pods, no monitor; test_monitoring.py
and test_alerts_live.py: a monitor, two replicas), and adding a third rig to one costs a host's bring-up
in a module of 4 to 9 minutes; what the bed would add is the scrape, which test_alerts_live.py already
checks for the sentinel's series (docs/sentinel.md)."""

from __future__ import annotations

import json
import re
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rigup.rig import servingctl as ctl
from rigup_testbed import aptrepo
from rigup_testbed import openai_responder as rich
from tests.desired.test_alert_rules import NODE, promtool_test, series

MODEL = "qwen3.6-27b"
REPLICAS = ("rep-a", "rep-b", "rep-c")  # one variant, one identity; rep-c drifts
SOLO = "solo"  # a model served by one pod, which answers garbage
DRIFT_AFTER = 8  # chat requests: two healthy rounds of four probes, then rep-c's answers drift
GARBAGE_FROM = 2  # the round from which the single replica answers club-3090 #922's "!!!!"
ROUNDS = 7


def fault_switches() -> Any:
    sys.path.insert(0, str(aptrepo.STANDINS))
    try:
        import responder
    finally:
        sys.path.remove(str(aptrepo.STANDINS))
    return responder


class FaultHandler(rich.Handler):
    """openai_responder's handler behind the stand-in engine's fault switches, as responder.py's FaultHandler
    sets them per request from responder.json (here the server's own `faults`)."""

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        switches = self.server.switches
        self.server.config.garbage = switches.answers_garbage(self.server.faults, None)
        self.server.config.diverge = switches.drifts(self.server.faults, self.server, self.path)
        super().do_POST()


@pytest.fixture
def pods() -> Iterator[dict[str, rich.Responder]]:
    switches = fault_switches()
    servers = {}
    for name in (*REPLICAS, SOLO):
        server = rich.Responder(("127.0.0.1", 0), rich.Config(model=MODEL))
        server.RequestHandlerClass = FaultHandler
        server.switches, server.faults = switches, {}
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True).start()
        servers[name] = server
    yield servers
    for server in servers.values():
        server.shutdown()
        server.server_close()


class ActiveUnits(ctl.Systemd):
    def show(self, unit: str) -> dict[str, str]:
        return {"ActiveState": "active"}


def write_release(root: Path, pod: str, variant: str, port: int) -> None:
    """A listed pod's release and its last passed gate, as the serving task and the gate leave them."""
    variant_dir, state = root / "variants" / pod, root / "state" / "pods" / pod
    variant_dir.mkdir(parents=True)
    state.mkdir(parents=True)
    release = {"variant": variant, "pod": pod, "state_dir": str(state), "unit": f"rigup-{pod}.service",
               "unit_file": f"/etc/systemd/system/rigup-{pod}.service", "variant_dir": str(variant_dir),
               "install_root": str(root), "health_url": f"http://127.0.0.1:{port}/v1/models",
               "served_model_name": MODEL, "env_file": str(variant_dir / ".env"), "files": {},
               "image": {"ref": "vllm/vllm-openai:v0.27.1", "digest": "sha256:" + "ab" * 32}, "sources": [],
               "models": [{"repo_id": "Qwen/Qwen3.6-27B", "revision": "r", "files_sha256": "d" * 64}],
               "engine": {"tensor_parallel_size": 2 if variant == "dual" else 1}}
    (variant_dir / "release.json").write_text(json.dumps(release))
    (state / "provenance.json").write_text(json.dumps({"variant": variant, "pod": pod, "generation": 1,
                                                       "release_sha256": "r1", "gate": {"result": "passed"}}))


SAMPLE = re.compile(r"^(?P<name>\w+)\{(?P<labels>.*)\} (?P<value>\S+)$")


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    found = []
    for line in text.splitlines():
        match = SAMPLE.match(line)
        if match:
            labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', match["labels"]))
            found.append((match["name"], labels, float(match["value"])))
    return found


def test_a_drifting_replica_among_three_is_outvoted_and_a_lone_garbage_answer_is_caught_by_its_judge(pods, tmp_path):
    root, out = tmp_path / "opt/rigup", tmp_path / "rigup-sentinel.prom"
    for pod in REPLICAS:
        write_release(root, pod, "dual", pods[pod].server_address[1])
    write_release(root, SOLO, "solo", pods[SOLO].server_address[1])
    pods["rep-c"].faults = {"diverge_after_requests": DRIFT_AFTER}
    rounds: list[list[tuple[str, dict[str, str], float]]] = []
    for number in range(ROUNDS):
        if number == GARBAGE_FROM:
            pods[SOLO].faults = {"mode": "garbage"}
        assert ctl.sentinel(str(root), str(out), 2, 3, ActiveUnits(), out=lambda line: None) == 0
        rounds.append(samples(out.read_text()))

    def last(name: str, **labels: str) -> list[tuple[dict[str, str], float]]:
        return [(lab, value) for n, lab, value in rounds[-1] if n == name and labels.items() <= lab.items()]

    # the drifting replica answers right by every judge: the sentinel alone never quarantines it
    assert {lab["probe"]: value for lab, value in last("rigup_sentinel_probe_passed", pod="rep-c")} == {
        "arithmetic": 1, "recall": 1, "tool-call": 1, "json-shape": 1}
    assert [value for _, value in last("rigup_sentinel_quarantined", pod="rep-c")] == [0]
    # ...but its answers' hashes differ from its replicas' (a tool call carries no text: the same)
    answers = {(lab["pod"], lab["probe"]): lab["answer"] for lab, _ in last("rigup_sentinel_answer_info")}
    identities = {lab["identity"] for lab, _ in last("rigup_sentinel_answer_info") if lab["variant"] == "dual"}
    assert len(identities) == 1
    (identity,) = identities
    for probe in ctl.PROBE_NAMES:
        assert answers[("rep-a", probe)] == answers[("rep-b", probe)]
        assert (answers[("rep-c", probe)] != answers[("rep-a", probe)]) == (probe != "tool-call"), probe
    # the single replica answering garbage is caught by the known answers: quarantined after two wrong rounds
    ((solo, quarantined),) = last("rigup_sentinel_quarantined", pod=SOLO)
    assert quarantined == 1 and solo["probe"] == "arithmetic" and solo["answer"].startswith("'!!!!")
    assert solo["expected"] == "lexical variety 0.00 over the first 200 words (verify-full fails < 0.30)"

    # the monitor's view: each round's answer series, one round a minute, as the node job scrapes them
    keys: dict[tuple[tuple[str, str], ...], list[str]] = {}
    for number, found in enumerate(rounds):
        for name, labels, _ in found:
            if name == "rigup_sentinel_answer_info":
                keys.setdefault(tuple(sorted(labels.items())), ["_"] * ROUNDS)[number] = "1"
    inputs = [series("rigup_sentinel_answer_info", {**NODE, **dict(key)}, " ".join(values)) for key, values in keys.items()]
    drifted_from = DRIFT_AFTER // len(ctl.PROBE_NAMES)  # the first round with rep-c's drifted answers
    outvoted = []
    for probe in ("arithmetic", "recall", "json-shape"):
        labels = {"host": NODE["host"], "pod": "rep-c", "variant": "dual", "identity": identity, "probe": probe,
                  "answer": answers[("rep-c", probe)], "severity": "critical"}
        outvoted.append({"exp_labels": labels, "exp_annotations": {
            "summary": f"{NODE['host']}/rep-c (dual) is outvoted by its replicas on probe {probe} (answer "
                       f"{answers[('rep-c', probe)]})",
            "runbook": f"its greedy answer differs from the majority of its release identity {labels['identity']}: "
                       "compare the rigs' drivers, GPUs and P2P (rigup status); converge or take the rig out"}})
    checks = [
        # agreement, then the drift's first minutes (RigupPodOutvoted holds 60 s): nothing
        {"eval_time": f"{drifted_from}m", "alertname": "RigupPodOutvoted", "exp_alerts": []},
        # the drift held a round (60 s): rep-c, and only rep-c, outvoted on each probe whose text differs, as
        # long as it drifts; the lone pod of solo, wrong as it is, is nobody's minority
        *[{"eval_time": f"{minute}m", "alertname": "RigupPodOutvoted", "exp_alerts": outvoted}
          for minute in range(drifted_from + 1, ROUNDS)],
    ]
    result = promtool_test(tmp_path, {"three replicas, one drifting; one lone pod answering garbage": (inputs, checks)})
    assert result.returncode == 0, result.stdout + result.stderr
