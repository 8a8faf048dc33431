"""rigup/py: the fleet plan (who fetches from the hub, who copies from whom) and the decisions
of the model operations, on @fake hosts with scripted rigfetch --check answers."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from pyinfra.api import Config, Inventory, State
from pyinfra.api.connect import connect_all
from pyinfra.api.operation import add_op
from pyinfra.api.operations import run_ops

from rigup.desired.knobs import load_defaults
from rigup.desired.lock import FilePin, GitNeed, GitPin, ImagePin, LockError, LockFile, ModelNeed, ModelPin
from rigup.desired.needs import needs_for
from rigup.desired.recipe import resolve
from rigup.facts.model import ModelFiles
from rigup.operations.model import model_files
from rigup.rig.rigfetch.manifest import load_manifest
from rigup.runstate import fleet_plan

QWEN = "model:Lorbus/Qwen3.6-27B-int4-AutoRound"
DFLASH = "model:z-lab/Qwen3.6-27B-DFlash"
HF_TOKEN = "hf_secret_for_modelops_tests"
STALE = '{"script": "stale"}'


def _check(work: list[dict[str, Any]] | None = None, prune: list[str] | None = None) -> str:
    work = work or []
    return json.dumps({"script_version": 1, "files": 3, "ok": 3 - len(work), "work": work, "prune": prune or []})


WORK = _check(
    [{"path": "/opt/rigup/models/qwen3.6-27b-autoround-int4/model.safetensors", "action": "fetch", "size": 10, "part_size": 0}]
)


def _write_lock(path: Path, variants: list[str]) -> None:
    """A lock with made-up but well-formed pins for what these variants need."""
    lock = LockFile()
    for variant in variants:
        data = {**load_defaults(), "variant": variant}
        for need in needs_for(resolve(data, None), data):
            if isinstance(need, GitNeed):
                commit = need.ref if re.fullmatch(r"[0-9a-f]{40}", need.ref) else "1" * 40
                lock.git[need.name] = GitPin(need.name, need.url, need.ref, commit)
            elif isinstance(need, ModelNeed):
                files = (FilePin("config.json", 10, "a" * 64), FilePin("model.safetensors", 1000, "b" * 64))
                lock.models[need.name] = ModelPin(need.name, need.repo_id, need.revision, "2" * 40, files)
            else:
                lock.images[need.name] = ImagePin(need.name, need.repository, need.tag, None)
    lock.save(path)


def _state(tmp_path: Path, hosts: list[tuple[str, dict[str, Any]]]) -> State:
    lock_file = tmp_path / "rigs.lock.yaml"
    _write_lock(lock_file, sorted({data["variant"] for _, data in hosts}))
    entries = []
    for name, data in hosts:
        entries.append(
            (name, {**load_defaults(), "lock_file": str(lock_file), "fake_delay": 0, "fake_delay_jitter": 0, **data})
        )
    inventory = Inventory((entries, {}))
    state = State(inventory=inventory, config=Config())
    connect_all(state)
    return state


def _model_plan(state: State, host: Any) -> Any:
    """The host's model plan, from the run's FleetPlan (every rig of the run planned together, once)."""
    return fleet_plan(state).host(host.name).models


def _names(manifest: dict[str, Any]) -> list[str]:
    return [m["name"] for m in manifest["models"]]


def test_fleet_rigs_holding_a_model_form_its_chain(tmp_path: Path) -> None:
    state = _state(
        tmp_path,
        [
            ("@fake/rig-01", {"variant": "dual", "ssh_hostname": "10.0.0.11"}),
            ("@fake/rig-02", {"variant": "dual-dflash", "ssh_hostname": "10.0.0.12"}),
            ("@fake/rig-03", {"variant": "dual", "ssh_hostname": "10.0.0.13", "model_fleet_port": 9000}),
        ],
    )
    host = state.inventory.get_host
    one, two, three = (_model_plan(state, host(f"@fake/rig-0{i}")) for i in (1, 2, 3))

    main, draft = "qwen3.6-27b-autoround-int4", "qwen3.6-27b-dflash"
    assert _names(one.manifest) == [main] and _names(two.manifest) == [main, draft]
    assert [m.host.name for m in one.chains[main]] == ["@fake/rig-01", "@fake/rig-02", "@fake/rig-03"]
    assert [m.base_url for m in one.chains[main]] == ["http://10.0.0.11:8765/", "http://10.0.0.12:8765/", "http://10.0.0.13:9000/"]
    assert [m.host.name for m in two.chains[draft]] == ["@fake/rig-02"]  # the only rig with the draft
    assert three.listen_port == 9000 and one.chains and three.chains
    assert one.chains[main][1].manifest == two.manifest  # what rig-01 checks of rig-02 is rig-02's own check

    entry = one.manifest["models"][0]
    assert entry["dir"] == "/opt/rigup/models/qwen3.6-27b-autoround-int4"
    assert entry["hub_url"] == f"https://huggingface.co/Lorbus/Qwen3.6-27B-int4-AutoRound/resolve/{'2' * 40}/"
    assert [f["path"] for f in entry["files"]] == ["config.json", "model.safetensors"]
    assert "upstreams" not in entry  # decided at execution, from the facts
    assert one.script == "/opt/rigup/bin/rigfetch.py"


def test_rigs_locked_to_other_files_of_a_model_are_in_another_chain(tmp_path: Path) -> None:
    state = _state(tmp_path, [(f"@fake/rig-0{i}", {"variant": "dual"}) for i in (1, 2, 3)])
    other = tmp_path / "other.lock.yaml"
    lock = LockFile.load(tmp_path / "rigs.lock.yaml")
    pin = lock.models[QWEN]
    lock.models[QWEN] = ModelPin(pin.name, pin.repo_id, pin.revision, "3" * 40, pin.files[:1])
    lock.save(other)
    three = state.inventory.get_host("@fake/rig-03")
    three.data.override_datas["lock_file"] = str(other)  # rig-03 follows another lock
    host = state.inventory.get_host
    one, rig3 = _model_plan(state, host("@fake/rig-01")), _model_plan(state, three)
    name = "qwen3.6-27b-autoround-int4"
    assert [m.host.name for m in one.chains[name]] == ["@fake/rig-01", "@fake/rig-02"]
    assert [m.host.name for m in rig3.chains[name]] == ["@fake/rig-03"]


def test_fleet_off_rigs_are_in_no_chain(tmp_path: Path) -> None:
    state = _state(
        tmp_path,
        [
            ("@fake/rig-01", {"variant": "dual", "model_fleet_source": "off"}),
            ("@fake/rig-02", {"variant": "dual"}),
            ("@fake/rig-03", {"variant": "dual"}),
        ],
    )
    host = state.inventory.get_host
    one, two, three = (_model_plan(state, host(f"@fake/rig-0{i}")) for i in (1, 2, 3))
    assert one.chains == {}
    assert [m.host.name for m in two.chains["qwen3.6-27b-autoround-int4"]] == ["@fake/rig-02", "@fake/rig-03"]
    assert three.chains["qwen3.6-27b-autoround-int4"][0].base_url == "http://@fake/rig-02:8765/"


def test_a_single_rig_is_a_chain_of_one(tmp_path: Path) -> None:
    state = _state(tmp_path, [("@fake/rig-01", {"variant": "dual-dflash"})])
    plan = _model_plan(state, state.inventory.get_host("@fake/rig-01"))
    assert len(plan.manifest["models"]) == 2
    assert all(len(chain) == 1 for chain in plan.chains.values())


def test_plan_refuses_a_stale_lock(tmp_path: Path) -> None:
    state = _state(tmp_path, [("@fake/rig-01", {"variant": "dual"})])
    lock = LockFile.load(tmp_path / "rigs.lock.yaml")
    del lock.models[QWEN]
    lock.save(tmp_path / "rigs.lock.yaml")
    with pytest.raises(LockError, match="no entry"):
        _model_plan(state, state.inventory.get_host("@fake/rig-01"))


# ------------------------------------------------------------------------------------------
# operations on @fake hosts


def _rigfetch_runs(host: Any) -> list[str]:
    return [c for c in host.connector.executed_commands if c.startswith("python3 ") and "--check" not in c]


def test_model_files_is_a_noop_when_the_stamps_match(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = _state(tmp_path, [("@fake/rig-01", {"variant": "dual", "fake_responses": {"--check": _check()}})])
    host = state.inventory.get_host("@fake/rig-01")
    meta = _fetch(state)[host]
    assert meta.did_succeed() and not meta.did_change()
    assert _rigfetch_runs(host) == []


def test_model_files_runs_rigfetch_with_secrets_on_stdin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", HF_TOKEN)
    state = _state(
        tmp_path, [("@fake/rig-01", {"variant": "dual", "model_fleet_source": "off", "fake_responses": {"--check": WORK}})]
    )
    host = state.inventory.get_host("@fake/rig-01")
    plan = _model_plan(state, host)
    meta = _fetch(state, retries=5, reverify=True)[host]
    assert meta.did_change()
    (command,) = _rigfetch_runs(host)
    assert command.startswith("python3 /opt/rigup/bin/rigfetch.py --manifest-b64 ")
    assert "--retries 5 --terse --reverify --secrets-stdin" in command
    assert "--listen" not in command  # nobody to serve
    assert _manifest_of(command) == plan.manifest
    assert HF_TOKEN not in " ".join(host.connector.executed_commands)
    stdin = meta._commands[0].connector_arguments["_stdin"]
    assert json.loads(stdin) == {"hf_token": HF_TOKEN}


def test_model_files_treats_a_stale_script_as_work(tmp_path: Path) -> None:
    state = _state(tmp_path, [("@fake/rig-01", {"variant": "dual", "fake_responses": {"--check": STALE}})])
    host = state.inventory.get_host("@fake/rig-01")
    assert _fetch(state)[host].did_change()


def test_check_fact_command_guards_the_script_version() -> None:
    command = ModelFiles().command("/opt/rigup/bin/rigfetch.py", "f" * 64, "QUJD", True).get_raw_value()
    assert f"{'f' * 64}  -" in command and "--check --manifest-b64 QUJD --reverify" in command
    assert ModelFiles().process(["noise", STALE])["script"] == "stale"
    assert ModelFiles().process([_check()])["work"] == []


def _rig(n: int, check: str) -> tuple[str, dict[str, Any]]:
    return (f"@fake/rig-0{n}", {"variant": "dual", "ssh_hostname": f"10.0.0.1{n}", "fake_responses": {"--check": check}})


def test_rigs_that_hold_the_files_lead_the_chain_and_serve_the_ones_that_need_them(tmp_path: Path) -> None:
    state = _state(tmp_path, [_rig(1, WORK), _rig(2, _check()), _rig(3, WORK), _rig(4, _check())])
    one, two, three, four = (state.inventory.get_host(f"@fake/rig-0{i}") for i in (1, 2, 3, 4))
    metas = _fetch(state)
    # This run's chain: rig-02, rig-04 (they hold the files), then rig-01, rig-03.
    (first,) = _rigfetch_runs(one)
    assert _upstreams(first) == ["http://10.0.0.12:8765/", "http://10.0.0.14:8765/"]
    assert "--listen 0.0.0.0:8765 --expect-peers 1 --idle-timeout 30" in first  # rig-03 comes after it
    (third,) = _rigfetch_runs(three)
    assert _upstreams(third) == ["http://10.0.0.12:8765/", "http://10.0.0.14:8765/", "http://10.0.0.11:8765/"]
    assert "--listen" not in third  # the tail serves nobody
    for holder in (two, four):
        (serve,) = _rigfetch_runs(holder)
        assert "--expect-peers 2" in serve and _upstreams(serve) == []
    stdin = json.loads(metas[three]._commands[0].connector_arguments["_stdin"])
    assert stdin["fleet_token"] == json.loads(metas[two]._commands[0].connector_arguments["_stdin"])["fleet_token"]
    assert len(stdin["fleet_token"]) >= 32


def test_a_fleet_where_every_rig_holds_the_files_does_nothing(tmp_path: Path) -> None:
    state = _state(tmp_path, [_rig(i, _check()) for i in (1, 2, 3)])
    metas = _fetch(state)
    assert not any(meta.did_change() for meta in metas.values())
    assert not any(_rigfetch_runs(h) for h in state.inventory)


def test_a_failed_rig_leaves_the_chain(tmp_path: Path) -> None:
    state = _state(tmp_path, [_rig(1, _check()), _rig(2, WORK)])
    one, two = state.inventory.get_host("@fake/rig-01"), state.inventory.get_host("@fake/rig-02")
    plans = {h: _model_plan(state, h) for h in (one, two)}
    state.fail_hosts({one})
    metas = _fetch(state, plans=plans)
    (fetch,) = _rigfetch_runs(two)
    assert _upstreams(fetch) == []  # the head now: it reads the hub
    assert metas[two].did_change()


def _manifest_of(command: str) -> dict[str, Any]:
    return load_manifest(None, command.split("--manifest-b64 ")[1].split()[0])


def _upstreams(command: str) -> list[str]:
    return _manifest_of(command)["models"][0].get("upstreams", [])


def _fetch(state: State, plans: dict[Any, Any] | None = None, **kwargs: Any) -> dict[Any, Any]:
    """Add model_files on every active host, each with its own plan, then run it (one op: pyinfra runs it
    on all hosts at once, as in a deploy)."""
    plans = plans or {h: _model_plan(state, h) for h in state.inventory.get_active_hosts()}
    metas: dict[Any, Any] = {}
    for host in sorted(state.inventory.get_active_hosts(), key=lambda h: h.name):
        plan = plans[host]
        metas[host] = add_op(
            state,
            model_files,
            host=host,
            manifest=plan.manifest,
            script=plan.script,
            chains=plan.chains,
            listen_port=plan.listen_port,
            **kwargs,
        )[host]
    run_ops(state)
    return metas
