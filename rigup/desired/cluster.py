"""Clusters: one variant served by several rigs with vLLM's own multi-node engine (issue 29).

Two 2-GPU boxes serve a 4-GPU recipe: tensor parallelism inside each host times pipeline parallelism
across the hosts (TP2 x PP2). The fleet file lists them beside `hosts`/`groups`:

    clusters:
      - name: big              # like a pod's: unit rigup-big.service on every member
        variant: qwen38-multi4-autoround-int4-mtp
        hosts: [rig-a, rig-b]  # the first is the head (publishes the API), the others are workers
        gpus_per_host: 2       # optional; default: the variant's tensor_parallel_size // len(hosts)
        port: 8030             # optional, like a pod's
        variant_overrides: {}  # optional, like a pod's
        socket_interface: eth1 # optional: NCCL's, Gloo's and TP's interface on every member; default: the
                               # one each member's routes to the others leave by (read, never guessed)

This module is the control machine's pure part: `parse_clusters` checks the entries (ClusterError names
the key path, the value and what is allowed), `split` does the arithmetic and names the render transform
(SPLIT_TRANSFORM, beyond upstream: club-3090's docs/PODS.md keeps a pod on one host), `refusals` says
what vLLM cannot run across hosts, each with its reason and the vLLM source it was read in.

What vLLM does, read in the PyPI wheels of the releases the catalog's vllm/vllm-openai images carry (file
and commit of vllm-project/vllm, the commit being the wheel's vllm/_version.py commit id): v0.22.0 =
0b3ba88f1, v0.24.0 = ee0da84ab, v0.27.1 = 6e448d0ea, and v0.20.1 = 132765e35 for the nightlies (not read
themselves: 7a1eb8ac is 0.20.1rc1.dev16, the others are spring 2026 builds). Each fact below holds in all
four unless it names a release.

Engine: vLLM's Ray backend (`--distributed-executor-backend ray`) over a Ray cluster of the members, as
vLLM's examples/online_serving/run_cluster.sh lays it out (`ray start --head --port=6379` on the head,
`ray start --block --address=HEAD:6379` on each worker, in the vllm/vllm-openai image, host networking;
vllm-project/vllm@0c37e239). vLLM also runs multi-node without Ray (below); rigup takes Ray because
(1) every release the catalog pins runs it (0.27.1's default Ray executor is RayExecutorV2,
vllm/envs.py VLLM_USE_RAY_V2_EXECUTOR_BACKEND), (2) its placement group takes every member's GPUs before
a layer is loaded, so a missing or unreachable member fails the start with vLLM's own "Cannot provide a
placement group requiring N GPUs" (vllm/v1/executor/ray_utils.py) instead of a hang, (3) a member that
dies fails the head ("RayWorkerProc rank=... died unexpectedly", ray_executor_v2.py), so systemd restarts
it, and (4) the test bed can run the real rendezvous: Ray's CPU wheel from PyPI (rigup_testbed
standins), where the native backend's would need torch. Every Ray port is pinned (cluster_ray_* knobs)
for the firewall: Ray listens on all addresses whatever --node-ip-address says.

- Multi-node without Ray: `vllm serve --nnodes N --node-rank R --master-addr HEAD --master-port P`
  (vllm/engine/arg_utils.py, all four releases; master_port defaults to 29501 in vllm/config/parallel.py);
  a node with rank > 0 runs a headless multiproc executor and no API server
  (vllm/entrypoints/cli/serve.py `if parallel_config.node_rank_within_dp > 0`); with nnodes > 1 on CUDA
  the backend is "mp" (vllm/config/parallel.py `elif current_platform.is_cuda() and self.nnodes > 1`).
- Layers need not divide by PP: get_pp_indices (vllm/distributed/utils.py, identical in all four) gives
  every stage num_hidden_layers // pp and one more layer to each of the `remainder` stages just before
  the last; VLLM_PP_LAYER_PARTITION overrides it and is refused (ValueError) unless it has exactly pp
  entries summing to num_hidden_layers. `layer_partition` mirrors it.
- PP needs a model class implementing SupportsPP (vllm/config/model.py verify_with_parallel_config:
  NotImplementedError "Pipeline parallelism is not supported for this model"); the catalog's families do
  (v0.27.1 vllm/model_executor/models/qwen3_5.py Qwen3_5ForCausalLMBase, qwen3_vl.py
  Qwen3VLForConditionalGeneration, gemma4_mm.py Gemma4ForConditionalGeneration, nemotron_h.py
  NemotronHForCausalLM).
- Speculative decoding: the drafter lives on the last pipeline stage only (vllm/v1/worker/
  gpu_model_runner.py `if self.speculative_config and get_pp_group().is_last_rank`, all four). MTP works
  there, with its own embed_tokens/lm_head (sharing the target's needs a PP world of 1:
  vllm/v1/spec_decode/llm_base_proposer.py `if get_pp_group().world_size == 1`). DFlash and EAGLE3 feed on
  the target's auxiliary hidden states, which each stage collects only from the layers it holds
  (v0.27.1 vllm/model_executor/models/qwen3_next.py forward over `islice(self.layers, self.start_layer,
  self.end_layer)`): the last stage hands the drafter fewer features than its fc takes, which v0.27.1
  refuses (vllm/model_executor/models/qwen3_dflash.py combine_hidden_states: "DFlash drafter expects
  {expected} concatenated aux hidden features"); older releases lack that check and hand the fc input of
  the wrong width. Model Runner V2 lists "EAGLE3 with pipeline parallelism" as unsupported
  (vllm/config/vllm.py _get_v2_model_runner_unsupported_features, v0.22.0 on).
- Vision: not refused. The encoder runs on the first stage only (gpu_model_runner.py `if
  self.supports_mm_inputs and is_first_rank`), while Qwen3.5's vision tower is built on every stage
  (qwen3_5.py Qwen3_5ForConditionalGeneration.__init__ has no pipeline guard).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from rigup import DEPLOY_ROOT
from rigup.desired.catalog import load_catalog
from rigup.desired.cluster_token import RAY_AUTH_MODE
from rigup.desired.knobs import knob
from rigup.desired.templating import render_template
from rigup.parsers.iproute import PeerRoutes, interface_for_peers, route_to

CLUSTER_KEYS = ("name", "variant", "hosts", "gpus_per_host", "port", "variant_overrides", "socket_interface")

# The render transform a cluster adds to its variant's recipe (`rigup render --explain` names it).
SPLIT_TRANSFORM = "split-tp-across-hosts-as-pp"
SPLIT_EXPLANATION = (
    "beyond upstream (club-3090's docs/PODS.md keeps a pod on one host): the variant's tensor_parallel_size "
    "GPUs are split as tensor parallelism over gpus_per_host GPUs inside each member host times pipeline "
    "parallelism over the member hosts, on vLLM's Ray backend over the members' Ray cluster (vLLM's "
    "run_cluster.sh): the head (the first host) runs the Ray head and the API with the first layers, each "
    "worker joins the head's Ray and runs the next layers; vLLM splits the layers as evenly as it can "
    "(vllm/distributed/utils.py get_pp_indices)"
)

# vLLM's refusals and failures across pipeline stages, by speculative method (module docstring).
_DRAFTER_ON_LAST_STAGE = (
    "vLLM puts the drafter on the last pipeline stage only (vllm/v1/worker/gpu_model_runner.py "
    "`if self.speculative_config and get_pp_group().is_last_rank`, v0.20.1 to v0.27.1)"
)
_AUX_HIDDEN_STATES = (
    "it drafts from the target's hidden states of layers across the whole model, but each stage collects "
    "them only from its own layers (v0.27.1 vllm/model_executor/models/qwen3_next.py forward: "
    "islice(self.layers, self.start_layer, self.end_layer))"
)
REFUSED_SPECULATIVE: dict[str, str] = {
    "dflash": (
        f"speculative decoding with DFlash across hosts: {_DRAFTER_ON_LAST_STAGE} and {_AUX_HIDDEN_STATES}, so "
        "the drafter gets fewer features than it takes: v0.27.1 raises \"DFlash drafter expects N concatenated "
        "aux hidden features\" (vllm/model_executor/models/qwen3_dflash.py combine_hidden_states, 6e448d0ea) "
        "and older releases hand its fc input of the wrong width; use a variant without DFlash (MTP works across hosts)"
    ),
    "eagle3": (
        f"speculative decoding with EAGLE3 across hosts: {_DRAFTER_ON_LAST_STAGE} and {_AUX_HIDDEN_STATES}; "
        "Model Runner V2 refuses \"EAGLE3 with pipeline parallelism\" (vllm/config/vllm.py "
        "_get_v2_model_runner_unsupported_features, v0.22.0 0b3ba88f1 to v0.27.1 6e448d0ea)"
    ),
}

# Images whose engine is not one `vllm serve` rigup can split (catalog `images` repositories).
REFUSED_IMAGES: dict[str, str] = {
    "vllm/vllm-omni": (
        "a vLLM-Omni recipe: its GPUs are the stages of upstream's deploy config (thinker, talker, code2wav, "
        "each placed on a device of one machine), not tensor parallelism rigup could split across hosts"
    ),
    "lmcache/vllm-openai": (
        "an LMCache recipe: upstream's entrypoint starts an LMCache server inside the container that the "
        "engine's LMCacheMPConnector fills from host RAM sized for one host (L1 30 GB, Requires-min-ram-gb 58), "
        "in a third-party image whose vLLM build is none of the vllm/vllm-openai releases these rules were "
        "read in; rigup does not split it (vLLM itself does not refuse the connector under PP)"
    ),
}


class ClusterError(ValueError):
    """A `clusters` entry rigup cannot use; the message names the entry, the key and what is allowed."""


@dataclass(frozen=True)
class Cluster:
    name: str  # unit rigup-<name>.service on every member, like a pod's
    variant: str
    hosts: tuple[str, ...]  # in rank order: the head first
    gpus_per_host: int
    overrides: Mapping[str, Any]  # variant_overrides (a `port` entry included)
    index: int = 0  # its place in the fleet file's list (messages name clusters[index])
    socket_interface: str | None = None  # NCCL/Gloo/TP's interface; None: the routed one, read on each member

    @property
    def head(self) -> str:
        """The member that publishes the API (node rank 0)."""
        return self.hosts[0]

    @property
    def workers(self) -> tuple[str, ...]:
        return self.hosts[1:]

    @property
    def pipeline_parallel(self) -> int:
        return len(self.hosts)

    @property
    def tensor_parallel(self) -> int:
        return self.gpus_per_host

    @property
    def unit(self) -> str:
        return f"rigup-{self.name}.service"

    @property
    def where(self) -> str:
        """How messages name it: "clusters[0] (big)"."""
        return f"clusters[{self.index}] ({self.name})"

    def member_rank(self, host: str) -> int:
        """The host's node rank (vLLM's --node-rank): 0 for the head, then the workers in the listed order."""
        if host not in self.hosts:
            raise ClusterError(f"{self.where}: {host!r} is not a member (hosts: {', '.join(self.hosts)})")
        return self.hosts.index(host)


@dataclass(frozen=True)
class VariantFacts:
    """What the cluster rules read of a variant: from the catalog (`variant_facts`) or a resolved recipe
    (`recipe_facts`, which also knows what upstream's compose file says: its speculative method, its
    environment, a deploy config)."""

    variant: str
    tensor_parallel_size: int  # the GPU count of the recipe, variant_overrides applied
    model: str  # catalog model key
    image_repository: str
    speculative_method: str | None  # "mtp", "dflash", ...; None: none (or, from the catalog, none it notes)
    language_model_only: bool
    num_hidden_layers: int | None = None  # catalog model `num_hidden_layers` when present
    environment: Mapping[str, str] | None = None  # the container's (recipe only)
    deploy_config: bool = False  # vLLM-Omni --deploy-config stages (recipe only)
    genesis: bool = False  # Genesis patches at container start (recipe only)
    image: str = ""  # the catalog image's key
    ray_version: str | None = None  # the Ray the image carries (catalog images.<key>.ray_version); None: not recorded


@dataclass(frozen=True)
class Split:
    """How a cluster runs its variant: TP inside each host x PP across the hosts."""

    cluster: str
    transform: str  # SPLIT_TRANSFORM
    explanation: str  # SPLIT_EXPLANATION
    tensor_parallel: int  # gpus_per_host
    pipeline_parallel: int  # member hosts
    hosts: tuple[str, ...]  # node ranks in order
    layers: tuple[int, ...] | None  # decoder layers per stage (vLLM's default partition); None: count unknown
    notes: tuple[str, ...] = ()  # what changes for the variant across hosts, without being refused

    @property
    def world_size(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel


def positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def recipe_facts(recipe: Any) -> VariantFacts:
    """The facts of a resolved rigup.desired.recipe.Recipe: what upstream's compose file says included."""
    layers = load_catalog()["models"][recipe.model.name].get("num_hidden_layers")
    return VariantFacts(
        variant=recipe.variant,
        tensor_parallel_size=int(recipe.tensor_parallel_size),
        model=recipe.model.name,
        image_repository=recipe.image.repository,
        speculative_method=recipe.speculative_method,
        language_model_only=bool(recipe.language_model_only),
        num_hidden_layers=layers if positive_int(layers) else None,
        environment={env.name: env.value for env in recipe.environment},
        deploy_config="--deploy-config" in recipe.vllm_args or recipe.gpu_count != recipe.tensor_parallel_size,
        genesis=bool(recipe.genesis),
        image=recipe.image.key,
        ray_version=image_ray_version(recipe.image.key),
    )


