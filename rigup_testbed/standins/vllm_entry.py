#!/usr/bin/python3.11
"""`vllm` inside the test bed's images for the real engine (rigup_testbed/registry.py builds them).

`vllm serve ARGS` (the image's entrypoint, or a compose command) becomes responder.py serving the OpenAI
API on the --host/--port it names, inside the container, with this container's own command line: the
model directory, chat template and deploy config are read at their container paths (the mounts are
real), the GPUs are the ones the container toolkit's hook handed it (the simulated hardware it mounts at
/etc/rigup-testbed lists only those). The process stays the container's PID 1 when
the entrypoint execs it, so `docker kill` and `docker stop` reach the server itself. Other `vllm`
subcommands fail loudly as not simulated. Stdlib only, but for the Ray backend below.

`--distributed-executor-backend ray` (a cluster across rigs, issue 29) runs vLLM 0.27.1's Ray executor
(RayExecutorV2) for real before the server starts, with the image's Ray (the second layer registry.py
builds): ray.init(address=None) joins the Ray cluster this node's `ray start` recorded (rigup's member
script started the head: files/cluster/rigup-cluster-member), the placement group of TP x PP bundles
{"GPU": 1.0} is awaited (PG_WAIT_TIMEOUT 1800 s, vLLM's wording past it), one RayWorkerProc actor per
bundle is placed and answers from its node with the simulated GPU Ray's id names there (an id beyond the
node's GPUs fails as vLLM's worker does), and only then does the HTTP server start: nothing answers
before every rank joined. A thread then watches the ranks as vLLM's RayWorkerMonitor does; a rank (its
node) that dies ends the whole process non-zero with vLLM's lines, so the container stops. Any of this
failing before the server started exits 1 as vLLM's engine core does ("EngineCore failed to start.").
The test bed's one knob: /etc/rigup-testbed/responder.json `pg_wait_timeout_s` shortens the placement
group wait (vLLM has none; tests of a missing member would wait 30 minutes).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time

HERE = os.path.dirname(os.path.realpath(__file__))  # the command is a link to this file
RUN = "/run/rigup-standin"
EXIT_ENGINE = 1  # `vllm serve` whose engine core failed (to start, or later)


def engine_error(lines: list[str], code: int = EXIT_ENGINE) -> None:
    """vLLM's lines as its engine core and API server write them when the engine fails; exits at once
    (os._exit: from the monitor thread too, whatever the HTTP server's threads are doing)."""
    sys.stdout.flush()
    sys.stderr.write("\n".join(lines) + "\n")
    sys.stderr.flush()
    os._exit(code)


def ray_executor(args: dict, gpus: list[str], faults: dict) -> dict:
    """RayExecutorV2's start (ray_cluster.start_executor) and its monitor thread; the ready report."""
    import ray_cluster

    tp, pp = int(args.get("tp") or 1), int(args.get("pp") or 1)
    timeout = float(faults.get("pg_wait_timeout_s") or ray_cluster.PG_WAIT_TIMEOUT)
    stamp = time.strftime("%m-%d %H:%M:%S")
    if tp * pp > len(gpus):  # initialize_ray_cluster's prevalidation (0.27.1), against this node's GPUs
        sys.stderr.write(
            f"WARNING {stamp} [ray_utils.py] Tensor parallel size ({tp * pp}) exceeds available GPUs ({len(gpus)}). "
            "This may result in Ray placement group allocation failures. Consider reducing tensor_parallel_size "
            f"to {len(gpus)} or less, or ensure your Ray cluster has {tp * pp} GPUs available.\n")
    try:
        report, actors = ray_cluster.start_executor(
            tp=tp, pp=pp, timeout=timeout, standin_lib=HERE, gpu_memory_utilization=float(args.get("gpu_util") or 0.9),
            local_gpus=len(gpus))
    except ray_cluster.HeadFailure as e:
        engine_error([f"ERROR {time.strftime('%m-%d %H:%M:%S')} [core.py] EngineCore failed to start.", str(e),
                      "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): "
                      "{'EngineCore_DP0': 1}"])
    except Exception as e:  # Ray's own errors (no cluster, GCS gone): the engine core does not start
        engine_error([f"ERROR {time.strftime('%m-%d %H:%M:%S')} [core.py] EngineCore failed to start.",
                      f"{type(e).__name__}: {e}",
                      "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): "
                      "{'EngineCore_DP0': 1}"])
    stopping = threading.Event()

    def monitor() -> None:
        try:
            ray_cluster.watch(actors, should_stop=stopping.is_set)
        except ray_cluster.HeadFailure as e:
            if not stopping.is_set():
                engine_error([str(e), f"ERROR {time.strftime('%m-%d %H:%M:%S')} [api_server.py] EngineDeadError: "
                              "the engine died; the API server exits"])
        except Exception as e:  # vLLM's monitor: "RayWorkerMonitor: unexpected error, exiting monitor thread"
            if not stopping.is_set():
                sys.stderr.write(f"ERROR {time.strftime('%m-%d %H:%M:%S')} [ray_executor_v2.py] RayWorkerMonitor: "
                                 f"unexpected error, exiting monitor thread: {type(e).__name__}: {e}\n")

    thread = threading.Thread(target=monitor, daemon=True, name="RayWorkerMonitor")
    thread.start()
    report["monitor"] = (stopping, thread)
    return report


def main(argv: list[str]) -> int:
    sys.path.insert(0, HERE)
    import common
    import container

    if argv[:1] != ["serve"]:
        sys.stderr.write(f"rigup stand-in: vllm {' '.join(argv[:1])} in a container is not simulated\n")
        return 127
    image = common.read_json(os.path.join(HERE, "image.json"), {}) or {}
    tokens = ["vllm", *argv]
    run = common.spath(RUN)
    os.makedirs(run, exist_ok=True)
    args = container.vllm_args(tokens)
    spec = {
        "id": socket.gethostname(),
        "name": socket.gethostname(),
        "kind": "vllm",
        "image": image.get("kind", "vllm"),
        "args": args,
        "argv": tokens,
        # the toolkit's hook mounted a hardware file listing only the GPUs this container was given
        "gpus": [g["uuid"] for g in common.hardware().get("gpus", [])]
        if os.environ.get("NVIDIA_VISIBLE_DEVICES", "void") not in ("", "void", "none") else [],
        # The server binds --host/--port itself, as vLLM does; the engine publishes the port.
        "network_mode": "host",
        "listen": [],
        "binds": [{"Destination": "/", "Source": "/"}],  # paths are the container's own
        "status_file": f"{run}/status.json",
        "ctr_socket": f"{run}/ctr.sock",
    }
    import responder

    monitor = None
    if args.get("distributed_executor_backend") == "ray":
        report = ray_executor(args, spec["gpus"], responder.faults())
        monitor = report.pop("monitor")
        spec["ray_world"] = report
        common.write_json_atomic(f"{run}/ray-world.json", report)
        print(f"rigup stand-in: Ray executor ready: {json.dumps(report)}", flush=True)
    with open(f"{run}/spec.json", "w") as f:
        json.dump(spec, f)
    try:
        return responder.main([f"{run}/spec.json"])
    finally:
        if monitor is not None:  # a stop asked for: the ranks ending with the driver are no failure
            monitor[0].set()
            monitor[1].join(timeout=5)  # before Ray shuts down under its ray.wait (vLLM's _join_monitor_thread)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
