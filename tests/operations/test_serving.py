"""Serving facts and operations (rigup/operations/serving.py), run through pyinfra's API on @fake hosts whose
fact commands answer scripted output, plus one real write of a secret file with @local."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest
from pyinfra.api import Config, Inventory, State
from pyinfra.api.connect import connect_all, disconnect_all
from pyinfra.api.exceptions import FactProcessError, OperationValueError
from pyinfra.api.hiddenvalue import HiddenValue
from pyinfra.api.operation import add_op
from pyinfra.api.operations import run_ops

from rigup.desired.knobs import load_defaults
from rigup.desired.recipe import resolve
from rigup.desired.secrets import SecretError, load_api_key, read_secret_file
from rigup.facts.serving import RigupVariantUnits, ServingStatus
from rigup.operations.serving import (
    HEALTH_BASE_S,
    HEALTH_GENESIS_S,
    HEALTH_PER_GB_S,
    health_gate,
    health_timeout_s,
    image_pulled,
    secret_file,
    serving_verified,
    sole_variant,
    variant_service,
)

CTL = "/opt/rigup/bin/rigup-servingctl"
RELEASE = "/opt/rigup/variants/dual/release.json"


def run(op: Any, responses: dict[str, Any] | None = None, **kwargs: Any) -> tuple[list[str], Any]:
    """Run one operation on a @fake host; returns (commands it executed, its OperationMeta)."""
    inventory = Inventory(
        (["@fake/rig"], {"fake_delay": 0, "fake_delay_jitter": 0, "fake_responses": responses or {}}),
    )
    state = State(inventory=inventory, config=Config())
    connect_all(state)
    host = inventory.get_host("@fake/rig")
    meta = add_op(state, op, name="op under test", **kwargs)[host]
    before = len(host.connector.executed_commands)
    run_ops(state)
    disconnect_all(state)
    executed = host.connector.executed_commands[before:]
    return executed, meta


def changes(commands: list[str], fact_markers: tuple[str, ...]) -> list[str]:
    """The commands that are not fact reads."""
    return [c for c in commands if not any(m in c for m in fact_markers)]


# --------------------------------------------------------------------------------------------
# sole_variant / RigupVariantUnits

UNITS = "systemctl is-enabled"


def test_sole_variant_stops_the_other_variants_only():
    out = ["rigup-dual.service enabled active", "rigup-single.service enabled inactive",
           "rigup-dflash.service disabled active", "rigup-old.service disabled inactive"]
    executed, meta = run(sole_variant, {UNITS: out}, unit="rigup-dual.service", install_root="/opt/rigup")
    assert changes(executed, (UNITS,)) == [
        "systemctl disable --now rigup-dflash.service",
        "systemctl disable --now rigup-single.service",
    ]
    assert meta.did_change()


def test_sole_variant_is_a_noop_when_alone():
    executed, meta = run(sole_variant, {UNITS: ["rigup-dual.service enabled active"]},
                         unit="rigup-dual.service", install_root="/opt/rigup")
    assert changes(executed, (UNITS,)) == []
    assert not meta.did_change()


def test_sole_variant_keeps_every_pod_of_the_host():
    out = ["rigup-left.service enabled active", "rigup-right.service enabled active", "rigup-dual.service enabled active"]
    executed, meta = run(sole_variant, {UNITS: out}, unit=["rigup-left.service", "rigup-right.service"],
                         install_root="/opt/rigup")
    assert changes(executed, (UNITS,)) == ["systemctl disable --now rigup-dual.service"]
    assert meta.did_change()


def test_variant_units_fact_lists_only_variant_directories(tmp_path: Path):
    """Run the fact's shell loop for real: units with a variants/<name> directory are variants;
    other rigup-* units (the GPU power-cap oneshot) are left out."""
    units = tmp_path / "units"
    units.mkdir()
    for name in ("rigup-dual", "rigup-single", "rigup-gpu-power", "other"):
        (units / f"{name}.service").write_text("[Service]\n")
    root = tmp_path / "opt rigup"  # a space: the path must be quoted
    (root / "variants/dual").mkdir(parents=True)
    (root / "variants/single").mkdir(parents=True)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "systemctl"
    fake.write_text(
        "#!/bin/sh\n"
        # as systemd 252 does: its own order, not the one asked for
        'if [ "$1" = show ]; then [ "$6" = rigup-dual.service ] && printf "Result=exit-code\\nNRestarts=2\\n" '
        '|| printf "Result=success\\nNRestarts=0\\n"; exit 0; fi\n'
        'case "$1 $2" in\n'
        '  "is-enabled rigup-dual.service") echo enabled ;;\n'
        '  "is-active rigup-dual.service") echo active ;;\n'
        '  "is-enabled rigup-single.service") echo disabled; exit 1 ;;\n'
        '  *) echo inactive; exit 3 ;;\n'
        "esac\n"
    )
    fake.chmod(0o755)
    command = RigupVariantUnits().command(install_root=str(root), unit_dir=str(units))
    result = subprocess.run(
        ["sh", "-c", command.get_raw_value()], capture_output=True, text=True, check=True,
        env={"PATH": f"{bin_dir}:/usr/bin:/bin"},
    )
    parsed = RigupVariantUnits().process(result.stdout.splitlines())
    assert parsed == {
        "rigup-dual.service": {"enabled": True, "active": True, "state": "active", "restarts": 2, "result": "exit-code"},
        "rigup-single.service": {"enabled": False, "active": False, "state": "inactive", "restarts": 0, "result": "success"},
    }
    # a systemd that knows neither property prints nothing for them
    assert RigupVariantUnits().process(["rigup-x.service enabled active"])["rigup-x.service"]["restarts"] == 0
    for garbage in ("garbage", "rigup-x.service enabled active NRestarts=many Result=exit-code", "rigup-x.service a b c"):
        with pytest.raises(FactProcessError):
            RigupVariantUnits().process([garbage])


# --------------------------------------------------------------------------------------------
# secret_file

STAT = "stat -c '%a %U:%G'"
TEXT = "# env\nVLLM_API_KEY='sk-secret-value-42'\n"
SHA = hashlib.sha256(TEXT.encode()).hexdigest()


def test_secret_file_noop_when_content_and_mode_match():
    executed, meta = run(secret_file, {STAT: ["600 root:root", f"{SHA}  /x/.env"]}, path="/x/.env", content=HiddenValue(TEXT))
    assert changes(executed, (STAT,)) == []
    assert not meta.did_change()


def test_secret_file_writes_through_stdin_never_the_command_line():
    executed, meta = run(secret_file, {STAT: ["600 root:root", f"{'0' * 64}  /x/.env"]}, path="/x/.env", content=HiddenValue(TEXT))
    (write,) = changes(executed, (STAT,))
    assert write.startswith("umask 077 && tmp=$(mktemp /x/.env.XXXXXX) && cat > \"$tmp\"")
    assert write.endswith('chmod 600 "$tmp" && mv -f "$tmp" /x/.env')
    assert "sk-secret" not in " ".join(executed)
    assert meta.did_change()


def test_secret_file_fixes_a_wide_mode_without_rewriting():
    executed, _ = run(secret_file, {STAT: ["644 root:root", f"{SHA}  /x/.env"]}, path="/x/.env", content=TEXT)
    assert changes(executed, (STAT,)) == ["chown root:root /x/.env && chmod 600 /x/.env"]


def test_secret_file_needs_a_final_newline():
    with pytest.raises(OperationValueError):
        run(secret_file, path="/x/.env", content="no newline")


@pytest.mark.skipif(os.geteuid() != 0, reason="writes a root-owned file")
def test_secret_file_for_real_with_local(tmp_path):
    path = tmp_path / "sub" / ".env"
    path.parent.mkdir()
    inventory = Inventory((["@local"], {}))
    state = State(inventory=inventory, config=Config())
    connect_all(state)
    host = inventory.get_host("@local")
    first = add_op(state, secret_file, name="write", path=str(path), content=HiddenValue(TEXT))[host]
    run_ops(state)
    assert first.did_change()
    assert path.read_text() == TEXT
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(p.name for p in path.parent.iterdir()) == [".env"]  # no temporary file left
    state = State(inventory=Inventory((["@local"], {})), config=Config())
    connect_all(state)
    host = state.inventory.get_host("@local")
    second = add_op(state, secret_file, name="write", path=str(path), content=HiddenValue(TEXT))[host]
    run_ops(state)
    assert not second.did_change()


# --------------------------------------------------------------------------------------------
# image_pulled

INSPECT = "docker image inspect"


def test_image_pulled_noop_when_present():
    executed, meta = run(image_pulled, {INSPECT: ["sha256:" + "a" * 64 + " 30000000000"]}, ref="docker.io/vllm/vllm-openai:v1")
    assert changes(executed, (INSPECT,)) == []
    assert not meta.did_change()


def test_image_pulled_pulls_when_missing():
    executed, _ = run(image_pulled, {INSPECT: []}, ref="docker.io/vllm/vllm-openai:v1")
    assert changes(executed, (INSPECT,)) == ["docker pull docker.io/vllm/vllm-openai:v1"]


# --------------------------------------------------------------------------------------------
# health gate and its fact

PROBE = "probe --release"
FINGERPRINT = "--rigup-fingerprint--"  # in the RigFingerprint fact's command
GATE = f"python3 {CTL} gate --release {RELEASE} --timeout 900 --keep 2"


def probe_output(**over: Any) -> list[str]:
    status = {
        "release_present": True, "release_sha256": "r1", "unit": "rigup-dual.service", "active": "active",
        "enabled": "enabled", "models": ["m"], "serving": True, "error": None, "stale": False,
        "need_daemon_reload": False, "started_at": 1.0,
        "provenance": {"variant": "dual", "generation": 2, "release_sha256": "r1", "gate_result": "passed"},
    }
    status.update(over)
    return [json.dumps(status)]


def test_serving_verified_noop_when_serving_the_recorded_release():
    executed, meta = run(serving_verified, {PROBE: probe_output()}, ctl=CTL, release=RELEASE, release_text=rendered(GOOD), timeout_s=900)
    assert changes(executed, (PROBE, FINGERPRINT)) == []
    assert not meta.did_change()


@pytest.mark.parametrize(
    "over",
    [
        {"serving": False, "error": "connection refused"},
        {"release_sha256": "r2"},  # files changed, never gated (e.g. a deploy interrupted after restart)
        {"provenance": {"variant": "dual", "generation": 2, "release_sha256": "r1", "gate_result": None}},
        {"release_present": False, "serving": False},
    ],
)
def test_serving_verified_gates_otherwise(over):
    executed, meta = run(serving_verified, {PROBE: probe_output(**over)}, ctl=CTL, release=RELEASE, release_text=rendered(GOOD),
                         timeout_s=900)
    assert changes(executed, (PROBE, FINGERPRINT)) == [GATE]
    assert meta.did_change()


GOOD, BAD = '{"image": "v1"}\n', '{"image": "v2"}\n'  # release files as a converge renders them


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def rendered(text: str):
    return lambda: text


SUPERSEDE = f"python3 {CTL} supersede --release {RELEASE}"


def rolled_back(failed: str) -> list[str]:
    """The probe after a failed gate of `failed` rolled back to GOOD, which serves as recorded."""
    return probe_output(release_sha256=sha(GOOD), provenance={"variant": "dual", "generation": 2, "release_sha256": sha(GOOD),
                                                              "gate_result": "passed", "failed_release_sha256": failed})


def test_serving_verified_supersedes_a_failed_gate_the_fleet_no_longer_asks_for():
    # the fleet file was reverted: the converge renders the release that serves, not the one that failed
    executed, meta = run(serving_verified, {PROBE: rolled_back(sha(BAD))}, ctl=CTL, release=RELEASE,
                         release_text=rendered(GOOD), timeout_s=900)
    assert changes(executed, (PROBE, FINGERPRINT)) == [SUPERSEDE]
    assert meta.did_change()


@pytest.mark.parametrize(
    ("probe", "asked"),
    [
        (rolled_back(sha(BAD)), BAD),  # --dry while the fleet still asks for the failed release (the disk holds GOOD)
        (rolled_back(None), GOOD),  # no failed gate stands (none, superseded, or a gate passed since)
    ],
)
def test_serving_verified_leaves_a_failed_gate_the_fleet_still_asks_for(probe, asked):
    executed, meta = run(serving_verified, {PROBE: probe}, ctl=CTL, release=RELEASE, release_text=rendered(asked),
                         timeout_s=900)
    assert changes(executed, (PROBE, FINGERPRINT)) == []
    assert not meta.did_change()


def test_serving_status_fact_before_the_first_deploy():
    command = str(ServingStatus().command(ctl=CTL, release=RELEASE))
    assert command.startswith(f"if [ -f {CTL} ]; then python3 -c ")  # the script's bytecode cached: tests/facts/test_rig_scripts.py
    assert f" {CTL} probe --release {RELEASE} ;" in command
    assert ServingStatus().process(['{"release_present": false, "serving": false}']) == {"release_present": False, "serving": False}
    with pytest.raises(FactProcessError):
        ServingStatus().process(["Traceback (most recent call last):"])


def test_health_gate_command_and_arguments():
    executed, meta = run(health_gate, ctl=CTL, release=RELEASE, timeout_s=900, keep=3, rollback=False)
    assert executed == [f"python3 {CTL} gate --release {RELEASE} --timeout 900 --keep 3 --no-rollback"]
    with pytest.raises(OperationValueError):
        run(health_gate, ctl=CTL, release=RELEASE, timeout_s=0)
    with pytest.raises(OperationValueError):
        run(health_gate, ctl=CTL, release=RELEASE, timeout_s=10, keep=0)


# --------------------------------------------------------------------------------------------
# control machine helpers


def test_health_timeout_scales_with_the_weights():
    data = load_defaults()
    data["variant"] = "dual"
    recipe = resolve(data)
    weights = sum(m.approx_size_gb for m in recipe.models)
    expected = HEALTH_BASE_S + int(-(-HEALTH_PER_GB_S * weights // 1)) + (HEALTH_GENESIS_S if recipe.genesis else 0)
    assert health_timeout_s(recipe, None) == expected
    assert health_timeout_s(recipe, None) > HEALTH_BASE_S + 17 * HEALTH_PER_GB_S  # a 17.5 GB model
    assert health_timeout_s(recipe, 42.2) == 43
    for bad in (0, -5, True, "60"):
        with pytest.raises(ValueError):
            health_timeout_s(recipe, bad)


def test_read_secret_file(tmp_path: Path):
    key = tmp_path / "api.key"
    with pytest.raises(SecretError, match="does not exist"):
        read_secret_file(key, "serving_api_key_file")
    key.write_text("sk-abc\n")
    key.chmod(0o644)
    with pytest.raises(SecretError, match="readable by group or others"):
        read_secret_file(key, "serving_api_key_file")
    key.chmod(0o600)
    assert read_secret_file(key, "serving_api_key_file") == "sk-abc"
    key.write_text("a\nb\n")
    with pytest.raises(SecretError, match="exactly one"):
        read_secret_file(key, "serving_api_key_file")
    assert load_api_key({"serving_api_key_file": None}) is None


# --------------------------------------------------------------------------------------------
# variant_service

UNIT = "rigup-dual.service"


def service(**over: Any) -> tuple[list[str], Any]:
    executed, meta = run(variant_service, {PROBE: probe_output(**over)}, ctl=CTL, release=RELEASE, unit=UNIT)
    return changes(executed, (PROBE, FINGERPRINT)), meta


def test_variant_service_noop_when_running_current_files():
    commands, meta = service(stale=False, need_daemon_reload=False)
    assert commands == [] and not meta.did_change()


def test_variant_service_restarts_only_a_stale_service():
    assert service(stale=True)[0] == [f"systemctl reset-failed {UNIT}", f"systemctl restart {UNIT}"]


def test_variant_service_starts_and_enables():
    assert service(active="inactive", enabled="disabled")[0] == [f"systemctl start {UNIT}", f"systemctl enable {UNIT}"]
    assert service(active="failed", stale=True)[0] == [f"systemctl reset-failed {UNIT}", f"systemctl start {UNIT}"]
    # Before the first deploy (prepare time): nothing on the rig yet.
    assert service(release_present=False, active=None, enabled=None, unit=None)[0] == [
        f"systemctl start {UNIT}", f"systemctl enable {UNIT}"]



def test_variant_service_reloads_systemd_only_when_it_says_so():
    assert service(need_daemon_reload=True, stale=True)[0] == [
        "systemctl daemon-reload", f"systemctl reset-failed {UNIT}", f"systemctl restart {UNIT}"]
    assert "systemctl daemon-reload" not in service(stale=True)[0]


def test_variant_service_refuses_another_variants_release():
    with pytest.raises(OperationValueError):
        service(unit="rigup-single.service")


# --------------------------------------------------------------------------------------------
# re-validation when the rig's fingerprint changed (issue 43)

REVALIDATE = f"python3 {CTL} revalidate --release {RELEASE} --timeout 900 --keep 2"
RIG = {"driver": "580.95.05", "gpu0.uuid": "GPU-0a", "gpu0.pci": "00000000:01:00.0", "gpu0.vbios": "94.02.42.00.A9",
       "topology": "GPU0 X", "p2p": "GPU0 X", "module": "NVRM version: x", "kernel": "6.8.0-45-generic", "bios": "F20"}


def fingerprint_output(fingerprint: dict[str, Any]) -> list[str]:
    """What the fact's script prints on a rig with one GPU and this fingerprint."""
    return [f"0, {fingerprint['gpu0.uuid']}, {fingerprint['gpu0.pci']}, {fingerprint['driver']}, {fingerprint['gpu0.vbios']}",
            FINGERPRINT, "GPU0\t X \t0-15", FINGERPRINT, "GPU0\tX", FINGERPRINT, fingerprint["module"], FINGERPRINT,
            fingerprint["kernel"], FINGERPRINT, fingerprint["bios"]]


