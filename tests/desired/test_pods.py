"""Pods: the pods knob read and refused, each pod's recipe on its own GPUs, paths and release."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from rigup.desired.knobs import KnobError, check_knob, load_defaults
from rigup.desired.plan import host_plan, host_plans
from rigup.desired.pods import PodError, host_pods
from rigup.desired.recipe import RecipeError, pods_of, resolve
from rigup.desired.release import recipe_provenance_path
from rigup.parsers.topology import Topology

QUAD = [{"name": "left", "variant": "dual", "gpus": [0, 1], "port": 8030},
        {"name": "right", "variant": "dual", "gpus": [2, 3], "port": 8031}]
TRI = [{"name": "pair", "variant": "dual", "gpus": [0, 1]}, {"name": "solo", "variant": "single", "gpus": 1}]


def host(**data: Any) -> dict[str, Any]:
    values = load_defaults()
    values.update(data)
    return values


def compose(plan: Any) -> dict[str, Any]:
    return yaml.safe_load(plan.compose.content)


def only_service(doc: dict[str, Any]) -> dict[str, Any]:
    (service,) = doc["services"].values()
    return service


def test_without_pods_the_one_pod_is_the_variant_and_nothing_moves() -> None:
    (pod,) = pods_of(host(variant="dual"))
    assert (pod.name, pod.variant, pod.gpus, pod.listed) == ("dual", "dual", None, False)
    (plan,) = host_plans(host(variant="dual"), require_lock=False, read_secrets=False)
    simple = host_plan(host(variant="dual"), require_lock=False, read_secrets=False)
    assert plan.compose.content == simple.compose.content
    recipe = plan.recipe
    assert recipe.paths.variant_dir == "/opt/rigup/variants/dual"
    assert recipe.paths.unit_name == "rigup-dual.service"
    assert recipe_provenance_path(recipe) == "/opt/rigup/state/provenance.json"
    devices = only_service(compose(plan))["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["count"] == 2 and "device_ids" not in devices[0]
    assert "rigup.pod" not in only_service(compose(plan))["labels"]


def test_each_listed_pod_has_its_own_gpus_port_unit_directory_and_record() -> None:
    left, right = host_plans(host(pods=QUAD), require_lock=False, read_secrets=False)
    for plan, name, gpus, port in ((left, "left", ["0", "1"], 8030), (right, "right", ["2", "3"], 8031)):
        recipe = plan.recipe
        service = only_service(compose(plan))
        devices = service["deploy"]["resources"]["reservations"]["devices"]
        assert devices == [{"driver": "nvidia", "device_ids": gpus, "capabilities": ["gpu"]}]
        assert service["container_name"] == f"rigup-{name}"
        assert compose(plan)["name"] == f"rigup-{name}"
        assert service["labels"]["rigup.pod"] == name
        assert service["ports"][0].endswith(f":{port}:8000")
        assert recipe.paths.unit_name == f"rigup-{name}.service"
        assert recipe.paths.variant_dir == f"/opt/rigup/variants/{name}"
        assert recipe.paths.cache_dir == f"/opt/rigup/cache/{name}"
        assert recipe.paths.state_dir == "/opt/rigup/state"  # model stamps stay the host's
        assert recipe_provenance_path(recipe) == f"/opt/rigup/state/pods/{name}/provenance.json"
        unit = plan.unit.content
        assert f"--project-name rigup-{name} --file /opt/rigup/variants/{name}/compose.yaml" in unit
        assert f"pod {name} on GPU(s) {','.join(gpus)}" in unit
    # the same variant twice: same model, image and served name, distinct everything else
    assert left.recipe.served_model_name == right.recipe.served_model_name
    assert left.recipe.models == right.recipe.models


def test_a_gpu_count_takes_the_lowest_free_indices() -> None:
    pair, solo = pods_of(host(pods=TRI))
    assert pair.gpus == (0, 1) and solo.gpus == (2,)
    first, second = pods_of(host(pods=[{"name": "a", "variant": "single", "gpus": 1},
                                       {"name": "b", "variant": "dual", "gpus": [0, 2]}]))
    assert first.gpus == (1,) and second.gpus == (0, 2)


def test_release_names_the_pod_only_when_listed() -> None:
    from rigup.desired.lock import LockFile  # noqa: F401  (the release needs no lock for these fields)
    from rigup.desired.release import build_release

    for data, pod in ((host(pods=TRI), "solo"), (host(variant="single"), None)):
        plan = host_plans(data, require_lock=False, read_secrets=False)[-1]
        release = build_release(plan.recipe, {p: f.content for p, f in plan.rendered.items()}, api_key_present=False,
                                secret_files={})
        if pod is None:
            assert not {"pod", "state_dir", "gpu_ids"} & set(release)
        else:
            assert (release["pod"], release["state_dir"], release["gpu_ids"]) == (pod, f"/opt/rigup/state/pods/{pod}", [2])
            assert release["unit"] == "rigup-solo.service" and release["variant"] == "single"
        json.dumps(release)


def test_a_pod_with_the_wrong_number_of_gpus_is_refused_naming_both() -> None:
    with pytest.raises(RecipeError, match=r"pod wide owns 3 GPU\(s\) \(0, 1, 2\) but variant dual uses 2"):
        host_plans(host(pods=[{"name": "wide", "variant": "dual", "gpus": [0, 1, 2]}]), require_lock=False,
                   read_secrets=False)


def test_interconnect_is_detected_among_the_pods_own_gpus() -> None:
    # GPUs 2 and 3 are bridged by NVLink, 0 and 1 are not: only the right pod plans NVLink settings
    links = {(a, b): ("NV4" if {a, b} == {2, 3} else "PHB") for a in range(4) for b in range(4) if a != b}
    topology = Topology(gpus=(0, 1, 2, 3), links=links)
    left, right = host_plans(host(pods=QUAD), topology=topology, require_lock=False, read_secrets=False)
    assert left.recipe.interconnect is not None and left.recipe.interconnect.nvlink is False
    assert right.recipe.interconnect is not None and right.recipe.interconnect.nvlink is True


@pytest.mark.parametrize("pods,message", [
    ("dual", "pods'? must be (a )?list"),
    ([{"name": "a", "variant": "dual"}], r"pods\[0\] \(a\): 'gpus' is required"),
    ([{"name": "A", "variant": "dual", "gpus": [0, 1]}], "'name' must be lowercase"),
    ([{"name": "gateway", "variant": "dual", "gpus": [0, 1]}], "not gateway, gpu-power"),
    ([{"name": "gpu-power", "variant": "dual", "gpus": [0, 1]}], "not gateway, gpu-power"),
    ([{"name": "a", "variant": "dual", "gpus": [0, 1], "port": 8030}, {"name": "b", "variant": "dual", "gpus": [2, 3],
      "variant_overrides": {"port": 8030}}], "port 8030 is published by both pod a \\(dual\\) and pod b \\(dual\\)"),
    ([{"name": "a", "variant": "duel", "gpus": [0, 1]}], "'variant' 'duel' is not in the catalog"),
    ([{"name": "a", "variant": "dual", "gpus": [0, 0]}], "lists a GPU twice"),
    ([{"name": "a", "variant": "dual", "gpus": [0, 1]}, {"name": "b", "variant": "single", "gpus": [1]}],
     "GPU 1 is given to both a and b"),
    ([{"name": "a", "variant": "dual", "gpus": [0, 1]}, {"name": "a", "variant": "single", "gpus": [2]}],
     "pod name 'a' is used twice"),
    ([{"name": "a", "variant": "dual", "gpus": [0, 1], "port": 8030, "variant_overrides": {"port": 8031}}],
     "the port is given twice"),
    ([{"name": "a", "variant": "dual", "gpus": [0, 1], "port": 70000}], "'port' must be an integer port"),
    ([{"name": "a", "variant": "dual", "gpus": [0, 1], "tp": 2}], "unknown key"),
    ([{"name": "a", "variant": "dual", "gpus": 0}], "count must be at least 1"),
    ([{"name": "a", "variant": "dual", "gpus": True}], "'gpus' must be a list of GPU indices"),
])
def test_bad_pods_are_refused_naming_the_entry_and_key(pods: Any, message: str) -> None:
    with pytest.raises(PodError, match=message):
        host_pods(pods, "dual", {})
    with pytest.raises(RecipeError, match=message):
        pods_of(host(pods=pods))
    with pytest.raises(KnobError, match=message):
        check_knob("pods", pods)


def test_variant_overrides_beside_pods_is_refused() -> None:
    with pytest.raises(PodError, match="each pod takes its own variant_overrides"):
        host_pods(TRI, "dual", {"max_model_len": 8192})
    with pytest.raises(RecipeError, match="each pod takes its own variant_overrides"):
        host_plans(host(pods=TRI, variant_overrides={"max_model_len": 8192}), require_lock=False, read_secrets=False)


def test_resolving_a_host_with_pods_needs_a_pod() -> None:
    with pytest.raises(RecipeError, match="the host lists pods \\(pair, solo\\): resolve one pod at a time"):
        resolve(host(pods=TRI))


def test_a_pods_overrides_change_that_pod_alone() -> None:
    plain = host_plans(host(pods=QUAD), require_lock=False, read_secrets=False)
    tuned = [dict(QUAD[0]), {**QUAD[1], "variant_overrides": {"max_num_seqs": 1}}]
    changed = host_plans(host(pods=tuned), require_lock=False, read_secrets=False)
    assert plain[0].compose.content == changed[0].compose.content
    assert plain[1].compose.content != changed[1].compose.content
    assert "--max-num-seqs" in changed[1].recipe.vllm_args
    args = list(changed[1].recipe.vllm_args)
    assert args[args.index("--max-num-seqs") + 1] == "1"


def test_a_source_two_pods_mount_from_is_checked_out_once_with_both_pods_paths() -> None:
    from rigup.desired.plan import host_sources

    pods = [{"name": "a", "variant": "dual-turbo", "gpus": [0, 1]}, {"name": "b", "variant": "single-long-text", "gpus": [2]}]
    plans = host_plans(host(pods=pods), require_lock=False, read_secrets=False)
    shared = {s.name for s in plans[0].recipe.sources} & {s.name for s in plans[1].recipe.sources}
    assert shared, "the two variants share no source: pick two that do"
    merged = {s.name: s for s in host_sources(plans)}
    assert len(merged) == len({s.name for p in plans for s in p.recipe.sources})
    for name in shared:
        wanted = {path for p in plans for s in p.recipe.sources if s.name == name for path in s.required_paths}
        assert set(merged[name].required_paths) == wanted
    assert any(set(merged[name].required_paths) != set(s.required_paths)
               for p in plans for s in p.recipe.sources if s.name in shared)  # neither pod's list alone
