"""Where the variants live, held by tests: the call table is the only list of calls, engines
declare themselves and are met only inside comm/, no source file passes 600 lines. Each rule
fails when the list of files a new collective or engine touches grows (docs/ARCHITECTURE.md,
"Where each kind of change goes")."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from cudampi.comm.engines import KINDS
from cudampi.comm.engines.base import Engine
from cudampi.names import CALLS, PATHS

SRC = Path(__file__).resolve().parents[2] / "src" / "cudampi"

OTHER_VOCABULARIES = {
    ("torch/methods.py", "METHODS"): "c10d's method names (torch's words, which share some calls')"
}
"""Collections whose names look like calls but are another vocabulary, with why."""


def _call_lists(path: Path, text: str) -> list[tuple[int, list[str]]]:
    """Every tuple, list, set or dict (its keys) literal in ``text`` naming two calls or more."""
    found = []
    tree = ast.parse(text)
    exempt = {name for (file, name) in OTHER_VOCABULARIES if path.as_posix().endswith(file)}
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id in exempt for t in targets):
                skip.update(id(n) for n in ast.walk(node.value) if node.value is not None)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        elts: list[ast.expr | None] = []
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            elts = list(node.elts)
        elif isinstance(node, ast.Dict):
            elts = list(node.keys)
        names = [
            e.value
            for e in elts
            if isinstance(e, ast.Constant) and isinstance(e.value, str) and e.value in CALLS
        ]
        if len(names) >= 2:
            found.append((node.lineno, names))
    return found


def test_the_call_table_is_the_only_list_of_calls():
    """A call name may appear alone anywhere (``if call == "broadcast"``), but a list of them
    is a second call table: read :data:`cudampi.names.CALLS` instead."""
    bad = []
    for path in sorted(SRC.rglob("*.py")):
        if path == SRC / "names.py":
            continue
        for line, names in _call_lists(path, path.read_text()):
            bad.append(f"{path.relative_to(SRC)}:{line} lists calls {names}")
    assert not bad, "\n".join(bad)


def test_the_call_list_check_finds_what_it_forbids(tmp_path):
    code = (
        'REDUCING = ("allreduce", "reduce")\nOK = ("allreduce",)\nD = {"gather": 1, "scatter": 2}\n'
    )
    assert [line for line, _ in _call_lists(tmp_path / "x.py", code)] == [1, 3]


def test_no_source_file_is_over_600_lines():
    """A file over 600 lines holds several jobs: split it by job (docs/ARCHITECTURE.md)."""
    long = {
        str(p.relative_to(SRC)): n
        for p in SRC.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 600
    }
    assert not long, long


def _imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.append((node.lineno, node.module))
            out.extend((node.lineno, f"{node.module}.{a.name}") for a in node.names)
        elif isinstance(node, ast.Import):
            out.extend((node.lineno, a.name) for a in node.names)
    return out


def test_no_engine_is_imported_outside_comm():
    """Outside comm/ the engines are met through the Communicator and comm.paths (their
    verdicts, what is unavailable), never by module: a new engine touches nothing outside."""
    bad = []
    for path in sorted(SRC.rglob("*.py")):
        if path.is_relative_to(SRC / "comm"):
            continue
        for line, module in _imports(path):
            if module.startswith(("cudampi.comm.engines", "cudampi.comm.ipc")):
                bad.append(f"{path.relative_to(SRC)}:{line} imports {module}")
    assert not bad, "\n".join(bad)


def test_engines_declare_themselves():
    """Every engine says which calls it runs (by implementing their methods), which path names
    ask for it, and how auto judges it; every path but auto has exactly one engine; one engine
    is auto's last resort."""
    owners: dict[str, list[str]] = {}
    for name, kind in KINDS.items():
        assert kind.name == name
        assert kind.calls <= set(CALLS), name
        assert {c for c in kind.calls if CALLS[c].data}, f"{name} runs no call"
        for path in kind.paths:
            owners.setdefault(path, []).append(name)
        for method in ("verdict", "route", "forced"):
            assert callable(getattr(kind, method)), (name, method)
    assert {p: len(o) for p, o in owners.items()} == {p: 1 for p in PATHS if p != "auto"}
    assert [n for n, k in KINDS.items() if k.last_resort] == ["staged"]


@pytest.mark.parametrize("name", sorted(KINDS))
def test_an_engine_runs_a_call_exactly_where_it_implements_its_method(name):
    kind = KINDS[name]
    for call, c in CALLS.items():
        if not c.engine:
            assert call in kind.calls
            continue
        implemented = not getattr(getattr(kind, c.engine), "unimplemented", False)
        assert (call in kind.calls) == implemented, (name, call)
        if implemented:
            assert getattr(kind, c.engine) is not getattr(Engine, c.engine) or c.engine in (
                "sendrecv",  # the base runs it on the engine's isend and irecv
            )


def test_code_and_tests_name_behaviour_not_issue_numbers():
    """History (which issue asked for what) lives in git; a docstring or comment says what
    the code does or what a test holds."""
    root = SRC.parents[1]
    issue = re.compile(r"\b[Ii]ssues? #?\d+|\b[Ii]tems? \d+(?:, \d+)* (?:of|against|through)\b")
    bad = [
        f"{p.relative_to(root)}:{n}"
        for top in ("src", "tests", "tools")
        for p in sorted((root / top).rglob("*.py"))
        if "fixtures" not in p.parts
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if issue.search(line)
    ]
    assert not bad, bad
