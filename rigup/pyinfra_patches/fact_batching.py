"""Facts read once per run, and a host's facts in one round trip.

pyinfra 3 keeps no fact cache: every `host.get_fact` runs its command again, so that a fact read after
a change sees the change. On a converged rig that is a hundred ssh+sudo round trips for a deploy that
changes nothing (the same `dpkg -l` eight times). With `read_facts_once(state)`:

- **Once.** What a fact returned is kept per host, keyed by the exact command pyinfra would run and
  its connector arguments (sudo, user, shell). It is dropped when anything other than a fact read runs
  on that host: an operation's command, an upload or download, a callback's own command. So a fact
  read after a change is read again, as pyinfra's own semantics require.
- **One round trip.** The facts the previous run of this deploy asked of a host (recorded in
  `<work dir>/.cache/facts/<host>.json`: fact class, arguments, the command, non-secret connector arguments; never
  a password or an environment) are read in one command per connector setting, every host at once:
  sent as soon as read_facts_once runs while the host's task files load (over SSH), else at the
  host's first fact request. pyinfra's per-path file reads (File, Directory, Link, Sha1File,
  Sha256File) go in one section per family (rigup.facts.file_reads): one `stat` and one hash tool
  for all the files a deploy owns. Each section carries its own stdout, stderr and exit status. A section
  that succeeded is made into the fact's value as pyinfra's fact reader does (the missing-command
  sentinel and empty output give the default, else process()); one that failed, or whose output
  does not process, is kept for the deploy's own request, which reads it alone, so pyinfra fails
  the host (or not) exactly as it would. A fact the record does not list is read on its own and
  recorded for the next run; the record keeps what the last run asked (the command included).

`RemoteCommands` counts what actually went to each host (commands, uploads, downloads, batches); the
closing summary and bench/converge.py report it.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import json
import logging
import os
import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gevent
import gevent.event
from pyinfra.api import facts as pyinfra_facts
from pyinfra.api.command import StringCommand
from pyinfra.api.facts import FactBase, ShortFactBase
from pyinfra.api.host import Host
from pyinfra.api.state import BaseStateCallback
from pyinfra.context import ctx_config, ctx_host, ctx_state

from rigup import WORK_DIR
from rigup.facts.file_reads import group_file_reads, raw_command

logger = logging.getLogger("pyinfra.rigup.facts")  # under pyinfra's logger: -v and --debug show it

RECORD_VERSION = 1
# Connector arguments a record may carry (none secret) and those that change how a command is wrapped.
PERSISTED_ARGS = ("_sudo", "_sudo_user", "_use_sudo_login", "_preserve_sudo_env", "_su_user", "_use_su_login",
                  "_preserve_su_env", "_su_shell", "_doas", "_doas_user", "_dzdo", "_dzdo_user",
                  "_shell_executable", "_chdir")  # fmt: skip
UNBATCHABLE_ARGS = ("_stdin", "_get_pty", "_env")  # read on their own
# What the batch command runs with: everything that decides how pyinfra wraps and runs a command.
RUN_ARGS = (*PERSISTED_ARGS, "_sudo_password", "_su_password")
# A fact asked, in a later run, with the same arguments as one asked now (see save_record).
COMPANIONS = {"pyinfra.facts.files:File": "pyinfra.facts.files:Sha1File"}


RECORDS_ENV = "RIGUP_FACT_RECORDS"  # where the records go instead (the tests use their own directory)
BATCH_START = "__rigup_d=$(mktemp -d) || exit 97"  # a batch's first line (is_fact_batch)


def record_dir() -> Path:
    return Path(os.environ.get(RECORDS_ENV) or Path(WORK_DIR) / ".cache" / "facts")


def is_fact_batch(command: str) -> bool:
    """Whether a command (as a connector logs it) is one of this module's fact batches: reads only."""
    return BATCH_START in command


class _Captured(Exception):
    """Raised from inside pyinfra's fact reader to learn the command it would run."""

    def __init__(self, command: StringCommand | str, kwargs: dict[str, Any]) -> None:
        super().__init__("captured")
        self.command = command
        self.kwargs = kwargs


@dataclass
class _Request:
    cls: type[FactBase]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    command: str = ""
    connector: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> tuple[str, str, str]:
        return (f"{self.cls.__module__}:{self.cls.__qualname__}", self.command, _args_key(self.connector))

    def persisted(self) -> dict[str, Any] | None:
        if any(self.connector.get(k) for k in UNBATCHABLE_ARGS):
            return None
        try:
            entry = {"fact": self.key[0], "args": list(self.args), "kwargs": self.kwargs, "command": self.command,
                     "connector": {k: self.connector[k] for k in PERSISTED_ARGS if k in self.connector}}
            json.dumps(entry)
        except (TypeError, ValueError):
            return None  # arguments that are not plain data are not recorded
        return entry


