"""rigup-entrance-usage (rigup/rig/entrance_usage.py): the counts per client from nginx's usage log, the
exposition Prometheus reads, and following the log across logrotate's rename and truncation (issue 44)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import requests

from rigup.rig.entrance_usage import Follower, Usage, main, serve


def line(client: str, status: str = "200", prompt: str = "", completion: str = "", model: str = "m") -> bytes:
    return json.dumps({"client": client, "model": model, "status": status, "prompt_tokens": prompt,
                       "completion_tokens": completion}).encode()


def test_requests_tokens_and_unmetered_answers_per_client() -> None:
    usage = Usage()
    for entry in (line("alice", prompt="9", completion="16"), line("alice", prompt="5", completion="0"),
                  line("bob"), line("bob", status="502"), line("alice", status="404", model="")):
        assert usage.count(entry)
    assert not usage.count(b"not json") and not usage.count(line(""))  # no client: a refused request, not counted
    text = usage.exposition()
    assert 'rigup_gateway_client_requests_total{client="alice",model="m",code="200"} 2' in text
    assert 'rigup_gateway_client_requests_total{client="alice",model="",code="404"} 1' in text
    assert 'rigup_gateway_client_prompt_tokens_total{client="alice",model="m"} 14' in text
    assert 'rigup_gateway_client_completion_tokens_total{client="alice",model="m"} 16' in text
    # bob's 200 had no usage (a stream without include_usage); his 502 is no answer
    assert 'rigup_gateway_client_unmetered_requests_total{client="bob",model="m"} 1' in text
    assert 'rigup_gateway_client_requests_total{client="bob",model="m",code="502"} 1' in text
    assert 'client="bob"' not in "".join(t for t in text.splitlines() if "tokens_total{" in t)
    assert text.count("# TYPE ") == 6 and all(t.startswith("# ") or "} " in t for t in text.splitlines())
    assert "rigup_entrance_completions_scored_total{" not in text  # no series before a scored completion


def test_the_hops_scored_completions_per_pod_and_model() -> None:
    """The lines the entrance's hop logs for a scored completion (log_format rigup_scored: the pod as rig/pod, its
    model, the verdict of entrance.js's score) count per pod; a degenerate one also by its rule."""
    usage = Usage()
    for pod, verdict in (("rig-02/dual", "variety"), ("rig-02/dual", "variety"), ("rig-02/dual", "ok"),
                         ("rig-02/dual", "repeats"), ("rig-01/twin", "ok")):
        assert usage.count(json.dumps({"scored": pod, "model": "m", "verdict": verdict}))
    # a host:port the hop has no pod for, or a verdict it does not write: not counted
    assert not usage.count(json.dumps({"scored": "", "model": "", "verdict": "ok"}))
    assert not usage.count(json.dumps({"scored": "rig-02/dual", "model": "m", "verdict": ""}))
    text = usage.exposition()
    assert 'rigup_entrance_completions_scored_total{model="m",pod="dual",rig="rig-02"} 4' in text
    assert 'rigup_entrance_completions_scored_total{model="m",pod="twin",rig="rig-01"} 1' in text
    assert 'rigup_entrance_completions_degenerate_total{model="m",pod="dual",rig="rig-02",rule="variety"} 2' in text
    assert 'rigup_entrance_completions_degenerate_total{model="m",pod="dual",rig="rig-02",rule="repeats"} 1' in text
    assert 'pod="twin",rig="rig-01",rule=' not in text and "rigup_gateway_client_requests_total{" not in text


def test_label_values_are_escaped() -> None:
    usage = Usage()
    usage.count(line("alice", model='a "quoted"\\model'))
    assert 'model="a \\"quoted\\"\\\\model"' in usage.exposition()


def test_the_log_is_followed_from_its_end_across_rotation_and_truncation(tmp_path: Path) -> None:
    log = tmp_path / "usage.log"
    log.write_bytes(line("before") + b"\n")
    follower = Follower(str(log))
    assert follower.lines() == []  # logged before it started: not counted again
    with log.open("ab") as handle:
        handle.write(line("a") + b"\n" + line("b")[:10])  # the second line half written
    assert follower.lines() == [line("a")]
    with log.open("ab") as handle:
        handle.write(line("b")[10:] + b"\n")
    assert follower.lines() == [line("b")]
    # logrotate: renamed, nginx writes on into the old file until it reopens, then a new one
    log.rename(tmp_path / "usage.log.1")
    with (tmp_path / "usage.log.1").open("ab") as handle:
        handle.write(line("c") + b"\n")
    assert follower.lines() == [line("c")]
    log.write_bytes(line("d") + b"\n")
    with (tmp_path / "usage.log.1").open("ab") as handle:
        handle.write(line("late") + b"\n")
    assert follower.lines() == [line("late"), line("d")]
    log.write_bytes(b"")  # truncated (copytruncate), then written anew
    assert follower.lines() == []
    with log.open("ab") as handle:
        handle.write(line("e") + b"\n")
    assert follower.lines() == [line("e")]


def test_a_log_made_after_the_start_is_read_from_its_first_line(tmp_path: Path) -> None:
    follower = Follower(str(tmp_path / "usage.log"))
    assert follower.lines() == []
    (tmp_path / "usage.log").write_bytes(line("a") + b"\n")
    assert follower.lines() == [line("a")]


def test_it_serves_metrics_only() -> None:
    usage = Usage()
    usage.count(line("alice"))
    server = serve(usage, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        reply = requests.get(f"{url}/metrics", timeout=10)
        assert reply.status_code == 200 and 'client="alice"' in reply.text
        assert requests.get(f"{url}/other", timeout=10).status_code == 404
    finally:
        server.shutdown()


def test_its_arguments() -> None:
    try:
        main(["--log", "/nonexistent"])
    except SystemExit as exc:
        assert exc.code == 2  # --port is required
    else:
        raise AssertionError("main accepted no --port")
