"""The package's shape: its layers import only downwards, no import cycle among rigup's modules,
product code never imports the tests, and the scripts uploaded to rigs use the standard library only."""

from __future__ import annotations

import ast
import importlib
import re
import sys
from pathlib import Path

from pyinfra.api import FactBase

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "rigup"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(package: Path = PACKAGE) -> dict[str, Path]:
    """The package's importable modules: files whose directories are packages (__init__.py) up to its
    root; scripts beside them that import their siblings by bare name (rigup_testbed/standins) are not."""
    return {
        module_name(p): p
        for p in package.rglob("*.py")
        if all((d / "__init__.py").is_file() for d in p.parents if d.is_relative_to(package))
    }


def imported_from(node: ast.ImportFrom, importer: str | None) -> str | None:
    """The module a `from ... import` names: a relative one (`from .manifest import x`, the rigfetch package's
    way: its name on a rig is another) resolved against `importer`, the importing module's package."""
    if node.level == 0:
        return node.module
    if importer is None:
        return None
    parts = importer.split(".")
    base = parts[: len(parts) - (node.level - 1)]  # `.` is the package itself, each further dot its parent
    return ".".join(base + ([node.module] if node.module else []))


def package_of(path: Path) -> str:
    """The package a module's relative imports start from: itself for an __init__.py, else its parent."""
    name = module_name(path)
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def imported(path: Path, known: set[str]) -> set[str]:
    """Every module `path` imports, at any depth of the file (function-level imports count too)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and (module := imported_from(node, package_of(path))):
            out.add(module)
            # `from rigup.rig import servingctl` imports the submodule too
            out.update(f"{module}.{a.name}" for a in node.names if f"{module}.{a.name}" in known)
    return out


def import_graph(package: Path) -> dict[str, set[str]]:
    """Each module of `package` -> the package's modules it imports (for cycles(); tests of other packages use it)."""
    mods = modules(package)
    known = set(mods)
    return {name: {m for m in imported(path, known) if m in known and m != name} for name, path in mods.items()}


def rigup_graph() -> dict[str, set[str]]:
    return import_graph(PACKAGE)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_among_rigup_modules() -> None:
    graph = rigup_graph()
    assert len(graph) > 40  # the walk sees the whole package
    # A package's __init__ importing its own submodules is how Python packages work, not a cycle of
    # design; none of rigup's __init__ files does it, so the check is strict.
    assert cycles(graph) == []


def test_product_code_never_imports_the_tests_benchmarks_or_test_bed() -> None:
    """The test bed sits above the product: `rigup sandbox` is its module, which rigup's CLI imports by name."""
    known = set(modules())
    for name, path in modules().items():
        bad = {m for m in imported(path, known) if m.split(".")[0] in {"tests", "bench", "rigup_testbed"}}
        assert not bad, f"{name} imports {sorted(bad)}"


def test_rig_scripts_use_the_standard_library_only() -> None:
    known = set(modules())
    for path in (PACKAGE / "rig").rglob("*.py"):
        if path.parent == PACKAGE / "rig" and path.name in ("__init__.py", "onefile.py"):
            continue  # the control machine's: the scripts' paths, and the zipapp's build
        own = {m for m in imported(path, known) if m.startswith("rigup.rig.rigfetch")}  # the package's own modules
        outside = {m for m in imported(path, known) - own if m.split(".")[0] not in sys.stdlib_module_names}
        assert not outside, f"{path.name} imports {sorted(outside)}: rigs run it with a bare python3"


# rigup's layers, lowest first. A module may import its own layer and any lower one, never a higher
# one or another of its own rank (function-level imports count); every module belongs to a layer.
LAYERS: tuple[frozenset[str], ...] = (
    frozenset({"rigup", "rig"}),  # the package root (where the deploy and user files live); rig-side scripts
    frozenset({"parsers", "layout"}),  # pure parsers of what a tool prints on a rig; where things live on a rig
    frozenset({"desired", "facts"}),  # what the control machine decides (host_plan); what a rig reports
    frozenset({"client"}),  # the control machine's SSH and OpenAI-API connections to rigs
    frozenset({"checks", "pyinfra_patches"}),  # facts and replies judged against the plan; pyinfra's speed-ups
    frozenset({"runstate"}),  # what one task file decides and a later one reads
    frozenset({"operations"}),  # pyinfra operations that close the gaps
    frozenset({"cli"}),  # `python -m rigup <command>`
    frozenset({"__main__"}),
)
RANK = {layer: rank for rank, layers in enumerate(LAYERS) for layer in layers}
# (importer, imported) pairs allowed against the order, each with why; none is needed today.
EXCEPTIONS: dict[tuple[str, str], str] = {}


