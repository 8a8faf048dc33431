"""Every change rigup makes to pyinfra's own behaviour, in one place, for the pinned pyinfra only.

deploy.py calls `enable_pyinfra_patches(state)` first. It refuses any pyinfra other than
PINNED_PYINFRA (the patches replace functions and call private ones whose shape other versions do
not promise) and installs:

1. **Facts read once, in one round trip** (fact_batching.py). Replaces `Host.get_fact`,
   `Host.run_shell_command`, `Host.put_file` and `Host.get_file` with wrappers that keep a fact's
   value until something else runs on the host (greenlets asking one fact at once share one read), and
   read the facts the previous run asked for in one batched command. While a host's batch goes out, its SSH client's `exec_command` is wrapped on that
   instance to learn when the command left. It calls the private `pyinfra.api.facts._get_fact` (to
   learn the command a fact would run), `_make_command` and `_MISSING_COMMAND_MARKER`.
   *Upstream would need:* a fact cache with invalidation on any non-fact command (pyinfra 3 removed
   the 2.x cache), and a hook to read several facts in one command (e.g. `FactBase.command` exposed
   with its connector arguments plus a `get_facts([...])` API). A fact-batching hook is a
   contribution pyinfra's maintainers may want: rigup measured 103 -> 2 remote commands per converged rig.
2. **Operation order without source reads** (call_order.py). Replaces `pyinfra.api.util.stack` and
   `getframeinfo` with context-free frame reads, and caches `all_global_arguments()`.
   *Upstream would need:* `get_operation_order_from_stack` calling `inspect.stack(context=0)`, and
   `all_global_arguments` computed once (both are pure speed-ups with the same result).
3. **Failing a host while the deploy is planned** (`fail_host_while_planning`). pyinfra fails a host
   during planning only from a failed fact read, through `State.fail_hosts`, which raises "No hosts
   remaining!" when it was the last one and so ends a `--dry` run before it prints anything else.
   *Upstream would need:* a public "fail this host now" for deploy code that lets the CLI go on to
   print its plan and exit 1.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any

from pyinfra.api.exceptions import PyinfraError

from rigup.pyinfra_patches.call_order import lean_call_order
from rigup.pyinfra_patches.fact_batching import read_facts_once

PINNED_PYINFRA = "3.10.0"  # pyproject.toml pins the same version


class PyinfraVersionError(PyinfraError):
    """The installed pyinfra is not the one rigup's patches are written for."""


def installed_pyinfra() -> str:
    try:
        return version("pyinfra")
    except PackageNotFoundError:
        return "unknown"


def require_pinned_pyinfra(found: str | None = None) -> None:
    """Raise PyinfraVersionError, saying what to install, unless pyinfra is PINNED_PYINFRA."""
    found = installed_pyinfra() if found is None else found
    if found != PINNED_PYINFRA:
        raise PyinfraVersionError(
            f"rigup needs pyinfra {PINNED_PYINFRA} (rigup/pyinfra_patches changes its internals), found {found}: "
            f"pip install 'pyinfra=={PINNED_PYINFRA}' (or pip install -e . in the rigup checkout)"
        )


def enable_pyinfra_patches(state: Any) -> None:
    """Check the pyinfra version and install patches 1 and 2 for this run (idempotent; call it from the
    deploy file before any fact is read: while a host's deploy file loads, its batch goes out at once)."""
    require_pinned_pyinfra()
    read_facts_once(state)
    lean_call_order()


def fail_host_while_planning(state: Any, host: Any) -> None:
    """Fail `host` now, as pyinfra fails a host whose fact read failed (State.fail_hosts): nothing more
    runs on it and the CLI exits 1. When it was the last host, pyinfra's "No hosts remaining!" is not
    raised, so a --dry run still prints its plan for the hosts before it and the run ends on the
    host's own reason; a FAIL_PERCENT overrun is raised as pyinfra raises it."""
    real_host = host._get_module() if callable(getattr(host, "_get_module", None)) else host  # `host` may be a context proxy
    try:
        state.fail_hosts({real_host})
    except PyinfraError:
        if state.active_hosts:
            raise
