"""Grafana's provisioning files and rigup's fleet overview: valid JSON/YAML in Grafana's shapes, and every
panel's PromQL parsed by the real promtool (as recording rules). tests/e2e/test_monitoring.py runs every
query against the test bed's real Prometheus."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import yaml

from rigup.desired.dashboards import (
    DASHBOARDS_DIR,
    DATASOURCE_UID,
    dashboards_provider_text,
    datasource_text,
    overview_text,
    panels,
    port_dropin_text,
)
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
    source = yaml.safe_load(datasource_text("http://127.0.0.1:9090"))["datasources"][0]
    assert (source["type"], source["url"], source["uid"], source["isDefault"]) == (
        "prometheus", "http://127.0.0.1:9090", DATASOURCE_UID, True)
    provider = yaml.safe_load(dashboards_provider_text())["providers"][0]
    assert provider["type"] == "file" and provider["options"] == {"path": DASHBOARDS_DIR}
    assert "Environment=GF_SERVER_HTTP_PORT=3001" in port_dropin_text(3001)