def layer_of(module: str) -> str:
    """rigup.facts.gpu -> facts, rigup.runstate -> runstate, rigup -> rigup."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Each import of a higher layer, or of another layer of the same rank, as "importer (layer) imports
    imported (layer)"."""
    found = []
    for name, deps in sorted(graph.items()):
        layer = layer_of(name)
        for dep in sorted(deps):
            dep_layer = layer_of(dep)
            if dep_layer != layer and RANK[dep_layer] >= RANK[layer] and (name, dep) not in EXCEPTIONS:
                found.append(f"{name} ({layer}) imports {dep} ({dep_layer})")
    return found


def test_the_layer_check_finds_an_upward_import() -> None:
    graph = {
        "rigup.facts.gpu": {"rigup.checks.fit", "rigup.parsers.nvidia_smi"},
        "rigup.desired.plan": {"rigup.facts.gpu"},
        "rigup.checks.fit": {"rigup.checks.driver_plan", "rigup.desired.recipe"},
    }
    assert upward_imports(graph) == [
        "rigup.desired.plan (desired) imports rigup.facts.gpu (facts)",
        "rigup.facts.gpu (facts) imports rigup.checks.fit (checks)",
    ]


def test_every_module_belongs_to_a_layer() -> None:
    unplaced = sorted({layer_of(name) for name in modules()} - RANK.keys())
    assert not unplaced, f"place {unplaced} in LAYERS"


def test_layers_point_one_way() -> None:
    assert upward_imports(rigup_graph()) == []


def test_checks_read_no_facts() -> None:
    """Checks judge facts already read (rigup.operations.preflight_facts reads preflight's): they may use
    the data types a facts module defines, never a fact itself or get_fact."""
    for name, path in modules().items():
        if layer_of(name) != "checks":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rigup.facts"):
                source = importlib.import_module(node.module)
                read = [a.name for a in node.names
                        if isinstance(getattr(source, a.name, None), type) and issubclass(getattr(source, a.name), FactBase)]
                assert not read, f"{name} imports the facts {read} from {node.module}"
            called = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
            assert called != "get_fact", f"{name} reads facts (get_fact, line {node.lineno})"


# -- private names and function-level imports ------------------------------------------------------


def is_private(name: str) -> bool:
    """`_x` belongs to its module; a dunder (`__version__`) does not."""
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_names_taken(source: str, own: str, known: set[str]) -> list[str]:
    """Each `_`-prefixed name that code of module `own` takes from another module of `known`: imported by
    name (`from rigup.facts.util import _parse`) or reached through an imported module (`util._parse`,
    `rigup.facts.util._parse`)."""
    found: list[str] = []
    bound: dict[str, str] = {}  # a local name -> the module (or, for `import a.b`, the package a) it names
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in {k.split(".")[0] for k in known}:
                    bound[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                if f"{node.module}.{alias.name}" in known:
                    bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                elif node.module in known and node.module != own and is_private(alias.name):
                    found.append(f"line {node.lineno}: from {node.module} import {alias.name}")
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and is_private(node.attr)):
            continue
        chain: list[str] = []
        value: ast.expr = node.value
        while isinstance(value, ast.Attribute):
            chain.append(value.attr)
            value = value.value
        if isinstance(value, ast.Name) and value.id in bound:
            module = ".".join([bound[value.id], *reversed(chain)])
            if module in known and module != own:
                found.append(f"line {node.lineno}: {module}.{node.attr}")
    return found


