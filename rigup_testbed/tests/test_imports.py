"""The test bed's shape: no import cycle among its modules, so each part loads (and is tested) alone."""

from __future__ import annotations

from tests.test_layout import ROOT, cycles, import_graph

TESTBED = ROOT / "rigup_testbed"


def test_no_import_cycle_among_testbed_modules() -> None:
    graph = import_graph(TESTBED)
    assert {"rigup_testbed.fleet", "rigup_testbed.hub", "rigup_testbed.tests.test_parts"} <= graph.keys()
    # function-level imports count: one deferred to call time still makes the modules need each other
    assert cycles(graph) == []
