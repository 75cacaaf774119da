"""The import graph of ``pd_fsm``, read from every module's source: no import circles, and each
layer imports only what the table below allows ("folders that show the concerns").

Every ``import`` statement counts, wherever it is: at the top, inside a function, under ``if
TYPE_CHECKING``. A function-level import still makes the module depend on the other one (it only
moves the failure to the call), and a ``TYPE_CHECKING`` import is still a dependency of what the
module means; both are how the circles this test now forbids used to be hidden, so neither is
exempt.

What is not an edge: a package's ``__init__`` running before its submodule (``from pd_fsm.core
import events`` depends on ``pd_fsm.core.events``, not on everything ``pd_fsm/core/__init__.py``
re-exports), and modules named in strings (``pd_fsm/cli.py`` imports its subcommands with
``importlib``; it is the top layer and may import anything anyway).
"""

from __future__ import annotations

import ast
from collections import deque
from collections.abc import Iterable, Mapping
from pathlib import Path

import attrs

import pd_fsm

# Layer -> the layers its modules may import (its own listed too). A module belongs to the longest
# layer name that is its name or a package above it; layers match exactly, so a sub-layer
# (pd_fsm.sim.real) is named wherever it may be imported. Why each row:
LAYERS: dict[str, frozenset[str]] = {
    # The sans-IO core: table-driven state machines, the bottom everything else builds on; no
    # JAX, no sockets, no clock (docs/design.md; test_core_purity checks its third-party imports).
    "pd_fsm.core": frozenset({"pd_fsm.core"}),
    # Text in and out of the model: tokenizers, detokenising, chat templates. No JAX, nothing of
    # pd_fsm: a bottom layer beside the core, so that handling text never needs the accelerator
    # stack (the engine's model loader, the schedulers and the HTTP layer all use it).
    "pd_fsm.text": frozenset({"pd_fsm.text"}),
    # The JAX data plane, a folder per concern (model, kv, compilation, parallel, sampling,
    # transfer). Below the schedulers that drive it and the processes that serve it. It imports
    # text (a model's tokenizer, a grammar's vocabulary) and nothing else of pd_fsm; the core, at
    # the bottom, is allowed. The folders are concerns, not layers: model, kv and parallel use
    # each other (the model writes the paged pool, the pool is sharded for tensor parallelism,
    # which shards the model), so only the module graph below them must be free of circles.
    "pd_fsm.jax_engine": frozenset({"pd_fsm.jax_engine", "pd_fsm.text", "pd_fsm.core"}),
    # The schedulers: batches on the JAX engine, and the PD ones drive the core's endpoints. No
    # HTTP, no processes: io_trio runs them.
    "pd_fsm.schedulers": frozenset(
        {"pd_fsm.schedulers", "pd_fsm.jax_engine", "pd_fsm.text", "pd_fsm.core"}
    ),
    # The simulator runs the real cores with everything else modelled, so it needs no JAX (a
    # modelled run is thousands of seeds) ...
    "pd_fsm.sim": frozenset({"pd_fsm.sim", "pd_fsm.sim.real", "pd_fsm.core"}),
    # ... except real.py, whose workers are the real PD schedulers on the tiny model
    # (``pd-fsm sim --schedulers real``; world.py imports it only for that).
    "pd_fsm.sim.real": frozenset(
        {"pd_fsm.sim.real", "pd_fsm.sim", "pd_fsm.core", "pd_fsm.jax_engine", "pd_fsm.text",
         "pd_fsm.schedulers"}
    ),
    # ... and profiler/ (`pd-fsm profile`), which measures the real engine for the performance
    # model (perf.py) and pins itself to cores as a worker does.
    "pd_fsm.sim.profiler": frozenset(
        {"pd_fsm.sim.profiler", "pd_fsm.sim", "pd_fsm.core", "pd_fsm.jax_engine", "pd_fsm.text",
         "pd_fsm.schedulers", "pd_fsm.io_trio"}
    ),
    # The processes: trio adapters around the core, the workers around the schedulers, the
    # proxy, the bootstrap server, the cluster runners. Not the simulator.
    "pd_fsm.io_trio": frozenset(
        {"pd_fsm.io_trio", "pd_fsm.schedulers", "pd_fsm.jax_engine", "pd_fsm.text", "pd_fsm.core"}
    ),
    # The `pd-fsm` command, the top: it may import every layer, and no layer imports it (it is
    # only ever run, ``python -m pd_fsm.cli`` in the cluster runners).
    "pd_fsm.cli": frozenset(
        {"pd_fsm.cli", "pd_fsm.io_trio", "pd_fsm.sim", "pd_fsm.sim.real", "pd_fsm.sim.profiler",
         "pd_fsm.schedulers", "pd_fsm.jax_engine", "pd_fsm.text", "pd_fsm.core"}
    ),
    # The package's own __init__ (empty): it imports nothing.
    "pd_fsm": frozenset({"pd_fsm"}),
}

