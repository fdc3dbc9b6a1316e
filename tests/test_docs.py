"""Every Python code block in README.md and docs/*.md runs, so the docs cannot
drift from the code.  The blocks of one file run in order in one namespace, like
a notebook; a block may rely on names an earlier block of the same file defined.
A few names the prose introduces without defining (a model's ``block``, a
batch) are provided by the small per-file setup below, written as a reader
would."""

from __future__ import annotations

import contextlib
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
FILES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)

SETUP = """
import torch
import remat_fn
from remat_fn import remat, policies, checkpoint_name
torch.manual_seed(0)
"""


# Names the prose of a page introduces without defining them.
PAGE_SETUP = {
    "docs/migration.md": """
block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
x = torch.randn(4, 8, requires_grad=True)
""",
    "docs/policies.md": """
def block(x, w1, w2):
    return x + torch.tanh(x @ w1) @ w2
""",
    "docs/random.md": """
batch, seed, step = 4, 0, 0
xs = torch.randn(batch, 512)
""",
    "docs/transform.md": """
from remat_fn import random as rnd
some_module = torch.nn.Linear(4, 4)
class _Obj:
    def method(self, x, n):
        return x * n
obj = _Obj()
steps, w, x = 2, torch.randn(8, 8), torch.randn(4, 8)
def model(x, key):
    return block(x, w, rnd.fold_in(key, 0)).sum()
""",
}


def blocks(path):
    return BLOCK.findall((ROOT / path).read_text())


@pytest.mark.parametrize("path", [f for f in FILES if blocks(f)])
def test_python_blocks_run(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TQDM_DISABLE", "1")
    if path in ("docs/migration.md", "docs/recipes.md"):
        pytest.importorskip("transformers")
    ns: dict = {"__name__": "__docs__"}
    exec(compile(SETUP + PAGE_SETUP.get(path, ""), "<setup>", "exec"), ns)
    with _process_group() if path == "docs/distributed.md" else _nothing():
        for i, code in enumerate(blocks(path)):
            try:
                exec(compile(code, f"{path}[block {i}]", "exec"), ns)
            except Exception as e:  # pragma: no cover - the failure message is the point
                raise AssertionError(f"{path}, python block {i} failed: {e!r}\n{code}") from e


@contextlib.contextmanager
def _nothing():
    yield


@contextlib.contextmanager
def _process_group():
    """A one-rank gloo group: the distributed page's code runs as on rank 0."""
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


# -- links to a heading use explicit ids ------------------------------------------------
# A heading's generated id depends on the Markdown toolchain's slugify (code spans,
# punctuation) and changes when the heading does; a link to one broke the strict
# docs build.  So every `page.md#anchor` (and `#anchor`) link must target an id the
# target page defines itself: `## Title {#anchor}` (attr_list), an HTML `id=`/`name=`,
# or, on a mkdocstrings page, the dotted path of an object it documents (`:::`).

LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]*#[^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)|href=\"([^\"]*#[^\"]*)\"")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
EXPLICIT_ID = re.compile(r"\{:?[^}\n]*?#([A-Za-z][\w.:-]*)[^}\n]*\}|\b(?:id|name)=[\"']([^\"']+)[\"']")
DIRECTIVE = re.compile(r"^:::\s+([\w.]+)", re.M)


