"""A real Ray rendezvous for the stand-in `vllm serve --distributed-executor-backend ray` (issue 29).

vLLM's multi-node recipe (`examples/online_serving/run_cluster.sh`) starts `ray start --head --port=6379`
on one rig, `ray start --address=HEAD:6379 --block` on the others, then `vllm serve ... --tensor-parallel-size
T --pipeline-parallel-size P --distributed-executor-backend ray` on the head. The test bed has no GPUs, so
this module does on CPU-only Ray (the PyPI wheel) what vLLM 0.27.1's Ray executor does before a model loads,
so that a wrong VLLM_HOST_IP, a blocked port or a missing member fails as it would on real rigs:

  head(...)    `ray start --head --block` (pinned ports, --node-ip-address, no dashboard, --num-gpus declares
               the rig's GPUs as a Ray resource), connects a driver, creates the placement group vLLM creates
               (world_size bundles {"GPU": 1.0}, strategy "PACK": vllm/v1/executor/ray_utils.py
               `initialize_ray_cluster`), waits for it with vLLM's `_wait_until_pg_ready` log lines and, past
               the timeout, fails with its ValueError wording; then places one actor per bundle (as
               RayExecutorV2 places its RayWorkerProc actors, named as `build_actor_name` names them) and
               makes a real round trip to each (node IP, pid); reports ready (callback, ready file, one JSON
               line); then watches the actors' run() refs with ray.wait as RayExecutorV2's monitor thread does
               (and ray.nodes() as a second signal): a member that dies ends the head non-zero with vLLM's
               messages ("RayWorkerProc rank=[...] died unexpectedly, shutting down executor.",
               "EngineCore encountered a fatal error.", "RuntimeError: Executor failed.") and Ray's own error.
  worker(...)  `ray start --address HEAD:PORT --block` with the same pins; returns its exit status.

The driver's steps are shared with the stand-in `vllm serve --distributed-executor-backend ray`
(vllm_entry.py, inside the image whose second layer holds Ray): connect() (vLLM's ray.init(address=None)
joins the cluster this node's `ray start` recorded), create_placement_group(), place_workers() (with
`standin_lib`, each rank reads its own node's simulated GPUs, takes the one Ray's GPU id names, fails as
vLLM's worker would when the id is beyond them, and registers a GPU process there) and watch();
start_executor() is the first three as the engine runs them, rendezvous() all four as head() runs them.

Facts (vLLM 0.27.1 wheel, `vllm/_version.py` commit g6e448d0ea): RayExecutorV2 is the default
(`VLLM_USE_RAY_V2_EXECUTOR_BACKEND` defaults to "1" in vllm/envs.py; vllm/v1/executor/abstract.py), and it calls
`initialize_ray_cluster(parallel_config, require_gpu_on_driver=False)`, so the "Current node has no GPU
available" check (RayDistributedExecutor only) does not apply; PG_WAIT_TIMEOUT is 1800 s, fixed.

Every process this module starts runs in its own session (a process group), and stop() kills that group and
every descendant by pid; `ray stop` is never used (it kills every Ray process of the machine by name). Each
node gets its own --temp-dir so two nodes on one machine (network namespaces) never share a session dir.

Stdlib + ray only. CLI:
    python3 ray_cluster.py head --ip IP --nodes N --gpus-per-node G --tp T --pp P [--timeout S] [ports...]
    python3 ray_cluster.py worker --ip IP --address HEAD:PORT --gpus-per-node G [ports...]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

PG_WAIT_TIMEOUT = 1800  # vllm/v1/executor/ray_utils.py (0.27.1)
EXIT_PG_TIMEOUT = 3
EXIT_NODE_DIED = 4
EXIT_RAY_START = 5


def log(level: str, msg: str) -> None:
    """vLLM's log line shape: `LEVEL MM-DD HH:MM:SS [file.py:line] msg` (without the line number)."""
    sys.stderr.write(f"{level} {time.strftime('%m-%d %H:%M:%S')} [ray_utils.py] {msg}\n")
    sys.stderr.flush()


