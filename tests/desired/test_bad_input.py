"""A bad fleet file or --data value is ONE message, before anything connects, from the real CLIs.

Each message names the file (if any), the host (or `data` / the group), the key, the bad value and
what is allowed, and no traceback appears anywhere. Every case goes through load_fleet() (which
inventory.py and every command use) and through one real command line in a subprocess: `pyinfra -y
inventory.py deploy.py --dry` for a representative subset, `rigup doctor --fleet` and `rigup status`
($RIGUP_RIGS) for the rest, `rigup render --data` for the --data forms. The subprocesses run at once,
in one module fixture, to keep the file fast.
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from rigup import REPO_ROOT
from rigup.checks.driver_plan import DRIVER_SOURCES, FLAVOURS
from rigup.desired import fleet as fleet_module
from rigup.desired import knobs as knobs_module
from rigup.desired import recipe as recipe_module
from rigup.desired.fleet import FleetError, load_fleet
from rigup.desired.interconnect import MODES
from rigup.desired.knobs import (
    MODEL_FLEET_MODES,
    REBOOT_POLICIES,
    VRAM_MISFIT_POLICIES,
    KnobError,
    check_knob,
    load_defaults,
    rules,
    undeclared_rules,
)
from rigup.desired.recipe import RecipeError, check_overrides, resolve

PYINFRA = str(Path(sys.executable).with_name("pyinfra"))
HOST = "rig-01"
# variant_overrides messages say which variant they were checked against (unless the message itself does).
ON_DUAL = f"host {HOST!r} (variant 'dual')"


@dataclass(frozen=True)
class Case:
    id: str
    key: str  # the key the message must name
    value: str  # the bad value as the message shows it (repr)
    allowed: tuple[str, ...]  # what the message must say is allowed
    host: dict[str, Any] = field(default_factory=dict)  # rig-01's own settings
    data: dict[str, Any] = field(default_factory=dict)  # fleet-wide data
    group: dict[str, Any] = field(default_factory=dict)  # group 'rigs' data
    where: str = f"host {HOST!r}"  # how the message locates the value
    cli: str = "doctor"  # the command line this case also runs through: pyinfra, doctor or status


CASES = [
    Case("unknown-key", "gpu_cuont", "'gpu_cuont'", ("did you mean 'gpu_count'",), host={"gpu_cuont": 2}, cli="pyinfra"),
    # the closest names and how to list them all, not the whole catalog on one line
    Case(
        "unknown-variant", "'variant'", "'singel'", ("did you mean 'single'", "`rigup render --list` lists all"),
        host={"variant": "singel"}, cli="pyinfra",
    ),
    Case(
        "override-max-model-len", "variant_overrides['max_model_len']", "'lots'", ("1024 to 262144",),
        host={"variant_overrides": {"max_model_len": "lots"}}, cli="pyinfra", where=ON_DUAL,
    ),
    Case(
        "override-port", "variant_overrides['port']", "99999", ("1 to 65535",),
        host={"variant_overrides": {"port": 99999}}, cli="status", where=ON_DUAL,
    ),
    Case(
        "override-tensor-parallel-size", "variant_overrides['tensor_parallel_size']", "got 3",
        ("one of [2, 4] for variant 'dual'", "tensor_parallel_size 2 and leave 1 idle"),
        host={"variant_overrides": {"tensor_parallel_size": 3}},
    ),
    Case(
        "override-gpu-memory-utilization", "variant_overrides['gpu_memory_utilization']", "1.5", ("0.1 to 0.99",),
        host={"variant_overrides": {"gpu_memory_utilization": 1.5}}, where=ON_DUAL,
    ),
    Case(
        "override-unknown-key", "'kv_cache_dtype'", "'fp8'", ("max_model_len, gpu_memory_utilization, port",),
        host={"variant_overrides": {"kv_cache_dtype": "fp8"}}, where=ON_DUAL,
    ),
    Case(
        "override-set-fleet-wide", "variant_overrides['port']", "got 0", ("1 to 65535",),
        data={"variant_overrides": {"port": 0}}, where=f"host {HOST!r} (variant 'dual'; variant_overrides set in data)",
        cli="status",
    ),
    Case("relative-model-dir", "'model_dir'", "'models'", ("absolute path",), host={"model_dir": "models"}, cli="pyinfra"),
    Case(
        "relative-install-root", "'install_root'", "'opt/rigup'", ("absolute path",),
        group={"install_root": "opt/rigup"}, where="group 'rigs' data",
    ),
    Case("bad-enum", "'driver_reboot'", "'sometimes'", ("one of auto, never",), host={"driver_reboot": "sometimes"}),
    Case(
        "bad-enum-fleet-wide", "'gpu_interconnect'", "'on'", ("one of auto, force_on, force_off",),
        data={"gpu_interconnect": "on"}, where="data", cli="status",
    ),
    Case(
        "bool-for-int", "'serving_keep_generations'", "True", ("an integer of at least 1",),
        host={"serving_keep_generations": True}, cli="pyinfra",
    ),
    Case("negative-keep-generations", "'serving_keep_generations'", "-1", ("an integer of at least 1",),
         host={"serving_keep_generations": -1}),
]  # fmt: skip


def fleet_doc(case: Case) -> dict[str, Any]:
    # 127.0.0.1:9 refuses at once should anything try to connect (nothing must).
    host = {"ssh_hostname": "127.0.0.1", "ssh_port": 9, **case.host}
    group: dict[str, Any] = {"hosts": {HOST: host}}
    if case.group:
        group["data"] = dict(case.group)
    return {"data": {"variant": "dual", **case.data}, "groups": {"rigs": group}}


def write_fleet(directory: Path, case: Case) -> Path:
    path = directory / case.id / "rigs.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(fleet_doc(case), sort_keys=False))
    return path


# --data forms for `rigup render dual --out DIR`: (pair, key, value, allowed)
RENDER_CASES = [
    ("gpu_cuont=2", "gpu_cuont", "gpu_cuont", ("did you mean 'gpu_count'",)),
    ('variant_overrides={"max_model_len": "lots"}', "variant_overrides['max_model_len']", "'lots'", ("1024 to 262144",)),
    ('variant_overrides={"port": 99999}', "variant_overrides['port']", "99999", ("1 to 65535",)),
    # YAML's flow style, as the fleet file writes it, is read as the fleet file reads it
    ("variant_overrides={port: 99999}", "variant_overrides['port']", "99999", ("1 to 65535",)),
    ('variant_overrides={"tensor_parallel_size": 3}', "variant_overrides['tensor_parallel_size']", "got 3", ("[2, 4]",)),
    ("model_dir=models", "'model_dir'", "'models'", ("absolute path",)),
    ("driver_reboot=sometimes", "'driver_reboot'", "'sometimes'", ("auto, never",)),
    ("serving_keep_generations=true", "'serving_keep_generations'", "True", ("an integer of at least 1",)),
    ("serving_keep_generations=-1", "'serving_keep_generations'", "-1", ("an integer of at least 1",)),
]


# --data forms for `rigup doctor --fleet GOOD --data PAIR`: checked as the fleet file's values are, before
# anything connects (pair, key, value, allowed)
DOCTOR_DATA_CASES = [
    # a value whose rule depends on the host (its variant): the message names the file and the host
    ("variant_overrides={port: 70000}", "variant_overrides['port']", "70000",
     ("rigs.yaml: host 'rig-01' (variant 'dual'; variant_overrides set in --data)", "1 to 65535")),
    ('variant_overrides={"tensor_parallel_size": 3}', "variant_overrides['tensor_parallel_size']", "got 3",
     ("rigs.yaml: host 'rig-01'", "[2, 4]")),
    ("variant=singel", "'variant'", "'singel'", ("did you mean 'single'",)),
    ("gpu_cuont=2", "gpu_cuont", "gpu_cuont", ("did you mean 'gpu_count'",)),
]


def _run(argv: list[str], fleet: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RIGUP_RIGS"}
    if fleet is not None:
        env["RIGUP_RIGS"] = str(fleet)
    return subprocess.run(argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)


def _argv(case: Case, path: Path) -> tuple[list[str], Path | None]:
    if case.cli == "pyinfra":
        return [PYINFRA, "-y", "inventory.py", "deploy.py", "--dry"], path
    if case.cli == "status":
        return [sys.executable, "-m", "rigup", "status"], path
    return [sys.executable, "-m", "rigup", "doctor", "--fleet", str(path)], None


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    """Every command line of this file, run concurrently: id -> (fleet file or out dir, result)."""
    root = tmp_path_factory.mktemp("bad-fleets")
    jobs: dict[str, tuple[Path, list[str], Path | None]] = {}
    for case in CASES:
        path = write_fleet(root, case)
        jobs[case.id] = (path, *_argv(case, path))
    for pair, *_ in RENDER_CASES:
        out = root / "render" / str(len(jobs))
        jobs[f"render {pair}"] = (out, [sys.executable, "-m", "rigup", "render", "dual", "--out", str(out), "--data", pair], None)
    good = write_fleet(root, Case("good", "", "", ()))
    for pair, *_ in DOCTOR_DATA_CASES:
        jobs[f"doctor {pair}"] = (good, [sys.executable, "-m", "rigup", "doctor", "--fleet", str(good), "--data", pair], None)
    with ThreadPoolExecutor(max_workers=max(2, min(6, os.cpu_count() or 2))) as pool:
        futures = {key: pool.submit(_run, argv, env_fleet) for key, (_, argv, env_fleet) in jobs.items()}
        return {key: (jobs[key][0], future.result()) for key, future in futures.items()}


def assert_one_message(text: str, *needles: str) -> None:
    assert "Traceback" not in text, text
    assert "UnexpectedExternalError" not in text and "exception occurred" not in text, text
    lines = [line for line in text.splitlines() if line.startswith("rigup")]
    assert len(lines) == 1, text
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"


# --------------------------------------------------------------------------------------------
# load_fleet: every case


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_load_fleet_names_file_host_key_value_and_allowed(tmp_path, case):
    path = write_fleet(tmp_path, case)
    with pytest.raises(FleetError) as excinfo:
        load_fleet(path)
    message = str(excinfo.value)
    assert message.startswith(f"{path}: {case.where}: "), message
    for needle in (case.key, case.value, *case.allowed):
        assert needle in message, f"{needle!r} not in {message!r}"
    assert "\n" not in message


# --------------------------------------------------------------------------------------------
# the real command lines


@pytest.mark.parametrize("case", CASES, ids=[f"{c.cli}-{c.id}" for c in CASES])
def test_command_line_prints_one_message_without_traceback(cli_runs, case):
    path, result = cli_runs[case.id]
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    prefix = "rigup:" if case.cli == "pyinfra" else f"rigup {case.cli}:"
    where = case.where if case.where == "data" or case.where.startswith("group") else HOST
    assert_one_message(out, prefix, str(path), where, case.key, case.value, *case.allowed)
    if case.cli == "pyinfra":
        assert result.returncode == 2
        assert "Connecting" not in out and "pyinfra error" not in out, out
    else:
        assert result.stdout == "", result.stdout  # nothing ran: no table, no progress


@pytest.mark.parametrize("pair,key,value,allowed", RENDER_CASES, ids=[c[0] for c in RENDER_CASES])
def test_render_data_prints_one_message_without_traceback(cli_runs, pair, key, value, allowed):
    out_dir, result = cli_runs[f"render {pair}"]
    out = result.stdout + result.stderr
    assert result.returncode == 2, out
    assert_one_message(out, "rigup render:", key, value, *allowed)
    assert not out_dir.exists()  # nothing rendered


@pytest.mark.parametrize("pair,key,value,allowed", DOCTOR_DATA_CASES, ids=[c[0] for c in DOCTOR_DATA_CASES])
def test_doctor_data_is_checked_as_the_fleet_file_is_before_connecting(cli_runs, pair, key, value, allowed):
    # Was: `doctor --data 'variant_overrides={port: 70000}'` connected, then failed the host's recipe (exit 1).
    _, result = cli_runs[f"doctor {pair}"]
    out = result.stdout + result.stderr
    assert result.returncode == 2, out
    assert_one_message(out, "rigup doctor:", key, value, *allowed)
    assert result.stdout == "", result.stdout  # nothing connected: no table


@pytest.mark.parametrize("where,host", [
    ("host", {"variant": "dual-tubro"}),
    ("pod", {"pods": [{"name": "left", "variant": "dual-tubro", "gpus": [0, 1]}]}),
])  # fmt: skip
def test_unknown_variant_is_one_short_line_with_the_closest_names(tmp_path, where, host):
    # Was one ~3,000-character line listing every variant, with no "did you mean".
    path = write_fleet(tmp_path, Case(f"typo-{where}", "", "", (), host=host))
    with pytest.raises(FleetError) as excinfo:
        load_fleet(path)
    message = str(excinfo.value)
    assert "did you mean 'dual-turbo'" in message, message
    assert len(message) < len(str(path)) + 250, message
    with pytest.raises(RecipeError, match=r"unknown variant 'dual-tubro' \(did you mean 'dual-turbo'") as excinfo:
        resolve({**load_defaults(), "variant": "dual-tubro"})
    assert len(str(excinfo.value)) < 200


# --------------------------------------------------------------------------------------------
# the knob rules


def test_every_rule_is_for_a_declared_knob_and_every_default_passes():
    assert undeclared_rules() == []
    for name, default in load_defaults().items():
        assert check_knob(name, default) == default


def test_example_fleet_file_passes():
    load_fleet(REPO_ROOT / "rigs.example.yaml")


ENUMS = {
    "driver_reboot": REBOOT_POLICIES,
    "gpu_interconnect": MODES,
    "preflight_vram_misfit": VRAM_MISFIT_POLICIES,
    "model_fleet_source": MODEL_FLEET_MODES,
    "nvidia_driver_flavour": FLAVOURS,
    "nvidia_driver_source": DRIVER_SOURCES,
}


def test_patterns_repeated_for_the_layering_match_the_recipes():
    # The recipe uses the knobs' patterns; the fleet check and resolve must agree on every value.
    assert knobs_module.RIG_PATH.pattern == recipe_module._SAFE_PATH.pattern
    for registry in ("docker.io", "mirror.lan:5000", "registry.example/dockerhub/", "https://x", "a b", "", "x:y"):
        try:
            recipe_module._registry_prefix(registry)
            recipe_ok = True
        except RecipeError:
            recipe_ok = False
        assert rules()["container_registry"].test(registry) is recipe_ok, registry


@pytest.mark.parametrize("name", sorted(ENUMS))
def test_enum_knobs_list_the_values_the_code_reads(tmp_path, name):
    values = ENUMS[name]
    assert rules()[name].allowed == f"one of {', '.join(values)}"
    for value in values:
        check_knob(name, value)
    path = write_fleet(tmp_path, Case(name, name, "'bogus'", (), host={name: "bogus"}))
    with pytest.raises(FleetError, match=rf"host 'rig-01': '{name}' must be one of {', '.join(values)}, got 'bogus'"):
        load_fleet(path)


INT_MINIMUMS = {
    name: int(rule.allowed.rsplit(" ", 1)[1])
    for name, rule in rules().items()
    if rule.allowed.startswith("an integer of at least ")
}


def test_integer_knobs_with_lower_bounds_are_covered():
    for name in ("serving_keep_generations", "model_download_retries", "rollout_batch", "driver_reboot_timeout_s", "gpu_count"):
        assert INT_MINIMUMS[name] == 1, name
    assert INT_MINIMUMS["rollout_max_failures"] == 0


@pytest.mark.parametrize("name", sorted(INT_MINIMUMS))
def test_integer_knobs_reject_below_the_bound_and_bools(name):
    minimum = INT_MINIMUMS[name]
    check_knob(name, minimum)
    for bad in (minimum - 1, True, "3"):
        with pytest.raises(KnobError) as excinfo:
            check_knob(name, bad)
        assert f"{name!r} must be" in str(excinfo.value) and repr(bad) in str(excinfo.value)
        assert f"an integer of at least {minimum}" in str(excinfo.value)


@pytest.mark.parametrize(
    "name,bad,allowed",
    [
        ("install_root", "/opt/../etc", "absolute path"),
        ("install_root", "/opt/my rigup", "absolute path"),
        ("model_dir", "/opt/../etc", "absolute path"),  # None is "<install_root>/models": tests/desired/test_derived_defaults.py
        ("model_fleet_port", 70000, "1 to 65535"),
        ("serving_bind_address", "localhost", "an IP address"),
        ("container_registry", "https://mirror.lan", "host[:port][/path]"),
        ("docker_apt_url", "download.docker.com/linux/ubuntu", "a URL"),
        ("source_refs", {"genesys": "main"}, "club3090, club3090-may, club3090-spring, genesis, qwen36-dual-3090, vllm-fork"),
        ("preflight_os_allowed", ["ubuntu"], "<os-release ID> <VERSION_ID>"),
        ("preflight_disk_margin_gb", -1, "0 or more"),
        ("serving_health_timeout_s", 0, "above 0"),
        ("variant_overrides", ["port"], "a mapping"),
    ],
)
def test_other_rules(name, bad, allowed):
    with pytest.raises(KnobError) as excinfo:
        check_knob(name, bad)
    assert allowed in str(excinfo.value) and repr(bad) in str(excinfo.value)


def test_ssh_port_range(tmp_path):
    path = tmp_path / "rigs.yaml"
    path.write_text("groups:\n  g:\n    hosts:\n      rig-01: {ssh_port: 0}\n")
    with pytest.raises(FleetError, match=r"host 'rig-01': 'ssh_port' must be an integer port from 1 to 65535, got 0"):
        load_fleet(path)


def test_fleet_and_resolve_apply_the_same_override_rule(tmp_path):
    overrides = {"max_model_len": "lots"}
    with pytest.raises(RecipeError) as direct:
        resolve({**load_defaults(), "variant": "dual", "variant_overrides": overrides})
    with pytest.raises(RecipeError) as checked:
        check_overrides("dual", overrides)
    path = write_fleet(tmp_path, Case("same", "", "", (), host={"variant_overrides": overrides}))
    with pytest.raises(FleetError) as fleet:
        load_fleet(path)
    assert str(direct.value) == str(checked.value)
    assert str(fleet.value).endswith(str(direct.value))


def test_overrides_are_checked_against_the_hosts_own_variant(tmp_path):
    # tensor_parallel_size 2 suits dual (fleet-wide) but not single (rig-02's own variant).
    path = tmp_path / "rigs.yaml"
    path.write_text(
        "data: {variant: dual, variant_overrides: {tensor_parallel_size: 2}}\n"
        "groups:\n  g:\n    hosts:\n      rig-01: {}\n      rig-02: {variant: single}\n"
    )
    with pytest.raises(FleetError, match=r"host 'rig-02' \(variant_overrides set in data\): .* for variant 'single', got 2"):
        load_fleet(path)


# --------------------------------------------------------------------------------------------
# @local: pyinfra's local connector


def _local_fleet(tmp_path: Path, host: str = "{}", data: str = "") -> Path:
    path = tmp_path / "rigs.yaml"
    path.write_text(f"{data}groups:\n  rigs:\n    hosts:\n      '@local': {host}\n      rig-01: {{ssh_hostname: 10.0.0.1}}\n")
    return path


@pytest.mark.parametrize("euid,sudo", [(0, False), (1000, True)])
def test_local_host_uses_sudo_unless_root(tmp_path, monkeypatch, euid, sudo):
    monkeypatch.setattr(fleet_module.os, "geteuid", lambda: euid)
    fleet = load_fleet(_local_fleet(tmp_path))
    assert fleet.host("@local").data["_sudo"] is sudo
    assert "_sudo" not in fleet.host("rig-01").data  # other hosts keep group_data/all.py's _sudo
    assert dict(fleet.pyinfra_groups()["rigs"])["@local"]["_sudo"] is sudo


@pytest.mark.parametrize(
    "host,data,sudo",
    [("{_sudo: false}", "", False), ("{_sudo: true}", "", True), ("{}", "data: {_sudo: false}\n", False)],
    ids=["host-false", "host-true", "fleet-wide"],
)
def test_local_host_keeps_the_fleet_files_own_sudo(tmp_path, monkeypatch, host, data, sudo):
    monkeypatch.setattr(fleet_module.os, "geteuid", lambda: 1000 if not sudo else 0)  # the opposite of the rule
    assert load_fleet(_local_fleet(tmp_path, host, data)).host("@local").data["_sudo"] is sudo


def test_data_values_parse_as_pyinfra_and_the_fleet_file_write_them():
    from rigup.desired.knobs import parse_data_value

    assert parse_data_value("true") is True and parse_data_value("8001") == 8001
    assert parse_data_value('{"port": 8001}') == {"port": 8001}
    assert parse_data_value("{port: 8001, max_model_len: 32768}") == {"port": 8001, "max_model_len": 32768}
    assert parse_data_value("[0, 1]") == [0, 1]
    assert parse_data_value("{port: 8001") == "{port: 8001"  # neither JSON nor YAML: text, refused by its knob
    assert parse_data_value("/opt/rigup") == "/opt/rigup"
