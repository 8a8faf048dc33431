"""Task files build their plans while pyinfra loads them; a plan that cannot be built stops the run here."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from pyinfra.api.exceptions import DeployError

from rigup.desired.lock import LockError
from rigup.desired.models import ModelPlan, plan_models
from rigup.desired.plan import host_plans
from rigup.desired.recipe import RecipeError
from rigup.runstate import pins_missing


@contextmanager
def stop_the_run_on(host: Any, *errors: type[Exception]) -> Iterator[None]:
    """Turn one of `errors` raised inside into pyinfra's DeployError naming the host: pyinfra ends the
    whole run with that one line, no traceback, before any operation of the task runs."""
    try:
        yield
    except errors as exc:
        raise DeployError(f"{host.name}: {exc}") from None


def model_plan_or_stop(state: Any, host: Any) -> ModelPlan | None:
    """The host's model plan (rigup.desired.models.plan_models). None when the lock lacks its pins: a
    --dry run then warns once and the model phase plans nothing (rigup.runstate.pins_missing; a real run
    has stopped at sources already). Any other problem stops the run naming the host: a pod's recipe
    (preflight reports it first in a whole deploy) or a lock problem that is not about missing pins
    (e.g. a bad model_fleet_source)."""
    try:
        with stop_the_run_on(host, RecipeError):
            return plan_models(state, host)
    except LockError as exc:
        previews = host_plans(host.data.dict(), host.name, read_secrets=False, require_lock=False)
        if not any(pins_missing(host, "model", preview) for preview in previews):
            raise DeployError(str(exc)) from None
        return None
