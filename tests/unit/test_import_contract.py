"""The layering of ``intellect``, checked statically: the source is parsed, never imported.

* ``intellect`` imports neither Prefect nor the ``flows``/``tasks`` packages, anywhere (module level,
  ``if TYPE_CHECKING:`` blocks, function bodies, ``importlib.import_module("...")`` literals): the
  library runs without the orchestrator.
* ``intellect.shardcast`` and ``intellect.toploc`` never import ``intellect.rl`` at run time: weight
  distribution and proofs know nothing about the RL loop that uses them.
* No import cycles between modules (module-level imports, typing-only ones included), nor between the
  top-level components of the package (``intellect.ledger``, ``intellect.rl``, ...; every run-time
  import, function bodies included).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Literal

import pytest

PKG = Path(__file__).resolve().parents[2] / "intellect"
Kind = Literal["module", "typing", "function"]


@dataclass(frozen=True)
class Edge:
    src: str  # importing module
    dst: str  # imported module (the longest prefix that is an intellect module, or the external name)
    line: int
    kind: Kind  # "typing": under `if TYPE_CHECKING:`; "function": inside a def (lazy, run time)

    def __str__(self) -> str:
        return f"{self.src}:{self.line} -> {self.dst} ({self.kind})"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _resolve(name: str) -> str:
    """``name`` itself if not ours; else the longest prefix of it that is an intellect module."""
    if name.split(".")[0] != "intellect":
        return name
    while name not in MODULES and "." in name:
        name = name.rpartition(".")[0]
    return name


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


class _Imports(ast.NodeVisitor):
    def __init__(self, module: str, is_package: bool) -> None:
        self.module, self.is_package = module, is_package
        self.edges: list[Edge] = []
        self._kind: list[Kind] = ["module"]

    def _add(self, names: Iterable[str], line: int) -> None:
        for name in names:
            dst = _resolve(name)
            if dst != self.module:
                self.edges.append(Edge(self.module, dst, line, self._kind[-1]))

    def _scoped(self, node: ast.AST, kind: Kind) -> None:
        self._kind.append(kind)
        self.generic_visit(node)
        self._kind.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self._scoped(node, "function")

    def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> None:
        self._scoped(node, "function")

    def visit_If(self, node: ast.If) -> None:
        if not _is_type_checking(node.test):
            self.generic_visit(node)
            return
        self.visit(node.test)
        self._kind.append("typing" if self._kind[-1] == "module" else self._kind[-1])
        for child in node.body:
            self.visit(child)
        self._kind.pop()
        for child in node.orelse:
            self.visit(child)

    def visit_Import(self, node: ast.Import) -> None:
        self._add((a.name for a in node.names), node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            package = self.module.split(".") if self.is_package else self.module.split(".")[:-1]
            package = package[: len(package) - node.level + 1]
            base = ".".join(package + ([node.module] if node.module else []))
        # `from a import b` imports a, and a.b too when b is a module
        self._add([base] + [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES], node.lineno)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        if name in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            self._add([node.args[0].value], node.lineno)
        self.generic_visit(node)


def imports_of(module: str, source: str) -> list[Edge]:
    visitor = _Imports(module, MODULES.get(module, Path()).name == "__init__.py")
    visitor.visit(ast.parse(source))
    return visitor.edges


EDGES = [e for m, p in MODULES.items() for e in imports_of(m, p.read_text())]


def cycles(edges: Iterable[tuple[str, str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted.

    >>> cycles([("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")])
    [['a', 'b', 'c']]
    """
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                out.append(sorted(scc))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def component(module: str) -> str:
    """``intellect.rl.trainer.step`` -> ``intellect.rl``; ``intellect.ledger`` -> ``intellect.ledger``."""
    return ".".join(module.split(".")[:2])


def _explain(scc: list[str], edges: list[Edge], key=lambda m: m) -> str:
    members = set(scc)
    return "\n  ".join(str(e) for e in edges if key(e.src) in members and key(e.dst) in members
                       and key(e.src) != key(e.dst))


# ---------------------------------------------------------------------------- the scanner itself


def test_the_scanner_sees_every_kind_of_import():
    src = (
        "from __future__ import annotations\n"
        "from typing import TYPE_CHECKING\n"
        "import prefect\n"
        "from . import ledger\n"
        "from .rl.trainer import step as s\n"
        "if TYPE_CHECKING:\n"
        "    from intellect.rl.wire.rollouts import Rollout\n"
        "def f():\n"
        "    import flows.rl\n"
        "    importlib.import_module('tasks.rl')\n"
    )
    got = {(e.dst, e.kind) for e in imports_of("intellect.verdict", src)}
    assert got == {("__future__", "module"), ("typing", "module"), ("prefect", "module"),
                   ("intellect", "module"), ("intellect.ledger", "module"), ("intellect.rl.trainer", "module"),
                   ("intellect.rl.trainer.step", "module"), ("intellect.rl.wire.rollouts", "typing"),
                   ("flows.rl", "function"), ("tasks.rl", "function")}
    assert cycles([("a", "b"), ("b", "a"), ("c", "c")]) == [["a", "b"]] and cycles([("a", "b")]) == []


def test_the_package_scan_finds_the_known_edges():
    found = {(e.src, e.dst) for e in EDGES}
    assert len(MODULES) > 50
    assert ("intellect.rl.trainer.step", "intellect.ledger") in found
    assert ("intellect.rl.service.validator", "intellect.verdict") in found


# ---------------------------------------------------------------------------- the contract


@pytest.mark.parametrize("forbidden", ["prefect", "flows", "tasks"])
def test_intellect_never_imports_the_orchestration_layers(forbidden):
    bad = [str(e) for e in EDGES if e.dst.split(".")[0] == forbidden]
    assert bad == [], f"intellect must not import {forbidden}:\n  " + "\n  ".join(bad)


