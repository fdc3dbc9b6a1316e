"""A tensor the region closes over that is also, one transform level down, its argument.

``grad(f)(u)`` with ``f`` closing over ``u``, which an outer ``grad`` (or eager autograd) differentiates:
the argument ``w`` is ``u`` wrapped at the inner level, the closed-over ``u`` is not, and below the
wrappers both are one tensor.  The recorded forward read both as that tensor, so a replay took the
closed-over one for the argument (``u * w`` differentiated as ``w * w``: 0.90 off under ``grad`` of
``grad`` and eager autograd around ``grad``), and an output returning ``u`` (as is, or a view of it) was
rebuilt as a view of the argument (67.9 off under ``vmap`` of ``grad`` of ``grad``; found by a hostile
pass).  The Function now gets the closed-over tensor as a view of itself, and an output is rebuilt as a
view of the input the function made it from.  Every case compares with the plain function.
"""

from __future__ import annotations

import pytest
import torch
from torch.func import grad, hessian, jacfwd, jacrev, jvp, vjp, vmap

from remat_fn import remat

from ._util import assert_tree_close, ident

D = torch.float64
_G = torch.Generator().manual_seed(52)
_W = torch.randn(4, 4, dtype=D, generator=_G) / 2
_XS = torch.randn(3, 2, 4, dtype=D, generator=_G)


def _region(kind: str, u, x):
    if kind == "times":
        return lambda w: ((u * w).sin().sum(), None)
    if kind == "as_is":
        return lambda w: ((x @ w).tanh().sum(), u)
    if kind == "view":
        return lambda w: ((x @ w).tanh().sum(), u[1:])
    if kind == "both":
        return lambda w: ((x @ w @ u).tanh().sum(), u.T)
    raise AssertionError(kind)


def _inner_grad(kind, wrap, u, x):
    g = wrap(_region(kind, u, x))

    def inner(w):
        a, b = g(w)
        return a if b is None else a * b.sum() + (b * w[-b.shape[0]:]).sum()
    return grad(inner)(u)


_COMPOSITIONS = {
    "grad_of_grad": lambda kind, wrap: grad(lambda u: _inner_grad(kind, wrap, u, _XS[0]).sin().sum())(_W),
    "eager_around_grad": lambda kind, wrap: _eager(kind, wrap),
    "vmap_of_grad_of_grad": lambda kind, wrap: vmap(lambda x: grad(lambda u: _inner_grad(kind, wrap, u, x).sin().sum())(_W))(_XS),
    "jacrev_of_grad": lambda kind, wrap: jacrev(lambda u: _inner_grad(kind, wrap, u, _XS[0]).sin().sum(0))(_W),
    "vjp_of_grad": lambda kind, wrap: vjp(lambda u: _inner_grad(kind, wrap, u, _XS[0]), _W)[1](torch.ones_like(_W))[0],
    "jvp_of_grad": lambda kind, wrap: jvp(lambda u: _inner_grad(kind, wrap, u, _XS[0]), (_W,), (torch.ones_like(_W),))[1],
    "jacfwd_of_grad": lambda kind, wrap: jacfwd(lambda u: _inner_grad(kind, wrap, u, _XS[0]).sin().sum(0))(_W),
    "hessian_of_grad_sum": lambda kind, wrap: hessian(lambda u: _inner_grad(kind, wrap, u, _XS[0]).sin().sum())(_W),
}


def _eager(kind, wrap):
    u = _W.clone().requires_grad_()
    _inner_grad(kind, wrap, u, _XS[0]).sin().sum().backward()
    return u.grad


@pytest.mark.parametrize("kind", ["times", "as_is", "view", "both"])
@pytest.mark.parametrize("composition", list(_COMPOSITIONS))
def test_closed_over_tensor_that_is_also_the_argument_one_level_down(composition, kind):
    want = _COMPOSITIONS[composition](kind, ident)
    got = _COMPOSITIONS[composition](kind, remat)
    assert_tree_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("composition", ["jvp", "jacfwd", "jacrev", "grad", "hessian"])
@pytest.mark.parametrize("depth", [2, 3])
def test_nested_regions_closing_over_the_argument(composition, depth):
    """Regions nested in each other, each closing over ``u``, the outermost's argument ``u`` wrapped by the
    inner ``grad``: the view that keeps the two apart doubled the gradient under forward mode (0.51 off, its
    tangent 2.72), where it is not made now (a hostile pass); under reverse mode it makes them exact (2.80
    off without it)."""
    u0 = torch.tensor([0.3, -0.8, 1.2], dtype=D)

    def inner_grad(wrap, u):
        def level(k, a):
            return (a * u).sin() if k == 0 else wrap(lambda b: level(k - 1, b))(a) * u.cos()

        return grad(lambda w: (wrap(lambda a: level(depth - 1, a))(w) * u).sum())(u)

    runs = {
        "jvp": lambda wrap: jvp(lambda u: inner_grad(wrap, u), (u0,), (torch.ones_like(u0),)),
        "jacfwd": lambda wrap: jacfwd(lambda u: inner_grad(wrap, u))(u0),
        "jacrev": lambda wrap: jacrev(lambda u: inner_grad(wrap, u))(u0),
        "grad": lambda wrap: grad(lambda u: inner_grad(wrap, u).sin().sum())(u0),
        "hessian": lambda wrap: hessian(lambda u: inner_grad(wrap, u).sin().sum())(u0),
    }
    assert_tree_close(runs[composition](remat), runs[composition](ident), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("composition", ["grad", "jacrev", "eager", "hessian"])
def test_one_tensor_given_as_two_arguments_one_wrapped_by_the_inner_grad(composition):
    """``grad(g)(u, u)``: the inner grad wraps the first argument only, so the region gets two objects over
    one tensor, which the tape read as one (the second differentiated as the first: up to 8.0 off, at
    4eca1f6 too; a hostile pass).  The later one reaches the Function as a view of itself."""
    u0 = torch.tensor([0.3, -0.7, 1.1], dtype=D)

    def inner(wrap, u):
        return grad(wrap(lambda v, k: ((v * k).sin() * k).sum()))(u, u)

    def run(wrap):
        if composition == "grad":
            return grad(lambda u: inner(wrap, u).pow(2).sum())(u0)
        if composition == "jacrev":
            return jacrev(lambda u: inner(wrap, u))(u0)
        if composition == "hessian":
            return hessian(lambda u: inner(wrap, u).pow(2).sum())(u0)
        u = u0.clone().requires_grad_()
        inner(wrap, u).pow(2).sum().backward()
        return u.grad

    assert_tree_close(run(remat), run(ident), rtol=1e-10, atol=1e-10)