def function_level_imports(source: str, known: set[str], package: str | None = None) -> list[tuple[int, str]]:
    """(line, module) of each import inside a function, at any depth: `from a.b import c` gives a.b.c where
    that is a module of `known`, else a.b; a relative one resolved against `package`."""
    found: list[tuple[int, str]] = []
    for function in ast.walk(ast.parse(source)):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(function):  # a nested function's imports are seen twice: deduplicated below
            if isinstance(node, ast.Import):
                found.extend((node.lineno, alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and (module := imported_from(node, package)):
                subs = [f"{module}.{a.name}" for a in node.names if f"{module}.{a.name}" in known]
                found.extend((node.lineno, m) for m in subs or [module])
    return sorted(set(found))


def test_the_private_name_check_finds_each_form() -> None:
    known = {"rigup.facts.util", "rigup.facts.gpu"}
    source = (
        "import rigup.facts.util\n"
        "import rigup.facts.util as u\n"
        "from rigup.facts import util\n"
        "from rigup.facts.util import ABSENT, _parse, __doc__\n"
        "rigup.facts.util._guarded, u._absent, util._sections, util.ABSENT, u.__name__\n"
    )
    assert private_names_taken(source, "rigup.facts.gpu", known) == [
        "line 4: from rigup.facts.util import _parse",
        "line 5: rigup.facts.util._guarded",
        "line 5: rigup.facts.util._absent",
        "line 5: rigup.facts.util._sections",
    ]
    assert private_names_taken(source, "rigup.facts.util", known) == []  # its own names


def test_no_module_takes_another_modules_private_names() -> None:
    """A `_` name is its module's own business: what another module needs gets a public name. The test
    bed's and the benchmarks' code count too (tests may use the `_` names of the module they test)."""
    known = set(modules()) | set(modules(ROOT / "rigup_testbed"))
    importers = {name: path for name, path in modules(ROOT / "rigup_testbed").items() if ".tests" not in name}
    importers |= modules() | {f"bench/{p.name}": p for p in (ROOT / "bench").rglob("*.py")}
    taken = {name: found for name, path in importers.items() if (found := private_names_taken(path.read_text(), name, known))}
    assert not taken, taken


# Function-level imports in rigup of its own modules and of other packages (the standard library's too,
# outside the rig scripts), each with why it is not at the top of its module: (importer, imported),
# imported being the rigup module or the top-level name of another package.
DEFERRED_IMPORTS: dict[tuple[str, str], str] = {
    ("rigup.cli.bench", "matplotlib"):
        "about 0.55 s to import, for --plot only; every rigup command imports rigup.cli.bench to build its parser",
    ("rigup.cli.doctor", "rigup.operations.preflight"):
        "brings rigup.runstate (rich) and the pyinfra patches, about 50 ms every rigup command would pay to "
        "build its parser; only doctor's collect() runs it",
    ("rigup.cli.rollout", "pyinfra_cli"): "importing pyinfra_cli monkeypatches the process for gevent (patch_all)",
    ("rigup.cli.rollout", "pyinfra"): "the --worker process imports pyinfra only after pyinfra_cli has patched it",
    ("rigup.rig.rigfetch.cli", "rigup.rig.rigfetch.fetcher"):
        "a fetch's modules (http.client, urllib.request, threads) are most of the start-up of `--check`, which "
        "every converged re-run runs on every rig and which needs none of them",
    ("rigup.rig.rigfetch.cli", "rigup.rig.rigfetch.fleet_server"):
        "http.server and hmac, for a rig that serves fleet peers only",
    ("rigup.cli.top", "rich"):
        "about 55 ms to import (rich.console), for `rigup top` only; every rigup command imports rigup.cli.top "
        "to build its parser",
    ("rigup.desired.pins", "git"):
        "GitPython: about 40 ms to import, for `rigup lock` only; every rigup command imports rigup.desired.pins "
        "(through rigup.cli.lock) to build its parser",
    ("rigup.desired.pins", "huggingface_hub"): "about 145 ms to import, for `rigup lock` only (as git)",
    ("rigup.desired.pins", "httpx2"): "huggingface_hub's HTTP client, for `rigup lock` with a CA bundle only (as huggingface_hub)",
}


def deferred_import_key(importer: str, module: str) -> tuple[str, str]:
    return importer, module if module.split(".")[0] == "rigup" else module.split(".")[0]


def test_the_function_level_import_check_finds_each_form() -> None:
    known = {"rigup.desired.catalog", "rigup.rig", "rigup.rig.servingctl"}
    source = (
        "import json\n"
        "def f():\n"
        "    from rigup.desired.catalog import load_catalog\n"
        "    import yaml\n"
        "    class C:\n"
        "        def g(self):\n"
        "            from rigup.rig import servingctl, SERVINGCTL_SCRIPT\n"
        "def h():\n"
        "    from . import servingctl\n"
        "    from ..desired.catalog import variant_names\n"
    )
    assert function_level_imports(source, known, "rigup.rig") == [
        (3, "rigup.desired.catalog"), (4, "yaml"), (7, "rigup.rig.servingctl"), (9, "rigup.rig.servingctl"),
        (10, "rigup.desired.catalog")]


def test_function_level_imports_are_deliberate() -> None:
    """Imports go at the top of a module, except one listed in DEFERRED_IMPORTS with its reason. The rig
    scripts (rigup/rig) may defer standard library modules their hot paths (`probe`, `--check`, run on
    every converged re-run) do not need; each such import says why beside it."""
    known = set(modules())
    unlisted: list[str] = []
    used: set[tuple[str, str]] = set()
    for name, path in sorted(modules().items()):
        for line, module in function_level_imports(path.read_text(), known, package_of(path)):
            if layer_of(name) == "rig" and module.split(".")[0] in sys.stdlib_module_names:
                continue
            key = deferred_import_key(name, module)
            if key in DEFERRED_IMPORTS:
                used.add(key)
            else:
                unlisted.append(f"{name} line {line}: {module}")
    assert not unlisted, f"move these imports to the top of their modules, or list them in DEFERRED_IMPORTS with why: {unlisted}"
    assert used == DEFERRED_IMPORTS.keys(), f"DEFERRED_IMPORTS lists imports no longer made: {sorted(DEFERRED_IMPORTS.keys() - used)}"


# the role knobs, read in rigup.desired.roles alone: whether a host serves, which groups hold the gateway
# and the monitor, the mirror it pulls through, its share of a cluster. A knob's derived default
# (rigup.desired.knobs.DERIVED_DEFAULTS: monitor_group's is gateway_group's value) is a default, read by
# knob() for every reader, not a role question: role_knob_reads skips that table.
ROLE_KNOBS = ("serves_variant", "gateway_group", "monitor_group", "image_mirror", "cluster")


def host_data(node: ast.AST) -> bool:
    """Whether an expression is a host's data by its name: `data`, `host.data`, `rig_data`, ..."""
    return re.search(r"(^|[._])data$", ast.unparse(node)) is not None


def role_knob_reads(source: str) -> list[str]:
    """Role knobs a module reads with the name spelled literally: through knob(data, "<name>") outside a
    DERIVED_DEFAULTS table, or straight from a host's data (`host.data.get("<name>")`, `data["<name>"]`; what
    the fleet file's loader writes there, `data["cluster"] = ...`, is not a read)."""
    tree = ast.parse(source)
    defaults = {id(node) for top in tree.body
                if isinstance(top, (ast.Assign, ast.AnnAssign))
                and "DERIVED_DEFAULTS" in {t.id for t in (top.targets if isinstance(top, ast.Assign) else [top.target])
                                           if isinstance(t, ast.Name)}
                for node in ast.walk(top)}
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and id(node) not in defaults and isinstance(node.func, ast.Name)
                and node.func.id == "knob" and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
                and node.args[1].value in ROLE_KNOBS):
            found.append(node.args[1].value)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
              and host_data(node.func.value) and node.args and isinstance(node.args[0], ast.Constant)
              and node.args[0].value in ROLE_KNOBS):
            found.append(node.args[0].value)
        elif (isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and host_data(node.value)
              and isinstance(node.slice, ast.Constant) and node.slice.value in ROLE_KNOBS):
            found.append(node.slice.value)
    return found


