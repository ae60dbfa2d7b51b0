"""mkdocs hooks: the site's home page is README.md, and links to the repository's other files (code, results,
configs, notebooks) lead to them on GitHub, where the site cannot serve them."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
REPOSITORY = "https://github.com/revlib-xla/revlib_xla/blob/main/"
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _rewrite(markdown: str, to_repository: str, to_docs: str) -> str:
    """Links starting with ``to_repository`` (relative to the repository root) point at GitHub; those starting with
    ``to_docs`` lose that prefix (they are pages of the site)."""

    def link(match: re.Match[str]) -> str:
        target = match.group(1)
        if target.startswith(("http://", "https://", "mailto:", "#")):
            return match.group(0)
        if to_docs and target.startswith(to_docs):
            return f"]({target[len(to_docs) :]})"
        if target.startswith(to_repository):
            return f"]({REPOSITORY}{target[len(to_repository) :]})"
        return match.group(0)

    return _LINK.sub(link, markdown)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if page.file.src_uri == "index.md":
        return _rewrite((ROOT / "README.md").read_text(encoding="utf-8"), "", "docs/")
    return _rewrite(markdown, "../", "")