def _args_key(connector: dict[str, Any]) -> str:
    """What makes two reads of one command the same read: how it is run and what counts as success
    (a password by presence only; timeouts and retries do not change the answer)."""
    shown = {k: connector.get(k) for k in (*PERSISTED_ARGS, *UNBATCHABLE_ARGS, "_success_exit_codes")}
    shown.update({k: bool(connector.get(k)) for k in ("_sudo_password", "_su_password")})
    return json.dumps(shown, sort_keys=True, default=repr)


@dataclass
class RemoteCommands:
    """What went to one host in this run."""

    commands: int = 0  # shell commands, fact batches included
    uploads: int = 0
    downloads: int = 0
    batches: int = 0  # of which: prefetch batches
    batched_facts: int = 0  # facts those batches answered
    single_facts: int = 0  # facts read with a command of their own
    memo_hits: int = 0
    invalidations: int = 0

    @property
    def round_trips(self) -> int:
        return self.commands + self.uploads + self.downloads


class HostFacts:
    """One host's fact memo, its record and its counters."""

    def __init__(self, host: Host) -> None:
        self.host = host
        self.memo: dict[tuple[str, str, str], Any] = {}
        self.asked: dict[tuple[str, str, str], dict[str, Any] | None] = {}
        self.stats = RemoteCommands()
        self.capture = False
        self.reading = 0
        self.last_ok = True  # the commands of the current single read all succeeded
        self.ready: gevent.event.Event | None = None  # set once the prefetch has answered
        # a read in flight, by key: another greenlet asking the same fact meanwhile (one host's operation
        # asking a fact of its chain peers while their own operations ask it) waits for it
        self.inflight: dict[tuple[str, str, str], gevent.event.Event] = {}

    # ------------------------------------------------------------------ record
    @property
    def record_path(self) -> Path:
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in self.host.name)
        return record_dir() / f"{safe}.json"

    def load_record(self) -> list[dict[str, Any]]:
        try:
            raw = json.loads(self.record_path.read_text())
        except (OSError, ValueError):
            return []
        if not isinstance(raw, dict) or raw.get("version") != RECORD_VERSION or not isinstance(raw.get("facts"), list):
            return []
        return [e for e in raw["facts"] if isinstance(e, dict)]

    def save_record(self) -> None:
        entries = [e for e in self.asked.values() if e is not None]
        if not entries:
            return
        # pyinfra's files.put/template ask a file's checksum only once the file exists: after the run
        # that uploaded it, the next one asks. Recorded now, so that run needs no round trip of its own.
        have = {(e["fact"], json.dumps(e["kwargs"], sort_keys=True)) for e in entries}
        for e in list(entries):
            follow = COMPANIONS.get(e["fact"])
            cls = _resolve(follow) if follow else None
            if cls is None or (follow, json.dumps(e["kwargs"], sort_keys=True)) in have:
                continue
            request = _describe(self, cls, tuple(e["args"]), {**e["kwargs"], **e["connector"]})
            entry = request.persisted() if request is not None else None
            if entry is not None:
                entry["kwargs"] = e["kwargs"]
                entries.append(entry)
        path = self.record_path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(json.dumps({"version": RECORD_VERSION, "host": self.host.name, "facts": entries}, indent=1))
            os.replace(tmp, path)
        except OSError as exc:  # a read-only work dir costs round trips next run, nothing else
            logger.debug("fact record for %s not saved: %s", self.host.name, exc)


def _state_of(host: Host) -> HostFacts:
    facts = getattr(host, "_rigup_facts", None)
    if facts is None:
        facts = HostFacts(host)
        host._rigup_facts = facts  # type: ignore[attr-defined]
    return facts


def remote_commands(host: Host) -> RemoteCommands:
    """What this run sent to `host` so far."""
    return _state_of(host).stats


# ---------------------------------------------------------------------- the reader
_ORIGINAL: dict[str, Any] = {}


def _resolve(cls_path: str) -> type[FactBase] | None:
    module, _, name = cls_path.partition(":")
    try:
        obj: Any = importlib.import_module(module)
        for part in name.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        return None
    return obj if isinstance(obj, type) and issubclass(obj, FactBase) else None