def test_the_role_knob_finder_finds_a_read() -> None:
    assert role_knob_reads('x = knob(target.data, "serves_variant")\ny = knob(d, "variant")') == ["serves_variant"]
    derived = 'DERIVED_DEFAULTS: dict = {"monitor_group": lambda data: knob(data, "gateway_group")}\n'
    assert role_knob_reads(derived) == []
    assert role_knob_reads(derived + 'g = knob(data, "gateway_group")') == ["gateway_group"]
    raw = ('a = h.data.get("cluster")\nb = rig_data["image_mirror"]\nc = release.get("cluster")\n'
           'data["cluster"] = member\nd = host.data.get("rollout_batch")\n')
    assert role_knob_reads(raw) == ["cluster", "image_mirror"]


def test_what_a_host_is_is_decided_in_rigup_desired_roles_alone() -> None:
    """Whether a host serves a variant, is the gateway or the monitor, pulls through a mirror or is a
    cluster's member is read in one module (issue 40); everything else asks it (directly or through the
    run's FleetPlan)."""
    readers = {
        rel: reads
        for path in [*sorted((ROOT / "rigup").rglob("*.py")), *sorted((ROOT / "tasks").glob("*.py")), ROOT / "deploy.py"]
        if (rel := str(path.relative_to(ROOT))) != "rigup/desired/roles.py" and (reads := role_knob_reads(path.read_text()))
    }
    assert readers == {}, f"ask rigup.desired.roles (or the run's FleetPlan) instead: {readers}"


