"""The hub: services the test-bed hosts use instead of the internet, run inside the hub namespace.

    hub = Hub(workdir, "10.213.0.1", netns="rigup-hub", ledger=ledger, cgroup_rel="rigup/hub")
    hub.start()
    hub.urls           # knob of group_data/all.py -> URL at the hub (plus ubuntu_archive_url/_key_url)
    hub.host_files()   # files every host gets at creation: the stand-in distribution archive as apt source
    hub.preinstall()   # .debs every host has before first boot (pciutils, mokutil stand-ins)
    hub.stop()

Services (fixed ports: the hub namespace is ours alone), each a process started detached inside the hub
namespace and the hub's cgroup, recorded in the ledger, and up once it wrote its ready file. Every one
speaks HTTPS, as the internet they stand in for does: a server certificate for the hub's address, issued
at start by the machine's test-bed CA (rigup_testbed/tls.py), which the rigs trust as an Ubuntu box trusts
a CA (Testbed installs it in their image's store: image.ensure_layer); `ca_cert` is that CA's certificate,
what the control machine's clients check the hub with (the fleet file's ca_bundle). `tls=False`: plain HTTP.

    apt       :8080  static HTTPS over the signed stand-in repos (rigup_testbed/aptrepo.py, built once
                     per content hash under the cache): docker_apt_url, nvidia_ctk_apt_url,
                     nvidia_cuda_repo_url and their key URLs, plus the stand-in Ubuntu archive;
                     engine_docker_apt_url/_key_url: Docker CE's packages holding the real engine
    registry  :5000  Registry v2 manifests, digests as the stand-in Docker engine pulls them, holding the
                     catalog's digest-pinned images at their digests (rigup_testbed/hubserve.py):
                     container_registry
    engine-registry :5001  the real distribution registry (Debian's docker-registry) holding images the
                     bed builds (rigup_testbed/registry.py): engine_registry, engine_registry_images,
                     engine_registry_log (its log: the bytes it served, served_blob_bytes)
    hf        :8082  Hugging Face endpoint (rigup_testbed/hfhub.py): hf_endpoint. Like the real Hub it
                     answers an LFS file's /resolve/ with a 302 to its CDN, another origin (:8084)
    git       :8081  smart HTTPS (git http-backend; GitHub serves https and turned git:// off in 2022) with
                     the fork, Genesis and club-3090 remotes (rigup_testbed/gitremotes.py): every
                     *_git_url knob, same <owner>/<name>.git path, and source_refs (the stand-ins' SHAs)
    pypi      :8083  static HTTPS over a PEP 503 simple index of the wheels files/router/requirements.txt
                     pins for the hosts' CPython 3.11 (rigup_testbed/pypi.py, built once per content hash
                     under the cache): gateway_pip_index_url (<base>/simple)

Without `netns`/`ledger` the services run in the current namespace, recorded in workdir/hub-state.json.
"""

from __future__ import annotations

import ast
import json
import os
import re
import sys
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rigup.desired.catalog import load_catalog
from rigup.desired.knobs import KNOBS_FILE
from rigup_testbed import PACKAGE_DIR
from rigup_testbed.aptrepo import build_repos
from rigup_testbed.gitremotes import source_refs_of
from rigup_testbed.image import REPO_ROOT, cache_dir
from rigup_testbed.pypi import build_index
from rigup_testbed.registry import ray_wheels
from rigup_testbed.state import Ledger, TestbedError, is_same_process, spawn, stop_process
from rigup_testbed.tls import BedCA, ServerCert, ensure_bed_ca, issue_server_cert

