"""The health gate of a cluster (rigup.desired.cluster): its members pass as one unit or roll back as one.

A pod's gate records its release or rolls it back on its own host. A cluster's members cannot: the head
answers only once every rank has joined, so a worker's release is proven by the head's gate, and a
member rolled back alone would leave the others on a generation that no longer matches it. So every
member that (re)started in this run gates in two operations, each running on all of them at once
(pyinfra runs an operation on every host before the next one starts):

1. `cluster_member_gate`: the head runs `rigup-servingctl gate --hold` (wait for the whole cluster,
   record nothing, roll nothing back); a worker whose head gates in this run waits for the head's result
   instead of asking the same question again; a worker whose head did not restart asks the head itself.
   Each result is kept for this run (rigup.runstate.cluster_gates).
2. `cluster_gate_verdict`: when every gated member passed and no member failed earlier in the run, each
   runs the ordinary gate, which passes at once and records its generation. Otherwise each runs
   `rigup-servingctl rollback` at the same time (restore, restart and gate the last good generation:
   the head's Ray and vLLM come back with workers on the same generation) and fails its host, naming
   the member whose gate failed and why.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import gevent
from pyinfra import logger
from pyinfra.api import QuoteString, operation
from pyinfra.connectors.util import CommandOutput

from rigup.operations.live_output import StreamedCommand
from rigup.operations.preflight import fail_host_with_reasons
from rigup.operations.serving import account_gate, check_gate_args, gate_command
from rigup.runstate import account, cluster_gates

GATE_FAILED = "health gate FAILED for "  # servingctl's failure line (rigup.rig.servingctl._print_failure)
FOLLOW_POLL_S = 1.0

def _run(state: Any) -> tuple[dict[str, dict[str, str | None]], dict[str, dict[str, Callable[[], bool]]]]:
    gates = cluster_gates(state)  # per run, in rigup.runstate
    return gates.results, gates.gating


def _state_of(target: Any) -> Any:
    getter = getattr(target, "_get_module", None)  # pyinfra's `host` is a context proxy
    real = getter() if callable(getter) else target
    return real.state


def member_gates_when(target: Any, cluster: str, when: Callable[[], bool]) -> Callable[[], bool]:
    """Record, while the deploy is planned, when member `target` gates (execute time: its service
    restarted, or its driver changed), so that its peers know whether to wait for it; returns `when`."""
    _run(_state_of(target))[1].setdefault(cluster, {})[target.name] = when
    return when


def failure_reason(output: Any) -> str:
    """servingctl's one-line reason from a failed gate's output (its "health gate FAILED" line)."""
    for line in getattr(output, "output_lines", output or []):
        if GATE_FAILED in line:
            return line.split(": ", 2)[-1] if line.count(": ") >= 2 else line
    return "the gate failed (no reason printed)"


def _failed_earlier(state: Any, members: Sequence[str], skip: str) -> dict[str, str]:
    """Members that failed earlier in this run (an image pull, a file write): their release is not serving."""
    failed = {getattr(h, "name", h) for h in getattr(state, "failed_hosts", ())}
    return {m: "failed earlier in this run" for m in members if m != skip and m in failed}


class _HeldGate(StreamedCommand):
    """`rigup-servingctl gate --hold`, or, on a worker whose head gates in this run, the head's result."""

    cluster: str = ""
    head: str = ""
    members: tuple[str, ...] = ()
    follow_timeout_s: float = 0.0

    def execute(self, state: Any, host: Any, connector_arguments: Any) -> Any:
        results, gating = _run(state)
        mine = results.setdefault(self.cluster, {})
        head_gates = gating.get(self.cluster, {}).get(self.head)
        if host.name != self.head and head_gates is not None and _safely(head_gates):
            deadline = time.monotonic() + self.follow_timeout_s
            while self.head not in mine and time.monotonic() < deadline:
                if _failed_earlier(state, [self.head], host.name):
                    break
                gevent.sleep(FOLLOW_POLL_S)
            if self.head in mine:  # the head's gate ended: whole-cluster proof either way
                said = mine[self.head]
                mine[host.name] = None if said is None else f"the head ({self.head}) failed its gate"
                verdict = "passed" if said is None else "FAILED"
                host.log_styled(f"cluster {self.cluster}: the head's gate {verdict}", log_func=logger.info)
                account(host, f"cluster gate: the head's {verdict}")
                return True, CommandOutput([])
            # the head failed earlier, or runs later (pyinfra's --serial): ask the head ourselves
        ok, output = super().execute(state, host, connector_arguments)
        mine[host.name] = None if ok else failure_reason(output)
        return True, output  # the verdict decides, once every member's gate has ended


