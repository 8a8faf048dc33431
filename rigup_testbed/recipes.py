"""The test bed's upstream recipe repositories: fixture trees shaped like club-3090 and qwen36-dual-3090.

`rigup_testbed/upstream/<repository>/<snapshot>/` holds, at upstream's own paths, compose files written
for the test bed after each upstream layout (rigup_testbed/upstream/README.md says which commit each
models) and the files they mount. gitremotes.py commits each snapshot to the stand-in remote; the unit
tests read the same trees directly (`working_trees()`), so both see the same recipes.
"""

from __future__ import annotations

from pathlib import Path

from rigup.desired.upstream import WorkingTrees

UPSTREAM_DIR = Path(__file__).with_name("upstream")

# catalog source -> (stand-in repository, snapshot tree under UPSTREAM_DIR), oldest commit first per repo
SNAPSHOTS: dict[str, tuple[str, str]] = {
    "club3090-spring": ("noonghunna/club-3090", "club-3090/spring"),
    "club3090-may": ("noonghunna/club-3090", "club-3090/may"),
    "club3090": ("noonghunna/club-3090", "club-3090/aug"),
    "qwen36-dual-3090": ("noonghunna/qwen36-dual-3090", "qwen36-dual-3090/frozen"),
}


def tree(source: str) -> Path:
    return UPSTREAM_DIR / SNAPSHOTS[source][1]


def tree_files(source: str) -> dict[str, str]:
    """Repository path -> text of every file in a snapshot tree."""
    root = tree(source)
    return {
        str(p.relative_to(root)): p.read_text()
        for p in sorted(root.rglob("*"))
        # an installed wheel (or a test's py_compile) leaves bytecode next to the fixture sources
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    }


def working_trees() -> WorkingTrees:
    """A reader of the fixture trees for every upstream source (what the unit tests render from)."""
    return WorkingTrees({source: tree(source) for source in SNAPSHOTS})
