"""Fixtures for end-to-end tests on the test bed (rigup_testbed).

  testbed_factory   session: make(specs, instance=None, hub=True) -> Testbed, booted; all torn down at
                    session end
  testbed           session: the default bed: rig-01 (group canary) + rig-02 (group rigs), 2x RTX 3090
                    each; RIGUP_TESTBED_HOSTS=N changes the count
  fleet_file        session: the default bed's fleet file (every URL knob at the hub, Debian 12 allowed)
  pyinfra_run       function: run(fleet, *args, opts=()) -> CompletedProcess of the real pyinfra CLI

Beds live under <runs>/<instance>, one directory for the whole machine (RIGUP_TESTBED_RUNS, else
/var/tmp/rigup-testbed/runs), whichever checkout the session runs from: a session holds
<runs>/<instance>.lock for each of its beds and first tears down the beds of every crashed session on the
machine (state.json present, lock free), so a killed run in another clone never leaves namespaces that
a later one trips over. Sessions can run side by side: each bed has its own namespaces, cgroups and
/24; a bed with a fixed name (a module's) that another live session holds is waited for, one at a time.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from pathlib import Path

import pytest

from rigup.desired.knobs import load_defaults
from rigup.desired.upstream import TREES_ENV
from rigup_testbed.fleet import Testbed, host_names
from rigup_testbed.hosts import HostSpec
from rigup_testbed.image import REPO_ROOT
from tests.support.timing import BED_UP_PROPERTY, over_budget

REQUIRED_TOOLS = ("debootstrap", "systemd-nspawn", "ip", "unshare", "ssh", "ssh-keygen", "mount")
PYINFRA = str(Path(sys.executable).with_name("pyinfra"))


def _prerequisites_missing() -> str | None:
    if os.geteuid() != 0:
        return "the test bed needs root (namespaces, mounts, cgroups)"
    missing = [t for t in REQUIRED_TOOLS if shutil.which(t) is None]
    if missing:
        return f"missing tools: {', '.join(missing)}"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = _prerequisites_missing()
    if reason is None:
        return
    if os.environ.get("RIGUP_REQUIRE_E2E") == "1":
        # CI sets this: a test bed that cannot start must turn the run red, not skip silently.
        raise pytest.UsageError(f"end-to-end tests required but cannot run: {reason}")
    for item in items:
        if "e2e" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))


RUNS_ENV = "RIGUP_TESTBED_RUNS"
MACHINE_RUNS = Path("/var/tmp/rigup-testbed/runs")
NAMED_BED_WAIT_S = 45 * 60  # a whole e2e session of another checkout, at most
# No e2e module may take longer than this, its beds' bring-up included: a module that grows past it fails,
# so growth is seen when it lands. The longest measured (tests/README.md): test_serving.py and test_cluster.py,
# 736 s and 862 s on a busy 2-core machine (test_recipes.py, 1,149 s there, is two modules since); the budget
# leaves that about 25 % to spare.
E2E_MODULE_BUDGET_S = 1100


def runs_dir() -> Path:
    """Machine-wide: the namespaces, links and cgroups a bed makes are machine-wide too."""
    env = os.environ.get(RUNS_ENV)
    return Path(env) if env else MACHINE_RUNS


class InstanceBusy(RuntimeError):
    pass


class InstanceLock:
    """<runs>/<name>.lock, held while a bed of that name exists in this process. The kernel drops it
    when the process dies, so a crashed session's beds are recognisably stale; `release` removes it."""

    def __init__(self, name: str, wait_s: float = 0.0) -> None:
        base = runs_dir()
        base.mkdir(parents=True, exist_ok=True)
        self.path = base / f"{name}.lock"
        deadline = time.monotonic() + wait_s
        told = False
        while True:
            handle = open(self.path, "a")
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.close()
                if time.monotonic() >= deadline:
                    raise InstanceBusy(f"test-bed instance {name!r} is in use by another session") from None
                if not told:
                    print(f"\ntest-bed instance {name!r} is in use by another session: waiting for it "
                          f"(at most {wait_s / 60:.0f} min)", file=sys.__stderr__, flush=True)
                    told = True
                time.sleep(5)
                continue
            try:
                if os.fstat(handle.fileno()).st_ino == os.stat(self.path).st_ino:
                    break  # not a file a releasing holder just unlinked
            except FileNotFoundError:
                pass
            handle.close()
        self.handle = handle

    def release(self) -> None:
        self.path.unlink(missing_ok=True)
        self.handle.close()