def _explicit_anchors(page: pathlib.Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    ids = {a or b for a, b in EXPLICIT_ID.findall(text)}
    for obj in DIRECTIVE.findall(text):  # mkdocstrings: the object and its members
        ids.add(obj)
    return ids


def _documented_object(anchor: str, page: pathlib.Path) -> bool:
    """``anchor`` is the path of an object a ``:::`` directive of ``page`` renders."""
    import importlib

    roots = DIRECTIVE.findall(page.read_text())
    if not any(anchor == r or anchor.startswith(r + ".") for r in roots):
        return False
    parts = anchor.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for name in parts[i:]:
                obj = getattr(obj, name)
        except AttributeError:
            return False
        return True
    return False


def broken_anchor_links(root: pathlib.Path, files: list[str]) -> list[str]:
    """``file: target`` for every link to an anchor its target page does not define explicitly."""
    bad = []
    for f in files:
        src = root / f
        text = FENCE.sub("", src.read_text())
        for m in LINK.finditer(text):
            target = m.group(1) or m.group(2)
            if re.match(r"[a-z]+:", target):  # http(s):, mailto:: not ours
                continue
            path, _, anchor = target.partition("#")
            page = (src.parent / path).resolve() if path else src
            if not page.is_file():
                bad.append(f"{f}: {target} (no such page)")
            elif anchor not in _explicit_anchors(page) and not _documented_object(anchor, page):
                bad.append(f"{f}: {target}")
    return bad


def test_anchor_links_target_explicit_ids():
    bad = broken_anchor_links(ROOT, FILES)
    assert not bad, (
        "links to anchors the target page does not define explicitly (generated heading ids "
        "change with the heading and the toolchain): give the heading an id, `## Title {#id}`, "
        "and link to that:\n  " + "\n  ".join(bad)
    )


def test_anchor_link_check_catches_generated_ids(tmp_path):
    (tmp_path / "a.md").write_text(
        "# A\n\n## Policies vs `torch.utils.checkpoint`\n\n## Explicit {#explicit}\n\n"
        '<a id="html-id"></a>\n\n::: remat_fn.nn\n\n```python\n# [not a link](b.md#nowhere)\n```\n'
    )
    (tmp_path / "b.md").write_text(
        "[ok](a.md#explicit) [ok](a.md#html-id) [ok](#here) [ok](a.md#remat_fn.nn.apply_remat)\n"
        "[web](https://example.org/x#y)\n\n## Here {#here}\n\n"
        "[bad](a.md#policies-vs-torchutilscheckpoint) [bad](#missing) [bad](c.md#x) "
        "[bad](a.md#remat_fn.nn.no_such_function)\n"
    )
    assert broken_anchor_links(tmp_path, ["a.md", "b.md"]) == [
        "b.md: a.md#policies-vs-torchutilscheckpoint", "b.md: #missing",
        "b.md: c.md#x (no such page)", "b.md: a.md#remat_fn.nn.no_such_function",
    ]


# -- printed outputs shown in the docs are what the code prints ---------------------------


def test_policies_page_printed_residuals_are_real(tmp_path, monkeypatch):
    """The ``>>>`` session on policies.md, run as a doctest: ``block`` from the page's
    "Naming values" block saved as ``model.py`` (so source lines read ``model.py:4``),
    with ``x`` 8x16, ``w1`` 16x32, ``w2`` 32x16 as the prose says."""
    import doctest
    import importlib.util

    import torch

    import remat_fn
    from remat_fn import policies

    text = (ROOT / "docs/policies.md").read_text()
    (model_src,) = [b for b in blocks("docs/policies.md") if "def block" in b]
    (tmp_path / "model.py").write_text(model_src)
    monkeypatch.chdir(tmp_path)
    spec = importlib.util.spec_from_file_location("model", "model.py")
    model = importlib.util.module_from_spec(spec)
    model.torch = torch  # the page imports torch in an earlier block
    spec.loader.exec_module(model)
    sessions = [b for b in re.findall(r"^```text\n(.*?)^```", text, re.S | re.M) if b.startswith(">>>")]
    assert sessions and "dots_saveable" in sessions[0]
    globs = dict(torch=torch, remat_fn=remat_fn, policies=policies, block=model.block,
                 x=torch.randn(8, 16), w1=torch.randn(16, 32), w2=torch.randn(32, 16))
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    for i, session in enumerate(sessions):
        test = doctest.DocTestParser().get_doctest(session, dict(globs), f"docs/policies.md[text {i}]",
                                                   "docs/policies.md", 0)
        result = runner.run(test, out=lambda s: pytest.fail("docs/policies.md shows an output the code does not print:\n" + s))
        assert result.attempted >= 3 and result.failed == 0


def test_recipes_functional_loop_dropout_follows_eval():
    """The functional-training recipe's ``net.eval()`` turns its key-based dropout
    off (``rnd.dropout`` defaults to ``training=True``), and ``train()`` back on.
    Runs the recipe alone: no transformers needed."""
    (code,) = [b for b in blocks("docs/recipes.md") if "class Net" in b and "net.eval()" in b]
    ns: dict = {"__name__": "__docs__"}
    exec(compile(SETUP + code, "docs/recipes.md[functional loop]", "exec"), ns)
    torch, rnd, net, params, x = ns["torch"], ns["rnd"], ns["net"], ns["params"], ns["x"]
    call = ns["functional_call"]
    assert net.training
    with torch.no_grad():
        assert not torch.equal(call(net, params, (x, rnd.key(1))), call(net, params, (x, rnd.key(2))))
        net.eval()
        out = call(net, params, (x, rnd.key(1)))
        assert torch.equal(out, call(net, params, (x, rnd.key(2))))
        net.load_state_dict(params)
        for b in net.blocks:  # no dropout at all: the plain residual MLP
            x = x + b.fc2(torch.relu(b.fc1(x)))
        torch.testing.assert_close(out, x)


# -- the API reference's rendering (docs/_griffe, docs/_hooks) ----------------------------


def _docs_module(relpath: str, name: str):
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(name, ROOT / relpath)
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, mod)
    spec.loader.exec_module(mod)
    return mod


