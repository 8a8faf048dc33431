"""`rigup status`: for every rig, the desired state (fleet file + lock) against the actual state,
with drift marked.

Desired: the release the serving task would write for the host (variant, image, source commits,
model revisions and file manifests, engine settings, hashes of the rendered compose file, .env and
unit), the GPU count and the driver branch, rendered as the deploy renders it: with the GPU topology
and, on a cluster member, the interface and addresses read on the rig. Actual, gathered over SSH on
all rigs at once: the provenance file the health gate wrote ({install_root}/state/provenance.json), the
files on disk now, the rigup-<variant> units (systemctl is-active), the driver, GPUs and VRAM in use
(nvidia-smi --query-gpu), and /v1/models asked from the control machine.

Each item is ok, drift (the rig is not what the fleet file and lock say: converge it), unhealthy (it
is not serving as it should) or info. Exit code: 0 all ok, 1 drift, 2 unhealthy, 3 both, 4 the fleet
file or --limit could not be used (one line says why; no host was asked).
"""

from __future__ import annotations

import argparse
import json
import posixpath
import re
import shlex
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import requests
from pyinfra.api.exceptions import FactProcessError

from rigup.checks.preflight import check_capabilities
from rigup.cli.runner import add_target_arguments, progress, run_fleet_command
from rigup.client.openai_client import ApiClient, tls_failure
from rigup.client.ssh import LOCAL_HOST, LazySsh, RemoteError, Runner, gpu_memory
from rigup.client.targets import Target, fleet_targets
from rigup.desired.cluster import MemberNetwork, cluster_of, member_data, member_net
from rigup.desired.fleet import load_fleet
from rigup.desired.fleet_plan import fleet_entries, plan_fleet
from rigup.desired.knobs import knob
from rigup.desired.lock import LockError
from rigup.desired.plan import host_plan
from rigup.desired.recipe import RecipeError, pods_of
from rigup.desired.release import Provenance, ProvenanceError, parse_provenance, provenance_path, recipe_provenance_path
from rigup.desired.roles import cluster_membership, serves_variant
from rigup.desired.secrets import SecretError
from rigup.facts.gpu import GpuTopology, NvidiaGpus
from rigup.facts.network import ClusterPeerRoutes
from rigup.facts.serving import RigupVariantUnits
from rigup.facts.system import HostCapabilities
from rigup.parsers.iproute import PeerRoutes
from rigup.parsers.nvidia_smi import SmiQuery
from rigup.parsers.system import Capabilities
from rigup.parsers.topology import Topology
from rigup.rig.servingctl import SENTINEL_NAME

OK, DRIFT, UNHEALTHY, INFO = "ok", "drift", "unhealthy", "info"
EXIT_DRIFT, EXIT_UNHEALTHY = 1, 2
EXIT_BAD_FLEET = 4  # 2 is "unhealthy" here, so a fleet file status cannot use is not the usual 2
UNIT_KEY = "unit"  # Provenance.files key of the systemd unit's hash
MAX_DIFFS = 20  # release differences listed per host (the release hash says the rest)


@dataclass(frozen=True)
class Desired:
    host: str
    variant: str | None
    unit: str | None  # rigup-<variant>.service
    served_model: str | None
    release: dict[str, Any] | None  # what the serving task would write; None when it cannot be built
    release_sha256: str | None
    gpu_count: int | None  # the host's gpu_count knob (GPUs the rig must have)
    tensor_parallel_size: int | None  # GPUs the variant uses
    driver_branch: int | None
    problem: str | None = None  # why the desired release could not be built (lock, recipe, secrets)
    host_units: tuple[str, ...] = ()  # the units of the host's other pods: not "other variants"


@dataclass
class Facts:
    """What the rig says now (gathered over SSH)."""

    reachable: bool
    error: str | None = None
    provenance_text: str | None = None  # None: no provenance file
    units: dict[str, dict[str, Any]] = field(default_factory=dict)  # RigupVariantUnits
    smi: SmiQuery | None = None  # None: nvidia-smi not installed
    memory: list[tuple[int, int]] | None = None  # (used, total) MiB per GPU
    topology: Topology | None = None  # GpuTopology: what the deploy renders the interconnect from
    peer_routes: PeerRoutes | None = None  # ClusterPeerRoutes of a cluster member: its interface and addresses
    file_hashes: dict[str, str | None] = field(default_factory=dict)  # relpath / "unit" -> sha256 now
    unit_logs: dict[str, list[str]] = field(default_factory=dict)  # a failed unit -> its journal's last lines
    capabilities: Capabilities | None = None  # HostCapabilities: whether systemd runs there at all
    sentinel_text: str | None = None  # the pod's sentinel.json (rigup-servingctl sentinel); None: no round yet


