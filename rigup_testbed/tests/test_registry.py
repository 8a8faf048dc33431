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
from rigup_testbed.image import cache_dir


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


def test_an_image_built_again_shares_its_layer_under_another_digest() -> None:
    image = registry.build_image("t/x", "1", {"/a": (b"a", 0o644)}, {}, {"Cmd": ["a"]})
    again = registry.rebuilt(image, "2", {"build": "2"})
    assert again.layer == image.layer and again.digest != image.digest and again.tag == "2"
    config = json.loads(again.config)
    assert config["config"] == {"Cmd": ["a"], "Labels": {"build": "2"}}
    assert config["rootfs"] == json.loads(image.config)["rootfs"]


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


def test_the_vllm_image_runs_the_stand_in_server_on_the_rigs_python(tmp_path: Path) -> None:
    roots = sorted((cache_dir() / "images").glob("*/root"))
    if not roots or not Path(registry.BUSYBOX).exists():
        pytest.skip("no test-bed root image built yet (the e2e tests build it)")
    image = registry.vllm_image(registry.python_runtime(roots[0]), "v0")
    config = json.loads(image.config)["config"]
    assert config["Entrypoint"] == ["vllm", "serve"] and config["WorkingDir"] == "/vllm-workspace"
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(image.layer))) as tar:
        members = {m.name: m for m in tar.getmembers()}
    assert members["usr/local/bin/vllm"].linkname == "/usr/lib/rigup-standin/vllm_entry.py"
    assert members["usr/bin/python3"].linkname == "/usr/lib/rigup-standin/image_shim.py"  # vLLM's programs: simulated
    assert members["usr/bin/python3.11"].isfile() and members["lib/x86_64-linux-gnu/libc.so.6"].isfile()
    assert members["lib/x86_64-linux-gnu/libgcc_s.so.1"].isfile()  # dlopened at thread exit: no ELF names it
    listed = json.loads(tar_file(image, "usr/lib/rigup-standin/image.json"))
    assert "/usr/local/lib/python3.12/dist-packages/vllm/__init__.py" in listed["files"]
    # what upstream's entrypoints look for: the module club-3090's PR 41800 overlay patches, the chat templates
    assert "/usr/local/lib/python3.12/dist-packages/vllm/entrypoints/utils.py" in listed["files"]
    assert "/vllm-workspace/examples/tool_chat_template_gemma4.jinja" in listed["files"]


def test_the_vllm_omni_image_has_no_entrypoint_and_says_its_kind() -> None:
    roots = sorted((cache_dir() / "images").glob("*/root"))
    if not roots or not Path(registry.BUSYBOX).exists():
        pytest.skip("no test-bed root image built yet (the e2e tests build it)")
    image = registry.vllm_image(registry.python_runtime(roots[0]), "v0.20.0", "vllm-omni")
    assert image.repository == "vllm/vllm-omni"
    config = json.loads(image.config)["config"]
    assert config["Entrypoint"] is None and config["WorkingDir"] == "/app"  # the compose command is `vllm serve ...`
    assert json.loads(tar_file(image, "usr/lib/rigup-standin/image.json"))["kind"] == "vllm-omni"
    assert "v0.20.0" in registry.catalog_tags("vllm/vllm-omni")
    assert registry.catalog_tags("lmcache/vllm-openai") == []  # pinned by upstream's digest: not built here


def tar_file(image: registry.Image, name: str) -> bytes:
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(image.layer))) as tar:
        member = tar.extractfile(name)
        assert member is not None
        return member.read()


def test_the_image_shim_knows_the_containers_bind_mounts() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("image_shim", registry.STANDIN_DIR / "image_shim.py")
    assert spec is not None and spec.loader is not None
    shim = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shim)
    mountinfo = (
        "1083 956 0:77 / / rw,relatime master:300 - overlay overlay rw,lowerdir=/var/lib/docker/overlay2/l/X\n"
        "1084 1083 0:80 / /proc rw,nosuid,nodev,noexec,relatime - proc proc rw\n"
        "1090 1083 0:46 /opt/rigup/models /root/.cache/huggingface ro,relatime - overlay overlay rw\n"
        "1091 1083 0:46 /opt/ai/vllm-src/marlin.py /usr/local/lib/python3.12/dist-packages/vllm/marlin.py ro - ext4 /dev/vda rw\n"
        "1092 1083 0:46 /etc/rigup-testbed /etc/rigup-testbed ro - overlay overlay rw\n"
        "1093 1083 0:86 / /dev/shm rw - tmpfs shm rw,size=16777216k\n"
        "1094 1083 0:46 /x /with\\040space rw - ext4 /dev/vda rw\n"
    )
    assert shim.mount_targets(mountinfo) == ["/root/.cache/huggingface", "/usr/local/lib/python3.12/dist-packages/vllm/marlin.py",
                                             "/etc/rigup-testbed", "/with space"]


