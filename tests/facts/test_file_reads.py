"""rigup.facts.file_reads: pyinfra's File/Directory/Link and Sha1File/Sha256File reads of many paths in
one command each, answered exactly as each read's own command would have been (run here, in sh)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import time
from pathlib import Path

import pytest
from pyinfra.facts.files import Directory, File, Link, Sha1File, Sha256File
from pyinfra.facts.server import Which

from rigup.facts.file_reads import group_file_reads
from rigup.pyinfra_patches import fact_batching as once


def _request(cls: type, **kwargs: str) -> once._Request:
    command = cls().command(**kwargs)
    return once._Request(cls, (), kwargs, command.get_raw_value() if hasattr(command, "get_raw_value") else command)


def _sh(command: str) -> list[str]:
    proc = subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def _alone(request: once._Request) -> object:
    found, value = once._value_of(request, _sh(request.command))
    assert found
    return value


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    (tmp_path / "plain").write_text("one\n")
    (tmp_path / "with space and 'quote'").write_text("two\n")
    (tmp_path / "dir").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "plain")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    (tmp_path / "secret").write_text("three\n")
    (tmp_path / "secret").chmod(0o600)
    # atime after mtime and recent: hashing a file does not move its atime (relatime), so the stat
    # lines read before and after the hash agree
    now = time.time()
    for p in tmp_path.rglob("*"):
        os.utime(p, (now, now - 100), follow_symlinks=False)
    return tmp_path


def test_each_read_gets_what_its_own_command_gives(tree: Path) -> None:
    paths = ["plain", "with space and 'quote'", "dir", "link", "dangling", "secret", "absent", "dir/absent"]
    requests = [_request(cls, path=str(tree / p)) for cls in (File, Directory, Link) for p in paths]
    requests += [_request(cls, path=str(tree / p)) for cls in (Sha1File, Sha256File)
                 for p in ("plain", "with space and 'quote'", "link", "absent")]
    requests.append(_request(Which, command="sh"))
    alone = [_alone(r) for r in requests]

    singles, groups = group_file_reads(requests)
    assert [r.cls for r in singles] == [Which]
    assert sorted(g.tool for g in groups) == ["sha1sum", "sha256sum", "stat"]
    stat = next(g for g in groups if g.tool == "stat")
    assert stat.paths == [str(tree / p) for p in paths]  # each path once, for the three facts
    answered = {}
    for group in groups:
        outputs = group.outputs(_sh(group.command()))
        assert outputs is not None and len(outputs) == len(group.requests)
        for request, out in zip(group.requests, outputs):
            found, answered[id(request)] = once._value_of(request, out)
            assert found
    for request, value in zip(requests, alone):
        if request.cls is not Which:
            assert answered[id(request)] == value, (request.cls.__name__, request.kwargs)
    # the answers are real ones: a file, a directory, a link and absent paths, a checksum
    by = {(r.cls, Path(r.kwargs["path"]).name): answered[id(r)] for r in requests if r.cls is not Which}
    assert by[(File, "plain")]["size"] == 4 and by[(File, "dir")] is False and by[(Directory, "dir")]["mode"] == 755
    assert by[(Link, "link")]["link_target"] == str(tree / "plain") and by[(File, "absent")] is None
    assert by[(File, "secret")]["mode"] == 600
    assert by[(Sha1File, "plain")] == hashlib.sha1(b"one\n").hexdigest()
    assert by[(Sha256File, "link")] == hashlib.sha256(b"one\n").hexdigest()  # through the link, as sha256sum reads
    assert by[(Sha1File, "absent")] is None


def test_a_directorys_checksum_is_none_as_alone_and_spoils_nothing(tree: Path) -> None:
    # the checksum read pyinfra's files.put pairs with a File read, asked of a directory
    requests = [_request(Sha1File, path=str(tree / p)) for p in ("plain", "dir", "link")]
    _, (group,) = group_file_reads(requests)
    outputs = group.outputs(_sh(group.command()))
    assert outputs is not None
    values = [once._value_of(r, out)[1] for r, out in zip(requests, outputs)]
    assert values == [_alone(r) for r in requests] and values[1] is None and values[0] == values[2]


def test_an_answer_that_does_not_add_up_answers_no_read(tree: Path) -> None:
    # sha1sum answers for fewer paths than exist (one it cannot read, one gone since the test): here,
    # a sha1sum given the first path alone
    requests = [_request(Sha1File, path=str(tree / p)) for p in ("plain", "secret")]
    _, (group,) = group_file_reads(requests)
    command = group.command().replace('sha1sum "$@"', 'sha1sum "$1"')
    proc = subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=60)
    assert group.outputs(proc.stdout.splitlines()) is None
    # so does a path that is gone between the test and the read, and any output not in the shape
    _, (stat,) = group_file_reads([_request(File, path=str(tree / p)) for p in ("plain", "dir")])
    assert stat.outputs(["+", "+", "user=root group=root mode=-rw-r--r-- atime=1 mtime=1 ctime=1 size=4 'x'"]) is None
    assert stat.outputs(["+", "?", "a", "b"]) is None and stat.outputs(["+"]) is None


def test_only_pyinfras_own_commands_for_plain_paths_are_grouped(tree: Path) -> None:
    plain = [_request(File, path=str(tree / "plain")), _request(Directory, path=str(tree / "dir"))]
    home = _request(File, path="~/.bashrc")  # the shell expands it: left to its own command
    other = _request(File, path=str(tree / "secret"))
    other.command = other.command.replace("stat -c", "stat -L -c")  # another pyinfra's command
    alone = _request(Sha1File, path=str(tree / "plain"))  # one read of its family: nothing to group
    singles, groups = group_file_reads([*plain, home, other, alone])
    assert singles == [home, other, alone]
    assert [(g.tool, g.requests) for g in groups] == [("stat", plain)]


def test_the_batch_answers_grouped_reads(tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through rigup.pyinfra_patches.fact_batching on @local: one batch, no read of its own, each value as pyinfra reads it."""
    from pyinfra.api.connect import disconnect_all

    from tests.pyinfra_patches.test_fact_batching import _state

    monkeypatch.setenv(once.RECORDS_ENV, str(tmp_path / "records"))
    wanted = [(File, "plain"), (File, "with space and 'quote'"), (Directory, "dir"), (File, "absent"),
              (Sha1File, "plain"), (Sha1File, "with space and 'quote'")]
    first = _state()
    host = first.inventory.get_host("@local")
    alone = [host.get_fact(cls, path=str(tree / p)) for cls, p in wanted]
    disconnect_all(first)
    second = _state()
    host = second.inventory.get_host("@local")
    batched = [host.get_fact(cls, path=str(tree / p)) for cls, p in wanted]
    stats = once.remote_commands(host)
    assert (stats.commands, stats.single_facts) == (1, 0), stats
    assert batched == alone
    disconnect_all(second)