# Fixed ports: the hub namespace is ours alone, so nothing else can hold them and URLs stay readable.
PORTS = {"apt": 8080, "git": 8081, "hf": 8082, "hf_cdn": 8084, "pypi": 8083, "registry": 5000, "engine_registry": 5001}
GATEWAY_REQUIREMENTS = REPO_ROOT / "files" / "router" / "requirements.txt"  # the entrance's vllm-router
READY_TIMEOUT_S = 60.0
PREINSTALLED = ("pciutils", "mokutil")
# What rigup's host layer (tasks/nvidia_driver.py, docker.py, container_toolkit.py) installs on a bed's Debian 12 rig
# with the fleet's defaults (nvidia_driver_branch 580, nvidia_driver_flavour open, the real engine, the newest toolkit),
# as (the hub's repository directory, packages): a bed whose module tests what comes after the host layer can start
# with them installed (Testbed.up(host_layer=True)), as an image baked with them would.
HOST_LAYER_PACKAGES = (
    ("ubuntu-archive/pool/restricted/n/nvidia-graphics-drivers-580",
     ("nvidia-driver-580-open", "nvidia-dkms-580-open", "nvidia-kernel-common-580", "nvidia-utils-580")),
    ("docker-engine/linux/ubuntu/dists/bookworm/pool/stable/amd64",
     ("containerd.io", "docker-ce", "docker-ce-cli", "docker-compose-plugin")),
    ("libnvidia-container/stable/deb/amd64",
     ("libnvidia-container1", "libnvidia-container-tools", "nvidia-container-toolkit-base", "nvidia-container-toolkit")),
)


@dataclass
class Service:
    """One hub process: how to start it and which knobs its ready file answers."""

    name: str
    module: str
    args: list[str]
    ready_file: Path
    # ready-file JSON -> {knob: url}
    knobs: Callable[[dict[str, Any]], dict[str, str]]
    entry: dict[str, Any] | None = None
    ready: dict[str, Any] = field(default_factory=dict)


def _deb_version(deb: Path) -> list[tuple[int, int | str]]:
    """A sort key of a .deb file's version (name_VERSION_arch.deb): its digit runs compared as numbers, as dpkg
    compares them (enough for one package's versions in one repository)."""
    version = deb.name.split("_")[1]
    return [(0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"(\d+)", version) if part]


def newest_deb(directory: Path, name: str) -> Path:
    """The newest .deb of package `name` in `directory` of the hub's repositories."""
    found = sorted(directory.glob(f"{name}_*.deb"), key=_deb_version)
    if not found:
        raise TestbedError(f"the hub's repositories have no {name} package under {directory}")
    return found[-1]


def host_layer_debs(repos: Path) -> list[Path]:
    """The newest .deb of each of HOST_LAYER_PACKAGES under `repos` (rigup_testbed.aptrepo's tree): what rigup's host
    layer installs from those repositories on a bed's rig."""
    return [newest_deb(repos / directory, name) for directory, names in HOST_LAYER_PACKAGES for name in names]


def url_knobs(group_data: Path = KNOBS_FILE) -> dict[str, str | None]:
    """Knobs of group_data/all.py that name something outside the rig (every *_url, *_endpoint, and
    the container registry) with their defaults (None: unset, e.g. pip's own configured index): what
    the hub stands in for, so the test bed must point each of them at the hub."""
    tree = ast.parse(group_data.read_text())
    knobs: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            if name.endswith(("_url", "_endpoint")) or name == "container_registry":
                value = ast.literal_eval(node.value)
                knobs[name] = None if value is None else str(value)
    return knobs


def unserved_vllm_repository(base: str) -> dict[str, str]:
    """vLLM's repository, read for its Grafana dashboards only when `grafana` is on, which the bed cannot
    install: GitHub's path on the hub's git server, which holds no repository there (the dashboards'
    reading at a commit is unit-tested on a local repository laid out as vLLM's)."""
    return {"vllm_git_url": f"{base.rstrip('/')}/vllm-project/vllm.git"}


def unserved_grafana(base: str) -> dict[str, str]:
    """Grafana's apt knobs, at a path of the hub that holds nothing: no Grafana package is reachable from
    this machine, so the bed cannot install it (the `grafana` knob stays off; its dashboards' queries are
    run against the bed's real Prometheus instead). Pointed at the hub all the same: no knob of the bed
    names the internet."""
    return {"grafana_apt_url": f"{base.rstrip('/')}/grafana-not-served",
            "grafana_apt_key_url": f"{base.rstrip('/')}/grafana-not-served/gpg.key"}