@dataclass
class Ports:
    """Every port a Ray node opens, pinned (a firewall between rigs must let exactly these through)."""

    gcs: int = 6379  # --port (head only): the GCS
    node_manager: int = 6380
    object_manager: int = 6381
    min_worker: int = 10002
    max_worker: int = 10100
    dashboard_agent_listen: int = 52365
    dashboard_agent_grpc: int = 52366
    runtime_env_agent: int = 52367
    metrics_export: int = 52368

    def args(self, head: bool) -> list[str]:
        a = [
            f"--node-manager-port={self.node_manager}",
            f"--object-manager-port={self.object_manager}",
            f"--min-worker-port={self.min_worker}",
            f"--max-worker-port={self.max_worker}",
            f"--dashboard-agent-listen-port={self.dashboard_agent_listen}",
            f"--dashboard-agent-grpc-port={self.dashboard_agent_grpc}",
            f"--runtime-env-agent-port={self.runtime_env_agent}",
            f"--metrics-export-port={self.metrics_export}",
        ]
        if head:
            # no --ray-client-server-port: the minimal wheel has no Ray Client ("requires pip package
            # `ray[client]`") and starts no client server
            a = [f"--port={self.gcs}", *a]
        return a


@dataclass
class Node:
    """A `ray start ... --block` we started: its process group and what it was started with."""

    proc: subprocess.Popen
    temp_dir: str
    argv: list[str] = field(default_factory=list)

    def stop(self, sig: int = signal.SIGTERM, wait_s: float = 10.0) -> None:
        stop_tree(self.proc.pid, sig, wait_s)


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return out


def descendants(pid: int) -> list[int]:
    seen, todo = [], [pid]
    while todo:
        p = todo.pop()
        for c in _children(p):
            if c not in seen:
                seen.append(c)
                todo.append(c)
    return seen


def _pgid_members(pgid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[2]) == pgid:
                        out.append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    return out


def stop_tree(pid: int, sig: int = signal.SIGTERM, wait_s: float = 10.0) -> None:
    """Stop `ray start --block` (pid, a session leader: start_new_session) and everything it started, by pid.

    `sig` goes to `pid` alone first: on SIGTERM `ray start --block` stops its own daemons in order (signalling
    them all at once leaves the GCS and agents waiting on each other for seconds). Then whatever is left of
    its descendants and its process group (Ray's daemons stay in it; its workers are the raylet's children)
    gets SIGTERM, and SIGKILL after 2 s."""
    pids = {pid, *descendants(pid), *_pgid_members(pid)}
    _signal([pid], sig)
    end = time.monotonic() + wait_s
    while time.monotonic() < end and _alive(pid):
        time.sleep(0.05)
    left = [p for p in {*pids, *descendants(pid), *_pgid_members(pid)} if _alive(p)]
    if os.environ.get("RAYP_DEBUG") and left:
        sys.stderr.write(f"left after the root's exit: {left}\n")
    _signal(left, signal.SIGTERM)
    end = time.monotonic() + 2.0
    while time.monotonic() < end and any(_alive(p) for p in left):
        time.sleep(0.05)
    _signal([p for p in left if _alive(p)], signal.SIGKILL)


def _signal(pids, sig: int) -> None:
    for p in pids:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def ray_bin() -> str:
    """The `ray` script next to this interpreter (a venv's bin), else on PATH."""
    cand = os.path.join(os.path.dirname(sys.executable), "ray")
    return cand if os.path.exists(cand) else "ray"


def start_node(
    *,
    ip: str,
    gpus: int,
    ports: Ports,
    temp_dir: str,
    address: str | None = None,
    num_cpus: int = 0,
    object_store_bytes: int = 80 * 1024 * 1024,
    log_path: str | None = None,
    env: dict[str, str] | None = None,
) -> Node:
    """`ray start [--head | --address A] --block` in a new session. --num-cpus defaults to 0: no idle
    workers are prestarted (vLLM's actors take num_cpus=0 and one GPU of their bundle)."""
    head = address is None
    argv = [
        ray_bin(),
        "start",
        *(["--head"] if head else [f"--address={address}"]),
        f"--node-ip-address={ip}",
        f"--num-gpus={gpus}",
        f"--num-cpus={num_cpus}",
        f"--object-store-memory={object_store_bytes}",
        f"--temp-dir={temp_dir}",
        # `--include-dashboard` is refused without --head ("should only be specified when starting head node")
        *(["--include-dashboard=false"] if head else []),
        "--disable-usage-stats",
        *ports.args(head),
        "--block",
    ]
    os.makedirs(temp_dir, exist_ok=True)
    e = {**os.environ, **(env or {}), "RAY_USAGE_STATS_ENABLED": "0"}
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL
    try:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=e, start_new_session=True)
    finally:
        if log_path:
            out.close()
    return Node(proc=proc, temp_dir=temp_dir, argv=argv)


