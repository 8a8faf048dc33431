"""`rigup lock` and an image the catalog pins by digest (lmcache/vllm-openai: upstream pins it by digest
because its tag moved): the lock records the catalog's digest, checked against the registry with
--image-digests, never what the tag points at now. Run against the hub's stand-in registry
(rigup_testbed/hubserve.py) holding the catalog's pinned images, as the sandbox's hub does."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from rigup.desired.catalog import load_catalog
from rigup.desired.knobs import load_defaults
from rigup.desired.lock import ImageNeed, ImagePin, LockError, LockFile
from rigup.desired.pins import Resolver, catalog_image_digest, registry_has_digest, update_lock
from rigup.desired.recipe import resolve
from rigup_testbed import hubserve
from rigup_testbed.hub import catalog_pinned_images
from rigup_testbed.service import ThreadingServer
from rigup_testbed.standin_modules import load_standin

REPOSITORY, TAG = "lmcache/vllm-openai", "v0.4.7-cu129"
# club-3090 models/qwen3.6-27b/vllm-lmcache/compose/dual/fp8/lmcache.yml@4a29ab57 (image default)
PINNED = "sha256:663f9b2f7528e34105c9b0428880b811616f9bc85133b6e2a577b2e7282be8de"
MOVED = "sha256:" + "e" * 64  # what the mutable tag points at today
NAME = f"image:{REPOSITORY}:{TAG}"


class Registry:
    def __init__(self, tmp_path: Path) -> None:
        self.config = tmp_path / "registry.json"
        self.images = tmp_path / "images.json"
        self.config.write_text("{}")
        self.images.write_text(json.dumps(catalog_pinned_images()))
        handler = type("H", (hubserve.RegistryHandler,), {"config_file": self.config, "images_file": self.images,
                                                           "dockerclient": load_standin("dockerclient")})
        self.server = ThreadingServer(("127.0.0.1", 0), handler)
        self.host = f"127.0.0.1:{self.server.server_address[1]}"
        handler.host_port = self.host
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def need(self) -> ImageNeed:
        return ImageNeed(NAME, REPOSITORY, TAG, self.host)


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[Registry]:
    reg = Registry(tmp_path)
    yield reg
    reg.server.shutdown()
    reg.server.server_close()


def test_the_catalog_pins_the_lmcache_image() -> None:
    assert catalog_image_digest(REPOSITORY, TAG) == PINNED
    assert catalog_image_digest(REPOSITORY, "latest") is None
    assert catalog_image_digest("vllm/vllm-openai", "v0.22.0") is None
    assert catalog_pinned_images() == {f"{REPOSITORY}:{TAG}": PINNED}


def test_the_lock_records_the_catalogs_digest_not_the_tags(registry: Registry) -> None:
    registry.config.write_text(json.dumps({"digests": {f"{REPOSITORY}:{TAG}": MOVED}}))  # the tag moved on
    from rigup.desired.pins import registry_digest

    assert registry_digest(registry.host, REPOSITORY, TAG) == MOVED  # what the old code locked
    logged: list[str] = []
    pin = Resolver(image_digests=True, log=logged.append).image(registry.need(), None)
    assert pin == ImagePin(NAME, REPOSITORY, TAG, PINNED)
    assert logged == [f"{NAME}: {PINNED} (the catalog's pin; {registry.host} has it)"]
    # Without --image-digests nothing is asked, and the catalog's digest still replaces a stale one.
    stale = ImagePin(NAME, REPOSITORY, TAG, MOVED)
    assert Resolver().image(registry.need(), stale).digest == PINNED
    assert Resolver().image(registry.need(), None).digest == PINNED


def test_a_registry_without_the_digest_fails_the_lock(registry: Registry) -> None:
    registry.images.write_text(json.dumps({f"{REPOSITORY}:{TAG}": MOVED}))  # holds the repository, not the pin
    with pytest.raises(LockError, match=rf"{REPOSITORY}@{PINNED}: {registry.host} does not have this digest"):
        Resolver(image_digests=True).image(registry.need(), None)
    with pytest.raises(LockError, match="does not have this digest"):
        registry_has_digest(registry.host, REPOSITORY, PINNED)
    registry.images.write_text(json.dumps(catalog_pinned_images()))
    registry_has_digest(registry.host, REPOSITORY, PINNED)  # held again: no error
    with pytest.raises(LockError, match="cannot reach 127.0.0.1:9"):
        registry_has_digest("127.0.0.1:9", REPOSITORY, PINNED)


def test_update_lock_fixes_a_stale_digest_and_the_recipe_takes_the_lock(registry: Registry) -> None:
    old = LockFile()
    old.images[NAME] = ImagePin(NAME, REPOSITORY, TAG, MOVED)  # locked from the moving tag before
    data = {**load_defaults(), "variant": "qwen-dual-fp8-lmcache", "container_registry": registry.host}
    with pytest.raises(Exception, match="but the catalog pins"):
        resolve(data, old)  # what `rigup lock` left behind: the recipe refuses it
    need = registry.need()
    new, changes = update_lock(old, {NAME: need}, Resolver(image_digests=True), None)
    assert new.images[NAME].digest == PINNED
    (change,) = changes
    assert change.kind == "fixed" and f"locked digest {MOVED}, but the catalog pins {PINNED}" in change.lines[0]
    again, changes = update_lock(new, {NAME: need}, Resolver(image_digests=True), None)
    assert again.images[NAME].digest == PINNED and changes == []  # a good pin is kept, nothing asked
    assert load_catalog()["images"]["lmcache-vllm-openai-663f9b2f"]["digest"] == PINNED


def test_images_the_catalog_does_not_pin_still_lock_the_tags_digest(registry: Registry) -> None:
    need = ImageNeed("image:vllm/vllm-openai:v0.22.0", "vllm/vllm-openai", "v0.22.0", registry.host)
    digest = Resolver(image_digests=True).image(need, None).digest
    assert digest is not None and digest != PINNED
    assert digest == load_standin("dockerclient").fake_digest(f"{registry.host}/vllm/vllm-openai:v0.22.0")
    assert Resolver().image(need, None).digest is None  # tag only, as before
