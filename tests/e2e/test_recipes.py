"""Every catalog variant comes up on the sandbox, rendered from the test bed's upstream remotes, and the
recipe repository's pin moves with its rendered diff and one restart: the single-card and dual rigs of the
lineup (tests/e2e/recipes_lineup.py; the four-, eight-card and H200 rigs are test_recipes_big_rigs.py's, a
bed of their own on another worker, so the two halves run side by side).

One bed of up to four rigs, each in its own group: a 1x3090 (the single-card recipes), two 2x3090 (the
duals) and a 2x3090 on the stand-in engine (a recipe pinned by upstream's digest) when this disk can take
it. Each round switches every rig to its next variant with the real `rigup lock` and `pyinfra deploy.py`;
the health gate, `rigup verify` and the old unit being stopped are checked per rig. Then: a recipe the
hardware cannot run is refused in preflight with nothing changed, an empty Genesis tree fails the gate with
the cause and rolls back, and `rigup lock --upgrade club3090` after an upstream commit prints the rendered
diff and restarts the rig once.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from rigup.desired.catalog import variant_names
from rigup_testbed.fleet import Testbed
from rigup_testbed.gitremotes import RemoteRepo, add_commit, git
from rigup_testbed.image import REPO_ROOT
from rigup_testbed.recipes import tree
from tests.e2e.recipes_lineup import (
    GROUP,
    HEAVY_GB,
    LAST,
    LINEUP,
    RecipesBed,
    check_serving,
    disk_need,
    every_variant_comes_up_and_verifies,
    recipes_bed,
)
from tests.e2e.test_serving import _recipe as recipe_of
from tests.e2e.test_serving import _tail, provenance, sh, starts_since, unit_prop

pytestmark = pytest.mark.e2e

RIGS_HERE = ["rig-1x", "rig-2x", "rig-2y", "rig-2s"]


def test_the_lineup_covers_every_catalog_variant() -> None:
    """Every catalog variant is placed on exactly one rig of the two recipe modules, the heavy ones after the
    others on each rig, and the variants the later tests need last are light enough for any disk that runs
    the rest."""
    listed = [v for _, variants in LINEUP.values() for v in variants]
    assert sorted(listed) == sorted(variant_names()) and len(listed) == len(set(listed))
    for _, variants in LINEUP.values():
        heavy = [disk_need(v) > HEAVY_GB for v in variants if v not in LAST.values()]
        assert heavy == sorted(heavy), variants
    assert all(disk_need(v) <= HEAVY_GB for v in LAST.values())


@pytest.fixture(scope="module")
def bed(testbed_factory: Callable[..., Testbed]) -> Iterator[RecipesBed]:
    yield recipes_bed(testbed_factory, RIGS_HERE, "rigrc")


def test_every_variant_comes_up_and_verifies(bed: RecipesBed) -> None:
    every_variant_comes_up_and_verifies(bed)  # it prints what this disk could not take


def test_a_recipe_the_hardware_cannot_run_is_refused_before_any_change(bed: RecipesBed) -> None:
    rig = "rig-1x"
    host = bed.host(rig)
    current = LINEUP[rig][1][-1]
    before = unit_prop(host, f"rigup-{current}.service", "ExecMainStartTimestamp")
    bed.group_data = {**bed.group_data, GROUP[rig]: {"variant": "gemma-single-autoround-int4-fp8-mtp"}}
    bed.write()
    proc = bed.deploy("--limit", rig, expect_ok=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "compute capability 8.6; variant 'gemma-single-autoround-int4-fp8-mtp' needs >= 9.0" in output, _tail(proc)
    assert unit_prop(host, f"rigup-{current}.service", "ExecMainStartTimestamp") == before
    assert sh(host, "test -e /opt/rigup/variants/gemma-single-autoround-int4-fp8-mtp && echo yes || echo no") == "no"


def _remote(bed: RecipesBed, key: str) -> RemoteRepo:
    ready = json.loads((bed.testbed.workdir / "hub" / "git" / "ready.json").read_text())
    info = ready["remotes"][key]
    return RemoteRepo(info["name"], info["path"], dict(info["branches"]), dict(info["tags"]), dict(info["commits"]))


def test_an_empty_genesis_tree_fails_the_gate_with_the_cause_and_rolls_back(bed: RecipesBed) -> None:
    """A switch to a Genesis recipe whose Genesis commit lost patches/apply_all.py: the checkout has the
    mounted directory (the sources phase passes), upstream's own entrypoint check stops the container,
    the gate fails with that cause, and the rig goes back to the variant it served."""
    rig = "rig-1x"
    host = bed.host(rig)
    good_variant = LINEUP[rig][1][-1]  # no Genesis: the rollback target does not mount the broken tree
    check_serving(bed, rig, good_variant)
    good = provenance(host)
    genesis = _remote(bed, "genesis")
    # on a branch from the pin's commit the recipe runs (source_refs: the stand-in of 2db18df), so nothing but
    # apply_all.py differs
    pin = bed.testbed.urls["source_refs"]["genesis"]
    assert pin == genesis.commits["pin"]
    git("update-ref", "refs/heads/rigup-e2e-broken", pin, cwd=Path(genesis.path))
    broken = add_commit(genesis, "rigup-e2e-broken", {"vllm/_genesis/patches/apply_all.py": None}, "lose apply_all")
    refs = {**bed.testbed.urls.get("source_refs", {}), "genesis": broken}
    # the lock holds one pin per source for the whole fleet: every group moves to the broken commit (what
    # the other rigs serve may use Genesis; the lineup depends on this machine's free disk), and only
    # this rig is deployed
    before = bed.group_data
    bed.group_data = {**{group: {**data, "source_refs": refs} for group, data in before.items()},
                      GROUP[rig]: {"variant": "single", "source_refs": refs}}
    bed.write()
    try:
        proc = bed.deploy("--limit", rig, expect_ok=False)
        output = proc.stdout + proc.stderr
        assert proc.returncode != 0
        assert "FAILED and ROLLED BACK" in output, _tail(proc)
        assert "Genesis tree is not mounted" in output, _tail(proc, 200)  # the container's own words, in the error
        # the crash-looped unit, taken out of service, is inactive (not left "failed" for alerts to find)
        assert unit_prop(host, "rigup-single.service", "ActiveState") == "inactive"
        check_serving(bed, rig, good_variant)
        prov = provenance(host)
        assert prov["release_sha256"] == good["release_sha256"] and prov["last_rollback"]["outcome"] == "rolled back"
    finally:  # the tests after this one converge the whole lineup: the rig goes back to its good variant
        bed.group_data = {**before, GROUP[rig]: {"variant": good_variant}}
        bed.write()


def test_moving_the_recipe_pin_shows_the_rendered_diff_and_restarts_once(bed: RecipesBed) -> None:
    rig, variant = "rig-2x", LINEUP["rig-2x"][1][-1]
    host = bed.host(rig)
    unit = f"rigup-{variant}.service"
    assert provenance(host)["variant"] == variant
    path = recipe_of(variant).upstream.path
    text = (tree("club3090") / path).read_text()
    assert "${MAX_NUM_SEQS:-2}" in text
    club = _remote(bed, "club3090")
    moved = add_commit(club, "master", {path: text.replace("${MAX_NUM_SEQS:-2}", "${MAX_NUM_SEQS:-3}")},
                       "dual: three streams")
    proc = subprocess.run([sys.executable, "-m", "rigup", "lock", "--upgrade", "club3090"], cwd=REPO_ROOT,
                          env=bed.env(), capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "upgraded  git:club3090" in out and moved in out
    assert f"/opt/rigup/variants/{variant}/compose.yaml changes for {rig}:" in out
    assert "-    - '2'" in out and "+    - '3'" in out
    mark = int(sh(host, "date +%s")) - 1
    bed.write(relock=False)
    bed.deploy()
    assert starts_since(host, unit, mark) == 1
    assert "'3'" in sh(host, f"grep -A1 -- '--max-num-seqs' /opt/rigup/variants/{variant}/compose.yaml")
    assert provenance(host)["gate"]["result"] == "passed"
    # and only once: a converged re-run leaves it alone
    bed.deploy()
    assert starts_since(host, unit, mark) == 1
