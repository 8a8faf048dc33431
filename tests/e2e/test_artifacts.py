"""Artifacts on the test bed: sources at the locked commits, model files fetched and verified, a re-run
that moves zero bytes, and fleet mode (three rigs, each file crosses the hub endpoint once).

The bed: rig-01 (canary, variant dual), rig-02 and rig-03 (variant dual-dflash). The main model's chain
is rig-01 (reads the hub), rig-02, rig-03; the DFlash draft's is rig-02 (reads the hub), rig-03. Each
rig forwards verified pieces down its chains while they arrive.
"""

from __future__ import annotations

import json
import shutil
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from rigup.desired.lock import LockFile
from rigup.rig.imagemirror import pin_name
from rigup_testbed.fleet import Testbed
from rigup_testbed.hfhub import HubAdmin
from rigup_testbed.hosts import HostSpec
from rigup_testbed.net import shape_port, unshape_port
from rigup_testbed.registry import served_blob_bytes
from tests.e2e.boundary_probe import check_services_from_outside, plan_of, writes_refused_from_members
from tests.e2e.helpers import run

pytestmark = pytest.mark.e2e

TASKS = ("tasks/sources.py", "tasks/model.py")
QWEN = "Lorbus/Qwen3.6-27B-int4-AutoRound"
DFLASH = "z-lab/Qwen3.6-27B-DFlash"
QWEN_DIR = "/opt/rigup/models/qwen3.6-27b-autoround-int4"
SHARD2 = "model-00002-of-00002.safetensors"
RUN = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture(scope="module")
def bed(testbed_factory: Callable[..., Testbed]) -> Testbed:
    return testbed_factory(
        [HostSpec("rig-01", group="canary"), HostSpec("rig-02", group="rigs"), HostSpec("rig-03", group="rigs")],
        "rigart",
    )