# Where things live on a rig is spelled in rigup/layout.py alone (RigLayout, issue 40). The scripts uploaded
# to a rig (rigup/rig) are single files its python3 runs and cannot import it: they spell their own files
# under the install_root they are handed, each named in their docstrings.
RIG_LAYOUT_MODULE = "rigup/layout.py"
RIG_SIDE = "rigup/rig/"


def mentions_install_root(node: ast.AST) -> bool:
    """Whether an expression reads the install_root: a name or attribute of that name, or knob(..., "install_root");
    what RigLayout(...) is handed does not count (asking it is the point)."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "RigLayout":
        return False
    if isinstance(node, ast.Name) and "install_root" in node.id:
        return True
    if isinstance(node, ast.Attribute) and "install_root" in node.attr:
        return True
    if isinstance(node, ast.Constant) and node.value == "install_root":
        return True
    return any(mentions_install_root(child) for child in ast.iter_child_nodes(node))


def install_root_spellings(source: str) -> list[int]:
    """Lines that spell a path under the install_root: an f-string that puts "/..." after it, a join
    (posixpath.join, os.path.join) that starts from it, or `install_root + "/..."`."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.JoinedStr):
            parts = node.values
            for i, part in enumerate(parts[:-1]):
                after = parts[i + 1]
                if (isinstance(part, ast.FormattedValue) and mentions_install_root(part.value)
                        and isinstance(after, ast.Constant) and str(after.value).startswith("/")):
                    lines.append(node.lineno)
        elif (isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name))
              and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id) == "join"
              and len(node.args) > 1 and mentions_install_root(node.args[0])):
            lines.append(node.lineno)
        elif (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add) and mentions_install_root(node.left)
              and isinstance(node.right, ast.Constant) and isinstance(node.right.value, str)
              and node.right.value.startswith("/")):
            lines.append(node.lineno)
    return sorted(set(lines))


def test_the_install_root_finder_finds_each_spelling() -> None:
    source = (
        'a = f"{install_root.rstrip(\'/\')}/bin/{NAME}"\n'
        'b = posixpath.join(str(knob(data, "install_root")), "cluster")\n'
        'c = install_root.rstrip("/") + "/state"\n'
        'd = os.path.join(recipe.paths.install_root, "x")\n'
        'e = RigLayout(install_root).servingctl\n'
        'h = RigLayout(install_root).variants_dir + "/"\n'
        'f = f"{install_root}"\n'
        'g = posixpath.join(variant_dir, "compose.yaml")\n'
    )
    assert install_root_spellings(source) == [1, 2, 3, 4]


def test_where_things_live_on_a_rig_is_spelled_in_rig_layout_alone() -> None:
    """Every path under install_root comes from rigup.layout.RigLayout (issue 40): the deploy's tasks and
    deploy.py too, and rigup's modules other than the rig-side scripts."""
    sources = [*sorted((ROOT / "rigup").rglob("*.py")), *sorted((ROOT / "tasks").glob("*.py")), ROOT / "deploy.py"]
    spelled = {
        rel: lines
        for path in sources
        if (rel := str(path.relative_to(ROOT))) != RIG_LAYOUT_MODULE and not rel.startswith(RIG_SIDE)
        and (lines := install_root_spellings(path.read_text()))
    }
    assert spelled == {}, f"ask rigup.layout.RigLayout for these paths: {spelled}"


RUN_NAMES = ("state", "host")  # pyinfra's State and Host, however a module holds them


def mentions_run(node: ast.AST) -> bool:
    """Whether an expression reads pyinfra's state or a host: `host`, `host.name`, `state`, `self.state`, ..."""
    return any((isinstance(n, ast.Name) and n.id in RUN_NAMES) or (isinstance(n, ast.Attribute) and n.attr in RUN_NAMES)
               for n in ast.walk(node))


