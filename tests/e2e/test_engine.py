"""The real container engine on a test-bed rig: Debian's dockerd, containerd and runc under Docker CE's
package names (rigup_testbed/aptrepo.py engine_debs), the real Compose v2 plugin, and the hub's real
distribution registry holding an image the bed built (rigup_testbed/registry.py).

The deploy itself installs the engine (preflight, driver and Docker phases: tests/e2e/engine_deploy.py),
from the repository that holds it, exactly as it installs Docker CE on Ubuntu. Then what only a real
engine can prove, each with rigup's own serving unit (templates/rigup-variant.service.j2) around a
compose project:

  * a container killed with SIGKILL (the OOM killer, a CUDA fault) makes `compose up --exit-code-from`
    exit 137, and systemd restarts the unit after its RestartSec;
  * a container that keeps dying stops at StartLimitBurst (unit failed, start-limit-hit);
  * `systemctl restart docker` under a serving unit: it comes back;
  * a read-only mount is read-only; a missing long-syntax bind source fails with Docker's words;
  * a pull by digest is checked against what the registry serves.

The GPU and vLLM stay simulated elsewhere; this module runs no GPU container.
"""

from __future__ import annotations

import json
import shlex
import time
from collections.abc import Callable
from types import SimpleNamespace

import pytest

from rigup.desired.render import render_template
from rigup_testbed.fleet import Testbed
from rigup_testbed.hosts import Host, HostSpec
from tests.e2e.helpers import changed, converge_json, sh

pytestmark = pytest.mark.e2e

ENGINE_DEPLOY = "tests/e2e/engine_deploy.py"
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
def engine(bed: Testbed, rig: Host) -> dict[str, object]:
    """The rig converged through Docker by the deploy, from the real engine's repository; then again."""
    urls = bed.urls
    fleet = bed.write_fleet(bed.workdir / "engine-rigs.yaml", data={
        "docker_apt_url": urls["engine_docker_apt_url"],
        "docker_apt_key_url": urls["engine_docker_apt_key_url"],
        "docker_insecure_registries": [urls["engine_registry"]],
    })
    code, first, log = converge_json(fleet, "converge through Docker, real engine", ENGINE_DEPLOY)
    assert code == 0, log[-6000:]
    code, second, log2 = converge_json(fleet, "re-run", ENGINE_DEPLOY)
    assert code == 0, log2[-6000:]
    return {"first": first, "second": second}


def root(rig: Host, command: str, timeout: float = 120) -> str:
    return sh(rig, f"sudo -n sh -c {shlex.quote(command)}", timeout=timeout)


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


def serving_unit(rig: Host, name: str, image: str, command: str) -> str:
    """rigup's serving unit around a one-service compose project `name` running `command` in `image`;
    returns the unit's name. Written as the deploy writes a variant's files, started."""
    paths = SimpleNamespace(variant_dir=f"{PROJECT_DIR}/{name}", compose_file=f"{PROJECT_DIR}/{name}/docker-compose.yml",
                            env_file=f"{PROJECT_DIR}/{name}/.env", unit_file=f"/etc/systemd/system/rigup-{name}.service")
    recipe = SimpleNamespace(variant=name, pod_listed=False, pod=name, gpu_ids=[], host_port=8000, paths=paths,
                             project_name=f"rigup-{name}", service_name="vllm")
    unit = render_template("rigup-variant.service.j2", recipe=recipe)
    compose = (f"services:\n  vllm:\n    image: {image}\n    container_name: rigup-{name}\n"
               f"    command: [\"sh\", \"-c\", {json.dumps(command)}]\n")
    root(rig, f"mkdir -p {paths.variant_dir} && printf '%s' {shlex.quote(compose)} > {paths.compose_file} && "
              f": > {paths.env_file} && chmod 600 {paths.env_file} && printf '%s' {shlex.quote(unit)} > {paths.unit_file} && "
              f"systemctl daemon-reload && systemctl start rigup-{name}.service")
    return f"rigup-{name}.service"


def container_running(rig: Host, name: str) -> bool:
    code, out = attempt(rig, f"docker inspect -f '{{{{.State.Running}}}} {{{{.State.StartedAt}}}}' rigup-{name}")
    return code == 0 and out.startswith("true")


def started_at(rig: Host, name: str) -> str:
    return root(rig, f"docker inspect -f '{{{{.State.StartedAt}}}}' rigup-{name}").strip()


# ------------------------------------------------------------------------------------------------


