"""MkDocs hook: where code spans inside tables may wrap.

Code in a table cell wraps only at spaces and at the ``<wbr>`` break points this
hook adds (docs/stylesheets/extra.css turns off Material's break-anywhere, which
let a narrow column cut ``everything_saveable`` into ``everything_saveabl`` / ``e``):

- in a row's first cell, the name the row is about (``dots_with_no_batch_dims_saveable``,
  a parameter's name) stays whole if it has at most 34 characters, as every policy name has (a longer one, a
  test's name say, may break after ``_``); a signature may break after its ``(``;
- in the other cells, an identifier may also break after ``_`` and ``.`` and between
  the words of a CamelCase name (``jax.`` / ``checkpoint_`` / ``policies``,
  ``RecomputeMismatch`` / ``Error``), never inside a word.

Measured on the migration page's four-column table at a 1280-pixel window: with
whole names everywhere the narrowest the table can get is 800 pixels in a
688-pixel column, and it scrolls sideways.
"""

from __future__ import annotations

import re

TABLE = re.compile(r"<table\b.*?</table>", re.S)
ROW = re.compile(r"<tr\b.*?</tr>", re.S)
CELL = re.compile(r"<t([dh])\b.*?</t\1>", re.S)
CODE = re.compile(r"(<code\b[^>]*>)([^<]*)(</code>)")
# after a ``_`` or ``.`` that follows a letter or digit (not the one of ``_private``),
# after ``(`` unless ``()``, and at a lower-to-upper-case step
IDENTIFIER_BREAKS = re.compile(r"(?<=\w[_.])(?=[^)_.])|(?<=\()(?=[^)])|(?<=[a-z])(?=[A-Z])")
LONG_NAME = re.compile(r"[\w.*]{35,}")


def _name_breaks(code: str) -> str:
    code = LONG_NAME.sub(lambda m: re.sub(r"(?<=\w_)(?=[^_])", "<wbr>", m.group(0)), code)
    return re.sub(r"(\()(?=[^)])", r"\1<wbr>", code)


def _identifier_breaks(code: str) -> str:
    return IDENTIFIER_BREAKS.sub("<wbr>", code)


def _code_breaks(cell: str, breaks) -> str:
    return CODE.sub(lambda m: m.group(1) + breaks(m.group(2)) + m.group(3), cell)


def _row(row: str) -> str:
    cells = iter(range(1_000_000))
    return CELL.sub(lambda c: _code_breaks(c.group(0), _name_breaks if next(cells) == 0 else _identifier_breaks),
                    row)


def add_breaks(html: str) -> str:
    return TABLE.sub(lambda t: ROW.sub(lambda r: _row(r.group(0)), t.group(0)), html)


def on_page_content(html: str, **kwargs) -> str:
    return add_breaks(html)
