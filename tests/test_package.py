"""The package surface (lazy submodules, early policy errors) and its layout."""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys
import tokenize

import pytest
import torch

import remat_fn
from remat_fn import PolicyError, policies, remat


def _prints_ok(code: str) -> None:
    """``code`` run in a fresh Python process succeeds and prints ``ok``."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_submodules_reachable_after_import_and_loaded_lazily():
    code = (
        "import sys, remat_fn\n"
        "lazy = ['random', 'compat', 'nn', 'distributed']\n"
        "assert not any(f'remat_fn.{m}' in sys.modules for m in lazy), sorted(sys.modules)\n"
        "assert remat_fn.random.key(0).shape == (2,)\n"
        "assert callable(remat_fn.compat.checkpoint) and callable(remat_fn.nn.remat_module)\n"
        "assert callable(remat_fn.distributed.remat)\n"
        "assert remat_fn.policies is remat_fn.checkpoint_policies\n"
        "assert 'distributed' in dir(remat_fn)\n"
        "print('ok')\n"
    )
    _prints_ok(code)


def test_import_and_eager_regions_do_not_load_the_compiler():
    # torch._dynamo costs 1.3-1.9 s to import (docs/benchmarks.md#import-time): it
    # loads when torch.compile is first used, not with remat_fn nor at a region's
    # first call (torch's wrapper of a dispatch mode imports it at the first op)
    code = (
        "import sys, torch, remat_fn, remat_fn.nn, remat_fn.compat, remat_fn.random\n"
        "assert 'torch._dynamo' not in sys.modules, 'import remat_fn imported torch._dynamo'\n"
        "x = torch.randn(4, 4, requires_grad=True)\n"
        "f = lambda x: torch.tanh(x @ x).sin().sum()\n"
        "for g in (remat_fn.remat(f), remat_fn.remat(f, policy=remat_fn.policies.dots_saveable)):\n"
        "    torch.testing.assert_close(torch.autograd.grad(g(x), x), torch.autograd.grad(f(x), x))\n"
        "remat_fn.compat.checkpoint(f, x, use_reentrant=False).backward()\n"
        "remat_fn.nn.remat_module(torch.nn.Linear(4, 4))(x).sum().backward()\n"
        "remat_fn.saved_residuals(remat_fn.remat(f), x)\n"
        "assert 'torch._dynamo' not in sys.modules, 'a region imported torch._dynamo'\n"
        "c = torch.compile(remat_fn.remat(f), backend='eager', fullgraph=True)\n"
        "torch.testing.assert_close(torch.autograd.grad(c(x), x), torch.autograd.grad(f(x), x))\n"
        "print('ok')\n"
    )
    _prints_ok(code)


def test_unknown_attribute_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        remat_fn.nope  # noqa: B018


@pytest.mark.parametrize("bad,match", [
    (policies.save_only_these_names, r"factory.*save_only_these_names\(\.\.\.\)"),
    (policies.memory_budget, r"factory.*memory_budget\(\.\.\.\)"),
    ("dots_saveable", r"string 'dots_saveable'.*policies\.dots_saveable"),
    ("no_such_policy", r"string 'no_such_policy'"),
    (3, r"got int 3.*Fix"),
])
def test_misused_policies_are_refused_when_remat_is_built(bad, match):
    with pytest.raises(PolicyError, match=match):
        remat(lambda x: x, policy=bad)  # refused here, not at the first call
    with pytest.raises(PolicyError, match=match):
        remat(policy=bad)


# ---------------------------------------------------------------------------
# Layout: what the package holds and how its modules depend on each other
# ---------------------------------------------------------------------------

PKG = pathlib.Path(remat_fn.__file__).parent


def _modules() -> dict[str, ast.Module]:
    return {p.stem: ast.parse(p.read_text()) for p in sorted(PKG.glob("*.py"))}


def _own_imports(tree: ast.Module) -> list[tuple[str, list[str], bool]]:
    """``(module, imported names, at module top)`` of every import of a package module,
    function-level imports included."""
    top = set(map(id, tree.body))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            names = [a.name for a in node.names]
            if node.module is None:  # from . import x
                out += [(n, [], id(node) in top) for n in names]
            else:
                out.append((node.module.split(".")[0], names, id(node) in top))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("remat_fn."):
            out.append((node.module.split(".")[1], [a.name for a in node.names], id(node) in top))
    return out


def test_no_import_cycle_among_the_package_modules():
    graph = {m: {dep for dep, _, _ in _own_imports(t) if dep != m} for m, t in _modules().items()}
    done: set[str] = set()

    def visit(m, path):
        if m in path:
            raise AssertionError("import cycle: " + " -> ".join([*path[path.index(m):], m]))
        if m in done:
            return
        for dep in graph.get(m, ()):
            visit(dep, [*path, m])
        done.add(m)

    for m in graph:
        visit(m, [])


def test_imports_at_module_top_and_no_private_names_across_modules():
    for m, tree in _modules().items():
        for dep, names, at_top in _own_imports(tree):
            assert at_top, f"remat_fn/{m}.py imports remat_fn.{dep} inside a function"
            private = [n for n in names if n.startswith("_")]
            assert not private, f"remat_fn/{m}.py imports private names {private} from remat_fn.{dep}"


def test_modules_are_small_and_hold_only_the_library():
    for p in PKG.glob("*.py"):
        text = p.read_text()
        assert len(text.splitlines()) <= 650, f"{p.name} has {len(text.splitlines())} lines"
        for needle in ("matplotlib", "argparse", "tqdm"):
            assert needle not in text, f"{p.name} mentions {needle}: tooling belongs outside the package"


_PRIVATE_TORCH = re.compile(
    r"\btorch\s*\.\s*_|\btorch\.utils\._|\btorch\.autograd\.forward_ad\._|\._schema\b|\._version\b|\._is_view\b"
    r"|\._use_count\b|\b_saved_tensors|\b_CachingTorchDispatchMode\b|\bforward_ad\._")


def _code_only(path) -> str:
    """The module's source without comments and string literals (docstrings name internals)."""
    out = []
    with open(path, "rb") as f:
        for tok in tokenize.tokenize(f.readline):
            if tok.type in (tokenize.COMMENT, tokenize.STRING, tokenize.ENCODING):
                continue
            if sys.version_info >= (3, 12) and tok.type in (tokenize.FSTRING_START, tokenize.FSTRING_MIDDLE,
                                                           tokenize.FSTRING_END):
                continue
            out.append(tok.string)
    return " ".join(out).replace(" . ", ".").replace(" .", ".").replace(". ", ".")


