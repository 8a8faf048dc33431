"""Every catalog variant comes up on the sandbox, rendered from the test bed's upstream remotes, and the
recipe repository's pin moves with its rendered diff and one restart.

One bed of four rigs, each in its own group: a 1x3090 (the single-card recipes), a 2x3090 and a 4x3090
(the dual and four-card ones) and a 2xH200 (the recipes that need sm 9.0, plus duals). Each round
switches every rig to its next variant with the real `rigup lock` and `pyinfra deploy.py`; the health
gate, `rigup verify` and the old unit being stopped are checked per rig. Then: a recipe the hardware
cannot run is refused in preflight with nothing changed, an empty Genesis tree fails the gate with the
cause and rolls back, and `rigup lock --upgrade club3090` after an upstream commit prints the rendered
diff and restarts the rig once.
"""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from rigup.desired.catalog import load_catalog, variant_names
from rigup.desired.knobs import load_defaults
from rigup.desired.recipe import resolve
from rigup_testbed import hardware as hw
from rigup_testbed.fleet import Testbed
from rigup_testbed.gitremotes import RemoteRepo, add_commit, git
from rigup_testbed.hosts import HostSpec
from rigup_testbed.image import REPO_ROOT, cache_dir
from rigup_testbed.recipes import tree, working_trees
from tests.e2e.test_serving import GATE_TIMEOUT_S, Bed, _tail, models, provenance, sh, starts_since, unit_prop
from tests.e2e.test_serving import _recipe as recipe_of

pytestmark = pytest.mark.e2e

# rig -> hardware preset. Every catalog variant is placed on a rig whose hardware runs it (GPU count >=
# its tensor-parallel size, compute capability and memory per card), the most constrained first, each
# on the least loaded rig that fits; a variant no rig fits fails test_the_lineup_covers_every_catalog_variant.
RIGS = {"rig-1x": "1x3090", "rig-2x": "2x3090", "rig-2y": "2x3090", "rig-2z": "2x3090",
        "rig-4x": "4x3090", "rig-8x": "8x3090", "rig-h4": "4xh200", "rig-2s": "2x3090"}
# Every rig runs Docker's real engine and pulls from the hub's real registry, except these: a variant
# whose image the catalog pins by upstream's digest (LMCache's) can only be pulled at that digest, which
# no image built here has, so it runs on the stand-in engine and manifest-only registry, and only there.
STANDIN_ENGINE_RIGS = {"rig-2s"}
LAST = {
    "rig-1x": "qwen-single-autoround-int4-minimal",  # no Genesis: the rollback target of the Genesis test
    "rig-2x": "qwen-dual-autoround-int4-fp8-mtp",  # its compose has ${MAX_NUM_SEQS:-2}: the pin-move test
}


@functools.cache
def _gpus_used(name: str) -> int:
    """GPUs the variant occupies, as preflight counts them: its tensor-parallel size, or more (vLLM-Omni's
    stages each take their own devices: TP 1 on 2 GPUs)."""
    return resolve({**load_defaults(), "variant": name}, upstream=working_trees()).gpu_count


def _digest_pinned(variant: dict) -> bool:
    return bool(load_catalog()["images"][variant["image"]].get("digest"))


def _fits(name: str, variant: dict, rig: str) -> bool:
    if _digest_pinned(variant) != (rig in STANDIN_ENGINE_RIGS):
        return False
    preset = RIGS[rig]
    models, _ = hw.PRESETS[preset]
    card = models[0]
    return (max(variant["tensor_parallel_size"], _gpus_used(name)) <= len(models)
            and tuple(map(int, card.compute_cap.split("."))) >= tuple(map(int, variant["min_compute_capability"].split(".")))
            and card.memory_total_mib / 1024 >= variant["min_gpu_memory_gb"] * 0.95)


def _free_gb() -> float:
    """Free disk where the bed's rigs will live (its cache directory, or the closest existing parent:
    a fresh clone has none yet)."""
    path = cache_dir()
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free / 1e9