@pytest.mark.parametrize("layer", ["intellect.shardcast", "intellect.toploc"])
def test_shardcast_and_toploc_never_import_rl(layer):
    bad = [str(e) for e in EDGES if component(e.src) == layer and component(e.dst) == "intellect.rl"
           and e.kind != "typing"]
    assert bad == [], f"{layer} must not import intellect.rl:\n  " + "\n  ".join(bad)


def test_no_import_cycles_between_modules():
    edges = [e for e in EDGES if e.kind != "function" and e.dst in MODULES]
    found = cycles((e.src, e.dst) for e in edges)
    assert found == [], "import cycles:\n" + "\n".join(f"{c}:\n  {_explain(c, edges)}" for c in found)


def test_no_import_cycles_between_components():
    edges = [e for e in EDGES if e.kind != "typing" and e.dst in MODULES and component(e.src) != component(e.dst)]
    found = cycles((component(e.src), component(e.dst)) for e in edges)
    assert found == [], "import cycles between components:\n" + "\n".join(
        f"{c}:\n  {_explain(c, edges, component)}" for c in found)


# ---------------------------------------------------------------------------- the untrusted worker

#: What a permissionless inference worker's process must never load: it runs on machines nobody here
#: owns, and needs none of the trainer's, the ledger's or the validator's code, nor the orchestrator. A
#: name stands for itself and every module under it.
NOT_IN_A_WORKER = ("intellect.rl.trainer", "intellect.ledger", "duckdb", "intellect.rl.service.validator",
                   "intellect.toploc.check", "prefect")
WORKER = "intellect.rl.worker"
WORKER_MODULES = sorted(m for m in MODULES if m == WORKER or m.startswith(WORKER + "."))
CLI = PKG.parent / "flows" / "cli.py"


def loaded_by(roots: Iterable[str], edges: Iterable[Edge], kinds: tuple[Kind, ...] = ("module",)
              ) -> dict[str, Edge | None]:
    """Every module importing ``roots`` loads, with the edge it was first reached by (None: a root).
    Imports of ``kinds`` only (module level: what an import runs; with "function", what calling into
    the modules may load too), typing-only ones left out, each package's ``__init__`` included.

    >>> sorted(loaded_by(["intellect.a.b"], [Edge("intellect.a.b", "c", 1, "module"),
    ...                                       Edge("c", "d", 2, "typing")]))
    ['c', 'intellect', 'intellect.a', 'intellect.a.b']
    """
    graph: dict[str, list[Edge]] = {}
    for e in edges:
        if e.kind in kinds:
            graph.setdefault(e.src, []).append(e)
    seen: dict[str, Edge | None] = {}
    todo: list[tuple[str, Edge | None]] = [(r, None) for r in roots]
    while todo:
        module, via = todo.pop()
        if module in seen:
            continue
        seen[module] = via
        parent = module.rpartition(".")[0]
        if parent:
            todo.append((parent, Edge(module, parent, 0, "module")))
        todo += [(e.dst, e) for e in graph.get(module, [])]
    return seen


def _chain(seen: dict[str, Edge | None], module: str) -> str:
    links = []
    while (e := seen.get(module)) is not None:
        links.append(str(e))
        module = e.src
    return "\n  ".join(reversed(links))


def _forbidden(seen: dict[str, Edge | None]) -> dict[str, str]:
    return {m: _chain(seen, m) for m in seen if any(m == f or m.startswith(f + ".") for f in NOT_IN_A_WORKER)}


def test_the_untrusted_worker_loads_no_trainer_ledger_or_validator_code():
    """``intellect worker`` (flows/cli.py, which imports intellect.rl.worker.worker when the command is
    ``worker``) and every module of the worker package: the whole module-level closure of each."""
    cli_edges = [e for e in imports_of("flows.cli", CLI.read_text()) if e.kind == "module"]
    assert ("flows.cli", WORKER + ".worker") in {(e.src, e.dst) for e in imports_of("flows.cli", CLI.read_text())}
    assert len(WORKER_MODULES) > 3
    for roots in (WORKER_MODULES, [*WORKER_MODULES, *{e.dst for e in cli_edges}]):
        seen = loaded_by(roots, EDGES)
        assert len(seen) > 20  # the scan follows imports at all
        bad = _forbidden(seen)
        assert bad == {}, "\n".join(f"the worker loads {m}:\n  {chain}" for m, chain in bad.items())


def test_the_worker_package_reaches_none_of_it_at_run_time_either():
    """Imports inside functions count too: whatever a worker calls never loads the trainer, the
    validator, the ledger, DuckDB or Prefect."""
    seen = loaded_by(WORKER_MODULES, EDGES, ("module", "function"))
    bad = _forbidden(seen)
    assert bad == {}, "\n".join(f"the worker may load {m}:\n  {chain}" for m, chain in bad.items())


def test_the_worker_contract_catches_a_forbidden_import():
    """The check itself: a worker module that imported the trainer, or DuckDB in a function, is caught."""
    trainer = Edge(WORKER_MODULES[-1], "intellect.rl.trainer.step", 1, "module")
    duck = Edge(WORKER_MODULES[0], "duckdb", 1, "function")
    assert "intellect.rl.trainer.step" in _forbidden(loaded_by(WORKER_MODULES, [*EDGES, trainer]))
    assert "duckdb" in _forbidden(loaded_by(WORKER_MODULES, [*EDGES, duck], ("module", "function")))
    assert "duckdb" not in _forbidden(loaded_by(WORKER_MODULES, [*EDGES, duck]))
