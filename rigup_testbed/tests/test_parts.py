"""Fast tests of the test bed's pure parts: hardware schema, subnet choice, ledger, fleet document."""

from __future__ import annotations

import ipaddress
import json
import subprocess
import time
import types
from pathlib import Path

import pytest

from rigup_testbed import hardware as hw
from rigup_testbed import net
from rigup_testbed.fleet import Testbed
from rigup_testbed.hosts import Host
from rigup_testbed.hub import url_knobs
from rigup_testbed.standin_modules import load_standin
from rigup_testbed.state import Ledger, TestbedError, proc_starttime, signal_exact

# The knobs the brief says the test bed must point at the hub (more may be added to all.py).
EXTERNAL_KNOBS = {
    "docker_apt_url", "docker_apt_key_url", "nvidia_ctk_apt_url", "nvidia_ctk_apt_key_url",
    "nvidia_cuda_repo_url", "nvidia_cuda_repo_key_url", "vllm_fork_git_url", "genesis_git_url",
    "hf_endpoint", "container_registry",
}  # fmt: skip


def test_reference_rig_preset_matches_an_rtx_3090_pair() -> None:
    h = hw.preset("2x3090", "rig-01")
    assert [g.name for g in h.gpus] == ["NVIDIA GeForce RTX 3090"] * 2
    assert [(g.memory_total_mib, g.compute_cap, g.power_default_w, g.power_limit_w) for g in h.gpus] == [(24576, "8.6", 350, 350)] * 2
    assert [g.pci_bus_id for g in h.gpus] == ["00000000:01:00.0", "00000000:02:00.0"]
    assert (h.driver_cuda, h.secure_boot, h.topology) == (None, False, "PIX")  # None: the branch decides


def test_gpu_uuids_are_stable_per_host_and_distinct_across_hosts() -> None:
    a1, a2, b = hw.preset("2x3090", "rig-01"), hw.preset("2x3090", "rig-01"), hw.preset("2x3090", "rig-02")
    assert [g.uuid for g in a1.gpus] == [g.uuid for g in a2.gpus]
    assert not {g.uuid for g in a1.gpus} & {g.uuid for g in b.gpus}
    assert all(g.uuid.startswith("GPU-") and len(g.uuid) == 40 for g in a1.gpus)


@pytest.mark.parametrize("name", sorted(hw.PRESETS))
def test_every_preset_round_trips_through_json(name: str) -> None:
    h = hw.preset(name, "rig-07", secure_boot=True)
    assert hw.from_dict(json.loads(h.to_json())) == h
    assert h.secure_boot is True
    assert (h.topology is None) == (len(h.gpus) < 2)


def test_presets_cover_single_mixed_and_smaller_cards() -> None:
    assert len(hw.preset("1x3090", "r").gpus) == 1
    assert {g.memory_total_mib for g in hw.preset("mixed-3090-3080", "r").gpus} == {24576, 20480}
    assert [g.memory_total_mib for g in hw.preset("2x3080-20gb", "r").gpus] == [20480, 20480]


def test_hardware_json_with_wrong_schema_or_topology_is_refused() -> None:
    data = hw.preset("2x3090", "r").to_dict()
    with pytest.raises(ValueError, match="schema"):
        hw.from_dict({**data, "schema": 2})
    with pytest.raises(ValueError, match="topology"):
        hw.from_dict({**data, "topology": "NVLINK"})
    with pytest.raises(ValueError, match="gpus\\[0\\]"):
        hw.from_dict({**data, "gpus": [{**data["gpus"][0], "bogus": 1}]})
    with pytest.raises(ValueError, match="unknown hardware preset"):
        hw.preset("4x4090", "r")


def test_url_knobs_are_read_from_group_data() -> None:
    knobs = url_knobs()
    assert EXTERNAL_KNOBS <= set(knobs)
    assert knobs["hf_endpoint"] == "https://huggingface.co"
    assert all(v.startswith("https://") for k, v in knobs.items() if k != "container_registry" and v is not None)
    assert knobs["gateway_pip_index_url"] is None  # pip's own configured index: the bed still points it at the hub


