"""One host's plan: everything the control machine decides for a host, built in one place.

`host_plan(host_data, host_name, topology)` gives a HostPlan: the recipe (catalog entry + knobs +
overrides, with the lock's pins and the interconnect of the GPUs the variant uses), the lock, the
files the rig runs it from (compose file, .env, unit) and the release document those files and pins
make. The serving, sources and model tasks, preflight, doctor, status, render, verify, bench and
rollout read it; nothing else builds a recipe from host data (the lock tool resolves the catalog's
refs before there are pins: rigup.desired.pins).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rigup.desired.cluster_token import RAY_TOKEN_KEY, cluster_token
from rigup.desired.interconnect import detect
from rigup.desired.knobs import knob
from rigup.desired.lock import LOCK_COMMAND, LockError, LockFile, deploy_lock
from rigup.desired.needs import lock_problems
from rigup.desired.pod_keys import key_owner, pod_api_key
from rigup.desired.pods import Pod
from rigup.desired.recipe import Recipe, pods_of, resolve
from rigup.desired.release import build_release, release_json, release_sha256
from rigup.desired.render import (
    API_KEY_KEY,
    HF_TOKEN_KEY,
    RenderedFile,
    render_variant,
    secret_file,
    secret_names,
    secret_text,
)
from rigup.desired.secrets import read_hf_token, secrets_configured
from rigup.parsers.topology import Topology


@dataclass(frozen=True)
class HostPlan:
    """What one host should run, as decided on the control machine."""

    host: str
    recipe: Recipe
    lock: LockFile | None  # None: no usable lock (lock_problem says why); only previews accept that
    rendered: Mapping[str, RenderedFile]  # rig path without the leading "/" -> file
    release: Mapping[str, Any] | None  # release.json; None without a usable lock
    lock_problem: str | None = None
    secret_names: tuple[str, ...] = ()  # the secrets the pod carries (rigup.desired.render.secret_names)
    secrets: Mapping[str, str] = field(default_factory=dict, repr=False)  # name -> value: only ever a 0600 file

    def file(self, rig_path: str) -> RenderedFile:
        return self.rendered[rig_path.lstrip("/")]

    @property
    def compose(self) -> RenderedFile:
        return self.file(self.recipe.paths.compose_file)

    @property
    def env(self) -> RenderedFile:
        return self.file(self.recipe.paths.env_file)

    @property
    def unit(self) -> RenderedFile:
        return self.file(self.recipe.paths.unit_file)

    @property
    def pod_suffix(self) -> str:
        """What operation names end with for a listed pod (" [pod right]"); "" in the simple form."""
        return f" [pod {self.recipe.pod}]" if self.recipe.pod_listed else ""

    @property
    def secret_files(self) -> dict[str, str]:
        """Secret name -> its file on the rig ({secrets_dir}/NAME), for every secret the pod carries."""
        return {name: secret_file(self.recipe, name) for name in self.secret_names}

    def secret_text(self, name: str) -> str:
        """Secret `name`'s file text (read_secrets plans only); refuses a value that is not one line."""
        if name not in self.secret_names or name not in self.secrets:
            raise ValueError(f"{self.host}: pod {self.recipe.pod} carries no secret {name} in this plan")
        return secret_text(name, self.secrets[name])

    @property
    def release_text(self) -> str:
        if self.release is None:
            raise LockError(self.lock_problem or f"{self.host}: no release without a lock")
        return release_json(self.release)

    @property
    def release_sha256(self) -> str:
        """What rigup-servingctl records as release_sha256: the hash of release.json's text."""
        if self.release is None:
            raise LockError(self.lock_problem or f"{self.host}: no release without a lock")
        return release_sha256(self.release)


def recipe_for(host_data: Mapping[str, Any], topology: Topology | None, lock: LockFile | None = None,
               pod: Pod | None = None) -> Recipe:
    """rigup.desired.recipe.resolve with the interconnect detected among the GPUs the pod uses.
    topology None: nothing detected (no driver yet), the gpu_interconnect knob alone decides."""
    recipe = resolve(host_data, lock, None, pod=pod)
    if topology is None or recipe.gpu_count < 2:
        return recipe
    return resolve(host_data, lock, detect(topology, recipe.gpu_count, recipe.gpu_ids), pod=pod)