def lock_instance(name: str, wait_s: float = 0.0) -> InstanceLock:
    return InstanceLock(name, wait_s)


def clean_stale_runs() -> list[str]:
    """Tear down every bed a dead session left behind (its lock is free). Returns what was cleaned."""
    cleaned: list[str] = []
    base = runs_dir()
    if not base.exists():
        return cleaned
    for state in sorted(base.glob("*/state.json")):
        name = state.parent.name
        try:
            lock = lock_instance(name)
        except InstanceBusy:
            continue  # a live session's bed
        try:
            Testbed(state.parent, name).down()
            cleaned.append(name)
        finally:
            lock.release()
    return cleaned


_running_item: list[pytest.Item] = []


def pytest_runtest_setup(item: pytest.Item) -> None:
    _running_item[:] = [item]  # whose setup boots a bed: its report carries the bed's bring-up time


@pytest.fixture(autouse=True, scope="module")
def _within_the_module_budget(request: pytest.FixtureRequest) -> Iterator[None]:
    started = time.monotonic()
    yield
    problem = over_budget(request.module.__name__, time.monotonic() - started, E2E_MODULE_BUDGET_S)
    if problem:
        pytest.fail(problem, pytrace=False)


@pytest.fixture(autouse=True, scope="module")
def _recipes_from_the_git_remotes() -> Iterator[None]:
    """rigup and pyinfra run by e2e tests read upstream's recipes from the test bed's git remotes, as on
    a real control machine: the unit tests' $RIGUP_UPSTREAM_TREES shortcut is off for each e2e module
    (and back for the unit tests that run after it)."""
    saved = os.environ.pop(TREES_ENV, None)
    yield
    if saved is not None:
        os.environ[TREES_ENV] = saved


@pytest.fixture(scope="session")
def _testbed_session() -> Iterator[None]:
    """Stale beds of crashed sessions removed first; SIGTERM unwinds like Ctrl-C so fixtures still
    tear down."""
    clean_stale_runs()

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


_factories: list["BedFactory"] = []  # the session's, once made


# What every e2e bed's fleet file says unless its module says otherwise (issue 39: the suite is CPU-bound on
# 2 cores). The sentinel asks each pod 4 completions every sentinel_interval_s (30 s by default), ~0.1 s of a
# rig's CPU a round and the stand-in's answers beside it, for as long as a bed is up; only test_alerts_live
# watches its rounds (it sets its own interval), so the other beds ask every 5 minutes. The timer, the unit
# and the first round at the timer's start are what they are with the default. Likewise rigup's facts for
# node_exporter (metrics_facts_interval_s, 15 s by default): ~0.09 s of a rig's CPU a run (a Python start),
# read only by the modules whose Prometheus alerts on them (test_monitoring, test_alerts_live: they set the default).
E2E_FLEET_DEFAULTS = {"sentinel_interval_s": 300, "metrics_facts_interval_s": 300}
# group_data/all.py's metrics_facts_interval_s, for the modules that watch those series
FACTS_INTERVAL_S = load_defaults()["metrics_facts_interval_s"]