@dataclass(frozen=True)
class Health:
    ok: bool
    detail: str
    models: tuple[str, ...] = ()


@dataclass(frozen=True)
class Item:
    item: str
    desired: str
    actual: str
    state: str  # ok | drift | unhealthy | info
    note: str = ""


# --------------------------------------------------------------------------------------------
# desired state (control machine)


def desired_state(target: Target, topology: Topology | None = None, network: MemberNetwork | None = None) -> Desired:
    """The release tasks/serving.py would write for this host, from the fleet data, the lock, the rig's GPU
    topology (NVLink changes the rendered NCCL settings, as in the deploy) and, on a cluster member, its
    network as read on it (`member_network`: the interface and addresses its compose names)."""
    data = member_data(target.data, network)
    branch = knob(data, "nvidia_driver_branch")
    base = {
        "host": target.name,
        "variant": target.variant,
        "unit": target.recipe.paths.unit_name if target.recipe else None,
        "served_model": target.served_model,
        "gpu_count": knob(data, "gpu_count"),
        "tensor_parallel_size": target.recipe.tensor_parallel_size if target.recipe else None,
        "driver_branch": int(branch) if branch is not None else None,
        "host_units": target.host_units,
    }
    try:
        pod = target.pod
        if pod is not None:  # a member's pod carries its `cluster` knob: take the one with the `net` read
            pod = next(p for p in pods_of(data) if p.name == pod.name)
        plan = host_plan(data, target.host or target.name, topology, pod=pod)
    except (LockError, RecipeError, SecretError, ValueError) as exc:
        return Desired(**base, release=None, release_sha256=None, problem=str(exc))
    return Desired(**base, release=dict(plan.release or {}), release_sha256=plan.release_sha256)


# --------------------------------------------------------------------------------------------
# actual state (over SSH)


def member_network(target: Target, read: PeerRoutes | None) -> MemberNetwork | None:
    """A cluster member's interface and addresses decided from what it read, as the deploy decides them
    (rigup.desired.cluster.member_net); None for a host in no cluster or when nothing was read."""
    member = cluster_membership(target.data)
    if member is None or read is None:
        return None
    return member_net(cluster_of(member), target.host or target.name, read)


def read_capabilities(runner: Runner) -> Capabilities:
    """What the host can run (HostCapabilities, read without sudo): whether systemd runs there at all."""
    probe = HostCapabilities()
    return probe.process(runner.run(probe.command, timeout=30).stdout.splitlines())


def gather_facts(runner: Runner, install_root: str, record: str | None = None,
                 peers: Mapping[str, str] | None = None) -> Facts:
    """Everything status needs from one rig, in a few commands over one connection; `record`: the
    pod's provenance.json (default: the one of a host without pods); `peers`: a cluster member's other
    members (FleetPlan.cluster_peers), whose routes it reads as the deploy does."""
    facts = Facts(reachable=True, capabilities=read_capabilities(runner))
    if peers:
        routes = ClusterPeerRoutes()
        try:
            facts.peer_routes = routes.process(runner.run(routes.command(dict(peers)), timeout=60).stdout.splitlines())
        except FactProcessError as exc:
            raise RemoteError(f"reading the routes to the cluster's other members: {exc}") from exc
    path = record or provenance_path(install_root)
    result = runner.run(f"cat {shlex.quote(path)} 2>/dev/null || echo __RIGUP_ABSENT__", timeout=30)
    text = result.stdout
    facts.provenance_text = None if text.strip() == "__RIGUP_ABSENT__" else text
    sentinel = posixpath.join(posixpath.dirname(path), SENTINEL_NAME)  # beside the provenance, as the sentinel writes it
    text = runner.run(f"cat {shlex.quote(sentinel)} 2>/dev/null || echo __RIGUP_ABSENT__", timeout=30).stdout
    facts.sentinel_text = None if text.strip() == "__RIGUP_ABSENT__" else text

    units = RigupVariantUnits()
    result = runner.run(units.command(install_root).get_raw_value(), timeout=30)
    facts.units = units.process(result.stdout.splitlines())
    for name, unit in facts.units.items():
        if unit["state"] == "failed":  # why: what the server printed last, and whether systemd gave up
            # the journal is root's (or the systemd-journal group's) to read
            result = runner.run(f"journalctl -u {shlex.quote(name)} -n {UNIT_LOG_LINES} --no-pager -o cat 2>/dev/null || true",
                                sudo=True, timeout=30)
            facts.unit_logs[name] = [line for line in result.stdout.splitlines() if line.strip()]

    smi = NvidiaGpus()
    result = runner.run(smi.command(), timeout=60)
    facts.smi = smi.process(result.stdout.splitlines())
    if facts.smi is not None and facts.smi.status == "ok":
        try:
            facts.memory = gpu_memory(runner)
        except RemoteError:
            facts.memory = None
        topology = GpuTopology()
        result = runner.run(topology.command(), timeout=60)
        facts.topology = topology.process(result.stdout.splitlines()) if result.stdout.strip() else None

    if facts.provenance_text is not None:
        try:
            recorded = parse_provenance(facts.provenance_text)
        except ProvenanceError:
            return facts
        facts.file_hashes = hash_files(runner, recorded)
    return facts


