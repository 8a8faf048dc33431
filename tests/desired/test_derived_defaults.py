"""Knobs whose default follows another knob (rigup.desired.knobs.DERIVED_DEFAULTS): model_dir unset is
<install_root>/models, for every reader (knob(), the recipe, the host plan, preflight's disk check);
and gateway_pip_index_url unset leaves pip's own configured index alone."""

from __future__ import annotations

from typing import Any

import pytest
from pyinfra.api import Inventory

from rigup.checks.preflight import disk_paths
from rigup.desired.knobs import DERIVED_DEFAULTS, KnobError, check_knob, knob, load_defaults
from rigup.desired.plan import host_plan
from rigup.desired.recipe import resolve


def host(**data: Any) -> dict[str, Any]:
    """What a deploy's host data holds: every default of group_data/all.py, then the host's values."""
    return {**load_defaults(), **data}


def test_model_dir_is_declared_unset_and_derived() -> None:
    assert load_defaults()["model_dir"] is None  # no frozen copy of install_root's default
    assert set(DERIVED_DEFAULTS) == {"model_dir", "monitor_group"}
    assert knob(load_defaults(), "model_dir") == "/opt/rigup/models"
    assert knob({}, "model_dir") == "/opt/rigup/models"  # a partial mapping: the defaults, then the derivation


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"install_root": "/srv/x"}, "/srv/x/models"),
        ({"install_root": "/srv/x/"}, "/srv/x/models"),
        ({"install_root": "/srv/x", "model_dir": None}, "/srv/x/models"),
        ({"install_root": "/srv/x", "model_dir": "/data/models"}, "/data/models"),  # explicit wins
        ({"model_dir": "/data/models"}, "/data/models"),
    ],
)
def test_knob_derives_model_dir_from_install_root_unless_set(data: dict[str, Any], expected: str) -> None:
    assert knob(data, "model_dir") == expected
    assert knob(host(**data), "model_dir") == expected


@pytest.mark.parametrize(
    ("data", "expected"),
    [({}, "gateway"), ({"gateway_group": "edge"}, "edge"), ({"gateway_group": "edge", "monitor_group": "ops"}, "ops")],
)
def test_monitor_group_follows_gateway_group_unless_set(data: dict[str, Any], expected: str) -> None:
    assert load_defaults()["monitor_group"] is None
    assert knob(data, "monitor_group") == expected
    assert knob(host(**data), "monitor_group") == expected


def test_pyinfra_host_data_gets_the_derived_value() -> None:
    # a deploy reads knobs from host.data, where group_data/all.py's model_dir = None is loaded
    inventory = Inventory((["@fake/rig"], {"install_root": "/srv/x", "model_dir": None}))
    data = inventory.get_host("@fake/rig").data
    assert knob(data, "model_dir") == "/srv/x/models"


def test_the_recipe_puts_models_under_the_overridden_install_root() -> None:
    r = resolve(host(variant="dual", install_root="/srv/x"))
    assert r.paths.model_dir == "/srv/x/models"
    assert r.model.path == "/srv/x/models/qwen3.6-27b-autoround-int4"
    assert any(m.source.startswith("/srv/x/models/") for m in r.mounts)
    explicit = resolve(host(variant="dual", install_root="/srv/x", model_dir="/data/models"))
    assert explicit.paths.model_dir == "/data/models"
    assert explicit.model.path == "/data/models/qwen3.6-27b-autoround-int4"


def test_the_host_plan_renders_the_derived_model_dir() -> None:
    plan = host_plan(host(variant="dual", install_root="/srv/x"), "rig", require_lock=False, read_secrets=False)
    assert plan.recipe.paths.model_dir == "/srv/x/models"
    assert "/srv/x/models/qwen3.6-27b-autoround-int4" in plan.compose.content
    assert "/opt/rigup" not in plan.compose.content


def test_preflight_checks_free_space_where_the_models_go() -> None:
    assert disk_paths(host(install_root="/srv/x"), None)["models"] == "/srv/x/models"
    assert disk_paths(host(install_root="/srv/x", model_dir="/data/models"), None)["models"] == "/data/models"


def test_unset_is_accepted_for_both_knobs_and_a_bad_value_is_not() -> None:
    assert check_knob("model_dir", None) is None
    assert check_knob("gateway_pip_index_url", None) is None
    assert check_knob("model_dir", "/data/models") == "/data/models"
    with pytest.raises(KnobError, match="'model_dir' must be str"):
        check_knob("model_dir", 5)
    with pytest.raises(KnobError, match="absolute path"):
        check_knob("model_dir", "models")
    with pytest.raises(KnobError, match="'gateway_pip_index_url' must be str"):
        check_knob("gateway_pip_index_url", 5)
