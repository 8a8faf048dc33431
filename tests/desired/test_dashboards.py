"""Grafana's provisioning files and rigup's fleet overview: valid JSON/YAML in Grafana's shapes, and every
panel's PromQL parsed by the real promtool (as recording rules). tests/e2e/test_monitoring.py runs every
query against the test bed's real Prometheus."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from rigup.desired.dashboards import (
    DASHBOARDS_DIR,
    DATASOURCE_UID,
    ROWS,
    DashboardError,
    dashboards_provider_text,
    datasource_text,
    image_vllm_ref,
    overview_text,
    panels,
    port_dropin_text,
    provisioned_vllm_dashboard,
    served_vllm_refs,
    vllm_dashboards,
)
from rigup.desired.fleet import load_fleet
from rigup.desired.fleet_plan import fleet_entries, plan_fleet
from rigup.desired.knobs import load_defaults
from rigup.desired.metrics_auth import METRICS_USER, MetricsCredentials
from rigup.desired.needs import dashboard_needs
from rigup.desired.upstream import GitCache
from rigup_testbed import debarchive


def test_the_overview_is_grafana_dashboard_json_with_one_query_per_panel() -> None:
    dashboard = json.loads(overview_text())
    assert dashboard["uid"] == "rigup-fleet" and dashboard["schemaVersion"] == 39
    graphs = [p for p in dashboard["panels"] if p["type"] == "timeseries"]
    assert [p["targets"][0]["expr"] for p in graphs] == [p.expr for p in panels()]
    assert all(p["datasource"]["uid"] == DATASOURCE_UID for p in graphs)
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    # no two panels overlap on Grafana's 24-column grid
    cells = set()
    for p in dashboard["panels"]:
        g = p["gridPos"]
        area = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & area, p["title"]
        cells |= area
    titles = " ".join(p["title"] for p in graphs)
    for wanted in ("tokens/s", "Time to first token p95", "KV cache", "Requests waiting", "GPU temperature",
                   "GPU power draw", "Gateway routes", "Rollbacks"):
        assert wanted in titles


def test_every_panel_query_is_promql_promtool_parses(tmp_path: Path) -> None:
    rules = {"groups": [{"name": "panels", "rules": [{"record": f"rigup:panel_{i}", "expr": p.expr}
                                                     for i, p in enumerate(panels())]}]}
    path = tmp_path / "panels.yml"
    path.write_text(yaml.safe_dump(rules))
    checked = subprocess.run([str(debarchive.promtool()), "check", "rules", str(path)], capture_output=True, text=True,
                             timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(panels())} rules found" in checked.stdout


def test_provisioning_files() -> None:
    login = MetricsCredentials(METRICS_USER, "pw-of-the-fleet", "$2b$10$hash")
    source = yaml.safe_load(datasource_text("https://127.0.0.1:9090", login, "-----BEGIN CERTIFICATE-----\n"))["datasources"][0]
    assert (source["type"], source["url"], source["uid"], source["isDefault"]) == (
        "prometheus", "https://127.0.0.1:9090", DATASOURCE_UID, True)
    # Prometheus asks who is calling: Grafana presents the login and trusts the fleet CA (the file is 0600 grafana)
    assert (source["basicAuth"], source["basicAuthUser"], source["jsonData"]) == (True, METRICS_USER, {"tlsAuthWithCACert": True})
    assert source["secureJsonData"] == {"basicAuthPassword": "pw-of-the-fleet", "tlsCACert": "-----BEGIN CERTIFICATE-----\n"}
    provider = yaml.safe_load(dashboards_provider_text())["providers"][0]
    assert provider["type"] == "file" and provider["options"] == {"path": DASHBOARDS_DIR}
    assert "Environment=GF_SERVER_HTTP_PORT=3001" in port_dropin_text(3001)


# --- vLLM's official dashboards ------------------------------------------------------------------------------

NIGHTLY = "7a1eb8ac2ec4ea69338c51dc7afd4b15010abfa8"
GRAFANA_DIR = "examples/observability/dashboards/grafana"


def test_an_images_vllm_version_comes_from_its_tag() -> None:
    assert image_vllm_ref("vllm/vllm-openai", "v0.27.1") == "v0.27.1"
    assert image_vllm_ref("vllm/vllm-openai", f"nightly-{NIGHTLY}") == NIGHTLY
    assert image_vllm_ref("vllm/vllm-openai", "gemma4-unified") is None  # a named build: no version in its tag
    assert image_vllm_ref("vllm/vllm-openai", "nightly") is None  # a moving tag names no commit
    assert image_vllm_ref("vllm/vllm-omni", "v0.20.0") is None  # vLLM-Omni's own version, not vLLM's
    assert image_vllm_ref("lmcache/vllm-openai", "v0.4.7-cu129") is None


def _fleet(*hosts: tuple[str, dict, list[str]]) -> list[tuple[str, dict, list[str]]]:
    return [(name, {**load_defaults(), **data}, groups) for name, data, groups in hosts]


def test_the_fleet_served_versions_name_their_pods_and_note_the_unknown() -> None:
    fleet = _fleet(
        ("rig-a", {"variant": "dual"}, ["rigs"]),
        ("rig-b", {"pods": [{"name": "left", "variant": "qwen-dual-fp8-mtp", "gpus": [0, 1]},
                            {"name": "right", "variant": "gemma12b-single-qat-w4a16-mtp", "gpus": [2]}]}, ["rigs"]),
        ("gw", {"serves_variant": False}, ["gateway"]),
    )
    refs, notes = served_vllm_refs(fleet)
    assert refs == {NIGHTLY: ["rig-a/dual"], "v0.27.1": ["rig-b/left"]}
    assert notes == ["rig-b/right: image vllm/vllm-openai:gemma4-unified names no vLLM version; no vLLM dashboards for it"]


def test_a_grafana_monitor_host_needs_vllm_at_each_served_version_and_nothing_else_does() -> None:
    fleet = _fleet(
        ("rig-a", {"variant": "dual"}, ["rigs"]),
        ("rig-b", {"variant": "qwen-dual-fp8-mtp"}, ["rigs"]),
        ("gw", {"serves_variant": False, "grafana": True}, ["gateway"]),
    )
    _, gw, groups = fleet[2]
    needs = dashboard_needs(gw, groups, fleet)
    assert [(n.name, n.url, n.ref) for n in needs] == [
        (f"git:vllm@{NIGHTLY}", "https://github.com/vllm-project/vllm.git", NIGHTLY),
        ("git:vllm@v0.27.1", "https://github.com/vllm-project/vllm.git", "v0.27.1"),
    ]
    assert dashboard_needs({**gw, "grafana": False}, groups, fleet) == []  # no Grafana, no dashboards
    assert dashboard_needs(fleet[0][1], ["rigs"], fleet) == []  # not a monitor host


def test_fleet_needs_pin_vllm_for_a_gateway_only_monitor_host(tmp_path: Path) -> None:
    fleet = tmp_path / "rigs.yaml"
    fleet.write_text(
        "groups:\n  rigs:\n    hosts:\n"
        "      rig-01: {ssh_hostname: 10.0.0.11, variant: qwen-dual-fp8-mtp}\n"
        "  gateway:\n    hosts:\n"
        "      gw-01: {ssh_hostname: 10.0.0.10, serves_variant: false, grafana: true}\n"
    )
    needs, _ = plan_fleet(fleet_entries(load_fleet(fleet))).lock_needs()
    assert needs["git:vllm@v0.27.1"].ref == "v0.27.1"
    assert not [name for name in needs if name.startswith("git:vllm@") and name != "git:vllm@v0.27.1"]


def _board(uid: str = "vllm-overview", **extra: object) -> str:
    return json.dumps({"id": 7, "uid": uid, "title": "vLLM / Overview", "tags": ["vllm"], "schemaVersion": 39,
                       "panels": [{"type": "timeseries", "targets": [{"expr": "vllm:num_requests_running"}]}],
                       **extra})


def test_a_provisioned_vllm_dashboard_is_unique_to_its_version() -> None:
    release = json.loads(provisioned_vllm_dashboard(_board(), "v0.27.1", "vllm_overview.json"))
    nightly = json.loads(provisioned_vllm_dashboard(_board(), NIGHTLY, "vllm_overview.json"))
    assert release["uid"] == "vllm-overview-v0-27-1" and nightly["uid"] == f"vllm-overview-{NIGHTLY[:12]}"
    assert release["title"] == "vLLM / Overview (vLLM v0.27.1)" and "id" not in release
    assert release["tags"] == ["vllm", "vllm-v0.27.1"]
    assert release["panels"] == json.loads(_board())["panels"]  # the panels are vLLM's, untouched
    long = json.loads(provisioned_vllm_dashboard(_board("x" * 40), NIGHTLY, "a.json"))
    assert len(long["uid"]) == 40 and long["uid"].endswith(NIGHTLY[:12])  # Grafana's limit


def test_a_dashboard_exported_for_import_is_pointed_at_rigups_datasource() -> None:
    exported = _board(__inputs=[{"name": "DS_PROMETHEUS", "type": "datasource"}],
                      templating={"list": [{"datasource": "${DS_PROMETHEUS}"}]})
    provisioned = json.loads(provisioned_vllm_dashboard(exported, "v0.27.1", "grafana.json"))
    assert "__inputs" not in provisioned and provisioned["templating"]["list"][0]["datasource"] == DATASOURCE_UID


def test_a_file_that_is_not_a_dashboard_is_refused_naming_it() -> None:
    with pytest.raises(DashboardError, match=r"vLLM v0.27.1: broken.json is not JSON"):
        provisioned_vllm_dashboard("{", "v0.27.1", "broken.json")
    with pytest.raises(DashboardError, match=r"no panels list"):
        provisioned_vllm_dashboard('{"title": "x"}', "v0.27.1", "x.json")


def _git(cwd: Path, *args: str) -> str:
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t",
           "HOME": str(cwd), "PATH": "/usr/bin:/bin"}
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True).stdout.strip()


def test_vllm_dashboards_are_read_at_the_locked_commit_of_each_version(tmp_path: Path) -> None:
    """Through the control machine's git cache (a shallow, blob-less fetch of the one commit), from a
    repository laid out as vLLM's: a version without the directory gets a note, not an error."""
    repo = tmp_path / "vllm"
    repo.mkdir()
    _git(repo, "init", "-q", "-b", "main")
    (repo / "README.md").write_text("old\n")
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "before the dashboards")
    _git(repo, "tag", "v0.22.0")
    old = _git(repo, "rev-parse", "HEAD")
    boards = repo / GRAFANA_DIR
    boards.mkdir(parents=True)
    (boards / "vllm_overview.json").write_text(_board())
    (boards / "vllm_kv_cache.json").write_text(_board("vllm-kv-cache"))
    (boards / "README.md").write_text("not a dashboard\n")
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "dashboards")
    _git(repo, "tag", "v0.27.1")
    new = _git(repo, "rev-parse", "HEAD")
    (boards / "vllm_overview.json").write_text(_board("moved-on"))  # after the tag: must not be read
    _git(repo, "commit", "-qam", "later")

    cache = GitCache(tmp_path / "cache")
    got, notes = vllm_dashboards({"v0.27.1": new, "v0.22.0": old}, cache, f"file://{repo}", GRAFANA_DIR)
    assert [(b.ref, b.file, b.dest) for b in got] == [
        ("v0.27.1", "vllm_kv_cache.json", "/var/lib/grafana/dashboards/vllm/v0-27-1/vllm_kv_cache.json"),
        ("v0.27.1", "vllm_overview.json", "/var/lib/grafana/dashboards/vllm/v0-27-1/vllm_overview.json"),
    ]
    assert json.loads(got[1].text)["uid"] == "vllm-overview-v0-27-1"
    assert notes == [f"vLLM v0.22.0 has no dashboards under {GRAFANA_DIR}"]
    provider = yaml.safe_load(dashboards_provider_text(b.ref for b in got))["providers"]
    assert [(p["folder"], p["options"]["path"]) for p in provider] == [
        ("rigup", DASHBOARDS_DIR), ("vLLM v0.27.1", "/var/lib/grafana/dashboards/vllm/v0-27-1")]


