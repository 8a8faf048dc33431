"""A whole test bed: network, hub services and N booted hosts, with one state file to undo it all.

    bed = Testbed(workdir, instance="rigupt")
    bed.up([HostSpec("rig-01"), HostSpec("rig-02", hardware="1x3090")])
    bed.write_fleet(workdir / "rigs.yaml")      # pyinfra inventory for the bed (CONTRACT.md format)
    ...
    bed.down()                                   # also works from a new process after a crash

Everything created is listed in <workdir>/state.json before it is created (rigup_testbed/state.py);
`Testbed(workdir).down()` undoes it newest first: supervisors (hosts power off), leftover processes of
each host's cgroup, hub services, overlay mounts, network namespaces, the control link, directories.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import re
import subprocess
import time
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from rigup_testbed.hardware import preset
from rigup_testbed.hosts import Host, HostSpec, create_host, start_host, wait_ready
from rigup_testbed.hub import Hub, url_knobs
from rigup_testbed.image import ImageSpec, ensure_image, ensure_layer
from rigup_testbed.net import Network, create_hub, pick_subnet
from rigup_testbed.registry import DCGM_EXPORTER_REPOSITORY, DCGM_EXPORTER_TAG, smoke_reference
from rigup_testbed.state import Ledger, TestbedError, make_cgroup, run

INSTANCE_RE = re.compile(r"^[a-z][a-z0-9]{0,7}$")
NET_LOCK = "/run/lock/rigup-testbed-net.lock" if os.path.isdir("/run/lock") else "/tmp/rigup-testbed-net.lock"
# instance name -> the work dir whose state.json owns it, machine-wide (namespaces and links are), so a
# clash names the bed to tear down; /run empties at boot, as the namespaces do
OWNERS_DIR = Path("/run/rigup-testbed/owners") if os.path.isdir("/run") else Path("/tmp/rigup-testbed-owners")


def instance_owner(instance: str) -> Path | None:
    """The work dir of the live bed that holds `instance` on this machine, when one is recorded."""
    try:
        return Path((OWNERS_DIR / instance).read_text().strip())
    except OSError:
        return None


def registry_host_port(registry: str) -> str:
    """host:port of a container_registry value ("10.0.0.1:5000", "mirror.lan:5000/dockerhub"), as
    Docker's insecure-registries list wants it."""
    return registry.split("://", 1)[-1].split("/", 1)[0]


def host_names(count: int, prefix: str = "rig") -> list[str]:
    return [f"{prefix}-{i:02d}" for i in range(1, count + 1)]