def build_actor_name(instance_id: str, rank: int, tp: int, pp: int) -> str:
    """vllm/v1/executor/ray_utils.py `build_actor_name` (0.27.1), pcp_size 1."""
    name = f"vllm_Worker_{instance_id}"
    if tp > 1:
        name += f"_TP{rank % tp}"
    if pp > 1:
        name += f"_PP{(rank // tp) % pp}"
    return name


def pg_timeout_message(specs: list[dict], timeout: float) -> str:
    """vLLM 0.27.1 `_wait_until_pg_ready`'s ValueError, word for word (vLLM's timeout is the int 1800)."""
    timeout = int(timeout) if float(timeout).is_integer() else timeout
    total_gpu_required = sum(spec.get("GPU", 0) for spec in specs)
    if total_gpu_required > 1:
        return (
            f"Cannot provide a placement group requiring "
            f"{total_gpu_required} GPUs "
            f"(placement_group_specs={specs}) within "
            f"{timeout} seconds.\n"
            f"Tensor parallel size may exceed available GPUs in your "
            f"cluster. Check resources with `ray status` and "
            f"`ray list nodes`.\n"
            f"If running on K8s with limited GPUs, consider reducing "
            f"--tensor-parallel-size to match available GPU resources."
        )
    return (
        "Cannot provide a placement group of "
        f"placement_group_specs={specs} within "
        f"{timeout} seconds. See "
        "`ray status` and `ray list nodes` to make sure the cluster "
        "has enough resources."
    )


class HeadFailure(Exception):
    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