def test_sphinx_roles_render_as_references():
    """docs/_griffe/sphinx_roles.py: ``:func:`x``` and friends become the name in code
    inside an optional autorefs reference (a link where the site documents it, plain
    code otherwise), ``~`` keeps the last component, ``::`` before a literal block
    becomes ``:``; fenced code is left alone."""
    pytest.importorskip("griffe")
    roles = _docs_module("docs/_griffe/sphinx_roles.py", "_docs_sphinx_roles")
    resolve = {"RegionStats": "remat_fn._profile.RegionStats"}.get
    out = roles.render_roles(
        "See :func:`remat_fn.remat`, :class:`~remat_fn.RematError` and :class:`RegionStats`;\n"
        ":py:meth:`title <remat_fn.Profile.table>` too. A literal block::\n\n    code\n\n"
        "```pycon\n>>> ':func:`kept`'\n```",
        lambda t: resolve(t, t))
    assert out == (
        'See <autoref identifier="remat_fn.remat" optional>`remat_fn.remat`</autoref>, '
        '<autoref identifier="remat_fn.RematError" optional>`RematError`</autoref> and '
        '<autoref identifier="remat_fn._profile.RegionStats" optional>`RegionStats`</autoref>;\n'
        '<autoref identifier="remat_fn.Profile.table" optional>`title`</autoref> too. A literal block:\n\n'
        "    code\n\n```pycon\n>>> ':func:`kept`'\n```")


def test_doctests_in_example_admonitions_are_fenced():
    """docs/_griffe/doctest_blocks.py: a ``>>>`` session under ``Example:`` (an
    admonition for griffe, Markdown inside) is fenced; ``Examples:`` is griffe's own."""
    pytest.importorskip("griffe")
    blocks = _docs_module("docs/_griffe/doctest_blocks.py", "_docs_doctest_blocks")
    doc = "Summary.\n\nExample:\n    >>> 1 + 1\n    2\n\nExamples:\n    >>> 2\n    2\n"
    assert blocks.fence_doctests(doc) == (
        "Summary.\n\nExample:\n    ```pycon\n    >>> 1 + 1\n    2\n    ```\n\nExamples:\n    >>> 2\n    2")


def test_table_code_breaks_between_words_only():
    """docs/_hooks/code_breaks.py: in tables, a row's name (first cell) stays whole up
    to 34 characters, its arguments may start a new line; other cells break between
    the parts of an identifier, never inside a word; code outside tables is untouched."""
    hook = _docs_module("docs/_hooks/code_breaks.py", "_docs_code_breaks")
    html = ("<p><code>a_b</code></p><table><tr><th><code>run_it()</code></th></tr>"
            "<tr><td><code>dots_with_no_batch_dims_saveable</code> <code>offload_inputs(policy=None)</code> "
            "<code>test_checkpoint_warns_if_use_reentrant_not_passed</code></td>"
            "<td><code>jax.checkpoint_policies</code> <code>RecomputeMismatchError</code> "
            "<code>_saved_result</code> <code>f()</code></td></tr></table>")
    assert hook.add_breaks(html) == (
        "<p><code>a_b</code></p><table><tr><th><code>run_it()</code></th></tr>"
        "<tr><td><code>dots_with_no_batch_dims_saveable</code> <code>offload_inputs(<wbr>policy=None)</code> "
        "<code>test_<wbr>checkpoint_<wbr>warns_<wbr>if_<wbr>use_<wbr>reentrant_<wbr>not_<wbr>passed</code></td>"
        "<td><code>jax.<wbr>checkpoint_<wbr>policies</code> <code>Recompute<wbr>Mismatch<wbr>Error</code> "
        "<code>_saved_<wbr>result</code> <code>f()</code></td></tr></table>")
