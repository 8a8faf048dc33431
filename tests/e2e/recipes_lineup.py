"""The catalog's lineup for the recipe modules (tests/e2e/test_recipes.py and test_recipes_big_rigs.py): which
rig of which hardware brings up which variants, in which order, and the round loop both modules run.

The placement does not depend on this machine's free disk, so the two modules (run by different pytest-xdist
workers, each importing this at its own time) agree on which rig serves which variant and no variant falls
between them. What the disk cannot take is decided when a rig's turn comes (preflight wants the model, image
and sources at the catalog's real sizes) and recorded in DISK_SHORT; the unit tests render and check those.
"""

from __future__ import annotations

import functools
import json
import posixpath
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

from rigup.desired.catalog import load_catalog
from rigup.desired.knobs import load_defaults
from rigup.desired.recipe import resolve
from rigup_testbed import hardware as hw
from rigup_testbed.fleet import Testbed
from rigup_testbed.hosts import HostSpec
from rigup_testbed.image import REPO_ROOT, cache_dir
from rigup_testbed.recipes import working_trees
from tests.e2e.helpers import keyed_curl
from tests.e2e.test_serving import GATE_TIMEOUT_S, Bed, sh
from tests.e2e.test_serving import _recipe as recipe_of

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


def free_gb() -> float:
    """Free disk where the bed's rigs will live (its cache directory, or the closest existing parent:
    a fresh clone has none yet)."""
    path = cache_dir()
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free / 1e9


@functools.cache
def disk_need(variant: str) -> float:
    """What preflight's disk check wants for `variant` on an empty rig: model, image and sources at the
    catalog's real sizes, plus the margin."""
    data = load_defaults()
    need = resolve({**data, "variant": variant}, upstream=working_trees()).disk_needed_gb
    return need + float(data["preflight_disk_margin_gb"])


# variants this machine's disk could not take when their turn came (variant -> GB preflight wants)
DISK_SHORT: dict[str, float] = {}


# Variants up to this disk need (GB, preflight's figure) are placed first, the heavier ones after them on each rig:
# a machine short of disk drops the heavy ones from the end of a rig's list, so the rounds stay balanced.
# The catalog's needs have a gap here (66 GB, then 68 and up: the fp8 and nemotron weights).
HEAVY_GB = 67


def _lineup() -> dict[str, tuple[str, list[str]]]:
    variants = load_catalog()["variants"]
    placed: dict[str, list[str]] = {rig: [] for rig in RIGS}
    catalog_order = {name: i for i, name in enumerate(variants)}
    for heavy in (False, True):
        order = sorted((name for name in variants if name not in LAST.values() and (disk_need(name) > HEAVY_GB) == heavy),
                       key=lambda name: sum(_fits(name, variants[name], rig) for rig in RIGS))
        chosen: dict[str, list[str]] = {rig: [] for rig in RIGS}
        for name in order:
            fitting = [rig for rig in RIGS if _fits(name, variants[name], rig)]
            if fitting:
                chosen[min(fitting, key=lambda rig: len(placed[rig]) + len(chosen[rig]))].append(name)
        for rig in RIGS:
            placed[rig] += sorted(chosen[rig], key=catalog_order.__getitem__)
    for rig, name in LAST.items():
        placed[rig].append(name)
    return {rig: (preset, placed[rig]) for rig, preset in RIGS.items() if placed[rig]}


# rig -> (hardware preset, the variants it switches through, in order)
LINEUP: dict[str, tuple[str, list[str]]] = _lineup()
GROUP = {rig: "g" + rig.removeprefix("rig-") for rig in LINEUP}  # one group per rig
BRING_UP_S: dict[str, float] = {}  # variant -> seconds of the deploy round that brought it up


def bootable(rigs: Iterable[str]) -> dict[str, tuple[str, list[str]]]:
    """The lineup of `rigs` that this disk can start: variants whose need no longer fits are recorded in DISK_SHORT
    now, and a rig left with none (e.g. the stand-in engine's, when this disk cannot take LMCache's) is not booted."""
    free = free_gb() - 5  # what the beds write meanwhile
    out = {}
    for rig in rigs:
        preset, variants = LINEUP[rig]
        kept = []
        for name in variants:
            if name not in LAST.values() and disk_need(name) > free:
                DISK_SHORT[name] = round(disk_need(name), 1)
            else:
                kept.append(name)
        if kept:
            out[rig] = (preset, kept)
    return out


class RecipesBed(Bed):
    """A recipe module's bed: the rigs it was given (`rigs`) and the lineup of those it could boot (`lineup`)."""

    def __init__(self, testbed: Testbed, rigs: list[str], lineup: dict[str, tuple[str, list[str]]]) -> None:
        super().__init__(testbed, testbed.workdir)  # the real engine, but for STANDIN_ENGINE_RIGS' groups
        self.rigs = rigs
        self.lineup = lineup


def recipes_bed(testbed_factory: Callable[..., Testbed], rigs: Iterable[str], instance: str) -> RecipesBed:
    """A bed of `rigs` (bootable ones), each in its own group serving its first variant of the lineup. Every rig
    runs what a rig of its hardware needs to serve: the metrics phase (node_exporter, the GPU exporter, the
    sentinel's timer) is off here, since what this bed checks is each recipe's bring-up and the monitoring of a
    serving rig is tests/e2e/test_monitoring.py's and test_alerts_live.py's (its timers and exporters on eight
    rigs for the whole module were about a tenth of the module's CPU)."""
    lineup = bootable(rigs)
    specs = [HostSpec(name, hardware=preset, group=GROUP[name]) for name, (preset, _) in lineup.items()]
    # what comes after the host layer is what this bed checks; the stand-in engine's rigs install their own engine
    testbed = testbed_factory(specs, instance, host_layer=[name for name in lineup if name not in STANDIN_ENGINE_RIGS])
    b = RecipesBed(testbed, list(rigs), lineup)
    # Gemma's drafter is gated: the hub takes any bearer token, as one that accepted the licence
    token = testbed.workdir / "hf.token"
    token.write_text("hf_rigup_e2e_recipes\n")
    token.chmod(0o600)
    b.data = {"serving_health_timeout_s": GATE_TIMEOUT_S, "hf_token_file": str(token), "metrics_exporters": False}
    b.group_data = groups({name: variants[0] for name, (_, variants) in lineup.items()}, testbed)
    b.write()
    return b


