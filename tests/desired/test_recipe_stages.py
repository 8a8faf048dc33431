"""resolve()'s stages on their own: the branches resolve's end-to-end results only reach for some variants."""

from __future__ import annotations

from typing import Any

import pytest

from rigup.desired.catalog import load_catalog
from rigup.desired.knobs import load_defaults
from rigup.desired.lock import FilePin, LockFile, ModelPin
from rigup.desired.pods import Pod
from rigup.desired.recipe import (
    RecipeError,
    check_model_file_mounts,
    check_source_refs,
    mounts_of,
    only_pod,
    resolve,
    rig_paths,
    upstream_status,
    used_sources,
    variant_models,
)
from rigup.desired.transforms import CACHE_TARGETS

SOURCES_DIR = "/srv/rig/sources"
MODEL_DIR = "/srv/models"


def host(**data: Any) -> dict[str, Any]:
    return {**load_defaults(), **data}


def dflash_models() -> list[Any]:
    catalog = load_catalog()
    return variant_models(catalog, catalog["variants"]["dual-dflash"], MODEL_DIR, None)


# upstream_status: which recipes upstream's newest lineup still carries


def test_a_source_on_a_branch_is_upstreams_current_lineup() -> None:
    assert upstream_status({"ref": "master"}, "models/qwen3.6-27b/vllm/compose/dual/int4/turbo.yml") == "current"


def test_a_file_upstream_moved_to_archive_is_archived_even_on_the_branch() -> None:
    assert upstream_status({"ref": "master"}, "models/qwen3.6-27b/vllm/compose/_archive/dual.yml") == "archived"


def test_a_source_the_catalog_pins_to_a_commit_is_a_snapshot() -> None:
    assert upstream_status({"ref": "b3010249760bace22b9c94e31b089e2e68f9f817"}, "dual/turbo.yml") == "archived"
    # A short sha or a tag still follows upstream (the lock resolves it): only a full commit is frozen.
    assert upstream_status({"ref": "v1.2"}, "dual/turbo.yml") == "current"


def test_of_the_recipe_repositories_only_club3090_follows_upstream() -> None:
    catalog = load_catalog()
    recipe_sources = {v["upstream"]["source"] for v in catalog["variants"].values()}
    assert {"club3090", "club3090-may", "club3090-spring", "qwen36-dual-3090"} <= recipe_sources
    current = {s for s in recipe_sources if upstream_status(catalog["sources"][s], "x.yml") == "current"}
    assert current == {"club3090"}


def test_resolve_reports_snapshot_variants_as_archived() -> None:
    r = resolve(host(variant="dual-turbo"))  # read from the club3090-spring snapshot
    assert r.upstream_source is not None and r.upstream_source.name == "club3090-spring"
    assert r.upstream_status == "archived"


# used_sources: which checkouts the rig needs


def test_used_sources_keep_catalog_order_and_sort_the_required_paths() -> None:
    used = {"genesis": {"vllm/_genesis", "patches/b.py", "patches/a.py"}, "vllm-fork": {"vllm/x.py"}}
    sources = used_sources(load_catalog(), used, host(), SOURCES_DIR, None)
    assert [s.name for s in sources] == ["vllm-fork", "genesis"]  # catalog order, not the mapping's
    genesis = sources[1]
    assert genesis.required_paths == ("patches/a.py", "patches/b.py", "vllm/_genesis")
    assert genesis.path == "/srv/rig/sources/genesis" and genesis.lock_name == "git:genesis"


def test_used_sources_leave_out_unused_sources_and_take_the_locks_commit() -> None:
    class OneCommit:
        def git_commit(self, name: str) -> str | None:
            return "a" * 40 if name == "git:vllm-fork" else None

        def model_revision(self, name: str) -> str | None:
            return None

        def image_digest(self, name: str) -> str | None:
            return None

    (fork,) = used_sources(load_catalog(), {"vllm-fork": {"f.py"}}, host(), SOURCES_DIR, OneCommit())
    assert (fork.name, fork.commit, fork.locked) == ("vllm-fork", "a" * 40, True)


def test_used_sources_follow_a_hosts_source_refs() -> None:
    tag = "v7.51-stable-2026-04-27"  # one of upstream Genesis' tags
    (genesis,) = used_sources(load_catalog(), {"genesis": {"x"}}, host(source_refs={"genesis": tag}), SOURCES_DIR, None)
    assert (genesis.ref, genesis.commit, genesis.locked) == (tag, None, False)


# mounts_of: what each bind mount mounts


def volume(source: str, target: str, read_only: bool = True) -> dict[str, Any]:
    return {"source": source, "target": target, "read_only": read_only}