def hash_files(runner: Runner, recorded: Provenance) -> dict[str, str | None]:
    """SHA-256 now of every file the provenance records, the .env without its secret lines (a release written
    before the pods' secret files hashed it as rendered, before the deploy appended them; secrets never leave
    the rig). The secret files are not recorded with a hash: nothing here reads them."""
    release = recorded.raw["release"]
    variant_dir = release["variant_dir"]
    secret_keys = [k for k in release.get("secret_env_keys") or () if k.replace("_", "").isalnum()]
    env_rel = posixpath.relpath(release["env_file"], variant_dir)
    commands = []
    for key in recorded.files:
        path = release["unit_file"] if key == UNIT_KEY else posixpath.join(variant_dir, key)
        quoted = shlex.quote(path)
        if key == env_rel and secret_keys:
            strip = shlex.quote("^(" + "|".join(secret_keys) + ")=")
            hashed = f"grep -v -E {strip} {quoted} | sha256sum"
        else:
            hashed = f"sha256sum < {quoted}"
        commands.append(f'if [ -f {quoted} ]; then printf "%s " {shlex.quote(key)}; {hashed}; else echo {shlex.quote(key)} -; fi')
    result = runner.run("; ".join(commands), sudo=True, timeout=60)  # .env is 0600 root
    hashes: dict[str, str | None] = {key: None for key in recorded.files}
    for line in result.stdout.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] in hashes:
            hashes[parts[0]] = parts[1] if parts[1] != "-" else None
    return hashes


def check_health(target: Target) -> Health:
    if target.api_url is None:
        return Health(False, "no API URL")
    client = ApiClient(target.api_url, target.api_key)
    try:
        result = client.models(timeout=5.0)
    finally:
        client.close()
    if not result.ok:
        return Health(False, f"GET /v1/models: {result.describe_failure()}")
    models = tuple(sorted(result.models))
    if target.served_model not in result.models:
        return Health(False, f"/v1/models lists {list(models)}, not {target.served_model!r}", models)
    return Health(True, f"serves {target.served_model} ({result.elapsed * 1000:.0f} ms)", models)