def groups(active: dict[str, str], testbed: Testbed) -> dict[str, dict[str, object]]:
    """Each rig's group data: its variant, and for STANDIN_ENGINE_RIGS the stand-in engine's knobs."""
    standin = testbed.engine_data(real_engine=False)
    return {GROUP[rig]: {"variant": variant, **(standin if rig in STANDIN_ENGINE_RIGS else {})}
            for rig, variant in active.items()}


def verify(bed: Bed, *hosts: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rigup", "verify", "--json", "--limit", *hosts], cwd=REPO_ROOT, env=bed.env(),
        capture_output=True, text=True, timeout=600,
    )


SEPARATOR = "----rigup-e2e----"


def check_serving(bed: Bed, rig: str, variant: str, previous: str | None = None) -> None:
    """`variant` serves on `rig`: its unit active, its model listed by the pod, its gate passed in the provenance,
    its compose file the one rendered from upstream's recipe; and `previous`'s unit, if given, stopped. One SSH
    session asks all of it (eight rigs a round: a session each instead of five)."""
    recipe = recipe_of(variant)
    unit = f"rigup-{variant}.service"
    old = f"rigup-{previous}.service" if previous else "rigup-e2e-none.service"
    script = f"; echo {SEPARATOR}; ".join([
        f"systemctl show -p ActiveState --value {unit} {old}",
        f"{keyed_curl(posixpath.join(recipe.paths.secrets_dir, 'VLLM_API_KEY'))} -s -o /tmp/models.json -w '%{{http_code}}\\n' "
        f"http://127.0.0.1:{recipe.host_port}/v1/models; cat /tmp/models.json",
        "cat /opt/rigup/state/provenance.json",
        f"cat /opt/rigup/variants/{variant}/compose.yaml",
    ])
    parts = sh(bed.host(rig), script, check=False).split(SEPARATOR)
    states, listed, prov_text, compose = (part.strip() for part in parts)
    # `systemctl show` of two units: each one's value, a blank line between them
    active, old_state = ([line for line in states.splitlines() if line.strip()] + ["", ""])[:2]
    assert active == "active", f"{rig}: {unit} is {active!r}"
    if previous:
        assert old_state == "inactive", f"{rig}: {old} still runs ({old_state})"
    code, _, body = listed.partition("\n")
    served = [m["id"] for m in json.loads(body)["data"]] if code == "200" else []
    assert recipe.served_model_name in served, (rig, variant, code, body[:500])
    prov = json.loads(prov_text)
    assert prov["variant"] == variant and prov["gate"]["result"] == "passed", (rig, prov.get("gate"))
    # the compose file on the rig is the rendered one: upstream's base commit is named in it
    assert f"Base: {recipe.upstream.path} at " in compose, (rig, compose[:500])


def every_variant_comes_up_and_verifies(bed: RecipesBed) -> None:
    """Round by round, every rig of the bed switches to its next variant with the real `rigup lock` and
    `pyinfra deploy.py`; the gate, `rigup verify` and the old unit being stopped are checked per rig."""
    lineup = bed.lineup
    timings: list[str] = []
    active = {name: variants[0] for name, (_, variants) in lineup.items()}
    for n in range(max(len(v) for _, v in lineup.values())):
        previous = dict(active)
        if n:
            # the beds of the whole session fill this disk as it runs: a variant whose disk need no longer
            # fits what preflight will see is left out now (the rig keeps serving its current one)
            free = free_gb() - 2
            for name, (_, variants) in lineup.items():
                nxt = variants[min(n, len(variants) - 1)]
                if nxt != active[name] and nxt not in LAST.values() and disk_need(nxt) > free:
                    DISK_SHORT[nxt] = round(disk_need(nxt), 1)
                    continue
                active[name] = nxt
            bed.group_data = groups(active, bed.testbed)
            bed.write()
        started = time.monotonic()
        bed.deploy()
        elapsed = time.monotonic() - started
        switched = {rig: previous[rig] for rig, variant in active.items() if n and variant != previous[rig]}
        with ThreadPoolExecutor(len(active)) as pool:
            for done in [pool.submit(check_serving, bed, rig, variant, switched.get(rig)) for rig, variant in active.items()]:
                done.result()
        for rig, variant in active.items():
            if not n or rig in switched:
                BRING_UP_S[variant] = round(elapsed, 1)
        proc = verify(bed, *active)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
        timings.append(f"round {n + 1}: {elapsed:.1f} s ({', '.join(active.values())})")
    print("\n".join(timings))
    print(json.dumps(BRING_UP_S, indent=1))
    print(f"not brought up for this machine's disk (preflight wants, in GB): {DISK_SHORT}")
    mine = {v for rig in bed.rigs for v in LINEUP[rig][1]}
    assert mine <= set(BRING_UP_S) | set(DISK_SHORT), sorted(mine - set(BRING_UP_S) - set(DISK_SHORT))
