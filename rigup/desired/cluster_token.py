"""A cluster's Ray token: Ray's token authentication on every member (issue 42).

Ray's GCS, raylets, dashboard and job API answer anyone who reaches them unless `RAY_AUTH_MODE=token`
(Ray >= 2.52; CVE-2023-48022). With it, every Ray process of a node and every client presents a bearer
token and is refused without it. What rigup relies on, read in the Ray 2.58.0 wheel the test bed runs
(PyPI's ray-2.58.0-cp311 manylinux2014 wheel, ray/_version.py commit cec0a091b12675bbf101cf8a350c8706107baee1:
its Python files, and the strings of its gcs_server, raylet and _raylet.so binaries) and in ray-project/ray
src/ray/rpc/authentication/authentication_token_loader.cc as stored at 03864b87 (the same messages as the
2.58.0 binaries; the file at the release commit itself was not available to read):

- the mode comes from the environment only: `RAY_AUTH_MODE` (python/ray/_private/authentication/
  authentication_token_setup.py ensure_token_if_auth_enabled refuses AUTH_MODE in `_system_config`);
- the token is loaded by the C++ AuthenticationTokenLoader (shared by the GCS, the raylet, the workers and
  the Python side through ray._raylet) from, in order, `RAY_AUTH_TOKEN`, the file `RAY_AUTH_TOKEN_PATH`
  names, then ~/.ray/auth_token (TryLoadTokenFromSources); with the mode on and no token, the process stops
  (RAY_CHECK ... "Token authentication is enabled but Ray couldn't find an authentication token");
- `ray start` does not make one when joining or starting with the mode on (ray/scripts/scripts.py calls
  ensure_token_if_auth_enabled(..., create_token_if_missing=False)), so a member without the token fails
  at once instead of running open;
- a token is what Ray's own generator makes: secrets.token_hex(32) (python/ray/_private/authentication/
  authentication_token_generator.py generate_new_authentication_token), one line, whitespace trimmed.

Measured against that wheel (`ray start --head` with the mode on, then ray._raylet.GcsClient): without the
token, or with a wrong one, the GCS answers "Unauthenticated: RPC error: InvalidAuthToken: Authentication
token is missing or incorrect" (ray.exceptions.AuthenticationError); with it, it answers.

Every process of a member's container is a child of `ray start` or `vllm serve` and inherits the container's
environment, which names the token's file: `RAY_AUTH_TOKEN_PATH=/run/rigup/secrets/RAY_AUTH_TOKEN` (the loader's
second source), with `RAY_AUTH_MODE=token`. The token itself is never a value of the container's environment
(containerd keeps that in world-readable files: issue 42), the compose file, argv or a log: it is the 0600 file
RAY_AUTH_TOKEN of the member's secrets directory, bound read-only at /run/rigup/secrets (rigup.desired.transforms
SECRETS_TARGET). The token is made once per cluster on the control machine, 0600 beside the fleet CA
(`fleet_ca_dir/ray-<cluster>.token`), and every member's file carries the same one; a new token (the file
removed) changes every member's file, which restarts them together.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rigup.desired.fleet_ca import ca_directory, make_ca_directory
from rigup.desired.secrets import make_secret_file, read_secret_file

RAY_AUTH_MODE = "token"  # RAY_AUTH_MODE's value that turns token authentication on
RAY_TOKEN_KEY = "RAY_AUTH_TOKEN"  # the secret's name: its file in the pod's secrets directory


def token_file(host_data: Mapping[str, Any], cluster: str, base_dir: Path | None = None) -> Path:
    """Where the control machine keeps cluster `cluster`'s token: fleet_ca_dir/ray-<cluster>.token."""
    return ca_directory(host_data, base_dir) / f"ray-{cluster}.token"


def cluster_token(host_data: Mapping[str, Any], cluster: str, base_dir: Path | None = None) -> str:
    """Cluster `cluster`'s Ray token: the one on file (refused unless 0600), else one made now, 0600.

    The file appears whole or not at all (written under another name, then linked), so two members'
    plans made at once read the same token."""
    path = token_file(host_data, cluster, base_dir)
    if not path.exists():
        make_ca_directory(path.parent)  # 0700, with the .gitignore of * the CA's directory has
        make_secret_file(path)
    return read_secret_file(path, f"cluster {cluster}'s Ray token ({path})")


__all__ = ["RAY_AUTH_MODE", "RAY_TOKEN_KEY", "cluster_token", "token_file"]
