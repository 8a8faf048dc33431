"""Preflight checks: pure functions from (facts, recipe, host data) to a list of Check results.

tasks/preflight.py (through rigup.operations.preflight.preflight_checks) fails a host on any failed check of
severity "error"; `rigup doctor` prints the same list as a table or JSON. The recipe's fit
on the host (VRAM envelope, driver CUDA vs the image, GPU layout, interconnect) comes from
rigup.checks.fit.assess and is reported as checks of the same kind.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from rigup import command
from rigup.checks.driver_plan import (
    BRANCH_CUDA,
    DriverPlan,
    DriverWant,
    branch_cuda,
    needs_unsigned_modules,
    plan_driver,
)
from rigup.checks.fit import assess
from rigup.desired.cluster import clock_skew, mtu_disagreement
from rigup.desired.gpu_power import LOW_CAP_SHARE, power_cap
from rigup.desired.knobs import REBOOT_POLICIES, knob
from rigup.desired.lock import LOCK_COMMAND
from rigup.desired.plan import host_plan
from rigup.desired.pods import pod_data, ports_used_twice
from rigup.desired.recipe import pods_of
from rigup.desired.trust import TRUST_FIX, https_urls, untrusted_line
from rigup.facts.driver import PrebuiltModules
from rigup.parsers.curl import TlsProbe
from rigup.parsers.docker import DockerInfo
from rigup.parsers.dpkg import DebPackage
from rigup.parsers.gpu_models import known_gpu
from rigup.parsers.lspci import PciDevice, visible_gpus
from rigup.parsers.nvidia_smi import Gpu, GpuState, SmiQuery
from rigup.parsers.system import Capabilities, DiskFree, LoadedModule, OsInfo, PendingReboot, SecureBootState
from rigup.parsers.topology import Topology

Severity = Literal["error", "warning", "info"]
OPEN_MODULES_MIN_CC = (7, 5)  # NVIDIA's open kernel modules support Turing and newer
DEFAULT_DOCKER_ROOT = "/var/lib/docker"


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    severity: Severity  # what a failed check means: error fails the host, warning only reports
    message: str
    fix: str | None = None
    key: str | None = None  # the knob (group_data/all.py) the check is about

    @property
    def failed(self) -> bool:
        return not self.ok and self.severity == "error"

    def describe(self, host_name: str) -> str:
        text = f"{host_name}: {self.name}: {self.message}"
        if self.key:
            text += f" [key: {self.key}]"
        if self.fix:
            text += f" -> fix: {self.fix}"
        return text

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class HostFacts:
    """Everything the checks read about one host (facts, read by rigup.operations.preflight_facts.gather)."""

    os: OsInfo | None
    smi: SmiQuery | None
    pci: tuple[PciDevice, ...] | None
    loaded: LoadedModule | None
    packages: tuple[DebPackage, ...]
    secure_boot: SecureBootState | None
    prebuilt: PrebuiltModules | None
    docker: DockerInfo | None
    docker_snap: bool
    pending_reboot: PendingReboot | None
    disk: Mapping[str, DiskFree] = field(default_factory=dict)
    present_bytes: Mapping[str, int] = field(default_factory=dict)  # path or image ref -> bytes already there
    # rigup.facts.gpu, None without a working driver: memory per GPU (this variant's container's own
    # use excluded), the CUDA version the loaded driver supports, nvidia-smi topo
    gpu_memory: tuple[GpuState, ...] | None = None
    driver_cuda: str | None = None
    topology: Topology | None = None
    gpu_subset: tuple[int, ...] | None = None  # one pod's view (pod_facts): only these GPU indices
    # rigup.facts.network.HttpsTrust: curl's handshake with each https origin the host will reach (None:
    # no curl, or nothing asked)
    tls: Mapping[str, TlsProbe] | None = None

    @property
    def gpus(self) -> tuple[Gpu, ...]:
        """GPUs from nvidia-smi when the driver answers, else from lspci (fresh box, mismatch); in a pod's
        view only its own, under the host's indices."""
        gpus = visible_gpus(self.smi, self.pci)
        return gpus if self.gpu_subset is None else tuple(g for g in gpus if g.index in self.gpu_subset)

    @property
    def gpu_source(self) -> str:
        if self.smi is not None and self.smi.status == "ok":
            return "nvidia-smi"
        return "lspci" if self.pci is not None else "none"

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            out[name] = _jsonable(value)
        out["gpus"] = [_jsonable(g) for g in self.gpus]
        return out


