"""Clusters (issue 29): the fleet file's `clusters` read and refused, the TP-inside x PP-across split,
vLLM's layer partition and what vLLM cannot run across hosts."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import pytest

from rigup.desired.catalog import variant_names
from rigup.desired.cluster import (
    SPLIT_EXPLANATION,
    SPLIT_TRANSFORM,
    Cluster,
    ClusterError,
    VariantFacts,
    describe,
    layer_partition,
    recipe_facts,
    refusals,
    split,
)
from rigup.desired.cluster_entries import parse_clusters, variant_facts
from rigup.desired.knobs import load_defaults
from rigup.desired.recipe import resolve

HOSTS = ["rig-a", "rig-b", "rig-c", "rig-d"]
QUAD_MTP = "qwen38-multi4-autoround-int4-mtp"  # TP 4, built-in MTP, vllm/vllm-openai:v0.27.1


def entry(**changes: Any) -> dict[str, Any]:
    values: dict[str, Any] = {"name": "big", "variant": QUAD_MTP, "hosts": ["rig-a", "rig-b"]}
    values.update(changes)
    return values


def refused(listed: Any, known: list[str] = HOSTS) -> str:
    with pytest.raises(ClusterError) as caught:
        parse_clusters(listed, known)
    return str(caught.value)


def recipe(variant: str, **overrides: Any) -> Any:
    data = load_defaults()
    data.update(variant=variant, variant_overrides=overrides)
    return resolve(data)


# --- valid forms ---------------------------------------------------------------------------------------


def test_no_clusters_is_an_empty_list() -> None:
    assert parse_clusters(None, HOSTS) == [] and parse_clusters([], HOSTS) == []


def test_two_hosts_split_a_four_gpu_variant_two_by_two() -> None:
    (cluster,) = parse_clusters([entry()], HOSTS)
    assert cluster == Cluster("big", QUAD_MTP, ("rig-a", "rig-b"), 2, {}, 0)
    assert (cluster.head, cluster.workers, cluster.unit) == ("rig-a", ("rig-b",), "rigup-big.service")
    assert (cluster.tensor_parallel, cluster.pipeline_parallel) == (2, 2)
    assert [cluster.member_rank(h) for h in cluster.hosts] == [0, 1]
    with pytest.raises(ClusterError, match=r"clusters\[0\] \(big\): 'rig-c' is not a member \(hosts: rig-a, rig-b\)"):
        cluster.member_rank("rig-c")


def test_port_gpus_per_host_and_overrides_are_kept() -> None:
    listed = [entry(gpus_per_host=2, port=8030, variant_overrides={"max_model_len": 131072}),
              {"name": "duo", "variant": "dual", "hosts": ["rig-d", "rig-c"], "variant_overrides": {"tensor_parallel_size": 4}}]
    big, duo = parse_clusters(listed, HOSTS)
    assert big.overrides == {"max_model_len": 131072, "port": 8030} and big.gpus_per_host == 2
    # `dual` runs on 2 GPUs; its tensor_parallel_size override 4 is what the two hosts share
    assert (duo.index, duo.head, duo.gpus_per_host, duo.member_rank("rig-c")) == (1, "rig-d", 2, 1)


def test_the_default_gpus_per_host_follow_the_member_count() -> None:
    (four,) = parse_clusters([entry(variant="multi4", hosts=HOSTS)], HOSTS)
    assert (four.gpus_per_host, four.pipeline_parallel) == (1, 4)
    (eight,) = parse_clusters([entry(variant="qwen38-multi8-autoround-int4-mtp")], HOSTS)
    assert eight.gpus_per_host == 4


# --- the split -----------------------------------------------------------------------------------------


def test_split_is_tp_inside_times_pp_across() -> None:
    (cluster,) = parse_clusters([entry()], HOSTS)
    result = split(cluster, variant_facts(QUAD_MTP))
    assert (result.transform, result.tensor_parallel, result.pipeline_parallel, result.world_size) == (
        "split-tp-across-hosts-as-pp", 2, 2, 4)
    assert result.hosts == ("rig-a", "rig-b") and result.layers is None  # the catalog has no layer count
    assert any("MTP drafter runs on the last stage (rig-b)" in note for note in result.notes)
    assert any("images are encoded on the head (rig-a) only" in note for note in result.notes)


def test_split_refuses_a_gpu_count_that_does_not_fit() -> None:
    message = refused([entry(gpus_per_host=3)])
    assert message == ("clusters[0] (big): gpus_per_host: 3 GPU(s) x 2 hosts = 6, but variant "
                       f"'{QUAD_MTP}' runs on 4 GPU(s) (tensor_parallel_size); allowed: gpus_per_host x hosts = 4")
    message = refused([entry(variant="multi4", hosts=["rig-a", "rig-b", "rig-c"])])
    assert message == ("clusters[0] (big): variant 'multi4' runs on 4 GPU(s) (tensor_parallel_size), which 3 hosts "
                       "cannot share evenly: its GPU count must be gpus_per_host x 3 hosts")
    # a 2-GPU variant over 2 hosts is TP 1 x PP 2; with gpus_per_host 2 the count is off, naming the override
    cluster = Cluster("duo", "dual", ("rig-a", "rig-b"), 2, {"tensor_parallel_size": 2})
    with pytest.raises(ClusterError, match=r"runs on 2 GPU\(s\) \(tensor_parallel_size, with variant_overrides\)"):
        split(cluster, variant_facts("dual", {"tensor_parallel_size": 2}))


def test_split_of_a_resolved_recipe() -> None:
    cluster = Cluster("duo", "dual", ("rig-a", "rig-b"), 2, {"tensor_parallel_size": 4})
    result = split(cluster, recipe("dual", tensor_parallel_size=4))
    assert (result.tensor_parallel, result.pipeline_parallel) == (2, 2)


@pytest.mark.parametrize(
    ("layers", "pp", "partition"),
    [
        (64, 2, (32, 32)),
        (61, 2, (31, 30)),  # the remainder goes to the stages before the last
        (62, 4, (15, 16, 16, 15)),  # ... the middle ones when pp > 2 and it is at most pp - 2
        (63, 4, (16, 16, 16, 15)),
        (5, 3, (2, 2, 1)),
        (64, 1, (64,)),
    ],
)
def test_layer_partition_is_vllms(layers: int, pp: int, partition: tuple[int, ...]) -> None:
    assert layer_partition(layers, pp) == partition
    assert sum(partition) == layers


def test_layer_partition_override_is_checked_as_vllm_does() -> None:
    assert layer_partition(64, 2, "20,44") == (20, 44)
    with pytest.raises(ClusterError, match=r"VLLM_PP_LAYER_PARTITION='20,40': 60 layers, the model has 64"):
        layer_partition(64, 2, "20,40")
    with pytest.raises(ClusterError, match=r"VLLM_PP_LAYER_PARTITION='64': 1 counts for 2 pipeline stages"):
        layer_partition(64, 2, "64")
    with pytest.raises(ClusterError, match="comma-separated layer counts"):
        layer_partition(64, 2, "a,b")


def test_split_reports_layers_when_the_count_is_known_and_checks_the_override() -> None:
    (cluster,) = parse_clusters([entry()], HOSTS)
    facts = dataclasses.replace(variant_facts(QUAD_MTP), num_hidden_layers=64)
    assert split(cluster, facts).layers == (32, 32)
    facts = dataclasses.replace(facts, environment={"VLLM_PP_LAYER_PARTITION": "30,34"})
    assert split(cluster, facts).layers == (30, 34)
    facts = dataclasses.replace(facts, num_hidden_layers=None, environment={"VLLM_PP_LAYER_PARTITION": "10,20,34"})
    with pytest.raises(ClusterError, match=r"clusters\[0\] \(big\): VLLM_PP_LAYER_PARTITION='10,20,34': 3 counts for 2"):
        split(cluster, facts)


def test_the_transform_is_named_and_explained_as_beyond_upstream() -> None:
    assert SPLIT_TRANSFORM == "split-tp-across-hosts-as-pp"
    assert SPLIT_EXPLANATION.startswith("beyond upstream (club-3090's docs/PODS.md keeps a pod on one host)")
    (cluster,) = parse_clusters([entry()], HOSTS)
    text = describe(cluster, split(cluster, variant_facts(QUAD_MTP)))
    assert text.startswith(f"{SPLIT_TRANSFORM}: beyond upstream")
    assert "Cluster big: TP 2 x PP 2 on rig-a (rank 0, head), rig-b (rank 1)" in text


# --- refusals ------------------------------------------------------------------------------------------


def test_mtp_and_vision_are_not_refused() -> None:
    cluster = Cluster("big", QUAD_MTP, ("rig-a", "rig-b"), 2, {})
    facts = variant_facts(QUAD_MTP)
    assert (facts.speculative_method, facts.language_model_only) == ("mtp", False)
    assert refusals(cluster, facts) == []


def test_dflash_is_refused_with_vllms_reason() -> None:
    message = refused([entry(variant="qwen38-multi4-fp8-dflash2")])
    assert message.startswith("clusters[0] (big): vLLM cannot serve variant 'qwen38-multi4-fp8-dflash2' across hosts: "
                              "speculative decoding with DFlash across hosts: vLLM puts the drafter on the last pipeline "
                              "stage only (vllm/v1/worker/gpu_model_runner.py")
    assert "DFlash drafter expects N concatenated aux hidden features" in message
    assert "qwen3_dflash.py combine_hidden_states, 6e448d0ea" in message


def test_dflash_in_upstreams_command_is_refused_from_the_recipe() -> None:
    # dual-dflash's compose carries its --speculative-config: the catalog notes none, the recipe knows
    cluster = Cluster("duo", "dual-dflash", ("rig-a", "rig-b"), 2, {"tensor_parallel_size": 4})
    assert refusals(cluster, variant_facts("dual-dflash", {"tensor_parallel_size": 4})) == []
    built = recipe("dual-dflash", tensor_parallel_size=4)
    assert recipe_facts(built).speculative_method == "dflash"
    (reason,) = refusals(cluster, built)
    assert reason.startswith("speculative decoding with DFlash across hosts")


def test_eagle3_is_refused() -> None:
    facts = dataclasses.replace(variant_facts(QUAD_MTP), speculative_method="eagle3")
    (reason,) = refusals(Cluster("big", QUAD_MTP, ("rig-a", "rig-b"), 2, {}), facts)
    assert "Model Runner V2 refuses \"EAGLE3 with pipeline parallelism\"" in reason


def test_omni_stages_are_refused_before_the_gpu_arithmetic() -> None:
    message = refused([entry(variant="qwen-omni-dual-autoround-int4-omni")])
    assert message == ("clusters[0] (big): vLLM cannot serve variant 'qwen-omni-dual-autoround-int4-omni' across hosts: "
                       "a vLLM-Omni recipe: its GPUs are the stages of upstream's deploy config (thinker, talker, "
                       "code2wav, each placed on a device of one machine), not tensor parallelism rigup could split "
                       "across hosts")
    built = recipe("qwen-omni-dual-autoround-int4-omni")
    facts = recipe_facts(built)
    assert facts.deploy_config
    assert len(refusals(Cluster("o", facts.variant, ("rig-a", "rig-b"), 1, {}), dataclasses.replace(
        facts, image_repository="vllm/vllm-openai"))) == 1  # the deploy config alone is enough


def test_lmcache_is_refused() -> None:
    message = refused([entry(variant="qwen-dual-fp8-lmcache")])
    assert "across hosts: an LMCache recipe: upstream's entrypoint starts an LMCache server" in message
    assert "vLLM itself does not refuse the connector under PP" in message


# --- bad input -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("listed", "message"),
    [
        ({"big": {}}, "clusters: must be a list of {name, variant, hosts, gpus_per_host, port, variant_overrides, "
                      "socket_interface} entries"),
        (["big"], "clusters[0]: must be a mapping with keys name, variant, hosts, gpus_per_host, port, variant_overrides, "
                  "socket_interface, got 'big'"),
        ([entry(gpus=2)], "clusters[0] (big): unknown key(s) gpus; allowed: name, variant, hosts, gpus_per_host, port, "
                          "variant_overrides, socket_interface"),
        ([entry(socket_interface="eth 1")], "clusters[0] (big): socket_interface: must be a network interface's name "
                                            "(up to 15 letters, digits, '.', '-', '_', ':'; e.g. eth1), got 'eth 1'"),
        ([entry(socket_interface="a-very-long-interface")], "clusters[0] (big): socket_interface: must be a network "),
        ([entry(socket_interface=1)], "clusters[0] (big): socket_interface: must be a network "),
        ([{"variant": QUAD_MTP, "hosts": ["rig-a", "rig-b"]}], "clusters[0]: 'name' is required"),
        ([entry(variant=None)], "clusters[0] (big): variant: None is not in the catalog"),
        ([{"name": "big", "hosts": ["rig-a", "rig-b"]}], "clusters[0] (big): 'variant' is required"),
        ([{"name": "big", "variant": QUAD_MTP}], "clusters[0] (big): 'hosts' is required"),
        ([entry(name="Big")], "clusters[0] (Big): name: must be lowercase letters, digits and '-' (up to 40, not "
                              "gateway, gpu-power): it names the unit rigup-<name>.service on every member, got 'Big'"),
        ([entry(name="gateway")], "clusters[0] (gateway): name: must be lowercase"),
        ([entry(name=7)], "clusters[0]: name: must be lowercase letters, digits and '-'"),
        # a mistyped variant: its closest names, not all 72 (issue 41)
        ([entry(variant="qwen38-multi4-autoround-int4-mpt")],
         "clusters[0] (big): variant: 'qwen38-multi4-autoround-int4-mpt' is not in the catalog (did you mean "
         "'qwen38-multi4-autoround-int4-mtp' or 'qwen38-multi8-autoround-int4-mtp' or 'qwen-multi4-autoround-int4-mtp'? "
         f"`rigup render --list` lists all {len(variant_names())} variants)"),
        ([entry(variant="quad")], "clusters[0] (big): variant: 'quad' is not in the catalog (`rigup render --list` lists "
                                  f"all {len(variant_names())} variants)"),
        ([entry(hosts="rig-a,rig-b")], "clusters[0] (big): hosts: must be a list of at least 2 host names of the fleet "
                                       "file, the head first (e.g. [rig-a, rig-b]), got 'rig-a,rig-b'"),
        ([entry(hosts=["rig-a"])], "clusters[0] (big): hosts: must be a list of at least 2 host names of the fleet file, "
                                   "the head first (e.g. [rig-a, rig-b]), got ['rig-a']: one host serves the variant as a pod"),
        ([entry(hosts=["rig-a", "rig-a"])], "clusters[0] (big): hosts: rig-a listed twice in ['rig-a', 'rig-a']; list "
                                            "each member once"),
        ([entry(hosts=["rig-a", "rig-z"])], "clusters[0] (big): hosts: 'rig-z' not a host of the fleet file (hosts: "
                                            "rig-a, rig-b, rig-c, rig-d)"),
        ([entry(gpus_per_host=0)], "clusters[0] (big): gpus_per_host: must be a positive integer (GPUs each member gives "
                                   "the variant), got 0"),
        ([entry(gpus_per_host="2")], "clusters[0] (big): gpus_per_host: must be a positive integer (GPUs each member "
                                     "gives the variant), got '2'"),
        ([entry(gpus_per_host=True)], "clusters[0] (big): gpus_per_host: must be a positive integer (GPUs each member "
                                     "gives the variant), got True"),
        ([entry(port=0)], "clusters[0] (big): port: must be an integer port from 1 to 65535, got 0"),
        ([entry(port=70000)], "clusters[0] (big): port: must be an integer port from 1 to 65535, got 70000"),
        ([entry(port="8030")], "clusters[0] (big): port: must be an integer port from 1 to 65535, got '8030'"),
        ([entry(port=8030, variant_overrides={"port": 8031})],
         "clusters[0] (big): the port is given twice ('port' and variant_overrides['port']): keep one"),
        ([entry(variant_overrides=[1])], "clusters[0] (big): variant_overrides: must be a mapping, got [1]"),
        ([entry(variant_overrides={"kv_cache_dtype": "fp8"})],
         "clusters[0] (big): variant_overrides: unknown variant_overrides key 'kv_cache_dtype' (value 'fp8'); allowed: "),
        ([entry(variant_overrides={"tensor_parallel_size": 2})],
         f"clusters[0] (big): variant_overrides: variant_overrides['tensor_parallel_size'] must be one of [4] for variant "
         f"'{QUAD_MTP}', got 2"),
    ],
)
def test_bad_entries_name_the_key_path_value_and_what_is_allowed(listed: Any, message: str) -> None:
    assert refused(listed).startswith(message)


def test_names_and_members_are_each_used_once() -> None:
    twice = [entry(), entry(hosts=["rig-c", "rig-d"])]
    assert refused(twice) == "clusters[1] (big): name: 'big' is already the name of clusters[0] (big)"
    shared = [entry(), entry(name="other", hosts=["rig-c", "rig-b"])]
    assert refused(shared) == ("clusters[1] (other): hosts: 'rig-b' is already a member of clusters[0] (big); a host "
                               "serves in at most one cluster")


def test_an_empty_fleet_names_no_hosts() -> None:
    assert refused([entry()], known=[]) == ("clusters[0] (big): hosts: 'rig-a', 'rig-b' not a host of the fleet file "
                                            "(hosts: none)")


def test_variant_facts_read_the_catalog_through_its_api() -> None:
    facts = variant_facts(QUAD_MTP, {"port": 8030})
    assert facts == VariantFacts(QUAD_MTP, 4, "qwen38-27b-autoround-int4", "vllm/vllm-openai", "mtp", False, None,
                                 image="vllm-v0.27.1", ray_version=None)  # the catalog records no image's Ray
    assert variant_facts("dual", {"tensor_parallel_size": 4}).tensor_parallel_size == 4
    assert re.fullmatch(r"lmcache/vllm-openai", variant_facts("qwen-dual-fp8-lmcache").image_repository)
