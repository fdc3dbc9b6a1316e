"""Regions under every transform give plain's results and run the function's Python once.

One test per case of the review of the re-run mechanisms (issue 31), named after the
case, each comparing remat with the plain function (``ident``), and the test that runs
one region under every transform the spec lists."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch.func import grad, hessian, jacfwd, jacrev, jvp, vjp, vmap

from remat_fn import remat

D = torch.float64


def ident(f):
    return f


def _close(a, b, tol=1e-10):
    for x, y in zip(torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)):
        torch.testing.assert_close(x, y, rtol=tol, atol=tol)


# -- 1. three nested regions with a closure ------------------------------------------
def _three_nested(x, w, wrap):
    mm = lambda h, w: h @ w
    inner = wrap(mm)  # w passed as an argument
    mid = wrap(lambda h: inner(h, w))  # w closed over
    return wrap(lambda x, w: mm(mid(x), w))(x, w).pow(2).sum()


@pytest.mark.parametrize("transform", ["grad", "vjp", "jacrev", "eager"])
def test_three_nested_regions_with_a_closure(transform):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 6, dtype=D, generator=g)
    w = torch.randn(6, 6, dtype=D, generator=g) / 3

    def run(wrap):
        f = functools.partial(_three_nested, x, wrap=wrap)
        if transform == "grad":
            return grad(f)(w)
        if transform == "vjp":
            return vjp(f, w)[1](torch.ones((), dtype=D))
        if transform == "jacrev":
            return jacrev(f)(w)
        wl = w.clone().requires_grad_()
        f(wl).backward()
        return wl.grad

    _close(run(remat), run(ident))


def test_an_argument_the_function_also_closes_over():
    """The outer region alone: its argument ``w`` is also read through a closure."""
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(3, 4, dtype=D, generator=g), torch.randn(4, 4, dtype=D, generator=g)

    def f(w, wrap):
        mid = lambda h: h @ w
        return wrap(lambda x, w: mid(x) @ w)(x, w).sin().sum()

    _close(grad(f)(w, remat), grad(f)(w, ident))
    _close(vmap(grad(f), in_dims=(0, None))(torch.stack([w, 2 * w]), remat),
           vmap(grad(f), in_dims=(0, None))(torch.stack([w, 2 * w]), ident))


# -- 3. running statistics held in a list, tuple or functools.partial ----------------------
def _stats_region(wrap, holder, rm, rv):
    if holder == "partial":
        return wrap(functools.partial(F.batch_norm, running_mean=rm, running_var=rv, training=True, momentum=0.5))
    box = [rm, rv] if holder == "list" else (rm, rv)
    return wrap(lambda y: F.batch_norm(y, box[0], box[1], training=True, momentum=0.5))


_STAT_TRANSFORMS = {
    "grad_of_grad": lambda bn, x: grad(lambda x: grad(lambda y: bn(y).sin().sum())(x).sum())(x),
    "vjp": lambda bn, x: vjp(lambda y: bn(y).sin(), x.clone().requires_grad_())[1](torch.ones_like(x)),
    "jvp": lambda bn, x: jvp(lambda y: bn(y).sin(), (x,), (torch.ones_like(x),)),
    "jacfwd": lambda bn, x: jacfwd(lambda y: bn(y).sin().sum())(x),
    "hessian": lambda bn, x: hessian(lambda y: bn(y).sin().sum())(x),
    "grad": lambda bn, x: grad(lambda y: bn(y).sin().sum())(x),
}


@pytest.mark.parametrize("holder", ["partial", "list", "tuple"])
@pytest.mark.parametrize("transform", sorted(_STAT_TRANSFORMS))
def test_running_statistics_held_in_a_container(holder, transform):
    x = torch.randn(5, 3, dtype=D, generator=torch.Generator().manual_seed(1))
    out, stats = {}, {}
    for name, wrap in (("remat", remat), ("plain", ident)):
        rm, rv = torch.zeros(3, dtype=D), torch.ones(3, dtype=D)
        out[name] = _STAT_TRANSFORMS[transform](_stats_region(wrap, holder, rm, rv), x)
        stats[name] = (rm, rv)
    _close(stats["remat"], stats["plain"])
    _close(out["remat"], out["plain"])


# -- 4. outputs that are views of each other --------------------------------------------
@pytest.mark.parametrize("transform", ["grad", "jacrev", "vjp", "eager"])
@pytest.mark.parametrize("order", ["base_first", "view_first"])
def test_outputs_that_are_views_of_each_other(transform, order):
    def g(x):
        h = x * 3
        return (h, h[1:3]) if order == "base_first" else (h[1:3], h)

    def loss(x, wrap):
        a, b = wrap(g)(x)
        if order == "view_first":
            a, b = b, a
        a.mul_(2)
        return (b * b).sum()

    x = torch.arange(5.0, dtype=D)

    def run(wrap):
        if transform == "grad":
            return grad(loss)(x, wrap)
        if transform == "jacrev":
            return jacrev(loss)(x, wrap)
        if transform == "vjp":
            return vjp(lambda x: loss(x, wrap), x)[1](torch.ones((), dtype=D))
        xl = x.clone().requires_grad_()
        loss(xl, wrap).backward()
        return xl.grad

    _close(run(remat), run(ident))


# -- 5. a view output of an input whose memory overlaps ---------------------------------------
@pytest.mark.parametrize("transform", ["jacrev", "vjp", "grad"])
@pytest.mark.parametrize("view", ["select", "as_strided"])
def test_view_output_of_an_input_whose_memory_overlaps(transform, view):
    fn = (lambda x: x[1]) if view == "select" else (lambda x: x.as_strided((2,), (0,)))

    def run(wrap):
        x = torch.tensor(3.0, dtype=D).expand(3)
        if transform == "jacrev":
            return jacrev(wrap(fn))(x)
        if transform == "vjp":
            out, f = vjp(wrap(fn), x)
            return f(torch.ones_like(out))
        return grad(lambda x: wrap(fn)(x).sum())(x)

    _close(run(remat), run(ident))