def test_subnet_skips_networks_in_use(monkeypatch: pytest.MonkeyPatch) -> None:
    used = [ipaddress.IPv4Network("10.213.0.0/24"), ipaddress.IPv4Network("10.213.1.128/25"), ipaddress.IPv4Network("10.0.0.0/16")]
    monkeypatch.setattr(net, "_root_networks", lambda: used)
    monkeypatch.delenv("RIGUP_TESTBED_SUBNET", raising=False)
    assert net.pick_subnet() == ipaddress.IPv4Network("10.213.2.0/24")
    monkeypatch.setattr(net, "_root_networks", lambda: [ipaddress.IPv4Network("10.213.0.0/16")])
    monkeypatch.setenv("RIGUP_TESTBED_SUBNET", "10.213.7.0/24")
    with pytest.raises(TestbedError, match="overlaps 10.213.0.0/16"):
        net.pick_subnet()
    monkeypatch.setenv("RIGUP_TESTBED_SUBNET", "192.168.250.0/24")
    assert net.pick_subnet() == ipaddress.IPv4Network("192.168.250.0/24")


def test_network_addresses_and_names() -> None:
    n = net.Network("rigup", ipaddress.IPv4Network("10.213.4.0/24"))
    assert (n.hub_ip, n.control_ip, n.host_ip(0), n.host_ip(7)) == ("10.213.4.1", "10.213.4.254", "10.213.4.11", "10.213.4.18")
    assert (n.hub_netns, n.host_netns("rig-01"), n.control_link) == ("rigup-hub", "rigup-rig-01", "rigup-ctl")
    with pytest.raises(TestbedError):
        n.host_ip(500)


def test_instance_names_must_fit_interface_names(tmp_path: Path) -> None:
    with pytest.raises(TestbedError, match="instance"):
        Testbed(tmp_path, "much-too-long")


def test_ledger_undoes_newest_first_and_tolerates_missing_things(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "state.json")
    d = tmp_path / "d"
    ledger.add("dir", path=str(d))
    d.mkdir()
    (d / "x").write_text("x")
    f = d / "inner-file"  # removed before its directory because it was recorded later
    ledger.add("file", path=str(f))
    f.write_text("y")
    ledger.add("file", path=str(tmp_path / "never-created"))
    ledger.add("netns", name="rigup-unit-test-never-created")
    assert json.loads((tmp_path / "state.json").read_text())["resources"][0] == {"kind": "dir", "path": str(d)}
    assert Ledger(tmp_path / "state.json").teardown() == []
    assert not d.exists()
    assert json.loads((tmp_path / "state.json").read_text())["resources"] == []


def test_only_the_recorded_process_is_signalled(tmp_path: Path) -> None:
    proc = subprocess.Popen(["sleep", "30"])
    try:
        start = proc_starttime(proc.pid)
        assert start is not None
        # A recycled PID has another start time: it must be left alone.
        assert signal_exact(proc.pid, start + 1, 15) is False
        assert proc.poll() is None
        ledger = Ledger(tmp_path / "state.json")
        ledger.add("process", pid=proc.pid, starttime=start, stop_timeout=5)
        t0 = time.monotonic()
        assert ledger.teardown() == []
        assert proc_starttime(proc.pid) is None  # gone (teardown also reaped it)
        assert time.monotonic() - t0 < 5
    finally:
        proc.kill()
        proc.wait()


def _fake_bed(tmp_path: Path, urls: dict[str, str]) -> Testbed:
    bed = Testbed(tmp_path / "bed", "rigu")
    hosts = []
    for i, (name, group, preset) in enumerate([("rig-01", "canary", "2x3090"), ("rig-02", "rigs", "1x3090")]):
        hosts.append(
            Host(
                name=name, index=i, ip=f"10.213.9.{11 + i}", netns=f"rigu-{name}", machine=f"rigu-{name}",
                dir=tmp_path / name, hardware=hw.preset(preset, name), ssh_user="rigup",
                ssh_key=tmp_path / "id_ed25519", known_hosts=tmp_path / "known_hosts", group=group,
            ).to_json()
        )  # fmt: skip
    bed.ledger.data["info"] = {"instance": "rigu", "subnet": "10.213.9.0/24", "hub_ip": "10.213.9.1", "hosts": hosts, "urls": urls}
    return bed