def module_dicts(tree: ast.Module) -> set[str]:
    """Names a module binds at its top level to an empty dictionary ({}, dict(), defaultdict(...))."""
    names = set()
    for top in tree.body:
        value = top.value if isinstance(top, (ast.Assign, ast.AnnAssign)) else None
        targets = top.targets if isinstance(top, ast.Assign) else [top.target] if isinstance(top, ast.AnnAssign) else []
        empty = (isinstance(value, ast.Dict) and not value.keys) or (
            isinstance(value, ast.Call) and ast.unparse(value.func).rsplit(".", 1)[-1] in ("dict", "defaultdict"))
        if empty:
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def state_caches(source: str) -> list[int]:
    """Lines of a module that keep something per pyinfra run or host outside rigup.runstate: a weak-keyed
    dictionary (what a cache keyed on a State or Host is), an id(state) or id(host) key, a functools.cache /
    lru_cache function that takes a state or host, or a module-level dictionary written under a key read from a
    host or the state (`_ROUTERS[host.name] = ...`, `.setdefault(host.name, ...)`)."""
    lines = []
    tree = ast.parse(source)
    held = module_dicts(tree)
    for node in ast.walk(tree):
        if (isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name)
                and node.value.id in held and mentions_run(node.slice)):
            lines.append(node.lineno)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "setdefault"
              and isinstance(node.func.value, ast.Name) and node.func.value.id in held and node.args
              and mentions_run(node.args[0])):
            lines.append(node.lineno)
        if isinstance(node, ast.Attribute) and node.attr in ("WeakKeyDictionary", "WeakValueDictionary"):
            lines.append(node.lineno)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "id" and node.args
              and isinstance(node.args[0], ast.Name) and node.args[0].id in ("state", "host")):
            lines.append(node.lineno)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            cached = any("cache" in ast.unparse(d) for d in node.decorator_list)
            if cached and {a.arg for a in node.args.args} & {"state", "host"}:
                lines.append(node.lineno)
    return sorted(lines)


def test_the_state_cache_finder_finds_each_form() -> None:
    source = (
        "_RUNS = weakref.WeakKeyDictionary()\n"
        "_PLANS[id(state)] = 1\n"
        "@functools.cache\ndef plan(state, name): ...\n"
        "@functools.cache\ndef catalog(path): ...\n"
        "_ROUTERS: dict[str, list] = {}\n"
        "_SEEN = defaultdict(list)\n"
        "def decide(routers):\n"
        "    _ROUTERS[host.name] = routers\n"
        "    _SEEN.setdefault(self.state, []).append(1)\n"
        "    _ROUTERS[path] = routers\n"
        "    mine = {}\n"
        "    mine[host.name] = routers\n"
    )
    assert state_caches(source) == [1, 2, 4, 10, 11]


def test_per_run_state_is_kept_in_rigup_runstate_alone() -> None:
    """What one run keeps (its FleetPlan, what a task decides and a later one reads) lives in rigup.runstate,
    whose objects go with their run (issue 40): no other module caches on pyinfra's State or Host."""
    found = {
        str(path.relative_to(ROOT)): lines
        for path in [*sorted((ROOT / "rigup").rglob("*.py")), *sorted((ROOT / "tasks").glob("*.py"))]
        if path.name != "runstate.py" and (lines := state_caches(path.read_text()))
    }
    assert found == {}, f"keep per-run state in rigup.runstate: {found}"


# Every systemd unit, drop-in and timer rigup writes is a template in templates/ (issue 40): no Python source
# of the product or the deploy holds a unit's section header in a string.
UNIT_SECTION = re.compile(r"^\[(Unit|Service|Timer|Install|Socket|Path|Mount)\][ \t]*$", re.MULTILINE)


def unit_text_builders(source: str) -> list[int]:
    """Lines of string literals (f-strings' literal parts too) that hold a systemd section header on a line
    of its own."""
    return sorted({node.lineno for node in ast.walk(ast.parse(source))
                   if isinstance(node, ast.Constant) and isinstance(node.value, str) and UNIT_SECTION.search(node.value)})


def test_the_unit_text_finder_finds_a_unit_built_in_python() -> None:
    source = ('A = "[Unit]\\nDescription=x\\n"\n'
              'B = f"""\\n[Service]\\nExecStart={x}\\n"""\n'
              'C = "a [Unit] in prose"\n'
              'D = render_template("rigup-x.service.j2")\n')
    assert unit_text_builders(source) == [1, 2]


def test_every_unit_drop_in_and_timer_is_a_template() -> None:
    sources = [*sorted((ROOT / "rigup").rglob("*.py")), *sorted((ROOT / "tasks").glob("*.py")), ROOT / "deploy.py"]
    built = {str(p.relative_to(ROOT)): lines for p in sources if (lines := unit_text_builders(p.read_text()))}
    assert built == {}, f"write these units as templates in templates/ (rigup.desired.templating.render_template): {built}"