WORKER_HEALTH = re.compile(r'^vllm_router_worker_health\{(?P<labels>[^}]*)\} (?P<value>\S+)$', re.MULTILINE)
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def gateway_items(target: Target, timeout: float = 60.0) -> list[Item]:
    """The entrance this host runs, asked over HTTPS from here (its certificate verified against the fleet CA's,
    or gateway_tls_ca_file's): its front answers /health, then every route with its router's verdict
    (vllm-router's vllm_router_worker_health per model and worker, from the front's /metrics/, asked with a
    client's key)."""
    url = target.gateway_url
    problem = [Item("gateway key", "readable", target.gateway_error, DRIFT)] if target.gateway_error else []
    if url is None:
        return problem
    verify = target.gateway_ca or True
    try:
        ready = requests.get(f"{url}/health", timeout=10, verify=verify)
        answered = "ready (nginx + vllm-router)" if ready.ok else f"HTTP {ready.status_code}"
    except requests.exceptions.SSLError as exc:
        return problem + [Item("gateway", f"answering on {url}", tls_failure(exc, target.gateway_ca), UNHEALTHY)]
    except requests.RequestException as exc:
        return problem + [Item("gateway", f"answering on {url}", f"no answer ({type(exc).__name__})", UNHEALTHY)]
    items = problem + [Item("gateway", f"answering on {url}", answered, OK if ready.ok else UNHEALTHY)]
    if not ready.ok:
        return items
    if target.gateway_key is None:
        return items + [Item("gateway routes", "checked", "no gateway key to ask with", UNHEALTHY)]
    try:
        metrics = requests.get(f"{url}/metrics/", headers={"Authorization": f"Bearer {target.gateway_key}"}, timeout=timeout,
                               verify=verify)
    except requests.RequestException as exc:
        return items + [Item("gateway routes", "checked", f"GET /metrics/: {type(exc).__name__}", UNHEALTHY)]
    if not metrics.ok:
        return items + [Item("gateway routes", "checked", f"GET /metrics/: HTTP {metrics.status_code}", UNHEALTHY)]
    routes = []
    for found in WORKER_HEALTH.finditer(metrics.text):
        labels = dict(LABEL.findall(found.group("labels")))
        routes.append((labels.get("model", "?"), labels.get("worker", "?"), found.group("value") == "1"))
    if not routes:
        return items + [Item("gateway routes", "at least one", "none", UNHEALTHY)]
    for model, worker, healthy in sorted(routes):
        items.append(Item(f"route {model}", "healthy", f"{'healthy' if healthy else 'unhealthy'}: {worker}",
                          OK if healthy else UNHEALTHY))
    return items