# --- the overview's gateway route panel ----------------------------------------------------------------------


def test_the_route_panel_follows_each_routes_health_in_its_router(tmp_path: Path) -> None:
    # The series of the alert rules' route case: rig-1's pod is out of its router's rotation from minute 5 to 12
    # and back from 13; rig-2's serves throughout. The panel says 1 while it is out, as RigupGatewayRouteUnhealthy.
    from tests.desired.test_alert_rules import CASES, RIG1, RIG2

    (panel,) = [p for p in panels() if p.title.startswith("Gateway routes")]
    inputs, _ = CASES["RigupGatewayRouteUnhealthy"]
    rig1, rig2 = (f'{{host="gw", api_base="{base}/v1", requested_model="qwen"}}' for _, base in (RIG1, RIG2))

    def at(minute: str, rig1_value: int) -> dict[str, object]:
        return {"expr": panel.expr, "eval_time": minute,
                "exp_samples": [{"labels": rig1, "value": rig1_value}, {"labels": rig2, "value": 0}]}

    spec = tmp_path / "panel.test.yml"
    spec.write_text(yaml.safe_dump({"rule_files": [], "evaluation_interval": "1m", "tests": [
        {"interval": "1m", "input_series": inputs,
         "promql_expr_test": [at("4m", 0), at("7m", 1), at("12m", 1), at("15m", 0), at("40m", 0)]}]},
        sort_keys=False))
    result = subprocess.run([str(debarchive.promtool()), "test", "rules", spec.name], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_entrance_client_panels_show_each_clients_requests_and_tokens(tmp_path: Path) -> None:
    """The "Entrance clients" row over what rigup-entrance-usage serves: promtool evaluates each panel's query on
    ten minutes of the exporter's own exposition (rigup.rig.entrance_usage.Usage fed nginx's usage log lines), two
    clients, alice on two models and rate-limited now and then, bob on one."""
    from rigup.rig.entrance_usage import Usage

    minute = Usage()  # one minute's lines; the series grow by this much each minute
    for model in ("qwen-a", "qwen-b"):
        for _ in range(60):
            minute.count(json.dumps({"client": "alice", "model": model, "status": "200",
                                     "prompt_tokens": "50", "completion_tokens": "10"}))
    for _ in range(60):
        minute.count(json.dumps({"client": "alice", "model": "qwen-a", "status": "429",
                                 "prompt_tokens": "", "completion_tokens": ""}))
        minute.count(json.dumps({"client": "bob", "model": "qwen-a", "status": "200",
                                 "prompt_tokens": "60", "completion_tokens": "90"}))
    inputs = [{"series": series, "values": f"0+{value}x10"}
              for series, value in (line.rsplit(" ", 1) for line in minute.exposition().splitlines()
                                    if not line.startswith("#"))]
    by_title = {p.title: p for p in panels()}
    row = dict(ROWS)["Entrance clients"]
    assert [p.title for p in row] == ["Requests/s per client", "Prompt tokens/s per client (in)",
                                      "Completion tokens/s per client (out)"]
    expected = {  # per second: the minute's counts over 60 s
        "Requests/s per client": [('{client="alice", code="200"}', 2), ('{client="alice", code="429"}', 1),
                                  ('{client="bob", code="200"}', 1)],
        "Prompt tokens/s per client (in)": [('{client="alice"}', 100), ('{client="bob"}', 60)],
        "Completion tokens/s per client (out)": [('{client="alice"}', 20), ('{client="bob"}', 90)],
    }
    # rounded to whole numbers: rate()'s extrapolation leaves float noise (60.000000000000014) promtool compares exactly
    checks = [{"expr": f"round({by_title[title].expr})", "eval_time": "10m",
               "exp_samples": [{"labels": labels, "value": value} for labels, value in samples]}
              for title, samples in expected.items()]
    spec = tmp_path / "panels.test.yml"
    spec.write_text(yaml.safe_dump({"evaluation_interval": "1m", "tests": [
        {"name": "entrance clients", "interval": "1m", "input_series": inputs, "promql_expr_test": checks}]},
        sort_keys=False))
    result = subprocess.run([str(debarchive.promtool()), "test", "rules", spec.name], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert all(by_title[t].legend.startswith("{{client}}") for t in expected)
    assert "{{client}} {{code}}" == by_title["Requests/s per client"].legend
