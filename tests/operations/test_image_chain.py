"""The image chain's manifests as the control machine builds them at execution, from each host's image
helper check: the same model (pin) names and files on every member, each member reading its own
registry's upstream, a blob an image lists twice fetched once, and a pin the helper could not list left
out."""

from __future__ import annotations

from types import SimpleNamespace

from rigup.operations.image_chain import ImageChainMember, chain_manifest
from rigup.rig.imagemirror import pin_name
from rigup.rig.rigfetch.manifest import validate_manifest

PIN = "vllm/vllm-openai:nightly-1"
LAYER, CONFIG = "sha256:" + "a" * 64, "sha256:" + "c" * 64


def member(name: str, upstream: str, mirror: bool) -> ImageChainMember:
    return ImageChainMember(host=SimpleNamespace(name=name), base_url=f"http://{name}:8765/", rigfetch="/opt/rigup/bin/rigfetch.py",
                            helper="/opt/rigup/bin/rigup-image-mirror", keep_file="/etc/rigup/image-mirror-keep.json",
                            upstream=upstream, staging="/var/lib/docker-registry/rigup-staging",
                            state_dir="/opt/rigup/state/images", reserve_bytes=5, sudo=True, is_mirror=mirror)


CACHE = {"pins": {
    PIN: {"repository": "vllm/vllm-openai", "digest": "sha256:" + "d" * 64,
          "blobs": [[CONFIG, 700], [LAYER, 4096], [LAYER, 4096]]},  # an image may list one layer twice
    "vllm/vllm-openai:gone": {"repository": "vllm/vllm-openai", "error": "HTTP 404"},
}}


def test_every_member_names_a_pin_alike_and_reads_its_own_upstream() -> None:
    mirror = chain_manifest(member("rig-01", "https://registry-1.docker.io", True), CACHE)
    relay = chain_manifest(member("rig-02", "http://10.0.0.1:5000", False), CACHE)
    validate_manifest(mirror)
    validate_manifest(relay)
    (one,), (two,) = mirror["models"], relay["models"]  # the pin upstream lacks is not listed
    assert one["name"] == two["name"] == pin_name(PIN)
    assert one["dir"] == two["dir"] == f"/var/lib/docker-registry/rigup-staging/{pin_name(PIN)}"
    assert one["files"] == two["files"] == [{"path": CONFIG, "size": 700, "sha256": "c" * 64},
                                            {"path": LAYER, "size": 4096, "sha256": "a" * 64}]
    assert one["hub_url"] == "https://registry-1.docker.io/v2/vllm/vllm-openai/blobs/"
    assert two["hub_url"] == "http://10.0.0.1:5000/v2/vllm/vllm-openai/blobs/"
    assert one["hub_auth"] == two["hub_auth"] == "registry"
    assert (mirror["state_dir"], mirror["reserve_bytes"]) == ("/opt/rigup/state/images", 5)


def test_pin_names_differ_by_pin_and_fit_rigfetch() -> None:
    names = {pin_name(PIN), pin_name("vllm/vllm-openai:nightly-2"), pin_name("vllm/vllm-openai@sha256:" + "e" * 64)}
    assert len(names) == 3 and all(n.startswith("image-") and len(n) == 22 for n in names)
