"""The serving task's plans of a host's pods, and the file writes that take their text from them when they run.

The interconnect plan (NCCL, custom all-reduce, NVLINK_MODE) comes from the GPU topology `nvidia-smi topo`
reports. On a fresh rig there is no driver while the deploy is planned, so the topology is unknown then;
the driver task installs it before the serving task's operations run. pyinfra runs an operation's body
again when it executes, so the files the serving task writes take their text from `PodPlans.now()`: the
plans made while planning, or, where the topology was unknown then, the plans made again with the topology
read when the first file is written. The first converge of a fresh rig writes what every later converge
plans, and the second changes nothing (issue 41: a fresh cluster restarted on its second converge for
NVLINK_MODE=auto becoming force_off).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from io import StringIO
from typing import Any

from pyinfra import state
from pyinfra.api import OperationError, operation
from pyinfra.operations import files

from rigup.desired.lock import LockError
from rigup.desired.plan import HostPlan, host_plans
from rigup.desired.recipe import RecipeError
from rigup.desired.secrets import SecretError
from rigup.facts.gpu import GpuTopology
from rigup.parsers.topology import Topology


class PodPlans:
    """rigup.desired.plan.host_plans for one host, with the GPU topology known when its files are written.

    + host: pyinfra's host (the topology is read from it again at execute time)
    + data: the host data the plans are made from (tasks/serving.py: cluster_host_data)
    + topology: GpuTopology as read while the deploy is planned (None: no driver yet)
    + options: host_plans' keyword arguments (require_lock, ...)
    """

    def __init__(self, host: Any, data: Mapping[str, Any], topology: Topology | None, **options: Any):
        self.host = host
        self.data = dict(data)
        self.options = options
        self.planned_topology = topology
        self.planned: list[HostPlan] = host_plans(self.data, host.name, topology, **options)
        self._executed: list[HostPlan] | None = None

    def now(self) -> list[HostPlan]:
        """The plans as planned; while the deploy executes, when the topology was unknown at planning, the
        plans made once more with the topology read now (the driver task ran in between). A topology read
        at planning is kept: GPUs and their links do not change while a run executes, and reading it again
        would cost every converged rig a remote command."""
        if self.planned_topology is not None or not state.is_executing:
            return self.planned
        if self._executed is None:
            topology = self.host.get_fact(GpuTopology)
            if topology is None:  # still no driver (it failed, or waits for a reboot): the knob decided already
                self._executed = self.planned
            else:
                try:
                    self._executed = host_plans(self.data, self.host.name, topology, **self.options)
                except (LockError, RecipeError, SecretError, ValueError) as exc:
                    raise OperationError(f"{self.host.name}: planning the pods with the GPU topology read now: {exc}") from exc
        return self._executed

    def secret(self, index: int, name: str) -> Callable[[], str]:
        """The text of pod `index`'s secret file `name` when asked (never planned into pyinfra's output)."""
        return lambda: self.now()[index].secret_text(name)

    def text(self, index: int, which: str) -> Callable[[], str]:
        """The text of pod `index`'s file `which` ("compose", "env", "unit" or "release") when asked."""
        getters: dict[str, Callable[[HostPlan], str]] = {
            "compose": lambda plan: plan.compose.content,
            "env": lambda plan: plan.env.content,
            "unit": lambda plan: plan.unit.content,
            "release": lambda plan: plan.release_text,
        }
        if which not in getters:
            raise ValueError(f"no file {which!r} in a pod's plan; one of {', '.join(getters)}")
        get = getters[which]
        return lambda: get(self.now()[index])


@operation()
def text_file(dest: str, text: Callable[[], str], mode: str = "644"):
    """
    Write a file whose text is decided when the operation runs (pyinfra's ``files.put`` of it).

    + dest: the file on the rig
    + text: called when the operation is planned and again when it executes (PodPlans.text)
    + mode: octal mode

    **Example:**

    .. code:: python

        text_file(
            name="Write the compose file",
            dest="/opt/rigup/variants/dual/compose.yaml",
            text=pod_plans.text(0, "compose"),
        )
    """
    yield from files.put._inner(src=StringIO(text()), dest=dest, mode=mode)  # type: ignore[attr-defined]