# --------------------------------------------------------------------------------------------
# comparison (pure)


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted paths of a release: lists of sources/models are keyed by their name or repo id."""
    flat: dict[str, Any] = {}
    if isinstance(value, Mapping):
        for key, item in value.items():
            flat.update(flatten(item, f"{prefix}{key}."))
    elif isinstance(value, list) and value and all(isinstance(v, Mapping) for v in value):
        for item in value:
            name = item.get("name") or item.get("repo_id") or json.dumps(item, sort_keys=True)
            rest = {k: v for k, v in item.items() if k not in ("name", "repo_id")}
            flat.update(flatten(rest, f"{prefix}{name}."))
    else:
        flat[prefix.rstrip(".")] = value
    return flat


def release_differences(desired: Mapping[str, Any], recorded: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    want, have = flatten(desired), flatten(recorded)
    return [(key, want.get(key), have.get(key)) for key in sorted(set(want) | set(have)) if want.get(key) != have.get(key)]


def _short(value: Any) -> str:
    if value is None:
        return "-"
    text = value if isinstance(value, str) else json.dumps(value)
    if len(text) == 64 and all(c in "0123456789abcdef" for c in text):
        return text[:12]  # a SHA-256
    return text if len(text) <= 48 else text[:45] + "..."


def compare(desired: Desired, facts: Facts, health: Health) -> list[Item]:
    items: list[Item] = []
    if not facts.reachable:
        items.append(Item("ssh", "reachable", facts.error or "unreachable", UNHEALTHY))
    else:
        items.extend(_release_items(desired, facts))
        items.extend(sentinel_items(facts))
        items.extend(_unit_items(desired, facts))
        items.extend(_gpu_items(desired, facts))
    items.append(Item("health", f"serves {desired.served_model}", health.detail, OK if health.ok else UNHEALTHY))
    return items


def _release_items(desired: Desired, facts: Facts) -> list[Item]:
    items: list[Item] = []
    if desired.problem is not None:
        items.append(Item("desired", "a buildable release", "-", DRIFT, desired.problem))
    if facts.provenance_text is None:
        items.append(Item("provenance", f"variant {desired.variant}", "none (never passed the health gate)", DRIFT))
        return items
    try:
        recorded = parse_provenance(facts.provenance_text)
    except ProvenanceError as exc:
        items.append(Item("provenance", "a rigup provenance record", str(exc), DRIFT))
        return items
    items.append(
        Item("variant", str(desired.variant), recorded.variant, OK if recorded.variant == desired.variant else DRIFT)
    )
    if desired.release is not None:
        same = desired.release_sha256 == recorded.release_sha256
        items.append(
            Item("release", _short(desired.release_sha256), _short(recorded.release_sha256), OK if same else DRIFT,
                 "" if same else "converge to apply")
        )
        if not same:
            differences = release_differences(desired.release, recorded.raw.get("release") or {})
            for key, want, have in differences[:MAX_DIFFS]:
                items.append(Item(f"  {key}", _short(want), _short(have), DRIFT))
            if len(differences) > MAX_DIFFS:
                items.append(Item("  ...", "", f"{len(differences) - MAX_DIFFS} more differences", DRIFT))
        rollback = recorded.last_rollback or {}
        if rollback.get("failed_release_sha256") == desired.release_sha256:
            items.append(
                Item("rollback", "-", f"this release failed the gate at {rollback.get('at')}", DRIFT,
                     str(rollback.get("reason", ""))[:120])
            )
    gate_ok = recorded.gate_result == "passed"
    items.append(Item("gate", "passed", f"{recorded.gate_result} at {recorded.gate_at}", OK if gate_ok else UNHEALTHY))
    changed = [key for key, sha in recorded.files.items() if facts.file_hashes.get(key) != sha]
    if changed:
        for key in changed:
            now = facts.file_hashes.get(key)
            items.append(Item(f"file {key}", _short(recorded.files[key]), "missing" if now is None else _short(now),
                              DRIFT, "changed on the rig since the gate"))
    else:
        items.append(Item("files", f"{len(recorded.files)} as recorded", "unchanged", OK))
    driver_then = recorded.host.get("nvidia_driver")
    driver_now = _driver(facts)
    if driver_then and driver_now and driver_then != driver_now:
        items.append(Item("driver since gate", driver_then, driver_now, INFO, "the driver changed after the gate"))
    return items


QUARANTINED = "QUARANTINED"  # the start of the sentinel item's actual, and the host's verdict, while it holds


def sentinel_items(facts: Facts) -> list[Item]:
    """What the rig's sentinel last found (docs/sentinel.md): QUARANTINED with its evidence (the probe, the
    answer's start, what was expected), wrong rounds not yet a quarantine, or right answers."""
    if facts.sentinel_text is None:
        return []
    try:
        record = json.loads(facts.sentinel_text)
    except ValueError:
        return [Item("sentinel", "a sentinel record", "not JSON", INFO)]
    quarantine = record.get("quarantined") if isinstance(record, dict) else None
    last = record.get("last_round") if isinstance(record, dict) and isinstance(record.get("last_round"), dict) else {}
    if isinstance(quarantine, dict):
        return [Item("sentinel", "right answers", f"{QUARANTINED} since {quarantine.get('since')}: probe "
                     f"{quarantine.get('probe')} answered {quarantine.get('answer')}", UNHEALTHY,
                     f"expected: {quarantine.get('expected')}; {quarantine.get('why')}")]
    failures = record.get("consecutive_failures") or 0
    failure = record.get("last_failure") if isinstance(record.get("last_failure"), dict) else {}
    if failures:
        return [Item("sentinel", "right answers", f"{failures} wrong round(s) in a row: probe {failure.get('probe')} "
                     f"answered {failure.get('answer')}", INFO, f"expected: {failure.get('expected')}")]
    when = "skipped (no answer)" if last.get("skipped") else "right"
    return [Item("sentinel", "right answers", f"{record.get('consecutive_passes', 0)} right round(s) in a row; last "
                 f"{when} at {last.get('at')}", OK)]


UNIT_LOG_LINES = 40  # enough to reach past systemd's and compose's own lines of the last attempts
START_LIMIT_HIT = "Start request repeated too quickly"  # systemd's words when a unit reaches StartLimitBurst


def systemd_items(facts: Facts) -> list[Item]:
    """A host without systemd as its init (a container, WSL without systemd) cannot run rigup's units:
    said in preflight's words, instead of a unit that is merely "not installed"."""
    if facts.capabilities is None:
        return []
    failed = [c for c in check_capabilities(facts.capabilities, {}) if c.name == "systemd" and not c.ok]
    return [Item("systemd", "the running init", check.message, UNHEALTHY, f"fix: {check.fix}") for check in failed]


