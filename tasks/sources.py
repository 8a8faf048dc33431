"""Sources: the git checkouts the host's variant (every pod's) mounts files from, each at its locked commit.

True afterwards: for every source the variant needs (vLLM fork for the Marlin files, Genesis,
club-3090), {install_root}/sources/<name> is a checkout of exactly the commit in the lock file,
with no local edits to tracked files, and the files the compose file mounts from it exist.
Sources other variants need are not cloned. A rig with local edits fails with the list of files.
Reads: variant, variant_overrides, install_root, vllm_fork_git_url, genesis_git_url,
club3090_git_url, lock_file.
Restarts: nothing (serving renders the commits into its provenance and restarts on change).
Not idempotent: none (a re-run with the same pins changes nothing).
Without a usable lock: the first phase that needs pins. A real run stops here (pyinfra ends the run when a task
file raises), saying what the lock pins and how to make it; a --dry run warns so in one line and plans nothing here.
"""

from pyinfra import host, state
from pyinfra.operations import files

from rigup.desired.lock import LockError
from rigup.desired.plan import host_sources
from rigup.desired.recipe import RecipeError
from rigup.operations.apt import os_packages
from rigup.operations.git import git_checkout
from rigup.operations.planning_errors import stop_the_run_on
from rigup.runstate import fleet_plan, pins_missing

with stop_the_run_on(host, LockError, RecipeError):
    plans = fleet_plan(state).host(host.name).pods
wanted = host_sources(plans)  # every pod's sources, each once, with the paths all of them mount
# a variant without sources needs no pins here (the model phase refuses then)
sources = () if wanted and any(pins_missing(host, "sources", plan) for plan in plans) else wanted

if sources:
    os_packages(name="Install git", packages=["git"])
    files.directory(name="Create the sources directory", path=plans[0].recipe.paths.sources_dir, mode="755")

for source in host.loop(sources):
    git_checkout(
        name="Check out each source at its locked commit",
        src=source.git_url,
        dest=source.path,
        commit=source.commit,
        full_clone=source.full_clone,
        required_paths=source.required_paths,
    )