class BedFactory:
    """make(specs, instance=None, hub=True) -> a booted Testbed. A bed lives until the end of the module
    that made it (a booted bed left behind would take CPU from every module after it); the session's
    default bed (`testbed`) until the end of the session."""

    def __init__(self) -> None:
        self.beds: list[tuple[Testbed, InstanceLock, bool]] = []
        self.session_id = f"{os.getpid() % 100000:05d}"
        self.made = 0

    def __call__(self, specs: Sequence[HostSpec], instance: str | None = None, *, hub: bool = True,
                 for_the_session: bool = False, host_layer: bool | Collection[str] = False) -> Testbed:
        """Boot a bed of `specs`. Without `instance`, a name unique to this session is used (several
        sessions can run at once: each bed has its own namespaces, cgroups and subnet). `host_layer`: its hosts
        boot with rigup's host-layer packages installed (Testbed.up), for a module that tests what comes after."""
        name = instance or f"t{self.session_id}{self.made}"
        self.made += 1
        try:
            lock = lock_instance(name, NAMED_BED_WAIT_S if instance else 0.0)
        except InstanceBusy as exc:
            pytest.fail(str(exc))
        bed = Testbed(runs_dir() / name, name, hub=hub)
        bed.fleet_defaults = dict(E2E_FLEET_DEFAULTS)
        self.beds.append((bed, lock, for_the_session))
        if bed.created:  # left by a crashed session that used the same name
            bed.down()
        # what an earlier session's tests left in a named bed's directory (a lock file pinning that
        # session's moved commits, a token) must not carry into this one
        shutil.rmtree(bed.workdir, ignore_errors=True)
        bed.up(specs, host_layer=host_layer)
        if _running_item:
            _running_item[0].user_properties.append((BED_UP_PROPERTY, round(bed.timings.get("up_s", 0.0), 1)))
        return bed

    def down(self, *, module_beds_only: bool) -> list[str]:
        """Tear down the beds (newest first), only those made for a module if asked. Returns problems."""
        problems = []
        for entry in reversed(list(self.beds)):
            bed, lock, for_the_session = entry
            if module_beds_only and for_the_session:
                continue
            try:
                bed.down()
                lock.release()
                self.beds.remove(entry)
            except Exception as exc:  # tear down the others anyway; a kept lock marks the bed in use
                problems.append(f"{bed.instance}: {exc}")
        return problems


@pytest.fixture(scope="session")
def testbed_factory(_testbed_session: None) -> Iterator[BedFactory]:
    factory = BedFactory()
    _factories.append(factory)
    try:
        yield factory
    finally:
        _factories.remove(factory)
        problems = factory.down(module_beds_only=False)
        if problems:
            pytest.fail("test-bed teardown: " + "; ".join(problems))


@pytest.fixture(autouse=True, scope="module")
def _module_beds_down_after_it() -> Iterator[None]:
    yield
    for factory in _factories:  # none until a module asked for a bed: no stale-bed sweep for the others
        problems = factory.down(module_beds_only=True)
        if problems:
            pytest.fail("test-bed teardown: " + "; ".join(problems), pytrace=False)


def default_specs() -> list[HostSpec]:
    count = int(os.environ.get("RIGUP_TESTBED_HOSTS", "2"))
    names = host_names(count)
    return [HostSpec(n, group="canary" if i == 0 else "rigs") for i, n in enumerate(names)]


@pytest.fixture(scope="session")
def testbed(testbed_factory: BedFactory) -> Testbed:
    return testbed_factory(default_specs(), for_the_session=True)


@pytest.fixture(scope="session")
def fleet_file(testbed: Testbed) -> Path:
    return testbed.write_fleet(testbed.workdir / "rigs.yaml")


@pytest.fixture
def pyinfra_run() -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run the real pyinfra CLI from the repo root with inventory.py reading `fleet` (RIGUP_RIGS):
    run(fleet, "deploy.py") or run(fleet, "exec", "--", "uptime", opts=["--limit", "canary"])."""

    def run(
        fleet: Path, *args: str, opts: Sequence[str] = (), timeout: float = 900
    ) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "RIGUP_RIGS": str(fleet)}
        return subprocess.run(
            [PYINFRA, "-y", *opts, "inventory.py", *args],
            cwd=REPO_ROOT,
            env=env,
            text=True,
            capture_output=True,
            timeout=timeout,
        )

    return run
