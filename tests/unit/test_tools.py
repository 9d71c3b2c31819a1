"""The maintainers' scripts in tools/ still fit the package they measure: every name a tool
imports from cudampi, from tests or from a tool beside it exists there (a tool is run by hand on
the GPU machine, so a rename in the package would otherwise show only in a device call)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "tools"
OURS = ("cudampi", "tests", *(p.stem for p in TOOLS.glob("*.py")))
"""Top-level modules whose names a tool's imports must find: the package, the test helpers and
the tools themselves (a tool imports ``timing`` from beside it)."""


def imported(tree: ast.Module) -> list[tuple[str, str | None]]:
    """(module, name) for every import of :data:`OURS` in ``tree`` (name None: the module)."""
    out: list[tuple[str, str | None]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] in OURS:
                out += [(node.module, a.name) for a in node.names if a.name != "*"]
        elif isinstance(node, ast.Import):
            out += [(a.name, None) for a in node.names if a.name.split(".")[0] in OURS]
    return out


def missing(module: str, name: str | None) -> str | None:
    """Why ``from module import name`` (or ``import module``) fails; None where it works, or
    where the module needs a library this Python lacks (torch, CuPy: a GPU-only tool)."""
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] not in OURS:
            return None
        return f"no module {module!r} ({exc})"
    except ImportError:
        return None  # a third-party library there failed to load: not the tool's fault
    if name is None or hasattr(mod, name):
        return None
    try:
        importlib.import_module(f"{module}.{name}")
    except ModuleNotFoundError:
        return f"{module!r} has no {name!r}"
    return None


@pytest.mark.parametrize("tool", sorted(p.name for p in TOOLS.glob("*.py")))
def test_every_name_a_tool_imports_exists(tool, monkeypatch):
    monkeypatch.syspath_prepend(str(TOOLS))
    monkeypatch.syspath_prepend(str(ROOT))
    tree = ast.parse((TOOLS / tool).read_text(), tool)
    wrong = [why for module, name in imported(tree) if (why := missing(module, name))]
    assert not wrong, f"tools/{tool}: " + "; ".join(wrong)


def test_a_renamed_function_is_caught(monkeypatch):
    """The check itself: a name that is not there is reported."""
    monkeypatch.syspath_prepend(str(ROOT))
    assert missing("cudampi.config", "parse_size") is None
    assert "has no 'no_such_name'" in (missing("cudampi.config", "no_such_name") or "")
    assert "no module" in (missing("cudampi.no_such_module", None) or "")
