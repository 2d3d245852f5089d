"""Whether a training script uses nonstop, read from its source: the script itself, and the modules
of its own it imports (files beside it, followed to any depth). A script that reaches
``nonstop.wrap`` through a module of its own (``from mytrainer import main``) is a wrapped script
like one that calls it directly: the launcher runs its job as managed, and each rank process waits
for ``nonstop.wrap`` to enter its generation. No import is executed; a file that cannot be read
or parsed counts as not using nonstop (the script itself reports its own errors when it runs)."""

from __future__ import annotations

import ast
from pathlib import Path

MAX_FILES = 200  # a bound on the modules followed


def imported_names(tree: ast.AST) -> list[str]:
    """Every module name an ``import`` or absolute ``from ... import`` in ``tree`` names."""
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
    return names


def _is_nonstop(name: str) -> bool:
    return name == "nonstop" or name.startswith("nonstop.")


def _local(name: str, root: Path) -> Path | None:
    """The file of module ``name`` if it is the script's own (under the script's directory)."""
    parts = name.split(".")
    for candidate in (root.joinpath(*parts).with_suffix(".py"),
                      root.joinpath(*parts, "__init__.py")):
        try:
            if candidate.is_file():
                return candidate
        except OSError:
            continue
    return None


def uses_nonstop(script: str | Path, tree: ast.AST | None = None) -> bool:
    """Whether ``script`` or a module of its own it imports, at any depth, imports nonstop."""
    path = Path(script)
    root = path.resolve().parent
    todo: list[tuple[Path, ast.AST | None]] = [(path, tree)]
    seen: set[Path] = set()
    while todo and len(seen) < MAX_FILES:
        file, parsed = todo.pop()
        try:
            key = file.resolve()
        except OSError:
            continue
        if key in seen:
            continue
        seen.add(key)
        if parsed is None:
            try:
                parsed = ast.parse(file.read_bytes(), str(file))
            except (OSError, SyntaxError, ValueError):
                continue
        names = imported_names(parsed)
        if any(_is_nonstop(n) for n in names):
            return True
        for name in names:
            # a package's submodule import names its parents too (a.b: a/__init__.py, a/b.py)
            pieces = name.split(".")
            for i in range(1, len(pieces) + 1):
                local = _local(".".join(pieces[:i]), root)
                if local is not None:
                    todo.append((local, None))
    return False