def _disk_short() -> dict[str, float]:
    """Variants whose preflight disk check (model, image and sources at the catalog's real sizes, plus
    the margin) this machine cannot pass: the bed's rigs share its disk. Rendered and checked by the
    unit tests, not brought up here; the run prints them."""
    free = _free_gb() - 5  # what the bed itself writes meanwhile
    return {name: round(_disk_need(name), 1) for name in load_catalog()["variants"] if _disk_need(name) > free}


@functools.cache
def _disk_need(variant: str) -> float:
    """What preflight's disk check wants for `variant` on an empty rig: model, image and sources at the
    catalog's real sizes, plus the margin."""
    data = load_defaults()
    need = resolve({**data, "variant": variant}, upstream=working_trees()).disk_needed_gb
    return need + float(data["preflight_disk_margin_gb"])


DISK_SHORT = _disk_short()


def _lineup() -> dict[str, tuple[str, list[str]]]:
    variants = load_catalog()["variants"]
    placed: dict[str, list[str]] = {rig: [] for rig in RIGS}
    order = sorted((name for name in variants if name not in LAST.values() and name not in DISK_SHORT),
                   key=lambda name: sum(_fits(name, variants[name], rig) for rig in RIGS))
    for name in order:
        fitting = [rig for rig in RIGS if _fits(name, variants[name], rig)]
        if fitting:
            placed[min(fitting, key=lambda rig: len(placed[rig]))].append(name)
    catalog_order = {name: i for i, name in enumerate(variants)}
    for rig in placed:
        placed[rig].sort(key=catalog_order.__getitem__)
    for rig, name in LAST.items():
        placed[rig].append(name)
    # a rig left without variants (e.g. the stand-in engine's, when this disk cannot take LMCache's) is not booted
    return {rig: (preset, placed[rig]) for rig, preset in RIGS.items() if placed[rig]}


# rig -> (hardware preset, the variants it switches through, in order)
LINEUP: dict[str, tuple[str, list[str]]] = _lineup()
ROUNDS = max(len(v) for _, v in LINEUP.values())
GROUP = {rig: "g" + rig.removeprefix("rig-") for rig in LINEUP}  # one group per rig
BRING_UP_S: dict[str, float] = {}  # variant -> seconds of the deploy round that brought it up


def test_the_lineup_covers_every_catalog_variant() -> None:
    listed = [v for _, variants in LINEUP.values() for v in variants]
    assert sorted(listed + list(DISK_SHORT)) == sorted(variant_names()) and len(listed) == len(set(listed))
    assert not set(DISK_SHORT) & set(LAST.values())
    if DISK_SHORT:
        free = _free_gb()
        print(f"not brought up (this machine has {free:.0f} GB free; preflight wants, in GB): {DISK_SHORT}")


@pytest.fixture(scope="module")
def bed(testbed_factory: Callable[..., Testbed]) -> Iterator[Bed]:
    specs = [HostSpec(name, hardware=preset, group=GROUP[name]) for name, (preset, _) in LINEUP.items()]
    testbed = testbed_factory(specs, "rigrc")
    b = Bed(testbed, testbed.workdir)  # the real engine, but for STANDIN_ENGINE_RIGS' groups
    # Gemma's drafter is gated: the hub takes any bearer token, as one that accepted the licence
    token = testbed.workdir / "hf.token"
    token.write_text("hf_rigup_e2e_recipes\n")
    token.chmod(0o600)
    b.data = {"serving_health_timeout_s": GATE_TIMEOUT_S, "hf_token_file": str(token)}
    b.group_data = groups({name: variants[0] for name, (_, variants) in LINEUP.items()}, testbed)
    b.write()
    yield b


def groups(active: dict[str, str], testbed: Testbed) -> dict[str, dict[str, object]]:
    """Each rig's group data: its variant, and for STANDIN_ENGINE_RIGS the stand-in engine's knobs."""
    standin = testbed.engine_data(real_engine=False)
    return {GROUP[rig]: {"variant": variant, **(standin if rig in STANDIN_ENGINE_RIGS else {})}
            for rig, variant in active.items()}


def _verify(bed: Bed, *hosts: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rigup", "verify", "--json", "--limit", *hosts], cwd=REPO_ROOT, env=bed.env(),
        capture_output=True, text=True, timeout=600,
    )


