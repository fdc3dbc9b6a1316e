"""Griffe extension for the docs build: render the docstrings' Sphinx markup as Markdown.

The package's docstrings are read in the terminal (``help()``) as much as on the
site, and use a few reStructuredText forms that Markdown would print as text:

- cross-reference roles, ``:func:`remat_fn.remat```, ``:class:`~remat_fn.RematError```
  (``:mod:``, ``:class:``, ``:func:``, ``:meth:``, ``:attr:``, ``:data:``,
  ``:exc:``, ``:obj:``, ``:const:``, with or without ``py:``): each becomes the
  name in code, linked to its entry in the API reference where the site has one
  (an *optional* autorefs reference: a name the site does not document, a
  private class say, stays plain code, without a warning).  A relative name is
  resolved in the scope of the docstring's object, as Sphinx would; ``~`` shows
  the last component only, ``title <target>`` the title.
- a paragraph ending in ``::`` that introduces a literal block: the ``::``
  becomes ``:`` (the indented block after it already renders as code).

Text in fenced code blocks is left as it is.
"""

from __future__ import annotations

import html
import re
from collections.abc import Callable

import griffe

ROLE = re.compile(r":(?:py:)?(?:mod|class|func|meth|attr|data|exc|obj|const):`(?P<body>[^`]+)`")
LITERAL_INTRO = re.compile(r"(?<=\S)::$")


def split_role(body: str) -> tuple[str, str]:
    """``(title, target)`` of a role's body: ``title <target>``, ``~a.b.c`` (title ``c``),
    ``!name`` (no link in Sphinx; here the same as ``name``), ``.name`` (relative)."""
    m = re.fullmatch(r"\s*(.*?)\s*<([^<>]+)>\s*", body)
    if m and m.group(1):
        return m.group(1), m.group(2).lstrip("~!.")
    target = body.strip().lstrip("!")
    if target.startswith("~"):
        target = target[1:].lstrip(".")
        return target.rpartition(".")[2], target
    target = target.lstrip(".")
    return target, target


def render_roles(text: str, resolve: Callable[[str], str]) -> str:
    """``text`` with every cross-reference role replaced by an optional autorefs
    reference to ``resolve(target)`` around the title in code, and each ``::`` that
    introduces a literal block replaced by ``:``; fenced code blocks untouched."""
    out: list[str] = []
    lines = text.split("\n")
    fence = None
    for i, line in enumerate(lines):
        stripped = line.strip()
        if fence is None and stripped.startswith(("```", "~~~")):
            fence = stripped[:3]
        elif fence is not None:
            if stripped.startswith(fence):
                fence = None
            out.append(line)
            continue
        if fence is not None:
            out.append(line)
            continue
        line = ROLE.sub(lambda m: _reference(*split_role(m.group("body")), resolve), line)
        nxt = lines[i + 1].strip() if i + 1 < len(lines) else ""
        if LITERAL_INTRO.search(line.rstrip()) and not nxt:
            line = line.rstrip()[:-1]
        out.append(line)
    return "\n".join(out)


def _reference(title: str, target: str, resolve: Callable[[str], str]) -> str:
    identifier = html.escape(resolve(target), quote=True)
    return f'<autoref identifier="{identifier}" optional>`{title}`</autoref>'


def resolver(obj: griffe.Object) -> Callable[[str], str]:
    """Resolve a role's target as Sphinx does: an absolute path of the package as it
    is, otherwise its first component looked up in ``obj``'s scope (its members, its
    module's names and imports); a name found nowhere is kept as written."""
    root = obj.package.name

    def resolve(target: str) -> str:
        if target == root or target.startswith(root + "."):
            return target
        head, dot, rest = target.partition(".")
        try:
            path = obj.resolve(head)
        except Exception:  # NameResolutionError and anything griffe cannot follow
            return target
        return path + dot + rest

    return resolve


def _objects(obj: griffe.Object):
    yield obj
    for member in list(obj.members.values()):
        if not member.is_alias:  # an alias shares its target's docstring
            yield from _objects(member)


class SphinxRoles(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, **kwargs) -> None:
        for obj in _objects(pkg):
            doc = obj.docstring
            if doc is not None and (":`" in doc.value or "::" in doc.value):
                doc.value = render_roles(doc.value, resolver(obj))
