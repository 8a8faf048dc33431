"""The fleet's entrance (issue 44): nginx from the OS archive as the front, one vllm-router per served model
behind it, the pods behind the routers. What the control machine renders for it; the converge writes it.

Why this shape (measured in bench/results.md, section Entrance: nginx + vllm-router 0.97x direct at 32 streams
paced at a real rig's rate, LiteLLM 0.29x):
- vllm-router 0.1.17 routes one pool of workers that serve one model: its README's examples and its
  launcher (vllm_router/router_args.py) take `--worker-urls` and route every request to one of them whatever
  its `model`; multi-model pools exist only behind `--enable-igw` ("Inference-Gateway mode for multi-model
  support", no documented use). So each served model gets its own router process (rigup-router@<slug>).
- nginx picks the model's router from the request body's `model`: core nginx cannot read a body, so the
  archive's njs module (libnginx-mod-http-js) parses it once (entrance.js) and redirects to the location that
  proxies to that model's router. `/v1/models` is the list of routed models, rendered here at converge.
- The front checks the client's bearer key against a map in a 0600 include (keys never in nginx.conf, on a
  command line or in a log), allows only ALLOWED_PATHS (vLLM's unguarded `/invocations`, `/tokenize`,
  `/pause`, ... answer 404), drops the client's key, and streams unbuffered. The routers reach the pods through
  nginx's loopback hop (their HTTP_PROXY), which sends each pod its own key (vllm-router holds no key per worker
  and forwards the request's one header: rigup.desired.pod_keys).
- Routing: `consistent_hash` keyed by the session header (the wheel's README: "Routes same session/user to
  same worker", with `X-Session-ID`), so the turns of one conversation land on the pod that holds their
  prefix; a pod that fails its health checks (`--health-check-interval-secs`, `--health-failure-threshold`)
  or a request (`--retry-max-retries`, circuit breaker) hands its requests to the others.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
import secrets
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from rigup.desired.secrets import SecretError, read_secret_file
from rigup.desired.templating import render_template

# The OpenAI endpoints the fleet serves through the front; everything else is refused (vLLM's security guide:
# its --api-key guards only /v1, /v2 and /inference; /invocations, /tokenize, /pause... answer without one).
MODEL_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")  # routed by the body's model
ALLOWED_PATHS = (*MODEL_PATHS, "/v1/models", "/health")
ROUTER_UNIT_TEMPLATE = "rigup-router@.service"
NGINX_SITE = "/etc/nginx/conf.d/rigup-entrance.conf"  # nginx.conf of the package includes conf.d/*.conf
NGINX_PACKAGES = ("nginx", "libnginx-mod-http-js")  # Debian 12 / Ubuntu archive: nginx 1.22, njs 0.7
SESSION_HEADER = "X-Session-ID"  # vllm-router's README: consistent_hash's session header
CLIENT_NAME = re.compile(r"[a-z][a-z0-9-]{0,31}")
# What secrets.token_urlsafe makes (and a key rigup did not make must look like): nothing nginx would parse.
KEY_PATTERN = re.compile(r"[A-Za-z0-9_.~+/=-]{16,256}")
ROUTER_PORT_BASE = 30100  # router i listens on 127.0.0.1:(base + i), its metrics on (base + 100 + i)
# Requests and tokens per client (docs/gateway.md, Usage per client): nginx logs each request to a model path in
# USAGE_LOG (its client's name, model, status, the response's usage); rigup-entrance-usage (rigup/rig/entrance_usage.py)
# counts that log and serves the counters on 127.0.0.1:USAGE_PORT, which /metrics/ joins.
USAGE_LOG = "/var/log/nginx/rigup-entrance-usage.log"  # the package's logrotate rotates /var/log/nginx/*.log
USAGE_PORT = 30300
# The routers reach their pods through nginx on 127.0.0.1:POD_HOP_PORT (their HTTP proxy), which sends each pod its
# own key (rigup.desired.pod_keys: vllm-router holds no key per worker)
POD_HOP_PORT = 30400
USAGE_UNIT = "rigup-entrance-usage.service"


class EntranceError(ValueError):
    """An entrance setting rigup cannot use; the message names the knob and the allowed values."""


@dataclass(frozen=True)
class Client:
    """One client of the fleet's entrance: its name (in usage metrics and logs) and its bearer key."""

    name: str
    key: str

    def __repr__(self) -> str:  # never the key
        return f"Client({self.name!r})"


@dataclass(frozen=True)
class ModelRouter:
    """One vllm-router: the pods serving one model."""

    model: str
    slug: str  # systemd instance name and nginx name: [a-z0-9-]
    port: int
    metrics_port: int
    workers: tuple[str, ...]  # http://address:port (no /v1)


