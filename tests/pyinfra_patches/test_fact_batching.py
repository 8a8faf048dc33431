"""rigup.pyinfra_patches.fact_batching on pyinfra's own machinery (@local): a fact is read once until something runs on the
host, and the facts a run asked for come back in one batch the next run, each answered exactly as its
own command would have been."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from pyinfra.api import Config, FactBase, Inventory, State
from pyinfra.api.connect import connect_all, disconnect_all
from pyinfra.api.operation import add_op
from pyinfra.api.operations import run_ops
from pyinfra.context import ctx_host
from pyinfra.facts.files import Directory, File, Sha1File
from pyinfra.facts.server import Which
from pyinfra.operations import server

from rigup.pyinfra_patches import fact_batching as once
from tests.support.opharness import using

COUNTER = Path("/nonexistent")  # replaced per test (tmp_path)


class Counted(FactBase):
    """Reads a file and counts, on the host, how often its command ran."""

    def command(self, path: str) -> str:
        return f"echo x >> {COUNTER}; cat {path}"

    def process(self, output: list[str]) -> list[str]:
        return output


class NoNewline(FactBase):
    def command(self) -> str:
        return "printf 'a\\nb'"

    def process(self, output: list[str]) -> list[str]:
        return output


class Fails(FactBase):
    """Exits 3 with a message on stderr: pyinfra gives the default and fails the host unless told."""

    @staticmethod
    def default() -> str:
        return "default"

    def command(self) -> str:
        return "echo partial; echo broken >&2; exit 3"


class MissingTool(FactBase):
    requires_command = "rigup-no-such-tool"

    @staticmethod
    def default() -> str:
        return "absent"

    def command(self) -> str:
        return "rigup-no-such-tool --version"


def _run(state: State, host, fact, *args, **kwargs):  # noqa: ANN001, ANN202 - test helper
    return host.get_fact(fact, *args, **kwargs)


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    global COUNTER
    COUNTER = tmp_path / "counter"
    monkeypatch.setenv(once.RECORDS_ENV, str(tmp_path / "records"))
    (tmp_path / "data").write_text("one\n")
    yield tmp_path


def _state(read_once: bool = True) -> State:
    inventory = Inventory((["@local"], {}))
    state = State(inventory, Config())
    connect_all(state)
    if read_once:
        once.read_facts_once(state)
    return state


def _record(workdir: Path) -> Path:
    (path,) = (workdir / "records").glob("*.json")  # one host, one record
    return path


def _count() -> int:
    return len(COUNTER.read_text().splitlines()) if COUNTER.exists() else 0


def test_a_fact_is_read_once_until_something_runs_on_the_host(workdir: Path) -> None:
    state = _state()
    host = state.inventory.get_host("@local")
    data = str(workdir / "data")
    assert host.get_fact(Counted, path=data) == ["one"]
    assert host.get_fact(Counted, path=data) == ["one"]
    assert _count() == 1 and once.remote_commands(host).memo_hits == 1
    # the returned value is a copy: a caller that mutates it does not change what the next one gets
    host.get_fact(Counted, path=data).append("mutated")
    assert host.get_fact(Counted, path=data) == ["one"]

    # an operation's command runs on the host: what the memo held is dropped and read again
    add_op(state, server.shell, commands=[f"echo two >> {data}"])
    run_ops(state)
    assert host.get_fact(Counted, path=data) == ["one", "two"]
    assert _count() == 2 and once.remote_commands(host).invalidations == 1


def test_greenlets_asking_one_fact_at_once_share_one_read(workdir: Path) -> None:
    """At execution, every host of a fleet chain asks each member's facts while that member's own
    operation asks them too: the first read goes out, the others wait for it and share its value."""
    import gevent

    state = _state()
    host = state.inventory.get_host("@local")
    data = str(workdir / "data")
    readers = [gevent.spawn(host.get_fact, Counted, path=data) for _ in range(4)]
    gevent.joinall(readers, raise_error=True)
    assert [r.value for r in readers] == [["one"]] * 4
    assert _count() == 1 and once.remote_commands(host).memo_hits == 3


def test_without_read_facts_once_pyinfra_reads_every_time(workdir: Path) -> None:
    state = _state(read_once=False)
    host = state.inventory.get_host("@local")
    for _ in range(3):
        host.get_fact(Counted, path=str(workdir / "data"))
    assert _count() == 3


def test_the_next_run_reads_what_this_one_asked_in_one_command(workdir: Path) -> None:
    data = workdir / "data"
    wanted = [
        (Counted, {"path": str(data)}),
        (File, {"path": str(data)}),
        (Directory, {"path": str(workdir)}),
        (Sha1File, {"path": str(data)}),
        (File, {"path": str(workdir / "absent")}),
        (Which, {"command": "sh"}),
        (NoNewline, {}),
        (MissingTool, {}),
    ]
    first = _state()
    host = first.inventory.get_host("@local")
    singles = [host.get_fact(cls, **kw) for cls, kw in wanted]
    assert once.remote_commands(host).commands == len(wanted)
    disconnect_all(first)  # pyinfra's end of run: the record is saved
    record = json.loads(_record(workdir).read_text())
    # what was asked, in order, plus the checksum of the missing file (File's companion: pyinfra's
    # files.put asks it once the file exists, which the run that uploads it makes true)
    facts = [(e["fact"].rsplit(":", 1)[1], e["kwargs"].get("path")) for e in record["facts"]]
    assert facts == [(c.__name__, kw.get("path")) for c, kw in wanted] + [("Sha1File", str(workdir / "absent"))]

    second = _state()
    host = second.inventory.get_host("@local")
    batched = [host.get_fact(cls, **kw) for cls, kw in wanted]
    stats = once.remote_commands(host)
    assert (stats.commands, stats.batches, stats.batched_facts, stats.single_facts) == (1, 1, len(wanted) + 1, 0), stats
    assert _count() == 2  # Counted's command ran once per run
    # each answer is what the fact's own command gave: output without a final newline, a missing
    # file (None), a missing tool (the fact's default), a directory's mode and a checksum alike
    for (cls, _), single, again in zip(wanted, singles, batched):
        if cls is not File and cls is not Directory:
            assert again == single, cls.__name__
        else:  # stat times may move between the runs (the counter file is in this directory)
            assert (again is None) == (single is None) and (again or {}).get("mode") == (single or {}).get("mode")
    assert batched[6] == ["a", "b"] and batched[7] == "absent" and batched[4] is None
    disconnect_all(second)

    # a recorded command this deploy no longer builds (another rigup, other knobs) is not used for it:
    # the fact is read on its own, with the command of this run
    path = _record(workdir)
    raw = json.loads(path.read_text())
    raw["facts"][0]["command"] = "echo stale"
    path.write_text(json.dumps(raw))
    third = _state()
    host = third.inventory.get_host("@local")
    assert host.get_fact(Counted, path=str(data)) == ["one"]
    assert once.remote_commands(host).single_facts == 1 and _count() == 3


class _SshLikeClient:
    """What rigup.pyinfra_patches.fact_batching._send_early looks for on a connector: a client that runs commands (the local
    connector, which runs them itself, never calls it)."""

    def exec_command(self, *args: object, **kwargs: object) -> None:
        raise AssertionError("not called by the local connector")


def test_while_a_hosts_task_files_load_its_batch_is_sent_before_any_fact_is_asked(workdir: Path) -> None:
    data = str(workdir / "data")
    first = _state()
    host = first.inventory.get_host("@local")
    host.get_fact(Counted, path=data)
    host.get_fact(Which, command="sh")
    disconnect_all(first)

    second = _state(read_once=False)
    host = second.inventory.get_host("@local")
    client = host.connector.client = _SshLikeClient()
    with using(ctx_host, host):  # as pyinfra does around each host's task files
        once.read_facts_once(second)
    stats = once.remote_commands(host)
    # sent and answered before the deploy asked for anything; the client is as it was
    assert (stats.commands, stats.batches, stats.batched_facts) == (1, 1, 2) and _count() == 2
    assert "exec_command" not in vars(client)
    assert host.get_fact(Counted, path=data) == ["one"] and host.get_fact(Which, command="sh")
    assert stats.commands == 1 and stats.memo_hits == 2


def test_outside_a_hosts_task_files_nothing_is_sent_early(workdir: Path) -> None:
    first = _state()
    host = first.inventory.get_host("@local")
    host.get_fact(Counted, path=str(workdir / "data"))
    disconnect_all(first)
    second = _state(read_once=False)
    host = second.inventory.get_host("@local")
    host.connector.client = _SshLikeClient()
    once.read_facts_once(second)  # no host's task files loading: the first request sends the batch
    assert once.remote_commands(host).commands == 0 and _count() == 1
    assert host.get_fact(Counted, path=str(workdir / "data")) == ["one"]
    assert once.remote_commands(host).batches == 1 and _count() == 2


def test_a_failing_fact_is_left_to_the_deploys_own_request(workdir: Path) -> None:
    first = _state()
    host = first.inventory.get_host("@local")
    assert host.get_fact(Fails, _ignore_errors=True) == "default"
    assert host.get_fact(Fails, _ignore_errors=True) == "default"
    assert once.remote_commands(host).single_facts == 2  # a failed read is not kept
    disconnect_all(first)

    # the next run's batch runs it, keeps nothing and fails nobody; the request reads it and fails
    # the host exactly when pyinfra would (here: not told to ignore errors)
    second = _state()
    host = second.inventory.get_host("@local")
    host.get_fact(Which, command="sh")  # the first request: the batch runs
    stats = once.remote_commands(host)
    assert (stats.batches, stats.batched_facts) == (1, 0) and not second.failed_hosts
    with pytest.raises(Exception, match="No hosts remaining"):
        host.get_fact(Fails)
    assert host in second.failed_hosts


def test_the_record_keeps_no_secret_and_ignores_what_it_cannot_use(workdir: Path) -> None:
    first = _state()
    host = first.inventory.get_host("@local")
    host.get_fact(Counted, path=str(workdir / "data"), _sudo_password="hunter2", _env={"TOKEN": "sekrit"})
    host.get_fact(Counted, path=str(workdir / "data"), _sudo_password="hunter2")
    disconnect_all(first)
    text = _record(workdir).read_text()
    assert "hunter2" not in text and "sekrit" not in text
    assert len(json.loads(text)["facts"]) == 1  # the read with an environment is not recorded

    # a record naming a fact that no longer exists, or garbage, costs nothing but a single read
    path = _record(workdir)
    raw = json.loads(text)
    raw["facts"].insert(0, {"fact": "rigup.facts.nowhere:Gone", "args": [], "kwargs": {}, "connector": {}})
    path.write_text(json.dumps(raw))
    second = _state()
    host = second.inventory.get_host("@local")
    assert host.get_fact(Counted, path=str(workdir / "data"), _sudo_password="hunter2") == ["one"]
    assert once.remote_commands(host).batched_facts == 1
    path.write_text("{not json")
    third = _state()
    assert third.inventory.get_host("@local").get_fact(Counted, path=str(workdir / "data")) == ["one"]


def test_batch_sections_survive_marker_like_output(workdir: Path) -> None:
    script = once._batch_script("tok", ["printf 'x\\n@@other out 0\\n'", "true", "echo e >&2; exit 4"])
    import subprocess

    out = subprocess.run(["sh", "-c", script], capture_output=True, text=True, check=True).stdout.splitlines()
    sections = once._split_batch("tok", out, 3)
    assert sections == {0: (["x", "@@other out 0"], [], 0), 1: ([], [], 0), 2: ([], ["e"], 4)}


@pytest.mark.parametrize("text", ["", "x", "x\n", "\n", "x\n\n", "a\nb", "a\n\nb\n", "  \n", "@@other out 9\n"])
def test_batch_sections_keep_each_stream_line_for_line(text: str) -> None:
    """Whatever a read prints, with or without a last newline, comes back as pyinfra would split it
    (lines without their "\\n"), on stdout and stderr, in lanes of their own or sharing one."""
    import subprocess

    expected = text.split("\n")
    if expected[-1] == "":
        expected.pop()
    quoted = text.replace("'", "'\\''")
    commands = [f"printf '%s' '{quoted}'; printf '%s' '{quoted}' >&2; exit {i}" for i in range(40)]
    script = once._batch_script("tok", commands)
    out = subprocess.run(["sh", "-c", script], capture_output=True, text=True, check=True).stdout.splitlines()
    sections = once._split_batch("tok", out, len(commands))
    assert sections == {i: (expected, expected, i) for i in range(40)}
