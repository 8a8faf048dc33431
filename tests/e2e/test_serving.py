"""Serving end to end on the test bed: bring-up, converged re-run, pin change, variant switch, a failed
gate that rolls back, a pod answering garbage that fails its gate's probes and rolls back, a rig whose
fingerprint changed (a GPU's VBIOS) re-validated with its P2P cache removed, and the API key. (The fleet
rollout, on a bed of its own, is tests/e2e/test_rollout.py.)

The scenarios share one 2-host bed (rig-01 in group canary, rig-02 in group rigs) and run in file order;
after the variant switch (rig-02) the scenarios act on rig-01 alone (--limit), so each stands on its
own. Each deploy is the real `pyinfra -y inventory.py deploy.py`.
"""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from rigup.desired.lock import LockFile
from rigup_testbed.fleet import Testbed
from rigup_testbed.hosts import Host, HostSpec
from rigup_testbed.image import REPO_ROOT
from rigup_testbed.registry import REBUILT_TAG
from tests.e2e.helpers import CONTAINERD_BUNDLES, assert_secret_private, containerd_bundles_read, pod_key_of, remote_commands

pytestmark = pytest.mark.e2e

API_KEY = "sk-rigup-e2e-7f3a9c1d5b2e8f40"
GATE_TIMEOUT_S = 60  # the stand-in responder is up in seconds; keep failures quick
VARIANT = "dual"
OTHER_VARIANT = "single-minimal"


# --------------------------------------------------------------------------------------------
# helpers


class Bed:
    """A test bed plus the fleet/lock files the deploys use, rewritable per scenario."""

    def __init__(self, testbed: Testbed, workdir: Path, *, real_engine: bool = True) -> None:
        self.testbed = testbed
        self.real_engine = real_engine  # Docker's real engine and registry; False: the stand-in engine
        self.fleet = workdir / "rigs.yaml"
        self.lock = workdir / "rigs.lock.yaml"
        self.data: dict[str, Any] = {"variant": VARIANT, "serving_health_timeout_s": GATE_TIMEOUT_S}
        self.group_data: dict[str, dict[str, Any]] = {}
        self.clusters: list[dict[str, Any]] = []

    def write(self, *, relock: bool = True) -> None:
        # (the hub's registries speak plain HTTP, as a LAN mirror often does: the fleet tells Docker)
        self.testbed.write_fleet(self.fleet, data=self.data, group_data=self.group_data, real_engine=self.real_engine,
                                 clusters=self.clusters)
        if relock:
            proc = subprocess.run(
                [sys.executable, "-m", "rigup", "lock"], cwd=REPO_ROOT, env=self.env(),
                capture_output=True, text=True, timeout=600,
            )
            assert proc.returncode == 0, proc.stdout + proc.stderr

    def env(self) -> dict[str, str]:
        return {**os.environ, "RIGUP_RIGS": str(self.fleet)}

    def pyinfra(self, *args: str, timeout: float = 1200) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(Path(sys.executable).with_name("pyinfra")), "-y", "inventory.py", *args],
            cwd=REPO_ROOT, env=self.env(), capture_output=True, text=True, timeout=timeout,
        )

    def deploy(self, *extra: str, expect_ok: bool = True) -> subprocess.CompletedProcess[str]:
        proc = self.pyinfra("deploy.py", *extra)
        if expect_ok:
            assert proc.returncode == 0, _tail(proc)
        return proc

    def deploy_json(self, *extra: str) -> dict[str, Any]:
        proc = self.pyinfra("--json", "deploy.py", *extra)
        assert proc.returncode == 0, _tail(proc)
        return json.loads(proc.stdout)

    def host(self, name: str) -> Host:
        return self.testbed.host(name)


def _tail(proc: subprocess.CompletedProcess[str], lines: int = 80) -> str:
    return "\n".join((proc.stdout + proc.stderr).splitlines()[-lines:])


def sh(host: Host, command: str, check: bool = True) -> str:
    proc = host.ssh(f"sudo -n sh -c {_quote(command)}", check=False, timeout=120)
    if check:
        assert proc.returncode == 0, f"{host.name}: {command}: {proc.stdout}{proc.stderr}"
    return proc.stdout.strip()