class Testbed:
    """One test bed, identified by its work dir (state.json lives there) and instance name (prefix of
    its network namespaces, interfaces and cgroups)."""

    __test__ = False  # not a pytest test class

    def __init__(self, workdir: Path, instance: str = "rigup", *, hub: bool = True) -> None:
        if not INSTANCE_RE.match(instance):
            raise TestbedError(f"instance {instance!r}: 1-8 lowercase letters/digits, starting with a letter")
        self.workdir = workdir.resolve()
        self.instance = instance
        self.with_hub = hub
        self.ledger = Ledger(self.workdir / "state.json")
        self._hub: Any = None
        # knobs every fleet() of this bed starts from, below its own data (the e2e suite's beds set some)
        self.fleet_defaults: dict[str, Any] = {}

    # --- views of the recorded state ---------------------------------------------------------

    @property
    def created(self) -> bool:
        return bool(self.ledger.resources)

    @property
    def hosts(self) -> list[Host]:
        return [Host.from_json(h) for h in self.ledger.info.get("hosts", [])]

    def host(self, name: str) -> Host:
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(name)

    @property
    def urls(self) -> dict[str, str]:
        return dict(self.ledger.info.get("urls", {}))

    @property
    def ca_cert(self) -> Path | None:
        """The test-bed CA's certificate the hub's HTTPS is checked with (rigup_testbed/tls.py); None: the hub
        speaks plain HTTP. The rigs trust it in their system store; the fleet file names it as ca_bundle."""
        path = self.ledger.info.get("ca_cert")
        return Path(path) if path else None

    @property
    def network(self) -> Network:
        return Network(self.ledger.info["instance"], ipaddress.IPv4Network(self.ledger.info["subnet"]))

    @property
    def timings(self) -> dict[str, float]:
        return dict(self.ledger.info.get("timings", {}))

    # --- lifecycle -----------------------------------------------------------------------------

    def up(
        self,
        specs: Sequence[HostSpec],
        *,
        image: ImageSpec | None = None,
        ready_timeout: float = 180.0,
        host_layer: bool | Collection[str] = False,
    ) -> list[Host]:
        """Create and boot everything; on any failure, undo what was made and re-raise. With `host_layer`, every
        host with GPUs (a rig; a gateway box has none) boots with the packages of rigup's host layer installed
        (hub.HOST_LAYER_PACKAGES: the NVIDIA driver, loaded at the first boot, Docker CE, the container toolkit), as
        from an image baked with them: the first converge configures them and installs nothing, which a module
        testing what comes after the host layer need not watch on every rig (test_hostlayer.py and the others that
        install watch it). A collection of host names gives it to those hosts alone."""
        if self.created:
            raise TestbedError(f"{self.ledger.path} lists resources of an earlier bed; tear it down first")
        if host_layer and not self.with_hub:
            raise TestbedError("host_layer installs packages from the hub's repositories: a bed without a hub has none")
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise TestbedError(f"duplicate host names in {names}")
        ensure_inotify_room(len(specs))
        try:
            return self._up(specs, image, ready_timeout, host_layer)
        except BaseException as exc:
            try:
                self.down()
            except TestbedError as down_exc:
                exc.add_note(f"and cleaning up after it: {down_exc}")
            raise

    def _up(self, specs: Sequence[HostSpec], image_spec: ImageSpec | None, ready_timeout: float,
            host_layer: bool | Collection[str]) -> list[Host]:
        timings: dict[str, float] = {}
        t0 = time.monotonic()
        img = ensure_image(image_spec)
        timings["image_s"] = time.monotonic() - t0
        timings.update({f"image_{k}": v for k, v in img.timings.items()})

        t1 = time.monotonic()
        self.workdir.mkdir(parents=True, exist_ok=True)
        # Choosing a free /24 and taking it (the control link's route) is one step across test beds.
        with open(NET_LOCK, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            net = Network(self.instance, pick_subnet())
            owner = instance_owner(self.instance)
            if owner is not None and owner != self.workdir and (owner / "state.json").exists():
                raise TestbedError(
                    f"test-bed instance {self.instance!r} is held by the bed in {owner} (another session, or one "
                    f"that died; tear it down with: python -c 'from pathlib import Path; from rigup_testbed.fleet "
                    f"import Testbed; Testbed(Path(\"{owner}\"), \"{self.instance}\").down()')")
            self.ledger.set_info(instance=self.instance, subnet=str(net.subnet), hub_ip=net.hub_ip, image=img.spec.key)
            create_hub(self.ledger, net)
            OWNERS_DIR.mkdir(parents=True, exist_ok=True)
            (OWNERS_DIR / self.instance).write_text(f"{self.workdir}\n")
        ssh_dir = self.workdir / "ssh"
        self.ledger.add("dir", path=str(ssh_dir))
        ssh_dir.mkdir(mode=0o700)
        key = ssh_dir / "id_ed25519"
        run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"rigup-testbed-{self.instance}", "-f", str(key)])
        known_hosts = ssh_dir / "known_hosts"
        known_hosts.touch(mode=0o644)
        self.ledger.add("dir", path=str(self.workdir / "hosts"))
        timings["network_s"] = time.monotonic() - t1

        urls: dict[str, str] = {}
        host_files: dict[str, Any] = {}
        layer: Path | None = None
        rig_layer: Path | None = None
        t2 = time.monotonic()
        if self.with_hub:
            hub_dir = self.workdir / "hub"
            self.ledger.add("dir", path=str(hub_dir))
            make_cgroup(self.ledger, f"{self.instance}/hub")
            self._hub = Hub(hub_dir, net.hub_ip, netns=net.hub_netns, ledger=self.ledger, cgroup_rel=f"{self.instance}/hub",
                            python_root=img.root)
            self._hub.start()
            urls = dict(self._hub.urls)
            host_files = self._hub.host_files()
            preinstalled, cas = self._hub.preinstall(), self._hub.trusted_cas()
            layer = ensure_layer(img, preinstalled, cas)
            if host_layer:  # a second layer, the first's packages and the host layer's, for the hosts with GPUs
                rig_layer = ensure_layer(img, preinstalled + self._hub.host_layer_debs(), cas)

        def layer_of(spec: HostSpec) -> Path | None:
            """The host layer's for a host with GPUs that `host_layer` names (True: every one), else the first."""
            if rig_layer is None or not (host_layer is True or spec.name in host_layer):
                return layer
            return rig_layer if preset(spec.hardware, spec.name).gpus else layer
        timings["hub_s"] = time.monotonic() - t2
        ca_cert = self._hub.ca_cert if self._hub is not None else None
        self.ledger.set_info(urls=urls, ca_cert=str(ca_cert) if ca_cert else None)

        t3 = time.monotonic()
        hosts = [
            create_host(
                self.ledger, net, img, spec, index, self.workdir,
                client_pubkey=key.with_suffix(".pub").read_text(),
                known_hosts=known_hosts,
                ssh_key=key,
                extra_files=host_files,
                layer=layer_of(spec),
            )
            for index, spec in enumerate(specs)
        ]  # fmt: skip
        self.ledger.set_info(hosts=[h.to_json() for h in hosts])
        for h in hosts:
            start_host(self.ledger, h)
        ready = wait_ready(hosts, timeout=ready_timeout)
        timings["hosts_s"] = time.monotonic() - t3
        timings["slowest_host_ready_s"] = max(ready.values(), default=0.0)
        timings["up_s"] = time.monotonic() - t0
        self.ledger.set_info(timings=timings)
        return hosts

    def down(self) -> list[str]:
        """Undo everything the state file lists. Returns problems met (also raised as one error)."""
        t0 = time.monotonic()
        for host in self.hosts:
            try:
                host.close_ssh()
            except (OSError, subprocess.SubprocessError):
                pass  # the master goes by itself once the host is gone
        problems = self.ledger.teardown()
        if problems:
            raise TestbedError("teardown left problems:\n  " + "\n  ".join(problems))
        self.ledger.path.unlink(missing_ok=True)
        if instance_owner(self.instance) == self.workdir:
            (OWNERS_DIR / self.instance).unlink(missing_ok=True)
        try:
            self.workdir.rmdir()  # only when nothing else was put there
        except OSError:
            pass
        self.last_teardown_s = time.monotonic() - t0
        return problems

    # --- fleet file ----------------------------------------------------------------------------

    def fleet(
        self,
        *,
        data: Mapping[str, Any] | None = None,
        group_data: Mapping[str, Mapping[str, Any]] | None = None,
        require_all_urls: bool = True,
        real_engine: bool = True,
        clusters: Sequence[Mapping[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """The fleet document (CONTRACT.md format) for this bed: every URL knob at the hub (https, the hub's
        certificate from the bed's CA, which the rigs trust in their system store and the control machine's
        clients through ca_bundle, as a company's TLS-intercepting proxy's CA is configured; a hub on plain
        HTTP: its registry in docker_insecure_registries, as a LAN mirror user sets it), Debian 12 allowed,
        each host with pinned SSH settings and its GPU count. `data` overrides any of it;
        `clusters` is the fleet file's list of them, as given.

        With `real_engine` (the default), the rigs install Docker's real engine (the hub's engine repository)
        and pull from the hub's real registry, the GPU smoke image included, as from a LAN mirror of Docker
        Hub. Without it, the stand-in engine (rigup_testbed/standins/dockerd.py) and the manifest-only
        registry (hubserve.py), which simulate the image kinds the real registry does not build."""
        urls = self.urls
        knobs = url_knobs()
        missing = [k for k in knobs if k not in urls]
        if missing and require_all_urls:
            raise TestbedError(f"the hub serves nothing for {', '.join(missing)}; refusing to leave them on the internet")
        top: dict[str, Any] = {"preflight_os_allowed": ["debian 12"], **self.fleet_defaults}
        if self.ca_cert is not None:
            top["ca_bundle"] = str(self.ca_cert)
        top.update({k: urls[k] for k in knobs if k in urls})
        if "source_refs" in urls:  # stand-in commits for sources the catalog pins to upstream SHAs
            top["source_refs"] = dict(urls["source_refs"])
        if "container_registry" in urls:
            top.update(self.engine_data(real_engine=real_engine))
        top.update(data or {})
        groups: dict[str, dict[str, Any]] = {}
        for h in self.hosts:
            g = groups.setdefault(h.group, {"hosts": {}})
            if group_data and h.group in group_data:
                g["data"] = dict(group_data[h.group])
            g["hosts"][h.name] = {
                "ssh_hostname": h.ip,
                "ssh_port": 22,
                "ssh_user": h.ssh_user,
                "ssh_key": str(h.ssh_key),
                "ssh_known_hosts_file": str(h.known_hosts),
                "ssh_strict_host_key_checking": "yes",
                # a host without GPUs (a gateway box) says nothing: gpu_count takes 1 or more
                **({"gpu_count": len(h.hardware.gpus)} if h.hardware.gpus else {}),
                **dict(h.data),
            }
        return {"data": top, "groups": groups, **({"clusters": [dict(c) for c in clusters]} if clusters else {})}

    def engine_data(self, *, real_engine: bool) -> dict[str, Any]:
        """The knobs that choose a rig's container engine, as fleet(real_engine=...) sets them: Docker's apt
        repository, the registry (HTTPS with the bed's CA; on a plain-HTTP hub, as a LAN mirror often is, Docker
        must be told: docker_insecure_registries) and the GPU smoke image. As group data, they put a group on the
        other engine than the rest of the fleet."""
        urls = self.urls
        tls = self.ca_cert is not None
        if not real_engine:
            # the stand-in engine runs vLLM's images only: no GPU exporter container (node_exporter goes too)
            return {"docker_apt_url": urls["docker_apt_url"], "docker_apt_key_url": urls["docker_apt_key_url"],
                    "container_registry": urls["container_registry"],
                    "docker_insecure_registries": [] if tls else [registry_host_port(urls["container_registry"])],
                    "gpu_smoke_image": smoke_reference(), "metrics_exporters": False}
        if "engine_registry" not in urls:
            raise TestbedError("the hub serves no real registry (engine_registry): pass real_engine=False "
                               "for the stand-in engine")
        registry = urls["engine_registry"]
        return {"docker_apt_url": urls["engine_docker_apt_url"], "docker_apt_key_url": urls["engine_docker_apt_key_url"],
                "container_registry": registry, "docker_insecure_registries": [] if tls else [registry],
                "gpu_smoke_image": f"{registry}/{smoke_reference()}",
                # NVIDIA's registry is not Docker Hub: the knob names the whole reference, here the hub's copy
                "gpu_exporter_image": f"{registry}/{DCGM_EXPORTER_REPOSITORY}:{DCGM_EXPORTER_TAG}"}

    def write_fleet(self, path: Path, **kwargs: Any) -> Path:
        """Write `fleet(**kwargs)` as YAML to `path` (recorded, so teardown removes it)."""
        doc = self.fleet(**kwargs)
        path = path.resolve()
        if not any(r["kind"] == "file" and r["path"] == str(path) for r in self.ledger.resources):
            self.ledger.add("file", path=str(path))
        header = (
            f"# Test-bed fleet written by rigup_testbed (instance {self.instance}, subnet {self.ledger.info.get('subnet')}).\n"
            "# Every external URL points at the hub namespace; removed by teardown.\n"
        )
        tmp = path.with_suffix(".tmp")
        tmp.write_text(header + yaml.safe_dump(doc, sort_keys=False, default_flow_style=False))
        os.replace(tmp, path)
        return path

    # --- inspection ------------------------------------------------------------------------------

    def status(self) -> list[dict[str, Any]]:
        """One row per host: name, ip, group, preset, GPUs, running, boots, nspawn pid."""
        rows = []
        for h in self.hosts:
            rows.append(
                {
                    "name": h.name,
                    "ip": h.ip,
                    "group": h.group,
                    "hardware": h.hardware.preset,
                    "gpus": len(h.hardware.gpus),
                    "running": h.running(),
                    "boots": h.boots(),
                    "nspawn_pid": h.nspawn_pid(),
                }
            )
        return rows


# Each booted systemd takes several inotify instances (path units, journald, udev); the kernel's
# default of 128 per user runs out with a few dozen hosts alive at once, and hosts then boot
# "degraded" (systemd-ask-password-*.path failed). Raised, never lowered, for the whole machine.
INOTIFY_INSTANCES_PER_HOST = 64
INOTIFY_SYSCTL = Path("/proc/sys/fs/inotify/max_user_instances")


def ensure_inotify_room(new_hosts: int) -> None:
    try:
        current = int(INOTIFY_SYSCTL.read_text())
    except (OSError, ValueError):
        return
    wanted = max(8192, INOTIFY_INSTANCES_PER_HOST * new_hosts)  # 8192: room for ~128 hosts across beds
    if current < wanted:
        try:
            INOTIFY_SYSCTL.write_text(f"{wanted}\n")
        except OSError as exc:
            raise TestbedError(
                f"fs.inotify.max_user_instances is {current}; booting more hosts needs {wanted} (sysctl -w): {exc}"
            ) from None

