"""The pods' API keys (issues 42 and 44): every pod is keyed by default, each with its own key made on the control
machine, and everyone who calls a pod presents that pod's key.

What vLLM does with it: its OpenAI server takes its keys from `--api-key`, else from the environment variable
VLLM_API_KEY, and asks every request under /v1 for one of them as a bearer token. Read in vllm-project/vllm
vllm/entrypoints/openai/api_server.py at 0001948bc769 (build_app: `tokens := [key for key in (args.api_key or
[envs.VLLM_API_KEY]) if key]`, then AuthenticationMiddleware) and vllm/envs.py at 001f69f8b52e (`"VLLM_API_KEY":
lambda: os.environ.get("VLLM_API_KEY", None)`); the `if token := envs.VLLM_API_KEY or args.api_key` of earlier
releases reads the same variable. The catalog's images (the nightly 7a1eb8ac, 0.20.1rc1.dev16, and v0.22.0,
v0.27.1) were not readable here at their own commits; the test bed's stand-in engine keys itself the same way.
So the key reaches a pod as the 0600 file VLLM_API_KEY of its secrets directory, bound read-only in the container,
and the container's entrypoint wrapper exports VLLM_API_KEY from it before it execs upstream's entrypoint
(rigup.desired.transforms KEY_WRAPPER): never in argv, a journal, the container's configuration (which containerd
keeps world-readable) or any other world-readable file. vLLM's /metrics, /health and its other unguarded paths are not
behind the key (its security guide): the boundary firewall is what guards them.

Whose key: `serving_api_key_file` names the user's own, one key for every pod of the host. Without it (the
default) each pod has its own, made once on the control machine, 0600 beside the fleet CA
(`fleet_ca_dir/pod-keys/<host>/<pod>.key`, secrets.token_hex(32) as the cluster's Ray token). A cluster's members
carry its head's pod's key: the head publishes the cluster's API, and each member's gate asks it.

Who calls a pod with it: the pod's own gate and sentinel (rigup-servingctl, from the pod's secret file), `rigup status`,
`verify` and `bench` (from the control machine's file), and the entrance. The entrance's vllm-router 0.1.17
(files/router/requirements.txt) holds no key per worker and forwards the request's one Authorization header to
whichever pod it picks: its worker registration (`--worker-urls`, `/add_worker?url=`, the WorkerConfigRequest of
`/workers`) carries a URL and no key, and its one `--api-key` is for the data-parallel ranks of one worker
(vllm_router/router_args.py of the wheel; src/server.rs's `UrlQuery { url }` and src/protocols/worker_spec.rs of
vllm-project/router as stored at 00edc4e9 and a286cd7e, not the release's own commit; in the wheel's
vllm_router_rs.abi3.so `add_worker` takes that `UrlQuery`, and `api_key` is a field of the router's configuration
and of its routers, of no worker). Its HTTP client does take the proxy in HTTP_PROXY (reqwest's default; checked
with the pinned wheel: its health checks and requests to a worker, loopback ones too, went to the proxy as
`POST http://<worker>/v1/...` with the worker's host:port as Host). So each router is given the entrance's own
loopback hop as its proxy, and that hop sends each pod its own key by the pod's host:port
(rigup.desired.entrance pod_key_text); the front sends the routers no key at all.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rigup.desired.fleet_ca import ca_directory, make_ca_directory
from rigup.desired.secrets import SecretError, load_api_key, make_secret_file, read_secret_file

KEYS_DIR = "pod-keys"  # under fleet_ca_dir


def _component(name: str) -> str:
    """A host or pod name as a file name: itself when it is letters, digits, '.', '_' and '-', else those with a
    hash of the name (pyinfra's @local, say)."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip(".") or "_"
    return safe if safe == name else f"{safe}-{hashlib.sha256(name.encode()).hexdigest()[:8]}"


def pod_key_file(host_data: Mapping[str, Any], host: str, pod: str, base_dir: Path | None = None) -> Path:
    """Where the control machine keeps pod `pod` of host `host`'s key: fleet_ca_dir/pod-keys/<host>/<pod>.key."""
    return ca_directory(host_data, base_dir) / KEYS_DIR / _component(host) / f"{_component(pod)}.key"


def pod_key(host_data: Mapping[str, Any], host: str, pod: str, base_dir: Path | None = None, *, make: bool = True) -> str:
    """Pod `pod` of `host`'s key: the one on file (refused unless 0600), else, with `make`, one made now (0600,
    appearing whole: written under another name, then linked, so two plans made at once read the same one).
    Without `make` a missing file is a SecretError saying the converge makes it."""
    path = pod_key_file(host_data, host, pod, base_dir)
    what = f"the key of pod {pod} on {host} ({path})"
    if not path.exists():
        if not make:
            raise SecretError(f"{what} is not there yet: the converge makes it")
        make_ca_directory(path.parent.parent.parent)  # 0700, with the .gitignore of * the CA's directory has
        for directory in (path.parent.parent, path.parent):
            directory.mkdir(mode=0o700, exist_ok=True)
        make_secret_file(path)
    return read_secret_file(path, what)


def key_owner(host: str, pod: str, cluster_head: str | None) -> tuple[str, str]:
    """Whose key a pod carries: its own (host, pod), or for a member of a cluster its head's (the cluster's pod has
    the cluster's name on every member)."""
    return (cluster_head, pod) if cluster_head is not None else (host, pod)


def pod_api_key(host_data: Mapping[str, Any], host: str, pod: str, base_dir: Path | None = None, *,
                make: bool = True) -> str:
    """The API key of pod `pod` (key_owner's) of a host with `host_data`: serving_api_key_file's when it is set,
    else the pod's own (pod_key)."""
    own = load_api_key(host_data)
    return own if own is not None else pod_key(host_data, host, pod, base_dir, make=make)


__all__ = ["KEYS_DIR", "key_owner", "pod_api_key", "pod_key", "pod_key_file"]