def test_fleet_points_every_url_knob_at_the_hub_and_loads_with_rigup_fleet(tmp_path: Path) -> None:
    from rigup.desired.fleet import load_fleet

    # every URL knob at the hub; the registry as image references name one (host:port, no scheme)
    urls = {k: "10.213.9.1:8080" if k == "container_registry" else f"http://10.213.9.1:8080/{k}" for k in url_knobs()}
    bed = _fake_bed(tmp_path, urls)
    with pytest.raises(TestbedError, match="no real registry"):  # the real engine needs the hub's real registry
        bed.fleet()
    doc = bed.fleet(real_engine=False)
    assert doc["data"]["preflight_os_allowed"] == ["debian 12"]
    assert {k: doc["data"][k] for k in url_knobs()} == urls
    assert doc["data"]["docker_insecure_registries"] == ["10.213.9.1:8080"]  # Docker pulls from the hub over HTTP
    assert bed.fleet(data={"docker_insecure_registries": []}, real_engine=False)["data"]["docker_insecure_registries"] == []
    engine = {"engine_registry": "10.213.9.1:5001", "engine_docker_apt_url": "http://10.213.9.1:8080/docker-engine/linux/ubuntu",
              "engine_docker_apt_key_url": "http://10.213.9.1:8080/docker-engine/linux/ubuntu/gpg"}
    real = _fake_bed(tmp_path / "real", {**urls, **engine}).fleet()["data"]
    assert real["container_registry"] == "10.213.9.1:5001" and real["docker_insecure_registries"] == ["10.213.9.1:5001"]
    assert real["docker_apt_url"] == engine["engine_docker_apt_url"]
    assert real["gpu_smoke_image"] == "10.213.9.1:5001/nvidia/cuda:12.6.0-base-ubuntu22.04"
    rig1 = doc["groups"]["canary"]["hosts"]["rig-01"]
    assert rig1["ssh_strict_host_key_checking"] == "yes" and rig1["gpu_count"] == 2 and rig1["ssh_user"] == "rigup"
    assert doc["groups"]["rigs"]["hosts"]["rig-02"]["gpu_count"] == 1
    bed.workdir.mkdir()
    path = bed.write_fleet(tmp_path / "rigs.yaml", real_engine=False)
    fleet = load_fleet(path)  # the lead's loader accepts every key we write
    assert {h.name: h.group for h in fleet.hosts} == {"rig-01": "canary", "rig-02": "rigs"}
    assert fleet.host("rig-02").data["hf_endpoint"] == urls["hf_endpoint"]


def test_fleet_refuses_to_leave_a_url_knob_on_the_internet(tmp_path: Path) -> None:
    urls = {k: "http://10.213.9.1:8080/x" for k in url_knobs() if k != "docker_apt_url"}
    with pytest.raises(TestbedError, match="docker_apt_url"):
        _fake_bed(tmp_path, urls).fleet(real_engine=False)


def test_hub_registry_serves_the_digests_the_standin_engine_pulls(tmp_path: Path) -> None:
    import threading
    import urllib.error
    import urllib.request

    from rigup_testbed import hubserve
    from rigup_testbed.service import ThreadingServer

    config = tmp_path / "registry.json"
    config.write_text(json.dumps({"missing": ["gone/image:1"], "digests": {"pinned/image:2": "sha256:" + "ab" * 32}}))
    dc = load_standin("dockerclient")
    handler = type("H", (hubserve.RegistryHandler,), {"config_file": config, "dockerclient": dc})
    server = ThreadingServer(("127.0.0.1", 0), handler)
    handler.host_port = f"127.0.0.1:{server.server_address[1]}"
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:

        def head(path: str) -> tuple[int, str | None]:
            req = urllib.request.Request(f"http://{handler.host_port}{path}", method="HEAD")
            try:
                with urllib.request.urlopen(req, timeout=5) as resp:
                    return resp.status, resp.headers.get("Docker-Content-Digest")
            except urllib.error.HTTPError as err:
                return err.code, None

        status, digest = head("/v2/vllm/vllm-openai/manifests/v0.11.0")
        assert status == 200 and digest == dc.fake_digest(f"{handler.host_port}/vllm/vllm-openai:v0.11.0")
        assert head("/v2/pinned/image/manifests/2") == (200, "sha256:" + "ab" * 32)
        assert head("/v2/gone/image/manifests/1")[0] == 404
    finally:
        server.shutdown()
        server.server_close()


