"""A small harness for rigup's custom operations: scripted facts in, commands (or noop text) out.

Same idea as pyinfra_testing (which calls `op._inner` with mocked facts), without its wrapper for
argument-less facts: a scripted fact value comes back exactly as given.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from pyinfra.api import Config, FunctionCommand, StringCommand
from pyinfra.context import ContextManager, ctx_host, ctx_state


@contextmanager
def using(context: ContextManager, module: Any) -> Iterator[None]:
    """pyinfra's `context.use(module)` that puts the old value back when the block raises too: pyinfra's own
    (3.10.0) restores it only on a normal exit, so a test whose operation raised left its scripted host as
    pyinfra's current host for every later test in the same process."""
    old = context.get()
    context.set(module)
    try:
        yield
    finally:
        context.set(old)


@contextmanager
def scripted(host: Any, executing: bool) -> Iterator[None]:
    """`host` as pyinfra's current host, in a ScriptedState that is executing or planning."""
    with using(ctx_host, host), using(ctx_state, ScriptedState(executing)):
        yield


class ScriptedData:
    def __init__(self, values: Mapping[str, Any]):
        self._values = dict(values)

    def get(self, key: str, default: Any = None) -> Any:
        return self._values.get(key, default)

    def dict(self) -> dict[str, Any]:
        return dict(self._values)

    def __getattr__(self, key: str) -> Any:
        try:
            return self._values[key]
        except KeyError as exc:
            raise AttributeError(key) from exc


@dataclass
class ScriptedHost:
    """Stands in for pyinfra's Host. `facts` maps a fact class to its value, or to a function of
    the fact's keyword arguments; a fact nobody scripted is a test error."""

    facts: dict[type, Any]
    data: Any = None
    name: str = "rig-test"
    noops: list[str] = field(default_factory=list)
    logs: list[str] = field(default_factory=list)
    fact_calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    current_op_global_arguments: dict[str, Any] | None = None  # read by built-in ops used via _inner

    def __post_init__(self) -> None:
        if not isinstance(self.data, ScriptedData):
            self.data = ScriptedData(self.data or {})

    def get_fact(self, cls: type, **kwargs: Any) -> Any:
        self.fact_calls.append((cls.__name__, kwargs))
        if cls not in self.facts:
            raise AssertionError(f"fact {cls.__name__}({kwargs}) was not scripted")
        value = self.facts[cls]
        return value(**kwargs) if callable(value) and not isinstance(value, type) else value

    def get_temp_filename(self, hash_key: str | None = None, *_: Any, **__: Any) -> str:
        """Deterministic, like pyinfra's (a hash of the key) but without a host connection."""
        import hashlib

        return f"/tmp/pyinfra-{hashlib.sha1(str(hash_key).encode()).hexdigest()}"

    def noop(self, description: str) -> None:
        self.noops.append(description)

    def log_styled(self, message: str, **_: Any) -> None:
        self.logs.append(message)

    def log(self, message: str, **_: Any) -> None:
        self.logs.append(message)


@dataclass
class ScriptedState:
    is_executing: bool = True
    config: Any = field(default_factory=Config)


def render(command: Any) -> Any:
    if isinstance(command, StringCommand):
        return command.get_raw_value()
    if isinstance(command, FunctionCommand):
        return ("function", command.function.__name__)
    return repr(command)


def run_op(op: Callable[..., Any], host: ScriptedHost, executing: bool = True, **kwargs: Any) -> list[Any]:
    """The commands `op` yields for `host` (rendered); noop texts land in host.noops."""
    return [render(c) for c in raw_commands(op, host, executing, **kwargs)]


def raw_commands(op: Callable[..., Any], host: ScriptedHost, executing: bool = True, **kwargs: Any) -> list[Any]:
    with scripted(host, executing):
        return list(op._inner(**kwargs))  # type: ignore[attr-defined]


def call_function(command: FunctionCommand, host: ScriptedHost) -> Any:
    """Run a FunctionCommand through pyinfra's own FunctionCommand.execute: functions whose
    parameters are named (state, host) get both and their return value is the status."""
    with scripted(host, True):
        return command.execute(ScriptedState(True), host, {})  # type: ignore[arg-type]


@dataclass
class Judged:
    """What rigup.operations.preflight.preflight_gate did for a host while the deploy was planned."""

    passed: bool
    reported: dict[str, Any]  # the arguments of the preflight_checks operation it added
    failed_now: list[Any]  # the hosts it failed during planning


def judge_preflight(host: ScriptedHost, monkeypatch: Any) -> Judged:
    """preflight_gate on `host`, planning time (is_executing False), with the operation it adds and the
    host failure it makes recorded instead of handed to a pyinfra state."""
    from rigup.operations import preflight as preflight_ops  # the module whose names are replaced here

    reported: dict[str, Any] = {}
    failed: list[Any] = []
    monkeypatch.setattr(preflight_ops, "preflight_checks", lambda name, **kwargs: reported.update(kwargs))
    monkeypatch.setattr(preflight_ops, "fail_host_while_planning",
                        lambda state, target: failed.append(target._get_module()))  # the host behind pyinfra's proxy
    monkeypatch.setattr(preflight_ops, "record_preflight", lambda target, passed: None)
    with scripted(host, False):
        passed = preflight_ops.preflight_gate(name="Run preflight checks")
    return Judged(passed, reported, failed)
