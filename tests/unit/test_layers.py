"""The import rules of docs/ARCHITECTURE.md, checked on every import in src/ (an AST walk, the
imports inside functions included), so the map and the code cannot drift apart.

The floors and the exceptions are read from the map itself: change the map, and this test holds
the code to the change.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "cudampi"
MAP = ROOT / "docs" / "ARCHITECTURE.md"


def _block(name: str) -> str:
    text = MAP.read_text()
    m = re.search(rf"<!-- {name} -->(.*?)<!-- /{name} -->", text, re.S)
    assert m, f"docs/ARCHITECTURE.md has no <!-- {name} --> block"
    return m.group(1)


def floors() -> dict[str, int]:
    """Each room (a package, or a module directly under cudampi/) -> its floor."""
    out: dict[str, int] = {}
    for line in _block("floors").splitlines():
        m = re.match(r"\s*floor (\d+)\s+(.+)$", line)
        if m:
            for room in m.group(2).split():
                out[room] = int(m.group(1))
    return out


def exceptions() -> dict[tuple[str, str], str]:
    """``(importer module, imported module) -> why``, from the map's table."""
    out: dict[tuple[str, str], str] = {}
    for line in _block("exceptions").splitlines():
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("cudampi."):
            out[(cells[0], cells[1])] = cells[2]
    return out


@dataclass(frozen=True)
class Import:
    module: str
    """The importing module, e.g. ``cudampi.comm.paths``."""
    target: str
    """What it imports, e.g. ``cudampi.probe.capabilities`` or ``torch``."""
    line: int


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports() -> list[Import]:
    out: list[Import] = []
    for path in sorted(SRC.rglob("*.py")):
        mod = module_name(path)
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                out += [Import(mod, a.name, node.lineno) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join([*base, *([node.module] if node.module else [])])
                else:
                    target = node.module or ""
                # `from cudampi import comm` imports the module cudampi.comm
                subs = [f"{target}.{a.name}" for a in node.names]
                named = [s for s in subs if _is_module(s)]
                out += [Import(mod, t, node.lineno) for t in (named or [target])]
    return out


def _is_module(name: str) -> bool:
    if not name.startswith("cudampi."):
        return False
    rel = Path(*name.split(".")[1:])
    return (SRC / rel).with_suffix(".py").is_file() or (SRC / rel / "__init__.py").is_file()


def room(module: str) -> str:
    """``cudampi.comm.engines.mpi`` -> ``comm``; ``cudampi.config`` -> ``config``; ``cudampi``
    -> ``cudampi`` (the package root)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "cudampi"


def test_every_room_is_on_the_map():
    rooms = {room(module_name(p)) for p in SRC.rglob("*.py")}
    missing = rooms - set(floors())
    assert not missing, f"put these in docs/ARCHITECTURE.md's floors: {sorted(missing)}"
    assert not set(floors()) - rooms, "the map names rooms that src/ no longer has"


def _allowed(imp: Import) -> bool:
    return any(
        imp.module == who and (imp.target == what or imp.target.startswith(what + "."))
        for who, what in exceptions()
    )


def test_each_room_imports_only_itself_and_lower_floors():
    """Down, never up or sideways: comm and probe import nothing above them, and the packages
    of one floor (doctor, launch, torch) do not import each other. Importing the root package
    (``from cudampi import __version__``) is fine everywhere: it imports nothing heavy."""
    floor = floors()
    bad = []
    for imp in imports():
        if not imp.target.startswith("cudampi.") or _allowed(imp):
            continue
        src, dst = room(imp.module), room(imp.target)
        if src == dst:
            continue
        if floor[dst] >= floor[src]:
            bad.append(
                f"{imp.module}:{imp.line} imports {imp.target} ({src} is on floor "
                f"{floor[src]}, {dst} on floor {floor[dst]})"
            )
    assert not bad, "\n".join(bad)


def test_only_the_top_level_cli_reaches_bench():
    bad = []
    for path in sorted(SRC.rglob("*.py")):
        mod = module_name(path)
        if room(mod) == "bench" or mod == "cudampi.cli":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            named = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else [node.value]
                if isinstance(node, ast.Constant) and isinstance(node.value, str)
                else []
            )
            if any(n == "cudampi.bench" or n.startswith("cudampi.bench.") for n in named):
                bad.append(f"{mod}:{node.lineno}")
    assert not bad, f"only cudampi.cli may reach cudampi.bench: {bad}"


def test_launch_does_not_import_torch():
    bad = [
        f"{i.module}:{i.line} imports {i.target}"
        for i in imports()
        if room(i.module) == "launch"
        and (
            i.target.split(".")[0] == "torch"
            or (room(i.target) == "torch" and i.target.startswith("cudampi."))
        )
        and not _allowed(i)
    ]
    assert not bad, bad


def test_every_exception_is_still_needed():
    seen = imports()
    for who, what in exceptions():
        assert any(
            i.module == who and (i.target == what or i.target.startswith(what + ".")) for i in seen
        ), f"docs/ARCHITECTURE.md excuses {who} importing {what}, which it no longer does"


def test_no_import_circles():
    """Modules that import each other (even inside functions) are one job in two files: the map
    has no room for them. Found as the strongly connected parts of the import graph."""
    graph: dict[str, set[str]] = {}
    for i in imports():
        if _is_module(i.target) and i.target != i.module:
            graph.setdefault(i.module, set()).add(i.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = set()
            while True:
                w = stack.pop()
                part.add(w)
                if w == v:
                    break
            if len(part) > 1:
                circles.append(part)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert circles == []