def _check_serving(bed: Bed, rig: str, variant: str) -> None:
    host = bed.host(rig)
    recipe = recipe_of(variant)
    unit = f"rigup-{variant}.service"
    assert unit_prop(host, unit, "ActiveState") == "active", f"{rig}: {unit}"
    code, body = models(host, recipe.host_port)
    assert code == 200 and recipe.served_model_name in [m["id"] for m in body["data"]], (rig, variant, body)
    prov = provenance(host)
    assert prov["variant"] == variant and prov["gate"]["result"] == "passed", (rig, prov.get("gate"))
    # the compose file on the rig is the rendered one: upstream's base commit is named in it
    compose = sh(host, f"cat /opt/rigup/variants/{variant}/compose.yaml")
    assert f"Base: {recipe.upstream.path} at " in compose


def test_every_variant_comes_up_and_verifies(bed: Bed) -> None:
    timings: list[str] = []
    active = {name: variants[0] for name, (_, variants) in LINEUP.items()}
    for n in range(ROUNDS):
        previous = dict(active)
        if n:
            # the beds of the whole session fill this disk as it runs: a variant whose disk need no longer
            # fits what preflight will see is left out now (the rig keeps serving its current one)
            free = _free_gb() - 2
            for name, (_, variants) in LINEUP.items():
                nxt = variants[min(n, len(variants) - 1)]
                if nxt != active[name] and nxt not in LAST.values() and _disk_need(nxt) > free:
                    DISK_SHORT[nxt] = round(_disk_need(nxt), 1)
                    continue
                active[name] = nxt
            bed.group_data = groups(active, bed.testbed)
            bed.write()
        started = time.monotonic()
        bed.deploy()
        elapsed = time.monotonic() - started
        for rig, variant in active.items():
            _check_serving(bed, rig, variant)
            if n and variant != previous[rig]:
                BRING_UP_S[variant] = round(elapsed, 1)
                old = f"rigup-{previous[rig]}.service"
                assert unit_prop(bed.host(rig), old, "ActiveState") == "inactive", f"{rig}: {old} still runs"
            elif not n:
                BRING_UP_S[variant] = round(elapsed, 1)
        proc = _verify(bed, *active)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
        timings.append(f"round {n + 1}: {elapsed:.1f} s ({', '.join(active.values())})")
    print("\n".join(timings))
    print(json.dumps(BRING_UP_S, indent=1))
    print(f"not brought up for this machine's disk (preflight wants, in GB): {DISK_SHORT}")
    assert set(BRING_UP_S) | set(DISK_SHORT) == set(variant_names())


def test_a_recipe_the_hardware_cannot_run_is_refused_before_any_change(bed: Bed) -> None:
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


def _remote(bed: Bed, key: str) -> RemoteRepo:
    ready = json.loads((bed.testbed.workdir / "hub" / "git" / "ready.json").read_text())
    info = ready["remotes"][key]
    return RemoteRepo(info["name"], info["path"], dict(info["branches"]), dict(info["tags"]), dict(info["commits"]))


def test_an_empty_genesis_tree_fails_the_gate_with_the_cause_and_rolls_back(bed: Bed) -> None:
    """A switch to a Genesis recipe whose Genesis commit lost patches/apply_all.py: the checkout has the
    mounted directory (the sources phase passes), upstream's own entrypoint check stops the container,
    the gate fails with that cause, and the rig goes back to the variant it served."""
    rig = "rig-1x"
    host = bed.host(rig)
    good_variant = LINEUP[rig][1][-1]  # no Genesis: the rollback target does not mount the broken tree
    _check_serving(bed, rig, good_variant)
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
        _check_serving(bed, rig, good_variant)
        prov = provenance(host)
        assert prov["release_sha256"] == good["release_sha256"] and prov["last_rollback"]["outcome"] == "rolled back"
    finally:  # the tests after this one converge the whole lineup: the rig goes back to its good variant
        bed.group_data = {**before, GROUP[rig]: {"variant": good_variant}}
        bed.write()


def test_moving_the_recipe_pin_shows_the_rendered_diff_and_restarts_once(bed: Bed) -> None:
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
