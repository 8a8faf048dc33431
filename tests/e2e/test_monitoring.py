"""Fleet monitoring end to end: Debian's real Prometheus and node_exporter (from the hub's archive),
the DCGM exporter container on Docker's real engine, the real LiteLLM gateway, and the vLLM stand-in's
/metrics in vLLM's own format.

One 3-host bed: gw-01 (no GPU, serves_variant: false) runs the gateway and, by default, Prometheus;
rig-01 and rig-02 serve. The scenarios run in file order: bring-up scrapes every target (each pod,
GPU exporter, node, the gateway, Prometheus itself) and loads every alert rule; `rigup verify` moves
each pod's vllm:generation_tokens_total; a stopped pod fires RigupPodDown within its `for:` window
(and clears when it serves again); a variant switch moves its target at that converge; a converged
re-run changes nothing; no key is in the scrape config, and the key files are 0600 prometheus.
Every internal service asks who is calling (issue 42): node_exporter, the DCGM exporter, Prometheus and
Alertmanager want TLS from the fleet CA and the metrics login (these tests read Prometheus as `rigup top`
does, with it); from the hub, no member, only SSH and the entrance answer (tests/e2e/boundary_probe.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import requests

from rigup.desired.dashboards import panels
from rigup.desired.knobs import load_defaults
from rigup.desired.metrics_auth import PrometheusLogin, prometheus_login
from rigup_testbed.fleet import Testbed
from rigup_testbed.hosts import HostSpec
from rigup_testbed.image import REPO_ROOT
from tests.desired.test_monitoring import ALERTS
from tests.e2e.boundary_probe import check_from_outside, plan_of, refused_from_members
from tests.e2e.conftest import FACTS_INTERVAL_S
from tests.e2e.helpers import entrance_url, fleet_ca_file, key_files, remote_commands
from tests.e2e.test_serving import API_KEY, OTHER_VARIANT, VARIANT, Bed, port_of, served_name, sh

pytestmark = pytest.mark.e2e

GATEWAY_KEY = "sk-rigup-gateway-e2e-5b1e7c3a9d20"
SCRAPE_S = 5  # prometheus_scrape_interval_s: short, so targets and alerts move in seconds
POD_DOWN_FOR_S = 60  # RigupPodDown's `for:` in templates/rigup-alerts.yml.j2


# One kept-alive session per Prometheus and login: the alert scenarios poll every half second, several watches at
# once, and a new TLS connection (and CA file read) for each read was a large part of their CPU (issue 39).
_SESSIONS: dict[tuple[str, Any, str], requests.Session] = {}


def prometheus(bed: Bed, path: str, **params: Any) -> Any:
    """Prometheus' API as `rigup top` reads it: over TLS (the fleet CA's certificate) with the login it asks for,
    as the converge left them beside the fleet file."""
    login = prometheus_login({**load_defaults(), **bed.data}, bed.fleet.parent)
    assert isinstance(login, PrometheusLogin), login
    base = f"https://{bed.host('gw-01').ip}:9090"
    session = _SESSIONS.get((base, login.auth, login.ca_file))
    if session is None:
        session = _SESSIONS[(base, login.auth, login.ca_file)] = requests.Session()
    # verify per request: a session's own would lose to REQUESTS_CA_BUNDLE (requests' merge_environment_settings)
    reply = session.get(f"{base}{path}", params=params, timeout=30, auth=login.auth, verify=login.ca_file)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["status"] == "success", body
    return body["data"]


def query(bed: Bed, promql: str) -> list[dict[str, Any]]:
    return prometheus(bed, "/api/v1/query", query=promql)["result"]


def targets(bed: Bed) -> list[dict[str, Any]]:
    return prometheus(bed, "/api/v1/targets", state="active")["activeTargets"]


def wait_for(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    started = time.monotonic()
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() - started < timeout, f"timed out after {timeout} s waiting for {what}"
        time.sleep(1)


@pytest.fixture(scope="module")
def bed(testbed_factory: Callable[..., Testbed], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bed]:
    specs = [HostSpec("gw-01", hardware="none", group="gateway", data={"serves_variant": False}),
             HostSpec("rig-01", group="rigs"), HostSpec("rig-02", group="lab")]
    testbed = testbed_factory(specs, "monitor", host_layer=True)
    b = Bed(testbed, testbed.workdir)
    # the webhook answers nothing (the discard port): Alertmanager runs, Prometheus sends it alerts with its login
    keys = key_files(tmp_path_factory.mktemp("keys"), rig=API_KEY, gateway=GATEWAY_KEY, hook="http://127.0.0.1:9/rigup-e2e")
    b.data = {**b.data, "serving_api_key_file": str(keys["rig"]), "prometheus_scrape_interval_s": SCRAPE_S,
              "gateway_health_check_interval_s": 5, "metrics_facts_interval_s": FACTS_INTERVAL_S}
    b.group_data = {"gateway": {"gateway_api_key_file": str(keys["gateway"]),
                                "alertmanager_webhook_url_file": str(keys["hook"])}}
    b.write()
    yield b
    testbed.down()  # Prometheus, two exporters per rig and LiteLLM: not left running under later modules


def test_bring_up_scrapes_every_target_and_loads_every_rule(bed: Bed) -> None:
    proc = bed.deploy()
    output = proc.stdout + proc.stderr
    summary = output[output.index("--> What this converge did, per host:"):]
    assert "monitor: 2 pod target(s) (rig-01/dual, rig-02/dual)" in summary, summary
    rig1, rig2 = bed.host("rig-01").ip, bed.host("rig-02").ip
    expected = {
        ("prometheus", "gw-01"), ("vllm", "rig-01"), ("vllm", "rig-02"), ("gpu", "rig-01"), ("gpu", "rig-02"),
        ("node", "rig-01"), ("node", "rig-02"), ("gateway-gw-01", "gw-01"),
    }

    seen: dict[tuple[str, str], str] = {}

    def all_up() -> bool:
        seen.clear()
        seen.update({(t["labels"]["job"], t["labels"]["host"]): f"{t['health']} {t['lastError']}".strip()
                     for t in targets(bed)})
        return set(seen) == expected and all(h == "up" for h in seen.values())

    try:
        wait_for(all_up, 60, "every target up")
    except AssertionError:
        raise AssertionError(f"targets now: {seen}; expected up: {sorted(expected)}") from None
    pods = {t["labels"]["host"]: t for t in targets(bed) if t["labels"]["job"] == "vllm"}
    model = served_name(VARIANT)
    assert {h: (t["labels"]["pod"], t["labels"]["variant"], t["labels"]["model"]) for h, t in pods.items()} == {
        "rig-01": (VARIANT, VARIANT, model), "rig-02": (VARIANT, VARIANT, model)}
    assert pods["rig-01"]["scrapeUrl"] == f"http://{rig1}:{port_of(VARIANT)}/metrics"
    # the GPU exporter reports each simulated card with DCGM's names; node_exporter reads rigup's textfile
    temps = query(bed, 'DCGM_FI_DEV_GPU_TEMP{host="rig-02"}')
    assert len(temps) == 2 and {t["metric"]["gpu"] for t in temps} == {"0", "1"}
    assert all("3090" in t["metric"]["modelName"] for t in temps), temps
    gates = query(bed, "rigup_gate_last_passed")
    assert {(g["metric"]["host"], g["metric"]["pod"], g["value"][1]) for g in gates} == {
        ("rig-01", VARIANT, "1"), ("rig-02", VARIANT, "1")}
    assert {s["metric"]["host"] for s in query(bed, "rigup_driver_loaded_branch == rigup_driver_wanted_branch")} == {
        "rig-01", "rig-02"}
    assert query(bed, 'node_systemd_unit_state{name="rigup-dual.service", state="active"} == 1')
    # the gateway's own metrics, through its key
    assert query(bed, 'up{job="gateway-gw-01"} == 1')
    rules = prometheus(bed, "/api/v1/rules")["groups"]
    loaded = sorted(r["name"] for g in rules for r in g["rules"])
    assert loaded == sorted(ALERTS)  # every rule the fleet renders (tests/desired/test_monitoring.py's list)
    assert all(r["health"] == "ok" for g in rules for r in g["rules"]), rules
    assert f"https://{rig2}:9400/metrics" in {t["scrapeUrl"] for t in targets(bed)}  # the DCGM exporter asks too


def test_node_exporter_asks_who_is_calling(bed: Bed) -> None:
    """node_exporter serves TLS from the fleet CA (kept 0600 on the control machine, beside the fleet file) with
    basic auth: Prometheus scrapes it over https with its login (every node target up, above); the monitor host
    asking without the password gets 401, and plain HTTP is not served (issue 42)."""
    ca_dir = bed.fleet.parent / "fleet-ca"
    assert (ca_dir / "ca.key").stat().st_mode & 0o777 == 0o600
    rig1 = bed.host("rig-01").ip
    nodes = {t["labels"]["host"]: t["scrapeUrl"] for t in targets(bed) if t["labels"]["job"] == "node"}
    assert nodes["rig-01"] == f"https://{rig1}:9100/metrics", nodes
    monitor = bed.host("gw-01")
    ask = "curl -s -o /dev/null -w '%{http_code}' -m 5 --cacert /etc/prometheus/rigup-web/fleet-ca.crt"
    assert sh(monitor, f"{ask} https://{rig1}:9100/metrics") == "401"  # the CA checks out, the caller does not
    assert sh(monitor, f"curl -s -o /dev/null -w '%{{http_code}}' -m 5 http://{rig1}:9100/metrics", check=False) == "400"
    assert sh(bed.host("rig-01"), "stat -c '%a %U' /etc/prometheus/rigup-web/node-exporter.key") == "600 prometheus"


def test_from_outside_only_ssh_and_the_entrance_answer_and_members_are_asked_who_they_are(bed: Bed) -> None:
    """Issue 42's probe, from the table the boundary is rendered from (tests/e2e/boundary_probe.py): the hub
    (on the fleet's network, no member) scans every TCP port of every host and tries every service's requests;
    only SSH and the entrance answer, and only the entrance with its key lets a request through. From a member
    the firewall admits, every service that asks who is calling refuses a caller without credentials."""
    fleet = plan_of(bed.fleet)
    answer = check_from_outside(fleet, lambda h: bed.host(h).ip, bed.testbed.network.hub_netns,
                                {("gw-01", 4000): GATEWAY_KEY}, lambda h, command: sh(bed.host(h), command, check=False))
    print(f"outsider's scan of {len(answer['scan'])} hosts and {len(answer['probes'])} requests: {answer['seconds']} s "
          f"(keyed request ready after {answer['ready_seconds']} s; probes {answer['probe_seconds']} s and "
          f"{answer['probe_seconds_after']} s, keyed retries {answer['retries']} and {answer['retries_after']})")

    def run_on(member: str | None, command: str) -> str:
        if member is None:  # the control machine
            return subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60).stdout
        return sh(bed.host(member), command, check=False)

    asked, silent = refused_from_members(fleet, lambda h: bed.host(h).ip, run_on)
    print(f"members without credentials: {asked}")
    assert not silent, f"nothing answered: {silent}"  # every service of this bed listens where the table says
    assert {what.split(" on ")[0] for what in asked} == {
        "the entrance (the fleet's API)", "each pod's vLLM API", "node_exporter", "the DCGM exporter (Docker-published)",
        "Prometheus"}, asked


def test_verify_moves_every_pods_generated_tokens(bed: Bed) -> None:
    def generated() -> dict[str, float]:
        return {r["metric"]["host"]: float(r["value"][1]) for r in query(bed, "sum by (host) (vllm:generation_tokens_total)")}

    before = wait_for(lambda: generated() if len(generated()) == 2 else None, 30, "both pods' token counters")
    proc = subprocess.run([sys.executable, "-m", "rigup", "verify"], cwd=REPO_ROOT, env=bed.env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    after = wait_for(lambda: (g := generated()) and all(g[h] > before[h] for h in before) and g, 3 * SCRAPE_S + 10,
                     "vllm:generation_tokens_total to rise on both pods")
    assert set(after) == {"rig-01", "rig-02"}
    ttft = query(bed, "sum by (host) (vllm:time_to_first_token_seconds_count)")
    assert all(float(r["value"][1]) > 0 for r in ttft) and len(ttft) == 2


def test_top_logs_in_to_the_prometheus_it_is_named(bed: Bed) -> None:
    """`rigup top --prometheus URL` asks the monitor as the fleet's own commands do: with the metrics login and the
    fleet CA's certificate the converge left beside the fleet file (Prometheus asks who is calling: without them
    every query is refused, and top had no row)."""
    url = f"https://{bed.host('gw-01').ip}:9090"
    proc = subprocess.run([sys.executable, "-m", "rigup", "top", "--json", "--interval", "1", "--prometheus", url],
                          cwd=REPO_ROOT, env=bed.env(), capture_output=True, text=True, timeout=120)
    assert proc.stdout, proc.stderr
    frame = json.loads(proc.stdout)
    assert frame["source"] == f"Prometheus {url}", frame
    assert {(p["host"], p["pod"]) for p in frame["pods"]} == {("rig-01", VARIANT), ("rig-02", VARIANT)}, frame
    assert not [note for note in frame["notes"] if "401" in note or "refused" in note], frame["notes"]


def test_every_dashboard_panel_query_returns_data(bed: Bed) -> None:
    # Grafana cannot be installed here (no package reachable): its panels' queries run against the real
    # Prometheus instead. One request through the gateway first, so its per-route series exist.
    reply = requests.post(f"{entrance_url(bed.host('gw-01').ip)}/v1/chat/completions", verify=fleet_ca_file(bed.fleet),
                          headers={"Authorization": f"Bearer {GATEWAY_KEY}"}, timeout=60,
                          json={"model": served_name(VARIANT), "max_tokens": 8,
                                "messages": [{"role": "user", "content": "Say hello."}]})
    assert reply.status_code == 200, reply.text
    empty: list[str] = []

    def all_answer() -> bool:
        empty[:] = [p.title for p in panels() if not query(bed, p.expr)]
        return not empty

    try:
        wait_for(all_answer, 4 * SCRAPE_S + 30, "every panel's query to return data")
    except AssertionError:
        raise AssertionError(f"panels whose query returns nothing: {empty}") from None


def test_a_stopped_pod_fires_pod_down_within_its_window_and_clears(bed: Bed) -> None:
    rig2 = bed.host("rig-02")

    def firing() -> list[dict[str, Any]]:
        return [a for a in prometheus(bed, "/api/v1/alerts")["alerts"]
                if a["labels"]["alertname"] == "RigupPodDown" and a["state"] == "firing"]

    sh(rig2, f"systemctl stop rigup-{VARIANT}.service")
    stopped = time.monotonic()
    try:
        alerts = wait_for(firing, POD_DOWN_FOR_S + 3 * SCRAPE_S + 15, "RigupPodDown to fire")
        took = time.monotonic() - stopped
        assert POD_DOWN_FOR_S <= took, f"fired after {took:.0f} s, before its for: window"
        assert [(a["labels"]["host"], a["labels"]["pod"]) for a in alerts] == [("rig-02", VARIANT)]
        assert "does not answer /metrics" in alerts[0]["annotations"]["summary"]
    finally:
        sh(rig2, f"systemctl start rigup-{VARIANT}.service")
    wait_for(lambda: not firing(), 120, "RigupPodDown to clear once the pod serves again")


def test_alertmanager_asks_who_is_calling_and_prometheus_sends_it_alerts_with_its_login(bed: Bed) -> None:
    """Alertmanager (on the monitor's loopback) asks for TLS and the login as Prometheus does; Prometheus sent it
    RigupPodDown (above) with them and no notification failed; its HA gossip listener (0.0.0.0:9094 by default)
    is off (issue 42)."""
    gw = bed.host("gw-01")
    ask = "curl -s -o /dev/null -w '%{http_code}' -m 5 --cacert /etc/prometheus/rigup-web/fleet-ca.crt"
    assert sh(gw, f"{ask} https://127.0.0.1:9093/-/ready") == "401"
    assert sh(gw, "curl -s -o /dev/null -w '%{http_code}' -m 5 http://127.0.0.1:9093/-/ready", check=False) == "400"

    def count(metric: str) -> float:
        return sum(float(r["value"][1]) for r in query(bed, f'{metric}{{job="prometheus"}}'))

    def max_of(metric: str) -> float:
        return max(float(r["value"][1]) for r in query(bed, f'{metric}{{job="prometheus"}}'))

    wait_for(lambda: count("prometheus_notifications_sent_total") > 0, 3 * SCRAPE_S + 10, "Prometheus to have sent alerts")
    assert count("prometheus_notifications_errors_total") == 0 and count("prometheus_notifications_dropped_total") == 0
    # one Alertmanager per Prometheus (max: the gauge of each of Prometheus' own series, however it is scraped)
    assert max_of("prometheus_notifications_alertmanagers_discovered") == 1
    assert "9094" not in sh(gw, "ss -Hltnu")


def test_a_variant_switch_moves_the_target_at_that_converge(bed: Bed) -> None:
    bed.group_data = {**bed.group_data, "lab": {"variant": OTHER_VARIANT}}
    bed.write()
    bed.deploy("--limit", "rig-02", "--limit", "gw-01")
    other = served_name(OTHER_VARIANT)

    def moved() -> bool:
        pods = {t["labels"]["host"]: t["labels"] for t in targets(bed) if t["labels"]["job"] == "vllm"}
        return pods.get("rig-02", {}).get("model") == other and pods.get("rig-01", {}).get("model") == served_name(VARIANT)

    # file_sd: Prometheus re-reads the targets file on change, no reload
    wait_for(moved, 30, f"rig-02's target to name {other}")
    wait_for(lambda: query(bed, f'up{{job="vllm", host="rig-02", model="{other}"}} == 1'), 60, "the new pod up")


def test_a_converged_rerun_changes_nothing(bed: Bed) -> None:
    result = bed.deploy_json()
    changed = {op["name"]: op["success"] for op in result["results"]["operations"] if op["success"]}
    assert changed == {}, f"operations that changed on a converged re-run: {changed}"
    proc = bed.deploy()  # what a converged re-run sends each host, the monitor's certificates and web configs included
    counts = remote_commands(proc.stdout + proc.stderr)
    print(f"remote commands of a converged re-run: {counts}")
    assert max(counts.values()) <= 2, counts


def test_no_key_in_the_scrape_config_and_the_key_files_are_the_prometheus_users(bed: Bed) -> None:
    gw = bed.host("gw-01")
    config = sh(gw, "cat /etc/prometheus/prometheus.yml /etc/prometheus/rigup-targets/*.json")
    assert GATEWAY_KEY not in config and API_KEY not in config
    assert sh(gw, "stat -c '%a %U:%G' /etc/prometheus/rigup-keys/gateway-gw-01.key") == "600 prometheus:prometheus"
    assert sh(gw, "stat -c '%a %U:%G' /etc/prometheus/rigup-keys") == "750 root:prometheus"
    assert GATEWAY_KEY not in sh(gw, "ps -eo args")


def test_the_metrics_password_is_in_no_argv_journal_or_file_others_can_read(bed: Bed) -> None:
    """The metrics login's password (node_exporter, the DCGM exporter, Prometheus and Alertmanager ask it) is on no
    host's process list or journal, and every file holding it is its service's alone (issue 42). The search reads
    the password on its stdin, so it is never on a command line here either."""
    password = (bed.fleet.parent / "fleet-ca" / "metrics.password").read_text().strip()
    holders: dict[str, list[str]] = {}
    for name in ("gw-01", "rig-01", "rig-02"):
        host = bed.host(name)
        assert password not in sh(host, "ps -eo args"), name
        assert password not in host.ssh("sudo -n journalctl --no-pager -q -o cat", timeout=120).stdout, name
        found = subprocess.run([*host.ssh_argv(), "sudo -n grep -rlsF -D skip -f /dev/stdin /etc /opt /run /tmp /var/log /root "
                                "/var/lib/prometheus || true"], input=password + "\n", capture_output=True, text=True,
                               timeout=300)
        holders[name] = found.stdout.split()
        for path in holders[name]:
            mode, owner = sh(host, f"stat -c '%a %U' {path}").split()
            assert int(mode, 8) & 0o077 == 0, f"{name}:{path} is {mode} {owner}: others can read the metrics password"
    print(f"files holding the metrics password: {holders}")
    assert "/etc/prometheus/rigup-web/metrics.password" in holders["gw-01"] and not holders["rig-01"] + holders["rig-02"]
