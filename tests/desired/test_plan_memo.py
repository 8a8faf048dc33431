"""host_plan resolves each distinct recipe once per process (rigup.desired.plan._resolved): a converge
asks for a host's plan in several tasks. The memo is keyed by the inputs' content, never by identity."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from rigup.desired import knobs
from rigup.desired import plan as plan_module
from rigup.desired.knobs import load_defaults
from rigup.desired.lock import GitPin, LockFile
from rigup.desired.plan import host_plan
from rigup.desired.upstream import GitCache, WorkingTrees, default_reader, use_reader
from rigup.parsers.topology import Topology


class _CacheOverTrees(GitCache):
    """The git cache as resolve sees it (files at pinned commits, which never change), answering from the
    fixture trees the unit tests read upstream from."""

    def __init__(self, trees: Any) -> None:  # no cache directory: nothing is fetched
        self.trees = trees

    def read(self, source: str, url: str, commit: str, path: str) -> str:
        return self.trees.read(source, url, commit, path)

    def kind(self, source: str, url: str, commit: str, path: str) -> str | None:
        return self.trees.kind(source, url, commit, path)


@pytest.fixture
def resolves(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[dict[str, Any]]]:
    """Every call that reached rigup.desired.recipe.resolve, from a memo emptied for the test, with
    upstream read through the git cache."""
    calls: list[dict[str, Any]] = []
    real = plan_module.resolve

    def counting(host_data: Any, lock: Any = None, interconnect: Any = None, **kw: Any) -> Any:
        calls.append({"variant": host_data.get("variant"), "lock": lock, "interconnect": interconnect})
        return real(host_data, lock, interconnect, **kw)

    monkeypatch.setattr(plan_module, "resolve", counting)
    monkeypatch.setattr(plan_module, "_RESOLVED", {})
    previous = use_reader(_CacheOverTrees(default_reader()))
    yield calls
    use_reader(previous)


def data(**knobs: Any) -> dict[str, Any]:
    host = load_defaults()
    host.update(knobs)
    return host


def preview(host_data: dict[str, Any], **options: Any) -> Any:
    return host_plan(host_data, "rig-01", require_lock=False, read_secrets=False, **options)


def test_the_same_inputs_resolve_once_and_give_the_same_recipe(resolves: list[dict[str, Any]]) -> None:
    first = preview(data(variant="dual"))
    again = preview(data(variant="dual"))  # a fresh dict with the same content, as each task builds it
    assert len(resolves) == 1
    assert again.recipe == first.recipe


def test_a_changed_knob_or_topology_resolves_again(resolves: list[dict[str, Any]]) -> None:
    base = preview(data(variant="dual"))
    longer = preview(data(variant="dual", variant_overrides={"max_model_len": 8192}))
    assert len(resolves) == 2 and longer.recipe != base.recipe
    nvlink = Topology(gpus=(0, 1), links={(0, 1): "NV4", (1, 0): "NV4"})
    linked = preview(data(variant="dual"), topology=nvlink)
    # the plain recipe came from the memo; the one refined by the detected NVLink is new
    assert [c["interconnect"] is not None for c in resolves[2:]] == [True]
    assert linked.recipe != base.recipe


def test_a_lock_keys_by_its_pins_and_another_lock_is_not_kept(resolves: list[dict[str, Any]]) -> None:
    preview(data(variant="dual"), lock=LockFile())
    preview(data(variant="dual"), lock=LockFile())
    assert len(resolves) == 1  # two empty locks: the same content
    pinned = LockFile()
    pinned.git["unrelated"] = GitPin("git:unrelated", "https://example.invalid/x.git", "main", "a" * 40)
    preview(data(variant="dual"), lock=pinned)
    assert len(resolves) == 2  # other pins, another key (its repr shows them)

    class NoPins:  # rigup.desired.recipe.Lock by duck typing: its repr is its address, not its content
        def git_commit(self, name: str) -> None:
            return None

        def model_revision(self, name: str) -> None:
            return None

        def image_digest(self, ref: str) -> None:
            return None

    plan_module._resolved(data(variant="dual"), NoPins(), None, None)
    plan_module._resolved(data(variant="dual"), NoPins(), None, None)
    assert len(resolves) == 4


def test_an_error_is_raised_again_not_kept(resolves: list[dict[str, Any]]) -> None:
    for _ in range(2):
        with pytest.raises(Exception, match="no-such-variant"):
            preview(data(variant="no-such-variant"))
    assert len(resolves) == 2


def test_upstream_read_from_working_trees_is_resolved_every_time(resolves: list[dict[str, Any]]) -> None:
    trees = default_reader()
    assert isinstance(trees, _CacheOverTrees)
    use_reader(trees.trees)  # a recipe author's checkout: its files may change while the process runs
    assert isinstance(default_reader(), WorkingTrees)
    preview(data(variant="dual"))
    preview(data(variant="dual"))
    assert len(resolves) == 2
    use_reader(trees)
    preview(data(variant="dual"))
    preview(data(variant="dual"))
    assert len(resolves) == 3  # kept, for this reader
    use_reader(_CacheOverTrees(trees.trees))  # and not given out for another
    preview(data(variant="dual"))
    assert len(resolves) == 4
    use_reader(trees)


def test_hosts_that_differ_only_in_undeclared_data_share_one_resolve(resolves: list[dict[str, Any]]) -> None:
    # a fleet's rigs: the same knobs, their own SSH settings (pyinfra's, not group_data/all.py's)
    rigs = [preview(data(variant="dual", ssh_hostname=f"10.0.0.{i}", ssh_user="rigup")) for i in (11, 12, 13)]
    assert len(resolves) == 1 and rigs[0].recipe == rigs[2].recipe
    # resolve is handed the declared knobs alone: it could not read the SSH settings even if it tried
    seen: list[dict[str, Any]] = []
    real = plan_module.resolve
    plan_module.resolve = lambda host_data, *a, **kw: seen.append(dict(host_data)) or real(host_data, *a, **kw)
    try:
        preview(data(variant="dual", ssh_hostname="10.0.0.14", install_root="/srv/rigup"))
    finally:
        plan_module.resolve = real
    assert len(seen) == 1 and "ssh_hostname" not in seen[0] and seen[0]["install_root"] == "/srv/rigup"
    assert set(seen[0]) <= set(knobs._declared())


def test_hosts_asking_at_once_share_one_resolve(resolves: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    # pyinfra loads each host's task files in its own greenlet, and resolve waits on git; a host that asks
    # while another resolves the same inputs must wait for that answer, not resolve again.
    import threading

    import gevent
    from gevent.lock import RLock

    counting = plan_module.resolve

    def slow(*args: Any, **kw: Any) -> Any:
        gevent.sleep(0.05)  # as git's subprocess lets the other greenlets run
        return counting(*args, **kw)

    monkeypatch.setattr(plan_module, "resolve", slow)
    if not isinstance(plan_module._RESOLVING, RLock):  # pyinfra's CLI patches threading; pytest does not
        assert type(plan_module._RESOLVING) is type(threading.RLock())
        monkeypatch.setattr(plan_module, "_RESOLVING", RLock())
    plans = [gevent.spawn(preview, data(variant="dual")) for _ in range(4)]
    gevent.joinall(plans, raise_error=True)
    assert len(resolves) == 1
    assert len({id(p.value.recipe) for p in plans}) == 1