ROOT = Path(pd_fsm.__file__).parent


@attrs.frozen
class Edge:
    source: str
    target: str
    line: int

    def __str__(self) -> str:
        return f"{self.source} (line {self.line}) imports {self.target}"


def _module_files(root: Path) -> dict[str, Path]:
    """Every module of the package under ``root``, by dotted name."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = [root.name, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool,
             known: Mapping[str, Path]) -> Iterable[str]:
    """The modules of ``known`` that one import statement in ``module`` imports."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        if node.level:  # relative: from the module's package, one level up per extra dot
            package = module.split(".") if is_package else module.split(".")[:-1]
            base = ".".join(package[: len(package) - node.level + 1])
            prefix = f"{base}.{node.module}" if node.module else base
        else:
            prefix = node.module or ""
        # ``from P import n`` imports the submodule P.n when there is one, else a name of P.
        names = [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in known else prefix
                 for a in node.names]
    for name in names:
        parts = name.split(".")
        while parts and ".".join(parts) not in known:  # import a.b.c of a module a.b: a.b
            parts.pop()
        if parts:
            yield ".".join(parts)


def import_graph(root: Path = ROOT) -> dict[str, list[Edge]]:
    """Module -> the edges to the package's modules it imports (self-imports left out)."""
    known = _module_files(root)
    graph: dict[str, list[Edge]] = {}
    for module, path in known.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        edges = graph.setdefault(module, [])
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                for target in _targets(node, module, path.name == "__init__.py", known):
                    if target != module:
                        edges.append(Edge(module, target, node.lineno))
    return graph


def layer_of(module: str, layers: Iterable[str] = LAYERS) -> str | None:
    """The longest layer name that is ``module`` or a package above it."""
    matches = [x for x in layers if module == x or module.startswith(x + ".")]
    return max(matches, key=len, default=None)


def forbidden(graph: Mapping[str, list[Edge]],
              layers: Mapping[str, frozenset[str]] = LAYERS) -> list[str]:
    """Every edge that leaves what its module's layer may import, as a sentence."""
    out = []
    for edges in graph.values():
        for edge in edges:
            source = layer_of(edge.source, layers)
            target = layer_of(edge.target, layers)
            if source is None or target is None:
                continue  # unclassified: test_every_module_has_a_layer names it
            allowed = layers[source]
            if target not in allowed:
                out.append(f"{edge}: layer {source} may import only {', '.join(sorted(allowed))}")
    return out


def cycles(graph: Mapping[str, list[Edge]]) -> list[list[Edge]]:
    """One shortest circle through each strongly connected group of modules (Tarjan's algorithm,
    iterative; then a breadth-first search inside the group)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    groups: list[set[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph.get(start, [])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            edge = next(edges, None)
            if edge is not None:
                t = edge.target
                if t not in index:
                    index[t] = low[t] = len(index)
                    stack.append(t)
                    on_stack.add(t)
                    work.append((t, iter(graph.get(t, []))))
                elif t in on_stack:
                    low[node] = min(low[node], index[t])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                group = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.add(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(group)
    return [_shortest_circle(graph, group) for group in groups]


def _shortest_circle(graph: Mapping[str, list[Edge]], group: set[str]) -> list[Edge]:
    start = min(group)
    came_by: dict[str, Edge] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for edge in graph.get(node, []):
            if edge.target not in group or edge.target in came_by:
                continue
            came_by[edge.target] = edge
            if edge.target == start:
                path = [edge]
                while path[0].source != start:
                    path.insert(0, came_by[path[0].source])
                return path
            queue.append(edge.target)
    raise AssertionError(f"no circle through {start} in {sorted(group)}")


def folder_of(module: str, known: Mapping[str, Path], layers: Iterable[str] = LAYERS) -> str:
    """The folder of its layer a module is in: the layer's own (for its top modules), or the
    folder just below the layer that holds it, subfolders included. A subfolder is part of its
    folder's concern (``io_trio/worker/spmd`` is the worker spanning processes), so what the
    two use of each other is the folder's own business, as modules of one folder are."""
    layer = layer_of(module, layers) or module
    package = module if known[module].name == "__init__.py" else module.rpartition(".")[0]
    if package == layer or not package.startswith(layer + "."):
        return layer
    return f"{layer}.{package[len(layer) + 1:].split('.')[0]}"


