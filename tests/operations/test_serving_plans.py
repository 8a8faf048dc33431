"""A fresh cluster member converges in one run (issue 41): its files are planned while the deploy is planned,
when the rig has no driver and so no GPU topology, and written after the driver task installed it. Through
pyinfra's own planning and execution on a @fake host whose `nvidia-smi topo` starts answering between the
two, as a test-bed rig's stand-in does once its driver is loaded."""

from __future__ import annotations

from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from pyinfra.api import Config, Inventory, State
from pyinfra.api.connect import connect_all, disconnect_all
from pyinfra.api.operation import add_op
from pyinfra.api.operations import run_ops

from rigup.desired.fleet import load_fleet
from rigup.facts.gpu import GpuTopology
from rigup.facts.util import ABSENT
from rigup.operations.serving import secret_file
from rigup.operations.serving_plans import PodPlans, text_file
from tests.support.bed_topology import bed_topology_output
from tests.support.fit_fake import offline_lock

VARIANT = "qwen-multi4-autoround-int4-mtp"  # upstream's entrypoint sources detect_nvlink.sh: NVLINK_MODE
NET = {"ifname": "lan0", "address": "10.0.0.12", "head_address": "10.0.0.11"}
TOPOLOGY = "nvidia-smi topo -m"
API_KEY = "sk-serving-plans-7a0c3e9d51"


def member_data(tmp_path: Path) -> dict[str, Any]:
    """rig-b, the worker of a two-rig cluster, with its network as the deploy reads it."""
    key = tmp_path / "api.key"
    key.write_text(API_KEY + "\n")
    key.chmod(0o600)
    path = tmp_path / "rigs.yaml"
    path.write_text(
        f"data: {{serving_api_key_file: {key}, lock_file: {tmp_path / 'rigs.lock.yaml'}}}\n"
        "groups:\n  rigs:\n    hosts:\n      rig-a: {ssh_hostname: 10.0.0.11}\n      rig-b: {ssh_hostname: 10.0.0.12}\n"
        f"clusters:\n  - {{name: big, variant: {VARIANT}, hosts: [rig-a, rig-b], port: 8040}}\n"
    )
    data = load_fleet(path).resolved_data("rig-b")
    offline_lock(data, tmp_path / "rigs.lock.yaml")
    return {**data, "cluster": {**data["cluster"], "net": NET}}


def converge(data: dict[str, Any], monkeypatch: pytest.MonkeyPatch, topology_when_planned: str,
             topology_when_written: str) -> tuple[PodPlans, dict[str, str]]:
    """The serving task's file writes for one host through pyinfra: planned while `nvidia-smi topo` prints
    `topology_when_planned`, executed after it prints `topology_when_written`. Returns the plans and what
    was uploaded (path -> text)."""
    responses = {TOPOLOGY: topology_when_planned.splitlines()}
    inventory = Inventory((["@fake/rig-b"], {"fake_delay": 0, "fake_delay_jitter": 0, "fake_responses": responses}))
    state = State(inventory=inventory, config=Config())
    connect_all(state)
    host = inventory.get_host("@fake/rig-b")
    uploaded: dict[str, str] = {}

    def put_file(filename_or_io: Any, remote_filename: str, *args: Any, **kwargs: Any) -> bool:
        uploaded[remote_filename] = filename_or_io.read() if isinstance(filename_or_io, StringIO) else str(filename_or_io)
        return True

    monkeypatch.setattr(host.connector, "put_file", put_file)
    written: list[str] = []
    monkeypatch.setattr(host.connector, "run_shell_command", _recording(host.connector.run_shell_command, written))
    plans = PodPlans(host, data, host.get_fact(GpuTopology), require_lock=False)
    (plan,) = plans.planned
    paths = plan.recipe.paths
    add_op(state, text_file, name="Write the compose file", dest=paths.compose_file, text=plans.text(0, "compose"))
    key_file = plan.secret_files["VLLM_API_KEY"]
    add_op(state, secret_file, name="Write the secret file VLLM_API_KEY", path=key_file,
           content=plans.secret(0, "VLLM_API_KEY"))
    add_op(state, text_file, name="Write the release file", dest=f"{paths.variant_dir}/release.json",
           text=plans.text(0, "release"))
    # the driver task ran in between (the connector keeps its own copy of the host's data)
    host.connector.data["fake_responses"] = {TOPOLOGY: topology_when_written.splitlines()}
    run_ops(state)
    disconnect_all(state)
    key_writes = [c for c in written if "mktemp" in c]
    if key_writes:
        uploaded[key_file] = key_writes[-1]
    return plans, uploaded


def _recording(run: Any, into: list[str]) -> Any:
    def recorded(command: Any, *args: Any, **kwargs: Any) -> Any:
        stdin = kwargs.get("_stdin")
        if stdin is not None:
            into.append(f"{command.get_raw_value() if hasattr(command, 'get_raw_value') else command}\n{stdin}")
        return run(command, *args, **kwargs)
    return recorded


def test_a_fresh_members_first_converge_writes_what_the_second_plans(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = member_data(tmp_path)
    bed = bed_topology_output()  # two RTX 3090s on PCIe (PIX), no P2P: no NVLink
    first_plans, first = converge(data, monkeypatch, ABSENT, bed)  # fresh: no nvidia-smi while planning
    second_plans, second = converge(data, monkeypatch, bed, bed)  # converged: the driver is there all along
    (plan,) = second_plans.planned
    compose = plan.recipe.paths.compose_file
    assert "NVLINK_MODE=force_off" in first[compose]  # the interconnect rigup detects, not upstream's `auto`
    # what the second converge plans is what the first one wrote: nothing to restart
    assert first[compose] == plan.compose.content == second[compose]
    assert first[f"{plan.recipe.paths.variant_dir}/release.json"] == plan.release_text
    # while planning the fresh rig nothing was known: what the first converge wrote before (issue 41) differs
    (planned_fresh,) = first_plans.planned
    assert "NVLINK_MODE=auto" in planned_fresh.compose.content
    assert planned_fresh.release_sha256 != plan.release_sha256


def test_the_key_file_is_written_from_the_same_plan_and_its_secret_stays_out_of_the_arguments(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = member_data(tmp_path)
    bed = bed_topology_output()
    plans, uploaded = converge(data, monkeypatch, ABSENT, bed)
    (plan,) = plans.planned
    written = uploaded[plan.secret_files["VLLM_API_KEY"]]
    assert API_KEY in written.split("\n", 1)[1]  # on the command's stdin
    assert API_KEY not in written.split("\n", 1)[0]  # never in the command itself


def test_a_topology_read_while_planning_is_not_read_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = member_data(tmp_path)
    # a converged rig: the topology is known while planning; an answer that changed later is not asked for
    plans, uploaded = converge(data, monkeypatch, bed_topology_output(), bed_topology_output("2x3090-nvlink"))
    (plan,) = plans.planned
    assert uploaded[plan.recipe.paths.compose_file] == plan.compose.content
    assert "NVLINK_MODE=force_off" in plan.compose.content


def test_a_rig_whose_driver_is_still_missing_keeps_what_the_knob_decided(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = member_data(tmp_path)
    plans, uploaded = converge(data, monkeypatch, ABSENT, ABSENT)  # the driver waits for a reboot
    (plan,) = plans.planned
    assert uploaded[plan.recipe.paths.compose_file] == plan.compose.content
    assert "NVLINK_MODE=auto" in plan.compose.content
