"""The fleet's image mirror as the control machine decides it: the fleet file's check, each rig's pull
registry and daemon.json settings, the mirror host's role and config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from rigup.desired.fleet import FleetError, load_fleet
from rigup.desired.image_mirror import (
    DOCKER_HUB_API,
    daemon_settings,
    dropin_text,
    mirror_role,
    pinned_through,
    prune_unit_text,
    pull_registry,
    registry_role,
    upstream_url,
)
from rigup.desired.recipe import resolve
from rigup.layout import RigLayout
from tests.support.fleets import MIRROR_FLEET, write_fleet


def load(tmp_path: Path, text: str = MIRROR_FLEET):
    return load_fleet(write_fleet(tmp_path, text))


def test_clients_learn_the_mirror_address_and_port(tmp_path: Path) -> None:
    fleet = load(tmp_path)
    assert fleet.host("rig-02").data["image_mirror"] == {"host": "rig-01", "address": "10.0.0.1", "port": 5055}
    assert fleet.host("rig-01").data["image_mirror"]["host"] == "rig-01"  # the mirror pulls through itself
    assert "image_mirror" not in fleet.host("gw").data
    # each rig pulls from the registry on its own loopback: the mirror's own, or its relay of the mirror
    assert pull_registry(fleet.resolved_data("rig-02")) == "127.0.0.1:5000"
    assert pull_registry(fleet.resolved_data("rig-01")) == "127.0.0.1:5055"
    assert pull_registry(fleet.resolved_data("gw")) == "docker.io"


def test_a_rig_pulls_its_variant_image_from_its_relay(tmp_path: Path) -> None:
    data = load(tmp_path).resolved_data("rig-02")
    recipe = resolve(data)
    assert recipe.image.ref.startswith("127.0.0.1:5000/vllm/vllm-openai:")


def test_daemon_json_mirrors_docker_hub_through_the_local_registry(tmp_path: Path) -> None:
    data = load(tmp_path).resolved_data("rig-02")
    # loopback needs no insecure-registries entry: Docker allows plain HTTP to 127.0.0.0/8
    assert daemon_settings(data) == ([], ["http://127.0.0.1:5000"])
    # another upstream than Docker Hub: registry-mirrors would not apply to it (Docker mirrors Docker Hub only)
    other = dict(data, container_registry="registry.lan:5000", docker_insecure_registries=["registry.lan:5000"])
    assert daemon_settings(other) == (["registry.lan:5000"], [])
    assert daemon_settings({"docker_insecure_registries": ["a:1"]}) == (["a:1"], [])


def test_upstream_url_follows_how_docker_reaches_the_registry() -> None:
    assert upstream_url({"container_registry": "docker.io"}) == DOCKER_HUB_API == "https://registry-1.docker.io"
    assert upstream_url({"container_registry": "registry.lan:5000",
                         "docker_insecure_registries": ["registry.lan:5000"]}) == "http://registry.lan:5000"
    # written as Docker's own list takes it, with a scheme: the same registry
    assert upstream_url({"container_registry": "registry.lan:5000",
                         "docker_insecure_registries": ["http://registry.lan:5000/"]}) == "http://registry.lan:5000"
    assert upstream_url({"container_registry": "ghcr.io"}) == "https://ghcr.io"


def test_the_mirror_role_proxies_the_clients_registry_and_keeps_their_pins(tmp_path: Path) -> None:
    fleet = load(tmp_path)
    hosts = [(h.name, fleet.resolved_data(h.name)) for h in fleet.hosts]
    pins = {"rig-01": ["vllm/vllm-openai@sha256:" + "a" * 64], "rig-02": ["vllm/vllm-openai@sha256:" + "a" * 64,
                                                                        "vllm/vllm-openai@sha256:" + "b" * 64]}
    role = mirror_role("rig-01", fleet.resolved_data("rig-01"), hosts, pins)
    assert role is not None and role.clients == ("rig-01", "rig-02", "rig-03") and role.port == 5055
    assert role.keep == ("vllm/vllm-openai@sha256:" + "a" * 64, "vllm/vllm-openai@sha256:" + "b" * 64)
    assert role.max_bytes == 200 * 10**9  # group_data's image_mirror_max_gb
    config = yaml.safe_load(role.config_text())
    assert config["proxy"] == {"remoteurl": "https://registry-1.docker.io"}
    assert config["http"]["addr"] == ":5055"
    assert config["storage"]["filesystem"]["rootdirectory"] == "/var/lib/docker-registry"
    # read-only over the API, the relays too: no push or delete from anyone (rigup fills the storage itself)
    assert config["storage"]["maintenance"] == {"readonly": {"enabled": True}} and "delete" not in config["storage"]
    keep = json.loads(role.keep_text())
    assert keep["max_bytes"] == role.max_bytes and keep["keep"] == list(role.keep) and keep["port"] == 5055
    assert mirror_role("rig-02", fleet.resolved_data("rig-02"), hosts, pins) is None
    assert not role.is_relay and registry_role("rig-01", fleet.resolved_data("rig-01"), hosts, pins) == role


def test_a_client_runs_a_relay_of_the_mirror_on_loopback_keeping_its_own_pins(tmp_path: Path) -> None:
    fleet = load(tmp_path)
    hosts = [(h.name, fleet.resolved_data(h.name)) for h in fleet.hosts]
    pins = {"rig-01": ["vllm/vllm-openai@sha256:" + "a" * 64], "rig-02": ["vllm/vllm-openai@sha256:" + "b" * 64]}
    relay = registry_role("rig-02", fleet.resolved_data("rig-02"), hosts, pins)
    assert relay is not None and relay.is_relay and relay.keep == ("vllm/vllm-openai@sha256:" + "b" * 64,)
    config = yaml.safe_load(relay.config_text())
    assert config["proxy"] == {"remoteurl": "http://10.0.0.1:5055"}  # the mirror, as its clients reach it
    assert config["http"]["addr"] == "127.0.0.1:5000"  # its own rig only
    assert config["storage"]["maintenance"] == {"readonly": {"enabled": True}}
    keep = json.loads(relay.keep_text())
    assert keep["pins_only"] is True and keep["max_bytes"] == 0
    assert keep["staging"] == "/var/lib/docker-registry/rigup-staging"  # the storage's file system: links, not copies
    assert registry_role("gw", fleet.resolved_data("gw"), hosts, pins) is None


def test_pinned_through_reads_repository_and_digest_or_tag() -> None:
    digest = "sha256:" + "c" * 64
    assert pinned_through(f"10.0.0.1:5055/vllm/vllm-openai:nightly-1@{digest}", "10.0.0.1:5055") == f"vllm/vllm-openai@{digest}"
    assert pinned_through(f"10.0.0.1:5055/vllm/vllm-openai@{digest}", "10.0.0.1:5055") == f"vllm/vllm-openai@{digest}"
    # a lock without image digests: the tag is what the mirror keeps
    assert pinned_through("10.0.0.1:5055/vllm/vllm-openai:nightly-1", "10.0.0.1:5055") == "vllm/vllm-openai:nightly-1"
    assert pinned_through("10.0.0.1:5055/nvidia/cuda", "10.0.0.1:5055") == "nvidia/cuda:latest"
    assert pinned_through(f"nvcr.io/nvidia/x:1@{digest}", "10.0.0.1:5055") is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("data: {image_mirror_host: rig-9}\ngroups:\n  rigs:\n    hosts:\n      rig-01: {}\n",
         "host 'rig-01': image_mirror_host 'rig-9' is not a host of this fleet (hosts: rig-01)"),
        ("data: {image_mirror_host: rig-01, container_registry: registry.example/dockerhub}\n"
         "groups:\n  rigs:\n    hosts:\n      rig-01: {}\n",
         "image_mirror_host needs container_registry to be a registry host (host[:port]), got 'registry.example/dockerhub'"),
        ("data: {image_mirror_host: rig-01}\ngroups:\n  rigs:\n    hosts:\n      rig-01: {}\n"
         "      rig-02: {container_registry: ghcr.io}\n",
         "host 'rig-02': its mirror 'rig-01' would proxy https://ghcr.io, but host 'rig-01' has it proxy "
         "https://registry-1.docker.io: one mirror serves one container_registry"),
        ("data: {image_mirror: {host: x}}\ngroups:\n  rigs:\n    hosts:\n      rig-01: {}\n",
         "'image_mirror' must be set from image_mirror_host, not by hand"),
        ("data: {image_mirror_max_gb: 0}\ngroups:\n  rigs:\n    hosts:\n      rig-01: {}\n",
         "'image_mirror_max_gb' must be a number of GB above 0, got 0"),
    ],
)
def test_bad_mirror_settings_name_file_host_and_key(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "rigs.yaml"
    path.write_text(text)
    with pytest.raises(FleetError) as raised:
        load_fleet(path)
    assert str(raised.value).startswith(str(path))
    assert message in str(raised.value)


def test_units_run_rigups_config_and_the_helpers_prune() -> None:
    assert dropin_text().splitlines()[2:4] == ["ExecStart=", "ExecStart=/usr/bin/docker-registry serve /etc/rigup/image-mirror.yml"]
    unit = prune_unit_text(RigLayout("/opt/rigup").image_mirror_helper)
    assert "ExecStart=/usr/bin/python3 /opt/rigup/bin/rigup-image-mirror prune /etc/rigup/image-mirror-keep.json" in unit


def test_the_lock_pins_the_image_at_the_upstream_not_at_the_mirror(tmp_path: Path) -> None:
    from rigup.desired.lock import ImageNeed
    from rigup.desired.needs import needs_for

    data = dict(load(tmp_path).resolved_data("rig-02"), container_registry="registry.lan:5001",
                docker_insecure_registries=["registry.lan:5001"])
    recipe = resolve(data)
    assert recipe.image.registry == "127.0.0.1:5000"  # pulled from the relay
    (need,) = [n for n in needs_for(recipe, data) if isinstance(n, ImageNeed)]
    assert (need.registry, need.plain_http) == ("registry.lan:5001", True)  # pinned where the pin is true
