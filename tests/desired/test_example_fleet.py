"""rigs.example.yaml shows every form the fleet file takes, and the real loader (load_fleet, what
inventory.py and every command read) accepts it as written and with its commented-out forms switched on."""

from __future__ import annotations

from pathlib import Path

import yaml

from rigup import REPO_ROOT
from rigup.desired.cluster import CLUSTER_KEYS
from rigup.desired.fleet import GROUP_KEYS, LOCAL_HOST, SSH_KEYS, TOP_LEVEL_KEYS, load_fleet
from rigup.desired.knobs import load_defaults
from rigup.desired.pods import POD_KEYS

EXAMPLE = REPO_ROOT / "rigs.example.yaml"


def uncommented(text: str, *starts: str) -> str:
    """`text` with its commented-out settings that begin with one of `starts` switched on (the `# ` after
    the indentation dropped): what a user does to take a form the example shows commented."""
    lines = []
    for line in text.splitlines():
        body = line.lstrip()
        if body.startswith("# ") and body[2:].lstrip().startswith(starts):
            line = line[: len(line) - len(body)] + body[2:]
        lines.append(line)
    return "\n".join(lines) + "\n"


def test_example_loads_as_written():
    fleet = load_fleet(EXAMPLE)
    assert fleet.hosts and fleet.clusters


def test_example_shows_every_form_of_the_fleet_file():
    document = yaml.safe_load(EXAMPLE.read_text())
    fleet = load_fleet(EXAMPLE)
    assert set(document) == TOP_LEVEL_KEYS  # data, groups, clusters
    groups = document["groups"].values()
    assert {key for group in groups for key in group} == GROUP_KEYS  # a group's own data, its hosts
    hosts = {name: values or {} for group in groups for name, values in group["hosts"].items()}
    used = {key for values in hosts.values() for key in values}
    assert {"ssh_hostname", "ssh_user", "ssh_key", "ssh_port"} <= used & SSH_KEYS
    assert used & set(load_defaults()) - {"pods", "variant_overrides"}, "a knob set on one host"
    assert any("variant_overrides" in values for values in hosts.values()), "a host's variant_overrides"
    pods = [pod for values in hosts.values() for pod in values.get("pods", [])]
    assert {key for pod in pods for key in pod} == set(POD_KEYS)
    assert {type(pod["gpus"]) for pod in pods} == {list, int}, "pods' GPUs by index and by count"
    gateway_group = load_defaults()["gateway_group"]
    assert [h.data.get("serves_variant") for h in fleet.groups[gateway_group]] == [False], "a gateway-only host"
    [cluster] = document["clusters"]
    assert set(cluster) == set(CLUSTER_KEYS) - {"socket_interface"}  # that one is shown commented (below)
    assert all("cluster" in fleet.host(name).data for name in cluster["hosts"])


def test_example_commented_forms_load_when_switched_on(tmp_path: Path):
    # The machine you are on (@local) and a cluster's socket_interface are shown commented out: a copy of
    # the example would otherwise deploy to this machine, or name an interface the user's rigs lack.
    path = tmp_path / "rigs.yaml"
    path.write_text(uncommented(EXAMPLE.read_text(), "local:", "hosts:", '"@local":', "variant: single",
                                "socket_interface:", "image_mirror_host:"))
    fleet = load_fleet(path)
    local = fleet.host(LOCAL_HOST)
    assert local.data["variant"] == "single" and "_sudo" in local.data
    assert fleet.clusters[0].socket_interface == "eth1"
    assert {h.data.get("image_mirror_host") for h in fleet.hosts} == {"rig-01"}