def test_private_torch_internals_are_reached_from_one_module():
    """NOTE-style home for torch internals: remat_fn/_torch_internals.py checks each at
    import; every other module goes through it."""
    offenders = {}
    for p in PKG.glob("*.py"):
        if p.name == "_torch_internals.py":
            continue
        hits = sorted(set(m.group(0) for m in _PRIVATE_TORCH.finditer(_code_only(p))))
        if hits:
            offenders[p.name] = hits
    assert not offenders, f"private torch internals outside remat_fn/_torch_internals.py: {offenders}"


def test_a_missing_internal_names_the_torch_version_and_the_fix():
    code = ("import torch; del torch._C._autograd._top_saved_tensors_default_hooks\n"
            "try:\n    import remat_fn\nexcept ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "remat_fn needs torch._C._autograd._top_saved_tensors_default_hooks" in out.stdout, out.stderr
    assert torch.__version__ in out.stdout and "pip install 'torch>=" in out.stdout


# modules that answer questions about torch objects and hold no region's state: they import only each other
_HELPERS = {"_torch_internals", "_functorch", "_ops", "_pytree", "_describe", "_capture_ops", "_ambient", "_errors"}

_ENTERED = r"""
import collections, sys, torch
from torch.func import grad
import remat_fn
w = torch.randn(8, 8)
f = remat_fn.remat(lambda x: torch.tanh(x @ w).sin())
x = torch.randn(4, 8)
xg = x.clone().requires_grad_()
runs = {"eager": lambda: f(xg).sum().backward(), "grad": lambda: grad(lambda x: f(x).sum())(x)}
for name, run in runs.items():
    run()  # (first calls load and cache)
    edges = collections.defaultdict(set)
    def prof(frame, event, arg):
        if event == "call" and (mod := frame.f_globals.get("__name__", "")).startswith("remat_fn."):
            caller = frame.f_back
            while caller is not None and not caller.f_globals.get("__name__", "").startswith(("remat_fn.", "__main__")):
                caller = caller.f_back
            edges[caller.f_globals["__name__"] if caller is not None else ""].add(mod)
    sys.setprofile(prof)
    run()
    sys.setprofile(None)
    mods = sorted({m.split(".")[1] for ms in edges.values() for m in ms})
    both = sorted((a, b) for a in edges for b in edges[a] if a in edges.get(b, ()) and a < b)
    print(name, " ".join(mods), "|", both)
"""


def test_one_call_enters_few_modules_and_none_call_each_other_both_ways():
    """An eager call + backward enters at most 6 of the package's modules besides the helpers, a
    ``torch.func.grad`` call at most 10 (24 of all before the region lifecycle's state joined
    ``_region`` and the policy record's plan left the tape); no two call each other both ways."""
    for m, tree in _modules().items():
        if m in _HELPERS:
            deps = {dep for dep, _, _ in _own_imports(tree)} - {m}
            assert deps <= _HELPERS, f"the helper {m} imports {deps - _HELPERS}"
    out = subprocess.run([sys.executable, "-c", _ENTERED], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.strip().splitlines())
    for name, most in (("eager", 6), ("grad", 10)):
        mods, both = lines[name].split(" | ")
        own = [m for m in mods.split() if m not in _HELPERS]
        assert len(own) <= most, f"{name}: {len(own)} modules: {own}"
        assert both == "[]", f"{name}: modules calling each other both ways: {both}"