def _wait_gcs(ip: str, port: int, node: Node, deadline: float) -> None:
    import socket

    while time.monotonic() < deadline:
        if node.proc.poll() is not None:
            raise HeadFailure(EXIT_RAY_START, f"ray start --head exited with status {node.proc.returncode}")
        try:
            with socket.create_connection((ip, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.2)
    raise HeadFailure(EXIT_RAY_START, f"the GCS did not listen on {ip}:{port}")


def connect(address: str | None, node_ip: str | None = None, local_gpus: int | None = None) -> None:
    """ray.init as the engine does. vLLM 0.27.1 (`initialize_ray_cluster`, CUDA) calls
    `ray.init(address=ray_address)` with ray_address None: Ray then joins the cluster the last `ray start` on
    this node recorded (<temp dir>/ray/ray_current_cluster, or $RAY_ADDRESS), else starts a local instance
    with the node's detected GPUs; `local_gpus` stands for that detection (CPU-only Ray finds none)."""
    import ray
    from ray._private import services

    kwargs: dict = {"logging_level": logging.WARNING, "log_to_driver": False}
    if node_ip:
        kwargs["_node_ip_address"] = node_ip
    if address is None and local_gpus is not None and services.canonicalize_bootstrap_address(None) is None:
        kwargs["num_gpus"] = local_gpus
    ray.init(address=address, **kwargs)


def create_placement_group(world_size: int, timeout: float):
    """`initialize_ray_cluster`'s new placement group (world_size bundles {"GPU": 1.0}, PACK) and
    `_wait_until_pg_ready`: its log lines while waiting, its ValueError past `timeout` (HeadFailure)."""
    import ray
    from ray.util.placement_group import placement_group

    log("INFO", "No current placement group found. Creating a new placement group.")
    if ray.cluster_resources().get("GPU", 0) < world_size:
        log("WARNING", "The number of required GPUs exceeds the total number of available GPUs in the placement group.")
    specs = [{"GPU": 1.0} for _ in range(world_size)]
    pg = placement_group(specs, strategy="PACK")
    ready_ref = pg.ready()
    wait_interval = 10.0
    start = time.time()
    while time.time() - start < timeout:
        done, _ = ray.wait([ready_ref], timeout=min(wait_interval, max(0.0, timeout - (time.time() - start))))
        if done:
            break
        wait_interval *= 2
        log(
            "INFO",
            "Waiting for creating a placement group of specs for "
            f"{int(time.time() - start)} seconds. specs={pg.bundle_specs}. Check `ray status` and "
            "`ray list nodes` to see if you have enough resources,"
            " and make sure the IP addresses used by ray cluster"
            " are the same as VLLM_HOST_IP environment variable"
            " specified in each node if you are running on a multi-node.",
        )
    try:
        ray.get(ready_ref, timeout=0)
    except ray.exceptions.GetTimeoutError:
        raise HeadFailure(EXIT_PG_TIMEOUT, "ValueError: " + pg_timeout_message(pg.bundle_specs, timeout)) from None
    return pg


def place_workers(
    pg,
    *,
    tp: int,
    pp: int,
    timeout: float,
    instance_id: str = "rigup",
    expect_nodes: int | None = None,
    standin_lib: str | None = None,
    gpu_memory_utilization: float = 0.9,
) -> tuple[list, dict]:
    """One actor per bundle of `pg` (RayExecutorV2's RayWorkerProc: num_cpus=0, one GPU, its bundle,
    named by `build_actor_name`), ranks in bundle order sorted driver node first, and a round trip to
    each. With `standin_lib` (the directory holding common.py on every node: the image's
    /usr/lib/rigup-standin), each rank reads its own node's simulated GPUs (hardware.json: the GPUs its
    container was given), takes the one Ray's GPU id names (an id beyond them fails as vLLM's worker
    would) and registers a GPU process there as a vLLM worker does. Returns (actors, ready report)."""
    import ray
    from ray.util.placement_group import placement_group_table
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    world_size = tp * pp
    t0 = time.monotonic()
    table = placement_group_table(pg)
    bundle_node = table["bundles_to_node_id"]
    nodes = {n["NodeID"]: n for n in ray.nodes() if n["Alive"]}
    per_node: dict[str, int] = {}
    for nid in bundle_node.values():
        per_node[nid] = per_node.get(nid, 0) + 1
    for nid, count in per_node.items():
        if count < tp:
            log(
                "WARNING",
                f"tensor_parallel_size={tp} is bigger than a reserved number of GPUs ({count} GPUs) in a node "
                f"{nid}. Tensor parallel workers can be spread out to 2+ nodes which can degrade the performance "
                "unless you have fast interconnect across nodes, like Infiniband. To resolve this issue, make "
                f"sure you have more than {tp} GPUs available at each node.",
            )
    if expect_nodes is not None and len(per_node) != expect_nodes:
        raise HeadFailure(EXIT_PG_TIMEOUT, f"the placement group spans {len(per_node)} nodes, expected {expect_nodes}")

    class RayWorkerProc:
        """Stands for vLLM's RayWorkerProc: `where` is the init barrier, `run` the busy loop."""

        def where(self, standin_lib=None, gpu_util=0.9, name="ray::RayWorkerProc"):
            import os as _os

            import ray as _ray

            ctx = _ray.get_runtime_context()
            ip = _ray.util.get_node_ip_address()
            out = {"ip": ip, "pid": _os.getpid(), "node_id": ctx.get_node_id(),
                   "ray_gpu_ids": [str(g) for g in ctx.get_accelerator_ids().get("GPU", [])]}
            if standin_lib is None:
                return out
            import sys as _sys

            if standin_lib not in _sys.path:
                _sys.path.insert(0, standin_lib)
            import common  # the stand-in's, installed on every node as vLLM is

            visible = _os.environ.get("NVIDIA_VISIBLE_DEVICES", "void") not in ("", "void", "none")
            gpus = common.hardware().get("gpus", []) if visible else []
            mine = []
            for gid in out["ray_gpu_ids"]:
                if not gid.isdigit() or int(gid) >= len(gpus):
                    out["error"] = (f"RuntimeError: CUDA error: invalid device ordinal (Ray GPU id(s) "
                                    f"{out['ray_gpu_ids']} on node {ip}, which has {len(gpus)} GPU(s): the node "
                                    "declared more GPUs to Ray (ray start --num-gpus) than it has)")
                    return out
                mine.append(gpus[int(gid)])
            out["gpus"] = [{"uuid": g["uuid"], "name": g.get("name"), "index": g.get("index")} for g in mine]
            procs = common.path("/run/nvidia-standin/procs")  # the toolkit's hook mounts it in GPU containers
            if mine and procs.is_dir():  # a vLLM worker's CUDA context and weights: nvidia-smi on this node shows it
                pidns = common.own_pidns()
                tag = "".join(ch for ch in pidns if ch.isdigit())
                common.write_json_atomic(
                    procs / f"{tag}-{_os.getpid()}.json",
                    {"pid": _os.getpid(), "pidns": pidns, "starttime": common.proc_starttime(), "name": name,
                     "gpus": [g["uuid"] for g in mine], "used_mib": int(gpu_util * int(mine[0]["memory_total_mib"]))})
            return out

        def gloo_listen(self):
            """torch.distributed's Gloo group (vLLM's cpu_group) binds each rank's socket on the address of
            GLOO_SOCKET_IFNAME (else the node's address): this one listens there, as a rank would."""
            import fcntl as _fcntl
            import os as _os
            import socket as _socket
            import struct as _struct

            import ray as _ray

            ifname = _os.environ.get("GLOO_SOCKET_IFNAME")
            address = _ray.util.get_node_ip_address()
            if ifname:
                unable = ("RuntimeError: [enforce fail at ../third_party/gloo/gloo/transport/tcp/device.cc:83] "
                          f"ifa != nullptr. Unable to find address for: {ifname}")
                if ifname not in {name for _, name in _socket.if_nameindex()}:
                    return {"error": unable}
                probe = _socket.socket(_socket.AF_INET, _socket.SOCK_DGRAM)
                try:  # SIOCGIFADDR: the interface's IPv4 address
                    raw = _fcntl.ioctl(probe.fileno(), 0x8915, _struct.pack("256s", ifname.encode()[:15]))
                    address = _socket.inet_ntoa(raw[20:24])
                except OSError:
                    return {"error": unable}
                finally:
                    probe.close()
            listener = _socket.socket()
            listener.bind((address, 0))
            listener.listen(64)
            self._gloo = listener
            return {"address": address, "port": listener.getsockname()[1], "ifname": ifname}

        def gloo_connect(self, rank, peers):
            """Connect to every other rank's Gloo socket (connectFullMesh); the first failure in torch's words."""
            import socket as _socket

            for other, (address, port) in enumerate(peers):
                if other == rank:
                    continue
                try:
                    _socket.create_connection((address, port), timeout=5).close()
                except OSError as exc:
                    return {"error": "RuntimeError: Gloo connectFullMesh failed with "
                                     "[../third_party/gloo/gloo/transport/tcp/pair.cc:144] no error "
                                     f"(rank {rank} to rank {other} at {address}:{port}: {exc})"}
            return {}

        def run(self):
            import time as _time

            while True:
                _time.sleep(3600)

    # Defined here so that Ray pickles it by value (this module is not importable on the other nodes);
    # named as vLLM's class is, since Ray's errors print it (class_name).
    RayWorkerProc.__qualname__ = RayWorkerProc.__name__
    remote_proc = ray.remote(RayWorkerProc)

    # ranks in bundle order sorted driver-node first (ray_utils `get_bundles_sorted_by_node`)
    driver_node = ray.get_runtime_context().get_node_id()
    order = sorted(range(world_size), key=lambda b: (0 if bundle_node[b] == driver_node else 1, bundle_node[b], b))
    actors = []
    for rank, b in enumerate(order):
        actors.append(
            remote_proc.options(
                name=build_actor_name(instance_id, rank, tp, pp),
                num_cpus=0,
                num_gpus=1,
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=b),
            ).remote()
        )
    remaining = max(1.0, timeout - (time.monotonic() - t0))
    try:
        wheres = ray.get([a.where.remote(standin_lib, gpu_memory_utilization) for a in actors], timeout=remaining)
    except ray.exceptions.GetTimeoutError:
        raise HeadFailure(EXIT_PG_TIMEOUT, "RuntimeError: Ray workers did not answer within the timeout") from None
    except ray.exceptions.RayError as e:
        raise HeadFailure(EXIT_NODE_DIED, f"RuntimeError: Worker failed to initialize: {e}") from None
    ranks = []
    for rank, (b, w) in enumerate(zip(order, wheres)):
        if w.get("error"):
            raise HeadFailure(EXIT_NODE_DIED, w["error"])
        if w["node_id"] != bundle_node[b]:
            raise HeadFailure(EXIT_PG_TIMEOUT, f"rank {rank} answered from node {w['node_id']}, not its bundle's")
        ranks.append({"rank": rank, "bundle": b, **{k: v for k, v in w.items() if k != "error"}})
    report = {
        "ready": True,
        "world_size": world_size,
        "tp": tp,
        "pp": pp,
        "nodes": sorted({nodes[n]["NodeManagerAddress"] for n in per_node}),
        "gpus": ray.cluster_resources().get("GPU", 0),
        "bundles": ranks,
        "seconds": round(time.monotonic() - t0, 3),
    }
    return actors, report