def _safely(when: Callable[[], bool]) -> bool:
    try:
        return bool(when())
    except Exception:  # an operation that has not run (pyinfra's --no-wait): not known to gate
        return False


class _Verdict(StreamedCommand):
    """The ordinary gate when the whole cluster passed; otherwise `rigup-servingctl rollback` and a failure."""

    cluster: str = ""
    members: tuple[str, ...] = ()
    rollback_bits: tuple[Any, ...] = ()

    def execute(self, state: Any, host: Any, connector_arguments: Any) -> Any:
        results, _ = _run(state)
        said = results.get(self.cluster, {})
        failed = {m: r for m, r in said.items() if r is not None}
        failed.update(_failed_earlier(state, self.members, host.name))
        if not failed:
            return super().execute(state, host, connector_arguments)
        why = "; ".join(f"{m}: {r}" for m, r in failed.items())
        reason = f"cluster {self.cluster} rolls back as one: {why}"
        back = StreamedCommand(*self.rollback_bits, QuoteString(reason), _separator=self.separator,
                               **self.connector_arguments)
        back.on_done = _rolled_back
        ok, output = back.execute(state, host, connector_arguments)
        outcome = ("rolled back to its last good generation" if _marker(output) == "failed-and-rolled-back"
                   else "NOT rolled back: " + (_last_rigup_line(output) or "see the output above"))
        fail_host_with_reasons(state, host, f"cluster {self.cluster}: the health gate failed; this member {outcome}",
                               [f"{m}: {r}" for m, r in failed.items()])
        return False, output


def _marker(output: Any) -> str | None:
    for line in reversed(getattr(output, "output_lines", [])):
        if line.startswith("RIGUP-GATE-RESULT: "):
            return line.split(": ", 1)[1].strip()
    return None


def _last_rigup_line(output: Any) -> str | None:
    lines = [line for line in getattr(output, "output_lines", []) if line.startswith("rigup: ")]
    return lines[-1][len("rigup: "):] if lines else None


def _rolled_back(host: Any, ok: bool, output: Any, seconds: float) -> None:
    account(host, f"cluster rolled back in {seconds:.0f} s" if _marker(output) == "failed-and-rolled-back"
            else f"cluster rollback FAILED after {seconds:.0f} s")


def _held(host: Any, ok: bool, output: Any, seconds: float) -> None:
    account(host, f"cluster gate passed in {seconds:.0f} s" if ok else f"cluster gate FAILED after {seconds:.0f} s")


@operation(is_idempotent=False, idempotent_notice="Gate it with _if on the operations that restart the service.")
def cluster_member_gate(ctl: str, release: str, timeout_s: int, cluster: str, head: str, members: Sequence[str]):
    """
    Wait until the cluster serves, for one member: the first half of a cluster's gate (module docstring).
    Records nothing and never fails the host: ``cluster_gate_verdict`` does, on every member at once.

    + ctl: path of rigup-servingctl on the rig
    + release: the member's release.json on the rig
    + timeout_s: seconds to wait for ``/v1/models`` (the head's) to list the served model
    + cluster: the cluster's name
    + head: the member that publishes the API
    + members: every member, the head first
    """
    check_gate_args(timeout_s, 1)
    base = gate_command(ctl, release, timeout_s, 1, rollback=False)
    command = _HeldGate(*base.bits, "--hold", _separator=base.separator, **base.connector_arguments)
    command.on_done = _held
    command.cluster, command.head, command.members = cluster, head, tuple(members)
    command.follow_timeout_s = timeout_s + 60  # the head's own budget, and its journal read
    yield command


@operation(is_idempotent=False, idempotent_notice="Gate it with _if on the operations that restart the service.")
def cluster_gate_verdict(ctl: str, release: str, timeout_s: int, keep: int, cluster: str, members: Sequence[str]):
    """
    The second half of a cluster's gate (module docstring): record this member's generation when every
    member passed, else roll it back with the others and fail the host saying which member failed and why.

    + ctl: path of rigup-servingctl on the rig
    + release: the member's release.json on the rig
    + timeout_s: seconds the gate (or the restored generation's gate) waits for the served model
    + keep: generations to keep for rollback
    + cluster: the cluster's name
    + members: every member, the head first
    """
    check_gate_args(timeout_s, keep)
    base = gate_command(ctl, release, timeout_s, keep, rollback=True)
    command = _Verdict(*base.bits, _separator=base.separator, **base.connector_arguments)
    command.on_done = account_gate
    command.cluster, command.members = cluster, tuple(members)
    command.rollback_bits = ("python3", QuoteString(ctl), "rollback", "--release", QuoteString(release),
                             "--timeout", str(int(timeout_s)), "--reason")
    yield command


__all__ = ["cluster_gate_verdict", "cluster_member_gate", "failure_reason", "member_gates_when"]