# Ray's token authentication (RAY_AUTH_MODE=token, rigup.desired.cluster_token), which every member runs with, is
# Ray 2.52's: an older Ray ignores the variable and its GCS, raylets and job API answer anyone (CVE-2023-48022).
# files/cluster/rigup-cluster-member reads the version of the Ray `ray` runs before it starts it and refuses the
# same; a catalog image that records its Ray (ray_version) is refused here, before anything changes.
RAY_TOKEN_AUTH_SINCE = (2, 52)


def image_ray_version(image: str) -> str | None:
    """The Ray catalog image `image` carries (its ray_version), None when the catalog does not record it."""
    value = load_catalog()["images"].get(image, {}).get("ray_version")
    return str(value) if value is not None else None


def ray_refusal(cluster: Cluster, facts: VariantFacts) -> str | None:
    """Why `cluster` cannot run its variant's image with Ray's token authentication (the image's Ray, as the catalog
    records it, is older than RAY_TOKEN_AUTH_SINCE); None when it can, or when the catalog does not say (the member
    script checks it at start)."""
    if facts.ray_version is None:
        return None
    major, minor = (int(part) for part in facts.ray_version.split(".")[:2])
    if (major, minor) >= RAY_TOKEN_AUTH_SINCE:
        return None
    since = ".".join(map(str, RAY_TOKEN_AUTH_SINCE))
    return (f"variant: {cluster.variant!r} runs image {facts.image}, whose Ray is {facts.ray_version} (the catalog's "
            f"images.{facts.image}.ray_version), but every member of a cluster (here {', '.join(cluster.hosts)}) "
            f"runs Ray with token authentication (RAY_AUTH_MODE=token), which Ray reads from {since} on: an older "
            f"Ray ignores it and answers anyone; variant takes a variant whose image carries Ray {since} or later")


