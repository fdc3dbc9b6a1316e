"""Griffe extension for the docs build: render bare ``>>>`` doctest blocks as code.

The package's docstrings carry runnable ``>>>`` examples (they are doctested).
Outside a Google-style ``Example:`` section, Markdown would render them as prose,
so ``['argument']`` in an expected output becomes a broken reference link.  This
extension fences each run of doctest lines (a ``>>>`` line, its ``...``
continuations and the expected output up to a blank line) as ``pycon``.
"""

from __future__ import annotations

import re

import griffe

_SECTION = re.compile(r"^\s*(Examples?|Args|Arguments|Returns|Raises|Yields|Note|Notes):\s*$")


def fence_doctests(text: str) -> str:
    out: list[str] = []
    lines = text.splitlines()
    i, in_section, in_fence = 0, False, False
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        if stripped.startswith("```"):
            in_fence = not in_fence
        if _SECTION.match(line):
            in_section = True
        elif stripped and not line.startswith((" ", "\t")):
            in_section = False
        if not in_fence and not in_section and stripped.startswith(">>>"):
            indent = line[: len(line) - len(line.lstrip())]
            block = []
            while i < len(lines) and lines[i].strip():
                block.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i].strip())
                i += 1
            out += [indent + "```pycon", *(indent + b for b in block), indent + "```"]
            continue
        out.append(line)
        i += 1
    return "\n".join(out)


class DoctestBlocks(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None and ">>>" in obj.docstring.value:
            obj.docstring.value = fence_doctests(obj.docstring.value)
