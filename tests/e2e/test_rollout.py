"""A fleet rollout on the test bed: a canary first, then batches, with a host that is down, every rig pulling
the vLLM image through the fleet's image mirror on the canary; the mirror host's converged re-run changes
nothing. Its own 4-host bed (rig-01 the canary and mirror, rig-02..04 in group rigs, rig-03 powered off),
apart from tests/e2e/test_serving.py's so that the two run side by side (issue 39). The deploys are the real
`python -m rigup.cli.rollout` and `pyinfra -y inventory.py deploy.py`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from rigup.desired.lock import LockFile
from rigup_testbed.fleet import Testbed
from rigup_testbed.hosts import HostSpec
from rigup_testbed.image import REPO_ROOT
from rigup_testbed.registry import served_blob_bytes
from tests.e2e.test_serving import VARIANT, Bed, _recipe, provenance, registry_image_bytes, sh, unit_prop

pytestmark = pytest.mark.e2e


def test_rollout_with_a_canary_and_a_host_down(testbed_factory: Callable[..., Testbed]) -> None:
    testbed = testbed_factory(
        [HostSpec("rig-01", group="canary")] + [HostSpec(f"rig-0{i}", group="rigs") for i in (2, 3, 4)], "rigro",
        host_layer=True,
    )
    b = Bed(testbed, testbed.workdir)
    b.data["rollout_batch"] = 2
    b.data["image_mirror_host"] = "rig-01"  # the canary mirrors the hub's registry for the fleet
    b.write()
    hub_log = Path(testbed.urls["engine_registry_log"])
    hub_before = served_blob_bytes(hub_log, "vllm/vllm-openai")
    down = b.host("rig-03")
    down.ssh("sudo -n systemctl poweroff", check=False, timeout=30)
    deadline = time.monotonic() + 60
    while down.running() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not down.running()
    proc = subprocess.run(
        [sys.executable, "-m", "rigup.cli.rollout", "--json", "--log-dir", str(testbed.workdir / "rollout")],
        cwd=REPO_ROOT, env=b.env(), capture_output=True, text=True, timeout=1800,
    )
    result = json.loads(proc.stdout)
    statuses = {h["host"]: (h["step"], h["status"]) for h in result["hosts"]}
    assert statuses == {
        "rig-01": ("canary", "ok"),
        "rig-02": ("batch 1", "ok"),
        "rig-03": ("batch 1", "down"),
        "rig-04": ("batch 2", "ok"),
    }, json.dumps(result, indent=1)
    assert result["stopped"] is None and proc.returncode == 1
    # The canary step ran (and gated) before any other host was touched.
    canary_log = (testbed.workdir / "rollout" / "canary.log").read_text()
    assert "rig-02" not in canary_log and "Health-gate the (re)started variant" in canary_log
    for name in ("rig-01", "rig-02", "rig-04"):
        assert provenance(b.host(name))["gate"]["result"] == "passed"

    # The image mirror: every rig pulled the vLLM image from its own loopback registry, rig-01's being the
    # mirror and the others' relays of it (filled through rig-01 in a step without rig-01 in it too), and
    # the hub served the image's blobs once: rig-01 cached them before any rig pulled.
    local = "127.0.0.1:5000"
    image = _recipe(VARIANT).image
    digest = testbed.urls["engine_registry_images"][f"{image.repository}:{image.tag}"]
    pin = LockFile.load(b.lock).image_digest(image.lock_name)  # None: the bed's lock pins tags
    assert pin in (None, digest)
    kept = f"{image.repository}@{pin}" if pin else f"{image.repository}:{image.tag}"
    for name in ("rig-01", "rig-02", "rig-04"):
        ref = f"{local}/{image.repository}:{image.tag}" + (f"@{pin}" if pin else "")
        digests = json.loads(sh(b.host(name), f"docker image inspect --format '{{{{json .RepoDigests}}}}' {ref}"))
        assert f"{local}/{image.repository}@{digest}" in digests, (name, digests)
        keep = json.loads(sh(b.host(name), "cat /etc/rigup/image-mirror-keep.json"))
        assert kept in keep["keep"] and keep["pins_only"] is (name != "rig-01"), (name, keep)
        assert unit_prop(b.host(name), "docker-registry.service", "ActiveState") == "active"
    relay = json.loads(sh(b.host("rig-02"), "cat /etc/rigup/image-mirror-keep.json"))
    assert relay["upstream"] == f"http://{b.host('rig-01').ip}:5000", relay
    image_bytes = registry_image_bytes(testbed.urls["engine_registry"], image.repository, digest, testbed.ca_cert)
    assert served_blob_bytes(hub_log, image.repository) - hub_before == image_bytes
    # A converged mirror host changes nothing on a re-run: cache, bound, registry and daemon.json all hold.
    again = b.deploy_json("--limit", "rig-01")
    mirror_ops = [op for op in again["results"]["operations"]
                  if op["name"].startswith(("tasks/image_mirror.py", "tasks/docker.py"))]
    assert len(mirror_ops) > 10 and [op["name"] for op in mirror_ops if op["success"]] == []