def _unit_items(desired: Desired, facts: Facts) -> list[Item]:
    items: list[Item] = systemd_items(facts)
    if desired.unit is not None:
        unit = facts.units.get(desired.unit)
        state = unit["state"] if unit else "not installed"
        enabled = unit["enabled"] if unit else False
        healthy = unit is not None and unit["state"] == "active"
        restarts = int(unit.get("restarts", 0)) if unit else 0
        actual = f"{state}, {'enabled' if enabled else 'not enabled'}" + (f", {restarts} restart(s)" if restarts else "")
        log = facts.unit_logs.get(desired.unit, [])
        notes = []
        if restarts and healthy:
            notes.append("systemd restarted it after its server exited")
        if any(START_LIMIT_HIT in line for line in log):
            notes.append("crash loop: systemd stopped restarting it at its start limit")
        # compose prefixes what the container printed with its name and " | "; the rest is systemd's and compose's
        server_lines = [line.split(" | ", 1)[1].strip() for line in log if " | " in line]
        if state == "failed" and server_lines:
            notes.append("last lines: " + " | ".join(server_lines[-3:]))
        items.append(Item("service", "active, enabled", actual,
                          OK if healthy and enabled else UNHEALTHY if not healthy else DRIFT, "; ".join(notes)))
    others = sorted(name for name, unit in facts.units.items()
                    if name != desired.unit and name not in desired.host_units and (unit["active"] or unit["enabled"]))
    if others:
        items.append(Item("other variants", "none running", ", ".join(others), DRIFT, "the host's pods own the GPUs"))
    return items


def _driver(facts: Facts) -> str | None:
    if facts.smi is None or facts.smi.status != "ok" or not facts.smi.gpus:
        return None
    return facts.smi.gpus[0].driver_version


def _gpu_items(desired: Desired, facts: Facts) -> list[Item]:
    items: list[Item] = []
    smi = facts.smi
    wanted = f"branch >= {desired.driver_branch}" if desired.driver_branch is not None else "any"
    if smi is None:
        items.append(Item("driver", wanted, "nvidia-smi not installed", UNHEALTHY))
        return items
    if smi.status != "ok":
        items.append(Item("driver", wanted, f"{smi.status}: {smi.message}", UNHEALTHY))
        return items
    version = _driver(facts) or "?"
    try:
        branch = int(version.split(".")[0])
    except ValueError:
        branch = None
    below = desired.driver_branch is not None and (branch is None or branch < desired.driver_branch)
    items.append(Item("driver", wanted, version, DRIFT if below else OK))
    count = len(smi.gpus)
    expected = desired.gpu_count if desired.gpu_count is not None else desired.tensor_parallel_size
    names = sorted({g.name for g in smi.gpus})
    if desired.tensor_parallel_size is not None and count < desired.tensor_parallel_size:
        state = UNHEALTHY
    elif desired.gpu_count is not None and count != desired.gpu_count:
        state = DRIFT
    else:
        state = OK
    items.append(Item("gpus", str(expected) if expected is not None else "-", f"{count} x {', '.join(names)}", state))
    if facts.memory:
        used = ", ".join(f"{u}/{t}" for u, t in facts.memory)
        items.append(Item("vram MiB", "-", used, INFO))
    return items


# --------------------------------------------------------------------------------------------
# per host and output


@dataclass
class HostStatus:
    host: str
    variant: str | None
    url: str | None
    items: list[Item]

    @property
    def drift(self) -> bool:
        return any(i.state == DRIFT for i in self.items)

    @property
    def unhealthy(self) -> bool:
        return any(i.state == UNHEALTHY for i in self.items)

    @property
    def quarantined(self) -> bool:
        return any(i.item == "sentinel" and i.actual.startswith(QUARANTINED) for i in self.items)

    @property
    def verdict(self) -> str:
        unhealthy = QUARANTINED if self.quarantined else "UNHEALTHY"
        if self.drift and self.unhealthy:
            return f"DRIFT+{unhealthy}"
        return "DRIFT" if self.drift else unhealthy if self.unhealthy else "OK"


