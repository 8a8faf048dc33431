"""The fleet's plan for a run (rigup.desired.fleet_plan): each host's roles read in one place, and every host
planned once however often the run's tasks ask, so that planning grows linearly with the fleet."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from rigup.desired import plan as plan_module
from rigup.desired.fleet import load_fleet
from rigup.desired.fleet_plan import FleetPlan, fleet_entries, plan_fleet
from rigup.desired.lock import LockError
from rigup.desired.roles import HostRoles
from tests.support.fleets import MIRROR_FLEET, write_fleet


def fleet_plan(tmp_path: Path, text: str = MIRROR_FLEET) -> FleetPlan:
    return plan_fleet(fleet_entries(load_fleet(write_fleet(tmp_path, text))))


@pytest.fixture
def resolves(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The variant of every recipe resolved (rigup.desired.recipe.resolve, as rigup.desired.plan calls it)."""
    calls: list[str] = []
    real = plan_module.resolve

    def counting(host_data: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(str(host_data.get("variant")))
        return real(host_data, *args, **kwargs)

    monkeypatch.setattr(plan_module, "resolve", counting)
    return calls


def test_each_hosts_roles_come_from_its_knobs_groups_and_who_names_it(tmp_path: Path) -> None:
    plan = fleet_plan(tmp_path)
    assert plan.roles("rig-01") == HostRoles(rig=True, gateway=False, monitor=False, image_mirror=True,
                                             image_relay=True, cluster=None)
    assert plan.roles("rig-02") == HostRoles(rig=True, gateway=False, monitor=False, image_mirror=False,
                                             image_relay=True, cluster=None)
    # a gateway-only host: the gateway and (monitor_group's default) the monitor; no registry, no variant
    assert plan.roles("gw") == HostRoles(rig=False, gateway=True, monitor=True, image_mirror=False,
                                         image_relay=False, cluster=None)
    assert not plan.roles("gw").image_registry and plan.roles("rig-02").image_registry
    with pytest.raises(KeyError, match="'rig-09' is no host of this run"):
        plan.host("rig-09")


def test_every_host_is_planned_once_however_often_its_tasks_ask(tmp_path: Path, resolves: list[str]) -> None:
    plan = fleet_plan(tmp_path)
    plan.plan_everything()
    assert len(resolves) == 3  # one pod on each of the three rigs; the gateway-only host serves nothing
    for _ in range(2):  # what the sources, model and image mirror tasks and the mirror's chain ask, on every host
        for host in plan.hosts:
            host.pods, host.mirror_pins, host.registry
        plan.image_chain()
    assert len(resolves) == 3
    assert plan.host("gw").pods == []


def test_the_mirror_keeps_every_clients_pins_and_a_relay_its_own(tmp_path: Path) -> None:
    plan = fleet_plan(tmp_path)
    smoke = plan.host("rig-02").mirror_pins
    assert smoke and all(pin.startswith("nvidia/cuda:") for pin in smoke)  # no lock: the smoke image alone
    mirror, relay = plan.host("rig-01").registry, plan.host("rig-02").registry
    assert mirror is not None and not mirror.is_relay and mirror.clients == ("rig-01", "rig-02", "rig-03")
    assert relay is not None and relay.is_relay and list(relay.keep) == smoke
    assert plan.host("gw").registry is None
    # the chain: the mirror first, then the relays
    assert [h.name for h in plan.image_chain()] == ["rig-01", "rig-02", "rig-03"]


def test_a_rig_without_a_usable_lock_has_no_model_plan_and_says_why(tmp_path: Path) -> None:
    plan = fleet_plan(tmp_path)
    with pytest.raises(LockError, match="lock file not found"):
        plan.host("rig-02").models


def test_the_gateway_routes_to_every_rig_and_the_monitor_scrapes_them(tmp_path: Path) -> None:
    gw = fleet_plan(tmp_path).host("gw")
    gateway, monitor = gw.gateway(read_secrets=False), gw.monitor(read_secrets=False)
    assert gateway is not None and [r.host for r in gateway.rigs] == ["rig-01", "rig-02", "rig-03"]
    assert monitor is not None and [r.host for r in monitor.rigs] == ["rig-01", "rig-02", "rig-03"]
    assert fleet_plan(tmp_path).host("rig-01").gateway() is None


def test_hosts_asking_at_once_wait_for_one_plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # pyinfra loads every host's task files at once (greenlets; threads here), and planning waits on git
    plan = fleet_plan(tmp_path)
    calls: list[str] = []
    real = plan_module.resolve

    def slow(host_data: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(str(host_data.get("variant")))
        time.sleep(0.05)  # a read of upstream's files: another host asks meanwhile
        return real(host_data, *args, **kwargs)

    monkeypatch.setattr(plan_module, "resolve", slow)
    names = ["rig-01", "rig-02", "rig-03"] * 3
    with ThreadPoolExecutor(len(names)) as pool:
        pins = list(pool.map(lambda name: plan.host(name).mirror_pins, names))
        chains = list(pool.map(lambda name: [h.name for h in plan.image_chain()], names))
    assert len(calls) == 3  # each rig's one pod, once
    assert pins[0] == pins[3] and len({tuple(c) for c in chains}) == 1


def test_a_cluster_members_peers_are_the_other_members_as_the_fleet_reaches_them(tmp_path: Path) -> None:
    plan = fleet_plan(tmp_path, """
        groups:
          rigs:
            hosts:
              rig-a: {ssh_hostname: 10.0.0.11}
              rig-b: {ssh_hostname: 10.0.0.12}
              rig-c: {}
        clusters:
          - {name: big, variant: qwen-multi4-autoround-int4-mtp, hosts: [rig-c, rig-a], port: 8040}
    """)
    assert plan.cluster_peers("rig-a") == {"rig-c": "rig-c"}  # no ssh_hostname: its name
    assert plan.cluster_peers("rig-c") == {"rig-a": "10.0.0.11"}
    assert plan.cluster_peers("rig-b") == {}  # in no cluster
    assert plan.clusters() == {"big": ["rig-a", "rig-c"]}
