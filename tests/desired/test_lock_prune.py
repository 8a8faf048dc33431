"""`rigup lock` and pins no host needs any more: kept (and listed) unless --prune, which removes them
(and lists them); --check reports them without failing. Uses test_lock.py's fake hub and git remotes
where a pin has to be resolved, and made-up pins where nothing needs resolving (no network at all)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from rigup import REPO_ROOT
from rigup.desired.fleet import load_fleet
from rigup.desired.fleet_plan import fleet_entries, plan_fleet
from rigup.desired.lock import (
    LOCK_COMMAND,
    SHA40,
    FilePin,
    GitNeed,
    GitPin,
    ImagePin,
    LockFile,
    ModelNeed,
    ModelPin,
    Need,
)
from rigup.desired.needs import needs_for
from rigup.desired.pins import Resolver, update_lock
from rigup.desired.recipe import resolve
from rigup_testbed import hfhub
from rigup_testbed.gitremotes import Remotes
from tests.desired.test_lock import _host_data, _run, _write_fleet, clean_hub, hub, remotes  # noqa: F401 (fixtures)
from tests.support.artifacts import DFLASH, QWEN

UNUSED = f"model:{DFLASH}"  # what dual-dflash needs and dual does not


class NoNetwork(Resolver):
    """A resolver that must not be asked: every pin the test needs is already in the lock."""

    def git(self, need):  # type: ignore[no-untyped-def]
        raise AssertionError(f"resolved {need.name}")

    def model(self, need):  # type: ignore[no-untyped-def]
        raise AssertionError(f"resolved {need.name}")

    def image(self, need, previous):  # type: ignore[no-untyped-def]
        raise AssertionError(f"resolved {need.name}")


def _needs(data: dict) -> dict[str, Need]:
    return {n.name: n for n in needs_for(resolve(data, None), data)}


def test_update_keeps_unused_pins_unless_pruned(hub: hfhub.HfHub, remotes: tuple[Remotes, str], tmp_path: Path) -> None:
    dflash = _needs(_host_data(hub, remotes, tmp_path, variant="dual-dflash"))
    dual = _needs(_host_data(hub, remotes, tmp_path, variant="dual"))
    assert set(dflash) - set(dual) == {UNUSED}
    first, _ = update_lock(LockFile(), dflash, Resolver(), None)

    kept, changes = update_lock(first, dual, NoNetwork(), None)
    assert kept.dump() == first.dump()
    assert [(c.name, c.kind) for c in changes] == [(UNUSED, "unused")]
    assert "--prune" in changes[0].lines[0]

    pruned, changes = update_lock(first, dual, NoNetwork(), None, prune=True)
    assert [(c.name, c.kind) for c in changes] == [(UNUSED, "pruned")]
    assert pruned.names() == [n for n in first.names() if n != UNUSED]
    for name in pruned.names():
        assert pruned.entry(name) == first.entry(name)

    # The host goes back to dual-dflash: the kept pin serves it again, nothing is resolved.
    again, changes = update_lock(kept, dflash, NoNetwork(), None)
    assert again.dump() == first.dump() and changes == []
    # --upgrade (all) moves only what the fleet needs; the unused pin stays as it was.
    upgraded, changes = update_lock(first, dual, Resolver(), [])
    assert upgraded.entry(UNUSED) == first.entry(UNUSED)
    assert {c.kind for c in changes if c.name == UNUSED} == {"unused"}


def test_a_needed_stale_pin_is_fixed_while_an_unused_one_is_kept(
    hub: hfhub.HfHub, remotes: tuple[Remotes, str], tmp_path: Path
) -> None:
    rem, _ = remotes
    first, _ = update_lock(LockFile(), _needs(_host_data(hub, remotes, tmp_path, variant="dual-dflash")), Resolver(), None)
    refs = {**_host_data(hub, remotes, tmp_path)["source_refs"], "vllm-fork": rem.vllm.main_head}
    moved = _host_data(hub, remotes, tmp_path, variant="dual", source_refs=refs)
    new, changes = update_lock(first, _needs(moved), Resolver(), None)
    assert [(c.name, c.kind) for c in changes] == [("git:vllm-fork", "fixed"), (UNUSED, "unused")]
    assert new.git_commit("git:vllm-fork") == rem.vllm.main_head
    assert new.entry(UNUSED) == first.entry(UNUSED)


def test_lock_command_keeps_lists_and_prunes(hub: hfhub.HfHub, remotes: tuple[Remotes, str], tmp_path: Path) -> None:
    fleet = _write_fleet(tmp_path / "rigs.yaml", hub, remotes)
    lock = tmp_path / "rigs.lock.yaml"
    assert _run(fleet)[0] == 0
    text = lock.read_text()
    fleet.write_text(fleet.read_text().replace("variant: dual-dflash", "variant: dual"))  # nobody needs DFlash now

    code, out = _run(fleet)
    assert code == 0
    assert f"kept, unused: {UNUSED}\n" in out
    assert f"{lock}: kept 1 pin no host needs; `{LOCK_COMMAND} --prune` removes them" in out
    assert out.endswith(f"{lock}: unchanged (5 pins, 1 unused)\n")
    assert lock.read_text() == text

    code, out = _run(fleet, "--check")  # unused is reported, not a failure
    assert code == 0 and f"unused: {UNUSED}\n" in out and "covers all 5 pins" in out

    code, out = _run(fleet, "--dry-run", "--prune")
    assert code == 0 and f"pruned: {UNUSED}\n" in out and "would change (dry run)" in out
    assert lock.read_text() == text

    code, out = _run(fleet, "--prune")
    assert code == 0
    assert f"pruned: {UNUSED}\n" in out and f"{lock}: pruned 1 pin no host needs" in out
    assert out.endswith(f"{lock}: written (5 pins); commit it\n")
    assert UNUSED not in LockFile.load(lock).names() and f"model:{QWEN}" in LockFile.load(lock).names()
    code, out = _run(fleet, "--check")
    assert code == 0 and "unused" not in out


# ------------------------------------------------------------------------------------------
# the real command, in a subprocess, offline: every pin it needs is already in the lock


def _made_up_lock(needs: dict[str, Need], path: Path, extra: dict[str, Need] | None = None) -> LockFile:
    lock = LockFile()
    for need in [*needs.values(), *(extra or {}).values()]:
        if isinstance(need, GitNeed):
            lock.git[need.name] = GitPin(need.name, need.url, need.ref, need.ref if SHA40.match(need.ref) else "a" * 40)
        elif isinstance(need, ModelNeed):
            commit = need.revision if SHA40.match(need.revision) else "b" * 40
            lock.models[need.name] = ModelPin(need.name, need.repo_id, need.revision, commit, (FilePin("config.json", 2, "c" * 64),))
        else:
            lock.images[need.name] = ImagePin(need.name, need.repository, need.tag, "sha256:" + "d" * 64)
    lock.save(path)
    return lock


def _rigup_lock(fleet: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RIGUP_RIGS", "HF_TOKEN")}
    return subprocess.run(
        [sys.executable, "-m", "rigup", "lock", "--fleet", str(fleet), *argv],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120,
    )


def test_rigup_lock_cli_keeps_then_prunes_unused_pins(tmp_path: Path) -> None:
    fleet = tmp_path / "rigs.yaml"
    fleet.write_text(
        "groups:\n  rigs:\n    hosts:\n"
        "      rig-01: {ssh_hostname: 10.0.0.11, variant: dual}\n"
        "      rig-02: {ssh_hostname: 10.0.0.12, variant: single-minimal}\n"
    )
    needs, _ = plan_fleet(fleet_entries(load_fleet(fleet))).lock_needs()
    base = load_fleet(fleet).resolved_data("rig-01")
    gone = {**_needs({**base, "variant": "dual-turbo"}), **_needs({**base, "variant": "dual-dflash"})}
    unused = {n: need for n, need in gone.items() if n not in needs}  # what variants no host has any more need
    assert {"git:genesis", UNUSED} <= set(unused)
    lock = tmp_path / "rigs.lock.yaml"
    _made_up_lock(needs, lock, unused)
    text = lock.read_text()

    proc = _rigup_lock(fleet)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert [line for line in lines if line.startswith("kept, unused: ")] == [f"kept, unused: {n}" for n in sorted(unused, key=_order)]
    assert f"kept {len(unused)} pins no host needs" in proc.stdout
    assert lines[-1] == f"{lock}: unchanged ({len(needs)} pins, {len(unused)} unused)"
    assert lock.read_text() == text

    proc = _rigup_lock(fleet, "--check")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert all(f"unused: {n}" in proc.stdout for n in unused)

    proc = _rigup_lock(fleet, "--check", "--prune")
    assert proc.returncode == 2 and "not allowed with" in proc.stderr

    proc = _rigup_lock(fleet, "--prune")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [line for line in proc.stdout.splitlines() if line.startswith("pruned: ")] == [
        f"pruned: {n}" for n in sorted(unused, key=_order)
    ]
    assert proc.stdout.splitlines()[-1] == f"{lock}: written ({len(needs)} pins); commit it"
    assert LockFile.load(lock).names() == sorted(needs, key=_order)

    # A needed pin gone: --check fails (exit 1) and says what is missing.
    broken = LockFile.load(lock)
    del broken.git["git:vllm-fork"]
    broken.save(lock)
    proc = _rigup_lock(fleet, "--check")
    assert proc.returncode == 1 and "stale: git:vllm-fork: no entry" in proc.stdout


def _order(name: str) -> tuple[int, str]:
    """LockFile.names() order: git, then models, then images, each sorted."""
    return (("git", "model", "image").index(name.split(":", 1)[0]), name)


def test_a_gateway_only_host_needs_no_pins(tmp_path: Path) -> None:
    fleet = tmp_path / "rigs.yaml"
    fleet.write_text(
        "groups:\n  rigs:\n    hosts:\n"
        "      rig-01: {ssh_hostname: 10.0.0.11, variant: single-minimal}\n"
        "  gateway:\n    hosts:\n"
        "      gw-01: {ssh_hostname: 10.0.0.10, serves_variant: false}\n"  # its variant would be the default, dual
    )
    with_box, _ = plan_fleet(fleet_entries(load_fleet(fleet))).lock_needs()
    alone = tmp_path / "alone.yaml"
    alone.write_text("groups:\n  rigs:\n    hosts:\n      rig-01: {ssh_hostname: 10.0.0.11, variant: single-minimal}\n")
    assert set(with_box) == set(plan_fleet(fleet_entries(load_fleet(alone))).lock_needs()[0])