def watch(actors: list, head_node: Node | None = None, poll_s: float = 1.0, should_stop=None) -> None:
    """RayExecutorV2's worker monitor (`start_worker_monitor`: ray.wait on the actors' run() refs) plus
    ray.nodes() as a second signal; returns None once `should_stop()` says so, else raises HeadFailure
    with vLLM's lines when a rank (its node) dies. vLLM polls with a 5 s timeout; `poll_s` is how often
    the node table and `should_stop` are looked at."""
    import ray

    run_refs = [a.run.remote() for a in actors]
    ref_rank = {r: i for i, r in enumerate(run_refs)}
    members = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    while True:
        if should_stop is not None and should_stop():
            return
        done, _ = ray.wait(run_refs, num_returns=1, timeout=poll_s)
        if should_stop is not None and should_stop():
            return
        gone = [n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] in members and not n["Alive"]]
        if head_node is not None and head_node.proc.poll() is not None:
            raise HeadFailure(EXIT_NODE_DIED, f"the head's ray start exited with status {head_node.proc.returncode}")
        if not done and not gone:
            continue
        if not done:  # the node is marked dead; the actors' refs follow within a moment
            done, _ = ray.wait(run_refs, num_returns=len(run_refs), timeout=5.0)
        dead_ranks = sorted(ref_rank[r] for r in done)
        cause = ""
        for r in done:
            try:
                ray.get(r, timeout=0)
            except Exception as e:  # ray.exceptions.ActorDiedError and friends: Ray's own wording
                cause = f"{type(e).__name__}: {e}"
                break
        lines = [
            f"ERROR {time.strftime('%m-%d %H:%M:%S')} [ray_executor_v2.py] RayWorkerProc rank={dead_ranks} died "
            "unexpectedly, shutting down executor.",
        ]
        if gone:
            lines.append(f"(ray) node(s) {sorted(set(gone))} marked dead by the GCS")
        if cause:
            lines.append(cause)
        lines += [
            f"ERROR {time.strftime('%m-%d %H:%M:%S')} [core.py] EngineCore encountered a fatal error.",
            "RuntimeError: Executor failed.",
        ]
        raise HeadFailure(EXIT_NODE_DIED, "\n".join(lines))