def _describe(facts: HostFacts, cls: type[FactBase], args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Request | None:
    """The command and connector arguments pyinfra would use for this fact (None: it would not run one,
    e.g. a failed precondition; the caller then asks pyinfra directly)."""
    request = _Request(cls, tuple(args), {k: v for k, v in kwargs.items() if not k.startswith("_")})
    facts.capture = True
    try:
        pyinfra_facts._get_fact(facts.host.state, facts.host, cls, list(args), dict(kwargs))
    except _Captured as captured:
        request.command = raw_command(captured.command)
        request.connector = {k: v for k, v in captured.kwargs.items() if k not in ("print_output", "print_input")}
        return request
    except Exception:  # noqa: BLE001 - whatever pyinfra raises, it raises again on the real read
        return None
    finally:
        facts.capture = False
    return None


def _read_single(facts: HostFacts, request: _Request | None, cls: type, args: tuple, kwargs: dict) -> Any:
    facts.reading += 1
    facts.last_ok = True
    try:
        value = pyinfra_facts.get_fact(facts.host.state, facts.host, cls, args=list(args), kwargs=dict(kwargs))
    finally:
        facts.reading -= 1
    if request is not None:
        facts.stats.single_facts += 1
        if facts.last_ok:  # a failed read is read again when asked again, as pyinfra does
            facts.memo[request.key] = copy.deepcopy(value)
    return value


BATCH_LANES = 16  # sections the rig runs at once: they are reads, independent of each other


def _batch_script(token: str, commands: list[str]) -> str:
    """One shell script that runs every command (in BATCH_LANES lanes in the background, each lane its
    share of the sections one after another, so one slow read holds up only its own lane) and then
    prints each one's stdout, stderr and exit status between markers, in order.

    Each section writes its own two files, markers included (shell builtins: a fork costs more than
    most reads), and one `cat` prints them all: a process a read leaves behind can only ever write
    into its own section. Each stream ends with one newline, which _split_batch takes off again."""
    lines = [BATCH_START]
    lanes = min(BATCH_LANES, len(commands))
    for lane in range(lanes):
        lines.append("(")
        for i in range(lane, len(commands), lanes):
            o, e = f'"$__rigup_d/{i}.o"', f'"$__rigup_d/{i}.e"'
            lines.append(f"echo '@@{token} out {i}' >{o}; echo '@@{token} err {i}' >{e}; "
                         f"( {commands[i]}\n) >>{o} 2>>{e} </dev/null; "
                         f'__rigup_s=$?; echo >>{o}; echo >>{e}; echo "@@{token} end {i} $__rigup_s" >>{e}')
        lines.append(") &")
    lines.append("wait")
    files = " ".join(f'"$__rigup_d/{i}.o" "$__rigup_d/{i}.e"' for i in range(len(commands)))
    lines.append(f"cat {files} 2>/dev/null")
    lines.append('rm -rf "$__rigup_d"')
    return "\n".join(lines)


def _split_batch(token: str, lines: Iterable[str], count: int) -> dict[int, tuple[list[str], list[str], int]]:
    sections: dict[int, tuple[list[str], list[str], int]] = {}
    out: list[str] = []
    err: list[str] = []
    current: list[str] | None = None
    prefix = f"@@{token} "
    for line in lines:
        if line.startswith(prefix):
            kind, _, rest = line[len(prefix):].partition(" ")
            if current and current[-1] == "":
                current.pop()  # the newline the script adds after each stream (see _batch_script)
            if kind == "out":
                out, err = [], []
                current = out
            elif kind == "err":
                current = err
            elif kind == "end":
                index, _, rc = rest.partition(" ")
                if index.isdigit() and rc.lstrip("-").isdigit() and int(index) < count:
                    sections[int(index)] = (out, err, int(rc))
                current = None
            continue
        if current is not None:
            current.append(line)
    return sections


def _prefetch(facts: HostFacts) -> None:
    """Read every recorded fact of this host in one command per connector setting.

    The record holds each fact's command as this deploy built it last run: a fact whose command has
    changed since (another rigup, other knobs) is simply not found in the memo and is read on its own.
    How a group's command runs (sudo, user, password) comes from this run: one description per group."""
    groups: dict[str, tuple[dict[str, Any], list[_Request]]] = {}
    for entry in facts.load_record():
        cls = _resolve(str(entry.get("fact", "")))
        command = entry.get("command")
        if cls is None or issubclass(cls, ShortFactBase) or not isinstance(command, str):
            continue
        recorded = entry.get("connector") or {}
        group = json.dumps(recorded, sort_keys=True, default=repr)
        if group not in groups:
            probe = _describe(facts, cls, tuple(entry.get("args") or ()), {**(entry.get("kwargs") or {}), **recorded})
            if probe is None or any(probe.connector.get(k) for k in UNBATCHABLE_ARGS):
                continue
            groups[group] = (probe.connector, [])
        connector, requests = groups[group]
        request = _Request(cls, tuple(entry.get("args") or ()), dict(entry.get("kwargs") or {}), command, connector)
        if request.key not in facts.memo:
            requests.append(request)
    for connector, requests in groups.values():
        unique = list({r.key: r for r in requests}.values())
        if not unique:
            continue
        singles, file_groups = group_file_reads(unique)
        commands = [r.command for r in singles] + [g.command() for g in file_groups]
        token = secrets.token_hex(8)
        facts.reading += 1  # the batch is a fact read: it must not drop what the memo holds
        started = time.monotonic()
        try:
            ok, output = facts.host.run_shell_command(StringCommand(_batch_script(token, commands)),
                                                      print_output=False, print_input=False,
                                                      **{k: v for k, v in connector.items() if k in RUN_ARGS})
        finally:
            facts.reading -= 1
        logger.debug("%s: %d facts in one batch, %.2f s", facts.host.name, len(unique), time.monotonic() - started)
        facts.stats.batches += 1
        if not ok and not output.stdout_lines:
            continue  # nothing came back: each fact is read on its own when asked
        sections = _split_batch(token, output.stdout_lines, len(commands))
        succeeded = set(connector.get("_success_exit_codes") or (0,))
        answers: list[tuple[_Request, list[str]]] = []
        for i, request in enumerate(singles):
            # a failing read is left to the deploy's own request: pyinfra decides what it costs
            if i in sections and sections[i][2] in succeeded:
                answers.append((request, sections[i][0]))
        for i, group in enumerate(file_groups, start=len(singles)):
            outputs = group.outputs(sections[i][0]) if i in sections and sections[i][2] in succeeded else None
            answers.extend(zip(group.requests, outputs or ()))
        for request, out in answers:
            found, value = _value_of(request, out)
            if found:
                facts.memo[request.key] = copy.deepcopy(value)
                facts.stats.batched_facts += 1
        

def _prefetch_and_tell(facts: HostFacts) -> None:
    try:
        _prefetch(facts)
    except Exception as exc:  # noqa: BLE001 - a prefetch that fails leaves every fact to its own read
        logger.debug("fact prefetch on %s failed: %r", facts.host.name, exc)
    finally:
        assert facts.ready is not None
        facts.ready.set()


def _send_early(host: Host) -> None:
    """Send the host's batch now, from a greenlet of its own, and return once the rig runs it: pyinfra
    goes on loading the task files (a few hundred ms of this machine's CPU) while the rig reads.

    Only over pyinfra's SSH connector, whose client says when the command went out; elsewhere the
    first fact request sends the batch, as it always did."""
    facts = _state_of(host)
    client = getattr(host.connector, "client", None)
    if facts.ready is not None or not host.connected or not callable(getattr(client, "exec_command", None)):
        return
    facts.ready = gevent.event.Event()
    started = gevent.event.Event()
    state, config = host.state, ctx_config.get()

    def exec_then_tell(*args: Any, **kwargs: Any) -> Any:
        try:
            return type(client).exec_command(client, *args, **kwargs)
        finally:
            started.set()

    def batch() -> None:
        client.exec_command = exec_then_tell  # this host's client, until the batch has gone out
        try:
            with ctx_state.use(state), ctx_host.use(host), ctx_config.use(config):
                _prefetch_and_tell(facts)
        finally:
            vars(client).pop("exec_command", None)
            started.set()
            facts.ready.set()  # however it ended: no fact request may wait for it forever

    gevent.spawn(batch)
    started.wait(timeout=30)  # a round trip or two; the fact requests wait for the answer itself


def _value_of(request: _Request, out: list[str]) -> tuple[bool, Any]:
    """What pyinfra's fact reader makes of a successful command's stdout (pyinfra.api.facts._get_fact):
    the missing-command sentinel or no output gives the fact's default, else process(); (False, None)
    where processing fails, which fails the host: only the deploy's own request may do that."""
    fact = request.cls()
    try:
        # as pyinfra does: command() first (some facts keep their arguments for process()), then process()
        fact_kwargs = inspect.getcallargs(fact.command, *request.args, **request.kwargs) if (
            request.args or request.kwargs) else {}
        pyinfra_facts._make_command(fact.command, fact_kwargs)
        if out == [pyinfra_facts._MISSING_COMMAND_MARKER] or not out:
            return True, fact.default()
        return True, fact.process(list(out))
    except Exception:  # noqa: BLE001 - FactProcessError and the rest: the deploy's own read reports it
        return False, None


def _active(host: Host) -> bool:
    """Only the runs that asked for it (read_facts_once(state)); other pyinfra states in the process
    keep pyinfra's behaviour."""
    return bool(getattr(host.state, "_rigup_facts_once", False))


def _get_fact(self: Host, name_or_cls: Any, *args: Any, **kwargs: Any) -> Any:
    if not _active(self):
        return _ORIGINAL["get_fact"](self, name_or_cls, *args, **kwargs)
    facts = _state_of(self)
    if isinstance(name_or_cls, type) and issubclass(name_or_cls, ShortFactBase):
        return name_or_cls().process_data(_get_fact(self, name_or_cls.fact, *args, **kwargs))
    if not (isinstance(name_or_cls, type) and issubclass(name_or_cls, FactBase)) or self.state is None:
        return _ORIGINAL["get_fact"](self, name_or_cls, *args, **kwargs)
    if facts.ready is None and self.connected:
        # pyinfra loads the task files of every host in its own greenlet: each host's first request
        # reads its record, all hosts at once (unless read_facts_once sent it already)
        facts.ready = gevent.event.Event()
        _prefetch_and_tell(facts)
    elif facts.ready is not None and not facts.ready.is_set():
        facts.ready.wait()  # the batch is in flight (sent early, or a peer's operation asked meanwhile)
    request = _describe(facts, name_or_cls, args, kwargs)
    if request is None:
        return _read_single(facts, request, name_or_cls, args, kwargs)
    facts.asked.setdefault(request.key, request.persisted())
    while request.key in facts.inflight:
        facts.inflight[request.key].wait()
    if request.key in facts.memo:
        facts.stats.memo_hits += 1
        return copy.deepcopy(facts.memo[request.key])
    facts.inflight[request.key] = done = gevent.event.Event()
    try:
        return _read_single(facts, request, name_or_cls, args, kwargs)
    finally:
        del facts.inflight[request.key]
        done.set()


def _run_shell_command(self: Host, *args: Any, **kwargs: Any) -> Any:
    if not _active(self):
        return _ORIGINAL["run_shell_command"](self, *args, **kwargs)
    facts = _state_of(self)
    if facts.capture:
        raise _Captured(args[0], kwargs)
    if not facts.reading and facts.memo:
        facts.memo.clear()
        facts.stats.invalidations += 1
    facts.stats.commands += 1
    ok, output = _ORIGINAL["run_shell_command"](self, *args, **kwargs)
    facts.last_ok = facts.last_ok and bool(ok)
    return ok, output


def _transfer(kind: str):
    def transfer(self: Host, *args: Any, **kwargs: Any) -> Any:
        if not _active(self):
            return _ORIGINAL[kind](self, *args, **kwargs)
        facts = _state_of(self)
        if facts.memo:
            facts.memo.clear()
            facts.stats.invalidations += 1
        setattr(facts.stats, kind, getattr(facts.stats, kind) + 1)
        return _ORIGINAL[kind](self, *args, **kwargs)

    return transfer


class _SaveRecords(BaseStateCallback):
    """Save each host's record when pyinfra disconnects from it (the end of the run)."""

    @staticmethod
    def host_disconnect(state: Any, host: Host) -> None:
        _state_of(host).save_record()


def read_facts_once(state: Any) -> None:
    """Install the memo and the prefetch for this pyinfra run (idempotent; the deploy's first task calls
    it). Called while a host's task files load (pyinfra's host context set), that host's batch is
    sent at once (_send_early) instead of at its first fact request."""
    if not _ORIGINAL:
        _ORIGINAL.update(get_fact=Host.get_fact, run_shell_command=Host.run_shell_command,
                         uploads=Host.put_file, downloads=Host.get_file)
        Host.get_fact = _get_fact  # type: ignore[method-assign]
        Host.run_shell_command = _run_shell_command  # type: ignore[method-assign]
        Host.put_file = _transfer("uploads")  # type: ignore[method-assign]
        Host.get_file = _transfer("downloads")  # type: ignore[method-assign]
    if not getattr(state, "_rigup_facts_once", False):
        state._rigup_facts_once = True
        state.add_callback_handler(_SaveRecords())
    loading = ctx_host.get()
    current = getattr(state, "_get_module", lambda: state)()  # `from pyinfra import state` is a proxy
    if loading is not None and loading.state is current:
        _send_early(loading)
