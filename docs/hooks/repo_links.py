"""MkDocs hook: a page's link to a file of the repository outside docs/ (an example, a tool, a
test) works where the page is read on its own (the repository's Markdown), but the site has no
such page. On the site the link becomes the file's path in the repository, as code, and one
that names no file stays a link, so that the strict build reports it."""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath
from typing import Any

_LINK = re.compile(r"(?<!!)\[([^\]\n]+)\]\(([^)\s#]+)(#[^)\s]*)?\)")
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)


def _outside_docs(target: str, page: str, docs: Path) -> str | None:
    """The repository path ``target`` names from ``page``, when it leaves docs/ and exists."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("/"):
        return None
    where = (docs / PurePosixPath(page).parent / target).resolve()
    root = docs.parent.resolve()
    if where.is_relative_to(docs.resolve()) or not where.is_relative_to(root):
        return None
    return where.relative_to(root).as_posix() if where.exists() else None


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    docs = Path(config["docs_dir"])

    def swap(m: re.Match[str]) -> str:
        path = _outside_docs(m.group(2), page.file.src_uri, docs)
        if path is None:
            return m.group(0)
        text = m.group(1)
        return (
            f"`{path}`"
            if text.strip("`") == path.rsplit("/", 1)[-1] or text.strip("`") == path
            else f"{text} (`{path}`)"
        )

    out, last = [], 0
    for fence in _FENCE.finditer(markdown):
        out.append(_LINK.sub(swap, markdown[last : fence.start()]))
        out.append(fence.group(0))
        last = fence.end()
    out.append(_LINK.sub(swap, markdown[last:]))
    return "".join(out)