def _quote(text: str) -> str:
    return "'" + text.replace("'", "'\"'\"'") + "'"


def unit_prop(host: Host, unit: str, prop: str) -> str:
    return sh(host, f"systemctl show -p {prop} --value {unit}")


def models(host: Host, port: int, key: str | None = None) -> tuple[int, Any]:
    """The pod's /v1/models asked on its rig, with `key` as the bearer key: curl reads its header from stdin, the key
    joined there from two halves, so it is on no command line (sudo logs them) and the secret checks see none."""
    if key:
        half = len(key) // 2
        ask = f"printf 'header = \"Authorization: Bearer %s%s\"\\n' {key[:half]} {key[half:]} | curl -s -K -"
    else:
        ask = "curl -s"
    out = sh(host, f"{ask} -o /tmp/models.json -w '%{{http_code}}' http://127.0.0.1:{port}/v1/models; echo; "
                   "cat /tmp/models.json", check=False)
    code, _, body = out.partition("\n")
    try:
        return int(code or 0), json.loads(body) if body.strip() else None
    except ValueError:
        return int(code or 0), body


def provenance(host: Host) -> dict[str, Any]:
    return json.loads(sh(host, "cat /opt/rigup/state/provenance.json"))


def serving_ops(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [op for op in result["results"]["operations"] if op["name"].startswith("tasks/serving.py")]


def starts_since(host: Host, unit: str, since_epoch: int) -> int:
    """How many times systemd started `unit` since the given time (journal 'Started' lines)."""
    out = sh(host, f"journalctl -u {unit} --since @{since_epoch} --no-pager -o cat | grep -c '^Started ' || true")
    return int(out or 0)


def _recipe(variant: str) -> Any:
    from rigup.desired.knobs import load_defaults
    from rigup.desired.recipe import resolve

    return resolve({**load_defaults(), "variant": variant})  # from the fixture trees the remotes commit


def registry_image_bytes(registry: str, repository: str, digest: str, ca_file: Path | None = None) -> int:
    """The bytes of an image's config and layers, from its manifest in `registry` (host:port), over HTTPS
    checked against `ca_file` (the bed's CA), or plain HTTP without one."""
    request = urllib.request.Request(f"{'https' if ca_file else 'http'}://{registry}/v2/{repository}/manifests/{digest}",
                                     headers={"Accept": "application/vnd.docker.distribution.manifest.v2+json"})
    context = ssl.create_default_context(cafile=str(ca_file)) if ca_file else None
    manifest = json.loads(urllib.request.urlopen(request, timeout=30, context=context).read())
    return int(manifest["config"]["size"]) + sum(int(layer["size"]) for layer in manifest["layers"])


def port_of(variant: str) -> int:
    return _recipe(variant).host_port


def served_name(variant: str) -> str:
    return _recipe(variant).served_model_name


# --------------------------------------------------------------------------------------------
# the shared 2-host bed


@pytest.fixture(scope="module")
def bed(testbed_factory: Callable[..., Testbed], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bed]:
    testbed = testbed_factory([HostSpec("rig-01", group="canary"), HostSpec("rig-02", group="rigs")], "rigsv",
                              host_layer=True)
    b = Bed(testbed, testbed.workdir)
    b.write()
    yield b


def test_fresh_bring_up(bed: Bed) -> None:
    proc = bed.deploy()
    port, name = port_of(VARIANT), served_name(VARIANT)
    for h in ("rig-01", "rig-02"):
        host = bed.host(h)
        assert unit_prop(host, f"rigup-{VARIANT}.service", "ActiveState") == "active"
        assert unit_prop(host, f"rigup-{VARIANT}.service", "UnitFileState") == "enabled"
        # keyed by default: the pod's own key, made on the control machine (rigup.desired.pod_keys); none, or the
        # other rig's pod's, is refused; the key only in files root alone reads, on no argv and in no journal
        key = pod_key_of(bed.fleet, h, VARIANT)
        code, body = models(host, port, key)
        assert code == 200 and [m["id"] for m in body["data"]] == [name]
        other = pod_key_of(bed.fleet, "rig-02" if h == "rig-01" else "rig-01", VARIANT)
        assert models(host, port)[0] == 401 and models(host, port, other)[0] == 401 and other != key
        holders = assert_secret_private(host, key)
        # the key's one file (and its generation's copy), never the .env, the compose file or containerd's state,
        # which a local user reads (issue 42): the container gets the file, not a value of its environment
        assert f"600 root /opt/rigup/variants/{VARIANT}/secrets/VLLM_API_KEY" in holders, holders
        assert not any(path.endswith(("/.env", "config.json", "meta.db")) for path in holders), holders
        # containerd's state of the pod's container was among what the check above read (as root): its bundle's
        # config.json. A local user reads it where containerd makes the bundle 0711 (before 1.4ish); the bed's Debian
        # containerd makes it 0700, so the user's angle is shown, and the root sweep is the check.
        bundles = sh(host, f"ls {CONTAINERD_BUNDLES}/*/config.json").split()
        print(f"{h}: bundles {bundles}; containerd's files a local user reads: {containerd_bundles_read(host)}")
        assert bundles and sh(host, "grep -c /run/rigup/secrets " + " ".join(bundles)), bundles
        assert key not in proc.stdout + proc.stderr
        prov = provenance(host)
        assert prov["variant"] == VARIANT and prov["generation"] == 1 and prov["gate"]["result"] == "passed"
        assert prov["gate"]["completion"]["completion_tokens"] >= 1
        assert prov["release"]["image"]["ref"] and all(s["commit"] for s in prov["release"]["sources"])
        assert sh(host, f"stat -c '%a %U' /opt/rigup/variants/{VARIANT}/.env") == "600 root"
        assert sh(host, f"ls /opt/rigup/variants/{VARIANT}/generations") == "1"
    assert "Health-gate the (re)started variant" in proc.stdout + proc.stderr


def test_converged_rerun_does_not_restart(bed: Bed) -> None:
    hosts = [bed.host("rig-01"), bed.host("rig-02")]
    unit = f"rigup-{VARIANT}.service"
    before = {h.name: unit_prop(h, unit, "ExecMainStartTimestamp") for h in hosts}
    prov_before = {h.name: sh(h, "stat -c %Y /opt/rigup/state/provenance.json") for h in hosts}
    started = time.monotonic()
    result = bed.deploy_json()
    elapsed = time.monotonic() - started
    changed = {op["name"]: op["success"] for op in serving_ops(result) if op["success"]}
    assert changed == {}, f"serving changed something on a converged re-run: {changed}"
    for h in hosts:
        assert unit_prop(h, unit, "ExecMainStartTimestamp") == before[h.name]
        assert sh(h, "stat -c %Y /opt/rigup/state/provenance.json") == prov_before[h.name]
    print(f"converged re-run of deploy.py on 2 hosts: {elapsed:.1f} s")


def test_whole_deploy_converged_rerun_has_zero_changes(bed: Bed) -> None:
    proc = bed.pyinfra("--json", "deploy.py")
    assert proc.returncode == 0, _tail(proc)
    result = json.loads(proc.stdout)
    changed = {op["name"]: op["success"] for op in result["results"]["operations"] if op["success"]}
    assert changed == {}, f"operations that changed on a converged re-run: {changed}"
    # Every fact read once, the ones the last run asked for in one batch per sudo setting
    # (rigup.pyinfra_patches.fact_batching): a converged rig costs a few round trips, not one per fact (issue 15's bar: 15).
    counts = remote_commands(proc.stderr)
    assert set(counts) == {"rig-01", "rig-02"} and all(n <= 15 for n in counts.values()), counts


def test_pin_change_restarts_exactly_once(bed: Bed) -> None:
    host = bed.host("rig-01")
    unit = f"rigup-{VARIANT}.service"
    lock = LockFile.load(bed.lock)
    # one variant in use: one image of its own (beside the rigs' GPU exporter)
    (name,) = [n for n, p in lock.images.items() if p.repository.startswith("vllm/")]
    pin = lock.images[name]
    # the same repository built again, as when the tag moves upstream: a digest the registry has
    new_digest = bed.testbed.urls["engine_registry_images"][f"{pin.repository}:{REBUILT_TAG}"]
    assert new_digest != pin.digest
    lock.images[name] = type(pin)(pin.name, pin.repository, pin.tag, new_digest)
    lock.save(bed.lock)
    mark = int(sh(host, "date +%s")) - 1
    before = unit_prop(host, unit, "ExecMainStartTimestamp")
    bed.deploy()
    assert unit_prop(host, unit, "ExecMainStartTimestamp") != before
    assert starts_since(host, unit, mark) == 1
    prov = provenance(host)
    assert prov["release"]["image"]["digest"] == new_digest and prov["generation"] == 2
    assert new_digest in sh(host, f"cat /opt/rigup/variants/{VARIANT}/compose.yaml")
    # ...and only once: the next run leaves it alone.
    after = unit_prop(host, unit, "ExecMainStartTimestamp")
    bed.deploy()
    assert unit_prop(host, unit, "ExecMainStartTimestamp") == after
    assert starts_since(host, unit, mark) == 1


def test_variant_switch_stops_the_old_one(bed: Bed) -> None:
    host = bed.host("rig-02")
    bed.group_data = {"rigs": {"variant": OTHER_VARIANT}}
    bed.write()
    bed.deploy()
    old, new = f"rigup-{VARIANT}.service", f"rigup-{OTHER_VARIANT}.service"
    assert unit_prop(host, old, "ActiveState") == "inactive"
    assert unit_prop(host, old, "UnitFileState") == "disabled"
    assert unit_prop(host, new, "ActiveState") == "active"
    assert models(host, port_of(VARIANT))[0] == 0  # nothing listens on the old port
    code, body = models(host, port_of(OTHER_VARIANT), pod_key_of(bed.fleet, "rig-02", OTHER_VARIANT))
    assert code == 200 and [m["id"] for m in body["data"]] == [served_name(OTHER_VARIANT)]
    assert provenance(host)["variant"] == OTHER_VARIANT
    # the engine keeps nothing of the old variant: one container, one network, both the new one's (beside
    # the GPU exporter's container, which no variant owns)
    assert sorted(sh(host, "docker ps -a --format '{{.Names}}'").split()) == sorted([f"rigup-{OTHER_VARIANT}", "rigup-gpu-exporter"])
    networks = [n for n in sh(host, "docker network ls --format '{{.Name}}'").split() if n not in ("bridge", "host", "none")]
    assert networks == [f"rigup-{OTHER_VARIANT}_default"]
    # rig-01 kept its variant and was not restarted by the fleet change.
    assert unit_prop(bed.host("rig-01"), old, "ActiveState") == "active"


def test_failed_gate_rolls_back_and_the_old_generation_serves(bed: Bed) -> None:
    host = bed.host("rig-01")
    unit = f"rigup-{VARIANT}.service"
    good_compose = sh(host, f"cat /opt/rigup/variants/{VARIANT}/compose.yaml")
    good = provenance(host)
    # The upgrade publishes the port on an address the rig does not have: the container cannot start
    # (a real misconfiguration preflight does not catch), the gate fails, the last good one returns.
    bed.group_data = {**bed.group_data, "canary": {"serving_bind_address": "192.0.2.55"}}
    bed.write(relock=False)
    proc = bed.deploy("--limit", "rig-01", expect_ok=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "FAILED and ROLLED BACK" in output, _tail(proc)
    assert "RIGUP-GATE-RESULT: failed-and-rolled-back" in output
    assert f"journalctl -u {unit}" in output
    assert sh(host, f"cat /opt/rigup/variants/{VARIANT}/compose.yaml") == good_compose
    assert unit_prop(host, unit, "ActiveState") == "active"
    code, body = models(host, port_of(VARIANT), pod_key_of(bed.fleet, "rig-01", VARIANT))
    assert code == 200 and [m["id"] for m in body["data"]] == [served_name(VARIANT)]
    prov = provenance(host)
    assert prov["generation"] == good["generation"] and prov["release_sha256"] == good["release_sha256"]
    assert prov["last_rollback"]["outcome"] == "rolled back"
    # The same bad upgrade again at once: its crash loop and the rollback's start count against the
    # unit's start limit (5 in 15 min) from the first attempt, and neither may be refused for it.
    again = bed.deploy("--limit", "rig-01", expect_ok=False)
    assert "FAILED and ROLLED BACK" in again.stdout + again.stderr, _tail(again)
    assert unit_prop(host, unit, "ActiveState") == "active"
    assert models(host, port_of(VARIANT), pod_key_of(bed.fleet, "rig-01", VARIANT))[0] == 200
    # Back to the good settings: converges without a restart of what already serves it.
    bed.group_data = {k: v for k, v in bed.group_data.items() if k != "canary"}
    bed.write(relock=False)
    before = unit_prop(host, unit, "ExecMainStartTimestamp")
    bed.deploy("--limit", "rig-01")
    assert unit_prop(host, unit, "ExecMainStartTimestamp") == before


def test_a_pod_answering_garbage_fails_its_gate_and_rolls_back(bed: Bed) -> None:
    """club-3090 issue #922 on the bed: with custom all-reduce over a peer path that corrupts it, the engine
    starts, lists its model and answers fast, with "!" until max_tokens. The gate's probes catch it."""
    host = bed.host("rig-01")
    good = provenance(host)
    good_compose = sh(host, f"cat /opt/rigup/variants/{VARIANT}/compose.yaml")
    assert "--disable-custom-all-reduce" in good_compose  # no NVLink on the bed: custom all-reduce off
    # The rig's fault (responder.json), harmless while custom all-reduce stays off; then a fleet change that
    # turns it on (NVLink settings forced), so the restarted pod answers garbage.
    sh(host, """echo '{"p2p_corrupts_custom_all_reduce": true}' > /etc/rigup-testbed/responder.json""")
    bed.group_data = {**bed.group_data, "canary": {"gpu_interconnect": "force_on"}}
    bed.write(relock=False)
    try:
        proc = bed.deploy("--limit", "rig-01", expect_ok=False)
    finally:
        sh(host, "rm -f /etc/rigup-testbed/responder.json")
        bed.group_data = {k: v for k, v in bed.group_data.items() if k != "canary"}
        bed.write(relock=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "RIGUP-GATE-RESULT: failed-and-rolled-back" in output, _tail(proc)
    # the reason names the probe, the rule and the start of the answer
    assert "probe arithmetic failed: lexical variety 0.00 over the first 200 words" in output, _tail(proc)
    assert "!!!!!!!!!!!!!!!!!!!!" in output and "finish_reason=length, 48 tokens" in output
    assert sh(host, f"cat /opt/rigup/variants/{VARIANT}/compose.yaml") == good_compose
    prov = provenance(host)
    assert prov["generation"] == good["generation"] and prov["release_sha256"] == good["release_sha256"]
    assert prov["last_rollback"]["outcome"] == "rolled back"
    assert prov["last_rollback"]["reason"].startswith("probe arithmetic failed: lexical variety 0.00")


def test_a_changed_rig_loses_its_p2p_cache_and_is_revalidated(bed: Bed) -> None:
    """Issue 43: a GPU of rig-01 flashed with another VBIOS (a change of the bed's hardware fixture, which the
    stand-in nvidia-smi reports) under a pod that serves as recorded. The next converge finds the rig's
    fingerprint differs from the one its last gate recorded: vLLM's P2P access cache goes (a stale verdict
    planted where vLLM writes it, /root/.cache/vllm in the container, which the restart's compose down
    removes), the pod restarts and passes every probe again, and the account says so."""
    host = bed.host("rig-01")
    unit, cache = f"rigup-{VARIANT}.service", "/root/.cache/vllm/gpu_p2p_access_cache_for_0,1.json"
    before = provenance(host)
    assert before["fingerprint"]["gpu0.vbios"] == "94.02.42.00.A9" and before["fingerprint"]["gpu0.uuid"]
    assert before["fingerprint"]["driver"] and before["fingerprint"]["kernel"]
    sh(host, f"""docker exec rigup-{VARIANT} sh -c 'echo "{{\\"0->1\\": true, \\"1->0\\": true}}" > {cache}'""")
    sh(host, f"docker exec rigup-{VARIANT} sh -c '[ -f {cache} ]'")
    started = unit_prop(host, unit, "ExecMainStartTimestamp")
    sh(host, """python3 -c 'import json; p = "/etc/rigup-testbed/hardware.json"; d = json.load(open(p)); """
             """d["gpus"][0]["vbios_version"] = "94.02.42.00.B1"; json.dump(d, open(p, "w"), indent=2)'""")
    proc = bed.deploy("--limit", "rig-01")
    output = proc.stdout + proc.stderr
    said = ("fingerprint changed: GPU0 VBIOS 94.02.42.00.A9 to 94.02.42.00.B1 -> P2P cache removed (the container's, "
            "with compose down: none is kept on the host), full probe set passed (4 probes: arithmetic, recall, "
            "tool-call, json-shape)")
    summary = output[output.index("--> What this converge did, per host:"):]
    assert said in summary, _tail(proc)  # the per-host account
    assert unit_prop(host, unit, "ExecMainStartTimestamp") != started
    assert sh(host, f"docker exec rigup-{VARIANT} sh -c '[ -e {cache} ] && echo stale || echo gone'") == "gone"
    after = provenance(host)
    assert after["fingerprint"] == {**before["fingerprint"], "gpu0.vbios": "94.02.42.00.B1"}
    assert after["generation"] == before["generation"] and after["release_sha256"] == before["release_sha256"]
    assert after["gate"]["at"] > before["gate"]["at"] and sorted(after["gate"]["probes"]) == sorted(
        ["arithmetic", "recall", "tool-call", "json-shape"])
    # re-validated once: the next converge finds the rig as recorded
    result = bed.deploy_json("--limit", "rig-01")
    assert {op["name"] for op in serving_ops(result) if op["success"]} == set()
    assert provenance(host)["gate"]["at"] == after["gate"]["at"]


def test_api_key_is_enforced_and_kept_secret(bed: Bed, tmp_path: Path) -> None:
    key_file = tmp_path / "api.key"
    key_file.write_text(API_KEY + "\n")
    key_file.chmod(0o600)
    bed.data = {**bed.data, "serving_api_key_file": str(key_file)}
    bed.write(relock=False)
    proc = bed.deploy("-vvv", "--limit", "rig-01")
    assert API_KEY not in proc.stdout + proc.stderr
    host = bed.host("rig-01")
    port = port_of(VARIANT)
    assert models(host, port)[0] == 401
    code, body = models(host, port, API_KEY)
    assert code == 200 and body["data"][0]["id"] == served_name(VARIANT)
    key_file = f"/opt/rigup/variants/{VARIANT}/secrets/VLLM_API_KEY"
    assert sh(host, f"stat -c '%a %U' {key_file} /opt/rigup/variants/{VARIANT}/secrets") == "600 root\n700 root"
    assert sh(host, f"cat {key_file}") == API_KEY
    assert API_KEY not in sh(host, f"docker inspect rigup-{VARIANT}")  # the container's configuration names its file
    for path in (f"/etc/systemd/system/rigup-{VARIANT}.service", f"/opt/rigup/variants/{VARIANT}/compose.yaml",
                 f"/opt/rigup/variants/{VARIANT}/.env",
                 f"/opt/rigup/variants/{VARIANT}/release.json", "/opt/rigup/state/provenance.json"):
        assert API_KEY not in sh(host, f"cat {path}"), path
    assert API_KEY not in sh(host, "ps -eo args")
    assert API_KEY not in sh(host, f"journalctl -u rigup-{VARIANT}.service --no-pager -o cat", check=False)
    # The gate itself used the key (it passed), and a re-run is converged.
    assert provenance(host)["gate"]["result"] == "passed"
    result = bed.deploy_json("--limit", "rig-01")
    assert {op["name"]: op["success"] for op in serving_ops(result) if op["success"]} == {}


# --------------------------------------------------------------------------------------------
# rollout on 4 hosts: canary first, then batches; one host is down

