"""One host's plan: the recipe every phase builds (lock pins + the interconnect of the GPUs it uses)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # rigup.desired.recipe imports this module
    from rigup.desired.recipe import Lock, Recipe
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only for hints: the functions below import rigup.desired.recipe lazily
    from rigup.desired.recipe import Recipe
    from rigup.parsers.topology import Topology
from rigup.desired.interconnect import detect
from rigup.desired.lock import LockError, LockFile, deploy_lock, lock_problems
from rigup.parsers.topology import Topology


def resolve_for_host(host_data: Mapping[str, Any], topo: Topology | None, lock: Lock | None = None) -> Recipe:
    """rigup.desired.recipe.resolve with the interconnect detected among the GPUs the variant uses.

    The one way to build a host's recipe wherever files are rendered or compared (serving task,
    status, doctor, `rigup render --topo`), so they agree. topo None: nothing detected (no driver
    yet), the gpu_interconnect knob alone decides.
    """
    from rigup.desired.recipe import resolve

    recipe = resolve(host_data, lock)
    if topo is None or recipe.gpu_count < 2:
        return recipe
    return resolve(host_data, lock, detect(topo, recipe.gpu_count))


def locked_recipe(
    host_data: Mapping[str, Any],
    host_name: str = "this host",
    base_dir: Path | None = None,
    topology: Topology | None = None,
) -> tuple[Recipe, LockFile]:
    """(recipe, lock) for a host: THE way every phase (preflight, serving, status, doctor) builds a
    host's recipe, so they all render and compare the same thing.

    + host_data: the host's knobs
    + host_name: for the error message
    + base_dir: directory a relative lock_file is read from (default: the fleet file's)
    + topology: rigup.parsers.topology.Topology read on the host (fact rigup.facts.gpu.GpuTopology); None
      when nothing was detected (no driver yet): the gpu_interconnect knob alone decides the NCCL settings

    Raises LockError when the lock file is missing or an entry the variant needs is missing or stale.
    """
    from rigup.desired.plan import resolve_for_host

    lock = deploy_lock(host_data, base_dir)
    recipe = resolve_for_host(host_data, topology, lock)
    problems = lock_problems(recipe, host_data, lock)
    if problems:
        raise LockError(
            f"{lock.path}: missing or stale entries for {host_name} (variant {recipe.variant}): "
            + "; ".join(problems)
            + ". Run `python -m rigup lock` (it adds missing entries and keeps the others) and commit the file."
        )
    return recipe, lock