def recorded_with(fingerprint: dict[str, Any] | None) -> list[str]:
    return probe_output(provenance={"variant": "dual", "generation": 2, "release_sha256": "r1", "gate_result": "passed",
                                    "fingerprint": fingerprint})


def test_the_fact_reads_what_the_gate_records():
    from rigup.facts.serving import RigFingerprint

    assert RigFingerprint().process(fingerprint_output(RIG)) == RIG


def test_serving_verified_noop_when_the_rig_is_the_one_the_gate_passed_on():
    executed, meta = run(serving_verified, {PROBE: recorded_with(RIG), FINGERPRINT: fingerprint_output(RIG)}, ctl=CTL,
                         release=RELEASE, release_text=rendered(GOOD), timeout_s=900)
    assert changes(executed, (PROBE, FINGERPRINT)) == []
    assert not meta.did_change()


@pytest.mark.parametrize("recorded", [{**RIG, "driver": "580.82.09"}, {**RIG, "gpu0.uuid": "GPU-old"}, None])
def test_serving_verified_revalidates_a_pod_whose_rig_changed(recorded):
    """A driver or a GPU changed under a pod serving as recorded (or its record has no fingerprint yet):
    one command, which removes vLLM's P2P cache, restarts and gates (or, without a record, records)."""
    executed, meta = run(serving_verified, {PROBE: recorded_with(recorded), FINGERPRINT: fingerprint_output(RIG)},
                         ctl=CTL, release=RELEASE, release_text=rendered(GOOD), timeout_s=900)
    assert changes(executed, (PROBE, FINGERPRINT)) == [REVALIDATE]
    assert meta.did_change()