def _jsonable(value: Any) -> Any:
    if hasattr(value, "to_json"):
        return value.to_json()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        # Topology keys GPU pairs by (a, b): "0-1" in JSON
        return {"-".join(map(str, k)) if isinstance(k, tuple) else k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def disk_paths(host_data: Mapping[str, Any], docker: DockerInfo | None) -> dict[str, str]:
    """Role -> rig path whose filesystem holds it: sources, models, the image (Docker's root)."""
    root = str(knob(host_data, "install_root"))
    return {
        "sources": root,
        "models": str(knob(host_data, "model_dir") or f"{root}/models"),
        "image": (docker.root_dir if docker is not None and docker.root_dir else DEFAULT_DOCKER_ROOT),
    }


@dataclass(frozen=True)
class HostRecipe:
    """A host's recipe (one pod's) as the checks see it, and why it is missing or unpinned."""

    recipe: Any | None  # rigup.desired.recipe.Recipe
    error: str | None = None  # why there is no recipe (a failed "recipe" check)
    lock_problem: str | None = None  # why the lock's pins were not used (a "lock" warning)
    pod: Any | None = None  # rigup.desired.pods.Pod; None: the host's pods could not be read


def host_recipe(
    host_data: Mapping[str, Any], host_name: str, topology: Topology | None, base_dir: Path | None = None,
    pod: Any | None = None,
) -> HostRecipe:
    """The recipe every later phase will build (rigup.desired.plan.host_plan: lock pins + the interconnect
    of `topology`) for `pod` (default: the host's only one). Without a usable lock, the catalog's refs
    stand in so the hardware checks still run; the sources, model and serving phases refuse to run
    until `rigup lock` is done."""
    try:
        plan = host_plan(host_data, host_name, topology, base_dir=base_dir, require_lock=False, read_secrets=False,
                         pod=pod)
    except Exception as exc:  # RecipeError, CatalogError, bad knob types: reported as the "recipe" check
        return HostRecipe(None, f"{type(exc).__name__}: {exc}", None, pod)
    return HostRecipe(plan.recipe, None, plan.lock_problem, pod)


def host_recipes(
    host_data: Mapping[str, Any], host_name: str, topology: Topology | None, base_dir: Path | None = None
) -> list[HostRecipe]:
    """host_recipe for each of the host's pods (rigup.desired.pods), in the order it lists them."""
    try:
        pods = pods_of(host_data)
    except Exception as exc:  # a bad pods entry: the "recipe" check says which
        return [HostRecipe(None, f"{type(exc).__name__}: {exc}")]
    return [host_recipe(host_data, host_name, topology, base_dir, pod) for pod in pods]


def recipe_list(recipe: Any) -> list[Any]:
    """A recipe, or the list of a host's pods' recipes, as a list without the missing ones."""
    return [r for r in (recipe if isinstance(recipe, (list, tuple)) else [recipe]) if r is not None]


# --------------------------------------------------------------------------------------------
# The checks


def _ok(name: str, message: str, key: str | None = None) -> Check:
    return Check(name, True, "info", message, None, key)


def _fail(name: str, message: str, fix: str, key: str | None = None, severity: Severity = "error") -> Check:
    return Check(name, False, severity, message, fix, key)


def _norm_os(text: str) -> str:
    return " ".join(str(text).lower().split())


def check_os(facts: HostFacts, host_data: Mapping[str, Any]) -> Check:
    return check_os_release(facts.os, host_data)


def check_os_release(os_info: OsInfo | None, host_data: Mapping[str, Any]) -> Check:
    allowed = [_norm_os(a) for a in knob(host_data, "preflight_os_allowed") or ()]
    if os_info is None:
        return _fail("os", "cannot read /etc/os-release", "check the host is a Debian-family Linux", "preflight_os_allowed")
    if os_info.key in allowed:
        return _ok("os", f"{os_info.key} is allowed", "preflight_os_allowed")
    return _fail(
        "os",
        f"{os_info.key} is not in preflight_os_allowed {allowed}",
        f"use one of {allowed} or add {os_info.key!r} to preflight_os_allowed",
        "preflight_os_allowed",
    )


def check_gpus(facts: HostFacts, recipe: Any | None, host_data: Mapping[str, Any]) -> list[Check]:
    gpus = facts.gpus
    out: list[Check] = []
    if not gpus:
        if facts.pci is None and (facts.smi is None or facts.smi.status != "ok"):
            out.append(
                _fail(
                    "gpus",
                    "no NVIDIA driver answers and lspci is not installed: cannot count GPUs",
                    "apt-get install pciutils (or load the driver)",
                )
            )
        else:
            out.append(_fail("gpus", "no NVIDIA GPU found (nvidia-smi and lspci)", "check the cards are seated and powered"))
        return out
    names = sorted({g.name for g in gpus})
    out.append(_ok("gpus", f"{len(gpus)} GPU(s) via {facts.gpu_source}: {', '.join(names)}"))

    expected = knob(host_data, "gpu_count")
    if expected is not None:
        if int(expected) != len(gpus):
            out.append(
                _fail(
                    "gpu-count",
                    f"gpu_count is {expected} but {len(gpus)} GPU(s) are present",
                    "fix the hardware or set gpu_count for this host to the real number",
                    "gpu_count",
                )
            )
        else:
            out.append(_ok("gpu-count", f"{len(gpus)} GPU(s) as gpu_count says", "gpu_count"))

    want: DriverWant | None
    try:
        want = DriverWant.from_data(host_data)
    except ValueError:
        want = None
    if want is not None and want.flavour == "open":
        old = [g for g in gpus if g.compute_capability is not None and g.compute_capability < OPEN_MODULES_MIN_CC]
        if old:
            out.append(
                _fail(
                    "open-modules",
                    f"open kernel modules need Turing (7.5) or newer; {old[0].name} is {old[0].cc_text}",
                    "set nvidia_driver_flavour: proprietary",
                    "nvidia_driver_flavour",
                )
            )

    if recipe is None:
        return out
    # The GPU count against tensor parallelism and the VRAM are the fit's (gpu-layout, vram-fit).
    need = int(recipe.gpu_count)
    variant = recipe.variant
    used = gpus[:need] if len(gpus) >= need else gpus
    min_cc = tuple(recipe.min_compute_capability)
    unknown = [g for g in used if g.compute_capability is None]
    too_old = [g for g in used if g.compute_capability is not None and g.compute_capability < min_cc]
    if too_old:
        g = too_old[0]
        out.append(
            _fail(
                "compute-capability",
                f"GPU {g.index} ({g.name}) has compute capability {g.cc_text}; variant {variant!r} needs "
                f">= {min_cc[0]}.{min_cc[1]}",
                "use newer GPUs or a variant that supports this card",
                "variant",
            )
        )
    elif unknown:
        out.append(
            Check(
                "compute-capability",
                False,
                "warning",
                f"{unknown[0].name} is not a known card and no driver is loaded: compute capability "
                f"unchecked; {rechecked_when(facts, host_data)}",
                None,
                "variant",
            )
        )
    else:
        out.append(_ok("compute-capability", f"all used GPUs >= {min_cc[0]}.{min_cc[1]}", "variant"))

    return out


def rechecked_when(facts: HostFacts, host_data: Mapping[str, Any]) -> str:
    """When a check that needs the driver runs again (rigup.operations.preflight.preflight_after_driver re-runs
    every check once the driver op rebooted the host onto a new driver)."""
    try:
        want = DriverWant.from_data(host_data)
    except ValueError:
        return "re-checked once the driver is loaded"
    if plan_driver(want, facts.packages, facts.loaded).action == "none":
        return "re-checked by the next deploy once nvidia-smi answers"
    if knob(host_data, "driver_reboot") == "auto":
        return "re-checked after the driver's reboot, before Docker and the model are set up"
    return "re-checked by the next deploy once the host has been rebooted onto the driver (driver_reboot: never)"


FIT_SEVERITY: dict[str, Severity] = {"fail": "error", "warn": "warning", "info": "info"}


def _pre_driver_vram(check: Check, facts: HostFacts, recipe: Any, host_data: Mapping[str, Any]) -> Check:
    """vram-fit on GPUs only lspci knows: memory from the PCI id table, or honestly unknown."""
    unknown = [g for g in facts.gpus[: recipe.gpu_count] if g.memory_mib is None]
    if not unknown:
        return dataclasses.replace(check, message=f"no driver yet, memory from the PCI ids: {check.message}")
    g = unknown[0]
    dev = next((d for d in facts.pci or () if d.bus_id == g.bus_id), None)
    known = known_gpu(device_id=dev.device_id) if dev is not None else None
    if known is not None and known.memory_note:
        why = known.memory_note
    else:
        why = f"PCI id 10de:{dev.device_id} is not in rigup's table of cards" if dev is not None else "not a known card"
    return Check(
        "vram-fit",
        False,
        "warning",
        f"VRAM unknown until the driver loads: GPU {g.index} ({g.name}): {why}; {rechecked_when(facts, host_data)}",
        None,
        "preflight_vram_misfit",
    )


def check_fit(facts: HostFacts, recipe: Any | None, host_data: Mapping[str, Any], plan: DriverPlan | None) -> list[Check]:
    """rigup.checks.fit.assess as checks: cuda-compat, gpu-layout, gpu-mix, vram-fit, vram-driver, interconnect."""
    gpus: tuple[Any, ...] = facts.gpu_memory if facts.gpu_memory is not None else facts.gpus
    if recipe is None or not gpus:
        return []  # no recipe, or no GPU: the "recipe" / "gpus" checks say so
    # The loaded driver's CUDA only matters when this run keeps it; otherwise driver-cuda checks the planned branch.
    keeps_driver = plan is None or plan.action == "none"
    cuda = facts.driver_cuda if keeps_driver else None
    out: list[Check] = []
    for f in assess(recipe, gpus, cuda, str(knob(host_data, "preflight_vram_misfit"))):
        if f.name == "cuda-compat" and not keeps_driver:
            continue
        check = Check(f.name, f.ok, FIT_SEVERITY[f.severity], f.message, f.fix, f.key)
        if f.name == "vram-fit" and facts.gpu_memory is None and facts.gpu_source == "lspci":
            check = _pre_driver_vram(check, facts, recipe, host_data)
        out.append(check)
    return out


def check_power_cap(facts: HostFacts, host_data: Mapping[str, Any]) -> Check | None:
    cap = power_cap(host_data, facts.gpus)
    key = "gpu_power_cap_watts" if knob(host_data, "gpu_power_cap_watts") is not None else "gpu_power_cap_by_model"
    if cap.watts is None:
        return _ok("power-cap", cap.reason, key)
    if facts.smi is None or facts.smi.status != "ok":
        return _ok("power-cap", f"{cap.reason}; the cards' limits are checked once the driver answers", key)
    for g in facts.smi.gpus:
        low, high = g.power_min_w, g.power_max_w
        if (low is not None and cap.watts < low) or (high is not None and cap.watts > high):
            span = f"{'?' if low is None else f'{low:g}'}-{'?' if high is None else f'{high:g}'}"
            return _fail(
                "power-cap",
                f"{cap.reason}: outside GPU {g.index}'s ({g.name}) range {span} W",
                f"set gpu_power_cap_watts within {span} W (or null to keep the default)",
                key,
            )
    for g in facts.smi.gpus:
        default = g.power_default_w
        if default is not None and cap.watts < LOW_CAP_SHARE * default:
            return _fail(
                "power-cap",
                f"{cap.reason}: below {LOW_CAP_SHARE:.0%} of GPU {g.index}'s ({g.name}) default limit {default:g} W",
                f"set gpu_power_cap_watts for this card, or null to keep its {default:g} W",
                key,
                severity="warning",
            )
    return _ok("power-cap", f"{cap.reason}, within every GPU's power range", key)


def driver_plan(facts: HostFacts, host_data: Mapping[str, Any]) -> tuple[DriverWant | None, DriverPlan | None, Check]:
    try:
        want = DriverWant.from_data(host_data)
    except ValueError as exc:
        key = str(exc).split(" ", 1)[0]
        return None, None, _fail("driver", str(exc), "use an allowed value (see group_data/all.py)", key)
    plan = plan_driver(want, facts.packages, facts.loaded)
    if plan.action == "none":
        return want, plan, _ok("driver", plan.summary, "nvidia_driver_branch")
    verb = "will install" if plan.action == "install" else "will reboot"
    return want, plan, Check("driver", False, "warning", f"{verb}: {plan.summary}", None, "nvidia_driver_branch")


def check_reboot_policy(host_data: Mapping[str, Any]) -> Check | None:
    policy = knob(host_data, "driver_reboot")
    if policy in REBOOT_POLICIES:
        return None
    return _fail("driver-reboot", f"driver_reboot is {policy!r}", f"use one of {list(REBOOT_POLICIES)}", "driver_reboot")


def check_driver_cuda(want: DriverWant | None, plan: DriverPlan | None, recipe: Any | None) -> Check | None:
    if want is None or recipe is None:
        return None
    branch = plan.installed.branch if plan is not None and plan.installed is not None else want.branch
    supported = branch_cuda(branch)
    needed = tuple(int(p) for p in str(recipe.image.cuda_runtime).split(".")[:2])
    if supported is None:
        return _fail(
            "driver-cuda",
            f"driver branch {branch} is older than any branch rigup knows",
            "set nvidia_driver_branch to 580 or newer",
            "nvidia_driver_branch",
        )
    if supported < needed:
        newer = min((b for b, c in BRANCH_CUDA.items() if c >= needed), default=None)
        return _fail(
            "driver-cuda",
            f"driver branch {branch} supports CUDA {supported[0]}.{supported[1]}; the image needs "
            f"{recipe.image.cuda_runtime} (fails with error 804 at start)",
            f"set nvidia_driver_branch to {newer}" if newer else "use an image with an older CUDA runtime",
            "nvidia_driver_branch",
        )
    return _ok(
        "driver-cuda",
        f"branch {branch} supports CUDA {supported[0]}.{supported[1]} >= image {recipe.image.cuda_runtime}",
        "nvidia_driver_branch",
    )


def check_secure_boot(facts: HostFacts, want: DriverWant | None, plan: DriverPlan | None) -> Check:
    state = facts.secure_boot
    if want is None or plan is None or plan.action != "install":
        return _ok("secure-boot", f"Secure Boot {state or 'unknown'}; no driver install needed", "nvidia_driver_source")
    prebuilt = facts.prebuilt is not None and facts.prebuilt.available
    unsigned = needs_unsigned_modules(want, prebuilt)
    if not unsigned:
        return _ok(
            "secure-boot",
            f"Secure Boot {state or 'unknown'}; Canonical-signed modules exist for kernel {facts.prebuilt.kernel}"  # type: ignore[union-attr]
            if facts.prebuilt is not None
            else f"Secure Boot {state or 'unknown'}",
            "nvidia_driver_source",
        )
    why = (
        "the CUDA repository's driver builds its modules with DKMS"
        if want.source == "cuda"
        else f"Ubuntu's archive has no signed linux-modules-nvidia-{want.branch_flavour} package for the running "
        "kernel, so the driver would be built with DKMS"
    )
    if state == "enabled":
        return _fail(
            "secure-boot",
            f"Secure Boot is on and {why}: the unsigned module would not load",
            "use nvidia_driver_source: ubuntu on a kernel with signed linux-modules-nvidia packages, "
            "enroll a MOK key for DKMS, or turn Secure Boot off in the firmware",
            "nvidia_driver_source",
        )
    if state is None:
        return Check(
            "secure-boot",
            False,
            "warning",
            f"Secure Boot state unknown (mokutil missing) and {why}",
            "apt-get install mokutil to let preflight check",
            "nvidia_driver_source",
        )
    return _ok("secure-boot", f"Secure Boot {state}; DKMS-built modules will load", "nvidia_driver_source")


def check_disk(facts: HostFacts, recipe: Any | None, host_data: Mapping[str, Any]) -> list[Check]:
    """Room for what is still to download; `recipe` may be the list of the host's pods' recipes (each
    model, source and image counted once)."""
    recipes = recipe_list(recipe)
    if not recipes:
        return []
    margin_gb = float(knob(host_data, "preflight_disk_margin_gb"))
    paths = disk_paths(host_data, facts.docker)
    # (role, path that will hold it, GB still to download/unpack)
    items: list[tuple[str, str, float]] = []
    for m in {m.path: m for r in recipes for m in r.models}.values():
        have = facts.present_bytes.get(m.path, 0) / 1e9
        items.append((f"model {m.repo_id}", paths["models"], max(0.0, m.approx_size_gb - have)))
    for s in {s.path: s for r in recipes for s in r.sources}.values():
        have = facts.present_bytes.get(s.path, 0) / 1e9
        items.append((f"source {s.name}", paths["sources"], max(0.0, s.approx_size_gb - have)))
    for image in {r.image.ref: r.image for r in recipes}.values():
        have_image = facts.present_bytes.get(image.ref, 0) / 1e9
        items.append((f"image {image.repository}", paths["image"], max(0.0, image.approx_size_gb - have_image)))

    by_fs: dict[tuple[str, str], list[tuple[str, float]]] = {}
    avail: dict[tuple[str, str], float] = {}
    out: list[Check] = []
    for role, path, gb in items:
        disk = facts.disk.get(path)
        if disk is None:
            out.append(_fail("disk", f"no free-space reading for {path}", "check the path is reachable", "install_root"))
            continue
        fs = (disk.filesystem, disk.mount)
        by_fs.setdefault(fs, []).append((role, gb))
        avail[fs] = disk.avail_gb
    for fs, roles in sorted(by_fs.items()):
        need = sum(gb for _, gb in roles) + margin_gb
        what = ", ".join(f"{role} {gb:.1f} GB" for role, gb in roles)
        if avail[fs] < need:
            out.append(
                _fail(
                    "disk",
                    f"{fs[1]} has {avail[fs]:.1f} GB free; needs {need:.1f} GB ({what} + margin {margin_gb:g} GB)",
                    f"free {need - avail[fs]:.1f} GB on {fs[1]}, move install_root/model_dir, or lower "
                    "preflight_disk_margin_gb",
                    "preflight_disk_margin_gb",
                )
            )
        else:
            out.append(_ok("disk", f"{fs[1]}: {avail[fs]:.1f} GB free >= {need:.1f} GB ({what} + margin)", "preflight_disk_margin_gb"))
    return out


def check_docker_snap(facts: HostFacts) -> Check:
    if facts.docker_snap:
        return _fail(
            "docker-snap",
            "Docker is installed as a snap; the NVIDIA container toolkit cannot configure it",
            "sudo snap remove docker (rigup installs Docker CE from Docker's apt repository)",
        )
    return _ok("docker-snap", "no snap Docker")


def check_pending_reboot(facts: HostFacts, plan: DriverPlan | None) -> Check | None:
    pending = facts.pending_reboot
    if pending is None or not pending.required:
        return None
    kernel = [p for p in pending.packages if p.startswith("linux-")]
    if kernel:
        return Check(
            "pending-reboot",
            False,
            "warning",
            f"a reboot is pending for {', '.join(kernel)}: the next boot runs another kernel",
            "reboot the host before the deploy so the driver is checked against the kernel that will run",
        )
    return Check("pending-reboot", False, "warning", "the host flags a pending reboot", "reboot at a convenient time")


def check_container_network(recipe: Any | None, host_data: Mapping[str, Any]) -> Check | None:
    """Some upstream recipes pip-install packages at every container start: they need PyPI then."""
    if recipe is None or not recipe.needs_network_at_start:
        return None
    what = f"variant {recipe.variant!r}: upstream's entrypoint runs pip install at every container start"
    if knob(host_data, "container_network_at_start"):
        return _ok("container-network", f"{what} (allowed: container_network_at_start)", "container_network_at_start")
    return _fail("container-network", f"{what}, and container_network_at_start is false",
                 "allow the rig to reach PyPI and set container_network_at_start: true, or pick a variant that "
                 f"installs nothing at start ({command()} render --list)", "container_network_at_start")


def check_https_trust(tls: Mapping[str, TlsProbe] | None, host_data: Mapping[str, Any], gateway: bool = False) -> Check | None:
    """The host trusts the certificate of every https server the fleet file names for it (rigup.desired.trust):
    one failed check naming the first URL it does not trust, its knob, how many more, and curl's reason, before
    apt, git, pip or Docker meet it half-way through the converge. None where curl could not check (no curl)."""
    if tls is None:
        return None
    urls = https_urls(host_data, gateway=gateway)
    found = untrusted_line(urls, tls)
    if found is not None:
        name, line = found
        return _fail("https-trust", line, TRUST_FIX, name)
    return _ok("https-trust", f"{len(tls)} HTTPS server{'s' if len(tls) != 1 else ''} checked: every certificate trusted")


def check_boundary(host_data: Mapping[str, Any]) -> Check | None:
    """With `firewall: false` the host has no default deny (rigup.desired.boundary): every service it runs
    answers whoever reaches it, most of them without asking who is calling (docs/security.md)."""
    if knob(host_data, "firewall"):
        return None
    return _fail("firewall", "firewall is false: no default deny; the pods' /invocations, /tokenize and /pause, "
                 "the exporters, Prometheus and Ray answer anyone who reaches this host", "set firewall: true (the "
                 "default), adding your own networks to firewall_allow", "firewall", severity="warning")


def check_capabilities(caps: Capabilities | None, host_data: Mapping[str, Any]) -> list[Check]:
    """What the host can run, before any other fact is read: root or passwordless sudo, systemd as
    the running init, apt, and Docker present or installable. "privileges" failing means the other
    facts cannot be read at all (they run through sudo). caps None: the probe itself failed."""
    if caps is None:
        return [_fail("privileges", "could not read what the host can run (the probe failed; see the log above)",
                      "check that the login works and runs sh", "_sudo")]
    out: list[Check] = []
    sudo = bool(knob(host_data, "_sudo"))
    who = "root" if caps.root else f"uid {caps.uid}"
    if caps.root and sudo and caps.sudo == "absent":
        out.append(_fail("privileges", "logged in as root, but _sudo is true and sudo is not installed",
                         "set _sudo: false for this host (root needs no sudo)", "_sudo"))
    elif caps.root:
        out.append(_ok("privileges", "logged in as root", "_sudo"))
    elif not sudo:
        out.append(_fail("privileges", f"logged in as {who} with _sudo false: rigup installs packages and units as root",
                         "set _sudo: true and allow the user passwordless sudo, or log in as root", "_sudo"))
    elif caps.sudo == "absent":
        out.append(_fail("privileges", f"logged in as {who} and sudo is not installed",
                         "install sudo and allow the user passwordless sudo (NOPASSWD), or log in as root with _sudo: false", "_sudo"))
    elif caps.sudo == "password":
        out.append(_fail("privileges", f"sudo asks {who} for a password",
                         "allow the SSH user passwordless sudo (NOPASSWD in /etc/sudoers.d/), or log in as root", "_sudo"))
    else:
        out.append(_ok("privileges", f"{who} with passwordless sudo", "_sudo"))
    systemd = caps.pid1 == "systemd" and caps.systemd_running and "systemctl" in caps.tools
    if systemd:
        out.append(_ok("systemd", "systemd is the running init"))
    else:
        found = f"process 1 is {caps.pid1 or 'unknown'!r}" + ("" if caps.systemd_running else ", /run/systemd/system is absent")
        out.append(_fail("systemd", f"{found}: rigup's units (serving, GPU power), Docker and driver reboots need systemd",
                         "deploy to a host booted with systemd (a container without systemd cannot be a rig)"))
    apt = {"apt-get", "dpkg"} <= set(caps.tools)
    if apt:
        out.append(_ok("apt", "apt-get and dpkg are installed"))
    else:
        out.append(_fail("apt", "apt-get or dpkg is missing: rigup installs Docker, the toolkit and drivers with apt",
                         "use Ubuntu 22.04 or 24.04", "preflight_os_allowed"))
    if "docker" in caps.tools:
        out.append(_ok("docker", "docker is installed"))
    elif systemd and apt:
        out.append(_ok("docker", "docker is not installed; the docker phase installs it from Docker's repository"))
    else:
        out.append(_fail("docker", "docker is not installed and cannot be installed here (needs systemd and apt)",
                         "deploy to a host booted with systemd and apt, or one with a working Docker engine"))
    return out


def privileges_missing(checks: Sequence[Check]) -> bool:
    """The capability checks say the facts that need root cannot be read."""
    return any(c.name == "privileges" and c.failed for c in checks)


def run_checks(
    facts: HostFacts,
    recipe: Any | None,
    host_data: Mapping[str, Any],
    recipe_error: str | None = None,
    lock_problem: str | None = None,
) -> list[Check]:
    """Every preflight check for one host, in a stable order.

    + facts: what rigup.operations.preflight_facts.gather read from the host
    + recipe: the host's recipe (`host_recipe`), or None when it could not be built
    + host_data: the host's knobs
    + recipe_error: why the recipe could not be built (reported as a failed check)
    + lock_problem: why the lock's pins could not be used (reported as a warning)
    """
    checks: list[Check] = [check_os(facts, host_data)]
    if recipe is None:
        checks.append(
            _fail(
                "recipe",
                f"no recipe for this host: {recipe_error or 'unknown error'}",
                f"fix variant / variant_overrides ({command()} render --list)",
                "variant",
            )
        )
    else:
        checks.append(_ok("recipe", f"variant {recipe.variant!r}", "variant"))
    if lock_problem is not None:
        checks.append(
            Check(
                "lock",
                False,
                "warning",
                f"checked against the catalog's refs: {lock_problem}",
                f"{LOCK_COMMAND} (the sources, model and serving phases refuse to run without it)",
                "lock_file",
            )
        )
    checks += check_gpus(facts, recipe, host_data)
    want, plan, driver_check = driver_plan(facts, host_data)
    checks += check_fit(facts, recipe, host_data, plan)
    checks.append(driver_check)
    for extra in (
        check_reboot_policy(host_data),
        check_driver_cuda(want, plan, recipe),
        check_secure_boot(facts, want, plan),
        check_power_cap(facts, host_data),
        check_docker_snap(facts),
        check_pending_reboot(facts, plan),
        check_container_network(recipe, host_data),
        check_boundary(host_data),
        check_https_trust(facts.tls, host_data),
    ):
        if extra is not None:
            checks.append(extra)
    checks += check_disk(facts, recipe, host_data)
    return checks


# Checks about one pod's recipe on its own GPUs; the others are about the host, once.
POD_CHECKS = frozenset({
    "recipe", "lock", "compute-capability", "cuda-compat", "gpu-layout", "gpu-mix", "vram-fit", "vram-driver",
    "vram-policy", "interconnect", "driver-cuda", "container-network",
})


def pod_facts(facts: HostFacts, gpu_ids: Sequence[int]) -> HostFacts:
    """`facts` as one pod sees the host: only its GPUs, under the host's indices, so the fit, layout and
    compute capability are judged (and named) on the cards its container gets."""
    wanted = tuple(gpu_ids)
    memory = None if facts.gpu_memory is None else tuple(g for g in facts.gpu_memory if g.index in wanted)
    return dataclasses.replace(facts, gpu_subset=wanted, gpu_memory=memory)


def check_pod_layout(facts: HostFacts, built: Sequence[HostRecipe]) -> list[Check]:
    """The host's pods side by side: each GPU it names exists, and no two pods publish one port (the
    pods knob refuses a GPU given twice)."""
    out: list[Check] = []
    present = {g.index for g in facts.gpus}
    for b in built:
        missing = sorted(set(b.pod.gpus or ()) - present) if b.pod is not None else []
        if missing and present:
            out.append(_fail("pods", f"{b.pod.label()} owns GPU(s) {', '.join(map(str, missing))}; this host has "
                             f"GPU(s) {', '.join(map(str, sorted(present)))}", "give each pod GPUs the host has", "pods"))
    clashes = ports_used_twice([(b.pod, b.recipe.host_port) for b in built if b.recipe is not None and b.pod is not None])
    for problem in clashes:
        out.append(_fail("pods", problem, "give each pod its own port (its `port` key)", "pods"))
    if not out:
        out.append(_ok("pods", "; ".join(f"{b.pod.label()} on GPU(s) {', '.join(map(str, b.pod.gpus or ()))}"
                                         + (f", port {b.recipe.host_port}" if b.recipe is not None else "")
                                         for b in built if b.pod is not None), "pods"))
    return out


def run_host_checks(facts: HostFacts, built: Sequence[HostRecipe], host_data: Mapping[str, Any]) -> list[Check]:
    """Every preflight check for a host and its pods (host_recipes): run_checks for a host of one
    unlisted pod; for a host that lists pods, the host's checks once, the pods' layout, the disk for
    all of them, and each pod's recipe checks on its own GPUs, named "<check> (<pod>)"."""
    if len(built) == 1 and (built[0].pod is None or not built[0].pod.listed):
        only = built[0]
        return run_checks(facts, only.recipe, host_data, only.error, only.lock_problem)
    checks = [c for c in run_checks(facts, None, host_data) if c.name not in POD_CHECKS and c.name != "disk"]
    checks += check_pod_layout(facts, built)
    for b in built:
        data = pod_data(host_data, b.pod)
        narrowed = pod_facts(facts, b.pod.gpus or ())
        for c in run_checks(narrowed, b.recipe, data, b.error, b.lock_problem):
            if c.name in POD_CHECKS:
                checks.append(dataclasses.replace(c, name=f"{c.name} ({b.pod.name})"))
    checks += check_disk(facts, [b.recipe for b in built if b.recipe is not None], host_data)
    return checks


# The entrance's pinned router venv (vllm-router and its launcher's imports) and nginx take about 0.1 GB installed;
# kept at 1 GB, room for a new pin's venv built beside the running one.
GATEWAY_VENV_GB = 1.0


def gateway_host_checks(
    caps: Capabilities | None, os_info: Any, disk: Mapping[str, Any], host_data: Mapping[str, Any],
    tls: Mapping[str, TlsProbe] | None = None,
) -> list[Check]:
    """Preflight of a gateway-only host (serves_variant: false): it needs root, systemd, apt, an allowed
    OS, room for the gateway's venv and to trust its pip index's certificate (`tls`: HttpsTrust); no GPU,
    driver or Docker."""
    checks = [c for c in check_capabilities(caps, host_data) if c.name != "docker"]
    if privileges_missing(checks):
        return checks
    checks.append(check_os_release(os_info, host_data))
    for extra in (check_boundary(host_data), check_https_trust(tls, host_data, gateway=True)):
        if extra is not None:
            checks.append(extra)
    root = str(knob(host_data, "install_root"))
    free = disk.get(root)
    need = GATEWAY_VENV_GB + float(knob(host_data, "preflight_disk_margin_gb"))
    if free is None:
        checks.append(_fail("disk", f"no free-space reading for {root}", "check the path is reachable", "install_root"))
    elif free.avail_gb < need:
        checks.append(_fail("disk", f"{free.mount} has {free.avail_gb:.1f} GB free; the gateway needs {need:.1f} GB "
                            f"(venv {GATEWAY_VENV_GB:g} GB + margin)", f"free space on {free.mount} or move install_root",
                            "preflight_disk_margin_gb"))
    else:
        checks.append(_ok("disk", f"{free.mount}: {free.avail_gb:.1f} GB free >= {need:.1f} GB (gateway venv + margin)",
                          "preflight_disk_margin_gb"))
    return checks


def failures(checks: list[Check]) -> list[Check]:
    return [c for c in checks if c.failed]


def check_cluster_network(network: Any, peers: Sequence[Any]) -> list[Check]:
    """A cluster member's network (rigup.desired.cluster.MemberNetwork), and its MTU against the other
    members' (`peers`: theirs, read on them): one failed check when the member cannot be wired, a warning
    per thing that costs speed, else what was chosen."""
    if network is None:
        return []
    if network.net is None:
        return [_fail("cluster-network", str(network.problem),
                      "put the members on one private network each reaches the others over", "clusters")]
    out = [_fail("cluster-network", warning, "a faster, switched link between the members", "clusters",
                 severity="warning") for warning in network.warnings]
    mismatch = mtu_disagreement([network, *peers])
    if mismatch is not None:
        out.append(_fail("cluster-network", mismatch, "set one MTU on every member's interface", "clusters"))
    skew = clock_skew([network, *peers])
    if skew is not None:
        out.append(_fail("cluster-clock", skew, "enable NTP on every member", "clusters", severity="warning"))
    speed = f"{network.speed_mbps} Mb/s" if network.speed_mbps else "speed unknown"
    out.append(_ok("cluster-network", f"{network.net.ifname} ({speed}, MTU {network.mtu}): this member is "
                   f"{network.net.address}, the head {network.net.head_address}", "clusters"))
    return out
