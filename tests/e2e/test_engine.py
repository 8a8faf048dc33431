"""The real container engine on a test-bed rig: Debian's dockerd, containerd and runc under Docker CE's
package names (rigup_testbed/aptrepo.py engine_debs), the real Compose v2 plugin, and the hub's real
distribution registry holding an image the bed built (rigup_testbed/registry.py).

The whole deploy runs on it (Testbed.fleet(real_engine=True)): it installs the engine from the repository
that holds it, exactly as it installs Docker CE on Ubuntu, wires the container toolkit's `nvidia` runtime
and hook into it, pulls the locked image by digest from the registry and serves `dual` from it. The GPU and
vLLM stay simulated, at the real boundary: the toolkit's hook (a stand-in) hands a container the GPUs its
device request names, and the image's `vllm` is the stand-in server. Then what only a real engine proves:

  * a re-run changes nothing; the GPUs reach the container through the hook, and only those it asked for;
  * the vLLM container killed with SIGKILL (the OOM killer, a CUDA fault) makes `compose up --exit-code-from`
    exit 137, systemd restarts the unit after its RestartSec, and `rigup status` counts the restart;
  * a server that keeps dying stops at StartLimitBurst and `rigup status` says so, with its last lines;
    the next converge heals it;
  * `systemctl restart docker` under the serving unit: it serves again;
  * a read-only mount is read-only; a missing long-syntax bind source fails with Docker's words;
  * a pull by digest is checked against what the registry serves;
  * the fleet's metrics sources, for Prometheus: NVIDIA's DCGM exporter image (the test bed's, with the
    stand-in exporter) run as its README runs it reports each GPU of the rig, a hot GPU and an XID error
    injected into the GPU stand-in included; the vLLM pod's /metrics counts a chat completion it served.
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rigup.desired.lock import LockFile
from rigup_testbed.fleet import Testbed
from rigup_testbed.hosts import Host, HostSpec
from rigup_testbed.registry import DCGM_EXPORTER_REPOSITORY, DCGM_EXPORTER_TAG, REBUILT_TAG
from tests.e2e.helpers import changed, converge_json, keyed_curl, run
from tests.e2e.test_serving import sh as root  # a command as root on a rig; it must succeed

pytestmark = pytest.mark.e2e

DEPLOY = "deploy.py"
VARIANT_UNIT = "rigup-dual.service"
CONTAINER = "rigup-dual"
PORT = 8010  # the dual recipe's published port
KEY_FILE = "/opt/rigup/variants/dual/secrets/VLLM_API_KEY"  # the pod's own key, keyed by default: its 0600 file
BUSYBOX = "rigup-testbed/busybox:1.35"
PROJECT_DIR = "/opt/rigup-engine-test"


@pytest.fixture(scope="module")
def bed(testbed_factory: Callable[..., Testbed]) -> Testbed:
    return testbed_factory([HostSpec("rig-01", group="canary")])


@pytest.fixture(scope="module")
def rig(bed: Testbed) -> Host:
    return bed.host("rig-01")


@pytest.fixture(scope="module")
def image(bed: Testbed) -> str:
    """The busybox image at the hub's real registry, by digest."""
    registry, digest = bed.urls["engine_registry"], bed.urls["engine_registry_images"][BUSYBOX]
    return f"{registry}/{BUSYBOX.split(':')[0]}@{digest}"