def client_entries(listed: Any, where: str) -> list[tuple[str, str]]:
    """The (name, key file) of each client the fleet file lists under gateway_clients ([{name, key_file}])."""
    if listed is None:
        return []
    if not isinstance(listed, list):
        raise EntranceError(f"{where}: gateway_clients must be a list of {{name, key_file}}, not {type(listed).__name__}")
    out: list[tuple[str, str]] = []
    for index, entry in enumerate(listed):
        if not isinstance(entry, Mapping) or set(entry) != {"name", "key_file"}:
            got = sorted(entry) if isinstance(entry, Mapping) else type(entry).__name__
            raise EntranceError(f"{where}: gateway_clients[{index}] must have exactly the keys name and key_file (got {got})")
        name, key_file = entry["name"], entry["key_file"]
        if not isinstance(name, str) or not CLIENT_NAME.fullmatch(name):
            raise EntranceError(f"{where}: gateway_clients[{index}].name {name!r}: lowercase letters, digits and '-', "
                                "starting with a letter, at most 32")
        if not isinstance(key_file, str) or not key_file:
            raise EntranceError(f"{where}: gateway_clients[{index}].key_file must be a path on the control machine")
        if name in {n for n, _ in out}:
            raise EntranceError(f"{where}: gateway_clients lists client {name!r} twice")
        out.append((name, key_file))
    return out


def client_key(name: str, key_file: str, knob_name: str) -> str:
    """The client's key from its 0600 file; a file that does not exist yet gets a new key, written 0600."""
    path = Path(key_file).expanduser()
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # made meanwhile (another host's plan): read it below
            pass
        else:
            with os.fdopen(descriptor, "w") as handle:
                handle.write(secrets.token_urlsafe(32) + "\n")
    key = read_secret_file(path, knob_name)
    if not KEY_PATTERN.fullmatch(key):
        raise SecretError(f"{knob_name}: the key of client {name!r} in {path} must be 16-256 of A-Z a-z 0-9 and "
                          "_ . ~ + / = - (a bearer token; secrets.token_urlsafe(32) makes one)")
    return key


def slug(model: str, taken: Iterable[str] = ()) -> str:
    """A name for the model's router: systemd instance and nginx identifier ([a-z0-9-]); unique among `taken`."""
    base = re.sub(r"[^a-z0-9]+", "-", model.lower()).strip("-")[:48] or "model"
    name, n = base, 2
    while name in set(taken):
        name, n = f"{base}-{n}", n + 1
    return name


def model_routers(workers_by_model: Mapping[str, Sequence[str]]) -> list[ModelRouter]:
    """One router per model (sorted by name, so ports are stable while the set of models is), its workers sorted."""
    routers: list[ModelRouter] = []
    for index, model in enumerate(sorted(workers_by_model)):
        routers.append(ModelRouter(model, slug(model, (r.slug for r in routers)), ROUTER_PORT_BASE + index,
                                   ROUTER_PORT_BASE + 100 + index, tuple(sorted(set(workers_by_model[model])))))
    return routers


def router_args(router: ModelRouter, *, health_check_interval_s: int, num_retries: int) -> str:
    """vllm-router's arguments for one model (flags as vllm_router/router_args.py of the pinned wheel defines
    them); no secret: each pod's key is added on the way by the entrance's hop (router_proxy_environment)."""
    args = [
        "--host", "127.0.0.1", "--port", str(router.port),
        "--worker-urls", *router.workers,
        # the README: consistent_hash "Routes same session/user to same worker" (X-Session-ID): a conversation's
        # turns stay on the pod holding its prefix; requests without the header hash their own request id
        "--policy", "consistent_hash",
        "--health-check-interval-secs", str(health_check_interval_s),
        "--health-failure-threshold", "1",  # out of rotation at the first failed check
        # a pod's circuit opens at its first failed request, so the retry goes to another pod at once (checked
        # with the pinned wheel: a pod killed under 4 streams of session traffic cost no failed request)
        "--cb-failure-threshold", "1",
        "--retry-max-retries", str(num_retries + 1),  # the wheel counts the first attempt
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(router.metrics_port),
        "--log-level", "warning",  # the launcher's own; the Rust part's is RUST_LOG (the unit sets warn)
    ]  # fmt: skip
    return " ".join(args)


def key_map_text(clients: Sequence[Client]) -> str:
    """nginx's map from the Authorization header to the client's name ("": refused). It holds the keys: written
    0600 (root; nginx's master reads it before dropping to www-data) and included, never in nginx.conf."""
    lines = ["# Rendered by rigup: the entrance's client keys (0600). Do not edit.",
             "map $http_authorization $entrance_client {", '    default "";']
    for client in sorted(clients, key=lambda c: c.name):
        lines.append(f'    "Bearer {client.key}" {client.name};')
    lines.append("}")
    return "\n".join(lines) + "\n"


def pod_address(worker_url: str) -> str:
    """A pod as the entrance's hop sees it: the host:port of its worker URL (the Host a router's request carries)."""
    return urlsplit(worker_url).netloc


def pod_upstreams(routers: Sequence[ModelRouter]) -> list[tuple[str, str]]:
    """(nginx upstream name, host:port) of every pod the routers route to, each once, in order."""
    addresses = sorted({pod_address(url) for router in routers for url in router.workers})
    return [(f"rigup_pod_{i}", address) for i, address in enumerate(addresses)]


