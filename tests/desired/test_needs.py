"""The lock file is data below every feature, and what a host needs pinned is collected above them
(rigup.desired.needs): so a feature can type the lock without the lock importing the feature back."""

from __future__ import annotations

from tests.test_layout import rigup_graph


def test_the_lock_imports_no_feature() -> None:
    graph = rigup_graph()
    assert graph["rigup.desired.lock"] <= {"rigup", "rigup.desired.fleet_file", "rigup.desired.knobs"}
    # the collector asks the features what they need: the recipe's image, sources and models (through the
    # recipe it is given), the GPU exporter (monitoring) and the vLLM dashboards (dashboards)
    assert {"rigup.desired.lock", "rigup.desired.monitoring", "rigup.desired.dashboards"} <= graph["rigup.desired.needs"]
    importers = {name for name, imported in graph.items() if "rigup.desired.needs" in imported}
    assert "rigup.desired.lock" not in importers and "rigup.desired.plan" in importers