def test_mounts_are_classified_by_target_then_by_the_checkout_holding_the_source() -> None:
    models = dflash_models()
    sources = used_sources(load_catalog(), {"genesis": {"g"}}, host(), SOURCES_DIR, None)
    cache_target = next(iter(CACHE_TARGETS))
    mounts = mounts_of(
        [
            volume(models[1].path, models[1].container_path),
            volume("/srv/rig/cache/dual/triton", cache_target, read_only=False),
            volume("/srv/rig/sources/club3090/data", "/data", read_only=False),
            volume("/srv/rig/sources/genesis/vllm/_genesis", "/genesis"),
            volume("/srv/rig/sources/genesis", "/whole-checkout"),
            volume("/srv/rig/sources/genesis-old/x", "/look-alike"),  # a sibling whose name starts the same
            volume("/etc/hosts", "/etc/hosts"),
        ],
        models,
        sources,
        data_dirs={"/data": "a writable directory upstream keeps in its checkout"},
    )
    assert [(m.kind, m.origin) for m in mounts] == [
        ("model", "model:qwen36-27b-dflash"),
        ("cache", "cache"),
        ("cache", "cache"),
        ("source", "git:genesis"),
        ("source", "git:genesis"),
        ("source", "host"),
        ("source", "host"),
    ]
    assert [m.read_only for m in mounts[:3]] == [True, False, False]


# check_model_file_mounts: a bind over a file inside the read-only model directory


def lock_listing(model: Any, *paths: str) -> LockFile:
    files = tuple(FilePin(p, 1, "0" * 64) for p in paths)
    pin = ModelPin(model.lock_name, model.repo_id, "main", "c" * 40, files)
    return LockFile(models={model.lock_name: pin})


def test_a_bind_over_a_file_the_locked_model_lacks_is_refused() -> None:
    main = dflash_models()[0]
    mounts = mounts_of([volume("/srv/rig/sources/club3090/t.jinja", f"{main.container_path}/chat_template.jinja")],
                       [main], (), {})
    with pytest.raises(RecipeError, match=rf"^variant 'x': f.yml: upstream mounts {main.container_path}/"
                                          r"chat_template.jinja, but .* has no chat_template.jinja"):
        check_model_file_mounts(mounts, [main], lock_listing(main, "config.json"), "variant 'x': f.yml")


def test_a_bind_over_a_file_the_model_has_or_without_a_file_list_passes() -> None:
    main = dflash_models()[0]
    mounts = mounts_of([volume("/srv/t.jinja", f"{main.container_path}/chat_template.jinja"),
                        volume("/srv/elsewhere", "/opt/elsewhere")], [main], (), {})
    check_model_file_mounts(mounts, [main], lock_listing(main, "chat_template.jinja"), "w")
    check_model_file_mounts(mounts, [main], lock_listing(main), "w")  # no files listed: nothing to check against
    check_model_file_mounts(mounts, [main], None, "w")


# the host-data stages


def test_variant_models_put_the_main_model_first_and_the_draft_second() -> None:
    main, draft = dflash_models()
    assert (main.role, draft.role) == ("main", "draft")
    assert draft.path == f"{MODEL_DIR}/{draft.dir_name}"
    assert draft.container_path == f"/root/.cache/huggingface/{draft.dir_name}"


def test_only_pod_refuses_a_host_that_lists_pods() -> None:
    pod = only_pod(host(variant="dual"))
    assert (pod.name, pod.listed) == ("dual", False)
    listed = host(variant="dual", pods=[{"name": "left", "variant": "single", "gpus": [0]}])
    with pytest.raises(RecipeError, match=r"^the host lists pods \(left\): resolve one pod at a time$"):
        only_pod(listed)


@pytest.mark.parametrize(
    ("source_refs", "message"),
    [
        (["genesis"], "^source_refs must be a mapping, got list$"),
        ({"genesys": "dev"}, "^unknown source_refs key 'genesys'; known: club3090, "),
        ({"genesis": " "}, r"^source_refs\['genesis'\] must be a branch, tag or commit, got ' '$"),
    ],
)
def test_check_source_refs_names_the_bad_entry(source_refs: Any, message: str) -> None:
    with pytest.raises(RecipeError, match=message):
        check_source_refs(source_refs, load_catalog()["sources"])


def test_check_source_refs_takes_none_and_known_sources() -> None:
    check_source_refs(None, load_catalog()["sources"])
    check_source_refs({"genesis": "dev", "club3090": "a" * 40}, load_catalog()["sources"])


def test_a_listed_pod_keeps_its_record_in_its_own_state_directory() -> None:
    data = host(install_root="/srv/rig/")
    simple = rig_paths(data, Pod("dual", "dual", None, {}, listed=False))
    listed = rig_paths(data, Pod("left", "dual", (0, 1), {}, listed=True))
    assert (simple.state_dir, simple.record_dir) == ("/srv/rig/state", "/srv/rig/state")
    assert (listed.state_dir, listed.record_dir) == ("/srv/rig/state", "/srv/rig/state/pods/left")
    assert (listed.variant_dir, listed.unit_file) == ("/srv/rig/variants/left", "/etc/systemd/system/rigup-left.service")