def pod_key_text(pod_keys: Mapping[str, str] | None) -> str:
    """The pods' keys the entrance's loopback hop sends, as an nginx map from the pod's host:port (the Host of a
    router's request through it) to its Authorization header: each pod its own key (rigup.desired.pod_keys), none
    for any other (the pod refuses). It holds the keys: written 0600 and included, never in nginx.conf."""
    lines = ["# Rendered by rigup: each pod's key, by its host:port (0600). Do not edit.",
             "map $http_host $entrance_pod_authorization {", '    default "";']
    for address, key in sorted((pod_keys or {}).items()):
        lines.append(f'    "{address}" "Bearer {key}";')
    lines.append("}")
    return "\n".join(lines) + "\n"


def router_proxy_environment() -> str:
    """The environment lines that send a router's requests to its pods through the hop (HTTP_PROXY, which the
    wheel's HTTP client takes: rigup.desired.pod_keys); NO_PROXY empty, so loopback pods go through it too."""
    proxy = f"http://127.0.0.1:{POD_HOP_PORT}"
    return f"HTTP_PROXY={proxy}\nhttp_proxy={proxy}\nNO_PROXY=\nno_proxy=\n"


def models_document(routers: Sequence[ModelRouter]) -> str:
    """The front's answer to GET /v1/models: every routed model (OpenAI's list shape)."""
    data = [{"id": r.model, "object": "model", "owned_by": "rigup"} for r in routers]
    return json.dumps({"object": "list", "data": data}, sort_keys=True) + "\n"


@dataclass(frozen=True)
class EntrancePaths:
    root: str  # {install_root}/gateway

    @property
    def key_map(self) -> str:
        return posixpath.join(self.root, "clients.map")

    @property
    def pod_key(self) -> str:
        return posixpath.join(self.root, "pod-key.conf")

    @property
    def models_json(self) -> str:
        return posixpath.join(self.root, "models.json")

    @property
    def dispatch_js(self) -> str:
        return posixpath.join(self.root, "entrance.js")

    @property
    def routers_dir(self) -> str:
        return posixpath.join(self.root, "routers")

    def router_env(self, router_slug: str) -> str:
        return posixpath.join(self.routers_dir, f"{router_slug}.env")

    @property
    def last_good(self) -> str:
        """The entrance's files as they were when it last came up healthy (tar, 0600: it holds the keys): what a
        converge whose new configuration fails puts back."""
        return posixpath.join(self.root, "last-good.tar")

    @property
    def usage_counter(self) -> str:
        """rigup/rig/entrance_usage.py: counts USAGE_LOG per client for Prometheus."""
        return posixpath.join(self.root, "rigup-entrance-usage")


def score_percent(rate: float) -> str | None:
    """gateway_score_sample_rate as nginx's split_clients writes a share ("5", "0.5"); None: nothing is scored."""
    text = f"{rate * 100:.2f}".rstrip("0").rstrip(".")
    return None if text in ("0", "") else text


def nginx_site(routers: Sequence[ModelRouter], paths: EntrancePaths, *, bind_address: str, port: int,
               tls: tuple[str, str] | None, scored: Sequence[tuple[str, str, str]] = (),
               score_sample_rate: float = 0.0) -> str:
    """The front's server: TLS when a certificate and key are named, keys, allowlist, model dispatch; the hop
    scores `score_sample_rate` of the pods' completions, labelled by `scored` ((host:port, rig/pod, model) each)."""
    return render_template("rigup-entrance.nginx.conf.j2", routers=routers, paths=paths,
                           listen=f"[{bind_address}]:{port}" if ":" in bind_address else f"{bind_address}:{port}",
                           tls=tls, model_paths=MODEL_PATHS, usage_log=USAGE_LOG, usage_port=USAGE_PORT,
                           pods=pod_upstreams(routers), hop_port=POD_HOP_PORT,
                           score_percent=score_percent(score_sample_rate), pod_labels=list(scored))


def dispatch_js(routers: Sequence[ModelRouter]) -> str:
    """njs: the request body's model -> the location of its router (404 in OpenAI's error shape otherwise)."""
    return render_template("rigup-entrance.js.j2", slugs=json.dumps({r.model: r.slug for r in routers}, sort_keys=True))


def router_env_text(router: ModelRouter, *, health_check_interval_s: int, num_retries: int) -> str:
    return (f"# Rendered by rigup: vllm-router for {router.model}. Do not edit.\n"
            f"ROUTER_ARGS={router_args(router, health_check_interval_s=health_check_interval_s, num_retries=num_retries)}\n"
            "# to its pods through the entrance's hop, which sends each pod its own key\n"
            + router_proxy_environment())


def usage_unit_text(paths: EntrancePaths) -> str:
    """The unit of rigup-entrance-usage: follows USAGE_LOG, serves the counters on 127.0.0.1:USAGE_PORT."""
    return render_template("rigup-entrance-usage.service.j2", script=paths.usage_counter, log=USAGE_LOG, port=USAGE_PORT)