def test_the_deploy_installs_the_real_engine_and_a_rerun_changes_nothing(engine: dict[str, object], rig: Host) -> None:
    first, second = engine["first"], engine["second"]
    assert any(name.startswith("tasks/docker.py") for name in changed(first, "rig-01"))  # type: ignore[arg-type]
    assert changed(second, "rig-01") == []  # type: ignore[arg-type]
    version = json.loads(root(rig, "docker version --format '{{json .}}'"))
    # Debian's engine under Docker CE's name: the server is the real dockerd, on the rig's systemd
    assert version["Server"]["Version"].startswith("20.10.")
    assert root(rig, "dpkg-query -W -f='${Version}' docker-ce").startswith("5:20.10.")
    info = json.loads(root(rig, "docker info --format '{{json .}}'"))
    assert info["Driver"] == "overlay2" and info["CgroupVersion"] == "2" and info["CgroupDriver"] == "systemd"
    assert root(rig, "systemctl is-active docker.service containerd.service").split() == ["active", "active"]
    compose = root(rig, "docker compose version --short").strip()
    assert compose.lstrip("v") == "2.40.3"


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


def test_a_killed_container_is_restarted_by_systemd(engine: dict[str, object], rig: Host, image: str) -> None:
    unit = serving_unit(rig, "crash", image, "sleep 3600")
    wait_for("the container runs", lambda: container_running(rig, "crash"), 60)
    before = started_at(rig, "crash")
    restart_s = int(unit_show(rig, unit, "RestartUSec")["RestartUSec"].rstrip("s") or 0)
    root(rig, "docker kill -s KILL rigup-crash")
    # compose up exits with the container's code: 137 (128 + SIGKILL), so Restart=on-failure fires
    wait_for("compose exits 137", lambda: "status=137" in root(rig, f"journalctl -u {unit} --no-pager -o cat"), 30)
    took = wait_for("the unit restarts the container", lambda: container_running(rig, "crash") and started_at(rig, "crash") != before,
                    restart_s + 60)
    print(f"restarted {took:.1f} s after the kill (RestartSec={restart_s}s)")
    assert took >= restart_s - 1
    assert unit_show(rig, unit, "NRestarts")["NRestarts"] == "1"
    root(rig, f"systemctl stop {unit}")
    assert attempt(rig, "docker inspect rigup-crash")[0] != 0  # ExecStop's compose down removed it


def test_a_crash_loop_stops_at_the_start_limit(engine: dict[str, object], rig: Host, image: str) -> None:
    # The unit's own StartLimitBurst and interval; RestartSec shortened by a drop-in so five restarts
    # take seconds, not minutes (the restart delay itself is the previous test's).
    unit = "rigup-loop.service"
    root(rig, "mkdir -p /etc/systemd/system/rigup-loop.service.d && "
              "printf '[Service]\\nRestartSec=1\\n' > /etc/systemd/system/rigup-loop.service.d/fast.conf")
    serving_unit(rig, "loop", image, "echo CUDA error: an illegal memory access; exit 3")
    limits = unit_show(rig, unit, "StartLimitBurst")
    # Between attempts the unit is failed for a moment too; at the limit systemd (252) refuses the next
    # start ("repeated too quickly") and leaves it failed, its Result still the last exit's.
    journal = ""

    def gave_up() -> bool:
        nonlocal journal
        journal = root(rig, f"journalctl -u {unit} --no-pager -o cat")
        return "Start request repeated too quickly" in journal

    wait_for("the unit gives up", gave_up, 180, lambda: attempt(rig, f"systemctl status --no-pager {unit}")[1])
    state = unit_show(rig, unit, "ActiveState", "Result", "NRestarts")
    assert state["ActiveState"] == "failed" and state["Result"] == "exit-code"
    assert int(state["NRestarts"]) == int(limits["StartLimitBurst"])  # the last restart is the refused one
    assert journal.count("CUDA error: an illegal memory access") == int(limits["StartLimitBurst"])
    assert "CUDA error: an illegal memory access" in journal and "status=3" in journal
    root(rig, f"systemctl reset-failed {unit}; docker rm -f rigup-loop >/dev/null 2>&1 || true")


def test_a_docker_restart_under_a_serving_unit_comes_back(engine: dict[str, object], rig: Host, image: str) -> None:
    unit = serving_unit(rig, "survive", image, "sleep 3600")
    wait_for("the container runs", lambda: container_running(rig, "survive"), 60)
    before = started_at(rig, "survive")
    root(rig, "systemctl restart docker.service")
    took = wait_for("the container serves again", lambda: container_running(rig, "survive") and started_at(rig, "survive") != before, 120)
    print(f"serving again {took:.1f} s after systemctl restart docker")
    assert root(rig, f"systemctl is-active {unit}").strip() == "active"
    root(rig, f"systemctl stop {unit}")
    # the unit's stop leaves no container and no network of its project behind
    assert root(rig, "docker ps -aq --filter name=rigup-survive").strip() == ""
    assert root(rig, "docker network ls -q --filter name=rigup-survive").strip() == ""
