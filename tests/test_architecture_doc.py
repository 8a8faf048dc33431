"""docs/architecture.md's table of layers says what tests/test_layout.py enforces: each rank's rooms and what
each may import, so the map cannot drift from the rules."""

from __future__ import annotations

import re
from pathlib import Path

from tests.test_layout import LAYERS, RANK, modules

DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"
TABLE = re.compile(r"<!-- layers:begin.*?-->\n(.*?)<!-- layers:end -->", re.S)


def layer_rows(text: str) -> dict[int, tuple[set[str], set[str] | None]]:
    """Rank -> (its rooms, the rooms it may import; None for "every room"), from the table's rows."""
    match = TABLE.search(text)
    assert match, "docs/architecture.md has no layers table between its markers"
    rows: dict[int, tuple[set[str], set[str] | None]] = {}
    for line in match.group(1).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].isdigit():
            continue
        rooms = set(re.findall(r"`([^`]+)`", cells[1]))
        may = None if cells[2] == "every room" else set(re.findall(r"`([^`]+)`", cells[2].split("(")[0]))
        rows[int(cells[0])] = (rooms, may)
    return rows


def test_the_row_reader_reads_rooms_and_imports() -> None:
    text = ("<!-- layers:begin -->\n| Rank | Room | May import |\n|---|---|---|\n"
            "| 0 | `rigup` (root), `rig` | nothing (`rig`: stdlib) |\n| 1 | `parsers` | `rigup`, `rig` |\n"
            "| 2 | `__main__` | every room |\n<!-- layers:end -->\n")
    assert layer_rows(text) == {0: ({"rigup", "rig"}, set()), 1: ({"parsers"}, {"rigup", "rig"}), 2: ({"__main__"}, None)}


def test_the_architecture_pages_layers_are_the_layout_tests_layers() -> None:
    rows = layer_rows(DOC.read_text())
    assert sorted(rows) == list(range(len(LAYERS))), f"one row per rank of LAYERS: {sorted(rows)}"
    for rank, layers in enumerate(LAYERS):
        rooms, may = rows[rank]
        assert rooms == set(layers), f"rank {rank}: the page names {sorted(rooms)}, LAYERS {sorted(layers)}"
        below = {layer for layer, r in RANK.items() if r < rank}
        if may is not None:
            assert may == below, f"rank {rank}: the page lets it import {sorted(may)}, the layout test {sorted(below)}"
        else:
            assert rank == len(LAYERS) - 1, "only the top rank may import every room"


def test_every_room_of_the_package_is_on_the_map() -> None:
    text = DOC.read_text()
    rooms = {name.split(".")[1] for name in modules() if name.count(".") >= 1} - {"__main__"}
    missing = sorted(room for room in rooms if f"rigup/{room}" not in text)
    assert not missing, f"docs/architecture.md's folder table lacks {missing}"
