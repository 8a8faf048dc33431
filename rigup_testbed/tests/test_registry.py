"""The hub's real registry (Debian's docker-registry) with the images the test bed builds and pushes."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import socket
import subprocess
import sys
import tarfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from rigup_testbed import registry


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, object]]:
    if not Path(registry.BINARY).exists() or not Path(registry.BUSYBOX).exists():
        pytest.skip("docker-registry or busybox-static missing: run scripts/setup")
    root = tmp_path_factory.mktemp("registry")
    ready = root / "ready.json"
    proc = subprocess.Popen([sys.executable, "-m", "rigup_testbed.registry", "--root", str(root / "r"),
                             "--port", str(_free_port()), "--ready-file", str(ready)])
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert proc.poll() is None, "the registry service exited"
            assert time.monotonic() < deadline, "the registry service did not get ready"
            time.sleep(0.1)
        yield json.loads(ready.read_text())
    finally:
        proc.terminate()
        proc.wait(15)
    # the service stops docker-registry with itself
    assert subprocess.run(["pgrep", "-f", f"docker-registry serve {root}"], capture_output=True).returncode != 0


def _get(url: str, accept: str = "") -> tuple[bytes, dict[str, str]]:
    request = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(request, timeout=10) as response:
        return response.read(), dict(response.headers)


def test_images_are_built_byte_for_byte_the_same() -> None:
    if not Path(registry.BUSYBOX).exists():
        pytest.skip("busybox-static missing: run scripts/setup")
    assert registry.busybox_image().digest == registry.busybox_image().digest


def test_build_image_layer_and_config_agree(tmp_path: Path) -> None:
    image = registry.build_image("t/x", "1", {"/usr/bin/tool": (b"#!/bin/sh\n", 0o755)}, {"/bin/t": "../usr/bin/tool"},
                                 {"Cmd": ["tool"]})
    manifest = json.loads(image.manifest)
    config = json.loads(image.config)
    assert manifest["layers"][0]["digest"] == "sha256:" + hashlib.sha256(image.layer).hexdigest()
    assert manifest["config"]["digest"] == "sha256:" + hashlib.sha256(image.config).hexdigest()
    diff = gzip.decompress(image.layer)
    assert config["rootfs"]["diff_ids"] == ["sha256:" + hashlib.sha256(diff).hexdigest()]
    with tarfile.open(fileobj=io.BytesIO(diff)) as tar:
        members = {m.name: m for m in tar.getmembers()}
    assert set(members) == {"usr", "usr/bin", "usr/bin/tool", "bin", "bin/t"}
    assert members["usr/bin/tool"].mode == 0o755 and members["bin/t"].linkname == "../usr/bin/tool"
    assert config["config"] == {"Cmd": ["tool"]}


def test_the_registry_serves_what_was_pushed_at_its_digest(served: dict[str, object]) -> None:
    address = served["url"]
    digest = served["images"]["rigup-testbed/busybox:1.35"]  # type: ignore[index]
    assert digest == registry.busybox_image().digest
    body, headers = _get(f"http://{address}/v2/rigup-testbed/busybox/manifests/{digest}", registry.MANIFEST_TYPE)
    assert "sha256:" + hashlib.sha256(body).hexdigest() == digest == headers["Docker-Content-Digest"]
    layer = json.loads(body)["layers"][0]
    blob, _ = _get(f"http://{address}/v2/rigup-testbed/busybox/blobs/{layer['digest']}")
    assert "sha256:" + hashlib.sha256(blob).hexdigest() == layer["digest"] and len(blob) == layer["size"]
    catalog, _ = _get(f"http://{address}/v2/_catalog")
    assert json.loads(catalog) == {"repositories": ["rigup-testbed/busybox"]}


def test_a_second_push_of_the_same_image_is_the_same_digest(served: dict[str, object]) -> None:
    image = registry.busybox_image()
    assert registry.push(str(served["url"]), image) == image.digest