def start_executor(
    *,
    tp: int,
    pp: int,
    timeout: float = PG_WAIT_TIMEOUT,
    standin_lib: str | None = None,
    gpu_memory_utilization: float = 0.9,
    local_gpus: int | None = None,
    instance_id: str | None = None,
) -> tuple[dict, list]:
    """`vllm serve --distributed-executor-backend ray`'s executor start (RayExecutorV2._init_executor up
    to its workers' ready barrier): connect as vLLM does (`connect(None)`), the placement group, one
    RayWorkerProc per bundle on its node's simulated GPUs. Returns (ready report, actors) for `watch`;
    raises HeadFailure as the engine core fails to start."""
    import uuid

    t0 = time.monotonic()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # initialize_ray_cluster sets it unless "1"
    connect(None, local_gpus=local_gpus)
    pg = create_placement_group(tp * pp, timeout)
    actors, report = place_workers(pg, tp=tp, pp=pp, timeout=max(1.0, timeout - (time.monotonic() - t0)),
                                   instance_id=instance_id or uuid.uuid4().hex[:5], standin_lib=standin_lib,
                                   gpu_memory_utilization=gpu_memory_utilization)
    gloo_full_mesh(actors, max(1.0, timeout - (time.monotonic() - t0)))
    report["seconds"] = round(time.monotonic() - t0, 3)
    return report, actors