def host_plan(
    host_data: Mapping[str, Any],
    host_name: str = "this host",
    topology: Topology | None = None,
    *,
    base_dir: Path | None = None,
    lock: LockFile | None = None,
    require_lock: bool = True,
    read_secrets: bool = True,
    pod: Pod | None = None,
) -> HostPlan:
    """The plan for one pod of a host (its only one by default: see host_plans for a host that lists pods).

    + host_data: the host's knobs (group_data/all.py defaults included)
    + host_name: for messages
    + topology: GPU topology read on the host (fact rigup.facts.gpu.GpuTopology); None when unknown
    + base_dir: directory a relative lock_file is read from (default: the fleet file's)
    + lock: a lock file already loaded (`rigup render --lock`); default: the host's lock_file knob
    + require_lock: raise LockError when the lock is missing or lacks an entry the variant needs;
      False: a preview (preflight, doctor, render, fleet targets): the pins the lock has are used, the
      catalog's refs stand in for the rest, lock_problem says why, and there is no release
    + read_secrets: read the API key and HF token files (the deploy and status), making the pod's own key
      when serving_api_key_file is not set and it is not there yet (rigup.desired.pod_keys); False: judge from
      the knobs whether they are configured, without reading them (previews, fleet targets)
    + pod: one of pods_of(host_data); None: the host's only pod (a RecipeError when it lists pods)

    Raises LockError, SecretError, RecipeError (and CatalogError) with messages naming the host.
    """
    lock_problem: str | None = None
    try:
        lock = lock if lock is not None else deploy_lock(host_data, base_dir)
    except LockError as exc:  # no usable lock file at all
        if require_lock:
            raise
        lock, lock_problem = None, str(exc)
    recipe = recipe_for(host_data, topology, lock, pod)
    problems = lock_problems(recipe, host_data, lock) if lock is not None else []
    if problems:
        lock_problem = (
            f"{lock.path}: missing or stale entries for {host_name} ({pod.label() if pod else 'variant ' + recipe.variant}): "
            + "; ".join(problems)
            + f". Run `{LOCK_COMMAND}` (it adds missing entries and keeps the others) and commit the file."
        )
        if require_lock:
            raise LockError(lock_problem)
        lock = None  # a preview: the pins the lock has are in the recipe, but there is no release

    secrets: dict[str, str] = {}
    if read_secrets:
        # the pod's API key: serving_api_key_file's, else its own (a cluster member its head's), made once on the
        # control machine (rigup.desired.pod_keys)
        head = recipe.cluster.cluster.head if recipe.cluster is not None else None
        hf_token = read_hf_token(knob(host_data, "hf_token_file"))
        api_key = pod_api_key(host_data, *key_owner(host_name, recipe.pod, head), base_dir)
        secrets = {k: v for k, v in ((HF_TOKEN_KEY, hf_token), (API_KEY_KEY, api_key)) if v is not None}
        if recipe.cluster is not None:  # made once on the control machine, 0600 beside the fleet CA
            secrets[RAY_TOKEN_KEY] = cluster_token(host_data, recipe.cluster.cluster.name, base_dir)
        hf_present, api_present = HF_TOKEN_KEY in secrets, API_KEY_KEY in secrets
    else:
        hf_present, api_present = secrets_configured(host_data)
    rendered = render_variant(recipe)
    names = secret_names(recipe, hf_token_present=hf_present, api_key_present=api_present)
    release = None
    if lock is not None:
        release = build_release(
            recipe,
            {path: f.content for path, f in rendered.items()},
            api_key_present=api_present,
            secret_files={name: secret_file(recipe, name) for name in names},
            lock=lock,
        )
    return HostPlan(host_name, recipe, lock, rendered, release, lock_problem, names, secrets)


def host_plans(host_data: Mapping[str, Any], host_name: str = "this host", topology: Topology | None = None,
               **options: Any) -> list[HostPlan]:
    """host_plan for every pod of the host, in the order it lists them (one without pods)."""
    return [host_plan(host_data, host_name, topology, pod=pod, **options) for pod in pods_of(host_data)]


def host_sources(plans: list[HostPlan]) -> list[Any]:
    """The git sources every pod of a host mounts from, each once (the lock pins one commit per source),
    with the paths all of them need (rigup.desired.recipe.SourceSpec.required_paths)."""
    merged: dict[str, Any] = {}
    for plan in plans:
        for source in plan.recipe.sources:
            known = merged.get(source.name)
            paths = source.required_paths if known is None else tuple(sorted({*known.required_paths, *source.required_paths}))
            merged[source.name] = replace(source, required_paths=paths)
    return list(merged.values())