@pytest.fixture(scope="module")
def fleet(bed: Testbed) -> Path:
    path = bed.write_fleet(bed.workdir / "engine-rigs.yaml", real_engine=True,
                           data={"variant": "dual", "serving_health_timeout_s": 90,
                                 "lock_file": str(bed.workdir / "engine-rigs.lock.yaml")})
    proc = run([sys.executable, "-m", "rigup", "lock", "--image-digests"], path, 300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return path


@pytest.fixture(scope="module")
def engine(fleet: Path, rig: Host) -> dict[str, object]:
    """The rig converged by the whole deploy on the real engine; then again."""
    code, first, log = converge_json(fleet, "first converge, real engine", DEPLOY)
    assert code == 0, log[-6000:]
    code, second, log2 = converge_json(fleet, "re-run", DEPLOY)
    assert code == 0, log2[-6000:]
    return {"first": first, "second": second, "log": log}


def status(fleet: Path) -> tuple[int, str]:
    proc = run([sys.executable, "-m", "rigup", "status"], fleet, 120)
    return proc.returncode, proc.stdout + proc.stderr


def models(rig: Host) -> int:
    code, out = attempt(rig, f"{keyed_curl(KEY_FILE)} -s -o /dev/null -w '%{{http_code}}' http://127.0.0.1:{PORT}/v1/models")
    return int(out.strip() or 0) if code == 0 else 0


def attempt(rig: Host, command: str, timeout: float = 120) -> tuple[int, str]:
    proc = rig.ssh(f"sudo -n sh -c {shlex.quote(command)} 2>&1", check=False, timeout=timeout)
    return proc.returncode, proc.stdout


def wait_for(what: str, check: Callable[[], bool], timeout: float, explain: Callable[[], str] = str) -> float:
    started = time.monotonic()
    while not check():
        if time.monotonic() - started > timeout:
            raise AssertionError(f"{what}: not within {timeout:.0f} s\n{explain()}")
        time.sleep(0.5)
    return time.monotonic() - started


def unit_show(rig: Host, unit: str, *props: str) -> dict[str, str]:
    out = root(rig, f"systemctl show {unit} " + " ".join(f"-p {p}" for p in props))
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def started_at(rig: Host, name: str) -> str:
    return root(rig, f"docker inspect -f '{{{{.State.StartedAt}}}}' rigup-{name}").strip()


def started_at_or_none(rig: Host, name: str) -> str | None:
    """When rigup-<name> started, while it runs; None between two of its lives."""
    code, out = attempt(rig, f"docker inspect -f '{{{{.State.Running}}}} {{{{.State.StartedAt}}}}' rigup-{name}")
    running, _, when = out.strip().partition(" ")
    return when if code == 0 and running == "true" else None


# ------------------------------------------------------------------------------------------------


def test_the_deploy_serves_on_the_real_engine_and_a_rerun_changes_nothing(engine: dict[str, object], rig: Host,
                                                                          fleet: Path) -> None:
    first, second = engine["first"], engine["second"]
    done = changed(first, "rig-01")  # type: ignore[arg-type]
    assert any(n.startswith("tasks/docker.py") for n in done) and any(n.startswith("tasks/serving.py") for n in done)
    assert changed(second, "rig-01") == []  # type: ignore[arg-type]
    version = json.loads(root(rig, "docker version --format '{{json .}}'"))
    # Debian's engine under Docker CE's name: the server is the real dockerd, on the rig's systemd
    assert version["Server"]["Version"].startswith("20.10.")
    assert root(rig, "dpkg-query -W -f='${Version}' docker-ce").startswith("5:20.10.")
    info = json.loads(root(rig, "docker info --format '{{json .}}'"))
    assert info["Driver"] == "overlay2" and info["CgroupVersion"] == "2" and info["CgroupDriver"] == "systemd"
    assert "nvidia" in info["Runtimes"]  # the toolkit's runtime, wired in by the deploy
    assert root(rig, "systemctl is-active docker.service containerd.service").split() == ["active", "active"]
    assert root(rig, "docker compose version --short").strip().lstrip("v") == "2.40.3"
    # the container runs the image the lock pins, pulled by digest from the registry
    lock = LockFile.load(fleet.with_name("engine-rigs.lock.yaml"))
    # the variant's image and the rig's GPU exporter, each pinned by digest
    assert sorted(p.repository for p in lock.images.values()) == [DCGM_EXPORTER_REPOSITORY, "vllm/vllm-openai"]
    pin = vllm_pin(lock)
    assert pin.digest and pin.digest.startswith("sha256:")
    image_id = root(rig, f"docker inspect -f '{{{{.Image}}}}' {CONTAINER}").strip()
    assert any(d.endswith("@" + pin.digest) for d in json.loads(root(rig, f"docker image inspect -f '{{{{json .RepoDigests}}}}' {image_id}")))
    assert models(rig) == 200
    code, out = status(fleet)
    assert code == 0 and "health" in out and "serves qwen3.6-27b-autoround" in out, out


def test_gpus_reach_containers_through_the_toolkits_hook(engine: dict[str, object], rig: Host, bed: Testbed) -> None:
    assert len(root(rig, f"docker exec {CONTAINER} nvidia-smi -L").splitlines()) == 2
    # the driver reports the container's server under its host pid, as the real one does
    apps = root(rig, "nvidia-smi --query-compute-apps=pid --format=csv,noheader").split()
    assert set(apps) == {root(rig, f"docker inspect -f '{{{{.State.Pid}}}}' {CONTAINER}").strip()}
    smoke = f"{bed.urls['engine_registry']}/nvidia/cuda:12.6.0-base-ubuntu22.04"
    uuid = root(rig, "nvidia-smi -i 1 --query-gpu=uuid --format=csv,noheader").strip()
    one = root(rig, f"docker run --rm --gpus '\"device=1\"' {smoke} nvidia-smi -L").splitlines()
    assert one == [f"GPU 0: NVIDIA GeForce RTX 3090 (UUID: {uuid})"]
    # a process started later in the container (docker exec: no NVIDIA_VISIBLE_DEVICES) sees no more GPUs
    ctr = root(rig, f"docker run -d --rm --gpus '\"device=1\"' {smoke} sleep 120").strip()
    assert root(rig, f"docker exec {ctr} nvidia-smi -L").splitlines() == one
    root(rig, f"docker rm -f {ctr}")
    code, out = attempt(rig, f"docker run --rm --gpus '\"device=7\"' {smoke} nvidia-smi -L")
    assert code != 0 and "nvidia-container-cli: device error: 7: unknown device" in out, out
    code, out = attempt(rig, f"docker run --rm {smoke} nvidia-smi -L")  # no GPU asked for: no driver in it
    assert code == 127, out


def vllm_pin(lock: LockFile):  # noqa: ANN201 - rigup.desired.lock.ImagePin
    """The variant image's pin (the lock also pins the GPU exporter's image)."""
    (pin,) = [p for p in lock.images.values() if p.repository == "vllm/vllm-openai"]
    return pin


def metric_families(text: str) -> dict[str, object]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def set_gpu_state(rig: Host, uuid: str, **values: object) -> None:
    """What a test does to a rig's GPU (the GPU stand-in's /run state: nvidia_smi.set_gpu_state)."""
    code = ("import json, sys; sys.path.insert(0, '/usr/lib/nvidia-standin/utils'); import nvidia_smi; "
            f"nvidia_smi.set_gpu_state({uuid!r}, **json.loads({json.dumps(values)!r}))")
    root(rig, f"python3 -c {shlex.quote(code)}")


def test_the_dcgm_exporter_reports_the_rigs_gpus(engine: dict[str, object], rig: Host, bed: Testbed) -> None:
    image = f"{bed.urls['engine_registry']}/{DCGM_EXPORTER_REPOSITORY}:{DCGM_EXPORTER_TAG}"
    # without GPUs DCGM cannot start, and the exporter says so as the real one does
    code, out = attempt(rig, f"docker run --rm {image}")
    assert code == 1 and "error starting nv-hostengine: DCGM initialization error" in out, out
    # as NVIDIA's README runs it, on another host port: the deploy's own GPU exporter may hold 9400
    ctr, port = "rigup-test-dcgm-exporter", 19400
    attempt(rig, f"docker rm -f {ctr}")
    gpus = rig.hardware.gpus
    try:
        root(rig, f"docker run -d --name {ctr} --gpus all --cap-add SYS_ADMIN -p {port}:9400 {image}")

        def scrape() -> dict[str, object]:
            return metric_families(root(rig, f"curl -sf http://127.0.0.1:{port}/metrics"))

        wait_for("the exporter's /metrics", lambda: attempt(rig, f"curl -sf -o /dev/null http://127.0.0.1:{port}/metrics")[0] == 0,
                 60, lambda: attempt(rig, f"docker logs {ctr} 2>&1")[1])
        fams = scrape()
        hostname = root(rig, f"docker inspect -f '{{{{.Config.Hostname}}}}' {ctr}").strip()
        temps = {s.labels["gpu"]: s for s in fams["DCGM_FI_DEV_GPU_TEMP"].samples}  # type: ignore[attr-defined]
        assert set(temps) == {str(g.index) for g in gpus}
        for gpu in gpus:
            sample = temps[str(gpu.index)]
            assert sample.labels == {"gpu": str(gpu.index), "UUID": gpu.uuid, "pci_bus_id": gpu.pci_bus_id,
                                     "device": f"nvidia{gpu.index}", "modelName": gpu.name, "Hostname": hostname,
                                     "DCGM_FI_DRIVER_VERSION": root(rig, "nvidia-smi --query-gpu=driver_version "
                                                                         "--format=csv,noheader -i 0").strip()}
            assert sample.value == 45  # the serving pod's engine runs on every GPU of the rig: busy, warmer
        used = {s.labels["gpu"]: s.value for s in fams["DCGM_FI_DEV_FB_USED"].samples}  # type: ignore[attr-defined]
        smi_used = root(rig, "nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits").split()
        assert used == {str(i): float(v) for i, v in enumerate(smi_used)} and min(used.values()) > 1000
        assert not [n for n in fams if n.startswith("DCGM_FI_PROF_")]  # GeForce: no profiling fields
        xid = {s.labels["gpu"]: s for s in fams["DCGM_FI_DEV_XID_ERRORS"].samples}  # type: ignore[attr-defined]
        assert {s.value for s in xid.values()} == {0} and xid["0"].labels["err_msg"] == "No Error"
        # a hot GPU and an XID error, injected into the GPU stand-in, show at the next scrape
        set_gpu_state(rig, gpus[1].uuid, temperature_c=93, xid=79)
        fams = scrape()
        temps = {s.labels["gpu"]: s.value for s in fams["DCGM_FI_DEV_GPU_TEMP"].samples}  # type: ignore[attr-defined]
        assert temps == {"0": 45, "1": 93}
        xid = {s.labels["gpu"]: s for s in fams["DCGM_FI_DEV_XID_ERRORS"].samples}  # type: ignore[attr-defined]
        assert xid["1"].value == 79 and xid["1"].labels["err_msg"] == "GPU has fallen off the bus"
        assert root(rig, "nvidia-smi -i 1 --query-gpu=temperature.gpu --format=csv,noheader").strip() == "93"
    finally:
        set_gpu_state(rig, gpus[1].uuid, temperature_c=None, xid=None)
        attempt(rig, f"docker rm -f {ctr}")


def test_the_vllm_pods_metrics_count_a_chat_it_served(engine: dict[str, object], rig: Host) -> None:
    def scrape() -> dict[str, object]:
        return metric_families(root(rig, f"curl -sf http://127.0.0.1:{PORT}/metrics"))

    def total(fams: dict[str, object], family: str) -> float:
        return sum(s.value for s in fams[family].samples if s.name == f"{family}_total")  # type: ignore[attr-defined]

    # The sentinel asks the pod its probes every sentinel_interval_s: held off for the window, so the
    # counters move by this one chat only (a probe inside it once made prompt_tokens move by 153, not 12).
    root(rig, "systemctl stop rigup-sentinel.timer rigup-sentinel.service")
    try:
        before = scrape()
        body = json.dumps({"model": "qwen3.6-27b-autoround", "max_tokens": 24,
                           "messages": [{"role": "user", "content": "What is the capital of France?"}]})
        answer = json.loads(root(rig, f"{keyed_curl(KEY_FILE)} -sf http://127.0.0.1:{PORT}/v1/chat/completions "
                                      f"-H 'Content-Type: application/json' -d {shlex.quote(body)}"))
        after = scrape()
    finally:
        root(rig, "systemctl start rigup-sentinel.timer")
    usage = answer["usage"]
    assert total(after, "vllm:prompt_tokens") - total(before, "vllm:prompt_tokens") == usage["prompt_tokens"]
    assert total(after, "vllm:generation_tokens") - total(before, "vllm:generation_tokens") == usage["completion_tokens"]
    assert total(after, "vllm:request_success") - total(before, "vllm:request_success") == 1
    ttft = [s for s in after["vllm:time_to_first_token_seconds"].samples  # type: ignore[attr-defined]
            if s.name == "vllm:time_to_first_token_seconds_count"]
    assert ttft[0].value >= 1 and ttft[0].labels == {"model_name": "qwen3.6-27b-autoround", "engine": "0"}
    running = after["vllm:num_requests_running"].samples[0]  # type: ignore[attr-defined]
    assert running.value == 0


def test_pull_by_digest_is_checked_by_the_engine(engine: dict[str, object], rig: Host, image: str, bed: Testbed) -> None:
    root(rig, f"docker pull -q {image}")
    digests = json.loads(root(rig, f"docker image inspect -f '{{{{json .RepoDigests}}}}' {image}"))
    assert image in digests
    unknown = image.rsplit("@", 1)[0] + "@sha256:" + "0" * 64
    code, out = attempt(rig, f"docker pull -q {unknown}")
    assert code != 0 and "manifest unknown" in out, out


def test_a_read_only_mount_is_read_only(engine: dict[str, object], rig: Host, image: str) -> None:
    root(rig, "mkdir -p /srv/ro-model && echo weights > /srv/ro-model/w.bin")
    code, out = attempt(rig, f"docker run --rm -v /srv/ro-model:/models:ro {image} sh -c 'cat /models/w.bin && echo x > /models/w.bin'")
    assert code == 1 and "weights" in out and "Read-only file system" in out, out
    assert root(rig, "cat /srv/ro-model/w.bin").strip() == "weights"


def compose_up(rig: Host, project: str, image: str, volume: str) -> tuple[int, str]:
    compose = (f"services:\n  vllm:\n    image: {image}\n    command: [\"true\"]\n    volumes:\n      - {volume}\n")
    root(rig, f"mkdir -p {PROJECT_DIR}/{project} && printf '%s' {shlex.quote(compose)} > {PROJECT_DIR}/{project}/docker-compose.yml")
    result = attempt(rig, f"cd {PROJECT_DIR}/{project} && docker compose -p {project} up --exit-code-from vllm")
    attempt(rig, f"cd {PROJECT_DIR}/{project} && docker compose -p {project} down")
    return result


def test_a_missing_bind_source_fails_with_dockers_words(engine: dict[str, object], rig: Host, image: str) -> None:
    # Compose v2 hands a long-syntax bind without `bind: {create_host_path: false}` to the engine the
    # short syntax's way (Binds), so the engine creates the missing source as an empty directory...
    code, out = compose_up(rig, "created", image, "{type: bind, source: /srv/made-by-docker, target: /x, read_only: true}")
    assert code == 0, out
    assert root(rig, "stat -c '%F %U' /srv/made-by-docker").strip() == "directory root"
    # ...and only with create_host_path: false does the start fail, in the engine's own words.
    code, out = compose_up(rig, "missing", image,
                           "{type: bind, source: /srv/no-such-dir, target: /x, read_only: true, bind: {create_host_path: false}}")
    assert code != 0 and "bind source path does not exist: /srv/no-such-dir" in out, out
    assert attempt(rig, "test -e /srv/no-such-dir")[0] != 0


def test_a_killed_vllm_container_is_restarted_and_status_counts_it(engine: dict[str, object], rig: Host,
                                                                   fleet: Path) -> None:
    before = started_at(rig, "dual")
    restart_s = int(unit_show(rig, VARIANT_UNIT, "RestartUSec")["RestartUSec"].rstrip("s") or 0)
    root(rig, f"docker kill -s KILL {CONTAINER}")
    # compose up exits with the container's code: 137 (128 + SIGKILL), so Restart=on-failure fires
    wait_for("compose exits 137", lambda: "status=137" in root(rig, f"journalctl -u {VARIANT_UNIT} --no-pager -o cat"), 30)
    took = wait_for("the unit serves again", lambda: started_at_or_none(rig, "dual") not in (None, before) and models(rig) == 200,
                    restart_s + 90)
    print(f"serving again {took:.1f} s after the kill (RestartSec={restart_s}s)")
    assert took >= restart_s - 1
    assert unit_show(rig, VARIANT_UNIT, "NRestarts")["NRestarts"] == "1"
    code, out = status(fleet)
    assert code == 0 and "active, enabled, 1 restart(s)" in out and "systemd restarted it after its server exited" in out, out


def test_a_crash_loop_stops_at_the_start_limit_status_says_so_and_a_converge_heals_it(
        engine: dict[str, object], rig: Host, fleet: Path) -> None:
    # The server now dies at every start (the simulated GPU's fault mode). The unit keeps its own
    # StartLimitBurst and interval; a drop-in shortens RestartSec so the loop takes seconds, not minutes
    # (the delay itself is the previous test's).
    dropin = f"/etc/systemd/system/{VARIANT_UNIT}.d"
    root(rig, f"mkdir -p {dropin} && printf '[Service]\\nRestartSec=1\\n' > {dropin}/fast.conf && systemctl daemon-reload && "
              "echo '{\"mode\": \"crash\"}' > /etc/rigup-testbed/responder.json")
    root(rig, f"docker kill -s KILL {CONTAINER}")
    # At the limit systemd (252) refuses the next start ("repeated too quickly") and leaves the unit failed.
    wait_for("the unit gives up", lambda: "Start request repeated too quickly" in root(rig, f"journalctl -u {VARIANT_UNIT} --no-pager -o cat"),
             180, lambda: attempt(rig, f"systemctl status --no-pager {VARIANT_UNIT}")[1])
    assert unit_show(rig, VARIANT_UNIT, "ActiveState")["ActiveState"] == "failed"
    code, out = status(fleet)
    assert code != 0 and "crash loop: systemd stopped restarting it at its start limit" in out, out
    assert "CUDA error: an illegal memory access was encountered" in out, out
    # the fault gone, the next converge brings the recorded release back
    root(rig, f"rm -r {dropin} /etc/rigup-testbed/responder.json && systemctl daemon-reload")
    code, result, log = converge_json(fleet, "converge after the crash loop", DEPLOY)
    assert code == 0, log[-4000:]
    assert models(rig) == 200
    assert status(fleet)[0] == 0


def test_a_docker_restart_under_the_serving_unit_comes_back(engine: dict[str, object], rig: Host) -> None:
    before = started_at(rig, "dual")
    root(rig, "systemctl restart docker.service")
    # docker.service is Required by the unit: systemd restarts it with the engine
    took = wait_for("the variant serves again", lambda: started_at_or_none(rig, "dual") not in (None, before) and models(rig) == 200,
                    120)
    print(f"serving again {took:.1f} s after systemctl restart docker")
    assert root(rig, f"systemctl is-active {VARIANT_UNIT}").strip() == "active"
    # nothing of an earlier start is left: one container, one network of the variant's project (beside
    # the GPU exporter's container, which its own unit restarts with the engine)
    assert len(root(rig, "docker ps -aq --filter label=com.docker.compose.project=rigup-dual").split()) == 1
    assert root(rig, "docker ps -a --format '{{.Names}}'").split().count("rigup-gpu-exporter") <= 1
    assert [n for n in root(rig, "docker network ls --format '{{.Name}}'").split() if n not in ("bridge", "host", "none")] == ["rigup-dual_default"]


def test_a_stopped_unit_ends_cleanly_every_time(engine: dict[str, object], rig: Host) -> None:
    """`systemctl stop` is a clean end (inactive, Result=success), never a failure: the server's threads
    end at shutdown, which needs the image's libgcc_s (glibc loads it then; without it: exit 139)."""
    for attempt in range(3):
        root(rig, f"systemctl stop {VARIANT_UNIT}")
        state = root(rig, f"systemctl show -p ActiveState -p Result -p ExecMainStatus {VARIANT_UNIT}").split()
        assert set(state) == {"Result=success", "ExecMainStatus=0", "ActiveState=inactive"}, (attempt, state)
        root(rig, f"systemctl start {VARIANT_UNIT}")
        wait_for("the variant serves again", lambda: models(rig) == 200, 120)


def test_a_moved_pin_leaves_only_the_kept_generations_images(engine: dict[str, object], rig: Host, fleet: Path,
                                                             bed: Testbed) -> None:
    repository = f"{bed.urls['engine_registry']}/vllm/vllm-openai"

    def digests() -> list[str]:
        return sorted(root(rig, f"docker image ls --digests --format '{{{{.Digest}}}}' {repository}").split())

    lock_file = fleet.with_name("engine-rigs.lock.yaml")
    lock = LockFile.load(lock_file)
    pin = vllm_pin(lock)
    name = pin.name
    assert digests() == [pin.digest]
    # the tag moved upstream to a new build; one generation kept: the old image has no use left
    moved = bed.urls["engine_registry_images"][f"vllm/vllm-openai:{REBUILT_TAG}"]
    lock.images[name] = type(pin)(pin.name, pin.repository, pin.tag, moved)
    lock.save(lock_file)
    bed.write_fleet(fleet, real_engine=True, data={"variant": "dual", "serving_health_timeout_s": 90,
                                                   "lock_file": str(lock_file), "serving_keep_generations": 1})
    code, result, log = converge_json(fleet, "converge to the moved pin", DEPLOY)
    assert code == 0, log[-4000:]
    assert f"rigup: removed image {repository}:{pin.tag}@{pin.digest}: no kept generation uses it" in log, log[-4000:]
    assert digests() == [moved]
    assert models(rig) == 200