def _facts(recipe_or_facts: Any) -> VariantFacts:
    return recipe_or_facts if isinstance(recipe_or_facts, VariantFacts) else recipe_facts(recipe_or_facts)


def layer_partition(num_hidden_layers: int, pipeline_parallel: int, override: str | None = None) -> tuple[int, ...]:
    """Decoder layers per pipeline stage as vLLM assigns them (vllm/distributed/utils.py get_pp_indices):
    `override` is VLLM_PP_LAYER_PARTITION ("31,33"); without it each stage gets layers // pp and the
    remainder goes one layer each to the stages before the last ("the last partition ... often contains an
    additional norm layer"). Raises ClusterError where vLLM raises ValueError."""
    if override is not None:
        try:
            parts = tuple(int(p) for p in override.split(","))
        except ValueError:
            raise ClusterError(f"VLLM_PP_LAYER_PARTITION={override!r}: vLLM takes comma-separated layer counts "
                               f"(\"Invalid partition string\", vllm/distributed/utils.py get_pp_indices)") from None
        if len(parts) != pipeline_parallel:
            raise ClusterError(f"VLLM_PP_LAYER_PARTITION={override!r}: {len(parts)} counts for {pipeline_parallel} "
                               f"pipeline stages (vLLM: \"len(partitions)=... does not match pp_size\")")
        if sum(parts) != num_hidden_layers:
            raise ClusterError(f"VLLM_PP_LAYER_PARTITION={override!r}: {sum(parts)} layers, the model has "
                               f"{num_hidden_layers} (vLLM: \"sum(partitions)=... does not match num_hidden_layers\")")
        return parts
    parts = [num_hidden_layers // pipeline_parallel] * pipeline_parallel
    for i in range(2, num_hidden_layers % pipeline_parallel + 2):
        parts[-i] += 1
    return tuple(parts)


def split(cluster: Cluster, recipe_or_facts: Any) -> Split:
    """TP = gpus_per_host inside each host x PP = the member hosts across them, for a recipe (Recipe) or the
    catalog's facts (VariantFacts). Raises ClusterError when the recipe's GPU count (its tensor_parallel_size)
    is not gpus_per_host x hosts, or when its VLLM_PP_LAYER_PARTITION is one vLLM refuses."""
    facts = _facts(recipe_or_facts)
    want = cluster.gpus_per_host * len(cluster.hosts)
    if facts.tensor_parallel_size != want:
        raise ClusterError(
            f"{cluster.where}: gpus_per_host: {cluster.gpus_per_host} GPU(s) x {len(cluster.hosts)} hosts = {want}, "
            f"but variant {facts.variant!r} runs on {facts.tensor_parallel_size} GPU(s) (tensor_parallel_size"
            f"{', with variant_overrides' if 'tensor_parallel_size' in cluster.overrides else ''}); allowed: "
            f"gpus_per_host x hosts = {facts.tensor_parallel_size}"
        )
    override = (facts.environment or {}).get("VLLM_PP_LAYER_PARTITION")
    layers: tuple[int, ...] | None = None
    if facts.num_hidden_layers is not None:
        try:
            layers = layer_partition(facts.num_hidden_layers, len(cluster.hosts), override)
        except ClusterError as exc:
            raise ClusterError(f"{cluster.where}: {exc}") from None
    elif override is not None and len(override.split(",")) != len(cluster.hosts):
        raise ClusterError(f"{cluster.where}: VLLM_PP_LAYER_PARTITION={override!r}: {len(override.split(','))} counts "
                           f"for {len(cluster.hosts)} pipeline stages (vLLM: \"len(partitions)=... does not match pp_size\")")
    return Split(
        cluster=cluster.name,
        transform=SPLIT_TRANSFORM,
        explanation=SPLIT_EXPLANATION,
        tensor_parallel=cluster.gpus_per_host,
        pipeline_parallel=len(cluster.hosts),
        hosts=cluster.hosts,
        layers=layers,
        notes=tuple(_notes(cluster, facts)),
    )


def _notes(cluster: Cluster, facts: VariantFacts) -> list[str]:
    notes = []
    if facts.speculative_method == "mtp":
        notes.append(f"the MTP drafter runs on the last stage ({cluster.hosts[-1]}) with its own copy of the "
                     f"embeddings and LM head: vLLM shares the target's only in a pipeline of one "
                     f"(vllm/v1/spec_decode/llm_base_proposer.py `if get_pp_group().world_size == 1`)")
    if not facts.language_model_only:
        notes.append(f"images are encoded on the head ({cluster.head}) only (vllm/v1/worker/gpu_model_runner.py "
                     f"`if self.supports_mm_inputs and is_first_rank`); a Qwen3.5-class model still loads its vision "
                     f"tower on every member (vllm/model_executor/models/qwen3_5.py builds it without a pipeline "
                     f"guard): language_model_only saves that memory")
    if facts.genesis:
        notes.append("Genesis patches vLLM at container start on every member; they are validated on one host only")
    return notes


def refusals(cluster: Cluster, recipe_or_facts: Any) -> list[str]:
    """What vLLM cannot run across `cluster`'s hosts for this recipe (Recipe) or the catalog's facts
    (VariantFacts), each with its reason and where vLLM says so; [] when nothing is refused.

    Not refused, because vLLM does not refuse it: a layer count PP does not divide (vLLM spreads the
    remainder: `layer_partition`), MTP (the drafter runs on the last stage), a vision tower (encoded on the
    first stage)."""
    facts = _facts(recipe_or_facts)
    found = []
    method = facts.speculative_method
    if method is not None and method in REFUSED_SPECULATIVE:
        found.append(REFUSED_SPECULATIVE[method])
    if facts.image_repository in REFUSED_IMAGES:
        found.append(REFUSED_IMAGES[facts.image_repository])
    elif facts.deploy_config:
        found.append(REFUSED_IMAGES["vllm/vllm-omni"])
    return found


def describe(cluster: Cluster, result: Split) -> str:
    """One paragraph for `rigup render --explain`: the transform, its explanation and the split."""
    layers = (f"; layers per stage {json.dumps(list(result.layers))}" if result.layers is not None
              else "; layers per stage: vLLM's even split (the catalog has no num_hidden_layers for the model)")
    members = ", ".join(f"{h} (rank {i}{', head' if i == 0 else ''})" for i, h in enumerate(cluster.hosts))
    notes = "".join(f"; {n}" for n in result.notes)
    return (f"{result.transform}: {result.explanation}. Cluster {cluster.name}: TP {result.tensor_parallel} x PP "
            f"{result.pipeline_parallel} on {members}{layers}{notes}")


def cluster_knob(cluster: Cluster, rank: int) -> dict[str, Any]:
    """The `cluster` knob the fleet file's loader gives member `rank`: the entry as listed, plus the rank."""
    return {"name": cluster.name, "variant": cluster.variant, "hosts": list(cluster.hosts),
            "gpus_per_host": cluster.gpus_per_host, "variant_overrides": dict(cluster.overrides), "rank": rank,
            "index": cluster.index, "socket_interface": cluster.socket_interface}


def cluster_of(knob_value: Mapping[str, Any]) -> Cluster:
    """The Cluster a member's `cluster` knob describes (cluster_knob's inverse)."""
    return Cluster(str(knob_value["name"]), str(knob_value["variant"]), tuple(knob_value["hosts"]),
                   int(knob_value["gpus_per_host"]), dict(knob_value.get("variant_overrides") or {}),
                   int(knob_value.get("index", 0)), knob_value.get("socket_interface"))


# --- a member's share: what the render transform `cluster` is told -----------------------------------------

@dataclass(frozen=True)
class ClusterNet:
    """How a member reaches the others, read on it (rigup.parsers.iproute.interface_for_peers): the
    interface NCCL, Gloo and TP bind to (the one the member-to-member routes leave by, unless the cluster
    names its socket_interface), this member's address on the routed one (Ray's and vLLM's), and the head's
    address as the member reaches it. Unread (a preview without facts): compose variables the .env would hold."""

    ifname: str
    address: str
    head_address: str

    @classmethod
    def unread(cls) -> ClusterNet:
        return cls("${RIGUP_CLUSTER_IFNAME}", "${RIGUP_CLUSTER_ADDRESS}", "${RIGUP_CLUSTER_HEAD_ADDRESS}")


@dataclass(frozen=True)
class RayPorts:
    """The ports every member's Ray node listens on (the cluster_ray_* knobs), pinned so the firewall can
    admit the members to exactly these."""

    gcs: int
    node_manager: int
    object_manager: int
    agent: int  # and the next three
    min_worker: int
    max_worker: int

    @classmethod
    def from_knobs(cls, data: Mapping[str, Any]) -> RayPorts:
        first, last = knob(data, "cluster_ray_worker_ports")
        return cls(knob(data, "cluster_ray_port"), knob(data, "cluster_ray_node_manager_port"),
                   knob(data, "cluster_ray_object_manager_port"), knob(data, "cluster_ray_agent_port"),
                   int(first), int(last))

    def tcp(self, head: bool) -> list[str]:
        """Port specs (nftables' "a" and "a-b") a member must accept from the other members."""
        out = [str(self.gcs)] if head else []
        return [*out, str(self.node_manager), str(self.object_manager), f"{self.agent}-{self.agent + 3}",
                f"{self.min_worker}-{self.max_worker}"]


@dataclass(frozen=True)
class ClusterMember:
    """One host's share of a cluster, as the render transform `cluster` applies it."""

    cluster: Cluster
    rank: int
    net: ClusterNet
    ports: RayPorts
    script: str  # rig path of rigup's member script (files/cluster/rigup-cluster-member)

    @property
    def role(self) -> str:
        return "head" if self.rank == 0 else "worker"

    def environment(self) -> dict[str, str]:
        """The container's environment for its role: the address and interface every library picks its
        socket by (vLLM's VLLM_HOST_IP, Ray's as vLLM's run_cluster.sh sets it, NCCL, Gloo, TP), no
        InfiniBand on Ethernet, Ray's token authentication on, and what the member script reads."""
        p = self.ports
        return {
            "VLLM_HOST_IP": self.net.address,
            "RAY_NODE_IP_ADDRESS": self.net.address,
            "RAY_OVERRIDE_NODE_IP_ADDRESS": self.net.address,
            "NCCL_SOCKET_IFNAME": f"={self.net.ifname}",  # '=': this interface exactly, not a prefix
            "GLOO_SOCKET_IFNAME": self.net.ifname,
            "TP_SOCKET_IFNAME": self.net.ifname,
            "NCCL_IB_DISABLE": "1",
            "RIGUP_CLUSTER_ROLE": self.role,
            "RIGUP_CLUSTER_HEAD": f"{self.net.head_address}:{p.gcs}",
            "RIGUP_CLUSTER_NODES": str(self.cluster.pipeline_parallel),
            "RIGUP_CLUSTER_GPUS": str(self.cluster.gpus_per_host),
            "RIGUP_RAY_PORTS": f"{p.gcs} {p.node_manager} {p.object_manager} {p.agent} {p.min_worker} {p.max_worker}",
            # Ray's token authentication on every Ray process of the member (rigup.desired.cluster_token);
            # the token itself comes from the 0600 .env as ${RAY_AUTH_TOKEN:-}
            "RAY_AUTH_MODE": RAY_AUTH_MODE,
        }


# --- a member's network, decided from what it read (rigup.facts.network.ClusterPeerRoutes) -------------

TEN_GBE_MBPS = 10_000
# Members' clocks further apart than this get a warning: vLLM and Ray keep time per host, so nothing breaks,
# but one request's log lines and metrics on the head and the workers no longer line up.
CLOCK_SKEW_WARN_S = 1.0


@dataclass(frozen=True)
class MemberNetwork:
    """How one member reaches the others: the decision (net), or why there is none (problem), and what
    preflight reports beside it."""

    host: str
    net: ClusterNet | None
    problem: str | None
    mtu: int | None = None
    speed_mbps: int | None = None
    warnings: tuple[str, ...] = ()
    clock_offset_s: float | None = None  # the member's clock minus the control machine's, as read


def member_net(cluster: Cluster, host: str, read: PeerRoutes) -> MemberNetwork:
    """`host`'s interface and address towards the other members (one interface and one private source
    address to all of them: rigup.parsers.iproute.interface_for_peers), and the head's address as `host`
    reaches it (the head's own source address on the head). Read, never guessed: a peer that does not
    resolve, or is reached over another interface, is a problem naming it."""
    others = [h for h in cluster.hosts if h != host]
    unresolved = [p for p in others if not read.addresses.get(p)]
    if unresolved:
        return MemberNetwork(host, None, f"{', '.join(unresolved)} (member of {cluster.where}) does not resolve to an "
                                         f"IPv4 address on {host}")
    choice = interface_for_peers({p: read.routes.get(p, "") for p in others})
    if isinstance(choice, str):
        return MemberNetwork(host, None, f"{cluster.where} on {host}: {choice}")
    dev, src = choice
    head_address = src if host == cluster.head else str(read.addresses[cluster.head])
    warnings = []
    ifname = dev
    if cluster.socket_interface is not None:
        if cluster.socket_interface not in read.mtu:
            return MemberNetwork(host, None, f"{cluster.where}: socket_interface: {cluster.socket_interface!r} is not "
                                             f"an interface of {host} (interfaces: {', '.join(sorted(read.mtu))})")
        ifname = cluster.socket_interface
        if ifname != dev:
            warnings.append(f"{cluster.where}: socket_interface {ifname!r} on {host} is not {dev}, the interface its "
                            f"routes to the other members leave by: NCCL and Gloo bind there, and the rendezvous "
                            f"fails unless the members reach each other over it too")
    routed = [p for p in others if route_to(read.routes[p]).via is not None]
    if routed:
        warnings.append(f"{host} reaches {', '.join(routed)} through a gateway: members on one switched network "
                        f"keep NCCL and Ray off the router")
    speed = read.speed_mbps.get(dev)
    if speed is None:
        warnings.append(f"{host}'s link speed on {dev} is unknown (/sys/class/net/{dev}/speed): pipeline parallelism "
                        f"sends each token's activations between the members")
    elif speed < TEN_GBE_MBPS:
        warnings.append(f"{host} reaches the members over {dev} at {speed} Mb/s, below 10 GbE: each token's "
                        f"activations cross between pipeline stages, so time to first token grows with the prompt's "
                        f"size (a TP2 x PP2 run used at most 25 Mb/s of 1 GbE while decoding: vllm-project/vllm#11874)")
    return MemberNetwork(host, ClusterNet(ifname, src, head_address), None, read.mtu.get(dev), speed, tuple(warnings),
                         read.clock_offset_s)


def member_data(data: Mapping[str, Any], network: MemberNetwork | None) -> dict[str, Any]:
    """A member's host data with its `cluster` knob's `net` filled in from what it read (`network`, from
    member_net), so its compose names its real interface and addresses; unchanged where nothing was decided
    (not a member, or a problem that preflight fails the host for). The deploy's render and `rigup status`
    both go through here: a status that compared against the unread variables saw drift on every member."""
    out = dict(data)
    if network is not None and network.net is not None:
        out["cluster"] = {**out["cluster"], "net": asdict(network.net)}
    return out


def mtu_disagreement(networks: Sequence[MemberNetwork]) -> str | None:
    """Members whose interfaces have different MTUs (large frames dropped on the way), or None."""
    mtus = {n.host: n.mtu for n in networks if n.mtu is not None}
    if len(set(mtus.values())) > 1:
        each = ", ".join(f"{host} {mtu}" for host, mtu in mtus.items())
        return f"the members' interfaces disagree on the MTU ({each}): set one MTU on the cluster's network"
    return None


def clock_skew(networks: Sequence[MemberNetwork]) -> str | None:
    """Members whose clocks are more than CLOCK_SKEW_WARN_S apart (each read against the control
    machine's clock, to within the SSH round trip), or None."""
    offsets = {n.host: n.clock_offset_s for n in networks if n.clock_offset_s is not None}
    if len(offsets) < 2 or max(offsets.values()) - min(offsets.values()) <= CLOCK_SKEW_WARN_S:
        return None
    each = ", ".join(f"{host} {offset:+.1f} s" for host, offset in offsets.items())
    return (f"the members' clocks are {max(offsets.values()) - min(offsets.values()):.1f} s apart (against the control "
            f"machine's: {each}): one request's logs and metrics on the head and the workers will not line up; "
            f"sync them (timedatectl set-ntp true)")


# --- the firewall every member runs (tasks/serving.py) -----------------------------------------------------

MEMBER_SCRIPT = DEPLOY_ROOT / "files" / "cluster" / "rigup-cluster-member"  # uploaded to {install_root}/cluster/
FIREWALL_TABLE = "rigup_cluster"
FIREWALL_FILE = "/etc/rigup/cluster-firewall.nft"
FIREWALL_UNIT = "rigup-cluster-firewall.service"


def firewall_text(cluster: Cluster, members: Mapping[str, str], ports: RayPorts, local_ports: tuple[int, int],
                  api_port: int) -> str:
    """nftables rules that admit only the members (host -> address) to Ray's pinned ports and to the
    ephemeral range, where NCCL, Gloo and vLLM's own sockets listen on unpinned ports: Ray and NCCL
    traffic is unauthenticated, and vLLM's docs warn it allows code execution. New connections only
    (replies to this host's own connections pass), the loopback and the API port always."""
    first, last = local_ports
    return render_template("rigup-cluster-firewall.nft.j2", cluster=cluster.name, members=list(members),
                           table=FIREWALL_TABLE, addresses=sorted(set(members.values())), api_port=api_port,
                           guarded=[*ports.tcp(head=True), f"{first}-{last}"])


def firewall_unit_text() -> str:
    return render_template("rigup-cluster-firewall.service.j2", firewall_file=FIREWALL_FILE,
                           firewall_table=FIREWALL_TABLE)