def folder_graph(graph: Mapping[str, list[Edge]], root: Path = ROOT,
                 layers: Iterable[str] = LAYERS) -> dict[str, list[Edge]]:
    """Folder -> the edges to the other folders of its layer that its modules import (one edge
    per import statement, named by the module that makes it).

    Not an edge: a package's ``__init__`` importing from inside its own package. That is the
    folder re-exporting its subfolders' names (``pd_fsm.schedulers`` offers the PD schedulers
    where engines have always imported them); what the subfolders' modules need of the folder
    above them does not make the folder above depend on them."""
    known = _module_files(root)
    folders: dict[str, list[Edge]] = {}
    for module, edges in graph.items():
        source = folder_of(module, known, layers)
        folders.setdefault(source, [])
        for edge in edges:
            target = folder_of(edge.target, known, layers)
            if target == source or layer_of(module, layers) != layer_of(edge.target, layers):
                continue
            if known[module].name == "__init__.py" and edge.target.startswith(module + "."):
                continue
            folders[source].append(Edge(source, target, edge.line))
            folders.setdefault(target, [])
    return folders


def _circle_text(circle: list[Edge]) -> str:
    return " -> ".join([f"{e.source} (line {e.line})" for e in circle] + [circle[0].source])


# --------------------------------------------------------------------------------- the tests


def test_no_import_circles() -> None:
    found = cycles(import_graph())
    assert not found, "import circles in pd_fsm:\n" + "\n".join(_circle_text(c) for c in found)


def test_no_import_circles_between_the_folders_of_a_layer() -> None:
    """A folder is a concern: inside a layer, if one folder's modules import another's, none of
    the other's may import the first's, through any number of folders (``jax_engine`` once had
    model -> kv -> parallel -> model: no folder could be read, moved or tested without the
    others). The layer's top modules count as one folder more. Circles between modules are the
    test above's."""
    found = cycles(folder_graph(import_graph()))
    assert not found, "import circles between folders:\n" + "\n".join(
        _circle_text(c) for c in found)


def test_each_layer_imports_only_what_it_may() -> None:
    bad = forbidden(import_graph())
    assert not bad, "imports across layers that LAYERS forbids:\n" + "\n".join(bad)


def test_every_module_has_a_layer() -> None:
    unclassified = [m for m in import_graph() if layer_of(m) is None]
    assert not unclassified, f"modules in no layer of LAYERS (add a row): {unclassified}"


def test_the_graph_sees_every_kind_of_import() -> None:
    """The reader is not vacuous: it finds a top-level import, one inside a function, and a
    ``from package import submodule`` (the TYPE_CHECKING and relative forms: the next test)."""
    graph = import_graph()
    targets = {m: {e.target for e in edges} for m, edges in graph.items()}
    assert "pd_fsm.core.dispatch" in targets["pd_fsm.core.rooms"]  # top level
    assert "pd_fsm.sim.real" in targets["pd_fsm.sim.world"]  # inside a function
    assert "pd_fsm.core.effects" in targets["pd_fsm.core.router"]  # from pd_fsm.core import effects


def test_the_checks_catch_what_they_guard(tmp_path: Path) -> None:
    """On a package made up here: a circle through a function-level and a TYPE_CHECKING import,
    and a forbidden edge, are both reported."""
    pkg = tmp_path / "toy"
    (pkg / "low").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "__init__.py").write_text("")
    (pkg / "low" / "a.py").write_text("def f():\n    from toy.high import b\n")
    (pkg / "high.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .low import a\n"
    )
    graph = import_graph(pkg)
    found = cycles(graph)
    assert [_circle_text(c) for c in found] == [
        "toy.high (line 3) -> toy.low.a (line 2) -> toy.high"
    ]
    layers = {"toy": frozenset({"toy", "toy.low"}), "toy.low": frozenset({"toy.low"})}
    assert forbidden(graph, layers) == [
        "toy.low.a (line 2) imports toy.high: layer toy.low may import only toy.low"
    ]


def test_the_folder_check_catches_a_loop_of_three(tmp_path: Path) -> None:
    """On a package made up here, one layer: three folders in a loop through modules that form
    no module circle (what ``jax_engine`` had: model -> kv -> parallel -> model), reported as
    the folders' circle; the package's ``__init__`` re-exporting a subfolder is no edge."""
    pkg = tmp_path / "toy"
    for name in ("model", "kv", "parallel"):
        (pkg / name).mkdir(parents=True)
        (pkg / name / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from toy.model.net import Net\n")
    (pkg / "top.py").write_text("")
    (pkg / "model" / "net.py").write_text("import toy.top\nfrom toy.kv import pool\n")
    (pkg / "kv" / "pool.py").write_text("from toy.parallel import shard\n")
    (pkg / "parallel" / "shard.py").write_text("from toy.model import spec\n")
    (pkg / "model" / "spec.py").write_text("")
    graph = import_graph(pkg)
    assert not cycles(graph)
    found = cycles(folder_graph(graph, pkg, {"toy": frozenset({"toy"})}))
    assert [_circle_text(c) for c in found] == [
        "toy.kv (line 1) -> toy.parallel (line 1) -> toy.model (line 2) -> toy.kv"
    ]