@pytest.fixture(scope="module")
def fleet(bed: Testbed) -> Path:
    path = bed.write_fleet(
        bed.workdir / "rigs.yaml",
        group_data={"canary": {"variant": "dual"}, "rigs": {"variant": "dual-dflash"}},
        # These tasks only reach git and the Hugging Face endpoint (both at the hub); the hosts have no
        # route anywhere else, so knobs the hub does not serve yet cannot leak.
        require_all_urls=False,
    )
    proc = run([sys.executable, "-m", "rigup", "lock"], path, 300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    bed.ledger.add("file", path=str(path.with_name("rigs.lock.yaml")))
    return path


@pytest.fixture(scope="module")
def lock(fleet: Path) -> LockFile:
    return LockFile.load(fleet.with_name("rigs.lock.yaml"))


@pytest.fixture(scope="module")
def hub(bed: Testbed) -> HubAdmin:
    return HubAdmin(bed.urls["hf_endpoint"], ca_file=bed.ca_cert)


def _converge(pyinfra_run: RUN, fleet: Path, *opts: str) -> subprocess.CompletedProcess[str]:
    proc = pyinfra_run(fleet, *TASKS, opts=["-v", *opts], timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    return proc


def _results(output: str) -> dict[str, tuple[int, int, int]]:
    """Operation -> (success, error, no change) from pyinfra's results table."""
    rows: dict[str, tuple[int, int, int]] = {}
    lines = output.split("--> Results:", 1)[1].splitlines()[2:]
    for line in lines:
        parts = line.split()
        if parts[:1] == ["Grand"]:
            break
        if len(parts) < 5:
            continue
        counts = [0 if p == "-" else int(p) for p in parts[-4:]]  # hosts, success, error, no change
        rows[" ".join(parts[:-4])] = (counts[1], counts[2], counts[3])
    return rows


def _locked_files(lock: LockFile, repo: str) -> dict[str, Any]:
    return {f.path: f for f in lock.models[f"model:{repo}"].files}


def _model_bytes(lock: LockFile, *repos: str) -> int:
    return sum(f.size for repo in repos for f in lock.models[f"model:{repo}"].files)


def _report(host: Any) -> dict[str, Any]:
    return json.loads(host.ssh("sudo cat /opt/rigup/state/fetch-report.json").stdout)


def test_fresh_converge_fetches_each_file_from_the_hub_once(
    bed: Testbed, fleet: Path, lock: LockFile, hub: HubAdmin, pyinfra_run: RUN
) -> None:
    hub.reset_stats()
    _converge(pyinfra_run, fleet)

    stats = hub.stats()
    # Three rigs, two models: every byte crossed the endpoint exactly once.
    assert stats["total_bytes"] == _model_bytes(lock, QWEN, DFLASH)
    for repo in (QWEN, DFLASH):
        for path, pin in _locked_files(lock, repo).items():
            assert stats["files"][f"{repo}/{path}"]["bytes"] == pin.size, path
    # LFS files came through the hub's 302 to its CDN (another origin), which saw no token
    assert any("GET /_lfs/" in key for key in stats["requests"]), stats["requests"]
    assert all(s["redirected"] == 1 for key, s in stats["files"].items() if key.endswith(".safetensors")), stats["files"]
    assert stats["cdn_authorized_requests"] == 0

    one, two, three = bed.hosts
    assert _report(three)["bytes_from_hub"] == 0
    assert _report(three)["bytes_from_peer"] == _model_bytes(lock, QWEN, DFLASH)

    for host, repos in ((one, (QWEN,)), (two, (QWEN, DFLASH)), (three, (QWEN, DFLASH))):
        for repo in repos:
            name = "qwen3.6-27b-autoround-int4" if repo == QWEN else "qwen3.6-27b-dflash"
            listing = host.ssh(f"cd /opt/rigup/models/{name} && sudo sha256sum $(sudo find . -type f -printf '%P ')").stdout
            got = {line.split()[1]: line.split()[0] for line in listing.splitlines()}
            assert got == {p: f.sha256 for p, f in _locked_files(lock, repo).items()}, (host.name, repo)
        checkout = host.ssh("sudo git -C /opt/rigup/sources/vllm-fork rev-parse HEAD").stdout.strip()
        assert checkout == lock.git_commit("git:vllm-fork")
    # rig-01's variant has no draft: it was not downloaded there.
    assert one.ssh("test -e /opt/rigup/models/qwen3.6-27b-dflash", check=False).returncode != 0


def test_rerun_changes_nothing_and_moves_zero_bytes(bed: Testbed, fleet: Path, hub: HubAdmin, pyinfra_run: RUN) -> None:
    reports = {h.name: _report(h) for h in bed.hosts}
    hub.reset_stats()
    proc = _converge(pyinfra_run, fleet)
    rows = _results(proc.stdout + proc.stderr)
    assert rows["Fetch locked model files (fleet: one rig reads the hub, the others forward verified pieces)"] == (0, 0, 3)
    assert rows["Check out each source at its locked commit"] == (0, 0, 3)
    changed = {op: counts for op, counts in rows.items() if counts[0] or counts[1]}
    assert changed == {}, rows
    assert hub.stats()["total_bytes"] == 0
    # rigfetch did not even run: nothing was hashed (its last report is the previous run's).
    assert {h.name: _report(h) for h in bed.hosts} == reports


def test_corrupted_shard_is_refetched_from_a_fleet_peer(
    bed: Testbed, fleet: Path, lock: LockFile, hub: HubAdmin, pyinfra_run: RUN
) -> None:
    three = bed.hosts[2]
    three.ssh(f"sudo dd if=/dev/zero of={QWEN_DIR}/{SHARD2} bs=1 count=32 seek=4096 conv=notrunc status=none")
    hub.reset_stats()
    _converge(pyinfra_run, fleet)
    report = _report(three)
    size = _locked_files(lock, QWEN)[SHARD2].size
    assert (report["bytes_hashed"], report["bytes_downloaded"], report["bytes_from_peer"]) == (size, size, size)
    assert hub.stats()["total_bytes"] == 0
    got = three.ssh(f"sudo sha256sum {QWEN_DIR}/{SHARD2}").stdout.split()[0]
    assert got == _locked_files(lock, QWEN)[SHARD2].sha256


def test_reverify_rehashes_without_downloading(
    bed: Testbed, fleet: Path, lock: LockFile, hub: HubAdmin, pyinfra_run: RUN
) -> None:
    hub.reset_stats()
    _converge(pyinfra_run, fleet, "--limit", "rig-01", "--data", "model_reverify=true")
    report = _report(bed.hosts[0])
    assert (report["bytes_hashed"], report["bytes_downloaded"]) == (_model_bytes(lock, QWEN), 0)
    assert hub.stats()["total_bytes"] == 0


# ------------------------------------------------------------------------------------------
# the fleet chain on a shaped LAN: rig-01 holds the main model, rig-02 and rig-03 need it again


SHARD1 = "model-00001-of-00002.safetensors"
PIECE = 4 << 20  # rigfetch's default piece size


@pytest.fixture
def shaped(bed: Testbed) -> Any:
    """Each rig's port limited to 200 Mbit/s each way for the test (the 160 MB model then takes ~7 s)."""
    net = bed.network
    for h in bed.hosts:
        shape_port(net, h.name, h.index, "200mbit")
    yield
    for h in bed.hosts:
        unshape_port(net, h.name, h.index)


def _main_model_only_on_rig_01(bed: Testbed, pyinfra_run: RUN, fleet: Path, hub: HubAdmin) -> None:
    """Converge (every rig then holds both models: a no-op after the tests above), then take the main model
    off rig-02 and rig-03, so the next converge copies it down the chain rig-01, rig-02, rig-03."""
    _converge(pyinfra_run, fleet)
    for h in bed.hosts[1:]:
        h.ssh(f"sudo rm -rf {QWEN_DIR}")
    hub.reset_stats()


def _intact(host: Any, lock: LockFile) -> bool:
    listing = host.ssh(f"cd {QWEN_DIR} && sudo sha256sum $(sudo find . -type f -printf '%P ')").stdout
    got = {line.split()[1]: line.split()[0] for line in listing.splitlines()}
    return got == {p: f.sha256 for p, f in _locked_files(lock, QWEN).items()}


def test_a_peer_that_corrupts_a_piece_is_dropped_and_the_converge_succeeds(
    bed: Testbed, fleet: Path, lock: LockFile, hub: HubAdmin, pyinfra_run: RUN, shaped: Any
) -> None:
    one, two, three = bed.hosts
    _main_model_only_on_rig_01(bed, pyinfra_run, fleet, hub)
    failpoints = json.dumps(
        {"corrupt_served_piece": {"file": f"qwen3.6-27b-autoround-int4/{SHARD1}", "piece": 3, "piece_size": PIECE}}
    )
    two.ssh(f"echo '{failpoints}' | sudo tee /opt/rigup/state/rigfetch-failpoints.json >/dev/null")
    try:
        _converge(pyinfra_run, fleet)
    finally:
        two.ssh("sudo rm -f /opt/rigup/state/rigfetch-failpoints.json")
    # This run's chain: rig-01 (holds it), rig-02, rig-03. rig-02 sent piece 3 with a byte flipped;
    # rig-03 caught it against rig-01's digest, dropped rig-02 and read the rest from rig-01.
    report = _report(three)
    assert (report["pieces_rejected"], report["peers_dropped"], report["hash_mismatches"]) == (1, 1, 0)
    assert report["bytes_from_hub"] == 0
    log = three.ssh("sudo cat /opt/rigup/state/fetch.log").stdout
    assert f"piece 3 of qwen3.6-27b-autoround-int4/{SHARD1} failed its hash" in log
    assert all(_intact(h, lock) for h in bed.hosts)  # no rig stamped a bad file
    assert hub.stats()["total_bytes"] == 0  # the fleet held a copy: the hub sent nothing


def test_a_peer_killed_mid_transfer_fails_alone_and_the_next_converge_heals_it(
    bed: Testbed, fleet: Path, lock: LockFile, hub: HubAdmin, pyinfra_run: RUN, shaped: Any
) -> None:
    one, two, three = bed.hosts
    _main_model_only_on_rig_01(bed, pyinfra_run, fleet, hub)
    result: dict[str, subprocess.CompletedProcess[str]] = {}
    converge = threading.Thread(target=lambda: result.update(proc=pyinfra_run(fleet, *TASKS, opts=["-v"], timeout=900)))
    converge.start()
    try:
        # Kill rig-02's rigfetch once rig-03 is receiving shard 1 from it (its nearest upstream).
        part = f"{QWEN_DIR}/.{SHARD1}.rigfetch-part"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            size = three.ssh(f"sudo stat -c %s {part} 2>/dev/null || echo 0", check=False).stdout.strip() or "0"
            if int(size) >= PIECE:
                break
            time.sleep(0.2)
        else:
            pytest.fail("rig-03 never started receiving shard 1")
        two.ssh("sudo pkill -KILL -f '/opt/rigup/bin/[r]igfetch.py --manifest-b64'")  # [r]: not this shell
    finally:
        converge.join(timeout=900)
    proc = result["proc"]
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0  # rig-02 failed its model step
    rows = _results(output)
    name = "Fetch locked model files (fleet: one rig reads the hub, the others forward verified pieces)"
    assert rows[name][1] == 1, rows  # one error: rig-02
    report = _report(three)
    log = three.ssh("sudo grep -v 'serve: ' /opt/rigup/state/fetch.log | tail -40").stdout
    assert report["ok"] and report["peers_dropped"] >= 1 and report["bytes_from_hub"] == 0, log
    assert _intact(three, lock)
    assert hub.stats()["total_bytes"] == 0
    # The next converge resumes rig-02 from its verified pieces, from a peer.
    _converge(pyinfra_run, fleet)
    assert _intact(two, lock)
    assert _report(two)["bytes_from_hub"] == 0 and hub.stats()["total_bytes"] == 0


# ------------------------------------------------------------------------------------------
# images: the mirror on rig-01, a relay on rig-02 and rig-03, the blobs moved along the chain


def _registry_image_bytes(registry: str, repository: str, digest: str, ca_file: Path | None) -> int:
    request = urllib.request.Request(f"{'https' if ca_file else 'http'}://{registry}/v2/{repository}/manifests/{digest}",
                                     headers={"Accept": "application/vnd.docker.distribution.manifest.v2+json"})
    context = ssl.create_default_context(cafile=str(ca_file)) if ca_file else None  # the bed's CA: the hub is https
    manifest = json.loads(urllib.request.urlopen(request, timeout=30, context=context).read())
    return int(manifest["config"]["size"]) + sum(int(layer["size"]) for layer in manifest["layers"])


# deploy.py's order: the boundary before anything listens
IMAGE_TASKS = ("tasks/boundary.py", "tasks/image_mirror.py")
OUTSIDER_ROWS = {"the image mirror (registry)", "the chain server (models and images rig to rig)"}


def _ip(bed: Testbed) -> Callable[[str], str]:
    return lambda name: bed.host(name).ip


def _image_report(host: Any) -> dict[str, Any]:
    return json.loads(host.ssh("sudo cat /opt/rigup/state/images/fetch-report.json").stdout)


def test_an_image_reaches_every_relay_along_the_chain_and_upstream_serves_it_once(
    bed: Testbed, fleet: Path, pyinfra_run: RUN
) -> None:
    """One converge of the three rigs: rig-01 runs the mirror and heads the chain (reads the hub's registry,
    as it would Docker Hub), rig-02 and rig-03 run relays and get every blob forwarded, verified, from the
    rig before them. Each relay then serves the image on 127.0.0.1 from its own disk, and a re-run changes
    nothing. The boundary is on (tasks/boundary.py first, as deploy.py runs it): all along the converge and
    after it, the outsider's registry pulls, pushes and deletes at the mirror and its requests to every rig's
    chain server get nothing through (tests/e2e/boundary_probe.py, those rows of the port table alone, no
    port scan), while the chain still moves every blob rig to rig, a client of the mirror pulls the image from
    it, and neither the mirror nor a relay takes a push or a delete from a member (read-only: 405)."""
    directory = fleet.parent / "images"
    directory.mkdir(exist_ok=True)
    images = bed.write_fleet(
        directory / "rigs.yaml",
        data={"image_mirror_host": "rig-01"},
        group_data={"canary": {"variant": "dual"}, "rigs": {"variant": "dual-dflash"}},
        require_all_urls=False,
    )
    shutil.copy(fleet.with_name("rigs.lock.yaml"), directory / "rigs.lock.yaml")
    bed.ledger.add("file", path=str(directory / "rigs.lock.yaml"))
    registry, log = bed.urls["engine_registry"], Path(bed.urls["engine_registry_log"])
    served_before = served_blob_bytes(log, "vllm/vllm-openai")

    plan, netns = plan_of(images), bed.network.hub_netns
    rounds: list[float] = []
    failures: list[BaseException] = []
    converged = threading.Event()

    def outsider() -> None:
        """The outsider asks again and again while the chain servers serve the blobs, and once more after the
        converge (that round beside the members' checks below)."""
        while True:
            after, started = converged.is_set(), time.monotonic()
            try:
                check_services_from_outside(plan, _ip(bed), netns, OUTSIDER_ROWS)
            except BaseException as exc:  # noqa: BLE001 - raised in the test's thread below
                failures.append(exc)
                return
            rounds.append(time.monotonic() - started)
            if after:
                return

    asking = threading.Thread(target=outsider, daemon=True)
    asking.start()
    try:
        proc = pyinfra_run(images, *IMAGE_TASKS, opts=["-v"], timeout=900)
    finally:
        converged.set()
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]

    one, two, three = bed.hosts
    keep = json.loads(one.ssh("cat /etc/rigup/image-mirror-keep.json").stdout)
    (pin,) = keep["keep"]  # the bed's lock pins the tag
    repository, tag = pin.rsplit(":", 1)
    digest = bed.urls["engine_registry_images"][pin]
    size = _registry_image_bytes(registry, repository, digest, bed.ca_cert)
    assert served_blob_bytes(log, repository) - served_before == size  # the hub sent one copy, to rig-01
    assert _image_report(one)["bytes_from_hub"] == size
    for relay in (two, three):
        report = _image_report(relay)
        assert (report["bytes_from_hub"], report["bytes_from_peer"]) == (0, size), relay.name
        relay_keep = json.loads(relay.ssh("cat /etc/rigup/image-mirror-keep.json").stdout)
        assert relay_keep["keep"] == [pin] and relay_keep["pins_only"] is True
        check = json.loads(relay.ssh("sudo python3 /opt/rigup/bin/rigup-image-mirror check "
                                     "/etc/rigup/image-mirror-keep.json").stdout)
        assert check["missing"] == [] and check["pins"][pin]["digest"] == digest
        # the relay answers the pull on loopback only, from its own disk
        got = relay.ssh(f"curl -fsS -H 'Accept: application/vnd.docker.distribution.manifest.v2+json' "
                        f"http://127.0.0.1:5000/v2/{repository}/manifests/{digest} | sha256sum").stdout.split()[0]
        assert "sha256:" + got == digest
        assert relay.ssh(f"curl -fsS -m 5 http://{relay.ip}:5000/v2/", check=False).returncode != 0
        # read-only: the relay takes no push or delete on loopback either
        writes = relay.ssh("for w in 'POST /v2/rigup-probe/blobs/uploads/' 'PUT /v2/rigup-probe/manifests/latest' "
                           f"'DELETE /v2/{repository}/manifests/{digest}'; do set -- $w; curl -s -o /dev/null "
                           "-w '%{http_code} ' -m 5 -X $1 http://127.0.0.1:5000$2; done").stdout.split()
        assert writes == ["405", "405", "405"], (relay.name, writes)
    served = served_blob_bytes(log, repository)

    # a client of the mirror pulls through it (what its relay does on a miss); the boundary lets the member in
    pulled = two.ssh(f"curl -fsS -m 10 -H 'Accept: application/vnd.docker.distribution.manifest.v2+json' "
                     f"http://{one.ip}:5000/v2/{repository}/manifests/{digest} | sha256sum").stdout.split()[0]
    assert "sha256:" + pulled == digest
    refused = writes_refused_from_members(plan, _ip(bed), lambda member, command: bed.host(member).ssh(
        command, check=False).stdout)
    asking.join(120)
    assert not asking.is_alive() and not failures, failures[:1]
    print(f"the outsider's requests to the mirror and the chain servers, none through: {len(rounds) - 1} rounds during "
          f"the converge and one after it ({max(rounds):.1f} s at most); a member's writes: {refused}")
    assert len(rounds) >= 2 and served_blob_bytes(log, repository) == served

    again = pyinfra_run(images, *IMAGE_TASKS, opts=["-v"], timeout=900)
    assert again.returncode == 0, again.stdout[-6000:] + again.stderr[-6000:]
    changed = {op: counts for op, counts in _results(again.stdout + again.stderr).items() if counts[0] or counts[1]}
    assert changed == {}
    assert served_blob_bytes(log, repository) == served


def test_an_image_peer_that_corrupts_a_piece_is_dropped_and_no_relay_keeps_a_bad_blob(
    bed: Testbed, fleet: Path, pyinfra_run: RUN
) -> None:
    """rig-01 and rig-02 hold the image (the test above); rig-03's relay loses it. Its chain: rig-01,
    rig-02 (both holding it), rig-03, which reads its nearest upstream, rig-02. rig-02 sends piece 3 of
    the largest layer with a byte flipped: rig-03 catches it against rig-01's digest, drops rig-02, reads
    the rest from rig-01, and its relay serves the right image; upstream and the mirror's registry send
    nothing."""
    images = fleet.parent / "images" / "rigs.yaml"
    one, two, three = bed.hosts
    check = json.loads(one.ssh("sudo python3 /opt/rigup/bin/rigup-image-mirror check /etc/rigup/image-mirror-keep.json").stdout)
    ((pin, listed),) = check["pins"].items()
    layer, size = max(listed["blobs"], key=lambda blob: blob[1])
    assert size > 4 * PIECE
    three.ssh("sudo systemctl stop docker-registry && sudo rm -rf /var/lib/docker-registry/docker "
              "/var/lib/docker-registry/rigup-staging && sudo systemctl start docker-registry")
    failpoints = json.dumps({"corrupt_served_piece": {"file": f"{pin_name(pin)}/{layer}", "piece": 3, "piece_size": PIECE}})
    two.ssh(f"echo '{failpoints}' | sudo tee /opt/rigup/state/images/rigfetch-failpoints.json >/dev/null")
    log = Path(bed.urls["engine_registry_log"])
    served = served_blob_bytes(log, listed["repository"])
    try:
        proc = pyinfra_run(images, "tasks/image_mirror.py", opts=["-v"], timeout=900)
    finally:
        two.ssh("sudo rm -f /opt/rigup/state/images/rigfetch-failpoints.json")
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    report = _image_report(three)
    assert (report["pieces_rejected"], report["peers_dropped"], report["hash_mismatches"]) == (1, 1, 0), report
    assert report["bytes_from_hub"] == 0  # not even the mirror's registry: rig-01 sent the rest
    assert f"piece 3 of {pin_name(pin)}/{layer} failed its hash" in three.ssh("sudo cat /opt/rigup/state/images/fetch.log").stdout
    got = three.ssh(f"curl -fsS http://127.0.0.1:5000/v2/{listed['repository']}/blobs/{layer} | sha256sum").stdout.split()[0]
    assert "sha256:" + got == layer  # the relay keeps and serves only verified bytes
    assert served_blob_bytes(log, listed["repository"]) == served


def test_stale_lock_stops_the_deploy_before_any_change(bed: Testbed, fleet: Path, pyinfra_run: RUN) -> None:
    proc = pyinfra_run(fleet, *TASKS, opts=["--data", "vllm_fork_git_url=http://10.0.0.1/elsewhere/vllm.git"], timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "git:vllm-fork: locked from" in output and "rigup lock`" in output
    assert "Beginning operation run" not in output
