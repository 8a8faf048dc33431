"""Where everything lives on a rig: the one place that spells a path under the install_root knob.

Every directory and file rigup keeps on a host is a property of `RigLayout(install_root)`; the tasks,
operations, facts and plans ask it instead of joining strings (tests/test_layout.py fails on a module
that spells one). It sits just above the rig scripts (it takes the record's file name from
rigup-servingctl, which writes it), so every other layer can use it: the plans (rigup.desired), the facts
that read a rig and the operations that write one. The scripts uploaded to a rig
(rigup/rig) are single files run by the rig's python3 and cannot import it: they are handed the
install_root and spell their own files under it, each file named in their docstrings.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass

from rigup.rig.servingctl import PROVENANCE_NAME  # the gate writes the record on the rig under this name

CTL_NAME = "rigup-servingctl"  # rigup/rig/servingctl.py: health gate, generations, rollback, sentinel
RIGFETCH_NAME = "rigfetch.py"  # rigup/rig/rigfetch as one zipapp file: verified downloads, the fleet chain
IMAGE_MIRROR_HELPER_NAME = "rigup-image-mirror"  # rigup/rig/imagemirror.py on the mirror host: check, warm, prune
QUARANTINE_ROUTES_NAME = "rigup-quarantine-routes"  # rigup/rig/quarantine_routes.py on the entrance host
CLUSTER_MEMBER_NAME = "rigup-cluster-member"  # files/cluster/rigup-cluster-member: starts a member's Ray node


@dataclass(frozen=True)
class RigLayout:
    """The directories and files under one rig's install_root (a trailing "/" is dropped; "/" stays "/")."""

    install_root: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "install_root", str(self.install_root).rstrip("/") or "/")

    def _under(self, *parts: str) -> str:
        return posixpath.join(self.install_root, *parts)

    # the scripts rigup uploads
    @property
    def bin_dir(self) -> str:
        return self._under("bin")

    @property
    def servingctl(self) -> str:
        return self._under("bin", CTL_NAME)

    @property
    def rigfetch(self) -> str:
        return self._under("bin", RIGFETCH_NAME)

    @property
    def image_mirror_helper(self) -> str:
        return self._under("bin", IMAGE_MIRROR_HELPER_NAME)

    @property
    def quarantine_routes(self) -> str:
        return self._under("bin", QUARANTINE_ROUTES_NAME)

    @property
    def cluster_member_script(self) -> str:
        return self._under("cluster", CLUSTER_MEMBER_NAME)

    # what the rig serves
    @property
    def sources_dir(self) -> str:  # one checkout per source at its locked commit
        return self._under("sources")

    @property
    def variants_dir(self) -> str:  # one directory per pod (a pod is named after its variant without pods)
        return self._under("variants")

    def variant_dir(self, pod: str) -> str:  # the pod's compose.yaml, .env, release.json, generations
        return self._under("variants", pod)

    def pod_secrets_dir(self, pod: str) -> str:  # 0700: one 0600 file per secret, bound read-only in the container
        return self._under("variants", pod, "secrets")

    def cache_dir(self, pod: str) -> str:  # the pod's torch.compile and Triton caches
        return self._under("cache", pod)

    @property
    def default_model_dir(self) -> str:  # model_dir when the knob is unset
        return self._under("models")

    # what the rig records
    @property
    def state_dir(self) -> str:  # model stamps, fetch log; the record of an unlisted pod
        return self._under("state")

    @property
    def pods_state_dir(self) -> str:  # one directory per listed pod, each with its provenance record
        return self._under("state", "pods")

    def record_dir(self, pod: str, listed: bool) -> str:
        """Where a pod's provenance record is: state/ for the one unlisted pod, state/pods/<pod>/ for a listed one."""
        return posixpath.join(self.pods_state_dir, pod) if listed else self.state_dir

    @property
    def provenance(self) -> str:  # the record of the host's one unlisted pod
        return self._under("state", PROVENANCE_NAME)

    @property
    def image_state_dir(self) -> str:  # the image chain's manifests and staging on a registry host
        return self._under("state", "images")

    # the fleet services
    @property
    def gateway_dir(self) -> str:  # the entrance's configuration, keys and router venv
        return self._under("gateway")

    @property
    def metrics_dir(self) -> str:  # the exporters' files (the DCGM counters list)
        return self._under("metrics")

    @property
    def gpu_counters(self) -> str:  # rigup's DCGM fields (files/monitoring/dcgm-counters.csv), mounted into the exporter
        return self._under("metrics", "dcgm-counters.csv")
