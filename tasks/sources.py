"""Sources: the git checkouts the host's variant mounts files from, each at its locked commit.

True afterwards: for every source the variant needs (vLLM fork for the Marlin files, Genesis,
club-3090), {install_root}/sources/<name> is a checkout of exactly the commit in the lock file,
with no local edits to tracked files, and the files the compose file mounts from it exist.
Sources other variants need are not cloned. A rig with local edits fails with the list of files.
Reads: variant, variant_overrides, install_root, vllm_fork_git_url, genesis_git_url,
club3090_git_url, lock_file.
Restarts: nothing (serving renders the commits into its provenance and restarts on change).
Not idempotent: none (a re-run with the same pins changes nothing).
"""

from pyinfra import host
from pyinfra.api.exceptions import DeployError
from pyinfra.operations import apt, files

from rigup.desired.lock import LockError
from rigup.desired.plan import host_plan
from rigup.operations.git import git_checkout

try:
    recipe = host_plan(host.data.dict(), host.name, read_secrets=False).recipe
except LockError as exc:
    raise DeployError(str(exc)) from None

if recipe.sources:
    apt.packages(name="Install git", packages=["git"])
    files.directory(name="Create the sources directory", path=recipe.paths.sources_dir, mode="755")

for source in host.loop(recipe.sources):
    git_checkout(
        name="Check out each source at its locked commit",
        src=source.git_url,
        dest=source.path,
        commit=source.commit,
        full_clone=source.full_clone,
        required_paths=source.required_paths,
    )
