#!/usr/bin/env python3
"""The sentinel's false alarms and cost, measured (issue 43): healthy pods probed over and over under mixed load.

    .venv/bin/python bench/sentinel.py [--pods 3] [--probes 2000] [--tokens-per-s 300] [--clients 4]
                                      [--results bench/results.md]

Loopback only. N stand-in vLLM pods (rigup_testbed/openai_responder.py: a test double of a healthy model,
which answers the gate's probes right; paced at --tokens-per-s per stream with --max-num-seqs 4, so requests
queue behind each other as on a busy engine) share one release identity, as replicas. Meanwhile --clients
threads per pod send mixed traffic straight to it: short and long chat completions (16 to 512 tokens),
streamed and not, with and without thinking, tool calls and JSON asks. rigup-servingctl's own `sentinel`
(rigup/rig/servingctl.py, as rigup-sentinel.timer runs it on a rig, every unit taken as active) runs round
after round until --probes probes were asked, with the fleet's defaults sentinel_fail_after and
sentinel_pass_after.

Reported: probes asked, wrong answers, rounds skipped (a pod that did not answer), false quarantines (any
quarantine of these healthy pods), replica disagreements (rounds in which the replicas' answer hashes
to one probe were not all equal: what RigupPodOutvoted compares), the probes' seconds (median, p95), and
their cost: prompt + completion tokens per round per pod (the stand-in's usage; a real tokenizer counts
differently) and per hour at the default sentinel_interval_s. Every process started runs in its own
process group and is stopped when the run ends.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from bench.bench_artifacts import write_results  # noqa: E402
from bench.entrance import MODEL, Processes, start_pods  # noqa: E402
from rigup.desired.knobs import load_defaults  # noqa: E402
from rigup.rig import servingctl  # noqa: E402

SECTION = "## Sentinel: false alarms and cost on healthy pods (bench/sentinel.py)"
TOOL = servingctl.WEATHER_TOOL


class ActiveUnits(servingctl.Systemd):
    """systemd as the sentinel asks it on a rig whose pods all run."""

    def show(self, unit: str) -> dict[str, str]:
        return {"ActiveState": "active"}


def mixed_request(rng: random.Random) -> dict[str, object]:
    """One client request of the mix: what a fleet's users send, in varied lengths and shapes."""
    kind = rng.choice(["short", "long", "stream", "thinking", "tool", "json"])
    body: dict[str, object] = {"model": MODEL, "max_tokens": rng.choice([16, 64, 128, 256, 512]),
                               "temperature": rng.choice([0, 0.7, 1.0]),
                               "messages": [{"role": "user", "content": f"Tell me about topic {rng.randint(1, 10**6)}."}]}
    if kind == "short":
        body["max_tokens"] = 16
    elif kind == "stream":
        body["stream"] = True
    elif kind == "thinking":
        body["chat_template_kwargs"] = {"enable_thinking": True}
    elif kind == "tool":
        body["tools"] = [TOOL]
        body["messages"] = [{"role": "user", "content": "What is the weather in Oslo?"}]
    elif kind == "json":
        body["messages"] = [{"role": "user", "content": 'Reply with a JSON object with the keys "a" (the number 1).'}]
    return body


def load(url: str, stop: threading.Event, seed: int, counts: dict[str, int]) -> None:
    rng = random.Random(seed)
    with requests.Session() as session:
        while not stop.is_set():
            try:
                reply = session.post(f"{url}/v1/chat/completions", json=mixed_request(rng), timeout=120)
                reply.content  # the whole answer, streamed or not
                counts[str(reply.status_code)] = counts.get(str(reply.status_code), 0) + 1
            except requests.RequestException:
                counts["error"] = counts.get("error", 0) + 1


def write_release(root: Path, pod: str, port: int) -> None:
    """A pod's release and its last passed gate, as the serving task and the gate leave them; the same
    identity (variant, image, pins, models, engine) for every pod."""
    variant_dir = root / "variants" / pod
    variant_dir.mkdir(parents=True)
    release = {"variant": "dual", "pod": pod, "state_dir": str(root / "state" / "pods" / pod),
               "unit": f"rigup-{pod}.service", "unit_file": f"/etc/systemd/system/rigup-{pod}.service",
               "variant_dir": str(variant_dir), "install_root": str(root),
               "health_url": f"http://127.0.0.1:{port}/v1/models", "served_model_name": MODEL,
               "env_file": str(variant_dir / ".env"), "files": {},
               "image": {"ref": "vllm/vllm-openai:v0.27.1", "digest": "sha256:" + "ab" * 32},
               "sources": [], "models": [{"repo_id": "Qwen/Qwen3.6-27B", "revision": "r", "files_sha256": "d" * 64}],
               "engine": {"tensor_parallel_size": 2}}
    (variant_dir / "release.json").write_text(json.dumps(release))
    state = root / "state" / "pods" / pod
    state.mkdir(parents=True)
    (state / "provenance.json").write_text(json.dumps({"variant": "dual", "pod": pod, "generation": 1,
                                                       "release_sha256": "r1", "gate": {"result": "passed"}}))