def host_status(target: Target, quiet: bool = False, peers: Mapping[str, str] | None = None) -> HostStatus:
    """Desired against actual for one target; `peers`: the other members of its cluster (FleetPlan.cluster_peers)."""
    if not quiet:
        where = "here (pyinfra's local connector)" if target.name == LOCAL_HOST else "over SSH"
        progress(f"[{target.name}] gathering state {where} ...")
    if not serves_variant(target.data):  # a gateway-only host
        return HostStatus(target.name, None, target.gateway_url, gateway_items(target))
    if target.recipe is None:  # nothing to compare with; whether the host could run a unit at all still counts
        items = [Item("recipe", "a valid variant", target.error or "-", DRIFT)]
        ssh = LazySsh(target.ssh)
        try:
            items += systemd_items(Facts(reachable=True, capabilities=read_capabilities(ssh)))
        except RemoteError as exc:
            items.append(Item("reachable", "yes", str(exc), UNHEALTHY))
        finally:
            ssh.close()
        return HostStatus(target.name, target.variant, None, items)
    ssh = LazySsh(target.ssh)
    try:
        facts = gather_facts(ssh, target.recipe.paths.install_root, recipe_provenance_path(target.recipe), peers)
    except RemoteError as exc:
        facts = Facts(reachable=False, error=str(exc))
    finally:
        ssh.close()
    network = member_network(target, facts.peer_routes)
    desired = desired_state(target, facts.topology, network)
    items = compare(desired, facts, check_health(target))
    if network is not None and network.problem is not None:  # preflight fails the member for it too
        items.insert(0, Item("cluster network", "decided from the member's routes", network.problem, UNHEALTHY))
    if target.error is not None:
        items.insert(0, Item("api key", "readable", target.error, DRIFT))
    if target.gateway_url or target.gateway_error:
        items += gateway_items(target)
    status = HostStatus(target.name, target.variant, target.api_url, items)
    if not quiet:
        progress(f"[{target.name}] {status.verdict}")
    return status


def render_table(statuses: list[HostStatus]) -> str:
    lines = []
    for s in statuses:
        lines.append(f"{s.host}  variant {s.variant or '-'}  {s.url or '-'}  {s.verdict}")
        wi = max([len(i.item) for i in s.items] + [4])
        wd = max([len(i.desired) for i in s.items] + [7])
        wa = max([len(i.actual) for i in s.items] + [6])
        lines.append(f"  {'ITEM':<{wi}}  {'DESIRED':<{wd}}  {'ACTUAL':<{wa}}  STATE")
        for i in s.items:
            mark = i.state.upper() if i.state in (DRIFT, UNHEALTHY) else i.state
            note = f"  ({i.note})" if i.note else ""
            lines.append(f"  {i.item:<{wi}}  {i.desired:<{wd}}  {i.actual:<{wa}}  {mark}{note}")
        lines.append("")
    drifted = sum(1 for s in statuses if s.drift)
    unhealthy = sum(1 for s in statuses if s.unhealthy)
    lines.append(f"{len(statuses)} host(s): {drifted} drifted, {unhealthy} unhealthy")
    return "\n".join(lines)


def exit_code(statuses: list[HostStatus]) -> int:
    code = 0
    if any(s.drift for s in statuses):
        code |= EXIT_DRIFT
    if any(s.unhealthy for s in statuses):
        code |= EXIT_UNHEALTHY
    return code


def status_document(statuses: list[HostStatus]) -> dict[str, Any]:
    return {
        "hosts": [
            {
                "host": s.host,
                "variant": s.variant,
                "url": s.url,
                "verdict": s.verdict,
                "drift": s.drift,
                "unhealthy": s.unhealthy,
                "items": [asdict(i) for i in s.items],
            }
            for s in statuses
        ]
    }


def cmd_status(args: argparse.Namespace) -> int:
    peers: dict[str, dict[str, str]] = {}  # target -> the other members of its cluster

    def select() -> list[Target]:
        fleet = load_fleet()
        targets = fleet_targets(args.limit, fleet)
        planned = plan_fleet(fleet_entries(fleet))  # its members' peers as the deploy reaches them
        peers.update({t.name: planned.cluster_peers(t.host) for t in targets if t.host is not None})
        return targets

    code, _ = run_fleet_command(
        "status",
        select,
        lambda t: host_status(t, args.quiet or args.json, peers.get(t.name)),
        as_json=args.json,
        document=status_document,
        table=render_table,
        exit_code=exit_code,
        bad_targets_exit=EXIT_BAD_FLEET,
    )
    return code


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "status",
        help="each rig's actual state against the fleet file and lock: OK, DRIFT (converge it) or UNHEALTHY per host",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_target_arguments(parser)
    parser.set_defaults(func=cmd_status)
    return parser
