"""Task files build their plans while pyinfra loads them; a plan that cannot be built stops the run here."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from pyinfra import logger
from pyinfra.api.exceptions import DeployError

from rigup.desired.dashboards import DashboardError, VllmDashboard, served_vllm_refs, vllm_dashboards
from rigup.desired.knobs import knob
from rigup.desired.lock import LOCK_COMMAND, LockError, deploy_lock, need_problem
from rigup.desired.models import ModelPlan
from rigup.desired.monitoring import RigExporters, rig_exporters
from rigup.desired.needs import dashboard_needs, exporter_needs
from rigup.desired.recipe import RecipeError
from rigup.desired.upstream import UpstreamError, default_reader
from rigup.runstate import fleet_plan, pins_missing, pyinfra_dry_run


@contextmanager
def stop_the_run_on(host: Any, *errors: type[Exception]) -> Iterator[None]:
    """Turn one of `errors` raised inside into pyinfra's DeployError naming the host: pyinfra ends the
    whole run with that one line, no traceback, before any operation of the task runs."""
    try:
        yield
    except errors as exc:
        raise DeployError(f"{host.name}: {exc}") from None


def model_plan_or_stop(state: Any, host: Any) -> ModelPlan | None:
    """The host's model plan (the run's FleetPlan: rigup.desired.models.plan_models). None when the lock lacks its pins: a
    --dry run then warns once and the model phase plans nothing (rigup.runstate.pins_missing; a real run
    has stopped at sources already). Any other problem stops the run naming the host: a pod's recipe
    (preflight reports it first in a whole deploy) or a lock problem that is not about missing pins
    (e.g. a bad model_fleet_source)."""
    try:
        with stop_the_run_on(host, RecipeError):
            return fleet_plan(state).host(host.name).models
    except LockError as exc:
        previews = fleet_plan(state).host(host.name).pods
        if not any(pins_missing(host, "model", preview) for preview in previews):
            raise DeployError(str(exc)) from None
        return None


def rig_exporters_or_stop(host: Any) -> RigExporters | None:
    """The rig's exporters (rigup.desired.monitoring.rig_exporters), the GPU exporter's image pinned by
    the lock. None when the host runs none, or when the lock lacks that pin on a --dry run (one warning;
    the metrics phase plans nothing); a real run stops with the same line."""
    data = host.data.dict()
    problem = None
    try:
        lock = deploy_lock(data)
    except LockError as exc:
        lock, problem = None, str(exc)
    exporters = rig_exporters(data, lock)
    if exporters is None:
        return None
    if lock is not None:
        problem = next((p for p in (need_problem(n, lock) for n in exporter_needs(data)) if p is not None), None)
    if problem is None:
        return exporters
    message = (f"the GPU exporter's image is not pinned ({problem}); run `{LOCK_COMMAND}` on the control "
               "machine and commit the file")
    if not pyinfra_dry_run():
        raise DeployError(f"{host.name}: {message}")
    logger.warning(f"{host.print_prefix}{message}; the metrics phase plans nothing here")
    return None


def vllm_dashboards_or_stop(host: Any, fleet: Any) -> tuple[list[VllmDashboard], list[str]]:
    """A Grafana monitor host's vLLM dashboards (rigup.desired.dashboards.vllm_dashboards) at the
    commits the lock pins for the vLLM versions the fleet serves, and notes on pods without one. Without
    those pins a --dry run warns once and provisions none; a real run stops with the same line, as it
    does when the repository cannot be read or a file is not a dashboard."""
    data = host.data.dict()
    needs = dashboard_needs(data, host.groups, fleet)
    if not needs:
        return [], []
    problem = None
    try:
        lock = deploy_lock(data)
        problem = next((p for p in (need_problem(n, lock) for n in needs) if p is not None), None)
    except LockError as exc:
        problem = str(exc)
    if problem is not None:
        message = (f"vLLM's dashboards are not pinned ({problem}); run `{LOCK_COMMAND}` on the control "
                   "machine and commit the file")
        if not pyinfra_dry_run():
            raise DeployError(f"{host.name}: {message}")
        logger.warning(f"{host.print_prefix}{message}; no vLLM dashboards are planned")
        return [], []
    refs, notes = served_vllm_refs(fleet)
    commits = {ref: str(lock.git_commit(need.name)) for need in needs for ref in refs if need.ref == ref}
    with stop_the_run_on(host, UpstreamError, DashboardError):
        dashboards, missing = vllm_dashboards(commits, default_reader(), str(knob(data, "vllm_git_url")),
                                              str(knob(data, "vllm_dashboards_path")))
    return dashboards, notes + missing