def _source_refs(remotes: dict[str, Any]) -> dict[str, str]:
    return source_refs_of(remotes)


def _git_knobs(base: str, root: Path) -> dict[str, str]:
    """Every *_git_url knob whose GitHub repo the hub serves, at the same <owner>/<name>.git path."""
    out: dict[str, str] = {}
    for knob, default in url_knobs().items():
        if not knob.endswith("_git_url") or default is None:
            continue
        path = urllib.parse.urlsplit(default).path.strip("/")
        if (root / path).is_dir():
            out[knob] = f"{base.rstrip('/')}/{path}"
    return out


def catalog_pinned_images() -> dict[str, str]:
    """{"repo:tag": digest} of every catalog image upstream pins by digest (its tag moves): the hub's
    registry is told it holds exactly these under those tags, so a recipe's repo:tag@digest pulls from it
    and `rigup lock --image-digests` finds the digest there, while another digest of the repository is
    unknown as on the real registry."""
    return {f"{spec['repository']}:{spec['tag']}": str(spec["digest"])
            for spec in load_catalog()["images"].values() if spec.get("digest")}


class Hub:
    def __init__(
        self,
        workdir: Path,
        ip: str,
        *,
        netns: str | None = None,
        ledger: Ledger | None = None,
        cgroup_rel: str | None = None,
        python_root: Path | None = None,
        tls: bool = True,
    ) -> None:
        self.workdir = workdir
        self.tls = tls
        self.ca: BedCA | None = None  # the test-bed CA that issued the services' certificate (tls)
        self.server_cert: ServerCert | None = None
        self.python_root = python_root  # the rigs' root file system: the engine registry's images take Python from it
        self.ip = ip
        self.netns = netns
        self.ledger = ledger if ledger is not None else Ledger(workdir / "hub-state.json")
        self.cgroup_rel = cgroup_rel
        self.services: list[Service] = []
        self._host_files: dict[str, str | bytes] = {}
        self.repo_info: Any = None
        self.pypi_root: Path | None = None  # the built simple index's directory (rigup_testbed/pypi.py)

    # --- the services ----------------------------------------------------------------------------

    def _tls_args(self, *, with_ca: bool = False) -> list[str]:
        """The services' --tls-cert/--tls-key (and the CA, for a service that checks itself); none without tls."""
        if self.server_cert is None:
            return []
        ca = ["--tls-ca", str(self.ca.cert)] if with_ca and self.ca is not None else []
        return ["--tls-cert", str(self.server_cert.cert), "--tls-key", str(self.server_cert.key), *ca]

    @property
    def ca_cert(self) -> Path | None:
        """The CA certificate the hub's services are checked with (None: plain HTTP)."""
        return self.ca.cert if self.ca is not None else None

    def _plan(self) -> list[Service]:
        w, ip = self.workdir, self.ip
        info = self.repo_info
        tls = self._tls_args()
        return [
            Service(
                name="apt",
                module="rigup_testbed.hubserve",
                args=["static", "--root", str(info.root), "--bind", ip, "--port", str(PORTS["apt"]),
                      "--ready-file", str(w / "apt/ready.json"), *tls],
                ready_file=w / "apt/ready.json",
                # engine_*: Docker's repository with the real engine inside (Testbed.fleet points the fleet's
                # docker_apt_url there unless real_engine=False)
                knobs=lambda r: {**info.urls(r["url"]), **{f"engine_{k}": v for k, v in info.engine_urls(r["url"]).items()},
                                 **unserved_grafana(r["url"])},
            ),
            Service(
                name="registry",
                module="rigup_testbed.hubserve",
                args=["registry", "--config", str(self.registry_config), "--images", str(self.registry_images),
                      "--bind", ip, "--port", str(PORTS["registry"]), "--ready-file", str(w / "registry/ready.json"), *tls],
                ready_file=w / "registry/ready.json",
                knobs=lambda r: {"container_registry": r["url"]},
            ),
            Service(
                name="engine-registry",
                module="rigup_testbed.registry",
                args=["--root", str(w / "engine-registry"), "--bind", ip, "--port", str(PORTS["engine_registry"]),
                      "--ready-file", str(w / "engine-registry/ready.json"),
                      *(["--python-root", str(self.python_root)] if self.python_root else []),
                      *self._tls_args(with_ca=True)],
                ready_file=w / "engine-registry/ready.json",
                knobs=lambda r: {"engine_registry": r["url"], "engine_registry_images": r["images"],
                                 "engine_registry_log": r["log"]},
            ),
            Service(
                name="hf",
                module="rigup_testbed.hfhub",
                args=["--root", str(w / "hf"), "--bind", ip, "--port", str(PORTS["hf"]),
                      "--redirect-lfs", "--cdn-port", str(PORTS["hf_cdn"]), "--ready-file", str(w / "hf/ready.json"), *tls],
                ready_file=w / "hf/ready.json",
                knobs=lambda r: {"hf_endpoint": r["url"]},
            ),
            Service(
                name="git",
                module="rigup_testbed.gitremotes",
                args=["--root", str(w / "git"), "--bind", ip, "--port", str(PORTS["git"]),
                      "--ready-file", str(w / "git/ready.json"), *tls],
                ready_file=w / "git/ready.json",
                knobs=lambda r: {**_git_knobs(r["url"], w / "git"), "source_refs": _source_refs(r["remotes"]),
                                 **unserved_vllm_repository(r["url"])},
            ),
            Service(
                name="pypi",
                module="rigup_testbed.hubserve",
                args=["static", "--root", str(self.pypi_root), "--bind", ip, "--port", str(PORTS["pypi"]),
                      "--ready-file", str(w / "pypi/ready.json"), *tls],
                ready_file=w / "pypi/ready.json",
                knobs=lambda r: {"gateway_pip_index_url": f"{r['url']}/simple"},
            ),
        ]  # fmt: skip

    @property
    def registry_config(self) -> Path:
        """registry.json of the hub's registry (format: hubserve.py); tests may rewrite it at any time."""
        return self.workdir / "registry" / "registry.json"

    @property
    def registry_images(self) -> Path:
        """The images the hub's registry holds by digest (hubserve.py --images): catalog_pinned_images()."""
        return self.workdir / "registry" / "images.json"

    def write_registry_files(self) -> None:
        """The registry's files as it starts: no test overrides yet, the catalog's pinned images held."""
        self.registry_config.parent.mkdir(parents=True, exist_ok=True)
        self.registry_config.write_text("{}\n")
        self.registry_images.write_text(json.dumps(catalog_pinned_images(), indent=1, sort_keys=True) + "\n")

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.tls:  # the machine's CA (made once), a certificate for this hub's address (each start)
            self.ca = ensure_bed_ca()
            self.server_cert = issue_server_cert(self.ca, self.workdir / "tls", [self.ip])
        # Built once per content hash into the shared cache; served read-only.
        self.repo_info = build_repos(cache_dir() / "aptrepo")
        # The first build downloads the entrance router's wheels (from the control machine's pip index).
        self.pypi_root = build_index(GATEWAY_REQUIREMENTS, cache_dir() / "pypi")
        # The registry service builds the vLLM image's Ray layer inside the hub's namespace, which reaches
        # no package index: its wheels are fetched here first (~82 MB, once), from the control machine's.
        ray_wheels()
        self._host_files.update(self._archive_files())
        self.write_registry_files()
        self.services = self._plan()
        # The services run as `python -m rigup_testbed....`: from the checkout or the installed package.
        env = {**os.environ, "PYTHONPATH": str(PACKAGE_DIR.parent), "PYTHONUNBUFFERED": "1"}
        for svc in self.services:
            svc.ready_file.parent.mkdir(parents=True, exist_ok=True)
            svc.ready_file.unlink(missing_ok=True)
            svc.entry = spawn(
                self.ledger,
                f"hub:{svc.name}",
                [sys.executable, "-m", svc.module, *svc.args],
                log=self.workdir / f"{svc.name}.log",
                cgroup_rel=self.cgroup_rel,
                netns=self.netns,
                env=env,
                cwd=REPO_ROOT,
            )
        # The services start in parallel; wait for all of them.
        deadline = time.monotonic() + READY_TIMEOUT_S
        for svc in self.services:
            svc.ready = self._wait_ready(svc, deadline)

    def _wait_ready(self, svc: Service, deadline: float) -> dict[str, Any]:
        if svc.entry is None:
            raise TestbedError(f"hub service {svc.name} was not started")
        while time.monotonic() < deadline:
            if svc.ready_file.exists():
                try:
                    return json.loads(svc.ready_file.read_text())
                except ValueError:
                    pass  # being written
            if not is_same_process(svc.entry["pid"], svc.entry["starttime"]):
                log = Path(svc.entry["log"]).read_text()[-2000:]
                raise TestbedError(f"hub service {svc.name} exited during start:\n{log}")
            time.sleep(0.05)
        raise TestbedError(f"hub service {svc.name} not ready after {READY_TIMEOUT_S:.0f}s; see {svc.entry['log']}")

    def stop(self) -> None:
        for svc in reversed(self.services):
            if svc.entry is not None:
                stop_process(svc.entry["pid"], svc.entry["starttime"])
                if svc.entry in self.ledger.resources:
                    self.ledger.resources.remove(svc.entry)
                    self.ledger.save()
                svc.entry = None

    # --- what hosts and the fleet file need --------------------------------------------------

    @property
    def urls(self) -> dict[str, str]:
        urls: dict[str, str] = {}
        for svc in self.services:
            urls.update(svc.knobs(svc.ready))
        return urls

    def trusted_cas(self) -> list[bytes]:
        """The CA certificates every host trusts before its first boot (image.ensure_layer): the bed's, with tls."""
        return [self.ca.pem] if self.ca is not None else []

    def host_files(self) -> dict[str, str | bytes]:
        """Files to write into every host's root (path -> content)."""
        return dict(self._host_files)

    def preinstall(self) -> list[Path]:
        """Archive packages a freshly installed Ubuntu server already has (pciutils: lspci; mokutil:
        Secure Boot state, pulled in by shim-signed on UEFI machines), as .deb files to install into
        every host before its first boot."""
        if self.repo_info is None:
            raise TestbedError("hub not started")
        pool = self.repo_info.root / "ubuntu-archive/pool/main"
        return [newest_deb(pool / name[0] / name, name) for name in PREINSTALLED]

    def host_layer_debs(self) -> list[Path]:
        """host_layer_debs of the hub's repositories."""
        if self.repo_info is None:
            raise TestbedError("hub not started")
        return host_layer_debs(self.repo_info.root)

    def _archive_files(self) -> dict[str, str | bytes]:
        """A rig's distribution archive is configured before rigup runs: give every host the stand-in
        archive (driver packages, mokutil, pciutils) as its one apt source, signed like the real one."""
        info = self.repo_info
        keyring = "/usr/share/keyrings/ubuntu-archive-keyring.gpg"
        base = f"{'https' if self.tls else 'http'}://{self.ip}:{PORTS['apt']}/{info.ubuntu_archive_url}"
        return {
            keyring: (info.root / "ubuntu-archive/ubuntu-archive-keyring.gpg").read_bytes(),
            "/etc/apt/sources.list.d/ubuntu.sources": (
                "# rigup test bed: stand-in of the distribution archive, served by the hub\n"
                "Types: deb\n"
                f"URIs: {base}\n"
                "Suites: bookworm\n"
                f"Components: {' '.join(info.ubuntu_archive_components)}\n"
                f"Signed-By: {keyring}\n"
            ),
        }