def test_serving_verified_leaves_a_changed_cluster_member_to_member_revalidated():
    """A member is never gated alone (its cluster passes or rolls back as one): after the cluster's gate there
    is nothing to re-validate here; only a record without a fingerprint gets today's."""
    executed, meta = run(serving_verified, {PROBE: recorded_with({**RIG, "driver": "580.82.09"}),
                                            FINGERPRINT: fingerprint_output(RIG)},
                         ctl=CTL, release=RELEASE, release_text=rendered(GOOD), timeout_s=900, member=True)
    assert changes(executed, (PROBE, FINGERPRINT)) == []
    executed, meta = run(serving_verified, {PROBE: recorded_with(None), FINGERPRINT: fingerprint_output(RIG)},
                         ctl=CTL, release=RELEASE, release_text=rendered(GOOD), timeout_s=900, member=True)
    assert changes(executed, (PROBE, FINGERPRINT)) == [f"{REVALIDATE} --member"]


@pytest.mark.parametrize("recorded", [{**RIG, "driver": "580.82.09"}, {**RIG, "gpu0.uuid": "GPU-old"},
                                      {**RIG, "p2p": "GPU0 X OK"}])
def test_a_cluster_member_whose_rig_changed_loses_its_p2p_cache_and_restarts_for_its_clusters_gate(recorded):
    from rigup.operations.serving import member_revalidated

    executed, meta = run(member_revalidated, {PROBE: recorded_with(recorded), FINGERPRINT: fingerprint_output(RIG)},
                         ctl=CTL, release=RELEASE, timeout_s=900)
    assert changes(executed, (PROBE, FINGERPRINT)) == [f"{REVALIDATE} --member"]
    assert meta.did_change()  # what makes the cluster's gate run (tasks/serving.py: restarted)