def test_hub_registry_holds_the_catalogs_digest_pinned_images(tmp_path: Path) -> None:
    """The hub writes the catalog's digest-pinned images (lmcache/vllm-openai, pinned by upstream because its
    tag moves) as what its registry holds: a pull of repo:tag@digest finds that exact digest, and that
    repository answers no other digest, as a real registry would not."""
    import threading
    import urllib.error
    import urllib.request

    from rigup_testbed import hubserve
    from rigup_testbed.hub import Hub, catalog_pinned_images
    from rigup_testbed.service import ThreadingServer

    pinned = "sha256:663f9b2f7528e34105c9b0428880b811616f9bc85133b6e2a577b2e7282be8de"  # club-3090 lmcache.yml@4a29ab57
    assert catalog_pinned_images() == {"lmcache/vllm-openai:v0.4.7-cu129": pinned}
    hub = Hub(tmp_path, "127.0.0.1")
    hub.repo_info = types.SimpleNamespace(root=tmp_path / "apt", urls=lambda url: {})
    hub.write_registry_files()
    registry = next(svc for svc in hub._plan() if svc.name == "registry")
    assert registry.args[:5] == ["registry", "--config", str(hub.registry_config), "--images", str(hub.registry_images)]
    config, images = hub.registry_config, hub.registry_images
    assert json.loads(images.read_text()) == catalog_pinned_images() and json.loads(config.read_text()) == {}
    handler = type("H", (hubserve.RegistryHandler,), {"config_file": config, "images_file": images,
                                                       "dockerclient": load_standin("dockerclient")})
    server = ThreadingServer(("127.0.0.1", 0), handler)
    handler.host_port = f"127.0.0.1:{server.server_address[1]}"
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:

        def head(path: str) -> tuple[int, str | None]:
            req = urllib.request.Request(f"http://{handler.host_port}{path}", method="HEAD")
            try:
                with urllib.request.urlopen(req, timeout=5) as resp:
                    return resp.status, resp.headers.get("Docker-Content-Digest")
            except urllib.error.HTTPError as err:
                return err.code, None

        assert head("/v2/lmcache/vllm-openai/manifests/v0.4.7-cu129") == (200, pinned)
        assert head(f"/v2/lmcache/vllm-openai/manifests/{pinned}") == (200, pinned)
        assert head("/v2/lmcache/vllm-openai/manifests/sha256:" + "e" * 64)[0] == 404  # not an image it holds
        # The tag moves on (a test's registry.json): the pinned manifest is still there by digest.
        config.write_text(json.dumps({"digests": {"lmcache/vllm-openai:v0.4.7-cu129": "sha256:" + "e" * 64}}))
        assert head("/v2/lmcache/vllm-openai/manifests/v0.4.7-cu129") == (200, "sha256:" + "e" * 64)
        assert head(f"/v2/lmcache/vllm-openai/manifests/{pinned}") == (200, pinned)
        assert head("/v2/lmcache/vllm-openai/manifests/sha256:" + "e" * 64)[0] == 200
        # Repositories it was not told about keep answering any digest (tests pin digests of their own).
        assert head("/v2/vllm/vllm-openai/manifests/sha256:" + "5" * 64) == (200, "sha256:" + "5" * 64)
    finally:
        server.shutdown()
        server.server_close()
