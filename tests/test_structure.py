"""The package's shape: its floors (an import runs down them, never up: ``FLOORS``), no import
circle (imports inside functions and under TYPE_CHECKING count: a circle there is a circle in the
design), and the pure decisions import nothing of the controller's."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"


def _modules() -> dict[str, Path]:
    out = {}
    for p in sorted((SRC / "nonstop").rglob("*.py")):
        parts = list(p.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, p in mods.items():
        pkg = m.split(".") if p.name == "__init__.py" else m.split(".")[:-1]
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg[:len(pkg) - (node.level - 1)]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != m:
                    graph[m].add(t)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_finder_finds_a_circle():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(g) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle():
    graph = import_graph()
    assert len(graph) > 100 and "nonstop.controller.machine" in graph["nonstop.controller.controller"]
    assert circles(graph) == []


def test_the_pure_decisions_import_nothing_of_the_controller():
    graph = import_graph()
    bad = {m: sorted(t for t in ts if t.startswith("nonstop.controller"))
           for m, ts in graph.items() if m.startswith("nonstop.decide")}
    assert {m: ts for m, ts in bad.items() if ts} == {}


#: The floors of the package, from the ground up: a module imports only from its own floor or
#: below (docs/design.md, "Layout"). The package's own ``__init__`` is the ground: its body
#: imports nothing of the package (the public names are re-exported lazily from ``runtime/``).
FLOORS: tuple[tuple[str, ...], ...] = (
    ("(root)", "errors", "pids"),
    ("protocol", "policy"),  # the records that cross a process; the policy's schema
    ("store", "net"),  # etcd and the TCPStore; the authenticated channel
    ("decide",),  # pure decisions
    ("observe", "zygote_client", "script_scan", "torch_internals"),
    ("state",),  # a rank's state: its snapshots, restores, checkpoints, the slots' format
    ("keeper",),  # node memory: the keeper process
    ("inject",),
    ("runtime", "ddp"),  # in each rank
    ("agent",),  # one host's processes
    ("controller",),
    ("launch",),  # nonstop run
    ("drain", "demo", "examples", "chaos", "measure"),  # commands at a job: nonstop's, or yours
    ("cli", "__main__"),
)


def _floor_of() -> dict[str, int]:
    return {room: i for i, rooms in enumerate(FLOORS) for room in rooms}


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "(root)"


def upward(graph: dict[str, set[str]]) -> list[str]:
    """Every import from a higher floor than its module's (the root's lazy re-exports aside)."""
    floor = _floor_of()
    return sorted(f"{m} -> {t}" for m, ts in graph.items() if m != "nonstop"
                  for t in ts if floor[_room(t)] > floor[_room(m)])


def test_every_room_has_a_floor():
    assert {_room(m) for m in import_graph()} - set(_floor_of()) == set()


def test_every_import_runs_down_the_floors():
    assert upward(import_graph()) == []


def test_the_floor_check_finds_an_upward_import():
    graph = {"nonstop.protocol.events": {"nonstop.decide.cuda"},
             "nonstop.decide.cuda": {"nonstop.protocol.cuda"}, "nonstop": {"nonstop.runtime"}}
    assert upward(graph) == ["nonstop.protocol.events -> nonstop.decide.cuda"]


def test_the_packages_own_init_imports_nothing_of_the_package_at_import():
    tree = ast.parse((SRC / "nonstop" / "__init__.py").read_text())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert all(isinstance(n, ast.Import) or n.module == "__future__" or n.level == 0 and
               not (n.module or "").startswith("nonstop") for n in top), ast.dump(top[-1])
    assert all(not (isinstance(n, ast.ImportFrom) and n.level) for n in top)