def test_an_image_with_a_second_layer_lists_both_in_order() -> None:
    base = registry.build_image("t/x", "1", {"/a": (b"a", 0o644)}, {}, {"Cmd": ["a"]})
    top_tar = registry._layer_tar({"/usr/local/bin/b": (b"b", 0o755)}, {})
    top = registry.Layer(gzip.compress(top_tar, mtime=0), "sha256:" + hashlib.sha256(top_tar).hexdigest(), "pip install b")
    image = registry.build_image("t/x", "1", {"/a": (b"a", 0o644)}, {}, {"Cmd": ["a"]}, (top,))
    manifest, config = json.loads(image.manifest), json.loads(image.config)
    assert image.layers == (base.layer, top.blob) and image.layer == base.layer
    assert [x["digest"] for x in manifest["layers"]] == ["sha256:" + hashlib.sha256(x).hexdigest() for x in image.layers]
    assert config["rootfs"]["diff_ids"] == [json.loads(base.config)["rootfs"]["diff_ids"][0], top.diff_id]
    assert [h["created_by"] for h in config["history"]] == [registry.BASE_CREATED_BY, "pip install b"]
    # one layer: the config and manifest a single-layer image always had (its digest does not move)
    assert json.loads(base.config)["history"] == [{"created": "2025-09-30T00:00:00Z", "created_by": registry.BASE_CREATED_BY}]
    again = registry.rebuilt(image, "2", {"build": "2"})
    assert again.layers == image.layers and json.loads(again.config)["rootfs"] == config["rootfs"]
    assert json.loads(again.config)["history"] == config["history"] and again.digest != image.digest


def test_the_vllm_image_carries_ray_in_a_second_layer_over_the_same_first() -> None:
    roots = sorted((cache_dir() / "images").glob("*/root"))
    if not roots or not Path(registry.BUSYBOX).exists():
        pytest.skip("no test-bed root image built yet (the e2e tests build it)")
    runtime = registry.python_runtime(roots[0])
    started = time.monotonic()
    ray = registry.ray_layer(roots[0], runtime)  # pip download + build once (~1 min), then read from the cache
    print(f"ray layer: {len(ray.blob) / 1e6:.1f} MB in {time.monotonic() - started:.1f} s")
    with_ray, without = registry.vllm_image(runtime, "v0", ray=ray), registry.vllm_image(runtime, "v0")
    assert len(with_ray.layers) == 2 and with_ray.layers[0] == without.layer and with_ray.layers[1] == ray.blob
    assert with_ray.digest != without.digest
    config = json.loads(with_ray.config)
    assert config["rootfs"]["diff_ids"] == [*json.loads(without.config)["rootfs"]["diff_ids"], ray.diff_id]
    assert config["config"] == json.loads(without.config)["config"]  # entrypoint, workdir, env: unchanged
    assert ray.diff_id == "sha256:" + hashlib.sha256(gzip.decompress(ray.blob)).hexdigest()
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(ray.blob))) as tar:
        members = {m.name: m for m in tar.getmembers()}
        script = tar.extractfile("usr/local/bin/ray").read().decode()  # type: ignore[union-attr]
    site = registry.RAY_SITE.lstrip("/")
    assert site == "usr/local/lib/python3.11/dist-packages"  # where Debian's python3.11 looks
    version = tar_member_text(ray.blob, f"{site}/ray-{registry.RAY_VERSION}.dist-info/METADATA")
    assert f"Version: {registry.RAY_VERSION}" in version
    assert members[f"{site}/ray/_raylet.so"].isfile() and members[f"{site}/ray/core/src/ray/raylet/raylet"].mode == 0o755
    assert script.startswith("#!/usr/bin/python3.11\n") and "from ray.scripts.scripts import main" in script
    assert members["usr/local/bin/ray"].mode == 0o755
    # what Ray's binaries load beyond the base layer's libraries; no base file is shadowed
    assert members["lib/x86_64-linux-gnu/libstdc++.so.6"].isfile()
    base_files = set(runtime[0]) | set(runtime[1])
    assert not [m for m in members.values() if m.isfile() and "/" + m.name in base_files]
    assert not any("__pycache__" in name for name in members)  # no bytecode: the same bytes every build
    # vLLM-Omni's image gets no Ray
    with pytest.raises(ValueError, match="gets no Ray layer"):
        registry.vllm_image(runtime, "v0", "vllm-omni", ray=ray)


def tar_member_text(blob: bytes, name: str) -> str:
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(blob))) as tar:
        member = tar.extractfile(name)
        assert member is not None
        return member.read().decode()