def gloo_full_mesh(actors: list, timeout: float) -> None:
    """vLLM's init_device on every rank builds the Gloo group over the ranks: each listens on its
    GLOO_SOCKET_IFNAME's address and connects to every other. A wrong interface fails as torch does
    (vllm-project/vllm#5094, #7074): the rank cannot find its address, or cannot reach another's."""
    import ray

    listening = ray.get([a.gloo_listen.remote() for a in actors], timeout=timeout)
    failed = next((w["error"] for w in listening if w.get("error")), None)
    if failed is None:
        peers = [(w["address"], w["port"]) for w in listening]
        connected = ray.get([a.gloo_connect.remote(rank, peers) for rank, a in enumerate(actors)], timeout=timeout)
        failed = next((c["error"] for c in connected if c.get("error")), None)
    if failed is not None:
        log("ERROR", "Error executing method 'init_device'. This might cause deadlock in distributed execution.")
        raise HeadFailure(EXIT_NODE_DIED, failed)


def rendezvous(
    *,
    ip: str,
    gcs_port: int,
    tp: int,
    pp: int,
    timeout: float,
    instance_id: str = "rigup",
    expect_nodes: int | None = None,
    on_ready=None,
    watch: bool = True,
    head_node: Node | None = None,
) -> dict:
    """The driver's part (what `vllm serve` does in its engine core): ray.init to the running cluster,
    the placement group, the actors and their round trip, then the watch. Returns the ready report when
    watch is False; otherwise returns only by raising HeadFailure."""
    t0 = time.monotonic()
    connect(f"{ip}:{gcs_port}", node_ip=ip)
    pg = create_placement_group(tp * pp, timeout)
    actors, report = place_workers(pg, tp=tp, pp=pp, timeout=max(1.0, timeout - (time.monotonic() - t0)),
                                   instance_id=instance_id, expect_nodes=expect_nodes)
    report["seconds"] = round(time.monotonic() - t0, 3)
    if on_ready:
        on_ready(report)
    if not watch:
        return report
    _watch(actors, head_node=head_node)
    raise HeadFailure(EXIT_NODE_DIED, "the watch ended")  # not reached: _watch returns only when told to stop


_watch = watch  # rendezvous' parameter `watch` shadows the function