@pytest.mark.parametrize("recorded", [RIG, None])
def test_a_cluster_member_on_the_rig_it_passed_on_or_without_a_record_is_not_restarted(recorded):
    from rigup.operations.serving import member_revalidated

    executed, meta = run(member_revalidated, {PROBE: recorded_with(recorded), FINGERPRINT: fingerprint_output(RIG)},
                         ctl=CTL, release=RELEASE, timeout_s=900)
    assert changes(executed, (PROBE, FINGERPRINT)) == []
    assert not meta.did_change()


def test_a_cluster_member_whose_last_gate_did_not_pass_is_not_restarted():
    from rigup.operations.serving import member_revalidated

    failed = probe_output(provenance={"variant": "dual", "generation": 2, "release_sha256": "r1", "gate_result": "failed",
                                      "fingerprint": {**RIG, "driver": "580.82.09"}})
    executed, meta = run(member_revalidated, {PROBE: failed, FINGERPRINT: fingerprint_output(RIG)},
                         ctl=CTL, release=RELEASE, timeout_s=900)
    assert changes(executed, (PROBE, FINGERPRINT)) == [] and not meta.did_change()


def test_the_account_says_what_revalidate_did():
    from types import SimpleNamespace

    from rigup.operations.serving import account_revalidation
    from rigup.runstate import accounts

    host = SimpleNamespace(name="rig-01", state=SimpleNamespace())
    said = ("fingerprint changed: GPU0 VBIOS 94.02.42.00.A9 to 94.02.42.00.B1 -> P2P cache removed (the container's, "
            "with compose down: none is kept on the host), full probe set passed (4 probes: arithmetic, recall, "
            "tool-call, json-shape)")
    account_revalidation(host, True, SimpleNamespace(stdout_lines=["rigup: ...", f"RIGUP-REVALIDATED: {said}"]), 9.0)
    account_revalidation(host, False, SimpleNamespace(stdout_lines=["Traceback"]), 3.0)
    assert accounts(host.state)["rig-01"] == [said, "re-validation FAILED after 3 s"]
