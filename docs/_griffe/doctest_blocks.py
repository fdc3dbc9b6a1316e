"""Griffe extension for the docs build: render bare ``>>>`` doctest blocks as code.

The package's docstrings carry runnable ``>>>`` examples (they are doctested).
Outside the Google-style sections griffe parses itself (``Examples:``, plural, is
one of them), Markdown would render them as prose: ``>>>`` as three nested block
quotes, ``['argument']`` in an expected output as a broken reference link.  That
includes ``Example:`` (singular) and ``Note:``, which griffe renders as admonitions
with Markdown bodies.  This extension fences each run of doctest lines (a ``>>>``
line, its ``...`` continuations and the expected output up to a blank line) as
``pycon``.
"""

from __future__ import annotations

import re

import griffe

# the sections griffe's Google parser parses (their doctests are its business);
# any other ``Title:`` section (Example, Note, Warning, ...) is an admonition
_SECTION = re.compile(
    r"^\s*(Examples|Args|Arguments|Params|Parameters|Keyword Args|Keyword Arguments|Other Args|"
    r"Other Arguments|Other Params|Other Parameters|Raises|Exceptions|Returns|Yields|Receives|"
    r"Attributes|Functions|Methods|Classes|Modules|Warns|Warnings):\s*$"
)


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