def head(
    *,
    ip: str | None = None,
    nodes: int,
    gpus_per_node: int,
    tp: int,
    pp: int,
    timeout: float = PG_WAIT_TIMEOUT,
    ports: Ports | None = None,
    temp_dir: str = "/tmp/ray-head",
    ready_file: str | None = None,
    on_ready=None,
    log_path: str | None = None,
    num_cpus: int = 0,
) -> int:
    """Start the head, rendezvous, report ready, watch. Returns the exit status (never 0 while watching:
    it returns only when something failed or on SIGTERM, which returns 0 after stopping the head)."""
    ip = ip or os.environ.get("VLLM_HOST_IP")
    if not ip:
        sys.stderr.write("ray_cluster: no node IP (--ip or VLLM_HOST_IP)\n")
        return 2
    ports = ports or Ports()
    node = start_node(ip=ip, gpus=gpus_per_node, ports=ports, temp_dir=temp_dir, log_path=log_path, num_cpus=num_cpus)

    def _term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _term)

    def _ready(report: dict) -> None:
        if ready_file:
            tmp = ready_file + ".tmp"
            with open(tmp, "w") as f:
                json.dump(report, f)
            os.replace(tmp, ready_file)
        print(json.dumps(report), flush=True)
        if on_ready:
            on_ready(report)

    try:
        _wait_gcs(ip, ports.gcs, node, time.monotonic() + 60)
        rendezvous(ip=ip, gcs_port=ports.gcs, tp=tp, pp=pp, timeout=timeout, expect_nodes=nodes, on_ready=_ready, head_node=node)
        return 0  # not reached
    except HeadFailure as e:
        sys.stderr.write(str(e) + "\n")
        sys.stderr.flush()
        return e.code
    except KeyboardInterrupt:
        return 0
    finally:
        t = time.monotonic()
        try:
            import ray

            if ray.is_initialized():
                ray.shutdown()
        except Exception:
            pass
        t2 = time.monotonic()
        node.stop()
        if os.environ.get("RAYP_DEBUG"):
            sys.stderr.write(f"shutdown {t2 - t:.2f}s stop {time.monotonic() - t2:.2f}s\n")


def worker(
    *,
    ip: str | None = None,
    address: str,
    gpus_per_node: int,
    ports: Ports | None = None,
    temp_dir: str = "/tmp/ray-worker",
    log_path: str | None = None,
    num_cpus: int = 0,
) -> int:
    """`ray start --address ... --block` until it ends (or SIGTERM, which stops it and returns 0)."""
    ip = ip or os.environ.get("VLLM_HOST_IP")
    if not ip:
        sys.stderr.write("ray_cluster: no node IP (--ip or VLLM_HOST_IP)\n")
        return 2
    node = start_node(
        ip=ip, gpus=gpus_per_node, ports=ports or Ports(), temp_dir=temp_dir, address=address, log_path=log_path, num_cpus=num_cpus
    )
    stopped = []

    def _term(signum, frame):
        stopped.append(signum)
        node.stop(wait_s=5.0)  # a `ray start` still dialling the GCS does not act on SIGTERM: killed after 5 s

    signal.signal(signal.SIGTERM, _term)
    try:
        rc = node.proc.wait()
    finally:
        node.stop()
    return 0 if stopped else (rc or 0)


def _ports_from(ns: argparse.Namespace) -> Ports:
    p = Ports()
    for k in vars(p):
        v = getattr(ns, k, None)
        if v is not None:
            setattr(p, k, v)
    return p


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="ray_cluster")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("head", "worker"):
        s = sub.add_parser(name)
        s.add_argument("--ip", default=None, help="node IP (default: $VLLM_HOST_IP)")
        s.add_argument("--gpus-per-node", type=int, default=2)
        s.add_argument("--num-cpus", type=int, default=0)
        s.add_argument("--temp-dir", default=f"/tmp/ray-{name}")
        s.add_argument("--log", default=None, help="ray start's output goes here")
        for k, v in vars(Ports()).items():
            s.add_argument("--" + k.replace("_", "-") + "-port", dest=k, type=int, default=None, help=f"default {v}")
        if name == "head":
            s.add_argument("--nodes", type=int, required=True)
            s.add_argument("--tp", type=int, required=True)
            s.add_argument("--pp", type=int, default=1)
            s.add_argument("--timeout", type=float, default=PG_WAIT_TIMEOUT)
            s.add_argument("--ready-file", default=None)
        else:
            s.add_argument("--address", required=True)
    ns = ap.parse_args(argv)
    ports = _ports_from(ns)
    if ns.cmd == "head":
        return head(
            ip=ns.ip, nodes=ns.nodes, gpus_per_node=ns.gpus_per_node, tp=ns.tp, pp=ns.pp, timeout=ns.timeout, ports=ports,
            temp_dir=ns.temp_dir, ready_file=ns.ready_file, log_path=ns.log, num_cpus=ns.num_cpus,
        )
    return worker(
        ip=ns.ip, address=ns.address, gpus_per_node=ns.gpus_per_node, ports=ports, temp_dir=ns.temp_dir, log_path=ns.log,
        num_cpus=ns.num_cpus,
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
