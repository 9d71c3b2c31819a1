"""Griffe extension for the API reference: cudampi's docstrings name other objects the way
Sphinx does (``:func:`~cudampi.comm.paths.choose```, ``:meth:`close```); the site shows them as
code, by the name a reader would type (the last part where ``~`` asks for it)."""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(
    r":(?:py:)?(?:func|meth|class|mod|data|attr|exc|obj|const|ref)[:]`(~?)([^`<]+?)"
    r"(?:\s*<[^>]+>)?`"
)


def plain(text: str) -> str:
    """Sphinx roles as Markdown code spans (pure)."""

    def code(m: re.Match[str]) -> str:
        name = m.group(2).strip()
        return f"`{name.rsplit('.', 1)[-1] if m.group(1) else name}`"

    return _ROLE.sub(code, text)


class SphinxRoles(griffe.Extension):
    def on_instance(self, *, node: Any, obj: griffe.Object, agent: Any, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = plain(obj.docstring.value)