def run(args: argparse.Namespace) -> str:
    defaults = load_defaults()
    fail_after, pass_after = defaults["sentinel_fail_after"], defaults["sentinel_pass_after"]
    interval = defaults["sentinel_interval_s"]
    with tempfile.TemporaryDirectory(prefix="bench-sentinel-") as tmp, Processes() as procs:
        work = Path(tmp)
        ports = start_pods(procs, args.pods, work, args.tokens_per_s, ["--max-num-seqs", "4"])
        root = work / "opt-rigup"
        pods = [f"pod-{i}" for i in range(args.pods)]
        for pod, port in zip(pods, ports):
            write_release(root, pod, port)
        stop = threading.Event()
        counts: dict[str, int] = {}
        threads = [threading.Thread(target=load, args=(f"http://127.0.0.1:{port}", stop, i * 100 + c, counts), daemon=True)
                   for i, port in enumerate(ports) for c in range(args.clients)]
        for thread in threads:
            thread.start()
        probes = wrong = skipped = quarantines = disagreements = rounds = 0
        seconds: list[float] = []
        tokens_per_round: list[int] = []
        started = time.monotonic()
        try:
            while probes < args.probes:
                servingctl.sentinel(str(root), str(work / "rigup-sentinel.prom"), fail_after, pass_after, ActiveUnits(),
                                    out=lambda line: None)
                rounds += 1
                hashes: dict[str, set[str]] = {}
                for pod in pods:
                    record = json.loads((root / "state" / "pods" / pod / "sentinel.json").read_text())
                    last = record["last_round"]
                    if last.get("skipped"):
                        skipped += 1
                        continue
                    quarantines += 1 if record.get("quarantined") else 0
                    round_tokens = 0
                    for name, result in last["probes"].items():
                        probes += 1
                        wrong += 0 if result["passed"] else 1
                        seconds.append(result["seconds"])
                        round_tokens += result["tokens"]
                        hashes.setdefault(name, set()).add(result["answer_sha256"])
                    tokens_per_round.append(round_tokens)
                disagreements += sum(1 for found in hashes.values() if len(found) > 1)
        finally:
            stop.set()
            for thread in threads:
                thread.join(timeout=130)
        elapsed = time.monotonic() - started
    served = sum(v for k, v in counts.items() if k == "200")
    per_round = statistics.mean(tokens_per_round)
    cuts = statistics.quantiles(seconds, n=20)
    label = (f"{platform.node() or 'this machine'}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
             f"{datetime.date.today().isoformat()}")
    return "\n".join([
        f"### Measured: {label}",
        "",
        f"{args.pods} healthy stand-in pods of one release identity at {args.tokens_per_s:g} tokens/s per stream "
        f"(--max-num-seqs 4), {args.clients} clients each sending mixed traffic ({served} requests answered 200, "
        f"{sum(v for k, v in counts.items() if k != '200')} otherwise); the sentinel as the rig runs it "
        f"(fail after {fail_after}, release after {pass_after}), {rounds} rounds back to back in {elapsed:.0f} s.",
        "",
        "| figure | value |",
        "|---|---|",
        f"| probes asked | {probes} |",
        f"| wrong answers | {wrong} |",
        f"| pod-rounds skipped (no answer) | {skipped} |",
        f"| false quarantines | {quarantines} |",
        f"| replica disagreements (a probe's answer hashes not all equal in a round) | {disagreements} |",
        f"| probe seconds, median / p95 | {statistics.median(seconds):.3f} / {cuts[18]:.3f} |",
        f"| tokens per round per pod (prompt + completion, {len(servingctl.PROBES)} probes) | {per_round:.0f} |",
        f"| tokens per hour per pod at sentinel_interval_s {interval} | {per_round * 3600 / interval:,.0f} |",
        "",
    ])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pods", type=int, default=3)
    parser.add_argument("--probes", type=int, default=2000)
    parser.add_argument("--tokens-per-s", type=float, default=300.0)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--results", type=Path, default=REPO_ROOT / "bench" / "results.md")
    args = parser.parse_args()
    text = run(args)
    print(text)
    write_results(args.results, text.splitlines()[0].removeprefix("### Measured: "), text, section=SECTION)
    return 0


if __name__ == "__main__":
    sys.exit(main())
